"""The cost of a staged pretraining run, computed without running it: what `k3rl pretrain CONFIG --plan` prints.

For every stage of `pretrain.stages` (rl/config/pretrain.py `StageConfig`): the token budget rounded up to whole optimizer
steps, the steps and rows, the training FLOPs and the activations of one micro-batch (rl/pretrain/cost.py: rows
per micro-batch = `learner.micro_batch_tokens // seq_len`, at least 1, at most the rank's rows of a step and
`learner.micro_batch_seqs`), the weights, gradients and optimizer states (rl/pretrain/param_memory.py) and the
time on the cluster of `pretrain.plan`. A stage trained segment by segment (its `learner.segment_tokens` below `seq_len`,
rl/train/segments.py) runs one more forward (pass 1, no grad): `recompute_flops`, counted in the printed FLOPs and
in the time. Time = FLOPs / (num_gpus × peak × MFU). Nothing is allocated: the rest is arithmetic.

The states are shown twice: replicated (every data-parallel rank holds everything, the learner without
`learner.fsdp`) and sharded evenly over the cluster's GPUs (what FSDP2 with expert parallelism gives,
`learner.fsdp` and `learner.expert_parallel`, rl/train/parallel.py).
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from k3rl.rl.pretrain.cost import activation_bytes, forward_flops_per_token
from k3rl.rl.pretrain.param_memory import ParamSummary, dtype_bytes, parameter_summary

GiB = 2**30


@dataclass(frozen=True)
class GPU:
    """An accelerator of a named cluster."""

    name: str
    peak_flops: float
    """Peak dense FLOP/s in the training dtype (bf16 on GPUs)."""
    memory_bytes: int
    kernels: str
    """`cuda` (fused SDPA and SiTU-GLU kernels) or `cpu` (PyTorch's CPU paths): what decides some saved tensors."""
    source: str


GPUS: dict[str, GPU] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 tensor core (1,979 with 2:4 sparsity), 80 GB HBM3.
    "h100": GPU("h100", 989e12, 80 * GiB, "cuda", "H100 SXM datasheet: 989 TFLOP/s dense bf16, 80 GB"),
    # NVIDIA H200 SXM datasheet: same compute as H100 (989 TFLOP/s dense BF16), 141 GB HBM3e; ~790 TFLOP/s measured
    # on a bf16 dense GEMM on this project's H200, so an MFU of 0.35 of peak is ~0.44 of what a GEMM reaches.
    "h200": GPU("h200", 989e12, 141 * 10**9, "cuda", "H200 SXM datasheet: 989 TFLOP/s dense bf16 (~790 measured), "
                "141 GB"),
    # NVIDIA HGX B200 datasheet: 36 PFLOP/s FP16/BF16 for 8 GPUs with 2:4 sparsity → 2.25 PFLOP/s dense BF16 per GPU;
    # 192 GB HBM3e per GPU.
    "b200": GPU("b200", 2.25e15, 192 * 10**9, "cuda", "B200 (HGX B200 datasheet): 2.25 PFLOP/s dense bf16, 192 GB"),
    # This machine: 2 Zen 4 cores, sgemm ≈ 190 GFLOP/s fp32 on both (docs/performance.md), 24 GiB of memory.
    "cpu-2core": GPU("cpu-2core", 190e9, 24 * GiB, "cpu", "this machine: 2 cores, ≈ 190 GFLOP/s fp32 sgemm, 24 GiB"),
}


