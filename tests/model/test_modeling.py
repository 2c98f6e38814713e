"""Whole-model tests of K3ForCausalLM: prefill-then-decode equals one full pass (float64, several
shapes, both gate forms, NoPE and RoPE), left padding equals unpadded rows, cache snapshot /
restore / select, logits_to_keep, routing replay, gradients to every parameter, bf16, named errors."""

from __future__ import annotations

import pytest
import torch
from k3_factory import make_model

from k3rl.model.cache import K3Cache

# float64 everywhere except the KDA decay gate, which kernels/kda/gate.py always computes in fp32:
# one fp32 rounding of g bounds the agreement of two float64 paths at ~1e-8.
ATOL = 1e-7


def decode_all(model, ids, prefill: int, chunk: int = 1):
    """Logits of `ids` [B, T]: prefill `prefill` tokens with a fresh cache, then steps of `chunk` tokens."""
    out = model(ids[:, :prefill], use_cache=True)
    logits, cache = [out.logits], out.cache
    for t in range(prefill, ids.shape[1], chunk):
        logits.append(model(ids[:, t:t + chunk], cache=cache).logits)
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("B,T,prefill,chunk,kw", [
    (2, 37, 30, 1, {}),
    (1, 70, 5, 1, {"linear_attn_config": {"gate_lower_bound": None}}),
    (3, 81, 66, 1, {"mla_use_nope": False, "rope_theta": 500.0}),
    (2, 23, 1, 1, {"attn_res_block_size": None, "linear_attn_config": {"use_full_rank_gate": False},
                   "q_lora_rank": None}),
    (2, 150, 64, 43, {"num_hidden_layers": 5, "kda_layers": (1, 3, 4), "attn_res_block_size": 3}),
])
def test_prefill_then_decode_equals_full_sequence(B, T, prefill, chunk, kw):
    model = make_model(**kw)
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    with torch.no_grad():
        full = model(ids).logits
        stepped, cache = decode_all(model, ids, prefill, chunk)
    assert cache.seq_len == T
    torch.testing.assert_close(stepped, full, atol=ATOL, rtol=0)


def test_left_padding_equals_unpadded_rows():
    model = make_model(mla_use_nope=False)
    lengths = [9, 14, 5]
    rows = [torch.randint(3, 97, (n,)) for n in lengths]
    T = max(lengths)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):], mask[i, T - len(r):] = r, 1
    nxt = torch.randint(3, 97, (len(rows), 3))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        steps = [model(nxt[:, j:j + 1], cache=out.cache).logits for j in range(3)]
        for i, r in enumerate(rows):
            alone = model(torch.cat([r, nxt[i]])[None]).logits[0]
            torch.testing.assert_close(out.logits[i, T - len(r):], alone[:len(r)], atol=ATOL, rtol=0)
            torch.testing.assert_close(torch.cat(steps, 1)[i], alone[len(r):], atol=ATOL, rtol=0)


def test_cache_snapshot_restore_select_and_bytes():
    model = make_model()
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        cache = model(ids[:, :12], use_cache=True).cache
        snap = cache.snapshot()
        assert snap.capacity == 12 and cache.nbytes() == K3Cache.layout_bytes(model.config, 2, cache.capacity, torch.float64)
        first = model(ids[:, 12:16], cache=cache).logits
        model(ids[:, 16:20], cache=cache)
        cache.restore(snap)
        assert cache.seq_len == 12
        torch.testing.assert_close(model(ids[:, 12:16], cache=cache).logits, first, atol=0, rtol=0)
        forked = snap.select([1, 1, 0])
        out = model(ids[[1, 1, 0], 12:13], cache=forked).logits
        torch.testing.assert_close(out, model(ids[[1, 1, 0], :13]).logits[:, -1:], atol=ATOL, rtol=0)
        grown = model.new_cache(2, capacity=4)
        model(ids[:, :10], cache=grown)
        assert grown.capacity >= 10 and grown.seq_len == 10


