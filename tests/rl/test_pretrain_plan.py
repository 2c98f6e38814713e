"""rl/pretrain/plan.py: the plan of a staged pretraining run against what a real learner step holds (rl/pretrain/measure.py).

The activation memory the plan predicts for one micro-batch is compared with `measure_step_memory` (the peak of the
bytes autograd saves for backward during a real `Learner.train_step`, plus the states rl/train/segments.py keeps) on a
4-layer tiny K3 (3 KDA + 1 MLA, MoE, Block AttnRes in blocks of 2), in fp32 on the CPU. Measured when written
(plan / measured): 382.8 / 382.5 MiB at 512 × 4 rows, 404.8 / 404.8 MiB at 2048 × 1 row, 106.4 / 105.8 MiB for 2048
tokens in segments of 512 (the whole row unsegmented: 404.8 MiB); the same arithmetic was within 1 % on other shapes
(the 8-layer tiny, bf16, latent MoE, RoPE, no AttnRes, 4096 tokens in segments of 1024 or 2048). The test allows
MARGIN = ±10 %.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).parents[2]
MARGIN = 0.10
"""Allowed |plan / measured − 1| for the activation memory of one micro-batch."""
TINY = ["num_hidden_layers=4", "linear_attn_config.kda_layers=[1,2,3]", "linear_attn_config.full_attn_layers=[4]",
        "attn_res_block_size=2", "max_position_embeddings=32768"]
_measured: dict = {}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from k3rl.model.init import init_model
    from k3rl.rl.config import load_model_config

    out = tmp_path_factory.mktemp("plan") / "tiny"
    init_model(load_model_config(REPO / "configs/model/tiny.yaml", TINY), out, seed=0)
    return out


def _learner(model_dir, seq_len: int, rows: int, segment: int | None, optimizer: str = "adamw"):
    import k3rl.model.modeling  # noqa: F401  (load_policy misses the K3 model class when K3Config was touched first)
    from k3rl.rl.train.learner import Learner, LearnerConfig

    return Learner(LearnerConfig(model_path=str(model_dir), algo="nll", lr=1e-3, micro_batch_tokens=seq_len * rows,
                                 segment_tokens=segment, optimizer=optimizer))


def _rows(seq_len: int, rows: int, seed: int = 0):
    from k3rl.rl.train.supervised import as_trajectory

    rng = np.random.default_rng(seed)
    # seq_len + 1 tokens: the learner trains seq_len positions (inputs tokens[:-1])
    return [as_trajectory(rng.integers(3, 4000, seq_len + 1), np.ones(seq_len + 1)) for _ in range(rows)]


def _measure(model_dir, seq_len: int, rows: int, segment: int | None) -> dict:
    from k3rl.rl.pretrain.measure import measure_step_memory

    key = (seq_len, rows, segment)
    if key not in _measured:
        _measured[key] = measure_step_memory(_learner(model_dir, seq_len, rows, segment), _rows(seq_len, rows))
    return _measured[key]


def _plan(config, seq_len: int, rows: int, segment: int | None, tokens: int | None = None, optimizer: str = "adamw",
          gpu: str = "cpu-2core", num_ranks: int = 1):
    from k3rl.rl.config import LearnerSettings, PlanConfig, StageConfig, StageLearner
    from k3rl.rl.pretrain.plan import plan

    stage = StageConfig(seq_len=seq_len, tokens=tokens or seq_len * rows, batch_tokens=seq_len * rows,
                        learner=StageLearner(segment_tokens=segment))
    learner = LearnerSettings(micro_batch_tokens=seq_len * rows, optimizer=optimizer)
    return plan(config, [stage], learner, PlanConfig(gpu=gpu, num_gpus=1, mfu=0.3, dtype_bytes=4), num_ranks)[0]


@pytest.mark.parametrize("seq_len,rows,segment", [(512, 4, None), (2048, 1, None), (2048, 1, 512)],
                         ids=["512x4", "2048x1", "2048-in-512-segments"])
def test_activation_memory_matches_a_real_step(tiny_dir, seq_len, rows, segment):
    from k3rl.model.formats.config_json import read_config

    config = read_config(tiny_dir)
    measured = _measure(tiny_dir, seq_len, rows, segment)
    assert measured["micro_batches"] == 1
    predicted = _plan(config, seq_len, rows, segment)
    ratio = predicted.activation_bytes / measured["activation_bytes"]
    assert abs(ratio - 1) <= MARGIN, (f"plan {predicted.activation_bytes / 2**20:.1f} MiB vs measured "
                                      f"{measured['activation_bytes'] / 2**20:.1f} MiB ({ratio:.3f})")
    if segment:
        assert measured["segment_state_bytes"] > 0
        whole = _plan(config, seq_len, rows, None)
        assert predicted.segment_tokens == segment and whole.segment_tokens is None
        assert measured["activation_bytes"] < 0.4 * whole.activation_bytes  # one segment, not the whole row


def test_optimizer_memory_matches_the_learners_states(tiny_dir):
    from k3rl.model.formats.config_json import read_config

    config = read_config(tiny_dir)
    measured = _measure(tiny_dir, 512, 4, None)
    predicted = _plan(config, 512, 4, None)
    assert predicted.optimizer_state_bytes == pytest.approx(measured["optimizer_state_bytes"], rel=0.02)
    assert predicted.weight_bytes == measured["param_bytes"]
    assert predicted.grad_bytes == pytest.approx(measured["grad_bytes"], rel=0.02)
    replicated = predicted.weight_bytes + predicted.grad_bytes + predicted.optimizer_state_bytes
    assert predicted.optimizer_bytes_replicated == replicated

    # Muon: one momentum for the hidden matrices, AdamW for the rest
    learner = _learner(tiny_dir, 64, 1, None, optimizer="muon")
    from k3rl.rl.pretrain.measure import measure_step_memory

    muon = measure_step_memory(learner, _rows(64, 1))
    predicted = _plan(config, 64, 1, None, optimizer="muon")
    assert predicted.optimizer_state_bytes == pytest.approx(muon["optimizer_state_bytes"], rel=0.02)
    assert predicted.optimizer_state_bytes < 0.7 * _plan(config, 64, 1, None).optimizer_state_bytes


def test_steps_round_the_budget_up_to_whole_batches():
    from k3rl.rl.config import load_model_config

    config = load_model_config(REPO / "configs/model/tiny.yaml")
    p = _plan(config, 128, 2, None, tokens=1000)  # batch 256 tokens
    assert (p.steps, p.tokens, p.rows_per_step) == (4, 1024, 2)
    assert _plan(config, 128, 2, None, tokens=1024).steps == 4
    assert _plan(config, 128, 2, None, tokens=1025).steps == 5
    two = _plan(config, 128, 2, None, num_ranks=2)
    assert (two.rows_per_rank, two.micro_batch_rows, two.micro_batches) == (1, 1, 1)


def test_flops_per_token_grow_with_length_only_with_mla_layers():
    from k3rl.rl.config import load_model_config

    hybrid = load_model_config(REPO / "configs/model/tiny.yaml")
    kda_only = load_model_config(REPO / "configs/model/tiny.yaml", ["linear_attn_config.kda_layers=[1,2,3,4,5,6,7,8]",
                                                                    "linear_attn_config.full_attn_layers=[]"])
    assert not kda_only.linear_attn_config["full_attn_layers"]
    for config, grows in ((hybrid, True), (kda_only, False)):
        short, long = (_plan(config, n, 1, None).flops_per_token for n in (512, 8192))
        assert (long > short) == grows
        if not grows:
            assert long == short
    p = _plan(hybrid, 512, 1, None)
    assert p.flops_per_token == 3 * sum(p.forward_flops_per_token.values())
    assert p.flops == p.flops_per_token * p.tokens and p.recompute_flops == 0
    seg = _plan(hybrid, 8192, 1, 2048)  # segment by segment: one more forward
    assert seg.recompute_flops == pytest.approx(seg.flops / 3)
    assert seg.time_s == pytest.approx((seg.flops + seg.recompute_flops) / (190e9 * 0.3))


def test_reference_plan_2p8t_on_the_meta_device():
    import k3rl.model.modeling  # noqa: F401  (imports are not what is timed)
    from k3rl.model.config import K3Config
    from k3rl.rl.config import load_config
    from k3rl.rl.pretrain.param_memory import parameter_summary
    from k3rl.rl.pretrain.plan import GPUS, format_plan, plan

    cfg = load_config(REPO / "configs/pretrain/staged.yaml")
    config = K3Config.from_model_config(cfg.model)
    start = time.perf_counter()
    summary = parameter_summary(config, str(cfg.learner.optimizer))
    plans = plan(config, list(cfg.pretrain.stages), cfg.learner, cfg.pretrain.plan, cfg.learner.num_ranks, summary)
    text = format_plan(plans, summary, str(cfg.pretrain.plan.gpu), cfg.pretrain.plan.mfu)
    assert time.perf_counter() - start < 3.0
    total, active = re.search(r"([\d.]+)T total / ([\d.]+)B active", text).groups()
    assert float(total) == pytest.approx(2.78, abs=0.01) and float(active) == pytest.approx(105, abs=1)
    assert [p.seq_len for p in plans] == [8192, 65536, 262144, 1048576]
    assert [p.segment_tokens for p in plans] == [None, None, 65536, 65536]
    # 6·N·D dominates: 15.5T tokens × 105B active ≈ 1e25 training FLOPs
    assert sum(p.flops for p in plans) == pytest.approx(6 * summary.active * sum(p.tokens for p in plans), rel=0.1)
    h200 = GPUS["h200"]
    assert plans[0].time_s == pytest.approx(plans[0].flops / (4096 * h200.peak_flops * 0.35))
    assert plans[0].optimizer_bytes_sharded * 4096 >= plans[0].optimizer_bytes_replicated
    # a segmented stage holds one segment: its activations are those of the 64K stage plus the segment states
    assert plans[3].activation_bytes < 1.1 * plans[1].activation_bytes


def test_format_plan_names_every_stage_and_the_cluster():
    from k3rl.rl.config import load_config
    from k3rl.rl.pretrain.plan import plan_from_job

    text, plans = plan_from_job(load_config(REPO / "configs/pretrain/cpu.yaml"))
    assert len(plans) == 4 and "cpu-2core" in text
    for length in ("512", "2K", "8K", "32K"):
        assert re.search(rf"\b{length}\b", text), length
    assert "total" in text and "assumptions" in text
    assert re.search(r"5\.1M total / 3\.0\dM active", text)


def test_plan_from_job_reads_the_model_dir_and_the_ranks(tiny_dir):
    from k3rl.rl.config import load_config
    from k3rl.rl.pretrain.plan import plan_from_job

    cfg = load_config(REPO / "configs/pretrain/cpu.yaml", [f"pretrain.model_dir={tiny_dir}", "learner.num_ranks=2",
                                                            "pretrain.plan.gpu=h100", "pretrain.plan.num_gpus=8"])
    text, plans = plan_from_job(cfg)
    assert "4 layers: 3 KDA, 1 MLA" in text and "8 × h100" in text
    assert plans[0].rows_per_rank == plans[0].rows_per_step // 2
    with pytest.raises(ValueError, match="pretrain.plan.gpu"):
        plan_from_job(load_config(REPO / "configs/pretrain/cpu.yaml", ["pretrain.plan.gpu=tpu"]))


def test_recompute_modes_in_the_plan(tiny_dir):
    """learner.recompute in rl/pretrain/cost.py and the plan: selective drops the KDA, MoE and AttnRes parts for the
    largest one of them, full keeps each layer's input and the largest layer; a segmented stage takes `full` as
    `selective` (the model's rule); the configured mode is the one planned, one more forward counted."""
    from k3rl.model.formats.config_json import read_config
    from k3rl.rl.config import LearnerSettings, PlanConfig, StageConfig, StageLearner
    from k3rl.rl.pretrain.cost import activation_bytes
    from k3rl.rl.pretrain.plan import GPUS, format_plan, gpus_to_fit, plan

    config = read_config(tiny_dir)
    none, sel, full = (activation_bytes(config, 2, 1024, None, 4, "cpu", recompute=m)
                       for m in ("none", "selective", "full"))
    assert activation_bytes(config, 2, 1024, None, 4, "cpu") == none
    assert sum(full.values()) < sum(sel.values()) < sum(none.values())
    assert sel["kda"] == sel["moe"] == sel["attn_res"] == 0 and sel["mla"] == none["mla"]
    assert sel["recompute"] == max(none["kda"] / 3, none["moe"] / 3, none["attn_res"] / 4)  # 3 KDA, 3 MoE, 4 layers
    assert full["layer_inputs"] == (4 + 2) * 2 * 1024 * config.hidden_size * 4  # 4 layer outputs, 2 block sums
    assert full["recompute"] > sel["recompute"]
    seg = {m: activation_bytes(config, 1, 4096, 1024, 4, "cpu", recompute=m) for m in ("selective", "full")}
    assert seg["full"] == seg["selective"]
    with pytest.raises(ValueError, match="recompute: 'some'"):
        activation_bytes(config, 1, 64, None, 4, recompute="some")

    stage = StageConfig(seq_len=1024, tokens=8192, batch_tokens=2048, learner=StageLearner())
    plans = {m: plan(config, [stage], LearnerSettings(micro_batch_tokens=2048, recompute=m),
                     PlanConfig(gpu="cpu-2core", num_gpus=1, mfu=0.3, dtype_bytes=4))[0]
             for m in ("none", "selective", "full")}
    for m, p in plans.items():
        assert p.recompute == m and p.activation_bytes == p.activation_by_recompute[m]
        assert p.recompute_flops == (0 if m == "none" else p.flops / 3)  # one more forward
    assert plans["full"].activation_bytes == sum(full.values())
    cpu = GPUS["cpu-2core"]
    fits = [gpus_to_fit(plans["none"], m, cpu) for m in ("none", "selective", "full")]
    assert fits[0] >= fits[1] >= fits[2] >= 1
    text = format_plan(list(plans.values())[:1], "tiny", "cpu-2core")
    assert "none / selective / full" in text and "to fit" in text
