"""`k3rl quickstart [CONFIG] [key=value …]`: the main job (`make run`), from nothing to a policy
that measurably learns, on the CPU in minutes.

1. **init**: a random tiny K3 and its byte-level BPE tokenizer (the `model:` section, as `k3rl init`).
2. **sft**: a supervised warm start on demonstrations (`run_sft`, rl/orchestrator/sft.py, the `sft:` section).
3. **rl**: GRPO (`algo.name`) with the native engine on a local Ray cluster (`Trainer`,
   rl/orchestrator/trainer.py, the `rl:` section), evaluating the held-out tasks at step 0 — the SFT policy,
   i.e. *before RL* — and after its last step, on the same tasks through the same workers.
4. **report**: success before and after RL with 95% Wilson intervals, the difference with its
   Newcombe (hybrid score) interval, answer F1 and reward before/after, `report.json` and
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
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

DEFAULT_CONFIG = "configs/rl/quickstart.yaml"


def newcombe_interval(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float]:
    """95% interval of p2 − p1 for two independent proportions (Newcombe 1998, method 10: the
    hybrid score interval built from each proportion's Wilson interval)."""
    from k3rl.rl.metrics import wilson_interval

    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson_interval(k1, n1)
    l2, u2 = wilson_interval(k2, n2)
    d = p2 - p1
    return (d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2), d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2))


def _fresh_dir(root: Path, name: str) -> Path:
    path = root / name
    k = 2
    while path.exists():
        path = root / f"{name}-{k}"
        k += 1
    return path


def _phase(title: str, started: float) -> None:
    print(f"\n== {title} [{time.perf_counter() - started:.0f} s]", flush=True)


def collapses(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training steps where the policy fell apart: mean reward below half the best earlier step's,
    with at least half of the groups scoring all their samples alike (nothing left to learn from)."""
    out, best = [], None
    for r in (r for r in rows if "reward/mean" in r):
        reward, zero_var = r["reward/mean"], r.get("groups/zero_variance_frac", 0.0)
        if best is not None and best > 0 and reward < 0.5 * best and zero_var >= 0.5:
            out.append({"step": r["step"], "reward": reward, "best_reward_before": best,
                        "zero_variance_frac": zero_var, "kl_ref": r.get("train/kl_ref")})
        best = reward if best is None else max(best, reward)
    return out


def report(rl_dir: Path, started: float, hedge: str = "", success_key: str | None = "em") -> dict[str, Any]:
    """Before/after numbers from the RL run's metrics (the step-0 and the last evaluation), what
    the held-out episodes did differently (`rl.eval.transcripts.behaviour`), a few of them side by side,
    and any training collapse."""
    from k3rl.rl.eval.transcripts import behaviour, eval_path, read_eval_episodes, side_by_side
    from k3rl.rl.metrics import read_metrics

    rows = read_metrics(rl_dir)
    evals = [r for r in rows if "eval/success_rate" in r]
    if len(evals) < 2:
        raise RuntimeError(f"{rl_dir}: expected an evaluation before and after RL, found {len(evals)}")
    before, after = evals[0], evals[-1]
    k1, n1 = int(before["eval/successes"]), int(before["eval/num_tasks"])
    k2, n2 = int(after["eval/successes"]), int(after["eval/num_tasks"])
    low, high = newcombe_interval(k1, n1, k2, n2)
    train = [r for r in rows if "reward/mean" in r]

    def part(r: dict[str, Any], k: int, n: int) -> dict[str, Any]:
        return {"step": r["step"], "successes": k, "tasks": n, "success": k / n,
                "ci95": [r["eval/ci_low"], r["eval/ci_high"]], "reward": r.get("eval/reward_mean"),
                "f1": r.get("eval/f1")}

    result: dict[str, Any] = {
        "before": part(before, k1, n1), "after": part(after, k2, n2),
        "difference": k2 / n2 - k1 / n1, "difference_ci95": [low, high],
        "improved_beyond_ci": low > 0 and after["eval/ci_low"] > k1 / n1,
        "train_reward_first": train[0]["reward/mean"] if train else None,
        "train_reward_last": train[-1]["reward/mean"] if train else None,
        "collapses": collapses(rows),
    }
    files = [eval_path(rl_dir, r["step"]) for r in (before, after)]
    if all(f.is_file() for f in files):
        episodes = [read_eval_episodes(f) for f in files]
        result["before"]["behaviour"] = behaviour(episodes[0], hedge=hedge)
        result["after"]["behaviour"] = behaviour(episodes[1], hedge=hedge)
        result["transcripts"] = side_by_side(*episodes, k=3, success_key=success_key)
    result["seconds"] = time.perf_counter() - started
    return result


def plot_report(result: dict[str, Any], rl_dir: Path, path: Path) -> None:
    """PNG: held-out success (95% intervals), answer F1 and reward before/after RL; the training
    rollouts per step (reward, sampled success, groups with nothing to learn); the KL to the SFT
    policy and the gradient norm per step, with any collapse marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from k3rl.rl.metrics import read_metrics

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 3.9))
    parts = [result["before"], result["after"]]
    metrics = [("success", "success"), ("f1", "answer F1"), ("reward", "reward")]
    width = 0.38
    for j, (p, label, colour) in enumerate(zip(parts, ["before RL (SFT)", "after RL"], ["#9aa5b1", "#2b8a3e"])):
        xs = [i + (j - 0.5) * width for i in range(len(metrics))]
        values = [p.get(key) or 0.0 for key, _ in metrics]
        a.bar(xs, values, width, color=colour, label=label)
        lo, hi = p["ci95"]
        a.errorbar([xs[0]], [p["success"]], yerr=[[max(0.0, p["success"] - lo)], [max(0.0, hi - p["success"])]],
                   fmt="none", ecolor="black", capsize=6)
        a.text(xs[0], hi + 0.02, f"{p['successes']}/{p['tasks']}", ha="center", fontsize=8)
    a.set_xticks(range(len(metrics)), [name for _, name in metrics])
    a.set_ylim(0, 1.1)
    a.set_title("held-out, greedy (success with 95% Wilson CI)")
    a.legend(fontsize=8, loc="upper left")

    rows = [r for r in read_metrics(rl_dir) if "reward/mean" in r]
    steps = [r["step"] for r in rows]
    b.plot(steps, [r["reward/mean"] for r in rows], marker="o", label="reward")
    b.plot(steps, [r["success/rate"] for r in rows], marker="s", label="success (sampled)")
    b.plot(steps, [r.get("groups/zero_variance_frac", 0.0) for r in rows], marker="x", ls=":",
           label="groups with equal rewards")
    b.set_xlabel("RL step")
    b.set_title("training rollouts")
    b.set_ylim(0, 1.05)
    b.grid(alpha=0.3)
    b.legend(fontsize=8)

    c.plot(steps, [r.get("train/kl_ref", 0.0) for r in rows], marker="o", color="#c92a2a", label="KL to SFT policy")
    c.set_xlabel("RL step")
    c.set_ylabel("KL (k3, per token)")
    c2 = c.twinx()
    c2.plot(steps, [r.get("train/grad_norm", 0.0) for r in rows], marker=".", ls="--", color="#495057",
            label="grad norm")
    c2.set_ylabel("grad norm")
    for x in result.get("collapses", []):
        c.axvline(x["step"], color="#c92a2a", alpha=0.3, lw=6)
        b.axvline(x["step"], color="#c92a2a", alpha=0.3, lw=6)
    c.set_title("policy drift" + (" (collapse marked)" if result.get("collapses") else ""))
    c.grid(alpha=0.3)
    lines = c.get_legend_handles_labels()[0] + c2.get_legend_handles_labels()[0]
    c.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _share(x: float) -> str:
    return f"{100 * x:.0f}%"


