"""Long-context evidence-retrieval tasks: seeded generators, two ways of serving, oracles.

Families (each instance is a pure function of ``(family, seed, options)``):

- ``needle``: one record among near-miss distractors, keys literal or paraphrased (RULER, NoLiMa).
- ``multihop``: chains of 1–4 hops over invented people, towns and rivers (MuSiQue).
- ``aggregate``: sum, count or arg-max over scattered ledger entries.
- ``ith``: the i-th of m near-identical memos (MRCR).

- ``file``: real questions and documents from a JSONL task file (multi-hop QA, long-document QA).

A share of every synthetic family (``unanswerable_rate``) has no answer in the text (a missing
link, an absent key, i > m); the gold answer is then "unanswerable". Served **in
context** (``serve="context"``) or **behind search** (``serve="search"``).

Layout: ``task.py`` (the types, template → regex), ``names.py`` (invented names), one
module per family holding its vocabulary, sentence templates, generator and solver
(``needle.py``, ``multihop.py``, ``aggregate.py``, ``ith.py``), ``families.py`` (the
family table), ``haystack.py`` (``generate``: facts hidden in real text, sized;
the in-context prompt), ``oracles.py`` (solvers played as policies), ``serving.py``
(the environments; registers them), ``taskfile.py`` (the ``file`` family: the task format, its
checks, its haystacks) and ``file_serving.py`` (its environments; registers them). Imports run one way, towards ``task.py``; nothing
here is imported by envs/search.py.
"""

from k3rl.envs.longctx.aggregate import GOODS
from k3rl.envs.longctx.families import DEFAULTS, FAMILIES, GENERATORS, SOLVERS
from k3rl.envs.longctx.file_serving import FileContextEnv, FileSearchEnv
from k3rl.envs.longctx.haystack import PROMPT_CONTEXT, generate, haystack_pool, parse_context, pool_words, render_context
from k3rl.envs.longctx.ith import MEMO_ADJ, MEMO_OBJ, ORDINALS
from k3rl.envs.longctx.multihop import RELATIONS
from k3rl.envs.longctx.names import ENTITY_PATTERN
from k3rl.envs.longctx.needle import COLOURS, OBJECTS, ROLES
from k3rl.envs.longctx.oracles import ContextOracle, FamilySearchOracle, solve_in_context
from k3rl.envs.longctx.serving import PROMPT_SEARCH, PROMPT_SEARCH_MINIMAL, LongContextEnv, LongContextSearchEnv
from k3rl.envs.longctx.task import UNANSWERABLE, Fact, Instance, Passages, Solver
from k3rl.envs.longctx.taskfile import FILE_FAMILY, FileTask, TaskFile, TaskFileError, read_task_file

__all__ = [
    "COLOURS", "DEFAULTS", "ENTITY_PATTERN", "FAMILIES", "FILE_FAMILY", "GENERATORS", "GOODS", "MEMO_ADJ",
    "MEMO_OBJ", "OBJECTS", "ORDINALS", "PROMPT_CONTEXT", "PROMPT_SEARCH", "PROMPT_SEARCH_MINIMAL", "RELATIONS",
    "ROLES", "SOLVERS", "UNANSWERABLE", "ContextOracle", "FamilySearchOracle", "Fact", "FileContextEnv", "FileSearchEnv",
    "FileTask", "Instance",
    "LongContextEnv", "LongContextSearchEnv", "Passages", "Solver", "TaskFile", "TaskFileError", "generate",
    "haystack_pool", "parse_context", "pool_words", "read_task_file", "render_context", "solve_in_context",
]
