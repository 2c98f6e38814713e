"""The quickstart's verdict on an RL run: held-out success before RL (the step-0 evaluation, the SFT policy) and
after (the last one), with Wilson intervals, the difference with its Newcombe interval, what the episodes did
differently (rl/eval/transcripts.py `behaviour`), training collapses, a figure and the summary lines.

`k3rl quickstart` (rl/commands/quickstart.py) writes `report.json`, `transcripts.md` and `quickstart.png` from it.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any


def newcombe_interval(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float]:
    """95% interval of p2 − p1 for two independent proportions (Newcombe 1998, method 10: the
    hybrid score interval built from each proportion's Wilson interval)."""
    from k3rl.rl.metrics import wilson_interval

    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson_interval(k1, n1)
    l2, u2 = wilson_interval(k2, n2)
    d = p2 - p1
    return (d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2), d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2))


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
