"""The rows of `k3rl eval`'s `tasks.jsonl` (rl/eval/grid.py): one per task and runner, appended and flushed as they
finish, so an interrupted eval started again skips every finished task; error rows of a transient failure (the
server was down, slow, overloaded) are run again.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from k3rl.util.atomic import write_text_atomic

if TYPE_CHECKING:
    from k3rl.rl.eval.cells import GridTask

TASKS_FILE = "tasks.jsonl"


def task_row(runner: str, gt: GridTask, reward: float, rewards: dict, metrics: dict, seconds: float,
             transcript: str, success_key: Optional[str], error: str = "", error_kind: str = "",
             **extra: Any) -> dict[str, Any]:
    """One row of tasks.jsonl: the task, its cell, its evidence depths (`depths`: every evidence passage's, in
    reading order; `depth`: the first one's, null without evidence), `prompt_tokens` (the whole in-context
    prompt of its haystack, the cell's measure), the reported reward components, success by the environment's
    rule (never for an error row), tool calls, tokens read, wall time, the transcript, the error and its kind (`error_kind`:
    util/chat_client.py's kinds, `context`, `engine` or `task`; a resume runs the transient ones again), for
    the model the first prompt the engine was given (`engine_prompt_tokens`: in context, the cell's prompt as
    rendered for that model), and a runner's `extra` fields (the endpoint's `reply_truncated`, `note`)."""
    from k3rl.rl.eval.cells import REPORTED
    from k3rl.rl.eval.evaluate import is_success
    from k3rl.rl.eval.report import Episode

    numeric = {k: float(v) for k, v in rewards.items() if k in REPORTED and isinstance(v, (int, float))
               and not isinstance(v, bool)}
    ok = (not error) and is_success(Episode(reward, numeric), success_key)
    return {"runner": runner, "task_id": gt.task_id, "family": gt.cell.family, "serve": gt.cell.serve,
            "length": gt.cell.length, "task": gt.task, "depth": None if math.isnan(gt.depth) else gt.depth,
            "depths": list(gt.depths),
            "prompt_tokens": gt.prompt_tokens, "reward": float(reward), "rewards": numeric, "success": bool(ok),
            "tool_calls": float(metrics.get("tool_calls", 0.0)),
            "tokens_read": float(metrics.get("tokens_read", gt.prompt_tokens)), "seconds": round(seconds, 3),
            "error": error, "error_kind": (error_kind or "task") if error else "", "transcript": transcript,
            **({"engine_prompt_tokens": int(metrics["engine_prompt_tokens"])} if "engine_prompt_tokens" in metrics else {}),
            **extra}


def transcript(messages: Sequence[dict[str, Any]]) -> str:
    """The messages after the prompt (system, user), one `[role] content` block each (an image as `[image W×H]`)."""
    from k3rl.envs.media import message_text

    return "\n".join(f"[{m['role']}] {message_text(m['content'])}" for m in messages[2:])


def tokens_read(messages: Sequence[dict[str, Any]], tokenizer: Any) -> int:
    """Tokens a model reads in the episode `messages` (a message-level policy's: the baselines'), counted as the
    model's own rows count them (`LocalModel`: the trajectory's tokens less the sampled ones): the conversation
    as the agent loop tokenises it (rollout/chat.py `render_transcript`: the prompt with its chat template and
    generation prompt, each tool result with its turn delimiters, up to the last assistant turn) less the
    assistant's tokens. Without a chat template (or a transcript the loop could not have produced): the
    non-assistant messages' contents."""
    from k3rl.rollout.chat import ChatRenderer, render_transcript

    if getattr(tokenizer, "chat_template", None) is not None:
        try:
            ids, mask, _ = render_transcript(ChatRenderer(tokenizer), messages)
            return len(ids) - sum(mask)
        except ValueError:
            pass
    from k3rl.envs.base import as_token_counter

    count = as_token_counter(tokenizer)
    from k3rl.envs.media import message_text

    return sum(count(message_text(m["content"])) for m in messages if m["role"] != "assistant")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a tasks.jsonl (a line torn by a crash, or anything else that is not a row, is dropped; lines
    end at `\n` only)."""
    if not path.is_file():
        return []
    lines = path.read_text(errors="surrogateescape").split("\n")
    return [row for row in map(_row, lines) if row is not None]


LEGACY_TRANSIENT = ("APIConnectionError:", "APITimeoutError:", "InternalServerError:", "RateLimitError:")
"""How the error of an endpoint row written before rows had an `error_kind` starts when it was transient (the
`openai` client's exceptions for a refused connection, a timeout, a 5xx, a 429)."""


def is_transient(row: dict[str, Any]) -> bool:
    """Whether an error row failed for a reason that may be gone (util/chat_client.py's TRANSIENT kinds): a
    resumed eval runs its task again. A row without `error_kind` (older k3rl) is judged by its error's
    exception name."""
    from k3rl.util.chat_client import TRANSIENT

    if not row.get("error"):
        return False
    if "error_kind" in row:
        return row["error_kind"] in TRANSIENT
    return str(row["error"]).startswith(LEGACY_TRANSIENT)


class RowWriter:
    """Appends rows to tasks.jsonl, flushed and fsynced per batch, after cutting a torn last line and the rows
    of `drop` ((runner, task_id): error rows run again), so the file keeps one row per task; the file is
    replaced whole (os.replace) when it changes, so a crash leaves the old one or the new one."""

    def __init__(self, path: Path, drop: frozenset[tuple[str, str]] = frozenset()):
        self.path = path
        if path.is_file():
            text = path.read_text(errors="surrogateescape")
            keep = text[:text.rfind("\n") + 1]
            if drop:
                keep = "".join(line + "\n" for line in keep.split("\n")[:-1] if _key(line) not in drop)
            if keep != text:
                write_text_atomic(path, keep, errors="surrogateescape")
        self._file = open(path, "a")

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _row(line: str) -> Optional[dict[str, Any]]:
    """The row of a tasks.jsonl line; None for a line that is not one."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    ok = isinstance(row, dict) and isinstance(row.get("runner"), str) and isinstance(row.get("task_id"), str)
    return row if ok else None


def _key(line: str) -> Optional[tuple[str, str]]:
    """(runner, task_id) of a tasks.jsonl line; None for a line that is not a row."""
    row = _row(line)
    return None if row is None else (row["runner"], row["task_id"])
