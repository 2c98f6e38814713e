"""The long-context RL recipe end to end on the CPU: a tiny K3 learns to retrieve at 1K, RL lengthens its reach.

    python bench/longctx_recipe.py --seed 0                       # one seed, native CPU code path
    python bench/longctx_recipe.py --seed 0 --path generic        # the same on torch's non-vectorised kernels
    python bench/longctx_recipe.py --seed 0 --rl-lengths 4096 8192 --eval-lengths 1024 4096 16384 32768
    python bench/longctx_recipe.py --seed 0 --sft-set sft.max_steps=1000 --rl-set rl.steps=40 learner.lr=1e-4

Stages, each a `k3rl` command on a config of configs/longctx/ (a stage whose output exists is skipped, so the
same command continues a cut run):

1. practice — retrieval-rich pretraining text (envs/longctx/practice.py): needle questions answered against real
   Wikipedia passages in ~100-token documents, from the seed's own `practice:` stream (never an environment's task
   seed); pretrain — `k3rl pretrain configs/longctx/pretrain.yaml`: the tiny K3 from random weights on that text in
   128-token rows, the likelihood retrieval score (rl/pretrain/retrieval_score.py) at the start and end
   (`--no-pretrain`: SFT from random weights);
2. sft — `k3rl sft configs/longctx/sft.yaml`: the chat format, the `answer` tool and the lookup itself on oracle
   demonstrations of the needle task in context at short length (from random weights, or the pretrained model);
3. eval-sft — `k3rl eval configs/longctx/eval.yaml` on the warm-started model: the grid before RL;
4. rl-L for each of `--rl-lengths` — `k3rl train configs/longctx/rl.yaml` at haystacks of L tokens from the
   previous model (a length curriculum), with the small in-training grid every `eval.grid_every` steps, then
   eval-rl-L — the grid on that stage's model;
5. report — `report.md` / `report.json`: success by length with Wilson intervals before and after every stage,
   effective lengths (rl/eval/report.py's rule at `eval.effective_ratio`), the difference at the longest trained
   length with its Newcombe interval, the verdicts the issue asks for, wall time and peak memory;
   `before_after.png`: success by length, before RL and after each stage, per family and serving.

Training tasks come from `run.seed`'s stream, the grid's from `eval.seed`'s (disjoint: asserted by the trainer
for its own grid, and here for every evaluation against every RL stage's training tasks). Peak memory is the largest
sum of RSS over this process's tree, sampled every second.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from quickstart_seeds import PATHS, cpu_name, path_env  # noqa: E402

CONFIGS = REPO / "configs" / "longctx"


class PeakRSS(threading.Thread):
    """The largest sum of resident memory over this process and its descendants, sampled every `every` s."""

    def __init__(self, every: float = 1.0):
        super().__init__(daemon=True)
        self.every, self.peak, self._stop = every, 0, threading.Event()

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.every)

    def stop(self) -> int:
        self._stop.set()
        return self.peak


def k3rl(args: list[str], log: Path, env: dict[str, str]) -> None:
    """Run one `k3rl` command, its output both on the console (progress) and in `log`; a failure stops here."""
    cmd = [sys.executable, "-m", "k3rl.rl.commands.cli", *args]
    print("$ k3rl " + " ".join(args), flush=True)
    with log.open("a") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        for line in proc.stdout:
            f.write(line)
            sys.stdout.write(line)
        if proc.wait() != 0:
            raise SystemExit(f"k3rl {args[0]} failed (exit {proc.returncode}); its output is in {log}. Run the same "
                             f"command again to continue from where it stopped.")


def latest_checkpoint(run_dir: Path) -> Path:
    from k3rl.rl.checkpoint import find_latest

    latest = find_latest(run_dir / "checkpoints")
    if latest is None:
        raise SystemExit(f"{run_dir} has no complete checkpoint")
    return latest


def training_task_ids(run_dir: Path) -> set[tuple]:
    """(family, seed) of every training task an RL stage drew (its config: env, num_tasks, run.seed)."""
    from omegaconf import OmegaConf

    import k3rl.envs as envs

    cfg = OmegaConf.load(run_dir / "config.yaml")
    env = envs.make(cfg.env.name, **OmegaConf.to_container(cfg.env.args, resolve=True))
    return {(t.get("family"), t["seed"]) for t in env.tasks(cfg.env.num_tasks, seed=cfg.run.seed)}


def grid_task_ids(eval_dir: Path) -> set[tuple]:
    ids = set()
    with (eval_dir / "tasks.jsonl").open() as f:
        for line in f:
            row = json.loads(line)
            task = row.get("task") or {}
            if "seed" in task:
                ids.add((task.get("family", row.get("family")), task["seed"]))
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--path", choices=sorted(PATHS), default="native", help="CPU code path (bench/quickstart_seeds.py)")
    p.add_argument("--out", type=Path, default=None, help="default: runs/longctx-recipe/seed<S>-<path>")
    p.add_argument("--rl-lengths", type=int, nargs="+", default=[4096])
    p.add_argument("--eval-lengths", type=int, nargs="+", default=None,
                   help="grid lengths (default: configs/longctx/eval.yaml's)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every command")
    for stage_name in ("pretrain", "sft", "rl", "eval"):
        p.add_argument(f"--{stage_name}-set", nargs="+", default=[], metavar="KEY=VALUE",
                       help=f"dotted overrides of every `{stage_name}` stage's config")
    p.add_argument("--no-pretrain", action="store_true",
                   help="skip the practice-text curriculum (configs/longctx/pretrain.yaml): SFT from random weights")
    args = p.parse_args(argv)
    out = (args.out or REPO / "runs" / "longctx-recipe" / f"seed{args.seed}-{args.path}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**path_env(args.path), "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    log = out / "recipe.log"
    seed = args.seed
    common = [f"run.seed={seed}", f"run.output_dir={out}"]
    grid = [f"eval.context_lengths=[{','.join(map(str, args.eval_lengths))}]"] if args.eval_lengths else []
    timings: dict[str, float] = json.loads((out / "timings.json").read_text()) if (out / "timings.json").is_file() else {}
    peak = PeakRSS()
    peak.start()
    started = time.perf_counter()

    (out / ".done").mkdir(exist_ok=True)

    def stage(name: str, run) -> None:
        """Run a stage unless its mark says it finished (a cut stage runs again: each command resumes itself)."""
        mark = out / ".done" / name
        if mark.exists():
            print(f"[{name}] finished earlier", flush=True)
            return
        print(f"[{name}] …", flush=True)
        t = time.perf_counter()
        run()
        timings[name] = time.perf_counter() - t
        (out / "timings.json").write_text(json.dumps(timings, indent=1))
        mark.touch()

    sft_args = ["sft", str(CONFIGS / "sft.yaml"), *common, "run.name=sft"]
    if not args.no_pretrain:
        from k3rl.envs.longctx.practice import write_practice_corpus

        # (byte-estimate length, questions, documents): ~100-token documents with the tiny K3's tokenizer
        practice = {"short": (60, 1, 16000)}
        for i, (kind, (length, questions, n)) in enumerate(practice.items()):
            stage(f"practice-{kind}", lambda kind=kind, length=length, q=questions, n=n, i=i:
                  write_practice_corpus(out / f"practice-{kind}.jsonl", {"needle": n}, length, seed=3 * seed + i,
                                        questions=q, ask="colour", distractors=0, paraphrase_rate=0.0))
        stage("pretrain", lambda: k3rl(
            ["pretrain", str(CONFIGS / "pretrain.yaml"), *common, "run.name=pretrain",
             *(f"pretrain.sources.{kind}.path={out / f'practice-{kind}.jsonl'}" for kind in practice),
             *args.pretrain_set], log, env))
        sft_args.append(f"sft.model_dir={sorted((out / 'pretrain').glob('stage*/final'))[-1]}")
    stage("sft", lambda: k3rl([*sft_args, *args.sft_set], log, env))
    models = {"sft": out / "sft" / "model"}

    def evaluate(name: str) -> None:
        stage(f"eval-{name}", lambda: k3rl(
            ["eval", str(CONFIGS / "eval.yaml"), *common, f"run.name=eval-{name}", f"eval.model_path={models[name]}",
             *grid, *args.eval_set], log, env))

    evaluate("sft")
    for length in args.rl_lengths:
        name, previous = f"rl-{length}", list(models.values())[-1]
        stage(name, lambda name=name, length=length, previous=previous: k3rl(
            ["train", str(CONFIGS / "rl.yaml"), *common, f"run.name={name}", f"rl.model_path={previous}",
             f"env.args.length={length}", f"rollout.max_context_tokens={length + 1024}", *grid, *args.rl_set],
            log, env))
        models[name] = latest_checkpoint(out / name)
        evaluate(name)
    train_ids = set().union(*(training_task_ids(out / f"rl-{n}") for n in args.rl_lengths))
    for name in models:
        shared = grid_task_ids(out / f"eval-{name}") & train_ids
        assert not shared, f"eval-{name}: {len(shared)} grid tasks are RL training tasks: {sorted(shared)[:3]}"
    from recipe_report import write_report

    write_report(out, models, args.rl_lengths, timings, time.perf_counter() - started, peak.stop(),
                 {"seed": seed, "path": args.path, "cpu": cpu_name(), "disjoint_from_training": len(train_ids)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
