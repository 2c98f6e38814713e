"""A learner step on a group of compacted episodes, with and without prefix sharing (`learner.share_prefix`).

A compacted episode (rollout/agent_loop.py `Compaction`) is several sequences that all start with the episode's
opening prompt [system, task]; a group's episodes share that prompt too. So a group of `--episodes` episodes of
`--sequences` sequences each is `episodes × sequences` rows whose first `--prompt` tokens are one and the same
(no loss row among them), each followed by `--tail` tokens of its own (a summary or the context after it, then
sampled turns: loss rows). With sharing the learner computes the prompt once and branches the rows from its state
(rl/train/units.py `make_units`, rl/train/segments.py); without, every row computes it again. Tokens computed are
counted from the units the learner builds; the step time is the median of `--reps` GRPO steps (fp32, AdamW) after
a warm-up, both settings in this process on the quickstart's tiny hybrid K3 (random weights); the first
step's gradient norm is printed for both (equal up to rounding: tests/rl/test_segments.py checks every gradient).

    python bench/compacted_group.py                     # 8 episodes × 2 sequences, 1024-token prompt, 192-token tails
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from long_prefill import tiny_config  # noqa: E402  (bench/, this script's directory)


def group(episodes: int, sequences: int, prompt: int, tail: int, vocab: int):
    """The group's trajectories: one shared prompt, a tail of its own per sequence (its last half sampled)."""
    import numpy as np

    from k3rl.rollout.trajectory import Trajectory

    rng = np.random.default_rng(0)
    opening = rng.integers(3, vocab, prompt)
    out = []
    for e in range(episodes):
        for _ in range(sequences):
            tokens = np.concatenate([opening, rng.integers(3, vocab, tail)]).astype(np.int32)
            mask = np.zeros(len(tokens), dtype=np.uint8)
            mask[prompt + tail // 2:] = 1
            logprobs = np.where(mask == 1, -rng.random(len(tokens)), 0.0).astype(np.float32)
            out.append(Trajectory(tokens=tokens, loss_mask=mask, logprobs=logprobs,
                                  versions=np.where(mask == 1, 0, -1).astype(np.int32),
                                  turn_spans=np.zeros((0, 2), dtype=np.int32), prompt_len=prompt, reward=float(e % 2),
                                  group_id="g", task_id="t", episode_id=f"g#{e}"))
    return out


def computed_tokens(learner, trajectories) -> int:
    """Positions the learner's units compute: a shared prefix once, every row's own positions."""
    from k3rl.rl.train.batching import to_train_sequence
    from k3rl.rl.train.learner import compute_advantages
    from k3rl.rl.train.units import make_units

    advantages = compute_advantages(learner.algo, trajectories)
    seqs = [to_train_sequence(t, a) for t, a in zip(trajectories, advantages)]
    units = make_units(seqs, learner.cfg, learner.policy, learner.device, None, learner.cfg.share_prefix)
    return sum(u.prefix_len + int(u.mb.valid.sum()) for u in units)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=192)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    from k3rl.model.formats.save import save_model
    from k3rl.model.modeling import K3ForCausalLM
    from k3rl.rl.train.learner import Learner, LearnerConfig

    length = args.prompt + args.tail
    config = tiny_config(length, kda_only=False)
    trajectories = group(args.episodes, args.sequences, args.prompt, args.tail, config.vocab_size)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        save_model(K3ForCausalLM(config), tmp)
        for share in (False, True):
            learner = Learner(LearnerConfig(model_path=tmp, lr=1e-5, share_prefix=share, routing_replay=False,
                                            micro_batch_tokens=len(trajectories) * length))
            tokens = computed_tokens(learner, trajectories)
            first = learner.train_step(trajectories)
            times = []
            for _ in range(args.reps):
                started = time.perf_counter()
                learner.train_step(trajectories)
                times.append(time.perf_counter() - started)
            rows.append((share, tokens, statistics.median(times), float(first["grad_norm"])))
    print(f"load {os.getloadavg()[0]:.2f}; {args.episodes} episodes × {args.sequences} sequences, a {args.prompt}-token "
          f"shared prompt + {args.tail}-token tails; tiny hybrid K3, fp32, median of {args.reps} steps")
    print("| prefix sharing | tokens computed | step s | tokens vs without | step time vs without | first grad norm |\n"
          "|---|---|---|---|---|---|")
    (_, t0, s0, _), _ = rows
    for share, tokens, seconds, norm in rows:
        print(f"| {'on' if share else 'off'} | {tokens:,} | {seconds:.2f} | {tokens / t0:.2f}× | {seconds / s0:.2f}× "
              f"| {norm:.6f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
