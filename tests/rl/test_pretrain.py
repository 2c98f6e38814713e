"""Staged pretraining (`k3rl pretrain`, rl/pretrain/climb.py): packed rows train as separate documents, the stage
hand-off, the RoPE base reaching MLA only, resume after kill -9 with the same data order, named errors for bad stage
lists. The data pipeline has its own tests (test_pretrain_data.py), the plan too (test_pretrain_plan.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from k3rl.model.formats.config_json import read_config
from k3rl.rl.config import ConfigError, JobConfig, load_config
from k3rl.rollout.trajectory import Trajectory

REPO = Path(__file__).parents[2]
TINY4 = ["model.num_hidden_layers=4", "model.linear_attn_config.kda_layers=[1,2,3]",
         "model.linear_attn_config.full_attn_layers=[4]", "model.max_position_embeddings=4096"]


def _model(tmp: Path, nope: bool) -> Path:
    from k3rl.rl.orchestrator.sft import init_model

    cfg = load_config(REPO / "configs/model/tiny.yaml", TINY4 + [f"model.mla_use_nope={str(nope).lower()}"], JobConfig)
    return init_model(cfg.model, tmp / ("nope" if nope else "rope"), seed=0)


@pytest.fixture(scope="module")
def rope_dir(tmp_path_factory) -> Path:
    return _model(tmp_path_factory.mktemp("pretrain-model"), nope=False)


def packed(docs: list[np.ndarray]) -> Trajectory:
    """The documents laid end to end as one row, positions restarting at each (rl/pretrain/packing.py's layout)."""
    tokens = np.concatenate(docs).astype(np.int32)
    positions = np.concatenate([np.arange(len(d)) for d in docs]).astype(np.int32)
    return row(tokens, positions)


def row(tokens: np.ndarray, positions: np.ndarray | None = None) -> Trajectory:
    n = len(tokens)
    mask = np.ones(n, np.uint8)
    if positions is None:
        mask[0] = 0
    else:
        mask[positions == 0] = 0
    return Trajectory(tokens=np.asarray(tokens, np.int32), loss_mask=mask, logprobs=np.zeros(n, np.float32),
                      versions=np.full(n, -1, np.int32), turn_spans=np.zeros((0, 2), np.int32), prompt_len=0,
                      position_ids=positions)


@pytest.mark.parametrize("segment", [None, 128], ids=["one-forward", "segments"])
def test_packed_training_equals_separate_documents(rope_dir, segment):
    """A packed row of four documents (one longer than the segment) gives the same log-probs, loss and gradients as
    the four documents trained as separate sequences (float64)."""
    from k3rl.rl.train.learner import Learner, LearnerConfig

    rng = np.random.default_rng(0)
    docs = [rng.integers(20, 4000, n) for n in (300, 41, 77, 150)]
    cfg = LearnerConfig(model_path=str(rope_dir), algo="nll", lr=1e-3, dtype="float64", segment_tokens=segment,
                        micro_batch_tokens=4096, max_grad_norm=0.0)
    a, b = Learner(cfg), Learner(cfg)
    lp_packed, = a.score([packed(docs)])
    lp_separate = np.concatenate(a.score([row(d) for d in docs]))
    assert lp_packed.shape == (sum(len(d) - 1 for d in docs),)
    np.testing.assert_allclose(lp_packed, lp_separate, rtol=0, atol=1e-10)

    grads = []
    for learner, batch in ((a, [packed(docs)]), (b, [row(d) for d in docs])):
        captured = {}
        hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: captured.__setitem__(n, p.grad.clone()))
                 for n, p in learner.model.named_parameters()]
        metrics = learner.train_step(batch)
        for h in hooks:
            h.remove()
        grads.append((metrics, captured))
    (ma, ga), (mb, gb) = grads
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-12) and ma["num_loss_tokens"] == mb["num_loss_tokens"]
    assert ga.keys() == gb.keys() and ga
    for name in ga:  # K3 keeps a few parameters in fp32 (conv weights, gate constants: model/kda.py)
        scale = float(gb[name].abs().max()) * (1e-9 if gb[name].dtype == torch.float64 else 1e-5)
        torch.testing.assert_close(ga[name], gb[name], rtol=0, atol=scale, msg=lambda m, n=name: f"{n}: {m}")
    # a different cut (the boundary moved by one token) is a different computation: the test can fail
    moved = [docs[0][:-1], np.concatenate([docs[0][-1:], docs[1]]), docs[2], docs[3]]
    assert not np.allclose(a.score([packed(moved)])[0], lp_packed, atol=1e-6)


