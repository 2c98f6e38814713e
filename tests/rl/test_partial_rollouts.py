"""Partial rollouts (issue 15): episodes paused at a turn boundary and continued under newer weights.

- `AgentLoop.run(max_rounds=…, resume=…)`: an episode paused after a round and resumed after each
  version bump carries v0 on its first turn and the newer versions on later ones; the weights being
  the same, it holds exactly the tokens and logprobs of an uninterrupted run, even with another call
  (an evaluation) in between.
- `RolloutWorker.collect_partial`: groups held across calls come back whole; an evaluation call
  leaves them alone.
- The buffer's staleness bound applies to a trajectory's oldest sampled token.
- `Collector` + `RolloutPool` on Ray: a held group is in flight (never handed out twice); a worker
  killed while it holds paused groups has their tasks collected again; a checkpoint's state lists
  them to be collected again.
- The trainer killed with SIGKILL while partial rollouts are in flight, then resumed: the tasks trained
  step by step are those of an uninterrupted run, each group once.
- `rollout.partial_resume=keep_state` on a K3 model (the native engine keeps the paused episodes' states
  across `load_weights`): with the weights unchanged across the version bumps, the uninterrupted run's tokens
  and logprobs for the prefilled tokens of one run, fewer than `reprefill`'s; with changed weights, every later
  turn continues its old state (no full prefill) and reports the context tokens older weights computed
  (`stale_state_tokens`), where `reprefill` prefills in full and reports none.
- Config: `keep_state` with vLLM, with `reuse_state` off or on a model without session states is refused by
  name before anything starts, and so is a negative `rollout.partial_rounds`.

Multi-turn episodes from a model that knows nothing: `ScriptedTail` lets the random tiny Qwen3 sample
the start of each turn and appends a scripted tool call; `looper_dir` is the tiny Qwen3 rewired to
write `<tool_call>` forever (a call never closed: an error observation, so every episode runs to its
turn budget) — the trainer's subprocess can run it as any model directory. The keep_state tests run the
random tiny K3 (`k3_dir`) in float64 with every turn read as a malformed call (`no_calls`): three turns each.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

import k3rl.envs.tools as T
from k3rl.envs import format_call
from k3rl.envs.base import Budget
from k3rl.rl.metrics import read_metrics
from k3rl.rl.orchestrator.buffer import TrajectoryBuffer
from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest, PausedEpisode
from k3rl.rollout.engine import SamplingParams
from k3rl.rollout.trajectory import Trajectory, TrajectoryBuilder
from tests.rl.test_trainer import REPO, child_env, kill_after_a_checkpoint, make_task, overrides, step_lines, task_files, write_config  # noqa: F401 (task_files)
from tests.rollout.test_agent_loop import Calc

CALL = format_call("add", {"a": 2, "b": 3})
ANSWER = format_call("answer", {"value": 5})


class ScriptedTail:
    """A real engine samples the first tokens of each turn (so they depend on the whole context), then a
    scripted call is appended: `add` on the first two turns, `answer` on the third."""

    def __init__(self, engine):
        self.engine, self.tokenizer = engine, engine.tokenizer

    @property
    def version(self) -> int:
        return self.engine.version

    def load_weights(self, named, version):
        self.engine.load_weights(named, version)

    def reset_cache(self):
        pass

    def generate(self, prompts, params):
        out = self.engine.generate(prompts, replace(params, max_tokens=min(4, params.max_tokens), stop=()))
        for prompt, samples in zip(prompts, out):
            turn = self.tokenizer.decode(prompt).count("<|im_start|>tool\n")  # observations so far
            tail = self.tokenizer(CALL if turn < 2 else ANSWER, add_special_tokens=False)["input_ids"]
            for c in samples:
                c.token_ids, c.logprobs, c.finish_reason = c.token_ids + tail, c.logprobs + [0.0] * len(tail), "stop"
        return out


def scripted_loop(model_dir) -> AgentLoop:
    from k3rl.rollout.torch_engine import TorchEngine

    engine = ScriptedTail(TorchEngine.from_pretrained(model_dir, seed=0))
    # a seed per generate call: a call in between (an evaluation) does not move the samples of later ones
    return AgentLoop(engine, engine.tokenizer, Calc, SamplingParams(max_tokens=32, seed=5), env_name="calc")


@pytest.fixture(scope="module")
def looper_dir(tiny_qwen3_dir, tmp_path_factory):
    """The tiny Qwen3 rewired to write `<tool_call>` over and over: its layers silenced (o_proj, down_proj = 0) so
    the last hidden state is the input token's embedding, and embeddings + head made a bigram table with logit 30
    for the next token of the tag. The call never closes, the environment answers with an error, and every episode
    runs to its turn budget; all samples agree, so every group-relative advantage is 0 and training changes nothing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, torch_dtype=torch.float32)
    ids = tok("<tool_call>", add_special_tokens=False)["input_ids"]
    assert len(set(ids)) == len(ids) < model.config.hidden_size
    gain = 30.0 / model.config.hidden_size ** 0.5  # RMSNorm turns a one-hot row into sqrt(hidden) at its place
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        emb[:, 0] = 1.0
        head.zero_()
        head[ids[0], 0] = gain
        for i, t in enumerate(ids):
            emb[t, 0], emb[t, i + 1] = 0.0, 1.0
            head[ids[(i + 1) % len(ids)], i + 1] = gain
    out = tmp_path_factory.mktemp("looper") / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def search_tasks(numbers) -> list[tuple[str, dict]]:
    return [(f"t{i}", make_task(i)) for i in numbers]


