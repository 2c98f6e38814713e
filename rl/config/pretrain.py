"""The `pretrain:` section of `k3rl pretrain`: corpora, the stages of the context climb, the cluster of `--plan`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional

from k3rl.rl.config.learner import PretrainLearner, StageLearner

OptimizerHandoff = StrEnum("OptimizerHandoff", {"keep": "keep", "reset": "reset"})
"""What a stage takes of the previous stage's optimizer: its moments (`keep`) or nothing (`reset`)."""


@dataclass
class DataSource:
    """One pretraining corpus (rl/pretrain/sources.py, token_cache.py): read (every local file checked before any work: a bad one
    is `path:line: what is wrong`), its control-token strings neutralised, tokenized once and cached."""

    path: str = "wiki"
    """A built-in corpus (`wiki`: Wikipedia lead summaries, `shakespeare`: 42 plays) or a local file, directory or
    glob of text, JSONL or Parquet files."""
    format: str = "auto"
    """`auto` (from the suffix), `text`, `json` (JSONL) or `parquet`; ignored for built-in corpora. `chat`: JSONL
    conversations (`{"messages": [{"role", "content"}, …]}`, e.g. an environment's oracle episodes:
    envs/longctx/practice.py `write_practice_episodes`) rendered through the model's chat template exactly as
    rollouts are (the framing tokens real, the contents neutralised), for a mid-training stage in the format RL
    samples; `text_field` and `group_by` do not apply."""
    text_field: str = "text"
    """The column holding the text (JSONL, Parquet)."""
    group_by: Optional[str] = None
    """Long documents: records sharing this column's value are concatenated, in order, into one document (e.g.
    the chapters of a book). Built-ins: `topic` groups the wiki summaries; the plays are whole already."""
    min_tokens: int = 0
    """Documents shorter than this (after grouping) are left out: a long-document source keeps only texts that
    really are long."""
    streaming: bool = False
    """Read Parquet files as a stream (`datasets` streaming): a corpus larger than memory is tokenized shard by
    shard into the on-disk cache. JSONL files are always read line by line, a text file whole (one document)."""


@dataclass
class StageConfig:
    """One stage of the staged context climb (8K → 64K → 256K → 1M); rl/pretrain/climb.py."""

    seq_len: int = 8192
    """Tokens per packed row (documents packed to this length, their boundaries respected)."""
    tokens: int = 1_000_000
    """Token budget of the stage (rounded up to whole optimizer steps of `batch_tokens`)."""
    batch_tokens: int = 65536
    """Tokens per optimizer step over all ranks (a multiple of `seq_len`)."""
    learner: StageLearner = field(default_factory=StageLearner)
    """The stage's learning rate, schedule and segment length (on top of `pretrain.learner` and `learner:`)."""
    decay_fraction: float = 0.2
    """`wsd`: the fraction of the stage's steps spent decaying."""
    rope_theta: Optional[float] = None
    """RoPE base of the MLA layers from this stage on (models with `mla_use_nope: false`; null keeps the model's;
    under NoPE it is ignored, and the run says so once)."""
    mixture: dict[str, float] = field(default_factory=dict)
    """Weights of `pretrain.sources` by name (normalised; empty: every source, weighted by its tokens)."""
    optimizer: OptimizerHandoff = OptimizerHandoff["keep"]
    """From the previous stage's final checkpoint: keep its optimizer moments or reset them (the first stage
    starts fresh either way)."""


@dataclass
class PlanConfig:
    """`k3rl pretrain CONFIG --plan`: the cluster the time estimate is for (rl/pretrain/plan.py)."""

    gpu: str = "h200"
    """Accelerator of the named cluster (its peak dense bf16 FLOP/s and memory come from rl/pretrain/plan.py)."""
    num_gpus: int = 1024
    mfu: float = 0.35
    """Model FLOPs utilisation assumed for the time estimate."""
    dtype_bytes: int = 2
    """Bytes per activation value (2: bf16 training)."""


@dataclass
class RetrievalScore:
    """The likelihood score of retrieval for base models (rl/pretrain/retrieval_score.py), at each stage's start and
    end beside the held-out loss by position: log p(gold answer | plain prompt) with vs without the evidence passages."""

    enabled: bool = False
    """Score after each stage (and at its start); off by default: at 16 tasks it costs two forwards of every length's
    prompt per task."""
    families: list[str] = field(default_factory=lambda: ["needle"])
    """Long-context families (envs/longctx/: needle, multihop, aggregate, ith) whose tasks are scored."""
    num_tasks: int = 16
    """Tasks per family and length (`env.tasks(num_tasks, seed=eval.seed)`, the held-out seed stream)."""
    lengths: list[int] = field(default_factory=list)
    """Lengths (tokens of the family's in-context prompt; those ≤ the stage's are used); empty: the stage's grid
    lengths (`pretrain.eval_lengths`)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The family's generator options (e.g. `{ask: colour, distractors: 0, paraphrase_rate: 0, source: wiki}`);
    `unanswerable_rate` is 0 unless set here."""


@dataclass
class PretrainConfig:
    """Staged pretraining of the backbone (`k3rl pretrain`, rl/pretrain/climb.py)."""

    model_dir: Optional[str] = None
    """Hugging Face directory to start from; null: a random model from the `model:` section."""
    sources: dict[str, DataSource] = field(default_factory=dict)
    """Corpora by name; stages mix them (`stages[i].mixture`). Empty: the built-in corpora, `wiki` (short
    documents) and `plays` (`shakespeare`, whole plays: the long documents)."""
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig()])
    heldout_source: Optional[str] = None
    """Source whose `heldout_docs` longest-available documents are held out for perplexity by position (null:
    the source with the longest documents)."""
    heldout_docs: int = 2
    heldout_every: int = 0
    """Perplexity by position on the held-out documents every this many steps (0: at each stage's start and end)."""
    save_every: int = 5
    """Checkpoint every this many steps of a stage (and at its end)."""
    keep_checkpoints: int = 2
    log_every: int = 1
    eval_grid: bool = True
    """After each stage, `k3rl eval`'s retrieval grid (`eval.families` × lengths up to the stage's) on its model."""
    eval_lengths: list[int] = field(default_factory=list)
    """Grid lengths (those ≤ the stage's length are used); empty: powers of 4 from 512 up to the stage length."""
    retrieval_score: RetrievalScore = field(default_factory=RetrievalScore)
    plan: PlanConfig = field(default_factory=PlanConfig)
    learner: PretrainLearner = field(default_factory=PretrainLearner)
    """What every stage trains with instead of these `learner:` fields (weight decay, clipping); the ranks are
    `learner.num_ranks`."""


def num_steps(stage: Any) -> int:
    """Optimizer steps of a stage: its token budget in whole steps of `batch_tokens` (rounded up)."""
    return max(1, math.ceil(stage.tokens / stage.batch_tokens))


def rows_per_step(stage: Any) -> int:
    """Packed rows of `seq_len` tokens per optimizer step (over all ranks)."""
    return stage.batch_tokens // stage.seq_len


def decay_steps(stage: Any) -> int:
    """`wsd`: the steps of the decay (the last `decay_fraction` of the stage)."""
    return round(stage.decay_fraction * num_steps(stage)) if str(stage.learner.lr_scheduler) == "wsd" else 0