@dataclass
class StagePlan:
    """The cost of one stage (see the module docstring for what is counted)."""

    index: int
    seq_len: int
    segment_tokens: Optional[int]
    """Segment length when the stage trains segment by segment (seq_len > segment_tokens), else None."""
    tokens: int
    """Token budget rounded up to whole steps: steps × batch_tokens."""
    steps: int
    batch_tokens: int
    rows_per_step: int
    """Rows of seq_len tokens per optimizer step, over all ranks."""
    rows_per_rank: int
    micro_batch_rows: int
    micro_batches: int
    """Micro-batches per rank and step."""
    forward_flops_per_token: dict[str, float]
    """Forward FLOPs per token by part: `matmul` (2 × active non-embedding parameters), `mla_attention`, `kda`."""
    flops_per_token: float
    """Training FLOPs per token: 3 × forward."""
    flops: float
    """Training FLOPs of the stage: flops_per_token × tokens."""
    recompute_flops: float
    """The extra no-grad forward of a segmented stage (pass 1 of rl/train/segments.py), plus one forward under
    `learner.recompute` full or selective (an upper bound for selective); 0 otherwise."""
    activation_bytes: int
    """Bytes saved for backward by one micro-batch on one rank (+ the segment states of a segmented stage), under
    the learner's `recompute` mode."""
    activation_breakdown: dict[str, int]
    recompute: str
    """`learner.recompute` (none, full, selective; rl/pretrain/cost.py)."""
    activation_by_recompute: dict[str, int]
    """activation_bytes under each recompute mode."""
    activation_dtype_bytes: int
    """Bytes per activation value (`pretrain.plan.dtype_bytes`); what the model computes in fp32 stays fp32."""
    param_dtype_bytes: int
    """Bytes per parameter (the learner's dtype)."""
    weight_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    num_gpus: int
    gpu: str
    time_s: float
    """(flops + recompute_flops) / (num_gpus × peak × mfu)."""

    @property
    def optimizer_bytes_replicated(self) -> int:
        """Weights + gradients + optimizer states on every rank when each holds everything (no `learner.fsdp`)."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_state_bytes

    @property
    def optimizer_bytes_sharded(self) -> int:
        """The same, sharded evenly over the cluster's GPUs (FSDP2 with expert parallelism, rl/train/parallel.py)."""
        return math.ceil(self.optimizer_bytes_replicated / self.num_gpus)


def _setting(obj: Any, name: str, default: Any = None) -> Any:
    value = getattr(obj, name, default) if obj is not None else default
    return default if value is None and default is not None else value


