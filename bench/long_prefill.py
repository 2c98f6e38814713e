"""Prefill of one long prompt on the native engine's path (model/policy.py `Policy.prefill`): segmented
(`segment_tokens`, MLA attending its cached latents by query block) vs in one piece, wall time and peak
resident memory, each measurement in a fresh process so the peaks do not mix.

Models (random weights: the cost does not depend on them): the quickstart's tiny hybrid
(configs/rl/quickstart.yaml: 3 KDA + 1 gated MLA) and, with `--kda-only`, the same model with every layer
KDA (its state is constant in length; the hybrid's MLA layer is quadratic in time, so 1M tokens of the hybrid
on two CPU cores takes hours — a GPU measurement). `max_position_embeddings` is raised to the length
(the tiny model's MLA is NoPE: positions are not used).

    python bench/long_prefill.py                          # hybrid: 4K..64K segmented, one piece up to 16K
    python bench/long_prefill.py --lengths 262144         # hybrid at 256K (~1 h on two cores)
    python bench/long_prefill.py --kda-only --lengths 262144 1048576 --no-one-piece
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tiny_config(length: int, kda_only: bool):
    """The quickstart's tiny hybrid (or every layer KDA) with positions up to `length` (its MLA is NoPE)."""
    from k3rl.rl.config import load_model_config

    config = load_model_config(ROOT / "configs/rl/quickstart.yaml")
    values = config.model_config_dict()
    values["max_position_embeddings"] = max(values["max_position_embeddings"], length + 1)
    if kda_only:
        n = values["num_hidden_layers"]
        values["linear_attn_config"] |= {"kda_layers": list(range(1, n + 1)), "full_attn_layers": []}
    return type(config)(**values)


def run_json_child(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run one measurement in a fresh process (so peak memory does not mix), `env` added to its environment; its
    last stdout line is JSON."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {out.returncode}: {tail[:80]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(length: int, segment: int | None, kda_only: bool, batch: int) -> dict:
    """One prefill in this process: seconds and peak RSS (GiB)."""
    import torch

    from k3rl.model.modeling import K3ForCausalLM
    from k3rl.model.policy import Policy

    config = tiny_config(length, kda_only)
    torch.manual_seed(0)
    model = K3ForCausalLM(config).eval()
    ids = torch.randint(3, config.vocab_size, (batch, length))
    mask = torch.ones_like(ids)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    started = time.perf_counter()
    with torch.no_grad():
        logits, state = Policy(model).prefill(ids, mask, capacity=length + 1, segment_tokens=segment)
    seconds = time.perf_counter() - started
    assert bool(torch.isfinite(logits).all())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"seconds": seconds, "peak_gib": peak, "before_gib": base, "cache_gib": state["cache"].nbytes() / 2**30}


def run_child(length: int, segment: int | None, kda_only: bool, batch: int, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", str(length), str(segment or 0), str(int(kda_only)), str(batch)]
    return run_json_child(cmd, timeout)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        length, segment, kda_only, batch = (int(a) for a in sys.argv[2:6])
        print(json.dumps(measure(length, segment or None, bool(kda_only), batch)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--segment", type=int, default=2048, help="segment_tokens of the segmented prefill")
    ap.add_argument("--kda-only", action="store_true", help="every layer KDA (constant state)")
    ap.add_argument("--one-piece-max", type=int, default=16384, help="longest length also prefilled in one piece")
    ap.add_argument("--no-one-piece", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=4 * 3600)
    args = ap.parse_args()
    model = "tiny KDA-only (4 KDA)" if args.kda_only else "tiny hybrid (3 KDA + 1 MLA)"
    print(f"prefill of one random prompt, {model}, batch {args.batch}, fp32, "
          f"segment {args.segment} tokens; peak = max resident set of a fresh process", flush=True)
    print("| tokens | path | s | tokens/s | peak RSS GiB | of which cache GiB | vs one piece (time, peak) |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for length in args.lengths:
        seg = run_child(length, args.segment, args.kda_only, args.batch, args.timeout)
        one = None
        if not args.no_one_piece and length <= args.one_piece_max:
            one = run_child(length, None, args.kda_only, args.batch, args.timeout)
        for name, r in (("segmented", seg), ("one piece", one)):
            if r is None:
                continue
            if "error" in r:
                print(f"| {length:,} | {name} | {r['error']} | | | | |", flush=True)
                continue
            ratio = ""
            if name == "segmented" and one and "error" not in one:
                ratio = f"{r['seconds'] / one['seconds']:.2f}×, {r['peak_gib'] / one['peak_gib']:.2f}×"
            print(f"| {length:,} | {name} | {r['seconds']:.1f} | {args.batch * length / r['seconds']:,.0f} | "
                  f"{r['peak_gib']:.2f} | {r['cache_gib']:.3f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