def looper_spec(model_dir, max_turns: int = 3):
    from k3rl.rollout.worker import WorkerSpec

    return WorkerSpec(model_dir=str(model_dir), env="search", env_kwargs={"corpus": None},
                      sampling=SamplingParams(max_tokens=8), max_context_tokens=2048,
                      budget=Budget(max_turns=max_turns))


def turn_versions(t: Trajectory) -> list[list[int]]:
    return [sorted(set(t.versions[s:e].tolist())) for s, e in t.turn_spans]


# ---- the agent loop and the worker (no Ray)

def test_paused_episode_resumes_under_the_new_version_with_the_uninterrupted_tokens(tiny_qwen3_dir):
    requests = [EpisodeRequest({"a": 2, "b": 3}, "t0", "g0", j) for j in range(2)] + \
        [EpisodeRequest({"a": 1, "b": 1}, "t1", "g1")]
    whole = scripted_loop(tiny_qwen3_dir).run(requests)
    assert [t.metrics["turns"] for t in whole] == [3, 3, 3] and [t.reward for t in whole] == [1.0, 1.0, 0.0]

    loop = scripted_loop(tiny_qwen3_dir)
    same = list(loop.engine.engine.model.state_dict().items())
    paused = loop.run(requests, max_rounds=1)
    assert all(isinstance(p, PausedEpisode) for p in paused)
    assert [(p.episode.turns, p.pauses) for p in paused] == [(1, 1)] * 3
    # paused at a turn boundary: the context ends with the observation and the next assistant header
    assert all(loop.tokenizer.decode(p.builder.tokens()).endswith("<|im_start|>assistant\n") for p in paused)
    # another call while they wait (an evaluation episode) runs in an environment of its own
    (other,) = loop.run([EpisodeRequest({"a": 7, "b": 8}, "e0", "eval/e0")])
    assert isinstance(other, Trajectory) and other.metrics["turns"] == 3
    loop.engine.load_weights(same, 1)
    paused = loop.run([], max_rounds=1, resume=paused)
    assert [(p.episode.turns, p.pauses) for p in paused] == [(2, 2)] * 3
    loop.engine.load_weights(same, 2)
    done = loop.run([], resume=paused)

    for a, b in zip(whole, done):
        assert (a.group_id, a.reward, a.finish_reason) == (b.group_id, b.reward, b.finish_reason)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
        assert turn_versions(a) == [[0]] * 3 and turn_versions(b) == [[0], [1], [2]]
        assert b.min_version == 0 and (b.versions[b.loss_mask == 0] == -1).all()
        first_two = int(np.diff(b.turn_spans[:2], axis=1).sum())
        assert b.metrics["stale_sampled_tokens"] == first_two and b.metrics["pauses"] == 2
        assert a.metrics["stale_sampled_tokens"] == 0 and a.metrics["pauses"] == 0


