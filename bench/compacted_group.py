"""A learner step on a group of compacted episodes, with and without prefix-tree training (`learner.share_prefix`).

A compacted episode (rollout/agent_loop.py `Compaction`) is several sequences that all start with the episode's
opening prompt [system, task]; a group's episodes share that prompt too, and samples of one policy often take the
same first turn. So a group of `--episodes` episodes of `--sequences` sequences each is `episodes × sequences` rows
whose first `--prompt` tokens are one and the same (no loss row among them); the first sequence of each episode
goes on with a sampled first turn of `--first-turn` tokens, the same one in the first `--agree` episodes (loss rows
inside a shared span), each restart with a summary of that many tokens of its own; then every row has `--tail`
tokens of its own (the second half sampled). With the tree the learner computes every shared span once and branches
from its state (rl/train/prefix_tree.py, rl/train/segments.py); without, every row computes it all again. Tokens
computed are counted from the units the learner builds; the step time is the median of `--reps` GRPO steps (fp32,
AdamW) after a warm-up, both settings in this process on the quickstart's tiny hybrid K3 (random weights); the first
step's gradient norm is printed for both (equal up to rounding: tests/rl/test_prefix_tree.py checks every gradient).

    python bench/compacted_group.py       # 8 episodes × 2 sequences, 1024-token prompt, 64-token first turn, 192 tails
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


def group(episodes: int, sequences: int, prompt: int, first_turn: int, agree: int, tail: int, vocab: int):
    """The group's trajectories (see the module docstring)."""
    import numpy as np

    from k3rl.rollout.trajectory import Trajectory

    rng = np.random.default_rng(0)
    opening, first = rng.integers(3, vocab, prompt), rng.integers(3, vocab, first_turn)
    out = []
    for e in range(episodes):
        for s in range(sequences):
            turn = first if s == 0 and e < agree else rng.integers(3, vocab, first_turn)
            tokens = np.concatenate([opening, turn, rng.integers(3, vocab, tail)]).astype(np.int32)
            mask = np.zeros(len(tokens), dtype=np.uint8)
            if s == 0:  # the first turn was sampled; a restart's summary is context
                mask[prompt:prompt + first_turn] = 1
            mask[prompt + first_turn + tail // 2:] = 1
            logprobs = np.where(mask == 1, -rng.random(len(tokens)), 0.0).astype(np.float32)
            out.append(Trajectory(tokens=tokens, loss_mask=mask, logprobs=logprobs,
                                  versions=np.where(mask == 1, 0, -1).astype(np.int32),
                                  turn_spans=np.zeros((0, 2), dtype=np.int32), prompt_len=prompt, reward=float(e % 2),
                                  group_id="g", task_id="t", episode_id=f"g#{e}"))
    return out


def computed_tokens(learner, trajectories) -> int:
    """Positions the learner's units compute: each shared span once, every row's own positions."""
    from k3rl.rl.train.advantages import compute_advantages
    from k3rl.rl.train.batching import to_train_sequence
    from k3rl.rl.train.units import make_units

    advantages = compute_advantages(learner.algo, trajectories)
    seqs = [to_train_sequence(t, a) for t, a in zip(trajectories, advantages)]
    units = make_units(seqs, learner.cfg, learner.policy, learner.device, None, learner.cfg.share_prefix)
    return sum(u.computed_tokens for u in units)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--first-turn", type=int, default=64)
    ap.add_argument("--agree", type=int, default=4)
    ap.add_argument("--tail", type=int, default=192)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    from k3rl.model.formats.save import save_model
    from k3rl.model.modeling import K3ForCausalLM
    from k3rl.rl.train.learner import Learner, LearnerConfig

    length = args.prompt + args.first_turn + args.tail
    config = tiny_config(length, kda_only=False)
    trajectories = group(args.episodes, args.sequences, args.prompt, args.first_turn, args.agree, args.tail,
                         config.vocab_size)
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
          f"shared prompt, a {args.first_turn}-token first turn ({args.agree} episodes agree), {args.tail}-token tails; "
          f"tiny hybrid K3, fp32, median of {args.reps} steps")
    print("| prefix tree | tokens computed | step s | tokens vs without | step time vs without | first grad norm |\n"
          "|---|---|---|---|---|---|")
    (_, t0, s0, _), _ = rows
    for share, tokens, seconds, norm in rows:
        print(f"| {'on' if share else 'off'} | {tokens:,} | {seconds:.2f} | {tokens / t0:.2f}× | {seconds / s0:.2f}× "
              f"| {norm:.6f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