def test_logits_to_keep_and_hidden_states():
    model = make_model()
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        full = model(ids).logits
        torch.testing.assert_close(model(ids, logits_to_keep=3).logits, full[:, -3:])
        idx = torch.tensor([0, 4, 10])
        torch.testing.assert_close(model(ids, logits_to_keep=idx).logits, full[:, idx])
        mask = torch.rand(2, 11) > 0.5
        torch.testing.assert_close(model(ids, logits_to_keep=mask).logits, full[mask])
        h = model(ids, return_hidden_states=True).hidden_states
        torch.testing.assert_close(model.lm_head(model.model.norm(h)), full)


def test_loss_is_shifted_cross_entropy():
    model = make_model()
    ids = torch.randint(0, 97, (2, 9))
    labels = ids.clone()
    labels[0, :4] = -100
    out = model(ids, labels=labels)
    logp = out.logits[:, :-1].log_softmax(-1)
    tgt = labels[:, 1:]
    keep = tgt != -100
    expected = -logp[keep].gather(-1, tgt[keep][:, None]).mean()
    torch.testing.assert_close(out.loss, expected)


def test_routing_replay_reproduces_logits_and_changes_them_when_altered():
    model = make_model()
    ids = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        ref = model(ids).logits
        routed = model.last_routed_expert_ids()
        n_moe = sum(layer.is_moe for layer in model.model.layers)
        assert routed.shape == (2, 13, n_moe, 2)
        torch.testing.assert_close(model(ids, routed_expert_ids=routed).logits, ref, atol=0, rtol=0)
        other = (routed + 1) % model.config.num_experts
        assert not torch.allclose(model(ids, routed_expert_ids=other).logits, ref)


@pytest.mark.parametrize("kw", [
    dict(mla_use_nope=False, routed_expert_hidden_size=16, latent_moe_use_norm=True),
    dict(linear_attn_config={"use_full_rank_gate": False, "gate_lower_bound": None}, q_lora_rank=None),
])
def test_gradients_reach_every_parameter_but_the_routing_bias(kw):
    model = make_model(dtype=torch.float32, media_placeholder_token_id=5, image_patch_size=2, **kw).train()
    ids = torch.randint(6, 97, (2, 19))
    ids[1, 2:4] = 5
    out = model(ids, pixel_values=torch.randn(1, 3, 2, 4), labels=ids)
    out.loss.backward()
    # Layer 0's mixer AttnRes mixes a single source (the embedding): no effect, hence no gradient (spec §4.2).
    inert = {"model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}
    for name, p in model.named_parameters():
        if name in inert:
            assert p.grad is None or not p.grad.any(), name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reaches {name}"
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and all(not b.requires_grad and b.grad is None for b in biases)


def test_a_few_adamw_steps_fit_one_batch():
    model = make_model(dtype=torch.float32).train()
    ids = torch.randint(0, 97, (4, 24))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(10):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0], losses