def learned_lines(result: dict[str, Any]) -> list[str]:
    """What the held-out episodes did differently after RL, in words."""
    b, a = result["before"].get("behaviour"), result["after"].get("behaviour")
    if not b or not a:
        return []
    parts = []
    if "hedged" in b:
        parts.append(f"hedged answers {_share(b['hedged'])} → {_share(a['hedged'])}")
    parts += [f"answers holding the right answer {_share(b['contains_gold'])} → {_share(a['contains_gold'])}",
              f"searched before answering {_share(b['searched'])} → {_share(a['searched'])}",
              f"ended with an answer {_share(b['answered'])} → {_share(a['answered'])}"]
    return ["what changed in the held-out episodes: " + "; ".join(parts)]


def advice_lines(result: dict[str, Any]) -> list[str]:
    """When RL did not beat the interval: what to try, from what the run shows."""
    if result["improved_beyond_ci"]:
        return []
    out = []
    for x in result.get("collapses", []):
        out.append(f"training collapsed at step {x['step']} (reward {x['reward']:.3f}, best before "
                   f"{x['best_reward_before']:.3f}; {_share(x['zero_variance_frac'])} of the groups scored all "
                   f"samples alike): try a smaller step, e.g. learner.lr=5e-5, or a stronger anchor, "
                   f"algo.args.kl_coef=0.2")
    if not out:
        out.append("no collapse: try more steps (rl.steps=2×) or another seed (run.seed=1); "
                   "`python bench/quickstart_seeds.py` measures how often the recipe improves")
    return ["what to try: " + line for line in out]


def summary_lines(result: dict[str, Any]) -> list[str]:
    b, a = result["before"], result["after"]
    lo, hi = result["difference_ci95"]
    if result["improved_beyond_ci"]:
        verdict = (f"RL improved held-out success beyond the confidence intervals (the difference's 95% interval "
                   f"excludes 0, and after RL the lower bound {a['ci95'][0]:.3f} is above the {b['success']:.3f} "
                   f"before)")
    else:
        verdict = "RL did NOT improve held-out success beyond the confidence intervals"
    lines = [
        f"held-out success before RL (SFT policy): {b['success']:.3f} = {b['successes']}/{b['tasks']} "
        f"[95% CI {b['ci95'][0]:.3f}, {b['ci95'][1]:.3f}]",
        f"held-out success after RL (step {a['step']}):  {a['success']:.3f} = {a['successes']}/{a['tasks']} "
        f"[95% CI {a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}]",
        f"difference: {result['difference']:+.3f} [95% CI {lo:+.3f}, {hi:+.3f}] — {verdict}",
    ]
    if b.get("f1") is not None and a.get("f1") is not None:
        lines.append(f"held-out answer F1: {b['f1']:.3f} → {a['f1']:.3f}; mean reward {b['reward']:.3f} → "
                     f"{a['reward']:.3f}")
    for x in result.get("collapses", []):
        lines.append(f"collapse at step {x['step']}: training reward {x['reward']:.3f} after {x['best_reward_before']:.3f}")
    return lines + learned_lines(result) + advice_lines(result)


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
