"""Job configuration: typed OmegaConf schemas, YAML recipes and dotted command-line overrides.

Every k3rl command reads `CONFIG.yaml` followed by `key=value` overrides
(`k3rl train configs/rl/quickstart.yaml learner.lr=1e-5 ray.address=auto`). The schema is one
dataclass tree (`JobConfig`, one section per component, as torchtitan does); a YAML file sets
any subset of it. A recipe may start from other recipes with `base:` (a path or a list of
paths, relative to the file), merged in order before the file's own values.

Mistakes are caught before any work starts: an unknown key names its full dotted path and lists
the valid keys at that level; a value of the wrong type names the key, the value and the type
the schema expects.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from k3rl.model.config import ModelConfig


class ConfigError(ValueError):
    """A configuration file or override that does not fit the schema."""


@dataclass
class RunConfig:
    """Where a job writes and how it is seeded."""

    name: str = "k3rl"
    """Run name; the run directory is `output_dir/name`."""
    output_dir: str = "runs"
    seed: int = 0
    device: str = "cpu"
    """`cpu` or `cuda`."""
    trust_remote_code: bool = False
    """Whether a model directory's own Python code (an `auto_map` in its tokenizer_config.json or config.json:
    `tokenization_*.py`, `modeling_*.py`) may be imported, by every command and Ray worker of the job, and copied
    into checkpoints. Off: such a directory is refused by name (model/formats/trust.py); k3rl's own K3 directories never
    need it."""
    allow_nonfinite_weights: bool = False
    """Whether a model directory holding NaN/±inf weights may be loaded (`k3rl eval`; off: refused by name, naming
    the tensors, model/formats/integrity.py). Training refuses them regardless: no step can be taken from them."""


@dataclass
class RayConfig:
    """How the driver joins Ray: `address=null` starts a local cluster, `auto` joins a running one."""

    address: Optional[str] = None
    num_cpus: Optional[int] = None
    """CPUs of a local cluster (null: all); ignored when joining an existing cluster."""
    include_dashboard: bool = False
    runtime_env: dict[str, Any] = field(default_factory=dict)
    """Ray's own `runtime_env` for every actor of the job (`py_modules`, `working_dir`, `env_vars`, `pip`, …):
    how a user's code and data reach the nodes of a cluster. A `module:Class` environment outside the
    installed packages is added to `py_modules` by the driver."""


# Choices are string enums: a value outside them fails at config time, naming the valid ones, and every
# member compares (and prints) as its string, so code reads `rl.mode == "async"`. Member names are the
# strings users write (OmegaConf matches by name), hence the functional form where one is a keyword.
Mode = StrEnum("Mode", {"sync": "sync", "async": "async"})
"""How rollouts and training interleave: `sync` (workers and learner take turns) or `async` (rollouts
continue while the learner trains, bounded by `rl.max_staleness`)."""
EngineName = StrEnum("EngineName", {"torch": "torch", "vllm": "vllm"})
"""The rollout engine: `torch` (k3rl's own, rollout/torch_engine.py) or `vllm` (rollout/vllm_engine.py)."""
BadRows = StrEnum("BadRows", {"refuse": "refuse", "skip": "skip"})
"""A task-file row that is not JSON or not a task of the environment: refused or skipped."""
Optimizer = StrEnum("Optimizer", {"adamw": "adamw", "muon": "muon"})
"""The learner's optimizer (rl/train/optim.py)."""
DType = StrEnum("DType", {n: n for n in ("float32", "bfloat16", "float16", "float64")})
"""The learner's parameter dtype."""
PartialResume = StrEnum("PartialResume", {"reprefill": "reprefill", "keep_state": "keep_state"})
"""How a paused episode continues under new weights (`rollout.partial_resume`)."""
LRSchedule = StrEnum("LRSchedule", {n: n for n in ("constant", "constant_with_warmup", "linear", "cosine", "wsd")})
"""The learning-rate schedule over optimizer steps (transformers' schedulers of these names; rl/train/optim.py)."""


@dataclass
class RLConfig:
    """The schedule of the policy-gradient job: how many steps of how many samples, sync or async, where
    the initial policy is, checkpoints. The algorithm is in `algo:`, the rollouts in `rollout:`, the tasks
    in `env:`, held-out evaluation in `eval:`, the optimizer in `learner:`."""

    steps: int = 20
    tasks_per_step: int = 8
    """Tasks (groups) per optimizer step."""
    group_size: int = 4
    """Samples per task; group-relative algorithms normalise within a group."""
    mode: Mode = Mode["sync"]
    """`sync` or `async` (rollouts continue while the learner trains)."""
    max_staleness: int = 1
    """Async mode: the most policy versions a trained token may lag behind the learner."""
    num_learners: int = 1
    """Data-parallel learner ranks (Ray actors)."""
    learner_num_cpus: float = 1.0
    """Ray CPUs per learner rank."""
    learner_num_gpus: float = 0.0
    """Ray GPUs per learner rank (run.device=cuda)."""
    save_every: int = 10
    """Checkpoint every this many steps (and after the last)."""
    resume: bool = False
    """Continue the run in `run.output_dir/run.name` from its newest complete checkpoint."""
    model_path: Optional[str] = None
    """Hugging Face directory of the initial policy (`k3rl init`, an SFT output, any HF causal LM)."""
    keep_checkpoints: int = 3
    """Complete checkpoints kept in `<run_dir>/checkpoints` (older ones are deleted)."""


@dataclass
class AlgoSection:
    """The training objective the learner optimises (rl/algos/)."""

    name: str = "grpo"
    """Name of an objective in `rl/algos/`: grpo, dr_grpo, rloo, ppo, gspo, cispo, or nll (supervised)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Settings of that objective (clip bounds, KL, truncated IS…); its config checks the keys."""


@dataclass
class RolloutConfig:
    """How trajectories are sampled: the engine, the sampling, the episode limits, the workers."""

    engine: EngineName = EngineName["torch"]
    """`torch` (k3rl's own, the CPU default) or `vllm`; also the engine `k3rl eval` runs `eval.model_path` on."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Settings of that engine's constructor (`torch`: `max_batch`; `vllm`: any `vllm.EngineArgs` field, e.g.
    `gpu_memory_utilization`, `enforce_eager`), checked against it before Ray starts."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    """Sampled tokens per turn."""
    max_turns: int = 4
    """Model turns per episode (the environment's own budget may be lower)."""
    max_context_tokens: int = 4096
    """Longest episode (prompt + every turn) in tokens."""
    num_workers: int = 1
    """Rollout actors (Ray), each with its own engine."""
    num_cpus: float = 1.0
    """Ray CPUs per rollout worker."""
    num_gpus: float = 0.0
    """Ray GPUs per rollout worker (run.device=cuda)."""
    max_restarts: int = 10
    """Rollout actors replaced after dying, over the whole run, before the run gives up."""
    partial_rounds: int = 0
    """Partial rollouts: model turns per episode in one collection call; an episode still running after them is
    paused at that turn boundary and kept by its worker, which continues it in its next call with the weights
    pushed meanwhile, so a long episode spans learner steps without holding them up. Its sampled tokens then carry
    several policy versions; `rl.max_staleness` bounds the oldest (the group is dropped beyond it). 0: off (every
    call runs its episodes to the end)."""
    partial_resume: PartialResume = PartialResume["reprefill"]
    """How a paused episode continues: `reprefill` (the new weights prefill its whole context again) or
    `keep_state` (continue from the KV/recurrent state the old weights computed, prefilling only the tokens
    added since; the context tokens read from such a state are reported as `episode/stale_state_tokens`). Only
    the native engine keeps an episode's state across a weight update (`engine: torch`, a K3 model,
    `engine_args.reuse_state` on); vLLM or an HF model with `keep_state` is refused at start."""


@dataclass
class EnvSection:
    """The environment and the tasks it is trained on."""

    name: str = "search"
    """A registered name (`k3rl envs`), a `k3rl.envs` entry point of an installed package, or
    `module.path:ClassName` of the user's own (importable, or in the current directory)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment (`envs.make(env.name, **env.args)`), e.g. `corpus: null`."""
    tasks_path: Optional[str] = None
    """JSONL file of training tasks (one JSON task per line); null: `env.tasks(num_tasks, seed=run.seed)`."""
    num_tasks: int = 256
    """Training tasks drawn from the environment when `tasks_path` is null."""
    bad_task_rows: BadRows = BadRows["refuse"]
    """A row of `env.tasks_path`/`eval.tasks_path` that is not JSON or not a task of the environment: `refuse`
    (a named error before anything runs) or `skip` (left out; the count and the first rows are printed)."""
    success_key: Optional[str] = None
    """Reward component (`Trajectory.rewards`) that marks success when ≥ 1; null: the environment's own rule
    (`Env.success_metric`, e.g. `em`; none declared: reward ≥ 1). See rl/eval/evaluate.py."""


@dataclass
class LearnerSettings:
    """The `learner:` section: how the policy is optimised, for every objective the learner trains
    (rl/train/learner.py `LearnerConfig` adds what the driver decides: model, algorithm, seed, device)."""

    lr: float = 1e-5
    """Peak learning rate of the optimizer."""
    weight_decay: float = 0.0
    """Decoupled weight decay, on matrices (≥ 2-D) only; norms, biases and 1-D parameters get none."""
    adam_beta1: float = 0.9
    """AdamW β₁ (also the AdamW part of `muon`)."""
    adam_beta2: float = 0.999
    """AdamW β₂."""
    adam_eps: float = 1e-8
    """AdamW ε."""
    optimizer: Optimizer = Optimizer["adamw"]
    """`adamw`, or `muon`: torch.optim.Muon on the 2-D hidden matrices (not embeddings, LM head, or
    [1, d] vectors) with `adjust_lr_fn="match_rms_adamw"` so `lr` means the same, AdamW on the rest."""
    muon_momentum: float = 0.95
    """Momentum of Muon's matrices (`optimizer: muon`)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0: no clipping; the norm is reported either way)."""
    micro_batch_tokens: int = 8192
    """Padded tokens (B·T) per micro-batch; a longer sequence gets a micro-batch of its own."""
    logprob_chunk_size: int = 1024
    """Loss-mask rows per chunk of the LM head (peak extra memory ≈ chunk × V × 4 bytes)."""
    compute_entropy: bool = False
    """Also report the policy entropy on loss-mask tokens (one more pass over each chunk)."""
    routing_replay: bool = True
    """R3: replay `Trajectory.routed_experts` on MoE models that accept `routed_expert_ids`."""
    ref_model_path: Optional[str] = None
    """Reference policy for the KL term (algo_args.kl_coef > 0); null: the initial policy."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in backward (less memory, about a third more compute)."""
    dtype: DType = DType["float32"]
    """Parameter dtype: float32, bfloat16, float16 or float64 (tests). The optimizers update the
    parameters in this dtype (no fp32 master copy); tensors the model keeps in fp32 stay fp32."""
    lr_scheduler: LRSchedule = LRSchedule["constant"]
    """`constant`, `constant_with_warmup`, `linear` or `cosine` (both decay to `min_lr_ratio` × lr at
    `total_steps`), or `wsd` (warmup, stable, then a cosine decay over the last `decay_steps`), over optimizer
    steps (a skipped step does not advance it). Like transformers, step k uses the factor of k, so a warmup's
    first step has learning rate 0."""
    warmup_steps: int = 0
    """Linear warmup from 0 to `lr` over this many steps (not for `constant`)."""
    total_steps: Optional[int] = None
    """Steps `linear` and `cosine` decay over; null: the job's step count (`rl.steps`, or the SFT run's steps)."""
    decay_steps: int = 0
    """`wsd`: the last steps, which decay the learning rate."""
    min_lr_ratio: float = 0.0
    """`cosine` and `wsd`: the learning rate they decay to, as a fraction of `lr`."""
    micro_batch_seqs: Optional[int] = None
    """At most this many sequences per micro-batch besides the token budget; null: no limit."""
    segment_tokens: Optional[int] = None
    """K3: train a sequence (or shared prompt) longer than this segment by segment — the forward keeps only the
    state at each boundary, the backward recomputes one segment at a time (rl/train/segments.py): activation memory of
    one segment, same loss and gradients, one more forward. null: whole sequences."""
    share_prefix: bool = True
    """The samples of a group share their prompt: forward and backward it once and branch from its state (K3: the
    hybrid cache, the prompt's tokens counted once in the router statistics; other models: their KV cache;
    rl/train/segments.py)."""
    expert_parallel: int = 1
    """K3: split the routed experts of every MoE layer across this many learner ranks (all-to-all token dispatch,
    rl/train/expert_parallel.py); the ranks form data-parallel replicas of `expert_parallel` ranks each, so the number of
    learner ranks (`rl.num_learners`) must be a multiple of it. 1: every rank holds every expert."""
    fsdp: bool = False
    """K3: shard parameters, gradients and optimizer states across the learner ranks with FSDP2 (the routed experts
    across the data-parallel replicas, as they are already split by `expert_parallel`; rl/train/parallel.py). With
    `expert_parallel > 1` or `fsdp` (and more than one rank) the learner runs only AdamW, no reference model
    (`algo.args.kl_coef: 0`), whole sequences (`segment_tokens: null`) and no prefix sharing (`share_prefix: false`),
    since every rank must run the same forward and backward passes."""


# Keys that moved to another section: a recipe or override that still uses one is told where it went.
MOVED_KEYS = {
    "rl.lr": "learner.lr", "rl.weight_decay": "learner.weight_decay", "rl.max_grad_norm": "learner.max_grad_norm",
    "rl.algo": "algo.name", "rl.algo_args": "algo.args",
    "rl.engine": "rollout.engine", "rl.temperature": "rollout.temperature", "rl.top_p": "rollout.top_p",
    "rl.max_new_tokens": "rollout.max_new_tokens", "rl.max_turns": "rollout.max_turns",
    "rl.max_context_tokens": "rollout.max_context_tokens", "rl.num_rollout_workers": "rollout.num_workers",
    "rl.rollout_num_cpus": "rollout.num_cpus", "rl.rollout_num_gpus": "rollout.num_gpus",
    "rl.max_worker_restarts": "rollout.max_restarts",
    "rl.env": "env.name", "rl.env_args": "env.args", "rl.tasks_path": "env.tasks_path",
    "rl.num_tasks": "env.num_tasks", "rl.bad_task_rows": "env.bad_task_rows", "rl.success_key": "env.success_key",
    "rl.eval_every": "eval.every", "rl.eval_tasks_path": "eval.tasks_path", "rl.eval_tasks": "eval.num_tasks",
    "rl.eval_seed": "eval.seed", "rl.eval_temperature": "eval.temperature", "eval.tasks": "eval.families",
}
"""Keys of earlier recipes and where they live now: using one is an error that names the new place."""


LRShape = StrEnum("LRShape", {n: n for n in ("wsd", "cosine", "constant")})
"""A pretraining stage's learning-rate shape: `wsd` (warmup, stable, decay over the last `decay_fraction`),
`cosine` (warmup, then cosine to `min_lr_ratio`) or `constant` (after warmup)."""
OptimizerHandoff = StrEnum("OptimizerHandoff", {"keep": "keep", "reset": "reset"})
"""What a stage takes of the previous stage's optimizer: its moments (`keep`) or nothing (`reset`)."""


@dataclass
class DataSource:
    """One pretraining corpus (rl/pretrain/data.py): read (every local file checked before any work: a bad one
    is `path:line: what is wrong`), its control-token strings neutralised, tokenized once and cached."""

    path: str = "wiki"
    """A built-in corpus (`wiki`: Wikipedia lead summaries, `shakespeare`: 42 plays) or a local file, directory or
    glob of text, JSONL or Parquet files."""
    format: str = "auto"
    """`auto` (from the suffix), `text`, `json` (JSONL) or `parquet`; ignored for built-in corpora."""
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
    """One stage of the staged context climb (8K → 64K → 256K → 1M); rl/commands/pretrain.py."""

    seq_len: int = 8192
    """Tokens per packed row (documents packed to this length, their boundaries respected)."""
    tokens: int = 1_000_000
    """Token budget of the stage (rounded up to whole optimizer steps of `batch_tokens`)."""
    batch_tokens: int = 65536
    """Tokens per optimizer step over all ranks (a multiple of `seq_len`)."""
    lr: float = 3e-4
    """Peak learning rate."""
    schedule: LRShape = LRShape["wsd"]
    warmup_steps: int = 0
    decay_fraction: float = 0.2
    """`wsd`: the fraction of the stage's steps spent decaying."""
    min_lr_ratio: float = 0.0
    """The learning rate at the end of the decay, as a fraction of `lr`."""
    rope_theta: Optional[float] = None
    """RoPE base of the MLA layers from this stage on (models with `mla_use_nope: false`; null keeps the model's;
    under NoPE it is ignored, and the run says so once)."""
    mixture: dict[str, float] = field(default_factory=dict)
    """Weights of `pretrain.sources` by name (normalised; empty: every source, weighted by its tokens)."""
    optimizer: OptimizerHandoff = OptimizerHandoff["keep"]
    """From the previous stage's final checkpoint: keep its optimizer moments or reset them (the first stage
    starts fresh either way)."""
    segment_tokens: Optional[int] = None
    """Segment-recurrent training above this many tokens per document (null: `learner.segment_tokens`)."""


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
class PretrainConfig:
    """Staged pretraining of the backbone (`k3rl pretrain`, rl/commands/pretrain.py)."""

    model_dir: Optional[str] = None
    """Hugging Face directory to start from; null: a random model from the `model:` section."""
    sources: dict[str, DataSource] = field(default_factory=dict)
    """Corpora by name; stages mix them (`stages[i].mixture`). Empty: the built-in corpora, `wiki` (short
    documents) and `plays` (`shakespeare`, whole plays: the long documents)."""
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig()])
    num_learners: int = 1
    """Data-parallel learner ranks (> 1: Ray actors, as the RL learner's `rl.num_learners`)."""
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
    plan: PlanConfig = field(default_factory=PlanConfig)
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0