def test_rope_base_reaches_mla_only(rope_dir, tmp_path):
    """`rope_theta` changes what the MLA layers compute and nothing the KDA layers compute, and is saved with the
    model; a NoPE model refuses one (and a stage's rope_theta is dropped for it, with a note)."""
    from k3rl.rl.train.learner import Learner, LearnerConfig

    base = Learner(LearnerConfig(model_path=str(rope_dir), algo="nll", dtype="float64"))
    raised = Learner(LearnerConfig(model_path=str(rope_dir), algo="nll", dtype="float64", rope_theta=640000.0))
    calls = {}

    def keep(name):
        def hook(module, args, kwargs, out):
            calls[name] = (args, kwargs, out)
        return hook

    hooks = [layer.self_attn.register_forward_hook(keep(i), with_kwargs=True)
             for i, layer in enumerate(base.model.model.layers)]
    ids = torch.randint(20, 4000, (1, 200))
    with torch.no_grad():
        base.model(ids, position_ids=torch.arange(200)[None])
    for h in hooks:
        h.remove()
    kinds = {}
    with torch.no_grad():
        for i, layer in enumerate(raised.model.model.layers):
            args, kwargs, out = calls[i]
            again = layer.self_attn(*args, **kwargs)
            kinds[i] = (type(layer.self_attn).__name__, torch.equal(again, out))
    assert {k for k, same in kinds.values() if same} == {"KimiDeltaAttention"}, kinds
    assert {k for k, same in kinds.values() if not same} == {"MultiheadLatentAttention"}, kinds

    raised.save(tmp_path / "saved")
    assert read_config(tmp_path / "saved").rope_theta == 640000.0  # in config.json (text_config in kimi_k3)
    nope = _model(tmp_path, nope=True)
    with pytest.raises(ValueError, match="no RoPE layers"):
        Learner(LearnerConfig(model_path=str(nope), algo="nll", rope_theta=40000.0))


def _write_corpus(root: Path) -> dict[str, Path]:
    """A short-document and a long-document (grouped by book) JSONL source, from the built-in wiki summaries."""
    from k3rl.envs.sources import wiki_records

    records = wiki_records()[:1200]
    short, long = root / "short.jsonl", root / "long.jsonl"
    with open(short, "w") as f:
        for r in records[:600]:
            f.write(json.dumps({"text": r["extract"]}) + "\n")
    with open(long, "w") as f:
        for i, r in enumerate(records[600:]):
            f.write(json.dumps({"book": f"book{i % 6}", "text": r["extract"]}) + "\n")
    return {"short": short, "long": long}


