"""The schema of each command, composed of the shared sections, and the `sft:` section.

A command reads only its schema's sections (`TrainJob`, `SFTJob`, `PretrainJob`, `EvalJob`, `QuickstartJob`). A recipe
may serve several commands (configs/rl/quickstart.yaml: `k3rl quickstart`, `k3rl train`, `k3rl sft`), so it is checked
against `JobConfig`, the union of their sections (what `k3rl config` prints), and each command then keeps its own
sections (rl/config/loader.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from k3rl.model.config import ModelConfig
from k3rl.rl.config.learner import LearnerSection, SFTLearner
from k3rl.rl.config.pretrain import PretrainConfig
from k3rl.rl.config.sections import AlgoSection, EnvSection, EvalConfig, RayConfig, RLConfig, RolloutConfig, RunConfig


@dataclass
class SFTConfig:
    """Supervised warm start on oracle demonstrations (`k3rl sft`). What a rollout allows comes from
    the `rollout:` section (`max_turns`, `max_new_tokens` per turn, `max_context_tokens`), so every
    demonstration is one the rollouts that follow could have produced; longer ones are dropped. The learner is
    the `learner:` section with `sft.learner` on top."""

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
    learner: SFTLearner = field(default_factory=SFTLearner)
    """SFT's rate, schedule, weight decay, clipping, checkpointing and LM-head chunk, in place of the `learner:`
    section's (RL's); the other `learner:` settings (optimizer, dtype, micro_batch_tokens, …) apply to SFT as well."""
    logging_steps: int = 10
    """Steps per line of progress and per row of `metrics.jsonl` (means over the steps since the last row)."""
    eval_tasks: int = 0
    """Held-out tasks (`env.tasks(eval_tasks, seed=eval.seed)` minus training tasks) rolled out
    greedily after training: success (rl/eval/evaluate.py, the environment's rule or `env.success_key`), well-formed
    tool calls; 0 skips."""


@dataclass
class TrainJob:
    """`k3rl train`: RL post-training on Ray."""

    run: RunConfig = field(default_factory=RunConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    algo: AlgoSection = field(default_factory=AlgoSection)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvSection = field(default_factory=EnvSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class SFTJob:
    """`k3rl sft`: the supervised warm start (`algo:` is replaced by the `nll` objective)."""

    run: RunConfig = field(default_factory=RunConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoSection = field(default_factory=AlgoSection)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvSection = field(default_factory=EnvSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


@dataclass
class PretrainJob:
    """`k3rl pretrain`: the staged context climb, and after each stage `k3rl eval`'s grid (`eval:`, `rollout:`,
    `env:`) on its model (`algo:` is replaced by the `nll` objective)."""

    run: RunConfig = field(default_factory=RunConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoSection = field(default_factory=AlgoSection)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvSection = field(default_factory=EnvSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class EvalJob:
    """`k3rl eval`: long-context evidence retrieval of `eval.model_path` or `eval.endpoint`."""

    run: RunConfig = field(default_factory=RunConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvSection = field(default_factory=EnvSection)
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class QuickstartJob(TrainJob):
    """`k3rl quickstart`: SFT (`sft:`), then RL (`k3rl train`'s sections) on the SFT model."""

    sft: SFTConfig = field(default_factory=SFTConfig)


@dataclass
class JobConfig:
    """A recipe: every section of the commands' schemas (a recipe may serve several commands); `k3rl config`
    prints it resolved, and a command keeps its own schema's sections."""

    run: RunConfig = field(default_factory=RunConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    algo: AlgoSection = field(default_factory=AlgoSection)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvSection = field(default_factory=EnvSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