@dataclass
class EvalConfig:
    """Evaluation: the trainer's held-out evaluation (`every`, `tasks_path`, `num_tasks`, `seed`,
    `temperature`) and the long-context evidence-retrieval settings (`families`, `context_lengths`, `serve`)."""

    every: int = 10
    """Evaluate every this many steps (also before the first and after the last); 0: never."""
    tasks_path: Optional[str] = None
    """JSONL file of held-out tasks; null: `env.tasks(num_tasks, seed=seed)`."""
    num_tasks: int = 32
    """Held-out tasks drawn from the environment when `tasks_path` is null."""
    seed: int = 1_000_003
    """Seed of the held-out tasks (distinct from run.seed); tasks equal to a training task are removed."""
    temperature: float = 0.0
    """Sampling temperature of evaluation (0: greedy)."""
    families: list[str] = field(default_factory=lambda: ["needle", "multihop"])
    """Long-context task families of `k3rl eval` (envs/longctx/: needle, multihop, aggregate, ith; `file`: the
    real tasks of `tasks_file`)."""
    tasks_file: Optional[str] = None
    """`k3rl eval`: the JSONL task file of the `file` family (real questions and documents; format in
    envs/README.md), whose first `num_tasks` tasks fill each of its cells. Not `tasks_path` (the trainer's)."""
    context_lengths: list[int] = field(default_factory=lambda: [4096])
    """Lengths (tokens of the in-context prompt, counted with the evaluated model's tokenizer) of `k3rl eval`'s grid."""
    serve: list[str] = field(default_factory=lambda: ["context"])
    """Servings of `k3rl eval`: `context` (haystack in the prompt) and/or `search` (behind the search tool)."""
    model_path: Optional[str] = None
    """`k3rl eval`: the HF model directory evaluated (K3 or any HF causal LM) on the engine of `rollout.engine`
    (`torch`: k3rl's own; `vllm`: any model vLLM runs, not K3, whose vLLM kernels need CUDA); its tokenizer counts
    the lengths. With `endpoint`, only its tokenizer is used (null: the one the served model's name resolves to)."""
    endpoint: Optional[str] = None
    """`k3rl eval`: evaluate a served model instead, at this OpenAI-compatible base URL (`vllm serve MODEL --port
    8000`: http://127.0.0.1:8000/v1), greedy through POST /chat/completions; an API key is read from OPENAI_API_KEY
    (never from the config, which is written next to the results)."""
    endpoint_model: Optional[str] = None
    """`k3rl eval`: the served model's name at `endpoint`; null: the first of GET /models."""
    endpoint_timeout_s: float = 600.0
    """`k3rl eval`: seconds one chat request to `endpoint` may take, all of it (connect, send, every byte of the
    reply: a server trickling bytes is cut there); past it — or on a refused connection, a 5xx or a 429 — it is
    retried. Also the longest wait before a retry, whatever the server's Retry-After asks."""
    endpoint_retries: int = 2
    """`k3rl eval`: retries of a failed chat request (after 1, 2, 4 … s or the server's Retry-After, at most
    `endpoint_timeout_s`); then the task is an error row and the run goes on. A resumed eval runs the tasks again
    whose error was transient (connection, timeout, 5xx, 429) and keeps the others (a 4xx refusal, …)."""
    endpoint_task_timeout_s: Optional[float] = None
    """`k3rl eval`: seconds one task may take at `endpoint`, all its turns, retries and waits together (past it:
    an error row, retried on resume). null: no bound but the per-request ones — up to `rollout.max_turns` ×
    (`endpoint_retries` + 1) × `endpoint_timeout_s` plus the waits."""
    endpoint_max_reply_chars: int = 65536
    """`k3rl eval`: the longest reply kept from `endpoint`, in characters; a longer one is cut (the row says
    `reply_truncated`), and its body is not read past 12 bytes a character (+ 64 KiB)."""
    max_position_embeddings: Optional[int] = None
    """`k3rl eval`: evaluate the model (native engine) with this many positions instead of its config's — to
    measure retrieval beyond the length it was trained at (NoPE MLA and KDA use no positions; a RoPE model
    extrapolates). null: the model's own limit, past which a task is an error row."""
    baselines: list[str] = field(default_factory=lambda: ["oracle", "closed_book"])
    """`k3rl eval`: reference policies run on the same tasks — `oracle` (the ceiling) and `closed_book` (answers
    at once with another task's answer: the floor)."""
    batch_size: int = 8
    """`k3rl eval`: episodes per engine batch (and per resume point)."""
    depth_bins: int = 3
    """`k3rl eval`: bins of evidence depth (position of a task's deepest evidence passage in the haystack) in the
    heatmaps."""
    effective_ratio: float = 0.85
    """Effective length = the longest length whose success is ≥ this × the success at the shortest length."""