def climb_config(tmp: Path, name: str, *extra: str, stages: str | None = None) -> Path:
    """A two-stage climb on the tiny 4-layer RoPE model: 256 → 1024 tokens, 4 steps each, a checkpoint every step."""
    files = _write_corpus(tmp) if not (tmp / "short.jsonl").is_file() else {"short": tmp / "short.jsonl",
                                                                             "long": tmp / "long.jsonl"}
    stages = stages or (
        "    - {seq_len: 256, tokens: 2048, batch_tokens: 512, learner: {lr: 3.0e-3, warmup_steps: 1, lr_scheduler: wsd}, "
        "decay_fraction: 0.5, rope_theta: 10000, mixture: {short: 1.0, long: 1.0}}\n"
        "    - {seq_len: 1024, tokens: 4096, batch_tokens: 1024, learner: {lr: 2.0e-3, lr_scheduler: cosine, "
        "segment_tokens: 256}, rope_theta: 40000, optimizer: keep, mixture: {long: 1.0}}\n")
    path = tmp / f"{name}.yaml"
    path.write_text(
        f"base: {REPO / 'configs/model/tiny.yaml'}\n"
        f"run: {{name: {name}, output_dir: {tmp / 'runs'}}}\n"
        "model: {num_hidden_layers: 4, max_position_embeddings: 4096, mla_use_nope: false,\n"
        "        linear_attn_config: {kda_layers: [1, 2, 3], full_attn_layers: [4]}}\n"
        "learner: {micro_batch_tokens: 2048}\n"
        "eval: {families: [needle], num_tasks: 1}\n"
        "rollout: {max_new_tokens: 8, max_turns: 1}\n"
        "pretrain:\n"
        f"  sources: {{short: {{path: {files['short']}}}, long: {{path: {files['long']}, group_by: book, "
        "min_tokens: 1025}}\n"
        "  heldout_source: long\n  heldout_docs: 1\n  save_every: 1\n  eval_grid: false\n"
        f"  stages:\n{stages}")
    return path


def child_env(tmp: Path) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), K3RL_DATA=str(tmp / "data"), OMP_NUM_THREADS="1")
    return env


def metrics(stage_dir: Path) -> list[dict]:
    from k3rl.rl.metrics import read_metrics

    return [r for r in read_metrics(stage_dir) if "data" in r]