def test_run_refuses_bad_rounds_and_ended_episodes(tiny_qwen3_dir):
    loop = scripted_loop(tiny_qwen3_dir)
    with pytest.raises(ValueError, match="max_rounds"):
        loop.run([], max_rounds=0)
    (paused,) = loop.run([EpisodeRequest({"a": 2, "b": 3}, "t0", "g0")], max_rounds=1)
    paused.episode.truncate("max_turns")
    with pytest.raises(ValueError, match="has ended"):
        loop.run([], resume=[paused])


def test_worker_holds_groups_across_calls_and_returns_them_whole(looper_dir):
    from k3rl.rollout.worker import RolloutWorker

    w = RolloutWorker(looper_spec(looper_dir))
    same = list(w.engine.model.state_dict().items())
    first = w.collect_partial(search_tasks([0, 1]), 2, "c1/", max_rounds=1)
    assert first.trajectories == [] and first.paused == ["c1/t0", "c1/t1"]
    w.load_weights(same, 1)
    second = w.collect_partial(search_tasks([2]), 2, "c2/", max_rounds=1)
    assert second.trajectories == [] and second.paused == ["c1/t0", "c1/t1", "c2/t2"]
    # an evaluation call while groups are held: whole episodes at the current version; the held ones wait
    (held_eval,) = w.collect(search_tasks([3]), 1, "eval/")
    assert held_eval.metrics["turns"] == 3 and turn_versions(held_eval) == [[1]] * 3
    assert w.health()["paused_groups"] == 3
    with pytest.raises(ValueError, match="already held"):
        w.collect_partial(search_tasks([2]), 2, "c2/")
    w.load_weights(same, 2)
    third = w.collect_partial([], 2, "c3/", max_rounds=1)
    assert third.paused == ["c2/t2"]
    assert [t.group_id for t in third.trajectories] == ["c1/t0", "c1/t0", "c1/t1", "c1/t1"]
    for t in third.trajectories:
        assert t.finish_reason == "truncated:max_turns" and turn_versions(t) == [[0], [1], [2]]
        assert t.metrics["pauses"] == 2 and t.metrics["stale_sampled_tokens"] == 16
    w.load_weights(same, 3)
    last = w.collect_partial([], 2, "c4/", max_rounds=4)
    assert last.paused == [] and [turn_versions(t) for t in last.trajectories] == [[[1], [2], [3]]] * 2
    assert w.health()["paused_groups"] == 0


def test_keep_state_needs_an_engine_that_keeps_states(looper_dir):
    from k3rl.rollout.worker import RolloutWorker

    with pytest.raises(ValueError, match="engine 'vllm' keeps no episode state"):
        RolloutWorker(replace(looper_spec(looper_dir), engine="vllm", partial_resume="keep_state"))
    with pytest.raises(ValueError, match="keep_state: the native engine keeps session states of K3 models only"):
        RolloutWorker(replace(looper_spec(looper_dir), partial_resume="keep_state"))


# ---- keep_state: the native engine continues a paused episode's state across a weight update

@pytest.fixture
def no_calls(monkeypatch):
    """Every turn is a malformed call: an error observation, and each episode runs to its turn budget."""
    monkeypatch.setattr(T, "parse", lambda text: T.ParseError("bad_shape", "no call in this turn"))


def k3_worker(k3_dir, partial_resume: str):
    import torch

    from k3rl.rollout.worker import RolloutWorker

    return RolloutWorker(replace(looper_spec(k3_dir), partial_resume=partial_resume,
                                 engine_kwargs={"dtype": torch.float64}))


def paused_twice(worker, weights: list) -> list[Trajectory]:
    """Two groups of 2 run one turn per call; `weights[k]` is loaded as version k + 1 after call k + 1."""
    assert worker.collect_partial(search_tasks([0, 1]), 2, "p/", max_rounds=1).trajectories == []
    for version, named in enumerate(weights, 1):
        worker.load_weights(named, version)
        got = worker.collect_partial([], 2, "p/", max_rounds=1)
    assert got.paused == [] and len(got.trajectories) == 4
    return got.trajectories


