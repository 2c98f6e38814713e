"""The long path on the long-context recipe's own trajectory shapes, in float64: segments (rl/train/segments.py),
prefix-tree training, the engine's state reuse across turns and segmented prefill (rollout/torch_engine.py), and
trajectories whose turns two policy versions sampled (partial rollouts), against the plain path.

The model is the recipe's: configs/rl/quickstart.yaml's tiny K3 (3 KDA + 1 gated MLA, hidden 128, MoE, vocabulary
4096), random, in NoPE and in RoPE mode. The trajectories are the needle task's in context, shortened: groups of 4
samples sharing a 300–400-token prompt, one or two turns (a reply, a tool reply, a reply), loss on the model's own
tokens, recorded routing, the second turn sampled under a newer version. With `segment_tokens` 128 one group's prompt
ends exactly on a segment boundary, the other's does not, and the suffix segments cut inside a reply, inside a tool
reply and exactly where a tool reply ends; MLA attends expanded or, as over the recipe's long caches, block by
block. The last test runs the real rollout worker on the needle task with partial rollouts across a weight update.
tests/rl/test_segments.py checks the mechanisms on short random sequences; tests/rollout/test_state_reuse.py checks
state reuse against full prefills (engine against engine).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from k3rl.model import mla
from k3rl.model.policy import load_policy
from k3rl.rl.config.loader import load_model_config
from k3rl.rl.train.learner import Learner, LearnerConfig
from k3rl.rollout.engine import SamplingParams
from k3rl.rollout.torch_engine import TorchEngine
from k3rl.rollout.trajectory import TrajectoryBuilder
from tests.model.k3_factory import make_model

ROOT = Path(__file__).parents[2]
SEG = 128
V = 4096


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _recipe_dir(tmp_path_factory, mode: str) -> Path:
    """The recipe's tiny K3 (configs/rl/quickstart.yaml), random, float64, saved."""
    config = load_model_config(ROOT / "configs/rl/quickstart.yaml", [f"mla_use_nope={mode == 'nope'}"])
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (V, 128, 4)
    model = make_model(config, seed=7)
    path = tmp_path_factory.mktemp(f"long-path-{mode}")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=["nope", "rope"])
def recipe_dir(request, tmp_path_factory):
    return _recipe_dir(tmp_path_factory, request.param)


@pytest.fixture(params=["expanded", "blocked"])
def attention(request, monkeypatch):
    """MLA's path for a cached multi-token step (model/mla.py): the recipe's segments of thousands of tokens over a
    long cache attend block by block; these short ones do too with a small score budget (2–6 queries per block).
    (One-token decode steps always take the blocked matmul form; they are not counted.)"""
    if request.param == "blocked":
        monkeypatch.setattr(mla, "SCORE_BUDGET", 40_000)
    queries = []
    real = mla.MultiheadLatentAttention._attend_blocked
    monkeypatch.setattr(mla.MultiheadLatentAttention, "_attend_blocked",
                        lambda self, q_nope, *a: queries.append(q_nope.shape[1]) or real(self, q_nope, *a))
    yield request.param
    assert any(t > 1 for t in queries) == (request.param == "blocked")


@pytest.fixture(scope="module")
def nope_dir(tmp_path_factory):
    return _recipe_dir(tmp_path_factory, "nope")


def make_learner(path, segment_tokens, share_prefix, micro_batch_tokens=2048, **algo_args) -> Learner:
    """A float64 GRPO learner without gradient clipping (the gradients are compared before the optimizer step)."""
    return Learner(LearnerConfig(model_path=str(path), dtype="float64", micro_batch_tokens=micro_batch_tokens,
                                 segment_tokens=segment_tokens, share_prefix=share_prefix, max_grad_norm=0.0,
                                 algo="grpo", algo_args=algo_args))


