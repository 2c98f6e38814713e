"""model/policy.py: the policy adapter gives exactly what the code it replaced computed, for K3 and a HF model.

The replaced code is written out here (the direct calls the learner, SFT and the engine made before
the adapter): hidden states must be bit-identical, log-probs equal a float64 log-softmax, and
cached decoding equals the uncached forward.
"""

from __future__ import annotations

import json

import pytest
import torch
from k3_factory import make_model

from k3rl.model.logprobs import naive_selected_logprobs
from k3rl.model.policy import Policy, load_policy


def old_hidden(model, ids, rows, mask=None):
    """What rl/train/learner.py computed before the adapter."""
    if "return_hidden_states" in type(model).forward.__code__.co_varnames:
        out = model(ids, routed_expert_ids=None, return_hidden_states=True, logits_to_keep=1)
        return model.model.norm(out.hidden_states[rows])
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return out.hidden_states[-1][rows]


@pytest.fixture(params=["k3", "qwen3"])
def policy(request, tiny_qwen3_dir):
    if request.param == "k3":
        return Policy(make_model(dtype=torch.float32, num_hidden_layers=4, kda_layers=(1, 2, 3),
                                 linear_attn_config={"full_attn_layers": [4]}))
    return load_policy(tiny_qwen3_dir)


def test_is_k3_is_answered_by_type(policy):
    assert policy.is_k3 == (type(policy.model).__name__ == "K3ForCausalLM")


def test_one_class_per_family_with_its_capabilities(policy, tmp_path):
    """`Policy(model)` and `load_policy` give the family's class; the learner asks its flags, not its type; each
    family writes and reads its own checkpoint format (internal names both ways)."""
    from k3rl.model.policy import HFPolicy, K3Policy

    k3 = policy.is_k3
    assert type(policy) is (K3Policy if k3 else HFPolicy) and type(Policy(policy.model)) is type(policy)
    assert (policy.segments, policy.routing_replay, policy.shardable, policy.resumable) == (k3,) * 4
    assert policy.can_share_prefix("none") and policy.can_share_prefix("full") == k3
    with pytest.raises(ValueError, match="recompute: 'some'"):
        policy.set_recompute("some")
    if not k3:  # only a K3 has parts to recompute apart
        with pytest.raises(ValueError, match="recompute=selective: .* is not a K3 model"):
            policy.set_recompute("selective")
    if k3:
        policy.model.config.mla_use_nope = False
        policy.set_rope_theta(640000.0)
        assert policy.model.config.rope_theta == 640000.0
        with pytest.raises(ValueError, match="must be > 1"):
            policy.set_rope_theta(1.0)
    else:
        with pytest.raises(ValueError, match="rope_theta: the model .* has no RoPE layers"):
            policy.set_rope_theta(640000.0)
    policy.save(tmp_path)
    state = policy.model.state_dict()
    read = policy.read_weights(tmp_path)
    assert set(read) <= set(state) and all(torch.equal(read[n], state[n]) for n in read)


def test_final_hidden_and_logprobs_equal_the_replaced_code(policy):
    torch.manual_seed(0)
    vocab = policy.model.config.vocab_size
    ids = torch.randint(3, vocab, (3, 21))
    rows = torch.rand(3, 21) < 0.4
    mask = torch.ones_like(ids)
    with torch.no_grad():
        new = policy.final_hidden(ids, attention_mask=mask, rows=rows)
        old = old_hidden(policy.model, ids, rows, mask)
        assert torch.equal(new, old)
        full = policy.final_hidden(ids, attention_mask=mask)
        assert full.shape == (3, 21, policy.model.config.hidden_size)
        targets = torch.randint(0, vocab, (int(rows.sum()),))
        logp = policy.selected_logprobs(new, targets, chunk_size=5)
        weight, scale = policy.head()
        ref, _ = naive_selected_logprobs(new.double(), weight.double(), targets, scale)
        assert torch.allclose(logp.double(), ref, atol=1e-5)
        # and against the model's own logits
        logits = policy.model(ids).logits.double()[rows]
        assert torch.allclose(logp.double(), torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0],
                              atol=1e-4)


def test_cached_decoding_equals_the_full_forward(policy):
    torch.manual_seed(1)
    vocab = policy.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,)) for n in (5, 9)]
    T = 9
    ids = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = p, 1
    new = torch.randint(3, vocab, (2, 3))
    with torch.no_grad():
        logits, state = policy.prefill(ids, mask, capacity=T + 3)
        steps = [logits]
        for j in range(2):
            logits, state = policy.decode(new[:, j], state)
            steps.append(logits)
        state = policy.select(state, torch.tensor([1]))  # keep the longer prompt only
        last, _ = policy.decode(new[1:, 2], state)
        for b, p in enumerate(prompts):
            full = policy.model(torch.cat([p, new[b]])[None]).logits[0]
            for j in range(3):
                assert torch.allclose(steps[j][b], full[len(p) - 1 + j], atol=1e-4), (b, j)
        full1 = policy.model(torch.cat([prompts[1], new[1]])[None]).logits[0]
        assert torch.allclose(last[0], full1[len(prompts[1]) + 2], atol=1e-4)


def test_load_policy_switches_dropout_off_and_names_a_missing_model(tmp_path, tiny_qwen3_dir):
    import shutil

    d = tmp_path / "drop"
    shutil.copytree(tiny_qwen3_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["attention_dropout"] = 0.3
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_policy(d).model.config.attention_dropout == 0.0
    assert load_policy(d, dropout=True).model.config.attention_dropout == 0.3
    with pytest.raises(FileNotFoundError, match="config.json missing"):
        load_policy(tmp_path / "nothing")
