"""`k3rl quickstart [CONFIG] [key=value …]`: the main job (`make run`), from nothing to a policy
that measurably learns, on the CPU in minutes.

1. **init**: a random tiny K3 and its byte-level BPE tokenizer (the `model:` section, as `k3rl init`).
2. **sft**: a supervised warm start on demonstrations (`run_sft`, rl/orchestrator/sft.py, the `sft:` section).
3. **rl**: GRPO (`algo.name`) with the native engine on a local Ray cluster (`Trainer`,
   rl/orchestrator/trainer.py, the `rl:` section), evaluating the held-out tasks at step 0 — the SFT policy,
   i.e. *before RL* — and after its last step, on the same tasks through the same workers.
4. **report** (rl/eval/before_after.py): success before and after RL with 95% Wilson intervals, the
   difference with its Newcombe (hybrid score) interval, answer F1 and reward before/after, `report.json` and
   `quickstart.png`.

The SFT and RL phases run on an `SFTJob` and a `TrainJob` (rl/config/schemas.py) built from the quickstart
job's sections, each with its own run directory (`sft/`, `rl/`) and starting model. The default recipe
(configs/rl/quickstart.yaml) plants a habit in SFT (hedged answers, which exact match rejects) that only the
reward can remove; bench/README.md records what was measured while choosing it.

Everything lands in one run directory, `run.output_dir/run.name` (a `-2`, `-3`, … suffix when it
exists already): `init/`, `sft/` (model, demos, loss), `rl/` (checkpoints, metrics.jsonl,
TensorBoard, plots), `report.json`, `quickstart.png`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

DEFAULT_CONFIG = "configs/rl/quickstart.yaml"


def _fresh_dir(root: Path, name: str) -> Path:
    path = root / name
    k = 2
    while path.exists():
        path = root / f"{name}-{k}"
        k += 1
    return path


def _phase(title: str, started: float) -> None:
    print(f"\n== {title} [{time.perf_counter() - started:.0f} s]", flush=True)


def sft_job(cfg: Any, run_dir: Path, init_dir: Path) -> Any:
    """The SFT phase's `SFTJob`: the quickstart job's sections, run directory `run_dir/sft`, starting from the
    model in `init_dir`."""
    from omegaconf import OmegaConf

    from k3rl.rl.config import SFTJob

    job = OmegaConf.to_object(cfg)
    return OmegaConf.structured(SFTJob(
        run=replace(job.run, output_dir=str(run_dir), name="sft"), ray=job.ray, model=job.model, algo=job.algo,
        rollout=job.rollout, env=job.env, learner=job.learner, eval=job.eval,
        sft=replace(job.sft, model_dir=str(init_dir))))


def rl_job(cfg: Any, run_dir: Path, sft_model: Path) -> Any:
    """The RL phase's `TrainJob`: the quickstart job's sections, run directory `run_dir/rl`, starting from the SFT
    model, and evaluating at the last step at least (`eval.every` = `rl.steps` when it is 0 or beyond the last step)."""
    from omegaconf import OmegaConf

    from k3rl.rl.config import TrainJob

    job = OmegaConf.to_object(cfg)
    every = job.eval.every if 0 < job.eval.every <= job.rl.steps else job.rl.steps
    return OmegaConf.structured(TrainJob(
        run=replace(job.run, output_dir=str(run_dir), name="rl"), ray=job.ray, model=job.model,
        rl=replace(job.rl, model_path=str(sft_model)), algo=job.algo, rollout=job.rollout, env=job.env,
        learner=job.learner, eval=replace(job.eval, every=every)))


def run_quickstart(cfg: Any) -> Path:
    """Run the main job on a loaded `QuickstartJob`; returns the run directory."""
    from k3rl.rl.config import ConfigError
    from k3rl.rl.orchestrator.sft import init_model, run_sft
    from k3rl.rl.orchestrator.trainer import Trainer

    sft = cfg.sft
    if (sft.env or cfg.env.name) != cfg.env.name or (sft.env_args is not None and sft.env_args != cfg.env.args):
        raise ConfigError("sft.env / sft.env_args: the quickstart warms up on the environment RL trains on; "
                          "leave them null")
    if (sft.task_seed if sft.task_seed is not None else cfg.run.seed) != cfg.run.seed or sft.num_tasks > cfg.env.num_tasks:
        raise ConfigError(f"sft.num_tasks ({sft.num_tasks}) must be ≤ env.num_tasks ({cfg.env.num_tasks}) with "
                          f"sft.task_seed null: the SFT tasks are then RL training tasks, and every held-out task "
                          f"is new to both")
    if cfg.eval.num_tasks <= 0 and not cfg.eval.tasks_path:
        raise ConfigError("eval.num_tasks: the quickstart compares held-out success before and after RL; "
                          f"set eval.num_tasks > 0 (or eval.tasks_path), got {cfg.eval.num_tasks}")
    started = time.perf_counter()
    run_dir = _fresh_dir(Path(cfg.run.output_dir), cfg.run.name)
    run_dir.mkdir(parents=True)
    print(f"run directory: {run_dir.resolve()}", flush=True)

    _phase("1/4 init: a random tiny K3 and its tokenizer", started)
    init_dir = init_model(cfg.model, run_dir / "init", cfg.run.seed)

    _phase("2/4 sft: warm start on oracle demonstrations", started)
    sft_model = run_sft(sft_job(cfg, run_dir, init_dir))

    _phase("3/4 rl: GRPO on a local Ray cluster (held-out evaluation at step 0 = before RL, and at the end)",
           started)
    trainer = Trainer(rl_job(cfg, run_dir, sft_model))
    rl_dir = trainer.train()

    _phase("4/4 report", started)
    from k3rl.rl.eval.before_after import plot_report, report, summary_lines
    from k3rl.rl.eval.transcripts import markdown

    result = report(rl_dir, started, hedge=sft.hedge if sft.hedging_rate > 0 else "",
                    success_key=trainer.success_key)
    result["run_dir"] = str(run_dir.resolve())
    (run_dir / "report.json").write_text(json.dumps(result, indent=1))
    if result.get("transcripts"):
        (run_dir / "transcripts.md").write_text(markdown(result["transcripts"]))
    plot_report(result, rl_dir, run_dir / "quickstart.png")
    for line in summary_lines(result):
        print(line, flush=True)
    print(f"total {result['seconds']:.0f} s; wrote {run_dir / 'report.json'}, {run_dir / 'quickstart.png'}, "
          f"{run_dir / 'transcripts.md'} (held-out episodes before/after), "
          f"the RL checkpoint under {rl_dir / 'checkpoints'} and TensorBoard logs under {run_dir}", flush=True)
    return run_dir


def main(argv: Optional[list[str]] = None) -> int:
    """`k3rl quickstart [CONFIG] [key=value …]`."""
    import argparse

    from k3rl.rl.config import ConfigError, QuickstartJob, load_config

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="k3rl quickstart", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, metavar="CONFIG",
                        help=f"a YAML recipe (default {DEFAULT_CONFIG})")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. rl.steps=10")
    args = parser.parse_args(argv)
    if "=" in args.config or args.config.startswith("~"):  # only overrides were given
        args.overrides, args.config = [args.config, *args.overrides], DEFAULT_CONFIG
    try:
        cfg = load_config(args.config, args.overrides, QuickstartJob)
        run_quickstart(cfg)
    except ConfigError as e:
        print(f"k3rl quickstart: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
