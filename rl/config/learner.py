"""The `learner:` section (how the policy is optimised, and on how many Ray ranks) and the override sections of the
commands that train with other settings: `sft.learner`, `pretrain.learner`, `pretrain.stages[i].learner`. An
override section's fields replace the `learner:` fields of the same name for that command (a null one, such as a
stage's `segment_tokens`, leaves the `learner:` value); `learner_overrides` collects them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Optional

from k3rl.rl.config.sections import DType, LRSchedule, Optimizer, Recompute


@dataclass
class LoraSettings:
    """`learner.lora`: low-rank adapters through PEFT instead of full-parameter training (rl/train/lora.py)."""

    rank: int = 0
    """Adapter rank r (0: off, every parameter trains)."""
    alpha: float = 16.0
    """Scale numerator: an adapter adds (alpha / rank)·B·A to its weight."""
    dropout: float = 0.0
    """Dropout on an adapted linear layer's input, on the adapter's path only."""
    push: str = "adapters"
    """What the rollout engines receive after a step: `adapters`, each adapted tensor's low-rank factors (the native
    engine adds them to its own copy of the base, rollout/weight_transfer.py; vLLM serves them as a LoRA adapter
    for HF models, rollout/vllm_engine.py), or `merged`, every tensor with the adapters merged (what vLLM's K3
    module takes)."""
    targets: Optional[list[str]] = None
    """Leaf names of the linear layers to adapt (`q_proj`, `gate_proj`, …) and, on K3, `w1`/`w2`/`w3` for the
    stacked routed experts; null: rl/train/lora.py's defaults (K3: attention, MLPs and experts, not the routers;
    other models: every linear layer but the head)."""


@dataclass
class LearnerSettings:
    """How the policy is optimised, for every objective the learner trains (rl/train/learner.py `LearnerConfig`
    adds what the driver decides: model, algorithm, seed, device)."""

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
    recompute: Recompute = Recompute["none"]
    """Activations recomputed in backward instead of kept: `none`; `full`, each whole layer (only its input kept,
    about a third more compute); `selective` (K3), only the KDA mixers and MoE blocks, the bulk of the saved
    tensors, while norms, AttnRes, MLA and dense FFNs keep theirs. In segment-recurrent training (`segment_tokens`)
    `full` recomputes what `selective` does. bench/recompute.py measures the memory; `k3rl pretrain --plan` plans
    with it."""
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
    """Sequences that start alike (a group's prompt, first turns its samples agree on, the restarts of a compacted
    episode, a system prompt shared across tasks) train as prefix trees: every shared span forward and backward once,
    branched from its state (K3: the hybrid cache, a span's tokens counted once in the router statistics; other
    models: their KV cache; rl/train/prefix_tree.py). Same loss and gradients as the sequences apart."""
    expert_parallel: int = 1
    """K3: split the routed experts of every MoE layer across this many learner ranks (all-to-all token dispatch,
    rl/train/expert_parallel.py); the ranks form data-parallel replicas of `expert_parallel` ranks each, so the number of
    learner ranks (`learner.num_ranks`) must be a multiple of it. 1: every rank holds every expert."""
    fsdp: bool = False
    """K3: shard parameters, gradients and optimizer states across the learner ranks with FSDP2 (the routed experts
    across the data-parallel replicas, as they are already split by `expert_parallel`; rl/train/parallel.py). With
    `expert_parallel > 1` or `fsdp` (and more than one rank) the learner runs only AdamW, no reference model
    (`algo.args.kl_coef: 0`), whole sequences (`segment_tokens: null`) and no prefix sharing (`share_prefix: false`),
    since every rank must run the same forward and backward passes."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """Train low-rank adapters instead of every parameter (`lora.rank > 0`, rl/train/lora.py): the rollout engines
    get the merged weights, checkpoints hold the merged model and the adapters (PEFT's format) beside it."""


@dataclass
class LearnerSection(LearnerSettings):
    """The `learner:` section: the settings above plus the Ray resources of the learner's ranks."""

    num_ranks: int = 1
    """Data-parallel learner ranks (Ray actors; `k3rl pretrain`: > 1 puts them on Ray, 1 trains in the driver)."""
    num_cpus: float = 1.0
    """Ray CPUs per learner rank."""
    num_gpus: float = 0.0
    """Ray GPUs per learner rank (run.device=cuda)."""


@dataclass
class SFTLearner:
    """`sft.learner`: SFT's own optimisation, replacing these fields of the `learner:` section (whose values are RL's);
    the other `learner:` fields (optimizer, dtype, micro_batch_tokens, …) apply to SFT as they are."""

    lr: float = 1e-3
    """Peak learning rate of SFT (the `learner:` section's is RL's)."""
    lr_scheduler: LRSchedule = LRSchedule["constant_with_warmup"]
    """`constant`, `constant_with_warmup`, `linear` or `cosine` (decaying to 0 at the last step)."""
    warmup_steps: int = 10
    """Linear warmup of the learning rate from 0 over this many steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay on matrices (as `learner.weight_decay`)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    recompute: Recompute = Recompute["none"]
    """Activations recomputed in backward (as `learner.recompute`: none, full, selective)."""
    logprob_chunk_size: int = 1024
    """Loss-token rows per LM-head chunk (`model.logprobs.selected_logprobs`)."""
    lora: Optional[LoraSettings] = None
    """SFT's own adapters (as `learner.lora`); null: the `learner:` section's. `sft.learner.lora.rank=0` trains the
    warm start in full while RL trains adapters."""


@dataclass
class PretrainLearner:
    """`pretrain.learner`: what every pretraining stage trains with instead of these fields of the `learner:`
    section; a stage's own `stages[i].learner` comes on top."""

    weight_decay: float = 0.1
    max_grad_norm: float = 1.0


@dataclass
class StageLearner:
    """`pretrain.stages[i].learner`: one stage's own rate and schedule (over the stage's steps), on top of
    `pretrain.learner` and `learner:`."""

    lr: float = 3e-4
    """Peak learning rate."""
    lr_scheduler: LRSchedule = LRSchedule["wsd"]
    """`wsd` (warmup, stable, decay over the stage's last `decay_fraction`), `cosine` (warmup, then cosine to
    `min_lr_ratio`), `linear`, `constant` (after the warmup, if any) or `constant_with_warmup`."""
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    """The learning rate at the end of the decay, as a fraction of `lr`."""
    segment_tokens: Optional[int] = None
    """Segment-recurrent training above this many tokens per document (null: `learner.segment_tokens`)."""


def learner_overrides(*sections: Any) -> dict[str, Any]:
    """The fields of override sections that are not null, later sections winning; choices as plain strings (what
    Ray ships), ready for `LearnerConfig.from_job(job, path, **overrides)`."""
    values: dict[str, Any] = {}
    for section in sections:
        names = list(section.keys()) if hasattr(section, "keys") else [f.name for f in fields(section)]
        for name in names:
            value = getattr(section, name)
            if value is not None:
                values[name] = str(value) if isinstance(value, Enum) else value
    return values
