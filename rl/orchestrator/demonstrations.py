"""SFT data: an environment's oracle (and imperfect teachers, envs/teachers.py) played on tasks, the kept
episodes rendered into token ids and an assistant mask exactly as rollouts build them.

The environment's oracle plays each task through `envs.base.run_episode`;
episodes below `sft.min_reward` are dropped. Each kept transcript becomes token ids and an
assistant mask exactly as the rollout agent loop would have built them (rollout/chat.py,
rollout/agent_loop.py): the opening messages rendered once with the generation prompt
(mask 0), each assistant turn encoded as the model would sample it (mask 1), each tool result
rendered as the observation delta (mask 0). A turn that ends with `</tool_call>` is where the
engine stops, so no EOS follows it; a turn without a call would end with the EOS the model
samples (mask 1). The terminal tool's result is left out, as the agent loop leaves it out.
The transcript is never re-templated as a whole, so what SFT trains is what rollouts see. For a model that reads
images (`image_patch`), the episodes show them and each row carries their pixels beside the ids (`images`: the flat
RGB uint8 bytes, `image_shapes`: (H, W) per image, in media-run order; rollout/trajectory.py).
Imperfect teachers can stand in for the oracle on a seeded fraction of the tasks
(`sft.closed_book_rate`: answer at once with a guess; `sft.hedging_rate`: the oracle's episode
with a hedged answer), so that SFT leaves RL something only the reward can teach.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from k3rl.envs.teachers import ClosedBookPolicy, HedgingPolicy, terminal_call


@dataclass
class DemoReport:
    """What playing the oracle produced: the kept demonstrations and why the others were dropped."""

    rows: list[dict[str, Any]]
    tasks: int
    dropped: dict[str, int]

    def summary(self) -> dict[str, Any]:
        n = max(1, len(self.rows))
        return {"tasks": self.tasks, "kept": len(self.rows), "dropped": dict(self.dropped),
                "teachers": dict(Counter(r.get("teacher", "oracle") for r in self.rows)),
                "mean_tokens": sum(len(r["input_ids"]) for r in self.rows) / n,
                "mean_assistant_tokens": sum(sum(r["assistant_masks"]) for r in self.rows) / n,
                "mean_prompt_tokens": sum(r["prompt_tokens"] for r in self.rows) / n,
                "mean_turns": sum(r["turns"] for r in self.rows) / n}

    def line(self) -> str:
        s = self.summary()
        why = ", ".join(f"{v} {_DROP_REASONS[k]}" for k, v in sorted(self.dropped.items()))
        mix = {k: v for k, v in s["teachers"].items() if k != "oracle"}
        closed = f" (by imperfect teachers: {', '.join(f'{v} {k}' for k, v in sorted(mix.items()))})" if mix else ""
        return (f"demonstrations: kept {s['kept']} of {s['tasks']} tasks" + (f" (dropped: {why})" if why else "")
                + closed
                + f"; {s['mean_tokens']:.0f} tokens each on average ({s['mean_prompt_tokens']:.0f} prompt, "
                  f"{s['mean_assistant_tokens']:.0f} the model's own), {s['mean_turns']:.1f} turns")


_DROP_REASONS = {"reward": "below min_reward", "length": "longer than the context limit",
                 "turn_length": "with a turn longer than the per-turn token limit"}


def collect_demonstrations(env_name: str, n: int, seed: int, tokenizer, env_kwargs: dict | None = None, *,
                           tasks: Sequence[Any] | None = None, min_reward: float = 1.0,
                           max_length: int | None = None, max_turn_tokens: int | None = None,
                           max_turns: int | None = None, closed_book_rate: float = 0.0, hedging_rate: float = 0.0,
                           hedge: str = HedgingPolicy.suffix, teacher_seed: int = 0,
                           image_patch: int | None = None) -> DemoReport:
    """Play the oracle of `env_name` on `tasks` (default: `env.tasks(n, seed)`) and render the
    successful episodes (see `rollout.chat.render_transcript`).

    Imperfect teachers, for SFT that leaves RL something to learn: a `closed_book_rate` fraction of
    the tasks (drawn with `teacher_seed`) is played by `ClosedBookPolicy` (guessing the final call of
    another task's oracle episode) and a `hedging_rate` fraction by `HedgingPolicy`; their episodes
    are kept whatever their reward when the oracle solved the task. Each row names its `teacher`.
    """
    import random

    import k3rl.envs as envs
    from k3rl.envs.base import run_episode, with_budget
    from k3rl.rollout.chat import ChatRenderer, images_of, render_transcript

    if not (0.0 <= closed_book_rate and 0.0 <= hedging_rate and closed_book_rate + hedging_rate < 1.0):
        raise ValueError(f"closed_book_rate + hedging_rate: each ≥ 0 and together < 1, got {closed_book_rate} "
                         f"and {hedging_rate}")
    renderer = ChatRenderer(tokenizer, image_patch=image_patch)
    env = envs.make(env_name, tokenizer=tokenizer, **(env_kwargs or {}))
    tasks = env.tasks(n, seed) if tasks is None else list(tasks)
    budget = env.budget if max_turns is None else with_budget(env.budget, max_turns=max_turns)
    count = lambda s: len(renderer.encode_text(s, tool_result=True))  # noqa: E731  (observations clipped as the agent loop clips them)
    results = [run_episode(env, task, env.oracle(task), budget, count, image_patch) for task in tasks]
    solved = [r.reward >= min_reward for r in results]
    rng = random.Random(teacher_seed)
    teacher = []
    for _ in tasks:
        u = rng.random()
        teacher.append("closed_book" if u < closed_book_rate else
                       "hedging" if u < closed_book_rate + hedging_rate else "oracle")
    calls = [(i, terminal_call(env, r.messages)) for i, r in enumerate(results) if solved[i]]
    calls = [(i, c) for i, c in calls if c is not None]
    for i, task in enumerate(tasks):
        if teacher[i] == "oracle" or not solved[i]:
            continue
        if teacher[i] == "hedging":
            results[i] = run_episode(env, task, HedgingPolicy(env.oracle(task), env, hedge), budget, count,
                                     image_patch)
        else:
            others = [c for j, c in calls if j != i]
            if not others:
                raise ValueError(f"closed_book_rate: no other oracle episode of {env_name!r} ended with a terminal "
                                 f"call to take a guess from")
            results[i] = run_episode(env, task, ClosedBookPolicy(rng.choice(others)), budget, count, image_patch)
    rows, dropped = [], Counter()
    for i, (task, result) in enumerate(zip(tasks, results)):
        if not solved[i]:
            dropped["reward"] += 1
            continue
        ids, mask, turns = render_transcript(renderer, result.messages)
        if max_length is not None and len(ids) > max_length:
            dropped["length"] += 1
            continue
        if max_turn_tokens is not None and max(turns) > max_turn_tokens:
            dropped["turn_length"] += 1
            continue
        task_id = str(task.get("id", i)) if isinstance(task, dict) else str(i)
        last = max(k for k, m in enumerate(result.messages) if m["role"] == "assistant")
        shown = [p.pixels for p in images_of(result.messages[:last + 1])]  # as render_transcript: up to the last turn
        rows.append({"input_ids": ids, "assistant_masks": mask, "task_id": task_id, "reward": float(result.reward),
                     "turns": len(turns), "prompt_tokens": mask.index(1), "teacher": teacher[i],
                     "images": b"".join(p.tobytes() for p in shown) if shown else None,
                     "image_shapes": [list(p.shape[:2]) for p in shown] if shown else None})
    return DemoReport(rows, len(tasks), dict(dropped))


def demonstrations(env_name: str, n: int, seed: int, tokenizer, env_kwargs: dict | None = None, **kwargs):
    """Successful oracle demonstrations as a `datasets.Dataset` with `input_ids` and
    `assistant_masks` (the loss mask of `rl.train.supervised.as_trajectory`) plus `task_id`, `reward`, `turns`,
    `prompt_tokens`; prints how many were kept. Keyword arguments as `collect_demonstrations`."""
    from datasets import Dataset

    report = collect_demonstrations(env_name, n, seed, tokenizer, env_kwargs, **kwargs)
    print(report.line(), flush=True)
    return Dataset.from_list(report.rows)
