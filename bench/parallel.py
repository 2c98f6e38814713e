"""The learner under data, expert and sharded parallelism on this machine, and the sizing of RL on the full K3.

Measured (default): one learner step (`LearnerGroup.train_step`, rl/train/group.py: GRPO, AdamW, float32) of the small
config (configs/model/small.yaml: 203M parameters, 32 routed experts top-4, 11 MoE layers) on two gloo ranks, in
three layouts, one after another in this run on the same batch:

- DP=2:        `learner.num_ranks=2`, every rank holds the whole model and optimizer (gradients all-reduced);
- EP=2:        `learner.expert_parallel=2`: each rank holds 16 of the 32 experts of every MoE layer, tokens go to
               the rank owning their expert and back by all-to-all (rl/train/expert_parallel.py);
- EP=2×FSDP:   `learner.fsdp=true` on top: every other parameter, gradient and optimizer state sharded over the
               two ranks with FSDP2 (rl/train/parallel.py `apply_parallelism`).

Per layout: 1 warm-up step, then `--steps` timed steps (median s/step); per rank, the peak resident memory of the
rank's process (VmHWM of the Ray actor, which includes the ~0.5–0.7 GiB of torch itself) and the bytes of the
parameters that rank holds. The ratio column is each layout's step time over DP=2's, measured in the same run. Two
cores, two ranks, one thread each: gloo's all-to-all and all-gather go through the loopback, so the communication
that NVLink or InfiniBand would carry is here a copy through the kernel — what this table shows is that the
layouts run and what they save per rank, not their speed on a GPU cluster.

`--plan` prints instead (no run, ~5 s) the arithmetic for RL on the published K3 (configs/model/k3.yaml) on H200
nodes: learner GPUs and per-GPU memory at EP×FSDP, and what the rollout side (vLLM, MXFP4 experts) needs.

    python bench/parallel.py                 # the measured table (a few minutes on 2 cores)
    python bench/parallel.py --plan          # the sizing table for the full K3 (arithmetic only)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GB = 10**9
LAYOUTS = (("DP=2", 1, False), ("EP=2", 2, False), ("EP=2×FSDP", 2, True))


# ---- measured

def batch(vocab: int, n_groups: int = 4, group_size: int = 4, prompt: int = 96, response: int = 160, seed: int = 0):
    """GRPO groups of random tokens: a shared prompt (no loss) and a sampled response per sample, rewards 0..1."""
    import numpy as np

    from k3rl.rollout.trajectory import TrajectoryBuilder

    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        p = rng.integers(10, vocab, prompt).tolist()
        for j in range(group_size):
            b = TrajectoryBuilder(p)
            n = int(response * (0.5 + rng.random()))
            b.append_sampled(rng.integers(10, vocab, n).tolist(), (-rng.random(n)).tolist(), 0, None)
            out.append(b.finish(reward=float(j == g % group_size), group_id=f"g{g}", task_id=f"t{g}"))
    return out


def _rank_stats(worker) -> dict:
    """Inside a rank's actor: peak RSS of the process and the bytes of the parameters this rank holds."""
    import torch

    params = list(worker.learner.model.parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    experts = [p.to_local() if hasattr(p, "to_local") else p
               for n, p in worker.learner.model.named_parameters() if ".experts." in n]
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    return {"peak_rss": hwm, "param_bytes": sum(t.numel() * t.element_size() for t in local),
            "expert_bytes": sum(t.numel() * t.element_size() for t in experts),
            "threads": torch.get_num_threads()}


def measure(model_dir: Path, trajectories, expert_parallel: int, fsdp: bool, steps: int) -> dict:
    import ray

    from k3rl.rl.train.group import LearnerConfig, LearnerGroup

    cfg = LearnerConfig(model_path=str(model_dir), algo="grpo", lr=1e-5, micro_batch_tokens=2048,
                        share_prefix=False, expert_parallel=expert_parallel, fsdp=fsdp)
    group = LearnerGroup(cfg, num_ranks=2, num_cpus_per_rank=1)
    try:
        group.train_step(trajectories)  # warm-up: allocator, first all-gathers
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            metrics = group.train_step(trajectories)
            times.append(time.perf_counter() - t0)
        ranks = ray.get([a.__ray_call__.remote(_rank_stats) for a in group.actors])
    finally:
        group.shutdown()
    return {"s_per_step": statistics.median(times), "times": times, "ranks": ranks, "loss": metrics.get("loss")}


def run_measured(args) -> None:
    import ray

    from k3rl.envs.registry import tokenizer_texts
    from k3rl.model.init import init_model
    from k3rl.rl.config import load_model_config

    config = load_model_config(str(ROOT / args.config), [])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        print(f"building {args.config} …", flush=True)
        init_model(config, model_dir, seed=0, tokenizer_texts=tokenizer_texts())
        trajectories = batch(config.vocab_size)
        tokens = sum(len(t.tokens) for t in trajectories)
        rows = []
        for name, ep, fsdp in LAYOUTS:
            print(f"{name}: {args.steps} timed steps …", flush=True)
            rows.append((name, measure(model_dir, trajectories, ep, fsdp, args.steps)))
    ray.shutdown()
    base = rows[0][1]["s_per_step"]
    print(f"\nlearner step of {args.config} on 2 gloo ranks, {len(trajectories)} trajectories / {tokens} tokens per "
          f"step, median of {args.steps} steps")
    print(f"{'layout':<11} {'s/step':>8} {'÷ DP=2':>7} {'loss':>9}   {'rank':>4} {'peak RSS':>9} {'params held':>12} "
          f"{'experts held':>13}")
    for name, r in rows:
        for i, rank in enumerate(r["ranks"]):
            head = (f"{name:<11} {r['s_per_step']:>8.2f} {r['s_per_step'] / base:>7.2f} {r['loss']:>9.5f}" if i == 0
                    else " " * 38)
            print(f"{head}   {i:>4} {rank['peak_rss'] / 2**30:>7.2f} GiB {rank['param_bytes'] / 2**20:>8.1f} MiB "
                  f"{rank['expert_bytes'] / 2**20:>9.1f} MiB")


# ---- sizing arithmetic (--plan)

def full_ft_gpus(config, s, args, gpu) -> list[str]:
    """GPUs to fit full-parameter RL (bf16 states sharded + full-recompute activations) at 8K / 128K / 1M."""
    from k3rl.rl.pretrain.cost import activation_bytes

    w, g, o = s.memory(2)
    out = []
    for length in (8192, 131072, 2**20):
        seg = args.segment if length > args.segment else None
        a = sum(activation_bytes(config, 1, length, seg, 2, recompute="full").values())
        out.append(str(math.ceil((w + g + o) / (0.9 * gpu.memory_bytes - a))) if a < 0.9 * gpu.memory_bytes else "—")
    return out


def run_plan(args) -> None:
    """RL on the published K3 on H200 nodes, from the parameter counts and rl/pretrain/cost.py's activation model."""
    from k3rl.rl.config import load_model_config
    from k3rl.rl.pretrain.cost import activation_bytes
    from k3rl.rl.pretrain.param_memory import lora_parameters, parameter_summary
    from k3rl.rl.pretrain.plan import GPUS

    config = load_model_config(str(ROOT / "configs/model/k3.yaml"), [])
    gpu = GPUS["h200"]
    s = parameter_summary(config, "adamw")
    w, g, o = s.memory(2)  # this learner: bf16 weights, gradients and AdamW moments, no fp32 master copy
    states_bf16 = w + g + o
    states_mixed = s.total * (2 + 4 + 4 + 4 + 4)  # the usual mixed precision: bf16 weights, fp32 grads, master, moments
    routed = s.counts["components"]["moe.routed_experts"]["total"]
    other = s.total - routed
    T = args.micro_batch_tokens
    saved = sum(activation_bytes(config, 1, T, None, 2).values())  # every layer's saved tensors, no recompute
    full = activation_bytes(config, 1, T, None, 2, recompute="full")  # learner.recompute=full
    checkpoints, one_layer = full["layer_inputs"], full["recompute"]
    act = sum(full.values())
    print(f"K3 (configs/model/k3.yaml): {s.total / 1e12:.3f}T parameters, routed experts {routed / 1e12:.3f}T, "
          f"the rest {other / 1e9:.1f}B, {s.active / 1e9:.1f}B active per token")
    print(f"learner states: {states_bf16 / 1e12:.1f} TB as this learner keeps them (bf16 weights, gradients, AdamW "
          f"moments); {states_mixed / 1e12:.1f} TB with fp32 master weights and moments")
    print(f"activations per GPU, micro-batch of {T} tokens, per-layer recompute: {act / GB:.1f} GB "
          f"(layer inputs {checkpoints / GB:.1f} GB + one layer's saved tensors {one_layer / GB:.1f} GB; "
          f"without recompute {saved / GB / 1000:.2f} TB)")
    print(f"\nlearner at EP×FSDP on {gpu.name} ({gpu.memory_bytes / GB:.0f} GB; experts split over EP, every state "
          f"sharded over all GPUs)")
    print(f"{'GPUs':>5} {'nodes':>5} {'EP':>4} {'experts/GPU':>11} {'states/GPU':>11} {'+ activations':>14} "
          f"{'fits':>5} {'fp32-master states/GPU':>23}")
    for n in (128, 256, 384, 512, 1024):
        ep = 64 if n >= 64 else n
        per = states_bf16 / n
        total = per + act
        print(f"{n:>5} {n // 8:>5} {ep:>4} {config.num_experts // ep:>11} {per / GB:>8.1f} GB {total / GB:>11.1f} GB "
              f"{'yes' if total < 0.9 * gpu.memory_bytes else 'no':>5} {states_mixed / n / GB:>20.1f} GB")
    print(f"\nRL learner step on one long trajectory (one sequence per micro-batch, segment-recurrent at "
          f"{args.segment // 1024}K tokens past it; activations per GPU as rl/pretrain/cost.py counts them, bf16; "
          f"GPUs to fit: states sharded over them + activations ≤ 90% of {gpu.memory_bytes / GB:.0f} GB)")
    print(f"{'length':>8} {'activations: none':>18} {'selective':>10} {'full':>10}   "
          f"{'GPUs to fit: none':>17} {'selective':>10} {'full':>6}")
    for length in (8192, 131072, 2**20):
        seg = args.segment if length > args.segment else None
        acts = [sum(activation_bytes(config, 1, length, seg, 2, recompute=m).values())
                for m in ("none", "selective", "full")]
        need = [math.ceil(states_bf16 / (0.9 * gpu.memory_bytes - a)) if a < 0.9 * gpu.memory_bytes else None
                for a in acts]
        print(f"{length // 1024:>7}K {acts[0] / GB:>15.0f} GB {acts[1] / GB:>7.0f} GB {acts[2] / GB:>7.0f} GB   "
              + " ".join(f"{n if n else '—':>{w}}" for n, w in zip(need, (17, 10, 6))))
    print("(—: one micro-batch's activations alone exceed a GPU; a shorter segment or context parallelism is needed)")
    print("\nRL with LoRA (learner.lora, rl/train/lora.py's K3 targets: every attention and MLP projection and the "
          "routed experts, one adapter per expert): frozen bf16 base weights sharded over the GPUs, adapters with "
          "bf16 gradients and AdamW moments; activations as above under full recompute (LoRA's own are r-wide); "
          "GPUs to fit as above. k3rl trains LoRA on unsharded learners only so far: the sharded counts are the "
          "plan, not a tested layout")
    print(f"{'rank':>5} {'adapter params':>15} {'of the model':>13} {'adapter states':>15} "
          f"{'GPUs to fit: 8K':>16} {'128K':>6} {'1M':>5}   full fine-tuning: "
          + " / ".join(f"{n}" for n in full_ft_gpus(config, s, args, gpu)))
    for rank in (16, 32, 64, 128):
        adapters = sum(lora_parameters(config, rank).values())
        states = adapters * (2 + 2 + 2 * 2)  # weights, gradients, two moments, bf16
        need = []
        for length in (8192, 131072, 2**20):
            seg = args.segment if length > args.segment else None
            a = sum(activation_bytes(config, 1, length, seg, 2, recompute="full").values())
            need.append(math.ceil((s.total * 2 + states) / (0.9 * gpu.memory_bytes - a))
                        if a < 0.9 * gpu.memory_bytes else None)
        print(f"{rank:>5} {adapters / 1e9:>13.2f} B {adapters / s.total:>12.2%} {states / GB:>12.0f} GB "
              f"{need[0] or '—':>16} {need[1] or '—':>6} {need[2] or '—':>5}")
    mxfp4 = routed * 4.25 / 8 + other * 2  # 4-bit values + one 8-bit scale per 32; the rest bf16
    bf16 = s.total * 2
    mla = len(config.linear_attn_config["full_attn_layers"])
    kda = len(config.linear_attn_config["kda_layers"])
    lac = config.linear_attn_config
    per_token = mla * (config.kv_lora_rank + config.qk_rope_head_dim) * 2  # bf16 latent cache
    per_seq = kda * lac["num_heads"] * lac["head_dim"] ** 2 * 4  # fp32 KDA state per sequence
    print(f"\nrollout (vLLM): weights {mxfp4 / 1e12:.2f} TB with MXFP4 experts (released format), "
          f"{bf16 / 1e12:.2f} TB in bf16; cache {per_token / 1e3:.1f} KB per token ({mla} MLA layers × "
          f"{config.kv_lora_rank + config.qk_rope_head_dim} bf16) + {per_seq / 1e6:.0f} MB of KDA state per sequence")
    print(f"{'instance':>22} {'GPUs':>5} {'free for cache':>15} {'seqs @128K':>11} {'seqs @1M':>9}")
    for label, weights, n in (("MXFP4, 2 nodes", mxfp4, 16), ("MXFP4, 4 nodes", mxfp4, 32), ("bf16, 6 nodes", bf16, 48),
                             ("bf16, 8 nodes", bf16, 64)):
        free = 0.9 * n * gpu.memory_bytes - weights
        k128 = math.floor(free / (per_token * 131072 + per_seq)) if free > 0 else 0
        m1 = math.floor(free / (per_token * 2**20 + per_seq)) if free > 0 else 0
        print(f"{label:>22} {n:>5} {free / 1e12:>12.2f} TB {k128:>11} {m1:>9}")
    print(f"\nweight sync per step: {bf16 / 1e12:.2f} TB in bf16, {mxfp4 / 1e12:.2f} TB re-quantized to MXFP4 on the "
          f"learner (lossy); at 8×400 Gb/s per node ({8 * 50} GB/s) into one 2-node MXFP4 instance: "
          f"{mxfp4 / (2 * 400 * GB):.1f} s, not counting the learner's gather")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", action="store_true", help="print the full-K3 sizing arithmetic instead of measuring")
    parser.add_argument("--config", default="configs/model/small.yaml", help="model config measured")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="--plan: tokens per micro-batch")
    parser.add_argument("--segment", type=int, default=8192, help="--plan: learner.segment_tokens of the long rows")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster of this process only
    if args.plan:
        run_plan(args)
    else:
        run_measured(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
