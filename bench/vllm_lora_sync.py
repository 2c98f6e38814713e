"""vLLM weight sync with LoRA: a learner's adapters served as a vLLM LoRA adapter vs its merged weights reloaded.

A Qwen3 (built locally by rollout/tiny_qwen3.py, random init, fp32) is the base of a LoRA learner
(`learner.lora`, rank `--rank`, every linear layer but the head) and of an in-process CPU `VLLMEngine`
(rollout/vllm_engine.py). One sync = `load_weights` of what the learner pushes plus one generated token, since
vLLM loads a new adapter on the first request that names it:
  * merged (`learner.lora.push: merged`): every tensor with the adapters merged, reloaded through
    `collective_rpc("reload_weights")`;
  * adapters (`learner.lora.push: adapters`): the low-rank factors, written as a PEFT directory and served as
    the engine's LoRA adapter over the unchanged base.
Bytes and ms per sync, median of `--reps` after one warm-up; after the syncs both engines' greedy log-probs are
compared with the learner's (the adapters are randomised first, so the check sees them).

    python bench/vllm_lora_sync.py                  # tiny (hidden 64) and small (hidden 512, 4 layers)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3rl.rollout.vllm_cpu import configure_cpu_env  # noqa: E402

configure_cpu_env()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from timing import median_ms  # noqa: E402  (bench/timing.py)

from k3rl.rl.config.learner import LoraSettings  # noqa: E402
from k3rl.rl.train.learner import Learner, LearnerConfig  # noqa: E402
from k3rl.rollout.engine import SamplingParams  # noqa: E402
from k3rl.rollout.tiny_qwen3 import build_tiny_qwen3  # noqa: E402
from k3rl.rollout.trajectory import TrajectoryBuilder  # noqa: E402
from k3rl.rollout.vllm_engine import VLLMEngine  # noqa: E402

MODELS = {"tiny": dict(hidden_size=64, num_layers=2), "small": dict(hidden_size=512, num_layers=4, num_heads=8)}
PROMPT = [5, 17, 42, 99, 7, 250, 31, 8]


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def measure(model_dir: Path, rank: int, reps: int) -> list[tuple[str, int, float]]:
    """(push, bytes per sync, ms per sync) for merged and adapter pushes into vLLM (module docstring)."""
    rows = []
    one = SamplingParams(n=1, temperature=0.0, max_tokens=1, seed=0)
    check = SamplingParams(n=1, temperature=0.0, max_tokens=8, seed=0)
    for push in ("merged", "adapters"):
        learner = Learner(LearnerConfig(model_path=str(model_dir), lr=1e-4,
                                        lora=LoraSettings(rank=rank, alpha=2.0 * rank, push=push)))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # PEFT starts B at 0: random factors make ΔW visible to the check below
            for name, p in learner.model.named_parameters():
                if ".lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        engine = VLLMEngine(model_dir, max_model_len=256, seed=0, lora_rank=rank if push == "adapters" else 0)
        named = learner.push_weights(copy=False)
        version = iter(range(1, 10_000))

        def sync():
            engine.load_weights(named, version=next(version))
            engine.generate([PROMPT], one)

        ms = median_ms(sync, reps)
        (out,) = engine.generate([PROMPT], check)
        builder = TrajectoryBuilder(PROMPT)
        builder.append_sampled(out[0].token_ids, out[0].logprobs, version=0)
        t = builder.finish(reward=0.0, group_id="g", task_id="t")
        (lp,) = learner.score([t])
        np.testing.assert_allclose(lp, out[0].logprobs, atol=2e-4, err_msg=f"{push}: vLLM ≠ learner")
        rows.append((push, nbytes(named), ms))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"load {os.getloadavg()[0]:.2f}, in-process CPU vLLM, LoRA rank {args.rank}, median of {args.reps} syncs "
          f"(load_weights + 1 token); greedy log-probs checked against the learner's after the syncs")
    header = ["model", "push", "MB per sync", "ms per sync", "bytes vs merged", "time vs merged"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            d = build_tiny_qwen3(Path(tmp) / model, **MODELS[model])
            (_, mb, mt), (_, ab, at) = measure(d, args.rank, args.reps)
            for push, b, t in (("merged", mb, mt), ("adapters", ab, at)):
                print(f"| {model} | {push} | {b / 1e6:.2f} | {t:.1f} | {b / mb:.3f}× | {t / mt:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
