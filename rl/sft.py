"""Supervised warm start (`k3rl sft CONFIG [key=value …]`): oracle demonstrations, trained through TRL's
`SFTTrainer`, with the loss on the model's own (assistant) tokens only.

1. Demonstrations. The environment's oracle plays each task through `envs.base.run_episode`;
   episodes below `sft.min_reward` are dropped. Each kept transcript becomes token ids and an
   assistant mask exactly as the rollout agent loop would have built them (rollout/chat.py,
   rollout/agent_loop.py): the opening messages rendered once with the generation prompt
   (mask 0), each assistant turn encoded as the model would sample it (mask 1), each tool result
   rendered as the observation delta (mask 0). A turn that ends with `</tool_call>` is where the
   engine stops, so no EOS follows it; a turn without a call would end with the EOS the model
   samples (mask 1). The terminal tool's result is left out, as the agent loop leaves it out.
   The transcript is never re-templated as a whole, so what SFT trains is what rollouts see.
   Imperfect teachers can stand in for the oracle on a seeded fraction of the tasks
   (`sft.closed_book_rate`: answer at once with a guess; `sft.hedging_rate`: the oracle's episode
   with a hedged answer), so that SFT leaves RL something only the reward can teach.
2. Training. The pre-tokenised dataset (`input_ids`, `assistant_masks`) goes to `SFTTrainer`,
   whose preparation turns the mask into `labels` (-100 where the mask is 0) and whose collator
   right-pads batches. Two things differ from TRL's own loss path:
   * the loss. TRL 1.16 patches a fused LM head onto the model that calls `model.base_model(…)`
     and reads `.last_hidden_state`; K3's backbone takes a `StepInfo` and returns the pre-norm
     state, so `compute_loss` is overridden (as TRL recommends) and scores the label rows the
     way the RL learner does: final hidden states → `rl.logprobs.selected_logprobs` in chunks,
     no [B, T, V] logits. Normalisation: Σ −log p over label tokens ÷ label tokens of the whole
     accumulated batch (`num_items_in_batch`, counted here for every model), so gradient
     accumulation equals one big batch.
   * the padding. K3's attention mask may only mark left padding. For a causal model right
     padding needs no mask: a real token never attends to the pads after it, and pads carry
     label -100. So K3 is called without a mask; its routers keep the pads out of the
     balancing statistics (`rl.routing.RoutingControl`) and their biases are balanced after
     every optimizer step (`model.moe.balance_routers`), as in the RL learner. Other HF models
     get the collator's attention mask.
   On the CPU, one demonstration per micro-batch with gradient accumulation is the default
   shape: no padding, and K3's MLA builds [B, H, T, T] scores.
3. Output, under `run.output_dir/run.name/`: `config.yaml`, `demos.json` (what was kept and
   why the rest was dropped), `init/` (the freshly initialised model when `sft.model_dir` is
   null), `tensorboard/`, `metrics.jsonl`, `loss.png`, and `model/` (HF model + tokenizer,
   written to a temporary directory and renamed). With `sft.eval_tasks > 0`, greedy rollouts on
   held-out tasks after training go to `eval.json`.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rl.config import ConfigError, JobConfig, SFTConfig  # noqa: F401  (SFTConfig: the `sft:` section)


@dataclass
class DemoReport:
    """What playing the oracle produced: the kept demonstrations and why the others were dropped."""

    rows: list[dict[str, Any]]
    tasks: int
    dropped: dict[str, int]

    def summary(self) -> dict[str, Any]:
        n = max(1, len(self.rows))
        return {"tasks": self.tasks, "kept": len(self.rows), "dropped": dict(self.dropped),
                "teachers": dict(Counter(r.get("teacher", "oracle") for r in self.rows)),
                "mean_tokens": sum(len(r["input_ids"]) for r in self.rows) / n,
                "mean_assistant_tokens": sum(sum(r["assistant_masks"]) for r in self.rows) / n,
                "mean_prompt_tokens": sum(r["prompt_tokens"] for r in self.rows) / n,
                "mean_turns": sum(r["turns"] for r in self.rows) / n}

    def line(self) -> str:
        s = self.summary()
        why = ", ".join(f"{v} {_DROP_REASONS[k]}" for k, v in sorted(self.dropped.items()))
        mix = {k: v for k, v in s["teachers"].items() if k != "oracle"}
        closed = f" (by imperfect teachers: {', '.join(f'{v} {k}' for k, v in sorted(mix.items()))})" if mix else ""
        return (f"demonstrations: kept {s['kept']} of {s['tasks']} tasks" + (f" (dropped: {why})" if why else "")
                + closed
                + f"; {s['mean_tokens']:.0f} tokens each on average ({s['mean_prompt_tokens']:.0f} prompt, "
                  f"{s['mean_assistant_tokens']:.0f} the model's own), {s['mean_turns']:.1f} turns")


_DROP_REASONS = {"reward": "below min_reward", "length": "longer than the context limit",
                 "turn_length": "with a turn longer than the per-turn token limit"}


def render_demonstration(renderer, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int], list[int]]:
    """A finished transcript as the agent loop would have tokenised it.

    Returns (input_ids [N], assistant_masks [N] with 1 on the model's own tokens, the token
    count of each assistant turn). Messages after the last assistant turn (the terminal tool's
    result) are not part of a rollout and are left out.
    """
    from envs.tools import STOP_SEQUENCES

    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("a demonstration needs at least one assistant turn")
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = renderer.prompt_tokens([dict(m) for m in messages[:first]])
    mask = [0] * len(ids)
    turns: list[int] = []
    ended_with_eos = False
    for m in messages[first:last + 1]:
        if m["role"] == "assistant":
            text = m["content"]
            stop = next((s for s in STOP_SEQUENCES if s in text), None)
            if stop is not None and not text.endswith(stop):
                raise ValueError(f"an assistant turn continues after {stop!r}; a rollout would have stopped there")
            part = renderer.encode(text)
            # The engine stops at a stop string; any other turn ends with the EOS the model samples.
            ended_with_eos = stop is None
            if ended_with_eos:
                part = part + [renderer.eos_token_id]
            turns.append(len(part))
            ids += part
            mask += [1] * len(part)
        elif m["role"] == "tool":
            part = renderer.observation_tokens(m["content"], ended_with_eos)
            ids += part
            mask += [0] * len(part)
        else:
            raise ValueError(f"unexpected {m['role']!r} message after the first assistant turn")
    return ids, mask, turns


class ClosedBookPolicy:
    """A teacher that answers at once, without looking anything up: its only turn is the terminal
    call `call` (another task's final answer, so a plausible guess of the right kind), as a
    closed-book model answers from memory."""

    preamble = "I will answer from memory.\n"

    def __init__(self, call):
        self.call = call

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        from envs.tools import format_call

        return self.preamble + format_call(self.call.name, self.call.arguments)


class HedgingPolicy:
    """A teacher that plays `oracle` but hedges its final answer: the first text argument of the
    terminal call gets `suffix` ("grey" → "grey, I think"), which exact match does not accept and F1
    scores lower (the longer the hedge, the lower), as a chatty model pads the answer field."""

    suffix = ", I think"

    def __init__(self, oracle, env, suffix: str | None = None):
        self.oracle, self.env = oracle, env
        if suffix is not None:
            self.suffix = suffix

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        from envs.tools import TOOL_CALL_START, format_call

        text = self.oracle(messages)
        call = _terminal_call(self.env, [{"role": "assistant", "content": text}])
        key = next((k for k, v in call.arguments.items() if isinstance(v, str)), None) if call else None
        if key is None:
            return text
        hedged = {**call.arguments, key: call.arguments[key] + self.suffix}
        return text[:text.index(TOOL_CALL_START)] + format_call(call.name, hedged)


def _terminal_call(env, messages: Sequence[dict[str, Any]]):
    """The terminal tool call that ended a transcript, or None."""
    from envs.tools import ToolCall, parse

    last = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
    call = parse(last["content"]) if last is not None else None
    spec = env.tool_specs().get(call.name) if isinstance(call, ToolCall) else None
    return call if spec is not None and spec.terminal else None


def collect_demonstrations(env_name: str, n: int, seed: int, tokenizer, env_kwargs: dict | None = None, *,
                           tasks: Sequence[Any] | None = None, min_reward: float = 1.0,
                           max_length: int | None = None, max_turn_tokens: int | None = None,
                           max_turns: int | None = None, closed_book_rate: float = 0.0, hedging_rate: float = 0.0,
                           hedge: str = HedgingPolicy.suffix, teacher_seed: int = 0) -> DemoReport:
    """Play the oracle of `env_name` on `tasks` (default: `env.tasks(n, seed)`) and render the
    successful episodes (see `render_demonstration`).

    Imperfect teachers, for SFT that leaves RL something to learn: a `closed_book_rate` fraction of
    the tasks (drawn with `teacher_seed`) is played by `ClosedBookPolicy` (guessing the final call of
    another task's oracle episode) and a `hedging_rate` fraction by `HedgingPolicy`; their episodes
    are kept whatever their reward when the oracle solved the task. Each row names its `teacher`.
    """
    import random

    import envs
    from envs.base import Budget, run_episode
    from rollout.chat import ChatRenderer

    if not (0.0 <= closed_book_rate and 0.0 <= hedging_rate and closed_book_rate + hedging_rate < 1.0):
        raise ValueError(f"closed_book_rate + hedging_rate: each ≥ 0 and together < 1, got {closed_book_rate} "
                         f"and {hedging_rate}")
    renderer = ChatRenderer(tokenizer)
    env = envs.make(env_name, **(env_kwargs or {}))
    tasks = env.tasks(n, seed) if tasks is None else list(tasks)
    budget = env.budget if max_turns is None else Budget(**{**vars(env.budget), "max_turns": max_turns})
    count = lambda s: len(renderer.encode(s))  # noqa: E731  (observations clipped as the agent loop clips them)
    results = [run_episode(env, task, env.oracle(task), budget, count) for task in tasks]
    solved = [r.reward >= min_reward for r in results]
    rng = random.Random(teacher_seed)
    teacher = []
    for _ in tasks:
        u = rng.random()
        teacher.append("closed_book" if u < closed_book_rate else
                       "hedging" if u < closed_book_rate + hedging_rate else "oracle")
    calls = [(i, _terminal_call(env, r.messages)) for i, r in enumerate(results) if solved[i]]
    calls = [(i, c) for i, c in calls if c is not None]
    for i, task in enumerate(tasks):
        if teacher[i] == "oracle" or not solved[i]:
            continue
        if teacher[i] == "hedging":
            results[i] = run_episode(env, task, HedgingPolicy(env.oracle(task), env, hedge), budget, count)
        else:
            others = [c for j, c in calls if j != i]
            if not others:
                raise ValueError(f"closed_book_rate: no other oracle episode of {env_name!r} ended with a terminal "
                                 f"call to take a guess from")
            results[i] = run_episode(env, task, ClosedBookPolicy(rng.choice(others)), budget, count)
    rows, dropped = [], Counter()
    for i, (task, result) in enumerate(zip(tasks, results)):
        if not solved[i]:
            dropped["reward"] += 1
            continue
        ids, mask, turns = render_demonstration(renderer, result.messages)
        if max_length is not None and len(ids) > max_length:
            dropped["length"] += 1
            continue
        if max_turn_tokens is not None and max(turns) > max_turn_tokens:
            dropped["turn_length"] += 1
            continue
        task_id = str(task.get("id", i)) if isinstance(task, dict) else str(i)
        rows.append({"input_ids": ids, "assistant_masks": mask, "task_id": task_id, "reward": float(result.reward),
                     "turns": len(turns), "prompt_tokens": mask.index(1), "teacher": teacher[i]})
    return DemoReport(rows, len(tasks), dict(dropped))


def demonstrations(env_name: str, n: int, seed: int, tokenizer, env_kwargs: dict | None = None, **kwargs):
    """Successful oracle demonstrations as a `datasets.Dataset` with `input_ids` and
    `assistant_masks` (what `SFTTrainer` turns into labels) plus `task_id`, `reward`, `turns`,
    `prompt_tokens`; prints how many were kept. Keyword arguments as `collect_demonstrations`."""
    from datasets import Dataset

    report = collect_demonstrations(env_name, n, seed, tokenizer, env_kwargs, **kwargs)
    print(report.line(), flush=True)
    return Dataset.from_list(report.rows)


@functools.cache
def _sft_trainer_class():
    """`SFTTrainer` with k3rl's loss (see module docstring); built on first use so importing this
    module stays free of torch and TRL."""
    import torch
    from trl import SFTTrainer

    from rl.logprobs import selected_logprobs
    from rl.routing import RoutingControl

    class K3SFTTrainer(SFTTrainer):
        # compute_loss divides by the tokens of the whole accumulated batch itself.
        loss_is_scaled_for_ga = True

        def __init__(self, *args, logprob_chunk_size: int = 1024, **kwargs):
            super().__init__(*args, **kwargs)
            model = self.model
            head = model.get_output_embeddings()
            text_config = model.config.get_text_config()
            if getattr(head, "bias", None) is not None or getattr(text_config, "final_logit_softcapping", None):
                raise ValueError(f"{type(model).__name__}: an LM-head bias or logit soft-capping is not supported")
            self.logit_scale = float(getattr(text_config, "logit_scale", None) or 1.0)
            self.native_hidden = "return_hidden_states" in inspect.signature(type(model).forward).parameters
            self.routing = RoutingControl(model)
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

        def final_hidden(self, model, input_ids, attention_mask):
            """[B, T, d] hidden states after the final norm (what the LM head reads)."""
            if self.native_hidden:
                # Right padding with no mask: exact for a causal model (see module docstring).
                out = model(input_ids, return_hidden_states=True, logits_to_keep=1)
                return model.model.norm(out.hidden_states)
            out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                        use_cache=False, logits_to_keep=1)
            return out.hidden_states[-1]

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if return_outputs:
                raise ValueError("K3SFTTrainer computes no logits; return_outputs is not supported")
            mode = "train" if model.training else "eval"
            input_ids, labels = inputs["input_ids"], inputs["labels"]  # [B, T] ×2
            attention_mask = inputs.get("attention_mask")  # [B, T], 0 on right padding
            targets = labels[:, 1:]  # [B, T-1]
            mask = targets != -100  # [B, T-1]
            valid = attention_mask.bool() if attention_mask is not None else None
            with self.routing.batch(valid) if self.routing else nullcontext():
                hidden = self.final_hidden(model, input_ids, attention_mask)  # [B, T, d]
                weight = model.get_output_embeddings().weight  # [V, d]
                logp, entropy = selected_logprobs(hidden[:, :-1][mask], weight, targets[mask], self.chunk_size,
                                                  self.logit_scale, return_entropy=True)  # [N] ×2
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
            from rl.routing import find_routers

            for router in find_routers(model):
                router.clear_stats()

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            from model.moe import balance_routers

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


def load_model(model_dir: str | Path, device: str = "cpu"):
    """(model, tokenizer) of an HF directory; K3 directories load through the Auto classes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import model.modeling  # noqa: F401  (registers K3 with the Auto classes)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    return lm, tokenizer


def save_model(model, tokenizer, target: str | Path) -> Path:
    """Write an HF directory (model + tokenizer) to a temporary sibling, then rename it to `target`."""
    from rl.checkpoint import atomic_dir

    with atomic_dir(target, kind="sft-model") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(target)


def init_model(model_section: Any, target: str | Path, seed: int = 0) -> Path:
    """A random model from a `model:` section, with its tokenizer, written to `target` (`model.init`)."""
    from model.config import K3Config
    from model.init import init_model as write_random_model

    try:
        config = K3Config.from_model_config(model_section)
        write_random_model(config, target, seed=seed)
    except ValueError as e:
        raise ConfigError(f"model: cannot build the model into {target}: {e}") from None
    return Path(target)


def evaluate_greedy(model, tokenizer, env_name: str, tasks: Sequence[Any], env_kwargs: dict | None = None, *,
                    max_new_tokens: int = 128, max_turns: int | None = None, max_context_tokens: int = 4096,
                    success_key: str = "em", device: str = "cpu") -> dict[str, Any]:
    """Greedy rollouts (TorchEngine + AgentLoop) on `tasks`: success rate (`rewards[success_key] ≥ 1`,
    else reward ≥ 1, as `k3rl train` counts it) with its 95% Wilson interval, mean reward, and how
    many sampled turns are well-formed tool calls (parse to a tool the environment has)."""
    import envs
    from envs.base import Budget
    from envs.tools import ToolCall, parse
    from rl.metrics import wilson_interval
    from rollout.agent_loop import AgentLoop, EpisodeRequest
    from rollout.engine import SamplingParams
    from rollout.torch_engine import TorchEngine

    was_training = model.training
    env0 = envs.make(env_name, **(env_kwargs or {}))
    budget = env0.budget if max_turns is None else Budget(**{**vars(env0.budget), "max_turns": max_turns})
    names = set(env0.tool_specs())
    engine = TorchEngine(model, tokenizer, device=device)
    loop = AgentLoop(engine, tokenizer, lambda: envs.make(env_name, **(env_kwargs or {})),
                     SamplingParams(temperature=0.0, max_tokens=max_new_tokens), budget=budget,
                     max_context_tokens=max_context_tokens, env_name=env_name)
    started = time.perf_counter()
    trajectories = loop.run([EpisodeRequest(t, str(i), str(i)) for i, t in enumerate(tasks)])
    seconds = time.perf_counter() - started
    model.train(was_training)
    turns_ok, turns, first_ok = 0, 0, 0
    for t in trajectories:
        for k, (a, b) in enumerate(t.turn_spans.tolist()):
            ids = t.tokens[a:b].tolist()
            if ids and ids[-1] == tokenizer.eos_token_id:
                ids = ids[:-1]
            call = parse(tokenizer.decode(ids, skip_special_tokens=False))
            ok = isinstance(call, ToolCall) and call.name in names
            turns_ok += ok
            turns += 1
            first_ok += ok and k == 0
    n = max(1, len(trajectories))
    wins = sum((t.rewards[success_key] if success_key in t.rewards else t.reward) >= 1.0 for t in trajectories)
    return {"tasks": len(trajectories), "success": wins / n,
            "success_ci95": list(wilson_interval(wins, len(trajectories))),
            "mean_reward": sum(t.reward for t in trajectories) / n,
            "first_turn_well_formed": first_ok / n, "turns_well_formed": turns_ok / max(1, turns),
            "mean_turns": turns / n, "seconds": seconds}


def _resolved(cfg) -> tuple[str, dict[str, Any], int]:
    """(environment name, its constructor arguments, task seed) after the `rl:` / `run:` fallbacks."""
    from omegaconf import OmegaConf

    sft = cfg.sft
    env_args = sft.env_args if sft.env_args is not None else cfg.rl.env_args
    return (sft.env if sft.env is not None else cfg.rl.env, OmegaConf.to_container(env_args, resolve=True) or {},
            sft.task_seed if sft.task_seed is not None else cfg.run.seed)


def _check(cfg) -> None:
    """Named errors for a config that cannot run, before any work starts."""
    from envs.registry import UnknownEnvironment, resolve

    sft = cfg.sft
    env_name, _, _ = _resolved(cfg)
    try:
        resolve(env_name)
    except UnknownEnvironment as e:
        raise ConfigError(f"{'sft.env' if sft.env is not None else 'rl.env'}: {e}") from None
    if sft.model_dir is not None:
        path = Path(sft.model_dir)
        if not path.is_dir():
            raise ConfigError(f"sft.model_dir: {path} does not exist")
        if not (path / "config.json").is_file():
            raise ConfigError(f"sft.model_dir: {path} is not a Hugging Face model directory (no config.json)")
    for key in ("num_tasks", "batch_size", "grad_accum", "logging_steps", "logprob_chunk_size"):
        if getattr(sft, key) <= 0:
            raise ConfigError(f"sft.{key}: must be > 0, got {getattr(sft, key)}")
    for key in ("closed_book_rate", "hedging_rate"):
        if not 0.0 <= getattr(sft, key) < 1.0:
            raise ConfigError(f"sft.{key}: must be in [0, 1), got {getattr(sft, key)}")
    if sft.closed_book_rate + sft.hedging_rate >= 1.0:
        raise ConfigError(f"sft.closed_book_rate + sft.hedging_rate: must be < 1 (some tasks are the oracle's), got "
                          f"{sft.closed_book_rate} + {sft.hedging_rate}")
    if sft.hedging_rate > 0 and not sft.hedge.strip():
        raise ConfigError("sft.hedge: empty, so the hedging teacher would answer as the oracle does; give it a "
                          "hedge such as ', I think' or set sft.hedging_rate=0")
    if sft.eval_tasks < 0:
        raise ConfigError(f"sft.eval_tasks: must be ≥ 0, got {sft.eval_tasks}")
    if cfg.run.device not in ("cpu", "cuda"):
        raise ConfigError(f"run.device: `cpu` or `cuda`, got {cfg.run.device!r}")


def run_sft(cfg) -> Path:
    """Run one SFT job (a loaded `JobConfig`, whose `sft:` section drives it); returns the directory
    of the trained HF model."""
    import envs
    from rl.config import to_yaml
    from rl.tasks import make_tasks, remove_training_tasks

    _check(cfg)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sft, run, rl = cfg.sft, cfg.run, cfg.rl
    env_name, env_kwargs, task_seed = _resolved(cfg)
    run_dir = Path(run.output_dir) / run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))

    model_dir = Path(sft.model_dir) if sft.model_dir is not None else init_model(cfg.model, run_dir / "init", run.seed)
    model, tokenizer = load_model(model_dir, run.device)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"sft.model_dir: the tokenizer in {model_dir} has no chat template")

    env = envs.make(env_name, **env_kwargs)
    train_tasks = make_tasks(env, sft.num_tasks, task_seed, "sft.num_tasks / rl.env_args")
    started = time.perf_counter()
    try:
        report = collect_demonstrations(env_name, sft.num_tasks, task_seed, tokenizer, env_kwargs, tasks=train_tasks,
                                        min_reward=sft.min_reward, max_length=rl.max_context_tokens,
                                        max_turn_tokens=rl.max_new_tokens, max_turns=rl.max_turns,
                                        closed_book_rate=sft.closed_book_rate, hedging_rate=sft.hedging_rate,
                                        hedge=sft.hedge, teacher_seed=task_seed)
    except NotImplementedError as e:
        raise ConfigError(f"environment {env_name!r}: {e}") from None
    print(report.line() + f" [{time.perf_counter() - started:.1f} s]", flush=True)
    (run_dir / "demos.json").write_text(json.dumps(report.summary(), indent=1))
    if not report.rows:
        raise ConfigError(f"sft: no demonstration kept out of {report.tasks} tasks ({report.dropped}); check "
                          f"sft.min_reward, rl.max_context_tokens and rl.max_new_tokens")

    from datasets import Dataset
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    metrics_path = run_dir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    _, jsonl_logger = _callbacks()
    trainer = make_trainer(model, tokenizer, Dataset.from_list(report.rows), sft, run_dir / "trainer", run.seed,
                           run.device, callbacks=[TensorBoardCallback(SummaryWriter(str(run_dir / "tensorboard"))),
                                                  jsonl_logger(metrics_path)])
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    out = save_model(trainer.model, tokenizer, run_dir / "model")
    history = [h for h in trainer.state.log_history if "loss" in h]
    print(loss_summary(history, seconds, trainer.state.global_step, trainer._total_train_tokens), flush=True)
    plot_loss(history, run_dir / "loss.png")
    if sft.eval_tasks > 0:
        held_out, dropped = remove_training_tasks(
            make_tasks(env, sft.eval_tasks, rl.eval_seed, "sft.eval_tasks / rl.env_args"), train_tasks)
        if dropped:
            print(dropped, flush=True)
        result = evaluate_greedy(trainer.model, tokenizer, env_name, held_out, env_kwargs,
                                 max_new_tokens=rl.max_new_tokens, max_turns=rl.max_turns,
                                 max_context_tokens=rl.max_context_tokens, success_key=rl.success_key,
                                 device=run.device)
        (run_dir / "eval.json").write_text(json.dumps(result, indent=1))
        lo, hi = result["success_ci95"]
        print(f"held-out greedy rollouts: success {result['success']:.2f} [{lo:.2f}, {hi:.2f}] on {result['tasks']} "
              f"tasks, first turn well-formed {result['first_turn_well_formed']:.2f}, turns well-formed "
              f"{result['turns_well_formed']:.2f}, mean reward {result['mean_reward']:.3f}", flush=True)
    print(f"wrote {out}", flush=True)
    return out


