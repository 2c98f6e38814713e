"""The learner with expert parallelism × FSDP2 (`learner.expert_parallel`, `learner.fsdp`) equals the one-rank learner.

Two gloo ranks (torch.multiprocessing, cheaper than Ray actors here) each run a `Learner` with EP = 2 and FSDP on a
tiny float64 K3 (3 layers, 2 MoE layers, 4 experts top-2), while the test process runs the one-rank `Learner` on the
same global batch:
* the batch is split across the ranks as `LearnerGroup` splits it (`split_balanced` by tokens), and the lengths and
  `micro_batch_tokens` make rank 1 run more micro-batches than rank 0, so rank 0 must join with idle passes (a
  wrong idle pass changes the gradient or deadlocks); layer 1's router bias keeps every token off experts 2 and 3,
  so rank 1 (their owner) receives no rows there;
* `score` of uneven shares before the step equals the one-rank `score`;
* after one step: the loss and grad_norm metrics, and every weight and buffer (router biases after balancing)
  gathered by `named_weights`, equal the one-rank values within 1e-10;
* `save_into` (every rank: DCP shards; rank 0: the released-layout export and the layout file), then a second step;
  a fresh 2-rank learner loads the checkpoint and takes the same second step: its weights equal the uninterrupted
  run's; the export read by `k3rl.model.formats.load.load_model` equals the weights after step 1;
* the sharded checkpoint refuses to load into a one-rank learner, naming the layout.
The config check runs the way `k3rl train` does (load_config, then the trainer's checks before anything starts).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from k3_factory import make_config, make_model  # noqa: E402

RTOL, ATOL = 1e-10, 1e-12
# (prompt, sampled) token counts: 13 tokens for rank 0 in one micro-batch, the short ones to rank 1 in several
SHAPES = [(6, 7), (2, 2), (3, 2), (2, 3), (2, 2), (3, 3)]


def _model_dir(root: Path) -> Path:
    from k3rl.model.formats.save import save_model

    model = make_model(make_config(num_hidden_layers=3, kda_layers=(1, 2)), seed=0)
    with torch.no_grad():
        # Layer 1's router steers every token away from experts 2 and 3: rank 1 owns them and receives no rows.
        model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, -9.0, -9.0]))
    return save_model(model, root / "model")


def _trajectories() -> list:
    from k3rl.rollout.trajectory import TrajectoryBuilder

    g = np.random.default_rng(3)
    out = []
    for i, (p, n) in enumerate(SHAPES):
        builder = TrajectoryBuilder([int(t) for t in g.integers(1, 97, p)])
        builder.append_sampled([int(t) for t in g.integers(1, 97, n)], [float(x) for x in -g.random(n)], version=0)
        out.append(builder.finish(reward=float(i % 3 == 0) + 0.25 * i, group_id=f"g{i % 2}", task_id=f"t{i % 2}"))
    return out


def _cfg(model_dir: Path, **kw):
    from k3rl.rl.train.learner import LearnerConfig

    base = dict(model_path=str(model_dir), dtype="float64", lr=1e-2, weight_decay=0.1, max_grad_norm=0.05,
                micro_batch_tokens=8, share_prefix=False)
    return LearnerConfig(**{**base, **kw})


def _shares(trajectories: list, advantages: np.ndarray) -> list[tuple[list, list[float]]]:
    from k3rl.rl.train.parallel import split_balanced

    parts = split_balanced([len(t.tokens) for t in trajectories], 2)
    return [([trajectories[i] for i in part], [float(advantages[i]) for i in part]) for part in parts]


def _worker(rank: int, init_file: str, tmp: str, cfg, shares, score_shares) -> None:
    from k3rl.rl import checkpoint as ckpt
    from k3rl.rl.train.learner import Learner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        out = {}
        learner = Learner(cfg)
        out["score"] = learner.score(score_shares[rank])
        trajectories, advantages = shares[rank]
        out["m1"] = learner.train_step(trajectories, advantages)
        out["w1"] = dict(learner.named_weights())
        ck = Path(tmp) / "ck"
        learner.save_into(ck)
        dist.barrier()
        if rank == 0:
            ckpt.mark_complete(ck)
        out["m2"] = learner.train_step(trajectories, advantages)
        out["w2"] = dict(learner.named_weights())
        dist.barrier()
        resumed = Learner(cfg)
        resumed.load(ck)
        out["resumed_version"] = resumed.version
        out["resumed_m2"] = resumed.train_step(trajectories, advantages)
        out["resumed_w2"] = dict(resumed.named_weights())
        torch.save(out, Path(tmp) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: names differ: {set(got) ^ set(want)}"
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {k}: {m}")


def test_expert_parallel_fsdp_learner_equals_one_rank(tmp_path):
    from k3rl.model.formats.load import load_model
    from k3rl.rl import checkpoint as ckpt
    from k3rl.rl.algos import get_algo
    from k3rl.rl.train.advantages import compute_advantages
    from k3rl.rl.train.learner import Learner

    model_dir = _model_dir(tmp_path)
    trajectories = _trajectories()
    advantages = compute_advantages(get_algo("grpo"), trajectories)
    shares = _shares(trajectories, advantages)
    score_shares = [trajectories[:1], trajectories[1:]]  # uneven on purpose: 1 vs 4 micro-batches
    sharded = _cfg(model_dir, expert_parallel=2, fsdp=True)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.spawn(_worker, args=(os.path.join(tmp, "init"), tmp, sharded, shares, score_shares), nprocs=2,
                       join=False)
        one = Learner(_cfg(model_dir))  # meanwhile, the one-rank reference in this process
        want_score = one.score(trajectories)
        want_m1 = one.train_step(trajectories, list(advantages))
        want_w1 = dict(one.named_weights())
        want_m2 = one.train_step(trajectories, list(advantages))
        want_w2 = dict(one.named_weights())
        while not ctx.join():
            pass
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(2)]
        ck = Path(tmp) / "ck"
        exported = load_model(ck, torch.float64).state_dict()
        meta = json.loads((ck / "sharded_learner.json").read_text())
        with pytest.raises(ckpt.CheckpointError, match="expert_parallel 2.*rl.model_path"):
            Learner(_cfg(model_dir)).load(ck)

    r0, r1 = ranks
    assert r0["m1"]["micro_batches"] < r1["m1"]["micro_batches"], "rank 0 runs no idle pass: nothing tested"
    assert want_m1["grad_clipped"] == 1.0 and want_m1["loss"] != want_m2["loss"]
    bias = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    assert not torch.equal(want_w1[bias], torch.tensor([0.0, 0.0, -9.0, -9.0])), "no balancing: nothing tested"
    # scores: each rank its share, in order
    for got, want in zip(r0["score"] + r1["score"], want_score):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    for res in ranks:  # the metrics are global on every rank
        for m, want in (("m1", want_m1), ("m2", want_m2), ("resumed_m2", want_m2)):
            for key in ("loss", "grad_norm", "num_loss_tokens", "num_seqs"):
                torch.testing.assert_close(res[m][key], want[key], rtol=RTOL, atol=0, msg=f"{m} {key}")
    assert r1["w1"] == {} and r1["w2"] == {}  # only rank 0 gets the gathered weights
    _close(r0["w1"], want_w1, "weights after step 1")
    _close(r0["w2"], want_w2, "weights after step 2")
    _close(r0["resumed_w2"], want_w2, "resumed weights after step 2")
    assert r0["resumed_version"] == 1 and meta == {"version": 1, "world_size": 2, "expert_parallel": 2, "fsdp": True,
                                                   "optimizer": "adamw"}
    _close(exported, want_w1, "the Hugging Face export")


def test_train_config_takes_expert_parallel_and_fsdp(tmp_path, capsys):
    """`k3rl train … learner.expert_parallel=2 learner.fsdp=true` passes the config checks; what a sharded learner
    cannot run is refused before anything starts, naming the key."""
    from k3rl.rl.commands.train import main
    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.train.learner import LearnerConfig

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "tokenizer_config.json").write_text("{}")
    recipe = str(Path(__file__).parents[2] / "configs/rl/quickstart.yaml")
    good = [f"rl.model_path={model_dir}", "learner.num_ranks=2", "learner.expert_parallel=2", "learner.fsdp=true",
            "algo.args.kl_coef=0", "learner.share_prefix=false"]
    cfg = LearnerConfig.from_job(load_config(recipe, good, schema=JobConfig), model_dir)
    assert (cfg.expert_parallel, cfg.fsdp, cfg.sharded) == (2, True, True)
    for extra, key in [(["algo.args.kl_coef=0.05"], "kl_coef"), (["learner.share_prefix=true"], "share_prefix"),
                       (["learner.num_ranks=3"], "learner.num_ranks = 3"), (["learner.optimizer=muon"], "optimizer"),
                       (["learner.segment_tokens=64"], "segment_tokens"), (["learner.expert_parallel=0"], "≥ 1")]:
        assert main([recipe, *good, *extra]) == 2
        err = capsys.readouterr().err
        assert "learner." in err and key in err, err
