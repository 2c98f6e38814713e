"""The RL driver end to end on Ray with a tiny Qwen3 and the search environment over per-task passages.

Unit tests (no Ray): the buffer's staleness bound and whole-group takes, the Wilson interval, the
metrics file cut back on resume, the plots. Ray tests (the session's local cluster, in-process):
a sync run writes metrics.jsonl, TensorBoard events, PNGs and checkpoints and syncs weights to
every engine; an async run overlaps rollouts with training and never trains a group beyond the
staleness bound (a late collection from an old policy is dropped and counted); a rollout actor
killed mid-run is replaced and its tasks are collected again. Subprocesses: the driver killed with
SIGKILL after a checkpoint and resumed (joining the session's cluster with `ray.address`); a
two-node `ray.cluster_utils.Cluster`, started in a child process of its own because the session
fixture already owns this process's Ray connection.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from k3rl.rl.metrics import MetricsLogger, plot, read_metrics, wilson_interval
from k3rl.rl.orchestrator.buffer import TrajectoryBuffer
from k3rl.rollout.trajectory import Trajectory

REPO = Path(__file__).parents[2]
PASSAGES = [{"id": f"p{i}", "title": f"Doc {i}", "text": f"Passage {i} says the code word is w{i * 7}."}
            for i in range(10)]
PLOTS = {"reward.png", "success.png", "eval_success.png", "kl.png", "staleness.png", "tokens_per_s.png"}


def make_task(i: int, prefix: str = "t") -> dict:
    return {"id": f"{prefix}{i}", "question": f"What is the code word of passage {i}?", "answers": [f"w{i * 7}"],
            "evidence": [f"p{i}"], "passages": PASSAGES}


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    train, held_out = root / "train.jsonl", root / "eval.jsonl"
    train.write_text("".join(json.dumps(make_task(i)) + "\n" for i in range(8)))
    held_out.write_text("".join(json.dumps(make_task(i, "e")) + "\n" for i in range(8, 10)))
    return train, held_out


def overrides(tmp_path, model_dir, task_files, name: str, **rl) -> list[str]:
    """Tiny run settings: 2 tasks × group 2 per step, 16 new tokens, half a CPU per actor. Keyword names are
    the flat names of earlier recipes (`max_new_tokens`, `num_rollout_workers`, …), each put in its section."""
    from k3rl.rl.config import MOVED_KEYS

    train, held_out = task_files
    settings = dict(steps=2, tasks_per_step=2, group_size=2, max_new_tokens=16, max_turns=2, eval_every=2,
                    save_every=1, max_context_tokens=2048, learner_num_cpus=0.5, rollout_num_cpus=0.5,
                    num_rollout_workers=1, lr=1e-3)
    settings.update(rl)
    return ([f"run.output_dir={tmp_path / 'runs'}", f"run.name={name}", f"rl.model_path={model_dir}",
             f"env.tasks_path={train}", f"eval.tasks_path={held_out}", "env.args={corpus: null}"]
            + [f"{MOVED_KEYS.get('rl.' + k, 'rl.' + k)}={v}" for k, v in settings.items()])


def job(*args, **rl):
    from k3rl.rl.config import JobConfig, load_config

    return load_config(None, overrides(*args, **rl), schema=JobConfig)


def step_lines(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)]


def trained_tasks(rows: list[dict]) -> Counter:
    """Task id → trajectories trained, from the `batch` entries ([group_id, size, min_version])."""
    counts: Counter = Counter()
    for r in rows:
        for group_id, n, _ in r.get("batch", []):
            counts[group_id.split("/", 1)[1]] += n
    return counts


# ---- unit tests (no Ray)

def traj(group: str, version: int, reward: float = 0.0, sampled: int = 3) -> Trajectory:
    n = 4 + sampled
    mask = np.r_[np.zeros(4), np.ones(sampled)].astype(np.uint8)
    return Trajectory(tokens=np.arange(n, dtype=np.int32), loss_mask=mask, logprobs=-mask.astype(np.float32),
                      versions=np.where(mask == 1, version, -1).astype(np.int32),
                      turn_spans=np.array([[4, n]], dtype=np.int32), prompt_len=4, reward=reward, group_id=group)


def test_buffer_takes_whole_fresh_groups_and_counts_stale_ones():
    buf = TrajectoryBuffer()
    assert buf.add([traj("a", 0), traj("b", 2), traj("a", 1), traj("b", 2)]) == 2
    buf.add([traj("c", 3), traj("c", 3), traj("d", 3, sampled=0)])
    assert len(buf) == 4 and buf.num_trajectories == 7
    # at version 3 with bound 1: group a (oldest token version 0) is 3 behind, b is 1, c 0, d has no sampled token
    assert buf.available(3, 1) == 3
    taken = buf.take(1, learner_version=3, max_staleness=1)
    assert [g.group_id for g in taken.groups] == ["b"] and len(taken.trajectories) == 2
    assert [g.group_id for g in taken.dropped] == ["a"]
    assert (buf.dropped_groups, buf.dropped_trajectories) == (1, 2)
    # the group of trajectories without a sampled token has no staleness; c keeps its place
    state = buf.state_dict()
    back = TrajectoryBuffer()
    back.load_state_dict(state)
    assert [t.group_id for t in back.trajectories()] == ["c", "c", "d"] and back.dropped_groups == 1
    rest = back.take(5, learner_version=10, max_staleness=0)
    assert [g.group_id for g in rest.groups] == ["d"] and [g.group_id for g in rest.dropped] == ["c"]
    with pytest.raises(ValueError, match="already in the buffer"):
        buf.add([traj("c", 4)])
    with pytest.raises(ValueError, match="no group_id"):
        buf.add([traj("", 4)])


def test_wilson_interval():
    lo, hi = wilson_interval(0, 2)
    assert lo == 0 and hi == pytest.approx(0.6576, abs=1e-4)
    lo, hi = wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    lo, hi = wilson_interval(81, 100)
    assert lo == pytest.approx(0.7222, abs=1e-4) and hi == pytest.approx(0.8749, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_metrics_resume_keeps_checkpointed_steps_only(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=5, console=False)
    for step in range(4):
        log.log(step, {"reward/mean": step / 10}, {"batch": [[f"g{step}", 2, step]]})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # a line torn by a crash
    log = MetricsLogger(tmp_path, total_steps=5, resume_step=1, console=False)
    assert step_lines(tmp_path) == [0, 1]
    log.log(2, {"reward/mean": 0.5})
    log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["batch"] == [["g1", 2, 1]]
    assert rows[2]["reward/mean"] == 0.5
    MetricsLogger(tmp_path, total_steps=5, resume_step=-1, console=False).close()
    assert step_lines(tmp_path) == []


def test_plot_writes_curves_with_eval_band(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=3, console=False)
    for step in range(3):
        lo, hi = wilson_interval(step, 4)
        log.log(step, {"reward/mean": 0.1 * step, "success/rate": 0.2 * step, "train/mismatch_kl": 1e-3,
                       "staleness/mean": 0.5, "staleness/max": 1, "perf/gen_tokens_per_s": 100.0,
                       "perf/train_tokens_per_s": 900.0, "eval/success_rate": step / 4, "eval/ci_low": lo,
                       "eval/ci_high": hi, "eval/num_tasks": 4})
    log.close()
    written = plot(tmp_path)
    assert {p.name for p in written} == PLOTS
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)


# ---- in-process runs on the session's Ray cluster

@pytest.mark.ray
def test_sync_run_logs_checkpoints_and_syncs_weights(ray_cluster, tiny_qwen3_dir, task_files, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from k3rl.rl import checkpoint as ckpt
    from k3rl.rl.orchestrator.trainer import Trainer

    ray = ray_cluster
    seen = []

    def check_engines(trainer, result):
        # sync mode: every engine holds the learner's new version before the next step starts
        versions = ray.get([a.health.remote() for a in trainer.worker_actors])
        seen.append((result.step, trainer.version, [h["version"] for h in versions]))
        staleness = [result.learner_version - t.min_version for t in result.taken.trajectories]
        assert staleness == [0] * 4
        # groups whose samples all scored alike are counted, not hidden
        alike = sum(len({t.reward for t in g.trajectories}) == 1 for g in result.taken.groups)
        assert result.metrics["groups/zero_variance"] == alike

    trainer = Trainer(job(tmp_path, tiny_qwen3_dir, task_files, "sync"), callbacks=[check_engines])
    run_dir = trainer.train()
    assert seen == [(1, 1, [1]), (2, 2, [2])]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/success_rate" in rows[0] and "eval/success_rate" in rows[2] and rows[2]["eval/num_tasks"] == 2
    assert rows[2]["eval/ci_low"] <= rows[2]["eval/success_rate"] <= rows[2]["eval/ci_high"]
    for r in rows[1:]:
        for key in ("reward/mean", "success/rate", "rewards/evidence_recall", "episode/tokens", "episode/tool_calls",
                    "train/mismatch_kl", "staleness/mean", "staleness/max", "groups/zero_variance",
                    "perf/gen_tokens_per_s", "perf/train_tokens_per_s", "perf/step_time_s"):
            assert key in r, key
        assert r["groups/trained"] == 2 and len(r["batch"]) == 2 and r["policy/version"] == r["step"]
    events = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
    assert [e.step for e in acc.Scalars("eval/success_rate")] == [0, 2]
    assert {p.name for p in (run_dir / "plots").glob("*.png")} == PLOTS
    assert [s for s, _ in ckpt.list_checkpoints(run_dir / "checkpoints")] == [1, 2]
    state = ckpt.load_trainer_state(ckpt.find_latest(run_dir / "checkpoints"), restore_rng_state=False)
    assert state["step"] == 2 and state["version"] == 2 and state["cursor"] == 4
    assert (run_dir / "checkpoints" / "step-000002" / "model.safetensors").is_file()
    # a second fresh run into the same directory is refused rather than mixed with this one
    from k3rl.rl.config import ConfigError

    with pytest.raises(ConfigError, match="rl.resume=true"):
        Trainer(job(tmp_path, tiny_qwen3_dir, task_files, "sync"))
    # actors the cluster cannot hold all at once: a named error, not a worker pending forever
    with pytest.raises(ConfigError, match=r"1 × 2 \+ 1 × 2 = 4 CPUs, but the Ray cluster has 2 \(ray.num_cpus"):
        Trainer(job(tmp_path, tiny_qwen3_dir, task_files, "too-big", learner_num_cpus=2, rollout_num_cpus=2))
    assert ray.is_initialized()  # the session's cluster: not the trainer's to shut down


@pytest.mark.parametrize("override,message", [
    ("env.args.lenght=1000", "env.args: environment 'search' does not take these arguments"),
    ("algo.args.kl_coeff=0.1", "algo.name / algo.args: algorithm 'grpo': unknown setting(s) kl_coeff"),
    ("rollout.engine=vlm", "config key 'rollout.engine' got 'vlm' (str), expected one of torch, vllm"),
    ("learner.dtype=float8", "config key 'learner.dtype' got 'float8' (str), expected one of"),
    ("rollout.engine_args.max_batchh=4", "rollout.engine_args: engine 'torch' does not take max_batchh; it takes: "
                                         "max_batch"),
    ("rl.model_path=tests/fixtures/k3_per_expert", "has no tokenizer (tokenizer.json / tokenizer_config.json)"),
    ("rl.model_path=tests/fixtures", "rl.model_path: no Hugging Face model at tests/fixtures (config.json missing)"),
    ("rollout.compaction_tokens=2000", "rollout.compaction_tokens: 2000 + summary_tokens 256 = 2256 must stay under "
                                       "rollout.max_context_tokens 2048"),
])
def test_late_errors_are_named_before_anything_starts(tiny_qwen3_dir, task_files, tmp_path, override, message):
    """Settings only an environment, algorithm or engine understands are checked in the driver, before Ray
    starts or anything is written (they used to fail seconds later inside a Ray actor)."""
    from k3rl.rl.config import ConfigError, JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    with pytest.raises(ConfigError) as e:
        Trainer(load_config(None, overrides(tmp_path, tiny_qwen3_dir, task_files, "late") + [override],
                            schema=JobConfig))
    assert message in str(e.value)
    assert not (tmp_path / "runs").exists()


def test_adapter_pushes_to_vllm_need_an_hf_model(k3_dir, task_files, tmp_path):
    """vLLM serves pushed adapters for HF models only (rollout/vllm_engine.py): a K3 policy with
    `learner.lora.push: adapters` on the vLLM engine is refused before anything starts, naming the way out."""
    from k3rl.rl.config import ConfigError, JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    items = overrides(tmp_path, k3_dir, task_files, "k3-lora") + ["rollout.engine=vllm", "learner.lora.rank=4"]
    with pytest.raises(ConfigError, match="vLLM's K3 module takes merged weights: set learner.lora.push=merged"):
        Trainer(load_config(None, items, schema=JobConfig))
    assert not (tmp_path / "runs").exists()


def test_bad_task_files_are_named_by_file_and_line(tiny_qwen3_dir, task_files, tmp_path):
    from k3rl.rl.config import ConfigError, JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    train, _ = task_files
    shaped = tmp_path / "shaped.jsonl"
    shaped.write_text(train.read_text().splitlines()[0] + "\n\n[1, 2]\n")  # valid JSON, not a task
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"question": "caf\xe9"}\n'.encode("latin-1"))
    for path, message in ((shaped, f"{shaped}:3: not a task of environment SearchEnv"),
                          (latin, f"{latin}:1: not UTF-8 text")):
        items = overrides(tmp_path, tiny_qwen3_dir, task_files, "tasks") + [f"env.tasks_path={path}"]
        with pytest.raises(ConfigError) as e:
            Trainer(load_config(None, items, schema=JobConfig))
        assert message in str(e.value)
    assert not (tmp_path / "runs").exists()


def test_bad_task_rows_refused_or_skipped_and_counted(task_files, tmp_path):
    """`env.bad_task_rows`: `refuse` names the first bad row; `skip` leaves bad rows out and describes each."""
    from k3rl.envs.search import SearchEnv
    from k3rl.rl.config import ConfigError
    from k3rl.rl.orchestrator.tasks import read_tasks

    train, _ = task_files
    good = train.read_text().splitlines()[:2]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([good[0], "{not json", "", '{"question": 3}', good[1]]) + "\n")
    env = SearchEnv(corpus=None)
    with pytest.raises(ConfigError, match=rf"{path}:2: not valid JSON .*env.bad_task_rows=skip"):
        read_tasks(path, env)
    skipped: list[str] = []
    tasks = read_tasks(path, env, "skip", skipped)
    assert [json.dumps(t) for t in tasks] == [json.dumps(json.loads(g)) for g in good]
    assert len(skipped) == 2 and skipped[0].startswith(f"{path}:2: not valid JSON")
    assert skipped[1].startswith(f"{path}:4: not a task of environment SearchEnv")
    with pytest.raises(ConfigError, match="'ignore' is not one of refuse, skip"):
        read_tasks(path, env, "ignore")


def test_resume_without_a_loadable_checkpoint_is_a_named_error_and_changes_nothing(tiny_qwen3_dir, task_files,
                                                                                  tmp_path):
    """No Ray needed: the resume point is decided before anything starts or is written."""
    from k3rl.rl.config import ConfigError
    from k3rl.rl.orchestrator.trainer import Trainer

    run_dir = tmp_path / "runs" / "gone"
    (run_dir / "checkpoints" / "step-000004").mkdir(parents=True)  # a save that never finished
    (run_dir / "checkpoints" / "step-000004" / "model.safetensors").write_bytes(b"partial")
    metrics = "".join(json.dumps({"step": i, "time": 0.0}) + "\n" for i in range(5))
    (run_dir / "metrics.jsonl").write_text(metrics)
    (run_dir / "config.yaml").write_text("the run's own config\n")
    with pytest.raises(ConfigError, match="rl.resume=true: .* holds a run but no checkpoint that loads .*no "
                                          "checkpoint directory holds a COMPLETE manifest.*nothing was changed"):
        Trainer(job(tmp_path, tiny_qwen3_dir, task_files, "gone", resume=True))
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert (run_dir / "config.yaml").read_text() == "the run's own config\n"


@pytest.mark.ray
def test_resume_skips_a_corrupt_checkpoint_for_the_newest_that_verifies(ray_cluster, tiny_qwen3_dir, task_files,
                                                                       tmp_path, capsys):
    from k3rl.rl.orchestrator.trainer import Trainer

    Trainer(job(tmp_path, tiny_qwen3_dir, task_files, "flip", eval_every=0)).train()
    run_dir = tmp_path / "runs" / "flip"
    weights = run_dir / "checkpoints" / "step-000002" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    Trainer(job(tmp_path, tiny_qwen3_dir, task_files, "flip", eval_every=0, steps=3, resume=True)).train()
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "skipped checkpoint step-000002" in out and "model.safetensors does not match its content hash" in out
    assert "resuming from the newest checkpoint that verifies, step-000001" in out
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


@pytest.mark.ray
def test_learner_settings_from_the_recipe_reach_the_learner(ray_cluster, tiny_qwen3_dir, task_files, tmp_path):
    """`learner.optimizer=muon learner.dtype=bfloat16 …` from the command line: the run's config.yaml shows
    them, the checkpoint holds bfloat16 weights and Muon's state; a bad value is named before anything runs."""
    import yaml
    from safetensors import safe_open

    from k3rl.rl.config import ConfigError, JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    items = overrides(tmp_path, tiny_qwen3_dir, task_files, "muon", steps=1, eval_every=0, save_every=1) + [
        "learner.optimizer=muon", "learner.dtype=bfloat16", "learner.micro_batch_tokens=512",
        "learner.muon_momentum=0.9", "learner.weight_decay=0.01"]
    run_dir = Trainer(load_config(None, items, schema=JobConfig)).train()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["learner"]
    assert (saved["optimizer"], saved["dtype"], saved["micro_batch_tokens"], saved["muon_momentum"]) == \
        ("muon", "bfloat16", 512, 0.9)
    step = run_dir / "checkpoints" / "step-000001"
    with safe_open(str(step / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}
    import torch

    optim = torch.load(step / "optimizer.pt", weights_only=False)
    assert len(optim["optimizers"]) == 2  # AdamW and Muon
    with pytest.raises(ConfigError, match=r"config key 'learner.optimizer' got 'sgd' \(str\), expected one of adamw, muon"):
        Trainer(load_config(None, overrides(tmp_path, tiny_qwen3_dir, task_files, "bad") + ["learner.optimizer=sgd"],
                            schema=JobConfig))
    assert not (tmp_path / "runs" / "bad").exists()


@pytest.mark.ray
def test_async_never_trains_beyond_staleness_bound(ray_cluster, tiny_qwen3_dir, task_files, tmp_path):
    from k3rl.rl.orchestrator.trainer import Trainer

    trained = []
    late = []

    def record(trainer, result):
        assert result.metrics["train/skipped"] == 0 and result.learner_version == result.step - 1
        trained.append([(result.learner_version, t.min_version) for t in result.taken.trajectories])
        if result.step == 2:
            # a straggling collection sampled by policy version 0 arrives now: at step 3 it is 2 versions old
            late.extend(replace(t, group_id=f"late/{t.group_id}") for t in result.taken.trajectories)
            late[:] = [replace(t, versions=np.where(t.loss_mask == 1, 0, -1).astype(np.int32)) for t in late]
            trainer.buffer.add(late)

    cfg = job(tmp_path, tiny_qwen3_dir, task_files, "async", mode="async", max_staleness=1, steps=4,
              save_every=0, eval_every=0)
    run_dir = Trainer(cfg, callbacks=[record]).train()
    staleness = [v - m for step in trained for v, m in step]
    assert len(staleness) == 16 and max(staleness) <= 1
    # rollouts of step 2 were sampled by version 0 while the learner made version 1: real overlap
    assert staleness.count(1) >= 4
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness/max"] <= 1 for r in rows)
    for r in rows:
        assert all(r["policy/version"] - 1 - min_version <= 1 for _, _, min_version in r["batch"])
        assert not any(g.startswith("late/") for g, _, _ in r["batch"])
    assert rows[2]["buffer/dropped_stale_groups"] == 2 and rows[3]["buffer/dropped_stale_total"] == 2
    assert sorted(g for g, _, _ in rows[2]["dropped"]) == sorted({t.group_id for t in late})


@pytest.mark.ray
def test_killed_rollout_actor_is_replaced_and_its_tasks_collected(ray_cluster, tiny_qwen3_dir, task_files, tmp_path):
    from k3rl.rl.orchestrator.trainer import Trainer

    ray = ray_cluster
    killed = []

    def kill_worker(trainer, result):
        if result.step == 1:
            killed.append(trainer.worker_actors[0])
            ray.kill(trainer.worker_actors[0], no_restart=True)

    cfg = job(tmp_path, tiny_qwen3_dir, task_files, "replace", mode="async", max_staleness=1, steps=4,
              save_every=0, eval_every=0)
    trainer = Trainer(cfg, callbacks=[kill_worker])
    replacements = []
    trainer.callbacks.append(lambda tr, res: replacements.append(tr.worker_actors[0]))
    trainer.train()
    assert killed and replacements[-1] != killed[0]
    rows = [r for r in read_metrics(trainer.run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["workers/restarts"] == 1
    # 4 steps × 2 tasks = one pass over the 8 training tasks: each trained exactly once, with its
    # whole group, so the tasks in flight on the killed worker were collected again
    assert trained_tasks(rows) == Counter({f"t{i}": 2 for i in range(8)})


@pytest.mark.ray
def test_broadcast_weight_sync_reaches_every_engine_and_forms_again_after_a_replacement(
        ray_cluster, tiny_qwen3_dir, task_files, tmp_path):
    """`rollout.weight_sync: broadcast` (rl/orchestrator/weight_sync.py): after every step each engine holds the
    learner's version and exactly its weights (every tensor compared); a killed worker is replaced, the group forms
    again with the new one, and the run continues."""
    from k3rl.rl.config import WeightSync
    from k3rl.rl.orchestrator.trainer import Trainer

    ray = ray_cluster
    checked, killed, actors = [], [], []

    def engine_weights(worker):
        return ray.get(worker.__ray_call__.remote(
            lambda self: {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}))

    def check(trainer, result):
        learner = dict(trainer.learner.named_weights())
        for worker in trainer.worker_actors:
            assert ray.get(worker.health.remote())["version"] == trainer.version == result.step
            held = engine_weights(worker)
            assert set(learner) <= set(held)
            for name, tensor in learner.items():
                assert torch.equal(held[name], tensor.to(held[name].dtype)), name
        checked.append((result.step, trainer.pool.sync.formed))
        actors.append(trainer.worker_actors[0])
        if result.step == 1:
            killed.append(trainer.worker_actors[0])
            ray.kill(trainer.worker_actors[0], no_restart=True)

    cfg = job(tmp_path, tiny_qwen3_dir, task_files, "broadcast", steps=2, save_every=0, eval_every=0,
              max_new_tokens=8)
    cfg.rollout.weight_sync = WeightSync["broadcast"]
    trainer = Trainer(cfg, callbacks=[check])
    trainer.train()
    assert checked == [(1, 1), (2, 2)]  # formed at the first push, again with the replacement
    assert killed and actors[-1] != killed[0]
    rows = [r for r in read_metrics(trainer.run_dir) if r["step"] > 0]
    assert rows[-1]["workers/restarts"] == 1


# ---- subprocess runs

def write_config(path: Path, items: list[str]) -> Path:
    """A YAML recipe from dotted overrides (the subprocess gets the file, as a user would)."""
    import yaml

    recipe: dict = {}
    for item in items:
        key, _, value = item.partition("=")
        *sections, leaf = key.split(".")
        node = recipe
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(recipe))
    return path


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    return env


@pytest.mark.ray
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_driver_killed_with_sigkill_resumes_without_loss(ray_cluster, tiny_qwen3_dir, task_files, tmp_path, lora):
    """kill -9 of the driver mid-run, then `rl.resume=true`: no step redone or skipped, every collected trajectory
    trained once; with `learner.lora` every checkpoint holds its PEFT adapters and the resumed learner trains
    adapters only, as before the kill."""
    from k3rl.rl import checkpoint as ckpt

    address = ray_cluster.get_runtime_context().gcs_address
    items = overrides(tmp_path, tiny_qwen3_dir, task_files, "killed", mode="async", max_staleness=1, steps=6,
                      save_every=2, eval_every=3, max_new_tokens=96) + [f"ray.address={address}"]
    if lora:
        items += ["learner.lora.rank=4", "learner.lora.alpha=8"]
    config = write_config(tmp_path / "job.yaml", items)
    run_dir = tmp_path / "runs" / "killed"
    root = run_dir / "checkpoints"
    latest, state = kill_after_a_checkpoint(config, run_dir, tmp_path / "first.log")
    k = state["step"]
    assert k < 6, "the run finished before it could be killed; make the steps longer"
    unconsumed = Counter(t.group_id for t in state["unconsumed"])
    # async with one worker: the collection running during step k's update is awaited and saved
    assert sum(unconsumed.values()) == 4 and len(unconsumed) == 2
    logged = read_metrics(run_dir)
    assert max(r["step"] for r in logged) > k, "no step after the checkpoint was logged before the kill"
    before = {r["step"]: r for r in logged if r["step"] <= k}

    resumed = subprocess.run([sys.executable, "-m", "k3rl.rl.commands.train", str(config), "rl.resume=true"], cwd=REPO,
                             env=child_env(), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {latest}" in resumed.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert all(rows[s] == before[s] for s in range(k + 1))
    assert [r["policy/version"] for r in rows[1:]] == [1, 2, 3, 4, 5, 6]
    # every trajectory collected before the kill and not yet trained is trained right after resume
    assert {g: n for g, n, _ in rows[k + 1]["batch"]} == dict(unconsumed)
    assert rows[k + 1]["staleness/max"] <= 1
    # the run trained every group once (no step redone on old data), and the first 4 steps made
    # one whole pass over the 8 training tasks: none was lost in flight at the kill or the save
    groups = [g for r in rows for g, _, _ in r.get("batch", [])]
    assert len(groups) == len(set(groups)) == 12
    assert trained_tasks(rows[1:5]) == Counter({f"t{i}": 2 for i in range(8)})
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 4, 6]
    if lora:
        for _, path in ckpt.list_checkpoints(root):
            assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in (path / "adapter").iterdir()}
        assert len({r["train/trainable_params"] for r in rows[1:]}) == 1
        assert rows[-1]["train/optimizer_state_mib"] == rows[1]["train/optimizer_state_mib"]


@pytest.mark.ray
def test_two_node_cluster_places_workers_on_both_nodes(tiny_qwen3_dir, task_files, tmp_path):
    items = overrides(tmp_path, tiny_qwen3_dir, task_files, "two-node", steps=1, eval_every=0, save_every=0,
                      num_rollout_workers=2)
    script = textwrap.dedent(f"""
        import json, sys
        from ray.cluster_utils import Cluster
        cluster = Cluster()
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        try:
            import ray
            from k3rl.rl.config import JobConfig, load_config
            from k3rl.rl.orchestrator.trainer import Trainer
            cfg = load_config(None, {items!r} + ["ray.address=" + cluster.address], schema=JobConfig)
            placed = []
            def where(trainer, result):
                placed.extend(ray.get([a.node_id.remote() for a in trainer.worker_actors]))
            nodes = None
            trainer = Trainer(cfg, callbacks=[where])
            nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
            trainer.train()
            print("RESULT " + json.dumps({{"placed": placed, "nodes": nodes}}))
        finally:
            cluster.shutdown()
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(result["nodes"]) == 2
    assert sorted(result["placed"]) == result["nodes"]
    rows = read_metrics(tmp_path / "runs" / "two-node")
    assert [r["step"] for r in rows] == [1] and rows[0]["groups/trained"] == 2


@pytest.mark.vllm
def test_short_run_with_vllm_engine(ray_cluster, tiny_qwen3_dir, task_files, tmp_path):
    """The same loop with vLLM as the rollout engine: weights pushed after each step reach vLLM, and
    the learner's first-step logprobs agree with vLLM's behaviour logprobs (mismatch KL ≈ 0)."""
    from k3rl.rl.orchestrator.trainer import Trainer

    ray = ray_cluster
    seen = []

    def check(trainer, result):
        seen.append([h["version"] for h in ray.get([a.health.remote() for a in trainer.worker_actors])])
        assert {t.min_version for t in result.taken.trajectories} == {result.step - 1}

    trainer = Trainer(job(tmp_path, tiny_qwen3_dir, task_files, "vllm", engine="vllm", eval_every=0),
                      callbacks=[check])
    run_dir = trainer.train()
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2] and seen == [[1], [2]]
    assert rows[0]["train/mismatch_kl"] < 1e-3
    assert all(r["episode/tokens"] > 0 for r in rows)


@pytest.mark.vllm
def test_lora_run_serves_the_adapters_through_vllm(ray_cluster, tiny_qwen3_dir, task_files, tmp_path):
    """`learner.lora.push: adapters` with the vLLM engine through Ray: the workers build vLLM to serve LoRA adapters
    and take every step's push as one (rollout/vllm_engine.py; a worker built without `lora_rank` refuses the push).
    The tiny model earns no reward here, so its adapters stay at their zero start; tests/rl/test_lora.py checks
    vLLM's log-probs against a learner with trained adapters."""
    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    items = overrides(tmp_path, tiny_qwen3_dir, task_files, "vllm-lora", engine="vllm", eval_every=0, steps=3,
                      lr=5e-2) + ["learner.lora.rank=4", "learner.lora.alpha=8"]
    rows = [r for r in read_metrics(Trainer(load_config(None, items, schema=JobConfig)).train()) if r["step"] > 0]
    assert [r["policy/version"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert abs(r["train/mismatch_kl"]) < 1e-3, r["train/mismatch_kl"]


def kill_after_a_checkpoint(config: Path, run_dir: Path, log_path: Path) -> tuple[Path, dict]:
    """Start `python -m k3rl.rl.commands.train config`, kill -9 it once a checkpoint exists and a later step is already
    logged (so resume must cut metrics.jsonl back); the newest checkpoint and its trainer state."""
    from k3rl.rl import checkpoint as ckpt

    root = run_dir / "checkpoints"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "k3rl.rl.commands.train", str(config)], cwd=REPO, env=child_env(),
                                stdout=log, stderr=subprocess.STDOUT)

        def past_checkpoint() -> bool:
            saved = ckpt.list_checkpoints(root)
            return bool(saved) and any(step > saved[-1][0] for step in step_lines(run_dir))

        deadline = time.time() + 400  # only a slow (loaded) machine waits this long
        while not past_checkpoint() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    first_log = log_path.read_text()
    assert proc.returncode == -signal.SIGKILL, first_log[-3000:]
    latest = ckpt.find_latest(root)
    assert latest is not None, first_log[-3000:]
    return latest, ckpt.load_trainer_state(latest, restore_rng_state=False)


@pytest.mark.ray
def test_lora_run_pushes_adapters_to_the_engines_and_resumes_them(ray_cluster, tiny_qwen3_dir, task_files, tmp_path):
    """`learner.lora` through Ray: the engines sample with the learner's weights after every adapter push (the
    mismatch KL stays ~0), checkpoints hold PEFT adapter files, and a resumed run continues from them."""
    from transformers import AutoModelForCausalLM

    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    def cfg(steps: int, *extra: str):
        return load_config(None, overrides(tmp_path, tiny_qwen3_dir, task_files, "lora", steps=steps, eval_every=0)
                           + ["learner.lora.rank=4", "learner.lora.alpha=8", *extra], schema=JobConfig)

    run_dir = Trainer(cfg(2)).train()
    assert (run_dir / "checkpoints" / "step-000002" / "adapter" / "adapter_model.safetensors").is_file()
    resumed = Trainer(cfg(3, "rl.resume=true"))
    assert resumed.step == 2
    resumed.train()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["policy/version"] for r in rows] == [1, 2, 3]
    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).parameters())
    for r in rows:
        assert abs(r["train/mismatch_kl"]) < 1e-5, r["train/mismatch_kl"]
        assert 0 < r["train/trainable_params"] < 0.2 * total
