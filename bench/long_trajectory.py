"""One learner step (forward + backward) on one long trajectory: segment-recurrent (`learner.segment_tokens`,
rl/train/segments.py) vs the whole sequence at once, wall time and peak resident memory, each measurement in a fresh
process so the peaks do not mix.

Models (random weights: the cost does not depend on them): the quickstart's tiny hybrid (configs/rl/quickstart.yaml:
3 KDA + 1 gated MLA, 3.0M parameters) and, with `--kda-only`, the same model with every layer KDA (its state is
constant in length; the hybrid's MLA layer is quadratic, so the hybrid at 1M on two CPU cores takes many hours — a
GPU measurement). The trajectory looks like an agent's: a sampled turn of `--turn` tokens (loss mask 1) after every
`--every` tokens of context; one GRPO step with advantage 1, fp32, AdamW.

The CPU floor (docs/performance.md): this run's sgemm rate for the matmul FLOPs of the step (projections,
experts at top-k, LM head on the loss rows, MLA attention; 4 forward-equivalents: the first pass, the recomputation
and the backward) plus KDA's chunked recurrence at the documented 0.7 µs per token, head and layer per forward.

    python bench/long_trajectory.py                                   # hybrid 16K, 64K (whole sequence at 16K)
    python bench/long_trajectory.py --lengths 262144                  # hybrid at 256K (hours on two cores)
    python bench/long_trajectory.py --kda-only --lengths 65536 262144 1048576 --whole-max 65536
    python bench/long_trajectory.py --lengths 8192 32768 --whole-max 8192 --segment 2048 --recompute none selective full

`--recompute` (`learner.recompute`, rl/config/learner.py) repeats every row per mode; "over before" is the step's
own peak resident set (VmHWM reset just before it) above the resident set just before it (the activations and the
step's transient buffers), and the plan's column is rl/pretrain/cost.py's count of the bytes autograd saves for that mode.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from long_prefill import run_json_child, tiny_config  # noqa: E402  (bench/, this script's directory)

KDA_FLOOR_S = 0.7e-6
"""Seconds per token, head and KDA layer of one chunked forward on this CPU's two cores (docs/performance.md)."""


def trajectory(length: int, vocab: int, every: int, turn: int):
    """`length` tokens: context with a sampled turn of `turn` tokens after every `every` (and at the end)."""
    import numpy as np

    from k3rl.rollout.trajectory import Trajectory

    rng = np.random.default_rng(0)
    mask = np.zeros(length, dtype=np.uint8)
    for end in range(every, length + every, every):
        mask[max(0, min(end, length) - turn):min(end, length)] = 1
    mask[:min(length - 1, 64)] = 0  # a prompt first
    tokens = rng.integers(3, vocab, length).astype(np.int32)
    logprobs = np.where(mask == 1, -rng.random(length), 0.0).astype(np.float32)
    return Trajectory(tokens=tokens, loss_mask=mask, logprobs=logprobs, versions=np.where(mask == 1, 0, -1).astype(np.int32),
                      turn_spans=np.zeros((0, 2), dtype=np.int32), prompt_len=64, group_id="g", task_id="t")


def step_flops(config, length: int, loss_tokens: int) -> float:
    """Matmul FLOPs of one training step (4 forward-equivalents) on one sequence."""
    import torch

    from k3rl.model.modeling import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(config)
    e, k = config.num_experts, config.num_experts_per_token
    per_token = 0.0
    for name, p in model.named_parameters():
        if p.ndim < 2 or "embed_tokens" in name or "lm_head" in name or "conv1d" in name:
            continue
        share = k / e if ".experts." in name else 1.0
        per_token += 2 * p.numel() * share
    flops = per_token * length + 2 * config.hidden_size * config.vocab_size * loss_tokens
    n_mla = config.num_hidden_layers - len(config.linear_attn_config["kda_layers"])
    width = config.kv_lora_rank + config.qk_rope_head_dim
    flops += n_mla * config.num_attention_heads * (length ** 2 / 2) * 2 * (width + config.kv_lora_rank)
    return 4 * flops


def sgemm_gflops() -> float:
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    started = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * 2048 ** 3 / (time.perf_counter() - started) / 1e9


