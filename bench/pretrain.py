"""The pretraining step at each stage length of the context climb: tokens/s, s/step and peak resident memory of the
learner's `train_step` (rl/train/learner.py, objective `nll`) on real packed rows, segmented vs unsegmented where both
fit, each measurement in a fresh process so the peaks do not mix.

For every stage of the climb config (default configs/pretrain/cpu.yaml: the tiny K3 with RoPE on its MLA layers,
512 → 2K → 8K → 32K): the random model of the config's `model:` section (built once, seed 0), the stage's learner
(`rl.pretrain.stages.learner_config`: its rate, schedule, RoPE base) and the stage's packed rows (rl/pretrain/packing.py
`PackedRows` of the stage's length and mixture, seed 0, held-out documents excluded — what `k3rl pretrain` trains
on). One measured step holds the stage's rows per optimizer step, capped at `--tokens-per-step` tokens (at least
one row); 1 warm-up step, then `--steps` timed steps (rows of the next steps); the table gives the median.

Variants per length:
- unsegmented: `segment_tokens: null`: every row in one forward/backward, its documents block-diagonal (KDA
  restarts its state at each document, MLA attends under a block-diagonal causal mask); run up to
  `--max-unsegmented` tokens (MLA's T² mask and scores make 32K very slow on two cores);
- segmented: the stage's `segment_tokens` (or `--segment`), only where the length is above it: a packed row is cut
  into its documents, short ones packed again up to a segment, long ones run segment by segment (rl/train/segments.py:
  a no-grad pass, then the segments' backward with recomputation);
- `--packed-vs-plain LEN` (default 2048, unsegmented): the same rows as packed (position_ids restart at each
  document) vs plain (the same tokens and loss mask, position_ids=None: one causal sequence per row, plain causal
  attention, no state restarts) — the cost of respecting document boundaries.

    python bench/pretrain.py                                  # cpu.yaml: 512, 2K, 8K (both), 32K (segmented)
    python bench/pretrain.py --max-unsegmented 32768          # 32K unsegmented too (slow on two cores)
    python bench/pretrain.py --lengths 8192 --steps 4 --packed-vs-plain 0     # one length, more steps

Reading the ratio column: segmented ÷ unsegmented tokens/s at the same length, both measured in this run on the
same rows; above 1 the segmented step is faster (at long lengths MLA's T² attention over the whole row costs more
than the segments' recomputation), below 1 the segments' extra pass costs more than it saves. On the plain row it
is plain ÷ packed: how much the document boundaries cost. Writes bench/out/pretrain.json and bench/out/pretrain.png.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from long_prefill import run_json_child  # noqa: E402  (bench/, this script's directory)

SEED = 0


def load(config: str):
    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.pretrain.climb import model_config

    cfg = load_config(config, [], JobConfig)
    return cfg, model_config(cfg)


def stores_of(cfg, tokenizer) -> dict:
    """Every source's token cache (built now if missing: the children then only open it)."""
    from k3rl.envs.sources import data_dir
    from k3rl.rl.pretrain.climb import sources_of
    from k3rl.rl.pretrain.token_cache import build_store

    return {name: build_store(name, src, tokenizer, data_dir() / "pretrain") for name, src in sources_of(cfg).items()}


def packed_rows(cfg, stores: dict, index: int, seq_len: int):
    """The driver's rows of stage `index` (rl/pretrain/climb.py `Climb.run_stage`), at `seq_len` tokens, seed 0."""
    from k3rl.rl.pretrain import stages as st
    from k3rl.rl.pretrain.packing import PackedRows

    pre = cfg.pretrain
    heldout = {}
    if pre.heldout_docs:
        name = pre.heldout_source or max(stores, key=lambda n: max(stores[n].doc_lengths))
        heldout = {name: stores[name].split_heldout(pre.heldout_docs, SEED)}
    weights = st.mixture(pre.stages[index], stores, {n: s.num_tokens for n, s in stores.items()})
    return PackedRows({n: stores[n] for n in weights}, weights, seq_len, SEED, index,
                      exclude={n: ids for n, ids in heldout.items() if n in weights})


