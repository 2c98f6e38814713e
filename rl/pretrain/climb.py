"""Staged pretraining of the backbone, the context climb: what `k3rl pretrain CONFIG` runs (rl/commands/pretrain.py).

`Climb` composes
- rl/pretrain/stages.py: each stage of `pretrain.stages` as the learner's settings, checked before any work;
- rl/pretrain/sources.py, token_cache.py, packing.py: the corpora of `pretrain.sources` read, tokenized once into
  an on-disk cache, packed into rows of the stage's length with document boundaries kept (positions restart, a
  document's first token is never predicted from the one before) — row r of stage s is a pure function of (seed, s, r);
- rl/train/learner.py: the learner of RL and SFT with the `nll` objective (rl/algos/nll.py): packed rows run as
  separate documents, a document longer than the stage's segment runs segment by segment (rl/train/segments.py);
  `learner.num_ranks > 1` puts the ranks on Ray exactly as the RL learner (`LearnerGroup`);
- rl/pretrain/climb_report.py: loss by position on held-out long documents, plots; rl/pretrain/retrieval_score.py:
  log p(gold answer) with vs without the evidence passages (`pretrain.retrieval_score`); rl/eval/grid.py
  `eval_model_grid`: the retrieval grid on each stage's final model; rl/pretrain/plan.py: the cost, written beside
  the results.

Each stage starts from the previous stage's final checkpoint (its weights, and its optimizer moments when the stage
says `optimizer: keep`), with its own RoPE base on the MLA layers (RoPE models only). The run directory
`run.output_dir/run.name/` holds `config.yaml`, `climb.json` (what decides the data and the weights: a resumed run
must match it), `plan.txt`, and per stage `stageN-LEN/`: `checkpoints/` (every `pretrain.save_every` steps, atomic,
the newest `keep_checkpoints` kept), `metrics.jsonl` + `tb/` (one row per step: loss, tokens/s, grad norm, MaxVio
per MoE layer, the step's data digest; the held-out loss by position in step 0's row and the last step's),
`loss.png`, `heldout.json` (loss by position at the stage's start and end), `retrieval.json` (the retrieval score
at its start and end, when `pretrain.retrieval_score.enabled`), `final/` (the
stage's model: an HF directory with tokenizer and optimizer state), `eval/` (the retrieval grid). At the top:
`position_loss.png`, `score_by_length.png`, `retrieval_gain.png` (with the retrieval score) and `summary.json`.

Crash safety: starting the same command again continues the climb — finished stages are kept, the current stage
resumes from its newest complete checkpoint at the same step with the same rows (the data order is a function of
the step), an unfinished eval grid keeps its finished tasks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from k3rl.rl.config import ConfigError, PretrainJob, check_model_code, validate
from k3rl.rl.config.pretrain import num_steps, rows_per_step
from k3rl.rl.pretrain import stages as st

PRETRAIN_HEADLINE = (("loss", "loss"), ("lr", "lr"), ("grad_norm", "grad norm"), ("train_tokens_per_s", "tok/s"),
                     ("step_time_s", "s/step"), ("maxvio_max", "MaxVio"))
CLIMB_FILE = "climb.json"


def model_config(cfg: Any):
    """The K3 config the climb trains: `pretrain.model_dir`'s, or the `model:` section's."""
    from k3rl.model.config import K3Config

    try:
        if cfg.pretrain.model_dir is not None:
            path = Path(cfg.pretrain.model_dir)
            if not (path / "config.json").is_file():
                raise ConfigError(f"pretrain.model_dir: {path} is not a Hugging Face model directory (no config.json)")
            from k3rl.model.formats.config_json import read_config

            return read_config(path)
        return K3Config.from_model_config(cfg.model)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


def sources_of(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from k3rl.rl.pretrain.sources import default_sources

    # as DataSource dataclasses (what rl/pretrain/token_cache.py takes), not config nodes
    return OmegaConf.to_object(cfg.pretrain.sources) if cfg.pretrain.sources else default_sources()


def check(cfg: Any) -> tuple[Any, list[str]]:
    """(model config, notes) of a climb that can run; ConfigError naming the key otherwise."""
    validate(cfg, PretrainJob)  # the schema's value checks (rl/config/checks.py), for a config not read by the loader
    if cfg.pretrain.model_dir is not None:
        check_model_code(cfg, "pretrain.model_dir", cfg.pretrain.model_dir)
    config = model_config(cfg)
    notes = st.check_stages(cfg, config, sources_of(cfg))
    from k3rl.envs.sources import data_dir
    from k3rl.rl.pretrain.token_cache import check_sources

    # every data file read through (not tokenized) before anything is written
    check_sources(sources_of(cfg), data_dir() / "pretrain")
    from k3rl.envs.longctx.families import FAMILIES

    bad = [f for f in cfg.eval.families if f not in FAMILIES]
    if cfg.pretrain.eval_grid and (bad or not cfg.eval.families):
        raise ConfigError(f"eval.families: {bad or 'empty'}; the grid after each stage takes {', '.join(FAMILIES)}")
    from k3rl.rl.pretrain.retrieval_score import check_settings

    check_settings(cfg)
    return config, notes


def climb_identity(cfg: Any) -> dict[str, Any]:
    """What decides the data order and the weights: a resumed climb must have the same."""
    from omegaconf import OmegaConf

    pre = OmegaConf.to_container(cfg.pretrain, resolve=True)
    keep = {k: pre[k] for k in ("model_dir", "sources", "stages", "heldout_source", "heldout_docs")}
    # the learner's ranks and Ray resources (`learner.num_ranks`, …) do not change the data order or the weights
    learner = {k: v for k, v in OmegaConf.to_container(cfg.learner, resolve=True).items()
               if k not in ("num_ranks", "num_cpus", "num_gpus")}
    return {"seed": cfg.run.seed, "model": OmegaConf.to_container(cfg.model, resolve=True), "learner": learner,
            "pretrain": keep}


def _check_resume(run_dir: Path, identity: dict[str, Any]) -> None:
    saved_file = run_dir / CLIMB_FILE
    if not saved_file.is_file():
        return
    saved = json.loads(saved_file.read_text())
    mine = json.loads(json.dumps(identity, default=str))
    for section in mine:
        if saved.get(section) != mine[section]:
            diff = _first_difference(saved.get(section), mine[section], section)
            raise ConfigError(f"{run_dir} holds a climb with other settings ({diff}); resume it with its own "
                              f"config ({run_dir / 'config.yaml'}) or choose another run.name")


def _first_difference(a: Any, b: Any, path: str) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path}: was {a!r}, now {b!r}"


class Climb:
    """One staged pretraining run: data, stages, the learner of each stage, reports (see module docstring)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.model_config, notes = check(cfg)
        if cfg.pretrain.model_dir is not None:
            from k3rl.rl.checkpoint import check_model_path

            # every weight read once (manifest, files, shapes, dtypes, finite values) before anything is written
            check_model_path("pretrain.model_dir", cfg.pretrain.model_dir, trains=True)
        for note in notes:
            print(f"k3rl pretrain: {note}", flush=True)
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.identity = climb_identity(cfg)
        _check_resume(self.run_dir, self.identity)
        self.stores: dict[str, Any] = {}
        self.heldout: dict[str, list[int]] = {}
        self.summary: list[dict[str, Any]] = []
        self.tokenizer: Any = None
        self.owns_ray = False  # a local Ray cluster this climb started (learner.num_ranks > 1), shut down at the end

    def start_model(self) -> Path:
        """`pretrain.model_dir`, or a random model (with the built-in tokenizer) in `run_dir/init`."""
        if self.cfg.pretrain.model_dir is not None:
            return Path(self.cfg.pretrain.model_dir)
        target = self.run_dir / "init"
        if not _complete(target):  # written whole or not at all
            from k3rl.envs.registry import tokenizer_texts
            from k3rl.model.init import init_model
            from k3rl.rl.checkpoint import atomic_dir

            with atomic_dir(target, kind="init") as tmp:
                init_model(self.model_config, tmp, seed=self.cfg.run.seed, tokenizer_texts=tokenizer_texts())
        return target

    def load_data(self, tokenizer: Any) -> None:
        """Every source tokenized (once, cached) and the held-out documents chosen."""
        from k3rl.envs.sources import CorpusError, data_dir
        from k3rl.rl.pretrain.token_cache import build_store

        cache = data_dir() / "pretrain"
        for name, source in sources_of(self.cfg).items():
            started = time.perf_counter()
            try:
                self.stores[name] = build_store(name, source, tokenizer, cache)
            except CorpusError as e:
                raise ConfigError(f"pretrain.sources.{name}: {e}") from None
            s = self.stores[name]
            print(f"data {name}: {s.num_docs} documents, {s.num_tokens:,} tokens, "
                  f"{s.manifest['neutralized_control_strings']} control-token strings neutralised ({s.path}) "
                  f"[{time.perf_counter() - started:.1f} s]", flush=True)
        pre = self.cfg.pretrain
        if pre.heldout_docs:
            name = pre.heldout_source or max(self.stores, key=lambda n: max(self.stores[n].doc_lengths))
            self.heldout = {name: self.stores[name].split_heldout(pre.heldout_docs, self.cfg.run.seed)}

    def heldout_docs(self):
        from k3rl.rl.pretrain.token_cache import heldout_documents

        return [d for name, ids in self.heldout.items() for d in heldout_documents(self.stores[name], ids)]

    def make_learner(self, index: int, model_path: Path):
        from k3rl.rl.train.group import Learner, LearnerGroup

        lcfg = st.learner_config(self.cfg, index, model_path, self.model_config)
        ranks = self.cfg.learner.num_ranks
        if ranks == 1:
            import torch

            torch.manual_seed(self.cfg.run.seed + index)
            return Learner(lcfg)
        import ray

        from k3rl.rl.orchestrator.cluster import init_ray

        self.owns_ray = self.owns_ray or not ray.is_initialized()
        init_ray(self.cfg.ray)
        return LearnerGroup(lcfg, num_ranks=ranks)

    def stage_learner(self, index: int, previous: Optional[Path], latest: Optional[Path]) -> tuple[Any, int]:
        """(learner, first step) of stage `index`: resumed from its own newest checkpoint `latest`, or handed the
        previous stage's final checkpoint — its weights always, its optimizer moments when the stage says
        `optimizer: keep` (the stage's own learning rate, schedule, RoPE base and step 0 either way)."""
        learner = self.make_learner(index, Path(latest) if latest else previous or self.start_model())
        if latest is not None:
            from k3rl.rl import checkpoint as ckpt

            learner.load(latest)
            # the checkpoint's step, not the learner's version: a skipped step (non-finite loss) took a batch of
            # data without an update, so the version can lag the steps the checkpoint covers
            step = int(json.loads((Path(latest) / ckpt.COMPLETE).read_text())["step"])
            print(f"{st.stage_dir(self.run_dir, index, self.cfg.pretrain.stages[index]).name}: resuming at step "
                  f"{step} from {latest}", flush=True)
            return learner, step
        if previous is not None and str(self.cfg.pretrain.stages[index].optimizer) == "keep":
            learner.load_optimizer(previous)
        return learner, 0

    def run_stage(self, index: int, previous: Optional[Path]) -> Path:
        """Train stage `index` to its final checkpoint (resuming it when it has checkpoints); returns `final/`."""
        from k3rl.rl import checkpoint as ckpt
        from k3rl.rl.log_sinks import open_sinks
        from k3rl.rl.metrics import MetricsLogger, null_nonfinite, read_metrics
        from k3rl.rl.pretrain import retrieval_score as rs
        from k3rl.rl.pretrain.climb_report import bucket_name, plot_stage_loss, position_loss
        from k3rl.rl.pretrain.packing import PackedRows

        cfg, pre = self.cfg, self.cfg.pretrain
        stage = pre.stages[index]
        sdir = st.stage_dir(self.run_dir, index, stage)
        final = sdir / "final"
        steps, rows = num_steps(stage), rows_per_step(stage)
        manager = ckpt.CheckpointManager(sdir / "checkpoints", keep=pre.keep_checkpoints)
        latest = manager.latest()
        learner, start = self.stage_learner(index, previous, latest)
        theta = learner.cfg.rope_theta
        print(f"{sdir.name}: {steps} steps × {rows} rows of {stage.seq_len} tokens, "
              f"lr {stage.learner.lr:g} ({stage.learner.lr_scheduler}), "
              f"segments {learner.cfg.segment_tokens or 'off'}, "
              f"{'RoPE base ' + format(theta, 'g') if theta else 'positions unchanged (NoPE/KDA)'}, optimizer "
              f"{'fresh' if previous is None else stage.optimizer} — from {latest or previous or 'random init'}",
              flush=True)
        weights = st.mixture(stage, self.stores, {n: s.num_tokens for n, s in self.stores.items()})
        data = PackedRows({n: self.stores[n] for n in weights}, weights, stage.seq_len, cfg.run.seed, index,
                          exclude={n: ids for n, ids in self.heldout.items() if n in weights})
        heldout_file = sdir / "heldout.json"
        heldout = json.loads(heldout_file.read_text()) if heldout_file.is_file() else {}
        docs = self.heldout_docs()

        retrieval_file = sdir / "retrieval.json"
        retrieval = json.loads(retrieval_file.read_text()) if retrieval_file.is_file() else {}

        def measure(label: str, step: int) -> dict[str, Any]:
            curve = position_loss(learner.score, docs, stage.seq_len) if docs else {}
            if curve:
                heldout[label] = {**curve, "step": step}
                heldout_file.write_text(json.dumps(heldout, indent=1))
                print(f"{sdir.name} held-out loss by position at step {step}: " + ", ".join(
                    f"{bucket_name(*b)} {v:.3f}" for b, v in zip(curve["buckets"], curve["nll"])), flush=True)
            out = {f"heldout/nll_{bucket_name(*b)}": v for b, v in zip(curve.get("buckets", []), curve.get("nll", []))}
            if pre.retrieval_score.enabled and label in ("start", "end"):
                score = rs.stage_score(cfg, stage, learner.score, self.tokenizer)
                retrieval[label] = {**score, "step": step}
                retrieval_file.write_text(json.dumps(null_nonfinite(retrieval), indent=1, allow_nan=False))
                print(rs.format_table(score, f"{sdir.name} retrieval at step {step}"), flush=True)
                out.update(rs.scalars(score))
            return out

        sdir.mkdir(parents=True, exist_ok=True)
        # rows after the step the stage (re)starts from belong to a run that died: cut them (one row per step)
        logger = MetricsLogger(sdir, total_steps=steps, resume_step=start, label=sdir.name, headline=PRETRAIN_HEADLINE,
                               sinks=open_sinks(cfg, sdir, start))
        try:
            if "start" not in heldout and start == 0:
                logger.log(0, measure("start", 0))
            for step in range(start, steps):
                batch = [r.trajectory() for r in data.batch(step, rows)]
                metrics = learner.train_step(batch)
                scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "skip_reason"}
                if step + 1 == steps:  # the end measurement joins the last step's row (measured again on a resume)
                    scalars.update(measure("end", steps))
                elif pre.heldout_every and (step + 1) % pre.heldout_every == 0:
                    scalars.update(measure(f"step{step + 1}", step + 1))
                if (step + 1) % pre.log_every == 0 or step + 1 == steps:
                    logger.log(step + 1, scalars, {"data": data.digest(step, rows), "stage": sdir.name,
                                                   "skip_reason": metrics.get("skip_reason", "")})
                if (step + 1) % pre.save_every == 0 and step + 1 < steps:
                    with manager.begin(step + 1) as tmp:
                        learner.save_into(tmp)
            with ckpt.atomic_dir(final, step=steps) as tmp:
                learner.save_into(tmp)
            plot_stage_loss(read_metrics(sdir), sdir / "loss.png", f"{sdir.name}: {stage.seq_len} tokens per row")
            logger.images([sdir / "loss.png"], steps)
        finally:
            logger.close()
        if hasattr(learner, "shutdown"):
            learner.shutdown()
        return final

    def eval_stage(self, index: int, final: Path) -> Optional[Path]:
        """`k3rl eval`'s retrieval grid on the stage's final model, lengths up to the stage's (resumable)."""
        if not self.cfg.pretrain.eval_grid:
            return None
        from k3rl.rl.eval.grid import eval_model_grid

        stage = self.cfg.pretrain.stages[index]
        sdir = st.stage_dir(self.run_dir, index, stage)
        lengths = st.eval_lengths(self.cfg, stage)
        # room for the answer turns after the longest prompt (a RoPE or NoPE model runs past its trained positions)
        room = max(lengths) + int(self.cfg.rollout.max_new_tokens) * int(self.cfg.rollout.max_turns) + 1024
        positions = max(room, int(self.model_config.max_position_embeddings))
        return eval_model_grid(self.cfg, final, sdir / "eval", lengths, max_context_tokens=room,
                               max_position_embeddings=positions, engine="torch")

    def run(self) -> Path:
        """The whole climb (or what is left of it)."""
        from k3rl.model.tokenizer import load_tokenizer
        from k3rl.rl.config import to_yaml

        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(self.cfg))
        (self.run_dir / CLIMB_FILE).write_text(json.dumps(self.identity, indent=1, default=str))
        self._write_plan()
        started = time.perf_counter()
        tokenizer = load_tokenizer(self.start_model(), trust_remote_code=bool(self.cfg.run.trust_remote_code))
        self.tokenizer = tokenizer
        self.load_data(tokenizer)
        previous: Optional[Path] = None
        for index, stage in enumerate(self.cfg.pretrain.stages):
            sdir = st.stage_dir(self.run_dir, index, stage)
            final = sdir / "final"
            if _complete(final):
                print(f"{sdir.name}: finished earlier ({final})", flush=True)
            else:
                final = self.run_stage(index, previous)
            grid = self.eval_stage(index, final)
            self.summary.append(self._stage_summary(index, sdir, grid))
            self._report(sdir)
            previous = final
        print(f"k3rl pretrain: {len(self.cfg.pretrain.stages)} stages in {time.perf_counter() - started:.0f} s; "
              f"wrote {self.run_dir}", flush=True)
        if self.owns_ray:
            import ray

            ray.shutdown()
        return previous

    def _stage_summary(self, index: int, sdir: Path, grid: Optional[Path]) -> dict:
        """A stage's numbers from its files (so a stage finished by an earlier, crashed run counts the same)."""
        from k3rl.rl.metrics import read_metrics
        from k3rl.rl.pretrain.climb_report import grid_scores
        from k3rl.rl.pretrain.retrieval_score import summary

        rows = [r for r in read_metrics(sdir) if "loss" in r and not r.get("skipped")]
        heldout = json.loads((sdir / "heldout.json").read_text()) if (sdir / "heldout.json").is_file() else {}
        retrieval = json.loads((sdir / "retrieval.json").read_text()) if (sdir / "retrieval.json").is_file() else {}
        out = {"name": sdir.name, "seq_len": int(self.cfg.pretrain.stages[index].seq_len), "steps": len(rows),
               "loss_first": rows[0]["loss"] if rows else None, "loss_last": rows[-1]["loss"] if rows else None,
               "tokens_per_s": sum(r["num_tokens"] for r in rows) / max(1e-9, sum(r["step_time_s"] for r in rows)),
               "heldout_start": heldout.get("start"), "heldout_end": heldout.get("end"),
               "retrieval_start": summary(retrieval["start"]) if "start" in retrieval else None,
               "retrieval_end": summary(retrieval["end"]) if "end" in retrieval else None,
               "train_seconds": sum(r["step_time_s"] for r in rows),
               "wall_seconds": (rows[-1]["time"] - rows[0]["time"] + rows[0]["step_time_s"]) if rows else 0.0}
        if grid is not None and (grid / "results.json").is_file():
            out["grid"] = grid_scores(grid / "results.json")
            out["grid_oracle"] = grid_scores(grid / "results.json", "oracle")
        return out

    def _report(self, sdir: Path) -> None:
        from k3rl.rl.metrics import null_nonfinite
        from k3rl.rl.pretrain.climb_report import plot_position_loss, plot_retrieval_gain, plot_score_by_length

        # an all-error grid cell scores NaN in memory (the plots skip it) and null in the file
        (self.run_dir / "summary.json").write_text(json.dumps(null_nonfinite(self.summary), indent=1,
                                                              allow_nan=False))
        plot_score_by_length(self.summary[-1:], sdir / "score_by_length.png")
        plot_position_loss(self.summary, self.run_dir / "position_loss.png")
        plot_score_by_length(self.summary, self.run_dir / "score_by_length.png")
        plot_retrieval_gain(self.summary, self.run_dir / "retrieval_gain.png")

    def _write_plan(self) -> None:
        """`--plan`'s table for this run, beside its results (what was predicted vs what was measured)."""
        from k3rl.rl.pretrain.plan import plan_from_job

        text, _ = plan_from_job(self.cfg)
        (self.run_dir / "plan.txt").write_text(text)


def _complete(path: Path) -> bool:
    from k3rl.rl import checkpoint as ckpt

    try:
        ckpt.verify(path)
        return True
    except ckpt.CheckpointError:
        return False


__all__ = ["CLIMB_FILE", "Climb", "check", "climb_identity", "model_config", "sources_of"]