def test_stage_handoff_takes_previous_weights_and_optimizer_policy(tmp_path, monkeypatch):
    """Stage 2 starts from stage 1's final checkpoint: the same weights; `optimizer: keep` its AdamW moments with
    stage 2's own learning rate at step 0, `reset` none; the RoPE base is stage 2's."""
    from k3rl.rl.config import OptimizerHandoff
    from k3rl.rl.pretrain.climb import Climb
    from k3rl.rl.train.learner import Learner

    monkeypatch.setenv("K3RL_DATA", str(tmp_path / "data"))
    cfg = load_config(climb_config(tmp_path, "handoff"), [], JobConfig)
    climb = Climb(cfg)
    learner, start = climb.stage_learner(0, None, None)
    rng = np.random.default_rng(0)
    learner.train_step([row(rng.integers(20, 4000, 256)) for _ in range(2)])
    final = tmp_path / "stage1-final"
    learner.save(final)
    for policy in ("keep", "reset"):
        cfg.pretrain.stages[1].optimizer = OptimizerHandoff[policy]
        nxt, start = Climb(cfg).stage_learner(1, final, None)
        assert isinstance(nxt, Learner) and start == 0 and nxt.version == 0
        for (n, p), q in zip(learner.model.named_parameters(), nxt.model.parameters()):
            assert torch.equal(p, q), n
        assert nxt.model.config.rope_theta == 40000.0 and learner.model.config.rope_theta == 10000.0
        old, new = learner.optimizers[0], nxt.optimizers[0]
        assert new.param_groups[0]["lr"] == 0.002  # stage 2's rate (cosine, no warmup: step 0 at the peak)
        if policy == "keep":
            assert len(new.state) == len(old.state) > 0
            for p_old, p_new in zip(learner.params, nxt.params):
                assert (p_old in old.state) == (p_new in new.state)
                if p_old not in old.state:  # no gradient reached it in stage 1's step (e.g. an unrouted expert)
                    continue
                torch.testing.assert_close(new.state[p_new]["exp_avg"], old.state[p_old]["exp_avg"], rtol=0, atol=0)
                assert int(new.state[p_new]["step"]) == int(old.state[p_old]["step"]) == 1
        else:
            assert len(new.state) == 0


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_resume_after_kill9_mid_stage_keeps_the_data_order(tmp_path):
    """kill -9 during stage 2 (after a checkpoint, with a later step already logged); the same command resumes the
    stage from its checkpoint: every step's rows (their digest) and the final weights equal an uninterrupted run's."""
    from k3rl.model.formats.load import read_state_dict
    from k3rl.rl import checkpoint as ckpt

    whole = climb_config(tmp_path, "whole")
    done = subprocess.run([sys.executable, "-m", "k3rl.rl.commands.pretrain", str(whole)], cwd=REPO, env=child_env(tmp_path),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = tmp_path / "runs"
    assert (runs / "whole/stage1-256/final").is_dir() and (runs / "whole/stage2-1K/final").is_dir()
    assert (runs / "whole/stage2-1K/loss.png").is_file() and (runs / "whole/position_loss.png").is_file()

    killed = climb_config(tmp_path, "killed")
    stage2 = runs / "killed/stage2-1K"
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "k3rl.rl.commands.pretrain", str(killed)], cwd=REPO, env=child_env(tmp_path),
                                stdout=out, stderr=subprocess.STDOUT)

        def mid_stage() -> bool:
            saved = ckpt.list_checkpoints(stage2 / "checkpoints")
            return bool(saved) and any(r["step"] > saved[-1][0] for r in metrics(stage2))

        _kill_when(proc, mid_stage)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    assert not (stage2 / "final").exists()
    resumed = subprocess.run([sys.executable, "-m", "k3rl.rl.commands.pretrain", str(killed)], cwd=REPO, env=child_env(tmp_path),
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "stage1-256: finished earlier" in resumed.stdout and "stage2-1K: resuming at step" in resumed.stdout

    from k3rl.rl.metrics import read_metrics

    for name in ("stage1-256", "stage2-1K"):
        a, b = metrics(runs / "whole" / name), metrics(runs / "killed" / name)
        assert [(r["step"], r["data"]) for r in a] == [(r["step"], r["data"]) for r in b], name
        assert [r["step"] for r in b] == [1, 2, 3, 4]  # no step repeated or skipped
        # one row per step, the held-out start (step 0) and end (the last step's row) included
        for run in ("whole", "killed"):
            rows = read_metrics(runs / run / name)
            assert [r["step"] for r in rows] == [0, 1, 2, 3, 4], (run, name)
            for row in (rows[0], rows[-1]):
                assert any(k.startswith("heldout/nll_") for k in row), (run, name, row["step"])
        for x, y in zip(a, b):
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-5), (name, x["step"])
    wa = read_state_dict(runs / "whole/stage2-1K/final")
    wb = read_state_dict(runs / "killed/stage2-1K/final")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-6, msg=k)
    heldout = json.loads((runs / "whole/stage2-1K/heldout.json").read_text())
    assert heldout["start"]["buckets"][-1] == [512, 1024] and heldout["end"]["step"] == 4


BAD_STAGES = [
    ("    - {seq_len: 1024, tokens: 4096, batch_tokens: 1024, learner: {lr: 1.0e-3}}\n"
     "    - {seq_len: 512, tokens: 4096, batch_tokens: 1024, learner: {lr: 1.0e-3}}\n",
     r"pretrain.stages\[1\].seq_len: 512 is not longer than stage 0's 1024"),
    ("    - {seq_len: 256, tokens: 0, batch_tokens: 512, learner: {lr: 1.0e-3}}\n", r"pretrain.stages\[0\].tokens: must be > 0"),
    ("    - {seq_len: 256, tokens: 2048, batch_tokens: 512, learner: {lr: 1.0e-3}}\n"
     "    - {seq_len: 8192, tokens: 8192, batch_tokens: 8192, learner: {lr: 1.0e-3}}\n",
     r"pretrain.stages\[1\].seq_len: 8192 is above the model's maximum \(max_position_embeddings = 4096\)"),
    ("    - {seq_len: 256, tokens: 2048, batch_tokens: 300, learner: {lr: 1.0e-3}}\n",
     r"pretrain.stages\[0\].batch_tokens: must be a positive multiple of seq_len 256"),
    ("    - {seq_len: 256, tokens: 2048, batch_tokens: 512, learner: {lr: 1.0e-3}, mixture: {books: 1.0}}\n",
     r"pretrain.stages\[0\].mixture: unknown source\(s\) \['books'\]"),
    ("    - {seq_len: 256, tokens: 2048, batch_tokens: 512, learner: {lr: 1.0e-3, warmup_steps: 9}}\n",
     r"pretrain.stages\[0\].learner.warmup_steps: 9 warmup \+ 1 decay steps do not fit in the stage.s 4 steps"),
    ("    []\n", r"pretrain.stages: empty"),
]