def read_stale(t: Trajectory) -> int:
    """Context tokens older weights computed, read by turns 2 and 3 resumed after a version bump each: the
    state kept after turn k covers the tokens up to turn k's last sampled one, which stays pending."""
    (_, end1), (_, end2) = t.turn_spans[:2]
    return (end1 - 1) + (end2 - 1)


def test_keep_state_under_unchanged_weights_gives_the_uninterrupted_tokens_for_fewer_prefilled(k3_dir, no_calls):
    reference = k3_worker(k3_dir, "reprefill")
    whole = reference.collect(search_tasks([0, 1]), 2, "p/")
    same = list(reference.engine.model.state_dict().items())
    runs = {resume: k3_worker(k3_dir, resume) for resume in ("keep_state", "reprefill")}
    got = {resume: paused_twice(w, [same, same]) for resume, w in runs.items()}
    for trajs in got.values():
        for a, b in zip(whole, trajs):
            assert a.group_id == b.group_id and a.finish_reason == b.finish_reason == "truncated:max_turns"
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-6)  # stored in float32
            assert turn_versions(a) == [[0]] * 3 and turn_versions(b) == [[0], [1], [2]]
    keep, again, one_go = runs["keep_state"].engine.stats, runs["reprefill"].engine.stats, reference.engine.stats
    # keep_state prefills what the uninterrupted run prefills: the first prompt of each group, then only new tokens
    assert keep.prefilled_tokens == one_go.prefilled_tokens < again.prefilled_tokens
    assert (keep.full_prompts, keep.resumed_prompts, keep.version_fallbacks) == (2, 8, 0)
    assert (again.full_prompts, again.resumed_prompts) == (2 + 4 + 4, 0)
    # versions moved, so the resumed states count as stale even though the weights are the same
    assert [t.metrics["stale_state_tokens"] for t in got["keep_state"]] == [read_stale(t) for t in whole]
    assert keep.stale_state_tokens == sum(read_stale(t) for t in whole) > 0
    assert all(t.metrics["stale_state_tokens"] == 0 for t in whole + got["reprefill"])
    assert one_go.stale_state_tokens == again.stale_state_tokens == 0


def test_keep_state_under_changed_weights_continues_the_old_state_and_reports_it(k3_dir, no_calls):
    import torch

    runs = {resume: k3_worker(k3_dir, resume) for resume in ("keep_state", "reprefill")}
    params = list(runs["reprefill"].engine.model.named_parameters())
    g = torch.Generator().manual_seed(0)
    updates = [[(k, v.detach() + 0.02 * torch.randn(v.shape, generator=g, dtype=v.dtype)) for k, v in params]
               for _ in range(2)]
    got = {resume: paused_twice(w, updates) for resume, w in runs.items()}
    keep, again = runs["keep_state"].engine.stats, runs["reprefill"].engine.stats
    # keep_state: no full prefill after the first turn; every later turn continues its state
    assert (keep.full_prompts, keep.resumed_prompts, keep.version_fallbacks) == (2, 8, 0)
    assert (again.full_prompts, again.resumed_prompts) == (10, 0)
    assert keep.prefilled_tokens < again.prefilled_tokens
    for k, r in zip(got["keep_state"], got["reprefill"]):
        assert turn_versions(k) == turn_versions(r) == [[0], [1], [2]]
        (s1, e1), (s2, _) = k.turn_spans[:2]
        # the first turn is the same; the second starts from a state the old weights computed, unlike reprefill's
        np.testing.assert_array_equal(k.tokens[:e1], r.tokens[:e1])
        np.testing.assert_allclose(k.logprobs[s1:e1], r.logprobs[s1:e1], rtol=0, atol=1e-6)
        assert abs(k.logprobs[s2] - r.logprobs[s2]) > 1e-6
        assert k.metrics["stale_state_tokens"] == read_stale(k) > 0 and r.metrics["stale_state_tokens"] == 0
    assert keep.stale_state_tokens == sum(read_stale(t) for t in got["keep_state"]) and again.stale_state_tokens == 0