def measure(spec: dict) -> dict:
    """Warm-up + timed `train_step`s of one (length, variant) in this process."""
    import dataclasses

    import numpy as np
    import torch
    from transformers import AutoTokenizer

    import k3rl.model.modeling  # noqa: F401  (registers the K3 model type: the tokenizer's AutoConfig needs it)
    from k3rl.rl.pretrain import stages as st
    from k3rl.rl.train.learner import Learner

    cfg, config = load(spec["config"])
    stores = stores_of(cfg, AutoTokenizer.from_pretrained(spec["model_dir"]))
    data = packed_rows(cfg, stores, spec["stage"], spec["seq_len"])
    lcfg = st.learner_config(cfg, spec["stage"], spec["model_dir"], config)
    lcfg = dataclasses.replace(lcfg, segment_tokens=spec["segment"], seed=SEED)
    torch.manual_seed(SEED)
    learner = Learner(lcfg)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    rows = spec["rows"]
    runs, docs = [], []
    for step in range(1 + spec["steps"]):
        batch = data.batch(step, rows)
        if step:
            docs += [int((r.position_ids[:-1] == 0).sum()) for r in batch]  # document starts among the inputs
        trajs = [r.trajectory() for r in batch]
        if spec["plain"]:
            trajs = [dataclasses.replace(t, position_ids=None) for t in trajs]
        m = learner.train_step(trajs)
        if step:  # the first is the warm-up
            runs.append(m)
    tps = [m["num_tokens"] / m["step_time_s"] for m in runs]
    losses = [m.get("loss", float("nan")) for m in runs]
    return {"tokens_per_s": statistics.median(tps), "s_per_step": statistics.median(m["step_time_s"] for m in runs),
            "tokens_per_s_all": tps, "num_tokens": runs[0]["num_tokens"], "micro_batches": runs[0]["micro_batches"],
            "loss": losses, "finite": all(np.isfinite(losses)) and not any(m["skipped"] for m in runs),
            "docs_per_row": float(np.mean(docs)), "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / 2**20, "rss_after_load_gib": before, "rope_theta": lcfg.rope_theta,
            "threads": torch.get_num_threads()}


def run_child(spec: dict, timeout: float) -> dict:
    return run_json_child([sys.executable, __file__, "--child", json.dumps(spec)], timeout)


