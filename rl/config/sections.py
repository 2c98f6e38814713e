"""The sections every command schema is built from: `run`, `ray`, `rl`, `algo`, `rollout`, `env`, `eval`, and the
choices (string enums) their fields take. The `learner:` section is in rl/config/learner.py, `pretrain:` in
rl/config/pretrain.py, the per-command schemas that compose them in rl/config/schemas.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional

Logger = StrEnum("Logger", {"tensorboard": "tensorboard", "wandb": "wandb"})
"""A sink of the run's scalars, config and plots (`run.loggers`, rl/log_sinks.py)."""


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
    loggers: list[Logger] = field(default_factory=lambda: [Logger.tensorboard])
    """Where scalars, the config and the plots go besides metrics.jsonl and the console (rl/log_sinks.py):
    `tensorboard` (run_dir/tb), `wandb` (Weights & Biases; offline into run_dir/wandb without an API key or with
    WANDB_MODE=offline, `wandb sync` uploads it later)."""
    wandb_project: str = "k3rl"
    """`run.loggers: [wandb]`: the project of the run."""
    wandb_entity: Optional[str] = None
    """`run.loggers: [wandb]`: the user or team (null: the API key's default)."""
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
WeightSync = StrEnum("WeightSync", {"object_store": "object_store", "broadcast": "broadcast"})
"""How the learner's weights reach the rollout workers (`rollout.weight_sync`)."""
PartialResume = StrEnum("PartialResume", {"reprefill": "reprefill", "keep_state": "keep_state"})
"""How a paused episode continues under new weights (`rollout.partial_resume`)."""
Recompute = StrEnum("Recompute", {n: n for n in ("none", "full", "selective")})
"""Activation recompute in training (model/modeling.py RECOMPUTE_MODES)."""
LRSchedule = StrEnum("LRSchedule", {n: n for n in ("constant", "constant_with_warmup", "linear", "cosine", "wsd")})
"""The learning-rate schedule over optimizer steps (transformers' schedulers of these names; rl/train/optim.py)."""


@dataclass
class RLConfig:
    """The schedule of the policy-gradient job: how many steps of how many samples, sync or async, where
    the initial policy is, checkpoints. The algorithm is in `algo:`, the rollouts in `rollout:`, the tasks
    in `env:`, held-out evaluation in `eval:`, the optimizer and the learner's ranks in `learner:`."""

    steps: int = 20
    tasks_per_step: int = 8
    """Tasks (groups) per optimizer step."""
    group_size: int = 4
    """Samples per task; group-relative algorithms normalise within a group."""
    mode: Mode = Mode["sync"]
    """`sync` or `async` (rollouts continue while the learner trains)."""
    max_staleness: int = 1
    """Async mode: the most policy versions a trained token may lag behind the learner."""
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
    weight_sync: WeightSync = WeightSync["object_store"]
    """How the learner's weights reach the workers after each step: `object_store` (the learner puts them in Ray's
    object store once, every worker maps them: rollout/weight_transfer.py) or `broadcast` (one collective over a
    group of the learner and the workers, NCCL between GPUs and gloo on the CPU: rollout/weight_broadcast.py; the
    learner waits for every worker to take it)."""
    partial_rounds: int = 0
    """Partial rollouts: model turns per episode in one collection call; an episode still running after them is
    paused at that turn boundary and kept by its worker, which continues it in its next call with the weights
    pushed meanwhile, so a long episode spans learner steps without holding them up. Its sampled tokens then carry
    several policy versions; `rl.max_staleness` bounds the oldest (the group is dropped beyond it). 0: off (every
    call runs its episodes to the end)."""
    compaction_tokens: int = 0
    """Context compaction (k3rl's own agent loop, rollout/agent_loop.py): when an episode's context reaches this many
    tokens at a turn boundary, the model is asked to summarise its progress (`compaction_prompt`, at most
    `summary_tokens` sampled), and the episode continues from [system, task, summary] as a new sequence of the same
    episode; the summary is trained like any sampled tokens. 0: off (an episode ends at `max_context_tokens`)."""
    compaction_prompt: str = ("Your context is full. Summarise your progress so far: what you searched, what you "
                              "found (names, numbers, passage ids) and what is left to do. Write only the summary.")
    """The user message that asks for the summary."""
    summary_tokens: int = 256
    """Longest summary, in sampled tokens."""
    max_compactions: int = 4
    """Compactions per episode; an episode that would need more ends as `truncated:context`."""
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
class EvalConfig:
    """Evaluation: the held-out tasks (`tasks_path`, `num_tasks`, `seed`), the trainer's schedule and sampling
    (`every`, `temperature`) and the long-context evidence-retrieval settings (`families`, `context_lengths`, `serve`)."""

    every: int = 10
    """Evaluate every this many steps (also before the first and after the last); 0: never."""
    tasks_path: Optional[str] = None
    """JSONL file of held-out tasks: the trainer's (tasks of `env:`; null: `env.tasks(num_tasks, seed=seed)`), or
    `k3rl eval`'s tasks of the `file` family (real questions and documents; format in envs/README.md), whose first
    `num_tasks` tasks fill each of its cells."""
    num_tasks: int = 32
    """Held-out tasks drawn from the environment when `tasks_path` is null."""
    seed: int = 1_000_003
    """Seed of the held-out tasks (distinct from run.seed); tasks equal to a training task are removed."""
    temperature: float = 0.0
    """Sampling temperature of evaluation (0: greedy)."""
    families: list[str] = field(default_factory=lambda: ["needle", "multihop"])
    """Long-context task families of `k3rl eval` (envs/longctx/: needle, multihop, aggregate, ith; `file`: the
    real tasks of `tasks_path`)."""
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
    grid_every: int = 0
    """`k3rl train`: run this grid (`families` × `serve` × `context_lengths`, `grid_num_tasks` per cell) on the policy
    every this many steps, also before the first (with `baselines`) and after the last, through `k3rl eval`'s own
    path; scalars `eval_grid/<family>/<serve>/<length>/success`, outputs and a heatmap by step under
    `<run_dir>/eval_grid/` (rl/orchestrator/eval_grid.py). 0: never."""
    grid_num_tasks: Optional[int] = None
    """`k3rl train`: tasks per cell of the grid of `grid_every` (null: `num_tasks`)."""