def spanning(group: str, turn_versions: list[int]) -> Trajectory:
    """A trajectory whose k-th turn (3 tokens, then a 2-token observation) was sampled by `turn_versions[k]`."""
    b = TrajectoryBuilder([1, 2, 3, 4])
    for v in turn_versions:
        b.append_sampled([5, 6, 7], [-0.1] * 3, v)
        b.append_context([8, 9])
    return b.finish(group_id=group)


def test_staleness_bound_applies_to_the_oldest_sampled_token_of_a_partial_rollout():
    buf = TrajectoryBuffer()
    # group "old": one sample's first turn is from version 0, its other turns (and the other sample) from 2
    buf.add([spanning("old", [0, 2, 2]), spanning("old", [2, 2, 2])])
    buf.add([spanning("fresh", [1, 2, 2]), spanning("fresh", [2, 2])])
    assert buf.trajectories()[0].min_version == 0 and buf.trajectories()[2].min_version == 1
    assert buf.available(learner_version=2, max_staleness=1) == 1
    taken = buf.take(2, learner_version=2, max_staleness=1)
    assert [g.group_id for g in taken.groups] == ["fresh"] and taken.groups[0].staleness(2) == 1
    assert [g.group_id for g in taken.dropped] == ["old"] and buf.dropped_trajectories == 2
    # the same groups at a bound of 2 are both trained
    buf.add([spanning("old2", [0, 2, 2])])
    assert [g.group_id for g in buf.take(1, learner_version=2, max_staleness=2).groups] == ["old2"]


@pytest.mark.parametrize("extra, message", [
    (["rollout.partial_resume=keep_state", "rollout.engine=vllm"], "engine 'vllm' keeps no episode state"),
    (["rollout.partial_resume=keep_state", "rollout.engine_args.reuse_state=false"], "reuse_state=false"),
    (["rollout.partial_resume=keep_state"], "session states of K3 models only"),
    (["rollout.partial_rounds=-1"], "rollout.partial_rounds: must be ≥ 0"),
    (["rollout.partial_resume=keep"], "rollout.partial_resume.*reprefill, keep_state"),
])
def test_partial_settings_are_checked_before_anything_starts(tiny_qwen3_dir, task_files, tmp_path, extra, message):
    from k3rl.rl.config import ConfigError, JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    with pytest.raises(ConfigError, match=message):
        Trainer(load_config(None, overrides(tmp_path, tiny_qwen3_dir, task_files, "bad") + extra,
                            schema=JobConfig))
    assert not (tmp_path / "runs" / "bad").exists()


# ---- on Ray: the pool and the collector, then the trainer

def task_id(group_id: str) -> str:
    """`c12/t3` → `t3` (a task handed out twice in one call is `t3#2`)."""
    return group_id.split("/", 1)[1].split("#")[0]


