"""Supervised warm start: the library loop behind `k3rl sft` (rl/commands/sft.py) and the quickstart's SFT phase.

`run_sft` composes
- rl/orchestrator/demonstrations.py: the environment's oracle (and imperfect teachers, envs/teachers.py) played on
  `sft.num_tasks` tasks, rendered exactly as rollouts render them (rollout/chat.py `render_transcript`);
- rl/train/supervised.py: the demonstrations trained by the RL learner itself (rl/train/learner.py) with the `nll`
  objective (rl/algos/nll.py) on the assistant's tokens — the same micro-batching, chunked log-probs,
  NaN guard, optimizers (`learner.optimizer`, `learner.dtype` apply), schedule and router balancing;
- model/init.py: the random model when `sft.model_dir` is null; rl/eval/evaluate.py: the held-out check.

Why not TRL's `SFTTrainer` (used here until issue 12): its loss path needs overriding for K3 (whose
backbone returns pre-norm states and whose routers need the padding mask and a bias update after each
step), which made it a second log-prob path and a second training loop beside the learner's.

Output, under `run.output_dir/run.name/`: `config.yaml`, `demos.json` (what was kept and
why the rest was dropped), `init/` (the freshly initialised model when `sft.model_dir` is
null), `tb/` (TensorBoard), `metrics.jsonl` (one row per `sft.logging_steps`), `loss.png`, and `model/`
(HF model + tokenizer, written to a temporary directory and renamed). With `sft.eval_tasks > 0`, greedy
rollouts on held-out tasks after training, scored by rl/eval/evaluate.py, go to `eval.json`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from k3rl.rl.config import ConfigError, SFTJob, check_model_code, validate
from k3rl.rl.log_sinks import open_sinks
from k3rl.rl.metrics import MetricsLogger
from k3rl.rl.orchestrator.demonstrations import collect_demonstrations
from k3rl.rl.train.group import as_trajectory, num_steps, step_batches, train_supervised

SFT_HEADLINE = (("loss", "loss"), ("lr", "lr"), ("grad_norm", "grad norm"), ("train_tokens_per_s", "tok/s"),
                ("step_time_s", "s/step"))


def save_model(model, tokenizer, target: str | Path) -> Path:
    """Write an HF directory (model + tokenizer; K3 in the released layout its config chooses,
    model/formats/layouts.py) to a temporary sibling, then rename it to `target`."""
    from k3rl.model.formats.save import save_model as save_k3
    from k3rl.model.modeling import K3ForCausalLM
    from k3rl.rl.checkpoint import atomic_dir

    with atomic_dir(target, kind="sft-model") as tmp:
        if isinstance(model, K3ForCausalLM):
            save_k3(model, tmp, tokenizer_from=tokenizer)
        else:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return Path(target)


def make_learner(cfg: Any, model_dir: str | Path, num_examples: int):
    """(the `nll` learner of an SFT job, its step count): the `learner:` section's settings with `sft.learner` on
    top (rate, schedule, …) and a micro-batch of `sft.batch_size`."""
    import torch

    from k3rl.rl.config import learner_overrides
    from k3rl.rl.train.group import Learner, LearnerConfig

    sft = cfg.sft
    steps = num_steps(num_examples, sft.batch_size * sft.grad_accum, sft.max_steps, sft.epochs)
    try:
        learner_cfg = LearnerConfig.from_job(
            cfg, model_dir, algo="nll", algo_args={}, **learner_overrides(sft.learner), total_steps=steps,
            micro_batch_seqs=sft.batch_size)
    except ValueError as e:
        raise ConfigError(f"sft: {e}") from None
    torch.manual_seed(cfg.run.seed)
    return Learner(learner_cfg), steps


def init_model(model_section: Any, target: str | Path, seed: int = 0) -> Path:
    """A random model from a `model:` section, with its tokenizer, written to `target` (`model.init`)."""
    from k3rl.envs.registry import tokenizer_texts
    from k3rl.model.config import K3Config
    from k3rl.model.init import init_model as write_random_model

    try:
        config = K3Config.from_model_config(model_section)
        write_random_model(config, target, seed=seed, tokenizer_texts=tokenizer_texts())
    except ValueError as e:
        raise ConfigError(f"model: cannot build the model into {target}: {e}") from None
    return Path(target)


def _resolved(cfg) -> tuple[str, dict[str, Any], int]:
    """(environment name, its constructor arguments, task seed) after the `rl:` / `run:` fallbacks."""
    from omegaconf import OmegaConf

    sft = cfg.sft
    env_args = sft.env_args if sft.env_args is not None else cfg.env.args
    return (sft.env if sft.env is not None else cfg.env.name, OmegaConf.to_container(env_args, resolve=True) or {},
            sft.task_seed if sft.task_seed is not None else cfg.run.seed)


def _check(cfg) -> None:
    """Named errors for a config that cannot run, before any work starts."""
    from k3rl.envs.registry import UnknownEnvironment, resolve

    sft = cfg.sft
    env_name, _, _ = _resolved(cfg)
    try:
        resolve(env_name)
    except UnknownEnvironment as e:
        raise ConfigError(f"{'sft.env' if sft.env is not None else 'cfg.env.name'}: {e}") from None
    if sft.model_dir is not None:
        path = Path(sft.model_dir)
        if not path.is_dir():
            raise ConfigError(f"sft.model_dir: {path} does not exist")
        if not (path / "config.json").is_file():
            raise ConfigError(f"sft.model_dir: {path} is not a Hugging Face model directory (no config.json)")
        check_model_code(cfg, "sft.model_dir", path)
    validate(cfg, SFTJob)  # the schema's value checks (rl/config/checks.py), for a config not read by the loader
    if sft.model_dir is not None:
        from k3rl.rl.checkpoint import check_model_path

        # last (it reads every weight once): manifest, files, shapes, dtypes, finite values, before anything is written
        check_model_path("sft.model_dir", sft.model_dir, trains=True)


def run_sft(cfg) -> Path:
    """Run one SFT job (a loaded `SFTJob`, whose `sft:` section drives it); returns the directory
    of the trained HF model."""
    import k3rl.envs as envs
    from k3rl.rl.config import to_yaml
    from k3rl.rl.orchestrator.tasks import make_tasks, remove_training_tasks

    _check(cfg)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sft, run = cfg.sft, cfg.run
    env_name, env_kwargs, task_seed = _resolved(cfg)
    try:
        # built before the run directory: an argument it refuses (`env.args.ask=size`) leaves nothing behind
        env = envs.make(env_name, **env_kwargs)
    except TypeError as e:  # envs.registry.EnvArgumentError
        key = "sft.env_args" if cfg.sft.env_args is not None else "env.args"
        raise ConfigError(f"{key}: environment {env_name!r} does not take these arguments ({e})") from None
    run_dir = Path(run.output_dir) / run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))

    model_dir = Path(sft.model_dir) if sft.model_dir is not None else init_model(cfg.model, run_dir / "init", run.seed)
    from k3rl.model.formats.config_json import image_patch_of
    from k3rl.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir, trust_remote_code=bool(run.trust_remote_code))
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"sft.model_dir: the tokenizer in {model_dir} has no chat template")

    train_tasks = make_tasks(env, sft.num_tasks, task_seed, "sft.num_tasks / env.args")
    started = time.perf_counter()
    try:
        report = collect_demonstrations(env_name, sft.num_tasks, task_seed, tokenizer, env_kwargs, tasks=train_tasks,
                                        min_reward=sft.min_reward, max_length=cfg.rollout.max_context_tokens,
                                        max_turn_tokens=cfg.rollout.max_new_tokens, max_turns=cfg.rollout.max_turns,
                                        closed_book_rate=sft.closed_book_rate, hedging_rate=sft.hedging_rate,
                                        hedge=sft.hedge, teacher_seed=task_seed, image_patch=image_patch_of(model_dir))
    except NotImplementedError as e:
        raise ConfigError(f"environment {env_name!r}: {e}") from None
    print(report.line() + f" [{time.perf_counter() - started:.1f} s]", flush=True)
    (run_dir / "demos.json").write_text(json.dumps(report.summary(), indent=1))
    if not report.rows:
        raise ConfigError(f"sft: no demonstration kept out of {report.tasks} tasks ({report.dropped}); check "
                          f"sft.min_reward, rollout.max_context_tokens and rollout.max_new_tokens")

    learner, steps = make_learner(cfg, model_dir, len(report.rows))
    examples = [as_trajectory(r["input_ids"], r["assistant_masks"], r.get("images"), r.get("image_shapes"))
                for r in report.rows]
    batches = step_batches(len(examples), sft.batch_size * sft.grad_accum, steps, run.seed)
    logger = MetricsLogger(run_dir, total_steps=steps, resume_step=-1, label="SFT", headline=SFT_HEADLINE,
                           sinks=open_sinks(cfg, run_dir, -1))
    started = time.perf_counter()
    try:
        history = train_supervised(learner, examples, batches, logger.log, sft.logging_steps)
        seconds = time.perf_counter() - started
        out = save_model(learner.model, tokenizer, run_dir / "model")
        plot_loss(history, run_dir / "loss.png")
        logger.images([run_dir / "loss.png"])
    finally:
        logger.close()
    print(loss_summary(history, seconds, steps), flush=True)
    if sft.eval_tasks > 0:
        held_out, dropped = remove_training_tasks(
            make_tasks(env, sft.eval_tasks, cfg.eval.seed, "sft.eval_tasks / env.args"), train_tasks)
        if dropped:
            print(dropped, flush=True)
        from k3rl.rl.eval.runners import greedy_report

        result = greedy_report(learner.model, tokenizer, env_name, held_out, env_kwargs,
                               max_new_tokens=cfg.rollout.max_new_tokens, max_turns=cfg.rollout.max_turns,
                               max_context_tokens=cfg.rollout.max_context_tokens, success_key=cfg.env.success_key,
                               device=run.device)
        (run_dir / "eval.json").write_text(json.dumps(result, indent=1))
        lo, hi = result["success_ci95"]
        print(f"held-out greedy rollouts: success {result['success']:.2f} [{lo:.2f}, {hi:.2f}] on {result['tasks']} "
              f"tasks, first turn well-formed {result['first_turn_well_formed']:.2f}, turns well-formed "
              f"{result['turns_well_formed']:.2f}, mean reward {result['mean_reward']:.3f}", flush=True)
    print(f"wrote {out}", flush=True)
    return out


def loss_summary(history: list[dict], seconds: float, steps: int) -> str:
    """One line: the training loss at the start and end, its minimum, skipped steps, time and throughput."""
    if not history:
        return f"sft: {steps} steps in {seconds:.1f} s (no loss logged)"
    losses = [h["loss"] for h in history if "loss" in h]
    tokens = sum(h["num_tokens"] for h in history)
    skipped = round(sum(h.get("skipped", 0.0) * h["window_steps"] for h in history))
    k = max(1, len(losses) // 10)
    return (f"sft: {steps} steps in {seconds:.1f} s ({seconds / max(1, steps):.2f} s/step, "
            f"{tokens / max(seconds, 1e-9):.0f} tokens/s); loss {losses[0]:.3f} → {losses[-1]:.3f} "
            f"(min {min(losses):.3f}; mean of first/last {k} logs {sum(losses[:k]) / k:.3f} → "
            f"{sum(losses[-k:]) / k:.3f}){f'; {skipped} steps skipped (non-finite)' if skipped else ''}")


def plot_loss(history: list[dict], path: str | Path) -> None:
    """PNG of the logged training loss against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    history = [h for h in history if "loss" in h]
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
