"""Segment-recurrent training and prefix sharing (rl/train/segments.py) against whole-sequence training, in float64:
the loss and every parameter gradient of a step are the same whether a sequence runs whole, in segments (lengths not
multiples of the segment, loss masks that skip whole segments), or as a shared prompt branched to its group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3rl.rl.train import router_balance
from k3rl.rl.train.advantages import compute_advantages
from k3rl.rl.train.batching import to_train_sequence
from k3rl.rl.train.learner import Learner, LearnerConfig
from k3rl.rollout.trajectory import TrajectoryBuilder
from tests.model.k3_factory import make_config, make_model

V = 97


def _k3(tmp_path_factory, mode: str):
    """A tiny K3 (KDA, KDA, KDA, MLA; MoE from layer 2; AttnRes blocks of 2) in float64, MLA in NoPE or RoPE mode."""
    config = make_config(num_hidden_layers=4, kda_layers=(1, 2, 3), mla_use_nope=mode == "nope")
    model = make_model(config, seed=3)
    path = tmp_path_factory.mktemp(f"seg-k3-{mode}")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=["nope", "rope"])
def k3_path(request, tmp_path_factory):
    return _k3(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def k3_nope(tmp_path_factory):
    return _k3(tmp_path_factory, "nope")


def trajectory(rng, prompt, response_len, group, reward, gap=None, routed=False):
    """prompt (loss 0) + sampled turn + optional tool output (loss 0) + sampled turn; random behaviour logprobs."""
    b = TrajectoryBuilder(list(prompt))
    first = response_len if gap is None else response_len // 2
    route = (lambda n: rng.integers(0, 4, size=(n, 3, 2))) if routed else (lambda n: None)
    b.append_sampled(rng.integers(1, V, first).tolist(), (-rng.random(first)).tolist(), 0, route(first))
    if gap is not None:
        b.append_context(rng.integers(1, V, gap).tolist())
        rest = response_len - first
        b.append_sampled(rng.integers(1, V, rest).tolist(), (-rng.random(rest)).tolist(), 0, route(rest))
    return b.finish(reward=reward, group_id=group, task_id=group)


def batch(seed=0, routed=False):
    """Two groups: 3 samples of a 70-token prompt (one with a 45-token tool output, so a whole 32-token segment has no
    loss row), and 2 samples of a 9-token prompt."""
    rng = np.random.default_rng(seed)
    p1, p2 = rng.integers(1, V, 70), rng.integers(1, V, 9)
    return [trajectory(rng, p1, 37, "a", 1.0, routed=routed), trajectory(rng, p1, 50, "a", 0.0, gap=45, routed=routed),
            trajectory(rng, p1, 21, "a", 0.5, routed=routed),
            trajectory(rng, p2, 30, "b", 1.0, routed=routed), trajectory(rng, p2, 11, "b", 0.0, routed=routed)]


def make_learner(path, **kw) -> Learner:
    """A float64 learner; the gate and conv parameters, which loading keeps in float32, made float64 too."""
    out = Learner(LearnerConfig(model_path=str(path), dtype="float64", micro_batch_tokens=400, **kw))
    out.model.double()
    return out


def step_grads(learner: Learner, trajectories, segment_tokens, share_prefix):
    """Summed loss and every parameter's gradient of one step's forward/backward (no optimizer step)."""
    learner.cfg.segment_tokens = segment_tokens
    adv = compute_advantages(learner.algo, trajectories)
    seqs = [to_train_sequence(t, a, learner._media) for t, a in zip(trajectories, adv)]
    n_tokens, n_seqs = float(sum(int(s.mask.sum()) for s in seqs)), float(len(seqs))
    learner.model.zero_grad(set_to_none=True)
    router_balance.clear_stats(learner.model)
    loss = 0.0
    units = learner._units(seqs, share_prefix)
    for unit in units:
        loss += float(learner._micro_batch(unit, n_tokens, n_seqs)[0])
    grads = {n: p.grad.detach().clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    tokens = [int(r._tokens) for r in learner._routers]
    return loss, grads, units, tokens


def assert_same(a, b, rtol=1e-9):
    (la, ga, *_), (lb, gb, *_) = a, b
    assert la == pytest.approx(lb, rel=rtol, abs=1e-12)
    assert ga.keys() == gb.keys() and len(ga) > 20
    for name in ga:
        assert ga[name].dtype == torch.float64, name
        scale = max(float(ga[name].abs().max()), 1e-6)
        torch.testing.assert_close(ga[name], gb[name], rtol=0, atol=rtol * scale, msg=name)


def test_segmented_equals_whole(k3_path):
    _segmented_equals_whole(k3_path, "grpo")


def test_segmented_equals_whole_sequence_level_objective(k3_nope):
    _segmented_equals_whole(k3_nope, "gspo")


def _segmented_equals_whole(k3_path, algo):
    learner = make_learner(k3_path, algo=algo)
    trajectories = batch()
    whole = step_grads(learner, trajectories, None, share_prefix=False)
    assert all(u.tree is None for u in whole[2]) and max(u.length for u in whole[2]) > 100
    for seg in (32, 23):  # 23: no length is a multiple of it
        segmented = step_grads(learner, trajectories, seg, share_prefix=False)
        assert_same(segmented, whole)
        assert segmented[3] == whole[3]  # every token counted once by the routers (the first pass is not counted)


def test_segmented_loss_mask_skips_whole_segments(k3_nope):
    learner = make_learner(k3_nope)
    (t,) = [batch()[1]]
    mask = t.loss_mask[1:]
    runs = np.flatnonzero(np.diff(np.r_[0, mask, 0]))
    assert (runs[2] - runs[1]) >= 2 * 16  # the tool output covers at least one whole 16-token segment
    assert_same(step_grads(learner, [t, batch()[0]], 16, False), step_grads(learner, [t, batch()[0]], None, False))


def test_prefix_sharing_equals_separate(k3_path):
    learner = make_learner(k3_path)
    trajectories = batch(routed=True)
    separate = step_grads(learner, trajectories, None, share_prefix=False)
    shared = step_grads(learner, trajectories, None, share_prefix=True)
    # the 9-token prompt is too short; the 70th prompt position predicts each member's first sampled token
    assert [u.prefix_len for u in shared[2] if u.tree is not None] == [70]
    assert_same(shared, separate)
    for seg in (16, 25):  # the prefix in several segments, the branch inside the member part
        assert_same(step_grads(learner, trajectories, seg, share_prefix=True), separate)


def test_prefix_sharing_counts_prompt_once(k3_nope):
    learner = make_learner(k3_nope)
    trajectories = batch()
    separate = step_grads(learner, trajectories, None, share_prefix=False)[3]
    shared = step_grads(learner, trajectories, None, share_prefix=True)[3]
    assert [s - h for s, h in zip(separate, shared)] == [2 * 70] * len(shared)


def test_segment_tokens_validated(k3_nope):
    with pytest.raises(ValueError, match="segment_tokens"):
        LearnerConfig(model_path=str(k3_nope), segment_tokens=0)


def test_segmented_with_blocked_attention(k3_nope, monkeypatch):
    """Segments over a long past take MLA's blocked path, each query block recomputed in backward (model/mla.py)."""
    from k3rl.model import mla

    calls = []
    monkeypatch.setattr(mla, "SCORE_BUDGET", 2000)  # 1–8 queries per block
    real = mla.MultiheadLatentAttention._attend_block
    monkeypatch.setattr(mla.MultiheadLatentAttention, "_attend_block",
                        lambda self, *a: calls.append(torch.is_grad_enabled()) or real(self, *a))
    learner = make_learner(k3_nope)
    trajectories = batch()[:2]
    segmented = step_grads(learner, trajectories, 24, False)
    assert True in calls and False in calls  # under grad (recomputed in backward) and in the first pass
    assert_same(segmented, step_grads(learner, trajectories, None, False))


def test_prefix_sharing_equals_separate_hf(tiny_qwen3_dir):
    """Any HF causal LM shares a group's prompt through its KV cache (model/policy.py `tree_hidden`)."""
    learner = make_learner(tiny_qwen3_dir)
    trajectories = batch()
    shared = step_grads(learner, trajectories, None, share_prefix=True)
    assert [u.prefix_len for u in shared[2] if u.tree is not None] == [70]
    # 1e-6: Qwen3's RMSNorm and RoPE compute in float32 even in a float64 model (a wrong branch is off by O(1))
    assert_same(shared, step_grads(learner, trajectories, None, share_prefix=False), rtol=1e-6)