def train_step(learner: Learner, trajectories) -> dict:
    """`Learner.train_step` on `trajectories`, recording what the objective saw: per trajectory, log π and log π_ref
    of each trained token (float64, in order) and its behaviour log-prob; every parameter's gradient before the
    optimizer step; the units; the step's metrics."""
    units, inputs, grads = [], [], {}
    real_units, real_loss = learner._units, learner.algo.loss

    def recorded_units(seqs, share_prefix):
        units.extend(real_units(seqs, share_prefix))
        return units

    def recorded_loss(x):
        inputs.append(x)
        return real_loss(x)

    def recorded_grads(optimizer, args, kwargs):
        grads.update({n: p.grad.detach().clone() for n, p in learner.model.named_parameters() if p.grad is not None})

    learner._units, learner.algo.loss = recorded_units, recorded_loss
    hooks = [opt.register_step_pre_hook(recorded_grads) for opt in learner.optimizers]
    metrics = learner.train_step(trajectories)
    for hook in hooks:
        hook.remove()
    assert len(inputs) == len(units) and not metrics["skipped"], metrics
    which = {tuple(t.tokens[:-1].tolist()): i for i, t in enumerate(trajectories)}
    rows: dict[str, list] = {k: [None] * len(trajectories) for k in ("logprobs", "ref_logprobs", "behaviour_logprobs")}
    for unit, x in zip(units, inputs):
        mb = unit.mb
        for r in range(mb.num_seqs):
            tokens = mb.input_ids[r][mb.valid[r]]  # a tree unit's micro-batch holds its sequences whole
            i = which[tuple(tokens.tolist())]
            for key, out in rows.items():
                assert out[i] is None, "a trajectory trained twice"
                value = getattr(x, key)
                out[i] = None if value is None else value[x.seq_ids == r].detach().double().numpy()
    for key, out in rows.items():
        assert all(v is not None for v in out) or key == "ref_logprobs", key
    return dict(units=units, grads=grads, metrics=metrics, **rows)


def episode(rng, prompt, turns, group, reward, routing_shape, noise=(0.5, 0.3)):
    """A needle episode as the agent loop builds it (rollout/agent_loop.py): the prompt, then per turn a tool reply
    (from the second turn on, loss 0) and the model's reply (loss 1), sampled by version `turn`: behaviour
    log-probs around a uniform policy's (noise[turn] of spread: the older version is further off), the routing of
    each reply token as the engine records it (the last one never fed back: -1). `turns`: [(tool, reply), …]."""
    b = TrajectoryBuilder(list(prompt))
    L, k = routing_shape
    for turn, (tool, reply) in enumerate(turns):
        if tool:
            b.append_context(rng.integers(3, V, tool).tolist())
        routed = np.stack([rng.permutation(8)[:k * L].reshape(L, k) for _ in range(reply)])  # [reply, L, k]
        routed[-1] = -1
        behaviour = -math.log(V) + noise[turn] * rng.standard_normal(reply)
        b.append_sampled(rng.integers(3, V, reply).tolist(), behaviour.tolist(), turn, routed)
    return b.finish(reward=reward, group_id=group, task_id=group)


def recipe_batch(seed, routing_shape):
    """Two groups of 4 (a task each) as the recipe trains them, one or two turns each. Group `a`'s 385-token prompt
    puts its last position, the first loss row, at 384 = 3 × SEG: the prompt/response boundary is a segment
    boundary, whole and shared. Group `b`'s 301-token prompt does not. Suffix segments (after the shared prompt)
    cut at 128: inside a2's second reply, at a3's tool/reply boundary (its last tool position predicts the reply's
    first token), inside b2's tool reply; b1's one reply is a single token (its suffix: one position)."""
    rng = np.random.default_rng(seed)
    pa, pb = rng.integers(3, V, 385), rng.integers(3, V, 301)
    a = [((0, 40),), ((0, 64),), ((0, 48), (64, 40)), ((0, 20), (107, 33))]
    b = [((0, 64), (45, 12)), ((0, 1),), ((0, 60), (80, 64)), ((0, 30), (20, 30))]
    rewards = [1.0, 0.0, 0.0, 1.0]
    return ([episode(rng, pa, t, "a", r, routing_shape) for t, r in zip(a, rewards)]
            + [episode(rng, pb, t, "b", r, routing_shape) for t, r in zip(b, rewards[::-1])])