@dataclass
class SFTConfig:
    """Supervised warm start on oracle demonstrations (`k3rl sft`). What a rollout allows comes from
    the `rl:` section (`max_turns`, `max_new_tokens` per turn, `max_context_tokens`), so every
    demonstration is one the rollouts that follow could have produced; longer ones are dropped."""

    env: Optional[str] = None
    """Registered environment whose oracle plays the demonstrations; null: `env.name`."""
    env_args: Optional[dict[str, Any]] = None
    """Constructor arguments of that environment; null: `env.args`."""
    model_dir: Optional[str] = None
    """Hugging Face model directory (with a chat-template tokenizer) to start from; null builds a
    random model from the `model:` section (`k3rl init`) into the run directory's `init/`."""
    num_tasks: int = 64
    """Tasks played by the oracle (`env.tasks(num_tasks, seed=task_seed)`); the kept ones are the training set."""
    task_seed: Optional[int] = None
    """Seed of those tasks; null: `run.seed` (the tasks `k3rl train` draws)."""
    min_reward: float = 1.0
    """Demonstrations whose episode reward is below this are dropped."""
    closed_book_rate: float = 0.0
    """Fraction of the tasks demonstrated by a closed-book teacher that answers at once with a guess
    (another task's answer) instead of the oracle (`envs.teachers.ClosedBookPolicy`); kept whatever their reward."""
    hedging_rate: float = 0.0
    """Fraction of the tasks demonstrated by a teacher that hedges the oracle's final answer
    ("grey" → "grey, I think"; `envs.teachers.HedgingPolicy`); kept whatever their reward. The quickstart
    uses it so that SFT leaves a habit that only the reward shows to be wrong."""
    hedge: str = ", I think"
    """What the hedging teacher appends to its answer. A longer hedge earns less F1 credit (", I
    think": 0.5; ", I think, but I am not sure": 0.22), so the reward tells it from a bare answer more clearly."""
    max_steps: int = 100
    """Optimizer steps; 0 or less trains for `epochs` epochs instead."""
    epochs: float = 1.0
    """Passes over the demonstrations when `max_steps` ≤ 0 (each epoch in a fresh order of `run.seed`)."""
    batch_size: int = 1
    """Demonstrations per micro-batch (the learner's `micro_batch_seqs`; `learner.micro_batch_tokens`
    still bounds B·T). One per micro-batch suits the CPU: no padding and no [B, H, T, T] attention scores
    in K3's MLA."""
    grad_accum: int = 8
    """Micro-batches per optimizer step: each step trains on `batch_size × grad_accum` demonstrations,
    and the update equals one batch of them (the loss divides by the step's loss tokens)."""
    lr: float = 1e-3
    """Peak learning rate of SFT (the `learner:` section's is RL's); the other `learner:` settings
    (optimizer, dtype, micro_batch_tokens, …) apply to SFT as well."""
    lr_scheduler: LRSchedule = LRSchedule["constant_with_warmup"]
    """`constant`, `constant_with_warmup`, `linear` or `cosine` (decaying to 0 at the last step)."""
    warmup_steps: int = 10
    """Linear warmup of the learning rate from 0 over this many steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay on matrices (as `learner.weight_decay`)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    logging_steps: int = 10
    """Steps per line of progress and per row of `metrics.jsonl` (means over the steps since the last row)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (less memory, slower)."""
    logprob_chunk_size: int = 1024
    """Loss-token rows per LM-head chunk (`model.logprobs.selected_logprobs`)."""
    eval_tasks: int = 0
    """Held-out tasks (`env.tasks(eval_tasks, seed=eval.seed)` minus training tasks) rolled out
    greedily after training: success (rl/eval/evaluate.py, the environment's rule or `env.success_key`), well-formed
    tool calls; 0 skips."""


@dataclass
class JobConfig:
    """Every section a k3rl job can set; commands read the sections they need."""

    run: RunConfig = field(default_factory=RunConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    algo: AlgoSection = field(default_factory=AlgoSection)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvSection = field(default_factory=EnvSection)
    learner: LearnerSettings = field(default_factory=LearnerSettings)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


def load_config(path: str | Path | None, overrides: list[str] = (), schema: type = JobConfig) -> DictConfig:
    """Schema defaults ← `base:` recipes ← the YAML file ← `key=value` overrides, checked at each step."""
    cfg = OmegaConf.structured(schema)
    if path is not None:
        for layer, source in _yaml_layers(Path(path)):
            _check_keys(layer, schema, source)
            cfg = _merge(cfg, layer, source, schema)
    for item in overrides:
        if item.startswith("~"):
            cfg = _reset(cfg, item[1:], schema)
            continue
        key, value = _parse_override(item)
        _check_keys(_nest(key, value), schema, f"override '{item}'")
        cfg = _merge(cfg, _nest(key, value), f"override '{item}'", schema)
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config key '{getattr(e, 'full_key', '?')}': {e.msg}") from None
    return cfg


def load_model_config(path: str | Path, overrides: list[str] = ()) -> Any:
    """The `model:` section of any recipe (a model file or a job recipe, `base:` recipes included) as a
    validated `K3Config`. Overrides may leave out the `model.` prefix (`hidden_size=64`)."""
    sections = {f.name for f in dataclasses.fields(JobConfig)}

    def qualified(item: str) -> str:
        bare = item.removeprefix("~")
        if bare.split(".", 1)[0].split("=", 1)[0] in sections:
            return item
        return ("~" if item.startswith("~") else "") + "model." + bare

    cfg = load_config(path, [qualified(o) for o in overrides])
    from k3rl.model.config import K3Config

    try:
        return K3Config.from_model_config(cfg.model)
    except ValueError as e:
        raise ConfigError(f"{path}: model.{e}") from None


def check_model_code(cfg: Any, key: str, path: str | Path, model: bool = True) -> None:
    """A ConfigError naming `key` when the model directory `path` asks to run its own code (an `auto_map`;
    only the tokenizer's unless `model`) and `run.trust_remote_code` is off (model/formats/trust.py): before any work."""
    from k3rl.model.formats.trust import RemoteCodeError, check_remote_code

    try:
        check_remote_code(path, bool(cfg.run.trust_remote_code), model=model)
    except RemoteCodeError as e:
        raise ConfigError(f"{key}: {e}") from None


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def _yaml_layers(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[dict, str]]:
    """The file's `base:` recipes (recursively, in order), then the file itself."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: `base:` recipes form a cycle")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    bases = data.pop("base", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: `base:` must be a path or a list of paths")
    layers: list[tuple[dict, str]] = []
    for base in bases:
        layers += _yaml_layers(path.parent / base, seen + (path,))
    layers.append((data, str(path)))
    return layers


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"override '{item}' is not of the form dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _reset(cfg: DictConfig, key: str, schema: type) -> DictConfig:
    """`~dotted.key`: a schema field goes back to its default (a dict field is emptied, so the
    overrides after it build a new one instead of merging into the recipe's); an entry of a free-form
    dict (`~env.args.length`) is removed."""
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"override '~{key}' is not of the form ~dotted.key")
    if key in MOVED_KEYS:
        raise ConfigError(f"override '~{key}': config key '{key}' has moved to '{MOVED_KEYS[key]}'")
    defaults = OmegaConf.structured(schema)
    parent_key, _, leaf = key.rpartition(".")
    if OmegaConf.select(defaults, key, default=_MISSING) is not _MISSING:
        default = OmegaConf.select(defaults, key)
        value = OmegaConf.to_container(default) if isinstance(default, (DictConfig, ListConfig)) else default
        OmegaConf.update(cfg, key, value, merge=False)
        return cfg
    parent = OmegaConf.select(cfg, parent_key) if parent_key else None
    if isinstance(parent, DictConfig) and leaf in parent:
        del parent[leaf]
        return cfg
    raise ConfigError(f"override '~{key}': no config key '{key}' to reset")


def _nest(key: str, value: Any) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _schema_fields(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _unwrap(tp: Any) -> Any:
    """Optional[X] → X; list[X] → list[X] unchanged."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _check_keys(data: Any, schema: type, source: str, prefix: str = "") -> None:
    """Every key of `data` must exist in `schema`; nested dicts are checked against nested dataclasses."""
    if not isinstance(data, dict):
        return
    known = _schema_fields(schema)
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in known:
            if full in MOVED_KEYS:
                raise ConfigError(f"{source}: config key '{full}' has moved to '{MOVED_KEYS[full]}'")
            level = prefix[:-1] or "the top level"
            named = _first_leaf_path(value, full)
            raise ConfigError(
                f"{source}: unknown config key '{named}' ('{key}' is not a key of {level}); "
                f"valid keys there: {', '.join(known)}"
            )
        tp = _unwrap(known[key])
        if dataclasses.is_dataclass(tp):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{source}: config key '{full}' is a section ({tp.__name__}); got value {value!r}")
            _check_keys(value, tp, source, f"{full}.")
        elif typing.get_origin(tp) is list and isinstance(value, list):
            (item_tp,) = typing.get_args(tp) or (Any,)
            if dataclasses.is_dataclass(item_tp):
                for i, item in enumerate(value):
                    _check_keys(item, item_tp, source, f"{full}[{i}].")
        elif typing.get_origin(tp) is dict and isinstance(value, dict):
            item_tp = (typing.get_args(tp) or (str, Any))[1]
            if dataclasses.is_dataclass(item_tp):
                for name, item in value.items():
                    _check_keys(item, item_tp, source, f"{full}.{name}.")


def _first_leaf_path(value: Any, path: str) -> str:
    """`no` with value {'such': {'key': 1}} → `no.such.key`: the whole key the user wrote."""
    while isinstance(value, dict) and len(value) == 1:
        (key, value), = value.items()
        path = f"{path}.{key}"
    return path


def _find_path(data: Any, leaf: str, path: str = "") -> str | None:
    """The dotted path (with [i] for list items) of the first key named `leaf` inside `data`."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        here = f"{path}[{key}]" if isinstance(data, list) else (f"{path}.{key}" if path else str(key))
        if key == leaf:
            return here
        found = _find_path(value, leaf, here)
        if found:
            return found
    return None


def _expected_type(schema: type, full_key: str) -> str:
    tp: Any = schema
    for part in full_key.replace("]", "").replace("[", ".").split("."):
        if part.isdigit():
            tp = (typing.get_args(tp) or (Any,))[0]
            continue
        tp = _unwrap(tp)
        if not dataclasses.is_dataclass(tp):
            break
        tp = _schema_fields(tp).get(part, Any)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(m.value for m in tp)
    return getattr(tp, "__name__", str(tp)) if not typing.get_args(tp) else str(tp).replace("typing.", "")


def _merge(cfg: DictConfig, layer: dict, source: str, schema: type) -> DictConfig:
    try:
        return OmegaConf.merge(cfg, layer)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        value = _lookup(layer, key)
        if value is _MISSING:
            key = _find_path(layer, key.rsplit(".", 1)[-1]) or key
            value = _lookup(layer, key)
        raise ConfigError(
            f"{source}: config key '{key}' got {value!r} ({type(value).__name__}), "
            f"expected {_expected_type(schema, key)}"
        ) from None


def _lookup(data: Any, full_key: str) -> Any:
    for part in full_key.replace("]", "").replace("[", ".").split("."):
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return _MISSING
    return data


_MISSING = object()
