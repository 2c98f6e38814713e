"""The cells and tasks of `k3rl eval`'s grid (rl/eval/grid.py): `eval.families` (envs/longctx/; `file`: the real
tasks of `eval.tasks_path`) × `eval.serve` (in context, or behind the search tool over the same haystack) ×
`eval.context_lengths` (tokens of the whole in-context prompt, counted with the evaluated model's tokenizer),
`eval.num_tasks` tasks per cell, deterministic in `eval.seed`. Each task records its evidence depths (where each
evidence passage sits in the haystack, 0 = start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from k3rl.rl.config import ConfigError

SERVINGS = ("context", "search")
BASELINES = ("oracle", "closed_book")
REPORTED = ("em", "f1", "evidence_recall", "evidence_recall_at_5", "search_calls", "open_calls")
"""The reward components and counters a task row keeps (the environments report them; rl/eval/evaluate.py scores them)."""


@dataclass(frozen=True)
class Cell:
    family: str
    serve: str
    length: int

    @property
    def name(self) -> str:
        return f"{self.family}/{self.serve}/{self.length}"


@dataclass
class GridTask:
    """One task of the grid: its cell, id, the environment's task dict, and what its instance looks like."""

    cell: Cell
    task_id: str
    task: dict[str, Any]
    depths: list[float]
    """Position of every evidence passage in the haystack, in [0, 1], in reading order (`Instance.evidence_depths`;
    empty when it has none: unanswerable)."""
    prompt_tokens: int
    """Tokens of the whole in-context prompt (chat template, system message with the tools, the user message)."""

    @property
    def depth(self) -> float:
        """The first (shallowest) evidence passage's position (NaN when there is none): rows' `depth`, as before
        `depths` was recorded."""
        return self.depths[0] if self.depths else math.nan


def scaffold_tokens(env: Any, tokenizer: Any) -> int:
    """Tokens the chat template and the system message (tools, call syntax) add to an in-context prompt's user
    message, so a cell's length counts the whole prompt the model reads, not the user message alone
    (0 for a tokenizer without a chat template: then only the user message is counted)."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return 0
    from k3rl.rollout.chat import ChatRenderer

    messages = [{"role": "system", "content": env.system_message()}, {"role": "user", "content": ""}]
    return len(ChatRenderer(tokenizer).prompt_tokens(messages))



def env_kwargs(cfg: Any, cell: Cell, tokenizer: Any) -> dict[str, Any]:
    """Constructor arguments of a cell's environment: `env.args` when `env.name` is that family (minus the
    grid's own keys), the cell's serving and length, and the tokenizer lengths are counted with."""
    from omegaconf import OmegaConf

    from k3rl.envs.longctx.taskfile import FILE_FAMILY

    base = OmegaConf.to_container(cfg.env.args, resolve=True) if cfg.env.name == cell.family else {}
    base = {k: v for k, v in (base or {}).items() if k not in ("serve", "length", "tokenizer", "path")}
    own = {"path": cfg.eval.tasks_path} if cell.family == FILE_FAMILY else {}
    return {**base, **own, "serve": cell.serve, "length": cell.length, "tokenizer": tokenizer}


def build_grid(cfg: Any, tokenizer: Any) -> list[GridTask]:
    """Every task of the grid, in cell order (family, serving, length), deterministic in `eval.seed`."""
    import k3rl.envs as envs

    ev, out = cfg.eval, []
    for family in ev.families:
        try:
            first = envs.make(family, **env_kwargs(cfg, Cell(family, "context", 0), tokenizer))
        except TypeError as e:  # envs.registry.EnvArgumentError: `env.args` the family refuses
            raise ConfigError(f"env.args: environment {family!r} does not take these arguments ({e})") from None
        # both servings get the haystack of the in-context prompt of the cell's length
        scaffold = scaffold_tokens(first, tokenizer)
        for serve in ev.serve:
            for length in ev.context_lengths:
                cell = Cell(family, serve, int(length))
                env = envs.make(family, **env_kwargs(cfg, cell, tokenizer))
                # the same task seeds at every length and serving: cells differ only in the haystack
                tasks = env.tasks(ev.num_tasks, seed=ev.seed)
                if len(tasks) < ev.num_tasks and (not out or out[-1].cell.family != family):  # said once
                    print(f"k3rl eval: {family} has {len(tasks)} tasks (eval.tasks_path), fewer than "
                          f"eval.num_tasks={ev.num_tasks}: each of its cells runs all of them", flush=True)
                for i, task in enumerate(tasks):
                    task = {**task, "length": cell.length - scaffold}
                    try:
                        inst = env.instance(task)
                    except ValueError as e:  # a length too short for the family's facts, a source too small
                        raise ConfigError(f"eval.context_lengths: cannot build {cell.name} task {i}: {e} (the cell's "
                                          f"{cell.length} tokens minus {scaffold} of chat template and system "
                                          f"message)") from None
                    out.append(GridTask(cell, f"{cell.name}/{i}", task, inst.evidence_depths(),
                                        scaffold + int(inst.meta["tokens"])))
    return out