@pytest.mark.parametrize("stages,message", BAD_STAGES, ids=["not-increasing", "zero-tokens", "above-max",
                                                              "batch-not-multiple", "unknown-source", "warmup", "empty"])
def test_bad_stage_lists_are_named_before_work_starts(tmp_path, capsys, stages, message):
    from k3rl.rl.commands.cli import main

    config = climb_config(tmp_path, "bad", stages=stages)
    assert main(["pretrain", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3rl pretrain: ") and __import__("re").search(message, err), err
    assert not (tmp_path / "runs/bad").exists()  # nothing written, no data tokenized


def test_nope_model_ignores_rope_base_with_a_note(tmp_path, monkeypatch):
    from k3rl.rl.pretrain.climb import check
    from k3rl.rl.pretrain.stages import learner_config

    cfg = load_config(climb_config(tmp_path, "nope"), ["model.mla_use_nope=true"], JobConfig)
    config, notes = check(cfg)
    assert notes and "ignored" in notes[0] and "NoPE" in notes[0]
    assert learner_config(cfg, 1, tmp_path, config).rope_theta is None
    with pytest.raises(ConfigError, match="held-out|heldout_source"):
        check(load_config(climb_config(tmp_path, "nope"), ["pretrain.heldout_source=books"], JobConfig))


@pytest.mark.ray
def test_data_parallel_ranks_on_ray_train_as_one(ray_cluster, tmp_path, monkeypatch):
    """`learner.num_ranks: 2` runs a stage on two Ray learner ranks (the RL learner's `LearnerGroup`): the same
    rows per step and the same losses as one rank."""
    from transformers import AutoTokenizer

    from k3rl.rl.metrics import read_metrics
    from k3rl.rl.pretrain.climb import Climb

    monkeypatch.setenv("K3RL_DATA", str(tmp_path / "data"))
    one_stage = ("    - {seq_len: 256, tokens: 1536, batch_tokens: 512, learner: {lr: 3.0e-3, lr_scheduler: constant}, "
                 "rope_theta: 10000, mixture: {short: 1.0, long: 1.0}}\n")
    losses = {}
    for ranks in (1, 2):
        cfg = load_config(climb_config(tmp_path, f"dp{ranks}", stages=one_stage),
                          [f"learner.num_ranks={ranks}", "pretrain.heldout_docs=0"], JobConfig)
        climb = Climb(cfg)
        climb.load_data(AutoTokenizer.from_pretrained(climb.start_model()))
        final = climb.run_stage(0, None)
        assert (final / "model.safetensors.index.json").is_file() and (final / "rng-rank00000.pt").is_file()
        if ranks == 2:
            assert (final / "rng-rank00001.pt").is_file()
        losses[ranks] = [(r["step"], r["data"], r["loss"], r.get("num_ranks", 1.0)) for r in read_metrics(final.parent)
                         if "data" in r]
    assert [r[:2] for r in losses[1]] == [r[:2] for r in losses[2]] and len(losses[1]) == 3
    assert {r[3] for r in losses[2]} == {2.0}
    for a, b in zip(losses[1], losses[2]):
        assert a[2] == pytest.approx(b[2], rel=2e-4), (a, b)