def loss_summary(history: list[dict], seconds: float, steps: int, tokens: int) -> str:
    """One line: the training loss at the start and end, its minimum, time and throughput."""
    if not history:
        return f"sft: {steps} steps in {seconds:.1f} s (no loss logged)"
    losses = [h["loss"] for h in history]
    k = max(1, len(losses) // 10)
    return (f"sft: {steps} steps in {seconds:.1f} s ({seconds / max(1, steps):.2f} s/step, "
            f"{tokens / max(seconds, 1e-9):.0f} tokens/s); loss {losses[0]:.3f} → {losses[-1]:.3f} "
            f"(min {min(losses):.3f}; mean of first/last {k} logs {sum(losses[:k]) / k:.3f} → "
            f"{sum(losses[-k:]) / k:.3f})")


def plot_loss(history: list[dict], path: str | Path) -> None:
    """PNG of the logged training loss against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], marker="o", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("SFT loss (nats / assistant token)")
    if history and min(h["loss"] for h in history) > 0 and max(h["loss"] for h in history) / min(
            h["loss"] for h in history) > 20:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """`k3rl sft CONFIG [key=value …]`."""
    from rl.cli import config_parser
    from rl.config import load_config

    args = config_parser("k3rl sft", "supervised warm start on oracle demonstrations (TRL SFTTrainer)").parse_args(argv)
    run_sft(load_config(args.config, args.overrides, JobConfig))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
