"""The two servings of the ``file`` family (envs/longctx/taskfile.py), registered as ``file``:
``make("file", path=…, serve="context" | "search", length=…, tokenizer=…)``.

A task is ``{"family": "file", "id", "seed"}`` (plus overrides such as ``length``); its instance is rebuilt from the
task file and kept while among the last few used, since an evaluation plays each task several times.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from k3rl.envs.base import Env, TextPolicy
from k3rl.envs.longctx.oracles import PassageContextOracle, PassageSearchOracle
from k3rl.envs.longctx.serving import LongContextEnv, LongContextSearchEnv
from k3rl.envs.longctx.task import Instance
from k3rl.envs.longctx.taskfile import FILE_FAMILY, SUMMARY, TaskFile, read_task_file
from k3rl.envs.registry import register


class _FileTasks:
    """What both servings of the ``file`` family share: a task is ``{"family": "file", "id", "seed"}`` (plus
    overrides such as ``length``), its instance rebuilt from the task file."""

    file: TaskFile

    def tasks(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """The first ``n`` tasks of the file (all of them when it has fewer); ``seed`` seeds their haystacks."""
        return [{"family": FILE_FAMILY, "id": t.id, "seed": seed} for t in self.file.tasks[:n]]

    def _instance_key(self, task: Mapping[str, Any]) -> tuple:
        return (FILE_FAMILY, self.file, str(task["id"]), int(task.get("seed", 0)), int(task.get("length", self.length)),
                task.get("source", self.source), self.tokenizer)

    def instance(self, task: Mapping[str, Any]) -> Instance:
        """The task's instance, built once while among the last few used (an eval plays each task several
        times: model, oracle, closed-book); treat it as read-only."""
        key = self._instance_key(task)
        if key in _INSTANCES:
            _INSTANCES.move_to_end(key)
            return _INSTANCES[key]
        _, _, task_id, seed, length, source, tokenizer = key
        inst = _INSTANCES[key] = self.file.instance(task_id, seed, length, source, tokenizer)
        while len(_INSTANCES) > 32:
            _INSTANCES.popitem(last=False)
        return inst


_INSTANCES: OrderedDict[tuple, Instance] = OrderedDict()
"""The most recently used instances, by ``_FileTasks._instance_key``."""


def _task_file(path: str | Path | None) -> TaskFile:
    if path is None:
        raise ValueError(f"the {FILE_FAMILY!r} family needs path=, a JSONL task file (envs/README.md)")
    return read_task_file(path)


class FileContextEnv(_FileTasks, LongContextEnv):
    """Tasks of a file served in context: the haystack is in the prompt; one tool, ``answer(text, evidence)``."""

    def __init__(self, path: str | None = None, length: int = 8192, source: str = "shakespeare", tokenizer: Any = None,
                 evidence_weight: float = 0.0):
        super().__init__(FILE_FAMILY, length=length, source=source, tokenizer=tokenizer, evidence_weight=evidence_weight)
        self.file = _task_file(path)

    def oracle(self, task: Mapping[str, Any]) -> TextPolicy:
        inst = self.instance(task)
        texts = dict(inst.passages)
        return PassageContextOracle(inst.answers[0], [texts[pid] for pid in inst.evidence])


class FileSearchEnv(_FileTasks, LongContextSearchEnv):
    """Tasks of a file served behind search: the same haystack is the corpus of ``search``/``open``."""

    def __init__(self, path: str | None = None, length: int = 8192, source: str = "shakespeare", tokenizer: Any = None,
                 max_k: int = 20, evidence_weight: float = 0.1, oracle_k: int | None = None, snippet_chars: int = 4000,
                 tool_prompt: str = "json", snippet: str = "head"):
        super().__init__(FILE_FAMILY, length=length, source=source, tokenizer=tokenizer, max_k=max_k,
                         evidence_weight=evidence_weight, oracle_k=oracle_k, snippet_chars=snippet_chars,
                         tool_prompt=tool_prompt, snippet=snippet)
        self.file = _task_file(path)

    def oracle(self, task: Mapping[str, Any]) -> TextPolicy:
        inst = self.instance(task)
        texts = dict(inst.passages)
        names = {pid: inst.meta["titles"].get(pid) or " ".join(texts[pid].split()[:12]) for pid in inst.evidence}
        return PassageSearchOracle(inst.question, inst.answers[0], names, self.oracle_k)


@register(FILE_FAMILY, summary=SUMMARY + " serve=context|search")
def file_family(serve: str = "context", tokenizer: Any = None, **kwargs: Any) -> Env:
    """The ``file`` family in context (``FileContextEnv``) or behind search (``FileSearchEnv``)."""
    if serve == "context":
        return FileContextEnv(tokenizer=tokenizer, **kwargs)
    if serve == "search":
        return FileSearchEnv(tokenizer=tokenizer, **kwargs)
    raise ValueError(f"serve must be 'context' or 'search', got {serve!r}")


__all__ = ["FileContextEnv", "FileSearchEnv", "file_family"]