def measure(length: int, segment: int | None, kda_only: bool, every: int, turn: int, recompute: str = "none") -> dict:
    """One learner step in this process: seconds, peak RSS (GiB), and the floor's seconds."""
    import torch

    from k3rl.model.formats.save import save_model
    from k3rl.model.modeling import K3ForCausalLM
    from k3rl.rl.train.learner import Learner, LearnerConfig

    config = tiny_config(length, kda_only)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(K3ForCausalLM(config), tmp)
        learner = Learner(LearnerConfig(model_path=tmp, lr=1e-5, segment_tokens=segment, share_prefix=False,
                                        micro_batch_tokens=length + 1, recompute=recompute))
    warm = min(length, 2 * segment + 100) if segment else min(length, 4096)  # first calls of each path cost more
    learner.train_step([trajectory(warm + 1, config.vocab_size, every, turn)], advantages=[1.0])
    traj = trajectory(length + 1, config.vocab_size, every, turn)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    rss_before = reset_peak_rss()
    started = time.perf_counter()
    metrics = learner.train_step([traj], advantages=[1.0])
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    step_peak = status_gib("VmHWM") if rss_before is not None else None
    assert not metrics["skipped"] and metrics["grad_norm"] > 0, metrics
    loss_tokens = int(traj.loss_mask[1:].sum())
    rate = sgemm_gflops()
    lac = config.linear_attn_config
    kda_floor = 4 * KDA_FLOOR_S * length * lac["num_heads"] * len(lac["kda_layers"])
    floor = step_flops(config, length, loss_tokens) / (rate * 1e9) + kda_floor
    from k3rl.rl.pretrain.cost import activation_bytes

    planned = activation_bytes(config, 1, length, segment, 4, kernels="cpu", recompute=recompute)
    return {"seconds": seconds, "peak_gib": peak, "before_gib": base, "rss_before_gib": rss_before,
            "step_peak_gib": step_peak,
            "floor_s": floor, "sgemm_gflops": rate, "loss_tokens": loss_tokens,
            "planned_gib": sum(planned.values()) / 2**30}


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
"""glibc in each child: every block over 64 KiB its own mapping, given back when freed, and the heap trimmed, so
the resident set follows the live tensors instead of what the allocator keeps from an earlier peak (the warm-up
step's, say); without it the "over before" column measures the allocator, not the step."""


def status_gib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in GiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 2**20


def reset_peak_rss() -> float | None:
    """Reset this process's peak resident set (VmHWM) to its current size (Linux ≥ 4.0: `5` to clear_refs), so the
    peak read after a step is the step's own; returns the resident set now (GiB), None where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status_gib("VmRSS")
    except OSError:
        return None


def run_child(length: int, segment: int | None, args, timeout: float, recompute: str = "none") -> dict:
    cmd = [sys.executable, __file__, "--child", str(length), str(segment or 0), str(int(args.kda_only)),
           str(args.every), str(args.turn), recompute]
    return run_json_child(cmd, timeout, env=MALLOC_ENV)


def step_over(r: dict) -> float:
    """GiB the step's peak resident set rose above the resident set before it (the whole process's peak over it
    where the peak cannot be reset)."""
    peak = r.get("step_peak_gib") or r["peak_gib"]
    return peak - (r.get("rss_before_gib") or r["before_gib"])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        length, segment, kda_only, every, turn = (int(a) for a in sys.argv[2:7])
        print(json.dumps(measure(length, segment or None, bool(kda_only), every, turn, sys.argv[7])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--segment", type=int, default=4096, help="learner.segment_tokens")
    ap.add_argument("--kda-only", action="store_true", help="every layer KDA (constant state)")
    ap.add_argument("--whole-max", type=int, default=16384, help="longest length also trained as one sequence")
    ap.add_argument("--every", type=int, default=2048, help="context tokens between sampled turns")
    ap.add_argument("--turn", type=int, default=128, help="tokens of a sampled turn (loss mask 1)")
    ap.add_argument("--timeout", type=float, default=8 * 3600)
    ap.add_argument("--recompute", nargs="+", default=["none"], choices=["none", "full", "selective"],
                    help="learner.recompute modes, a row each (the first is the baseline of the last column)")
    args = ap.parse_args()
    model = "tiny KDA-only (4 KDA)" if args.kda_only else "tiny hybrid (3 KDA + 1 MLA)"
    print(f"one learner step (GRPO, fp32, AdamW) on one trajectory, {model}; a {args.turn}-token sampled turn every "
          f"{args.every} tokens; segment {args.segment} tokens; peak = max resident set of a fresh process", flush=True)
    print("| tokens | path | recompute | s | tokens/s | peak RSS GiB | over before GiB | plan GiB | CPU floor s (×) | "
          f"vs whole (time, peak) | vs {args.recompute[0]} (time, over before) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for length in args.lengths:
        seg_first = None
        for name, segment in (("segmented", args.segment), ("whole", None)):
            if segment is None and length > args.whole_max:
                continue
            first = None
            for mode in args.recompute:
                r = run_child(length, segment, args, args.timeout, mode)
                if "error" in r:
                    print(f"| {length:,} | {name} | {mode} | {r['error']} | | | | | | | |", flush=True)
                    continue
                first = first or r
                if name == "segmented" and mode == args.recompute[0]:
                    seg_first = r
                ratio = mode_ratio = ""
                if name == "whole" and mode == args.recompute[0] and seg_first is not None:
                    ratio = (f"segmented: {seg_first['seconds'] / r['seconds']:.2f}×, "
                             f"{seg_first['peak_gib'] / r['peak_gib']:.2f}×")
                if r is not first:
                    over, over0 = step_over(r), step_over(first)
                    mode_ratio = f"{r['seconds'] / first['seconds']:.2f}×, {over / over0:.2f}×"
                print(f"| {length:,} | {name} | {mode} | {r['seconds']:.1f} | {length / r['seconds']:,.0f} | "
                      f"{r['peak_gib']:.2f} | {step_over(r):.2f} | {r['planned_gib']:.2f} | "
                      f"{r['floor_s']:.1f} ({r['seconds'] / r['floor_s']:.1f}×) | {ratio} | {mode_ratio} |", flush=True)


if __name__ == "__main__":
    main()