def assert_rows_close(got, ref, rtol=1e-9):
    for i, (x, y) in enumerate(zip(got, ref)):
        assert x.shape == y.shape, i
        np.testing.assert_allclose(x, y, rtol=rtol, atol=0, err_msg=f"trajectory {i}")


def assert_grads_close(got, ref, rtol=1e-9):
    assert got.keys() == ref.keys() and len(got) > 20
    for name in ref:
        assert got[name].dtype == torch.float64, name
        scale = max(float(ref[name].abs().max()), 1e-12)
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=rtol * scale, msg=name)


@pytest.fixture(scope="module")
def plain_step(recipe_dir):
    """The recipe batch and its plain step (each trajectory whole, nothing shared; no cache, so MLA attends
    expanded), shared by both attention paths of the long one."""
    plain = make_learner(recipe_dir, None, False, kl_coef=0.05)
    batch = recipe_batch(0, plain.routing_shape)
    return batch, train_step(plain, batch)


def test_long_path_equals_plain_on_recipe_trajectories(recipe_dir, plain_step, attention):
    """Segments + prefix sharing + routing replay + the KL reference (the recipe's `kl_coef`): log π and log π_ref
    of every model token, the loss, its metrics and every parameter's gradient equal the plain path's (each
    trajectory whole, nothing shared)."""
    batch, ref = plain_step
    got = train_step(make_learner(recipe_dir, SEG, True, kl_coef=0.05), batch)
    assert all(u.tree is None and u.length < 1000 for u in ref["units"])
    assert [(u.prefix_len, u.mb.num_seqs) for u in got["units"]] == [(385, 4), (300, 4)]
    assert max(u.length for u in got["units"]) > 3 * SEG
    n = [int(t.loss_mask[1:].sum()) for t in batch]
    assert [len(x) for x in ref["logprobs"]] == n
    assert_rows_close(got["logprobs"], ref["logprobs"])
    assert_rows_close(got["ref_logprobs"], ref["ref_logprobs"])
    assert_rows_close(got["behaviour_logprobs"], ref["behaviour_logprobs"], rtol=0)
    for key in ("loss", "kl_ref", "tis_weight", "tis_capped_frac", "mismatch_kl", "grad_norm", "num_loss_tokens"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-9, abs=1e-15), key
    assert 0 < ref["metrics"]["tis_capped_frac"] < 0.5  # the IS weights are not all 1 (nor all capped)
    assert_grads_close(got["grads"], ref["grads"])


def test_long_path_with_groups_split_across_micro_batches(recipe_dir, plain_step):
    """A token budget the groups do not fit in (micro_batch_tokens 700; a shared prompt longer than half of it counts
    as half): group `a` shares its prompt in a unit of 3 and its longest trains whole, likewise group `b`; still the
    plain path's numbers."""
    batch, ref = plain_step
    got = train_step(make_learner(recipe_dir, SEG, True, micro_batch_tokens=700, kl_coef=0.05), batch)
    assert [(u.prefix_len, u.mb.num_seqs) for u in got["units"]] == [(385, 3), (300, 3), (0, 1), (0, 1)]
    assert_rows_close(got["logprobs"], ref["logprobs"])
    assert_rows_close(got["ref_logprobs"], ref["ref_logprobs"])
    for key in ("loss", "kl_ref", "tis_weight", "mismatch_kl", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-9, abs=1e-15), key
    assert_grads_close(got["grads"], ref["grads"])


def plain_logprobs(model, tokens: np.ndarray, routed=None) -> torch.Tensor:
    """log π of tokens[1:] from one full forward of the whole sequence (full logits, no cache), replaying `routed`
    [N, L, k] (-1: route) when given: [N − 1]."""
    ids = torch.as_tensor(tokens, dtype=torch.long)[None]
    replay = None if routed is None else torch.as_tensor(np.asarray(routed, dtype=np.int64))[None]
    logp = model(ids, routed_expert_ids=replay).logits[0, :-1].double().log_softmax(-1)  # [N − 1, V]
    return logp.gather(-1, ids[0, 1:, None])[:, 0]