def test_gradient_checkpointing_gives_the_same_gradients():
    model = make_model(dtype=torch.float64).train()
    ids = torch.randint(0, 97, (2, 17))
    model(ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(ids, labels=ids).loss.backward()
    for n, g in ref.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("cached", [False, True], ids=["whole", "through_a_cache"])
def test_recompute_gives_the_same_gradients_and_runs_the_parts_again(mode, cached):
    """`set_recompute`: the same loss and gradients in float64, whole sequences and a second chunk through a cache
    (segment-recurrent training's form, whose KDA mixers recompute from the state they started from); each KDA
    mixer and MoE block runs again in backward (`full` without a cache: the whole layer)."""
    from k3rl.model.kda import KimiDeltaAttention

    torch.manual_seed(0)
    model = make_model(dtype=torch.float64, num_hidden_layers=4).train()
    ids = torch.randint(0, 97, (2, 21))
    parts = [m for layer in model.model.layers for m in (layer.self_attn, getattr(layer, "block_sparse_moe", None))
             if isinstance(m, KimiDeltaAttention) or (m is not None and m is getattr(layer, "block_sparse_moe", None))]
    assert any(isinstance(m, KimiDeltaAttention) for m in parts) and len(parts) > 2
    calls = [0]
    for m in parts:
        m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))  # (recompute can stop early)

    def loss_and_grads():
        model.zero_grad()
        calls[0] = 0
        if cached:  # the first 9 tokens fill the cache without grad, then 12 train through it, state grads too
            with torch.no_grad():
                cache = model(ids[:, :9], use_cache=True).cache
            for i in cache.recurrent:
                cache.recurrent[i] = cache.recurrent[i].clone().requires_grad_(True)
            start = dict(cache.recurrent)
            out = model(ids[:, 9:], cache=cache, labels=ids[:, 9:])
            end = sum((cache.recurrent[i] ** 2).sum() for i in cache.recurrent)  # the next segment's pull
            (out.loss + 1e-3 * end).backward()
            grads = {f"state{i}": s.grad.clone() for i, s in start.items()}
        else:
            out = model(ids, labels=ids)
            out.loss.backward()
            grads = {}
        grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return out.loss.item(), grads, calls[0]

    loss0, ref, plain_calls = loss_and_grads()
    model.model.set_recompute(mode)
    loss1, got, recompute_calls = loss_and_grads()
    assert loss1 == pytest.approx(loss0, rel=1e-12)
    assert set(got) == set(ref)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, atol=1e-12, rtol=1e-9, msg=n)
    assert recompute_calls == plain_calls + len(parts)  # every part once more, in backward
    model.model.set_recompute("none")
    assert loss_and_grads()[2] == plain_calls
    with pytest.raises(ValueError, match="recompute: 'some'"):
        model.model.set_recompute("some")


def test_bf16_forward_is_finite_and_keeps_fp32_parameters():
    model = make_model(dtype=torch.float32, num_hidden_layers=4).to(torch.bfloat16)
    kda = model.model.layers[0].self_attn
    assert kda.A_log.dtype == kda.dt_bias.dtype == kda.q_conv1d.weight.dtype == torch.float32
    assert kda.q_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.dtype == torch.float32
    ids = torch.randint(0, 97, (2, 100))
    with torch.no_grad():
        out = model(ids[:, :90], use_cache=True)
        step = model(ids[:, 90:91], cache=out.cache)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all() and torch.isfinite(step.logits).all()
    assert out.cache.recurrent[0].dtype == torch.float32 and out.cache.latent[3].dtype == torch.bfloat16


@pytest.mark.parametrize("call,match", [
    (lambda m, ids: m(ids[0]), "input_ids"),
    (lambda m, ids: m(ids, labels=ids, logits_to_keep=1), "labels"),
    (lambda m, ids: m(ids, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1], [1] * 6])), "attention_mask"),
    (lambda m, ids: m(ids, cache=m.new_cache(3)), "cache"),
    (lambda m, ids: m(torch.zeros(1, 5000, dtype=torch.long)), "max_position_embeddings"),
    (lambda m, ids: m(ids, pixel_values=torch.zeros(1, 3, 14, 14)), "pixel_values"),
    (lambda m, ids: m(ids, logits_to_keep=torch.ones(2, 5, dtype=torch.bool)), "logits_to_keep"),
    (lambda m, ids: m.new_cache(2).select([2]), "index"),
])
def test_bad_inputs_raise_named_errors(call, match):
    model = make_model()
    with pytest.raises(ValueError, match=match):
        call(model, torch.randint(0, 97, (2, 6)))


def test_padding_only_in_the_first_step():
    model = make_model()
    cache = model(torch.randint(0, 97, (2, 4)), use_cache=True).cache
    with pytest.raises(ValueError, match="attention_mask: padding is only allowed"):
        model(torch.randint(0, 97, (2, 2)), cache=cache, attention_mask=torch.tensor([[0, 1], [1, 1]]))