def plan(model_config: Any, stages: Sequence[Any], learner: Any, plan: Any, num_ranks: int = 1,
         summary: Optional[ParamSummary] = None) -> list[StagePlan]:
    """The cost of every stage (module docstring). `stages`: StageConfig-like (seq_len, tokens, batch_tokens,
    learner.segment_tokens); `learner`: LearnerSettings-like (dtype, micro_batch_tokens, micro_batch_seqs, segment_tokens,
    optimizer); `plan`: PlanConfig-like (gpu, num_gpus, mfu, dtype_bytes); `num_ranks`: data-parallel learner ranks."""
    gpu_name = str(_setting(plan, "gpu", "h200"))
    if gpu_name not in GPUS:
        raise ValueError(f"pretrain.plan.gpu: {gpu_name!r} is not one of {', '.join(GPUS)}")
    gpu = GPUS[gpu_name]
    num_gpus, mfu = int(_setting(plan, "num_gpus", 1)), float(_setting(plan, "mfu", 0.35))
    act_bytes = int(_setting(plan, "dtype_bytes", 2))
    optimizer = str(_setting(learner, "optimizer", "adamw"))
    summary = summary or parameter_summary(model_config, optimizer)
    param_bytes = dtype_bytes(_setting(learner, "dtype", "float32"))
    weight_bytes, grad_bytes, state_bytes = summary.memory(param_bytes)
    plans = []
    for i, stage in enumerate(stages):
        seq_len, batch_tokens = int(stage.seq_len), int(stage.batch_tokens)
        seg = _setting(stage.learner, "segment_tokens") or _setting(learner, "segment_tokens")
        segmented = bool(seg) and seq_len > seg
        steps = max(1, math.ceil(int(stage.tokens) / batch_tokens))
        rows_per_step = max(1, batch_tokens // seq_len)
        rows_per_rank = max(1, math.ceil(rows_per_step / num_ranks))
        mb_rows = max(1, int(_setting(learner, "micro_batch_tokens", 8192)) // seq_len)
        if _setting(learner, "micro_batch_seqs"):
            mb_rows = min(mb_rows, int(learner.micro_batch_seqs))
        mb_rows = min(mb_rows, rows_per_rank)
        fwd = forward_flops_per_token(model_config, summary, seq_len)
        per_token = 3 * sum(fwd.values())
        tokens = steps * batch_tokens
        mode = str(_setting(learner, "recompute", "none"))
        recompute = sum(fwd.values()) * tokens * (int(segmented) + int(mode != "none"))
        by_mode = {m: activation_bytes(model_config, mb_rows, seq_len, seg if segmented else None, act_bytes,
                                       gpu.kernels, recompute=m) for m in ("none", "selective", "full")}
        breakdown = by_mode[mode]
        plans.append(StagePlan(
            index=i, seq_len=seq_len, segment_tokens=int(seg) if segmented else None, tokens=tokens, steps=steps,
            batch_tokens=batch_tokens, rows_per_step=rows_per_step, rows_per_rank=rows_per_rank,
            micro_batch_rows=mb_rows, micro_batches=math.ceil(rows_per_rank / mb_rows),
            forward_flops_per_token=fwd, flops_per_token=per_token, flops=per_token * tokens,
            recompute_flops=recompute, activation_bytes=sum(breakdown.values()), activation_breakdown=breakdown,
            recompute=mode, activation_by_recompute={m: sum(b.values()) for m, b in by_mode.items()},
            activation_dtype_bytes=act_bytes, param_dtype_bytes=param_bytes,
            weight_bytes=weight_bytes, grad_bytes=grad_bytes, optimizer_state_bytes=state_bytes,
            num_gpus=num_gpus, gpu=gpu.name,
            time_s=(per_token * tokens + recompute) / (num_gpus * gpu.peak_flops * mfu)))
    return plans




def human_count(n: float) -> str:
    """15.0T, 400G, 65.5K: a token count."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def human_params(n: float) -> str:
    """2.78T, 105B, 5.1M: a parameter count."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def human_flops(x: float) -> str:
    """2.1e24 (whole runs), 631 GFLOP (per token)."""
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= scale and x < 1e21:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g}".replace("e+", "e")


def human_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def human_time(s: float) -> str:
    if s < 120:
        return f"{s:.3g} s"
    if s < 2 * 3600:
        return f"{s / 60:.3g} min"
    if s < 48 * 3600:
        return f"{s / 3600:.3g} h"
    return f"{s / 86400:.3g} days"


def _length(n: int) -> str:
    from k3rl.rl.pretrain.stages import human_tokens

    return human_tokens(n)


def format_plan(plans: Sequence[StagePlan], model: str | ParamSummary, cluster: str | GPU, mfu: float = 0.35,
                width: int = 160) -> str:
    """A readable table of `plans`: one row per stage and a total, a header line (model, parameters, cluster) and
    the assumptions below it. `model`: a name or the ParamSummary; `cluster`: a GPU name or GPU."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    gpu = GPUS[cluster] if isinstance(cluster, str) else cluster
    num_gpus = plans[0].num_gpus if plans else 1
    if isinstance(model, ParamSummary):
        lay = model.counts["layers"]
        head = (f"model: {human_params(model.total)} total / {human_params(model.active)} active parameters "
                f"({lay['total']} layers: {lay['kda']} KDA, {lay['mla']} MLA; {lay['moe']} MoE, {lay['dense']} dense)")
    else:
        head = f"model: {model}"
    head += (f"\ncluster: {num_gpus} × {gpu.name} ({human_flops(gpu.peak_flops)}/s peak, "
             f"{_memory(gpu)} each) at MFU {mfu:g}")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, justify in (("stage", "left"), ("seq", "right"), ("segment", "right"), ("tokens", "right"),
                         ("steps", "right"), ("rows/step", "right"), ("micro-batch", "right"),
                         ("FLOPs/token", "right"), ("FLOPs", "right"),
                         ("activations/rank", "right"),
                         ("weights+grads+optim", "right"), ("sharded", "right"), ("time", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for p in plans:
        table.add_row(
            f"{p.index + 1}", _length(p.seq_len), _length(p.segment_tokens) if p.segment_tokens else "—",
            human_count(p.tokens), f"{p.steps:,}", f"{p.rows_per_step:,}",
            f"{p.micro_batch_rows} × {_length(p.segment_tokens or p.seq_len)}",
            human_flops((p.flops + p.recompute_flops) / p.tokens), human_flops(p.flops + p.recompute_flops),
            human_bytes(p.activation_bytes), human_bytes(p.optimizer_bytes_replicated),
            human_bytes(p.optimizer_bytes_sharded), human_time(p.time_s))
    if plans:
        table.add_section()
        table.add_row("total", "", "", human_count(sum(p.tokens for p in plans)), f"{sum(p.steps for p in plans):,}",
                      "", "", "", human_flops(sum(p.flops + p.recompute_flops for p in plans)),
                      human_bytes(max(p.activation_bytes for p in plans)),
                      human_bytes(plans[0].optimizer_bytes_replicated), human_bytes(plans[0].optimizer_bytes_sharded),
                      human_time(sum(p.time_s for p in plans)))
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, highlight=False).print(table)
    notes = "\n".join(textwrap.fill(line, width, subsequent_indent="    ") for line in _assumptions(plans, gpu))
    return f"{head}\n{buf.getvalue().rstrip()}\n{notes}\n"


_DTYPE_NAMES = {2: "bf16", 4: "fp32", 8: "fp64"}


def _memory(gpu: GPU) -> str:
    """The memory as its datasheet says it: 141 GB, 80 GiB."""
    if gpu.memory_bytes % GiB == 0:
        return f"{gpu.memory_bytes // GiB} GiB"
    return f"{gpu.memory_bytes / 1e9:.0f} GB"


def _assumptions(plans: Sequence[StagePlan], gpu: GPU) -> list[str]:
    lines = ["assumptions:",
             "  tokens: each stage's budget rounded up to whole steps (steps = ⌈tokens / batch_tokens⌉)",
             "  FLOPs: training = 3 × forward; forward = 2 × active non-embedding parameters (LM head included) "
             "+ MLA "
             "causal attention 2·(T/2)·H·(d_qk+d_v) per layer + KDA 6d²+10Cd+⅔C² per head (C = 64); a segmented "
             "stage runs one more forward (pass 1, no grad), counted in its FLOPs, FLOPs/token and time",
             f"  time = FLOPs / (GPUs × peak × MFU); peak: {gpu.source}"]
    if not plans:
        return lines
    act, par = plans[0].activation_dtype_bytes, plans[0].param_dtype_bytes
    paths = ("CUDA kernels: fused SDPA and SiTU-GLU" if gpu.kernels == "cuda"
             else "CPU paths: the T×T attention probabilities when d_qk ≠ d_v")
    lines.append(
        f"  activations/rank: bytes saved for backward by one micro-batch (rows × min(seq, segment) tokens) as this "
        f"code saves them, {_DTYPE_NAMES.get(act, act)} activations with the fp32 parts (norms, KDA kernel, router, "
        f"combine) in fp32, {paths}; "
        f"segmented stages add the MLA latents of the whole row (×3) and the KDA states at each segment boundary; "
        f"not counted: transient buffers (gradients in flight, the LM head's [chunk, V] block), fragmentation, the "
        f"mask of packed documents")
    worst = max(plans, key=lambda p: p.activation_bytes)
    parts = sorted(worst.activation_breakdown.items(), key=lambda kv: -kv[1])
    lines.append(f"  stage {worst.index + 1}'s activations: " + ", ".join(
        f"{name} {human_bytes(b)} ({100 * b / worst.activation_bytes:.0f}%)" for name, b in parts if b))
    lines.append(f"  weights+grads+optim: replicated on every data-parallel rank (without learner.fsdp); parameters, "
                 f"gradients and moments in the learner dtype ({_DTYPE_NAMES.get(par, par)}; KDA gate/conv "
                 f"parameters fp32), no fp32 master copy; sharded: over all {plans[0].num_gpus} GPUs (learner.fsdp: "
                 f"FSDP2 with expert parallelism)")
    if act != par:
        lines.append(f"  note: activations are planned at {act} bytes (pretrain.plan.dtype_bytes) but the learner's "
                     f"parameters are {par}-byte")
    acts = "; ".join(f"{p.index + 1}: " + " / ".join(human_bytes(p.activation_by_recompute[m])
                                                  for m in ("none", "selective", "full")) for p in plans)
    lines.append(f"  recompute (learner.recompute: {plans[0].recompute} here; rl/pretrain/cost.py): selective keeps "
                 f"nothing of the KDA mixers, MoE blocks and AttnRes mixes but their inputs; full keeps each layer's "
                 f"input, and in a segmented stage recomputes what selective does; either counts one more forward in "
                 f"FLOPs and time. activations/rank by stage, none / selective / full: {acts}")
    fits = "; ".join(f"{p.index + 1}: " + " / ".join(
        str(gpus_to_fit(p, m, gpu) or "—") for m in ("none", "selective", "full")) for p in plans)
    lines.append(f"  {gpu.name}s to fit (states sharded over them + one micro-batch's activations ≤ {_memory(gpu)}), "
                 f"by stage, recompute none / selective / full (—: the activations alone do not fit): {fits}")
    over = [p for p in plans if p.activation_bytes + p.optimizer_bytes_sharded > gpu.memory_bytes]
    if over:
        lines.append(f"  does not fit one {gpu.name} ({_memory(gpu)}) even with sharded states: "
                     f"stage(s) {', '.join(str(p.index + 1) for p in over)}")
    elif plans[0].optimizer_bytes_replicated > gpu.memory_bytes:
        lines.append(f"  the replicated states alone exceed one {gpu.name} ({_memory(gpu)}): the "
                     f"run needs sharded states")
    return lines


def gpus_to_fit(p: StagePlan, mode: str, gpu: GPU) -> int | None:
    """The fewest GPUs whose memory holds the stage's states sharded over all of them plus one micro-batch's
    activations under recompute `mode`; None when the activations alone exceed one GPU."""
    free = gpu.memory_bytes - p.activation_by_recompute[mode]
    return math.ceil(p.optimizer_bytes_replicated / free) if free > 0 else None


def plan_from_job(cfg: Any) -> tuple[str, list[StagePlan]]:
    """The plan of a loaded JobConfig: model from `pretrain.model_dir`'s config.json when set (else the `model:`
    section), the `learner:` section, `pretrain.stages`, `pretrain.plan`, `learner.num_ranks` ranks."""
    from pathlib import Path

    from k3rl.model.config import K3Config

    pre = cfg.pretrain
    if pre.model_dir is not None:
        if not (Path(pre.model_dir) / "config.json").is_file():
            raise ValueError(f"pretrain.model_dir: {pre.model_dir} is not a Hugging Face model directory "
                             f"(no config.json)")
        from k3rl.model.formats.config_json import read_config

        config = read_config(pre.model_dir)
        name = str(pre.model_dir)
    else:
        config = K3Config.from_model_config(cfg.model)
        name = "the model: section"
    summary = parameter_summary(config, str(cfg.learner.optimizer))
    plans = plan(config, list(pre.stages), cfg.learner, pre.plan, int(cfg.learner.num_ranks), summary=summary)
    text = format_plan(plans, summary, str(pre.plan.gpu), float(pre.plan.mfu))
    text = f"{cfg.run.name}: {name}, learner {cfg.learner.dtype} / {cfg.learner.optimizer}, " \
           f"{cfg.learner.num_ranks} data-parallel rank(s)\n" + text
    return text, plans


__all__ = ["GPU", "GPUS", "StagePlan", "format_plan", "human_bytes", "human_count", "human_flops", "human_params",
           "human_time", "plan", "plan_from_job"]