def plan(cfg, args) -> list[dict]:
    """Every measurement of the run, in order: per stage its variants, then the packed-vs-plain pair."""
    from k3rl.rl.config.pretrain import rows_per_step

    out = []
    for i, stage in enumerate(cfg.pretrain.stages):
        n = int(stage.seq_len)
        rows = max(1, min(rows_per_step(stage), args.tokens_per_step // n))
        seg = stage.learner.segment_tokens if stage.learner.segment_tokens is not None else cfg.learner.segment_tokens
        seg = int(seg or args.segment)
        base = {"stage": i, "seq_len": n, "rows": rows, "plain": False}
        out.append({**base, "variant": "unsegmented", "segment": None,
                    "skip": None if n <= args.max_unsegmented else "skipped (--max-unsegmented)"})
        if n > seg:
            out.append({**base, "variant": "segmented", "segment": seg, "skip": None})
    if args.packed_vs_plain:
        n = args.packed_vs_plain
        lengths = [int(s.seq_len) for s in cfg.pretrain.stages]
        # the stage of that length (its mixture), or the longest one below it (the first when none is)
        i = lengths.index(n) if n in lengths else max([k for k, m in enumerate(lengths) if m <= n] or [0])
        base = {"stage": i, "seq_len": n, "rows": max(1, args.tokens_per_step // n), "segment": None, "skip": None}
        out += [{**base, "variant": "packed", "plain": False}, {**base, "variant": "plain", "plain": True}]
    return out


def fmt_row(r: dict, ratio: str) -> str:
    shape = f"{r['rows']}×{r['seq_len']:,}"
    if r.get("skip") or "error" in r:
        return f"| {r['seq_len']:,} | {r['variant']} | {shape} | {r.get('skip') or r['error']} | | | | | |"
    loss = "/".join(f"{x:.2f}" for x in r["loss"]) + ("" if r["finite"] else " NON-FINITE")
    return (f"| {r['seq_len']:,} | {r['variant']} | {shape} | {r['tokens_per_s']:,.0f} | {r['s_per_step']:.2f} | "
            f"{r['peak_rss_gib']:.2f} | {ratio} | {r['docs_per_row']:.1f} | {loss} |")


def ratio_of(r: dict, results: list[dict]) -> str:
    """segmented ÷ unsegmented (same length), plain ÷ packed; from this run only."""
    want = {"segmented": "unsegmented", "plain": "packed"}.get(r["variant"])
    if want is None or "tokens_per_s" not in r:
        return ""
    base = [b for b in results if b["variant"] == want and b["seq_len"] == r["seq_len"] and "tokens_per_s" in b]
    if not base:
        return ""
    label = "" if r["variant"] == "segmented" else "plain ÷ packed "
    return f"{label}{r['tokens_per_s'] / base[0]['tokens_per_s']:.2f}×"


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for variant, style in (("unsegmented", "o-"), ("segmented", "s-"), ("packed", "^"), ("plain", "v")):
        pts = [(r["seq_len"], r["tokens_per_s"]) for r in results if r["variant"] == variant and "tokens_per_s" in r]
        if pts:
            label = variant if variant not in ("packed", "plain") else f"{variant} (packed-vs-plain)"
            ax.plot(*zip(*pts), style, label=label, markersize=6 if variant in ("packed", "plain") else 4)
    if not ax.lines:
        plt.close(fig)
        return
    from k3rl.rl.pretrain.stages import human_tokens

    lengths = sorted({r["seq_len"] for r in results if "tokens_per_s" in r})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [human_tokens(n) for n in lengths])
    ax.set_xlim(min(lengths) / 1.5, max(lengths) * 1.5)
    ax.set_xlabel("tokens per row (stage length)")
    ax.set_ylabel("tokens / s (median step)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        print(json.dumps(measure(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/pretrain/cpu.yaml"), help="a `k3rl pretrain` config")
    ap.add_argument("--tokens-per-step", type=int, default=16384, help="cap on the tokens of one measured step "
                    "(the stage's rows per step, at most this many tokens, at least one row)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--segment", type=int, default=2048, help="segment_tokens where the stage and learner give none")
    ap.add_argument("--max-unsegmented", type=int, default=8192, help="longest length also run unsegmented")
    ap.add_argument("--packed-vs-plain", type=int, default=2048, help="length of the packed-vs-plain pair (0: none)")
    ap.add_argument("--lengths", type=int, nargs="+", help="only these stage lengths (and the pair's)")
    ap.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per measurement")
    ap.add_argument("--out", default=str(ROOT / "bench/out"))
    args = ap.parse_args()
    started = time.perf_counter()
    cfg, config = load(args.config)
    todo = plan(cfg, args)
    if args.lengths:
        todo = [t for t in todo if t["seq_len"] in args.lengths or t["variant"] in ("packed", "plain")]
    with tempfile.TemporaryDirectory(prefix="bench-pretrain-") as tmp:
        if cfg.pretrain.model_dir is not None:
            model_dir = str(cfg.pretrain.model_dir)
        else:
            from k3rl.envs.registry import tokenizer_texts
            from k3rl.model.config import K3Config
            from k3rl.model.init import init_model

            model_dir = str(Path(tmp) / "init")
            init_model(K3Config.from_model_config(cfg.model), model_dir, seed=SEED, tokenizer_texts=tokenizer_texts())
        from transformers import AutoTokenizer

        stores = stores_of(cfg, AutoTokenizer.from_pretrained(model_dir))
        print(f"pretraining step of {args.config}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
              f"{'RoPE' if not getattr(config, 'mla_use_nope', True) else 'NoPE'} MLA, random weights (seed {SEED}); "
              f"real packed rows ({', '.join(f'{n}: {s.num_docs} docs' for n, s in stores.items())}); "
              f"≤ {args.tokens_per_step:,} tokens per step, 1 warm-up + {args.steps} timed steps (median), "
              f"dtype {cfg.learner.dtype}, micro_batch_tokens {cfg.learner.micro_batch_tokens}; each in a fresh "
              f"process, peak = its max RSS", flush=True)
        print("| length | variant | rows×len | tokens/s | s/step | peak RSS GiB | segmented ÷ unsegmented tokens/s "
              "| docs/row | loss |")
        print("|---|---|---|---|---|---|---|---|---|", flush=True)
        results = []
        for t in todo:
            r = dict(t)
            if not t["skip"]:
                t0 = time.perf_counter()
                r.update(run_child({"config": args.config, "model_dir": model_dir, **{k: t[k] for k in (
                    "stage", "seq_len", "rows", "segment", "plain")}, "steps": args.steps}, args.timeout))
                r["wall_s"] = time.perf_counter() - t0
            results.append(r)
            print(fmt_row(r, ratio_of(r, results)), flush=True)
    total = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{Path(args.config).name}: train_step tokens/s, ≤{args.tokens_per_step} tokens/step, {os.cpu_count()} CPUs"
    (out / "pretrain.json").write_text(json.dumps(
        {"config": args.config, "args": vars(args), "cpus": os.cpu_count(), "total_s": total,
         "results": [{**r, "ratio": ratio_of(r, results)} for r in results]}, indent=1))
    plot(results, out / "pretrain.png", title)
    print(f"total {total:.0f} s; wrote {out / 'pretrain.json'} and {out / 'pretrain.png'}", flush=True)
    bad = [r for r in results if "error" in r or ("finite" in r and not r["finite"])]
    if bad:
        sys.exit(f"{len(bad)} measurement(s) failed or gave a non-finite loss")


if __name__ == "__main__":
    main()
