"""Segmented prefill (model/policy.py `Policy.prefill(segment_tokens=…)`) and MLA's blocked attention
(model/mla.py `_attend_blocked`): the same logits and decode state as a one-piece prefill, in float64, with
left padding longer than a segment, segment lengths that do not divide the prompt, query blocks that do not
divide the segment, and both MLA position modes."""

from __future__ import annotations

import pytest
import torch
from k3_factory import make_config, make_model

import k3rl.model.mla as mla
from k3rl.model.cache import K3Cache, make_step
from k3rl.model.mla import MultiheadLatentAttention
from k3rl.model.policy import Policy


def _padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = p, 1
    return ids, mask


@pytest.mark.parametrize("nope", [True, False])
def test_blocked_attention_equals_expanded(monkeypatch, nope):
    """A cached multi-token step over a padded cache: blocked (tiny score budget: 1–3 queries per block)
    equals the expanded SDPA path."""
    cfg = make_config(kda_layers=(), mla_use_nope=nope, rope_theta=300.0)
    torch.manual_seed(3)
    layer = MultiheadLatentAttention(cfg, 0).double()
    x = torch.randn(2, 23, cfg.hidden_size, dtype=torch.float64)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0  # row 1 is left-padded by 4
    outs = {}
    for budget in (1 << 30, 2 * 2 * 17, 1):  # expanded; a few rows per block; one row per block
        monkeypatch.setattr(mla, "SCORE_BUDGET", budget)
        cache = K3Cache.create(cfg, 2, capacity=23, dtype=torch.float64)
        with torch.no_grad():
            first = layer(x[:, :10], make_step((2, 10), "cpu", cache, mask, 10**6))
            cache.commit(10)
            second = layer(x[:, 10:], make_step((2, 13), "cpu", cache, None, 10**6))
        outs[budget] = torch.cat([first, second], 1)
    ref = outs[1 << 30]
    for budget, out in outs.items():
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10, msg=f"budget {budget}")


@pytest.mark.parametrize("segment", [1, 5, 16, 64])
def test_segmented_prefill_equals_one_piece_k3(monkeypatch, segment):
    """The whole hybrid (KDA + MLA, AttnRes, MoE): logits after the prompt and after 3 decode steps."""
    monkeypatch.setattr(mla, "SCORE_BUDGET", 40)  # force the blocked path for every cached multi-token step
    model = make_model(make_config(num_hidden_layers=4, kda_layers=(1, 2, 4)), seed=1)
    policy = Policy(model)
    torch.manual_seed(2)
    prompts = [torch.randint(3, 97, (n,)) for n in (37, 12, 29)]  # row 1: 25 columns of padding
    ids, mask = _padded(prompts)
    new = torch.randint(3, 97, (3, 3))
    results = []
    with torch.no_grad():
        for seg in (None, segment):
            logits, state = policy.prefill(ids, mask, capacity=40, segment_tokens=seg)
            steps = [logits]
            for j in range(3):
                logits, state = policy.decode(new[:, j], state)
                steps.append(logits)
            results.append((torch.stack(steps), state["cache"]))
    (ref, ref_cache), (got, got_cache) = results
    torch.testing.assert_close(got, ref, atol=1e-8, rtol=1e-7)  # float64; float32 would be ~1e-4
    for i in ref_cache.recurrent:
        torch.testing.assert_close(got_cache.recurrent[i], ref_cache.recurrent[i], atol=1e-8, rtol=1e-7)
        torch.testing.assert_close(got_cache.conv[i], ref_cache.conv[i], atol=1e-8, rtol=1e-7)
    for i in ref_cache.latent:
        n = ref_cache.seq_len
        torch.testing.assert_close(got_cache.latent[i][:, :n], ref_cache.latent[i][:, :n], atol=1e-8, rtol=1e-7)
    # and the full forward of each sequence alone (no padding, no cache)
    for b, p in enumerate(prompts):
        full = model(torch.cat([p, new[b]])[None]).logits[0]
        for j in range(4):
            torch.testing.assert_close(got[j, b], full[len(p) - 1 + j], atol=1e-9, rtol=1e-8)


def test_segmented_prefill_equals_one_piece_hf(tiny_qwen3_dir):
    """Any HF causal LM: its own KV cache, explicit positions, left padding across segments."""
    from k3rl.model.policy import load_policy

    policy = load_policy(tiny_qwen3_dir, dtype=torch.float64)
    torch.manual_seed(4)
    vocab = policy.model.config.vocab_size
    ids, mask = _padded([torch.randint(3, vocab, (n,)) for n in (30, 7)])
    new = torch.randint(3, vocab, (2,))
    with torch.no_grad():
        outs = []
        for seg in (None, 6):
            logits, state = policy.prefill(ids, mask, capacity=32, segment_tokens=seg)
            after, _ = policy.decode(new, state)
            outs.append(torch.stack([logits, after]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-9, rtol=1e-8)


def test_torch_engine_prefills_in_segments(monkeypatch):
    """The native engine's greedy tokens and logprobs do not depend on its prefill segment."""
    from types import SimpleNamespace

    from k3rl.rollout.engine import SamplingParams
    from k3rl.rollout.torch_engine import TorchEngine

    model = make_model(make_config(num_hidden_layers=4, kda_layers=(1, 2, 4)), seed=5)
    tok = SimpleNamespace(eos_token_id=2, pad_token_id=0)  # no stop strings: the engine never decodes
    prompts = [[3 + i % 90 for i in range(n)] for n in (45, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    got = [TorchEngine(model, tok, prefill_tokens=seg).generate(prompts, params) for seg in (4096, 8)]
    for a, b in zip(*got):
        assert a[0].token_ids == b[0].token_ids
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-9)
    with pytest.raises(ValueError, match="prefill_tokens"):
        TorchEngine(model, tok, prefill_tokens=0)