def test_engine_logprobs_with_state_reuse_equal_a_full_forward(recipe_dir, attention):
    """The engine's per-token log-probs, recorded while it samples two turns: two prompts of different lengths in
    one call (left-padded), prefilled in segments of 48, 2 samples each; each sample's second turn prefills only its
    tool reply (itself longer than a segment) on its kept state. They equal one full forward of the final tokens
    (float64: 1e-9), the learner's `score` through segments, and the log-probs of the learner's training step
    (segments + shared prompts + the recorded routing replayed): these are the μ and π_old of its importance ratios.
    The trajectory stores μ in float32 (rollout/trajectory.py), so there they agree to float32 rounding."""
    model = load_policy(recipe_dir, torch.float64).model
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    engine = TorchEngine(model, SimpleNamespace(eos_token_id=2, pad_token_id=0), prefill_tokens=48, reuse_state=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, V, 301).tolist(), rng.integers(3, V, 230).tolist()]
    # a reply ends at a "stop" token (1 in 20), so the kept states differ in length and are stacked
    params = SamplingParams(n=2, temperature=1.0, max_tokens=24, stop_token_ids=tuple(range(3, 3 + V // 20)), seed=5)
    first = engine.generate(prompts, params, sessions=[["a0", "a1"], ["b0", "b1"]])
    assert engine.stats.full_prompts == 2 and engine.stats.prefilled_tokens == 301 + 230
    replies = [c for samples in first for c in samples]
    assert len({len(c.token_ids) for c in replies}) > 1
    tools = [rng.integers(3, V, n).tolist() for n in (50, 61, 50, 97)]
    contexts = [prompts[j // 2] + c.token_ids + tool for j, (c, tool) in enumerate(zip(replies, tools))]
    second = engine.generate(contexts, SamplingParams(temperature=1.0, max_tokens=16, seed=6),
                             sessions=[["a0"], ["a1"], ["b0"], ["b1"]])
    assert engine.stats.resumed_prompts == 4 and engine.stats.full_prompts == 2
    # turn 2 ran only each tool reply and the reply's last token, which was sampled but never fed back
    assert engine.stats.prefilled_tokens == 301 + 230 + sum(len(t) + 1 for t in tools)

    trajectories, recorded = [], []
    for j, (c1, tool, (c2,)) in enumerate(zip(replies, tools, second)):
        b = TrajectoryBuilder(prompts[j // 2])
        b.append_sampled(c1.token_ids, c1.logprobs, 0, c1.routed_experts)
        b.append_context(tool)
        b.append_sampled(c2.token_ids, c2.logprobs, 0, c2.routed_experts)
        trajectories.append(b.finish(reward=float(j % 2), group_id=f"g{j // 2}", task_id=f"t{j // 2}"))
        recorded.append(np.array(c1.logprobs + c2.logprobs))
        with torch.no_grad():
            full = plain_logprobs(model, trajectories[-1].tokens).numpy()
        np.testing.assert_allclose(recorded[-1], full[trajectories[-1].loss_mask[1:].astype(bool)], rtol=1e-9, atol=0)

    learner = make_learner(recipe_dir, SEG, True)
    assert_rows_close(learner.score(trajectories), recorded)
    step = train_step(learner, trajectories)
    assert [u.prefix_len for u in step["units"]] == [301, 230]
    assert_rows_close(step["logprobs"], recorded)
    for got, mu in zip(step["logprobs"], recorded):
        np.testing.assert_allclose(np.float32(mu), got, rtol=2.0**-24, atol=0)
    assert abs(step["metrics"]["tis_weight"] - 1) < 1e-6 and step["metrics"]["mismatch_kl"] < 1e-12


def test_two_versions_in_one_trajectory_weigh_each_token_by_its_own_behaviour(nope_dir):
    """Partial rollouts: a trajectory's first turn sampled by version 0, its second by version 1, each token with
    the behaviour log-prob μ of the version that sampled it. The learner keeps every model token of both versions
    and weighs each by its own truncated IS weight min(π/μ, C) (rl/algos/common.py `tis_weights`; π_old is the
    current weights). A hand computation from one full forward: version 0's μ lies 1.0 below log π (weight
    e > C = 2: capped), version 1's 0.3 below (weight e^0.3); the GRPO loss and its gradient, through segments and
    a shared prompt, equal that of Σ_t c_t log π_t with c_t = −A_s w_t / (n_s S)."""
    learner = make_learner(nope_dir, 64, True)
    model = learner.model
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, V, 150).tolist()
    shapes = [((0, 20), (30, 25)), ((0, 12), (50, 40))]
    trajectories = [episode(rng, prompt, turns, "g", reward, learner.routing_shape) for turns, reward in
                    zip(shapes, (1.0, 0.0))]
    # by hand: A = ±0.5 / (std + 1e-6), std = 1/√2 (unbiased), in float32 as the learner keeps it
    adv = np.float32(0.5 / (math.sqrt(0.5) + 1e-6)) * np.array([1.0, -1.0])
    delta = {0: 1.0, 1: 0.3}
    model.zero_grad(set_to_none=True)
    loss, logprobs, weights = 0.0, [], []
    for s, t in enumerate(trajectories):
        t.routed_experts = None  # the hand computation's forward routes itself
        rows = np.flatnonzero(t.loss_mask)
        assert sorted(set(t.versions[rows].tolist())) == [0, 1]
        lp = plain_logprobs(model, t.tokens)[rows - 1]  # [n_s], with grad
        t.logprobs[rows] = lp.detach().numpy() - [delta[int(v)] for v in t.versions[rows]]
        w = np.minimum(np.exp(lp.detach().numpy() - t.logprobs[rows].astype(np.float64)), 2.0)
        c = -adv[s] * w / (len(rows) * len(trajectories))
        (torch.from_numpy(c) * lp).sum().backward()
        loss += float(c.sum())
        logprobs.append(lp.detach().numpy())
        weights.append(w)
    hand = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    step = train_step(learner, trajectories)
    assert [u.prefix_len for u in step["units"]] == [150]
    assert_rows_close(step["logprobs"], logprobs)
    w = np.concatenate(weights)
    v0 = np.concatenate([t.versions[t.loss_mask == 1] == 0 for t in trajectories])
    assert np.all(w[v0] == 2.0) and np.allclose(w[~v0], math.exp(0.3), rtol=1e-5)
    m = step["metrics"]
    assert m["num_loss_tokens"] == len(w) == 20 + 25 + 12 + 40
    assert m["loss"] == pytest.approx(loss, rel=1e-9)
    assert m["tis_weight"] == pytest.approx(w.mean(), rel=1e-9)
    assert m["tis_capped_frac"] == pytest.approx((20 + 12) / len(w), rel=1e-12)
    assert_grads_close(step["grads"], hand)


def test_partial_rollout_of_the_needle_task_through_the_worker(k3_dir, monkeypatch):
    """The recipe's rollout path end to end: the quickstart's tiny K3 (`k3_dir`, float64) plays the needle task
    served in context (a ~600-token haystack) in groups of 4 through `RolloutWorker.collect_partial`, one turn per
    call (`rollout.partial_rounds: 1`): turn 1 prefilled in segments of 64, turn 2 continuing each episode's kept
    state, then new weights (version 1) and turn 3 (the context prefilled again under them: `reprefill`). Each
    token's behaviour log-prob μ is that of the version it carries, from a full forward of the final tokens (to
    float32, its storage). The learner (version 1's weights, segments + shared prompts) gives log π of every token
    under the routing the rollout recorded (version 0's on version 0's tokens) and weighs each token by
    min(π/μ, C) with its own μ, by hand.

    Not asserted: that version 1's tokens get IS weight 1. They do without routing replay (to float32), but the
    replayed version-0 routing of the earlier turns' tokens is not the routing version 1's re-prefill gave them
    when it sampled turn 3, so π/μ on turn 3 is off by up to ~1% here (weights moved by 0.02 σ; ~1e-3 at 2e-4)."""
    from k3rl.envs import make
    from k3rl.envs.base import Budget
    from k3rl.envs.tools import ParseError
    from k3rl.rollout.worker import RolloutWorker, WorkerSpec

    # no call parses: every turn ends in an error observation, and every episode runs its three turns
    monkeypatch.setattr("k3rl.envs.tools.parse", lambda text: ParseError("bad_shape", "no call in this turn"))
    needle = dict(serve="context", source="wiki", length=600, ask="colour", distractors=0)
    worker = RolloutWorker(WorkerSpec(model_dir=str(k3_dir), env="needle", env_kwargs=needle,
                                      sampling=SamplingParams(max_tokens=12), max_context_tokens=2048,
                                      budget=Budget(max_turns=3),
                                      engine_kwargs={"dtype": torch.float64, "prefill_tokens": 64}))
    tasks = [(f"t{i}", task) for i, task in enumerate(make("needle", **needle).tasks(2, seed=3))]
    stats = worker.engine.stats
    for _ in range(2):
        assert worker.collect_partial(tasks, 4, "p/", max_rounds=1).trajectories == []
        tasks = []
    assert (stats.full_prompts, stats.resumed_prompts) == (2, 8)  # each prompt prefilled once; turn 2 resumed
    g = torch.Generator().manual_seed(0)
    worker.load_weights([(k, v.detach() + 0.02 * torch.randn(v.shape, generator=g, dtype=v.dtype))
                         for k, v in worker.engine.model.named_parameters()], 1)
    trajectories = worker.collect_partial([], 4, "p/", max_rounds=1).trajectories
    assert len(trajectories) == 8 and stats.full_prompts == 2 + 8

    v0 = load_policy(k3_dir, torch.float64).model
    learner = make_learner(k3_dir, SEG, True)
    learner.model.load_state_dict(worker.engine.model.state_dict())
    expected, behaviour, versions = [], [], []
    with torch.no_grad():
        for t in trajectories:
            assert [sorted(set(t.versions[s:e].tolist())) for s, e in t.turn_spans] == [[0], [0], [1]]
            rows = np.flatnonzero(t.loss_mask)
            lp = {0: plain_logprobs(v0, t.tokens).numpy()[rows - 1],
                  1: plain_logprobs(learner.model, t.tokens).numpy()[rows - 1]}
            own = np.where(t.versions[rows] == 0, lp[0], lp[1])
            np.testing.assert_allclose(t.logprobs[rows], own, rtol=2.0**-24 * (1 + 1e-6), atol=0)
            # the learner replays the routing the rollout recorded: version 0's on version 0's tokens
            expected.append(plain_logprobs(learner.model, t.tokens, t.routed_experts).numpy()[rows - 1])
            behaviour.append(t.logprobs[rows].astype(np.float64))
            versions.append(t.versions[rows])

    step = train_step(learner, trajectories)
    # prefix trees: the two needle prompts share their opening across tasks, each prompt is computed once per tree
    # (the exact shapes follow the sampled turns and the tokenizer's merges, so only what they save is asserted)
    trees = [u for u in step["units"] if u.tree is not None]
    assert trees and trees[0].tree.root_len < min(t.prompt_len for t in trajectories)
    saved = sum(len(t.tokens) - 1 for t in trajectories) - sum(u.computed_tokens for u in step["units"])
    assert saved >= 3 * min(t.prompt_len for t in trajectories)
    assert_rows_close(step["logprobs"], expected)
    d = np.concatenate(expected) - np.concatenate(behaviour)  # log π/μ per token
    old = np.concatenate(versions) == 0
    w = np.minimum(np.exp(d), 2.0)
    assert np.abs(w[old] - 1).max() > 1e-2  # version 0's tokens are off-policy for version 1's weights
    m = step["metrics"]
    assert m["num_loss_tokens"] == len(d)
    assert m["tis_weight"] == pytest.approx(w.mean(), rel=1e-9)
    assert m["mismatch_kl"] == pytest.approx((np.exp(d) - d - 1).mean(), rel=1e-9)
