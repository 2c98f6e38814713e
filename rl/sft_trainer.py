"""TRL's `SFTTrainer` with k3rl's loss: what `k3rl sft` (rl/sft.py) trains demonstrations with.

The pre-tokenised dataset (`input_ids`, `assistant_masks`) goes to `SFTTrainer`,
whose preparation turns the mask into `labels` (-100 where the mask is 0) and whose collator
right-pads batches. Two things differ from TRL's own loss path:
* the loss. TRL 1.16 patches a fused LM head onto the model that calls `model.base_model(…)`
  and reads `.last_hidden_state`; K3's backbone takes a `StepInfo` and returns the pre-norm
  state, so `compute_loss` is overridden (as TRL recommends) and scores the label rows the
  way the RL learner does: final hidden states → `model.logprobs.selected_logprobs` in chunks,
  no [B, T, V] logits. Normalisation: Σ −log p over label tokens ÷ label tokens of the whole
  accumulated batch (`num_items_in_batch`, counted here for every model), so gradient
  accumulation equals one big batch.
* the padding. K3's attention mask may only mark left padding. For a causal model right
  padding needs no mask: a real token never attends to the pads after it, and pads carry
  label -100. So K3 gets the mask as its routing mask only: its routers keep the pads out of the
  balancing statistics (model/moe.py `Router.forward`) and their biases are balanced after
  every optimizer step (`rl.router_balance.balance_routers`), as in the RL learner. Other HF models
  get the collator's attention mask.
On the CPU, one demonstration per micro-batch with gradient accumulation is the default
shape: no padding, and K3's MLA builds [B, H, T, T] scores.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any, Sequence

from rl.config import SFTConfig


@functools.cache
def _sft_trainer_class():
    """`SFTTrainer` with k3rl's loss (see module docstring); built on first use so importing this
    module stays free of torch and TRL."""
    import torch
    from trl import SFTTrainer

    from model.policy import Policy
    from rl import router_balance

    class K3SFTTrainer(SFTTrainer):
        # compute_loss divides by the tokens of the whole accumulated batch itself.
        loss_is_scaled_for_ga = True

        def __init__(self, *args, logprob_chunk_size: int = 1024, **kwargs):
            super().__init__(*args, **kwargs)
            model = self.model
            self.policy = Policy(model)
            self.policy.check_head()
            self.routing = bool(router_balance.routers(model))
            self.chunk_size = logprob_chunk_size
            if self.routing:
                router_balancing, _ = _callbacks()
                self.add_callback(router_balancing(self._metrics["train"]))

        def _get_num_items_in_batch(self, batch_samples, device):
            # Label tokens (shifted: position 0 is never a target) of all micro-batches of the step.
            n = sum((b["labels"][:, 1:] != -100).sum() for b in batch_samples)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                n = self.accelerator.gather(n.to(device)).sum()
            return n


        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if return_outputs:
                raise ValueError("K3SFTTrainer computes no logits; return_outputs is not supported")
            mode = "train" if model.training else "eval"
            input_ids, labels = inputs["input_ids"], inputs["labels"]  # [B, T] ×2
            attention_mask = inputs.get("attention_mask")  # [B, T], 0 on right padding
            targets = labels[:, 1:]  # [B, T-1]
            mask = targets != -100  # [B, T-1]
            policy = self.policy if model is self.model else Policy(model)
            # K3 takes the mask as its routing mask only (right padding is exact for a causal model)
            hidden = policy.final_hidden(input_ids, attention_mask=attention_mask)  # [B, T, d]
            logp, entropy = policy.selected_logprobs(hidden[:, :-1][mask], targets[mask], self.chunk_size,
                                                     entropy=True)  # [N] ×2
            n = mask.sum() if num_items_in_batch is None else num_items_in_batch
            loss = -logp.sum() / torch.as_tensor(n, device=logp.device).clamp(min=1)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                # DDP averages gradients over ranks; the count above is global.
                loss = loss * self.accelerator.num_processes
            self._metrics[mode]["entropy"].append(float(entropy.detach().sum()) / max(1, int(mask.sum())))
            if mode == "train":
                tokens = attention_mask.sum() if attention_mask is not None else torch.tensor(input_ids.numel())
                self._total_train_tokens += int(self.accelerator.gather_for_metrics(tokens.to(logp.device)).sum())
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            return loss

    return K3SFTTrainer


@functools.cache
def _callbacks():
    """(RouterBalancing, JsonlLogger) callback classes, defined on first use (transformers is heavy)."""
    from transformers import TrainerCallback

    class RouterBalancing(TrainerCallback):
        """After each optimizer step, update the MoE router biases from the step's statistics."""

        def __init__(self, metrics):
            self.metrics = metrics

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            from rl.router_balance import clear_stats

            clear_stats(model)

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            from rl.router_balance import balance_routers

            maxvio = balance_routers(model)
            if maxvio:
                self.metrics["maxvio_max"].append(max(maxvio.values()))

    class JsonlLogger(TrainerCallback):
        """Every log of the trainer as one JSON line, with the wall and process CPU seconds since
        training began (CPU seconds say more than wall time on a shared machine)."""

        def __init__(self, path: Path):
            self.path = path
            self.started = (time.perf_counter(), time.process_time())

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = (time.perf_counter(), time.process_time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            record = {"step": state.global_step, "time_s": round(time.perf_counter() - self.started[0], 3),
                      "cpu_s": round(time.process_time() - self.started[1], 3), **(logs or {})}
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    return RouterBalancing, JsonlLogger


def make_trainer(model, tokenizer, train_dataset, sft: SFTConfig, out_dir: str | Path, seed: int = 0,
                 device: str = "cpu", callbacks: Sequence[Any] = (), **overrides):
    """The `SFTTrainer` of a job: `sft` settings, CPU-safe precision, no checkpoints of its own.
    `overrides` go to TRL's `SFTConfig` (tests use e.g. `optim="sgd"`)."""
    import trl

    args = trl.SFTConfig(
        output_dir=str(out_dir), max_steps=sft.max_steps if sft.max_steps > 0 else -1,
        num_train_epochs=sft.epochs, per_device_train_batch_size=sft.batch_size,
        gradient_accumulation_steps=sft.grad_accum, learning_rate=sft.lr, lr_scheduler_type=sft.lr_scheduler,
        warmup_steps=sft.warmup_steps, weight_decay=sft.weight_decay, max_grad_norm=sft.max_grad_norm,
        logging_steps=sft.logging_steps, logging_first_step=True, save_strategy="no", report_to="none",
        seed=seed, data_seed=seed, use_cpu=device == "cpu", bf16=False, fp16=False,
        gradient_checkpointing=sft.gradient_checkpointing, max_length=None, packing=False, padding_free=False,
        dataloader_num_workers=0, **overrides)
    if getattr(model, "generation_config", None) is None:
        # SFTTrainer writes the pad token into `model.generation_config`, which only models that can
        # `generate()` have (K3 samples through rollout/torch_engine.py instead).
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id,
                                                   eos_token_id=tokenizer.eos_token_id)
    trainer_cls = _sft_trainer_class()
    return trainer_cls(model=model, args=args, train_dataset=train_dataset, processing_class=tokenizer,
                       callbacks=list(callbacks), logprob_chunk_size=sft.logprob_chunk_size)
