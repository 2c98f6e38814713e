"""Held-out episodes as text: what a user reads to see what training changed.

The trainer writes every held-out evaluation to `run_dir/eval/step_NNNN.jsonl`, one episode per
line: task id, reward and its components, finish reason, and the episode after its prompt decoded
with the policy's tokenizer (the model's turns and the tool observations, special tokens kept, so
the text shows exactly what the model produced). `side_by_side` pairs two evaluations on the same
tasks — before and after RL — and picks the episodes whose outcome changed, for the quickstart's
report (rl/eval/before_after.py).

Imports without torch, Ray or vLLM; the tokenizer is passed in.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

EVAL_DIR = "eval"
HEADLINE = ("em", "f1", "evidence_recall")
"""The reward components a transcript page shows (all of them when an environment has none of these)."""


def eval_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / EVAL_DIR / f"step_{step:04d}.jsonl"


def episode_record(trajectory: Any, tokenizer: Any) -> dict[str, Any]:
    """One held-out episode as a JSON-serialisable dict (see module docstring)."""
    tokens = trajectory.tokens[trajectory.prompt_len:].tolist()
    return {"task_id": trajectory.task_id, "reward": float(trajectory.reward),
            "rewards": {k: float(v) for k, v in trajectory.rewards.items()},
            "finish_reason": trajectory.finish_reason,
            "tool_calls": float(trajectory.metrics.get("tool_calls", 0.0)),
            "text": tokenizer.decode(tokens, skip_special_tokens=False)}


def write_eval_episodes(run_dir: str | Path, step: int, trajectories: Iterable[Any], tokenizer: Any) -> Path:
    """Write the episodes of the evaluation at `step` (sorted by task id); returns the file."""
    path = eval_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = sorted((episode_record(t, tokenizer) for t in trajectories), key=lambda r: r["task_id"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)
    return path


def read_eval_episodes(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def side_by_side(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]], k: int = 3,
                 success_key: str = "em") -> list[dict[str, Any]]:
    """Up to `k` tasks evaluated in both lists, the changed outcomes first: tasks that failed
    before and succeed after, then the reverse, then the largest reward changes. Each item holds
    `task_id`, `before` and `after` (the records)."""
    after_by_id = {r["task_id"]: r for r in after}
    pairs = [(b, after_by_id[b["task_id"]]) for b in before if b["task_id"] in after_by_id]

    def ok(r: dict[str, Any]) -> bool:
        return r["rewards"].get(success_key, r["reward"]) >= 1.0

    def rank(pair: tuple[dict, dict]) -> tuple[int, float]:
        b, a = pair
        gained, lost = ok(a) and not ok(b), ok(b) and not ok(a)
        return (0 if gained else 1 if lost else 2, -abs(a["reward"] - b["reward"]))

    chosen = sorted(pairs, key=rank)[:k]
    return [{"task_id": b["task_id"], "before": b, "after": a} for b, a in chosen]


def markdown(pairs: Sequence[dict[str, Any]], before_label: str = "before RL",
             after_label: str = "after RL") -> str:
    """The pairs of `side_by_side` as a Markdown page: per task, both episodes with their scores."""
    out = [f"# Held-out episodes, {before_label} vs {after_label}", ""]
    for p in pairs:
        out.append(f"## task {p['task_id']}")
        for label, r in ((before_label, p["before"]), (after_label, p["after"])):
            shown = {k: v for k, v in r["rewards"].items() if k in HEADLINE} or r["rewards"]
            scores = ", ".join(f"{k} {v:.2f}" for k, v in sorted(shown.items()))
            out += ["", f"**{label}** — reward {r['reward']:.3f} ({scores}; {r['finish_reason']})", "",
                    "```", r["text"].strip(), "```"]
        out.append("")
    return "\n".join(out)


def tool_calls(text: str) -> list[Any]:
    """Every tool call the model wrote in an episode's text, in order (`envs.tools.ToolCall`s;
    unreadable ones are skipped)."""
    from k3rl.envs.tools import TOOL_CALL_START, ToolCall, parse

    parts = text.split(TOOL_CALL_START)[1:]
    calls = [parse(TOOL_CALL_START + p) for p in parts]
    return [c for c in calls if isinstance(c, ToolCall)]


def behaviour(episodes: Sequence[dict[str, Any]], terminal: str = "answer", hedge: str = "") -> dict[str, float]:
    """What a set of held-out episodes did, as shares of the episodes: `answered` (the last call
    is `terminal`), `searched` (some other tool call came first), `contains_gold` (answer F1 > 0:
    the right answer is in it, bare or padded), and with `hedge` the share whose answer ends with
    that suffix."""
    n = max(1, len(episodes))
    answered = searched = hedged = gold = 0
    for r in episodes:
        calls = tool_calls(r["text"])
        last = calls[-1] if calls else None
        if last is not None and last.name == terminal:
            answered += 1
            value = next((v for v in last.arguments.values() if isinstance(v, str)), "")
            hedged += bool(hedge) and value.strip().endswith(hedge.strip())
        searched += any(c.name != terminal for c in calls)
        gold += r["rewards"].get("f1", 0.0) > 0
    out = {"answered": answered / n, "searched": searched / n, "contains_gold": gold / n}
    if hedge:
        out["hedged"] = hedged / n
    return out