@pytest.mark.ray
def test_held_groups_are_in_flight_and_a_killed_holder_has_them_collected_again(ray_cluster, looper_dir):
    from k3rl.rl.orchestrator.collector import Collector
    from k3rl.rl.orchestrator.rollout_pool import RolloutPool
    from k3rl.rollout.worker import build_engine

    ray = ray_cluster
    spec = looper_spec(looper_dir)
    pool = RolloutPool(spec, num_workers=2, num_cpus=0.5, partial_rounds=1)
    dispatched: list[list[str]] = []
    dispatch = pool.dispatch

    def recording(slot, kind, tasks, group_size, **kw):
        dispatched.append([t for t, _ in tasks])
        dispatch(slot, kind, tasks, group_size, **kw)

    pool.dispatch = recording
    # a bound no group reaches: every collected group is trained, so counts compare exactly
    c = Collector(pool, search_tasks(range(6)), seed=3, group_size=2, tasks_per_step=2, max_staleness=10,
                  eval_sampling=None)
    weights = list(build_engine(spec).model.state_dict().items())
    pool.start()
    collected, lost, at_kill = [], [], 0
    try:
        for version in range(3):
            c.collect(version)
            collected += c.take(version).trajectories
            c.prefetch_while_training(version)
            c.drain()
            held = pool.held_tasks()
            # paused groups are in flight: counted against the cap, and listed first for a checkpoint to collect again
            assert held and pool.in_flight("train") == len(held)
            assert c.state_dict()["requeue"][:len(held)] == held
            if version == 0:
                holder = next(s for s in pool.slots if s.held)
                lost = [t for t, _ in (h.task for h in holder.held.values())]
                at_kill = len(dispatched)
                ray.kill(holder.actor, no_restart=True)
            pool.push_weights(weights, version + 1, blocking=False)
        # let every held group end (an idle holder is called again even when nothing new is wanted)
        while pool.busy() or pool.held_tasks():
            c.fill(0, 3)
            c.wait()
        collected += c.take(3).trajectories
    finally:
        pool.close()
    assert pool.restarts == 1 and lost
    groups = Counter(t.group_id for t in collected)
    assert set(groups.values()) == {2}  # whole groups, each once
    # every task handed out was collected once, except those lost with the killed worker: collected again
    handed_out = Counter(t for call in dispatched for t in call)
    assert Counter(task_id(g) for g in groups) == handed_out - Counter(lost)
    assert Counter(lost) <= Counter(t for call in dispatched[at_kill:] for t in call)
    # groups continued across weight pushes: some trajectories hold tokens of two versions or more
    assert any(len(set(t.versions[t.loss_mask == 1].tolist())) > 1 for t in collected)
    assert all(t.metrics["pauses"] == 2 and t.finish_reason == "truncated:max_turns" for t in collected)


@pytest.mark.ray
def test_driver_killed_with_partial_rollouts_in_flight_resumes_like_an_uninterrupted_run(ray_cluster, looper_dir,
                                                                                         task_files, tmp_path):
    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    def items(name: str) -> list[str]:
        return overrides(tmp_path, looper_dir, task_files, name, mode="async", max_staleness=1, steps=6, save_every=2,
                         eval_every=3, max_new_tokens=16, max_turns=4) + ["rollout.partial_rounds=1"]

    whole = read_metrics(Trainer(load_config(None, items("whole"), schema=JobConfig)).train())

    address = ray_cluster.get_runtime_context().gcs_address
    config = write_config(tmp_path / "job.yaml", items("killed") + [f"ray.address={address}"])
    run_dir = tmp_path / "runs" / "killed"
    _, state = kill_after_a_checkpoint(config, run_dir, tmp_path / "first.log")
    k = state["step"]
    assert k < 6, "the run finished before it could be killed; make the steps longer"
    # at the checkpoint, the groups prefetched during the step's update were paused on the worker: their
    # tasks are listed to be collected again
    assert len(state["requeue"]) == 2
    before = {r["step"]: r for r in read_metrics(run_dir) if r["step"] <= k}

    resumed = subprocess.run([sys.executable, "-m", "k3rl.rl.commands.train", str(config), "rl.resume=true"], cwd=REPO,
                             env=child_env(), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in whole] == [0, 1, 2, 3, 4, 5, 6]
    assert all(rows[s] == before[s] for s in range(k + 1))
    # the tasks in flight at the kill were neither lost nor trained twice: step by step, the run trained the
    # tasks the uninterrupted run trained, each group once, nothing dropped as stale
    for run in (rows, whole):
        groups = [g for r in run for g, _, _ in r.get("batch", [])]
        assert len(groups) == len(set(groups)) == 12
        assert all(r["buffer/dropped_stale_total"] == 0 and r["staleness/max"] <= 1 for r in run[1:])
        # every episode ran 4 turns in 4 calls; groups prefetched during an update continued under the next version
        assert all(r["episode/pauses"] == 3 for r in run[1:])
        assert any(r["episode/stale_sampled_tokens"] > 0 for r in run[1:])
        assert all(r["episode/stale_state_tokens"] == 0 for r in run[1:])  # reprefill
    assert [[task_id(g) for g, _, _ in r["batch"]] for r in rows[1:]] == \
        [[task_id(g) for g, _, _ in r["batch"]] for r in whole[1:]]
    assert [task_id(g) for g, _, _ in rows[k + 1]["batch"]] == [t for t, _ in state["requeue"]]
