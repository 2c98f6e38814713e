"""Named errors for a `k3rl train` job that cannot run, raised before anything is started or written.

`check_job` reads the config and the files it names (the initial policy and reference model, the environment,
the engine arguments); `check_resources` compares what the learner ranks and rollout workers ask of the Ray
cluster with what it has, since an actor that cannot be placed would wait forever.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3rl.rl.config import ConfigError, TrainJob, check_model_code, validate
from k3rl.rollout.worker import check_engine_args, check_partial_resume


def check_job(cfg: Any) -> list[Path]:
    """Every check of a `k3rl train` job that needs no cluster (the model's weights read last, once); returns
    the files of user-defined environment modules the rollout actors must import."""
    rl = cfg.rl  # choices (rl.mode, rollout.engine, env.bad_task_rows, …) are enums checked by the loader
    if not rl.model_path:
        raise ConfigError("rl.model_path: set the initial policy's HF directory (`k3rl init`, `k3rl sft`, …)")
    model_dir = Path(rl.model_path)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"rl.model_path: no Hugging Face model at {model_dir} (config.json missing)")
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"rl.model_path: {model_dir} has no tokenizer (tokenizer.json / tokenizer_config.json); "
                          f"the rollout engines and the chat template need one (`k3rl init` writes both)")
    check_model_code(cfg, "rl.model_path", model_dir)
    if cfg.learner.ref_model_path:
        check_model_code(cfg, "learner.ref_model_path", cfg.learner.ref_model_path)
    validate(cfg, TrainJob)  # the schema's value checks (rl/config/checks.py), for a config not read by the loader
    from k3rl.envs.registry import UnknownEnvironment, resolve, user_module_path
    from k3rl.rl.train.group import LearnerConfig

    try:
        learner_cfg = LearnerConfig.from_job(cfg, rl.model_path)
    except ValueError as e:
        raise ConfigError(f"learner.{e}") from None
    from k3rl.rl.algos import get_algo

    try:
        get_algo(cfg.algo.name, **learner_cfg.algo_args)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"algo.name / algo.args: {e}") from None

    try:
        check_partial_resume(str(cfg.rollout.partial_resume), str(cfg.rollout.engine),
                             dict(cfg.rollout.engine_args), str(rl.model_path))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    lora = cfg.learner.lora
    if lora.rank and lora.push == "adapters" and str(cfg.rollout.engine) == "vllm":
        import json

        from k3rl.rollout.vllm_engine import k3_layout

        if k3_layout(json.loads((model_dir / "config.json").read_text())) is not None:
            raise ConfigError("learner.lora.push: `adapters` reach vLLM as LoRA adapters for HF models only; vLLM's "
                              "K3 module takes merged weights: set learner.lora.push=merged (or rollout.engine=torch)")
    try:
        check_engine_args(str(cfg.rollout.engine), dict(cfg.rollout.engine_args))
    except ValueError as e:
        raise ConfigError(f"rollout.engine_args: {e}") from None
    try:
        entry = resolve(cfg.env.name)
        env_modules = [p for p in [user_module_path(cfg.env.name)] if p is not None]
    except UnknownEnvironment as e:
        raise ConfigError(f"env.name: {e}") from None
    from k3rl.envs.agent import builds_agent

    if builds_agent(entry.target) and cfg.rollout.partial_rounds > 0:
        raise ConfigError("rollout.partial_rounds: an agent function's episodes run whole (envs/agent.py); set "
                          "rollout.partial_rounds=0")
    from k3rl.rl.checkpoint import check_model_path

    # last of the checks (it reads every weight once): here, not as a traceback from a Ray actor
    check_model_path("rl.model_path", model_dir, trains=True)
    if cfg.learner.ref_model_path:
        check_model_path("learner.ref_model_path", cfg.learner.ref_model_path, trains=True)
    return env_modules


def check_resources(cfg: Any, have: dict[str, float]) -> None:
    """The learner ranks and rollout workers all live at once: a cluster (`have`: Ray's resource totals) too
    small for them would leave an actor pending forever, so say which keys ask for what instead."""
    ln, ro = cfg.learner, cfg.rollout
    for kind, learner, rollout in (("CPU", ln.num_cpus, ro.num_cpus), ("GPU", ln.num_gpus, ro.num_gpus)):
        need = ln.num_ranks * learner + ro.num_workers * rollout
        if need > have.get(kind, 0.0) + 1e-9:
            key = "num_cpus" if kind == "CPU" else "num_gpus"
            raise ConfigError(
                f"learner.num_ranks × learner.{key} + rollout.num_workers × rollout.{key} = "
                f"{ln.num_ranks} × {learner:g} + {ro.num_workers} × {rollout:g} = {need:g} {kind}s, "
                f"but the Ray cluster has {have.get(kind, 0.0):g} (ray.num_cpus / ray.address)")
