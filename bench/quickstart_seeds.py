"""How often does the main job learn? `k3rl quickstart` for K seeds and CPU code paths, one row per run.

    python bench/quickstart_seeds.py                         # seeds 0–4 on the native code path
    python bench/quickstart_seeds.py --seeds 0 1 2 --path generic
    python bench/quickstart_seeds.py --seeds 0 --path native avx2 generic -- rl.steps=10

A seed changes the initial weights, the SFT data order and teacher draw, and the sampling; the
held-out tasks stay the same (`eval.seed`). A code path changes the floating-point rounding of
the CPU kernels, which a tiny model trained at a high learning rate can amplify into a different
outcome (issue 11):

- `native`: nothing forced (torch, MKL and oneDNN pick the best path of the machine: AVX-512 where
  the CPU has it, else AVX2);
- `avx2`: `ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 DNNL_MAX_CPU_ISA=AVX2`, what an
  AVX-512 machine does to run like an AVX2-only one (a no-op on an AVX2-only machine);
- `generic`: `ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE`, torch's non-vectorised kernels and
  MKL's conditional-numerical-reproducibility path: a different rounding on any x86 machine.

Which of these switches take effect was checked by hashing the bits of a matmul, a softmax and a
layer norm under each (`--check-paths` prints that table): on torch 2.13.0 (MKL 2024.2, oneDNN
3.12) `ATEN_CPU_CAPABILITY` changes all of them, `MKL_CBWR=COMPATIBLE` changes the matmul, while
`MKL_ENABLE_INSTRUCTIONS` and `DNNL_MAX_CPU_ISA` changed nothing on an AVX2-only EPYC.

Each run is a subprocess of its own (`python -m rl.commands.quickstart run.seed=S …`, its own local Ray
cluster), one after the other so the timings are comparable; rows print as they finish, then a
Markdown table and the share of runs that improved held-out success beyond the interval.
Everything lands in `--out` (default `bench/out/quickstart_seeds/`): each run's directory, and
`seeds.json` / `seeds.md` with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PATHS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"},
}
SWITCH_VARS = sorted({k for env in PATHS.values() for k in env})

_BITS = """
import hashlib, torch
torch.manual_seed(0)
a, b, x = torch.randn(64, 1000), torch.randn(1000, 96), torch.randn(16, 4096)
outs = {"matmul": a @ b, "softmax": torch.softmax(x, -1), "layer_norm": torch.nn.functional.layer_norm(x, (4096,))}
print(torch.backends.cpu.get_cpu_capability(), *(hashlib.md5(v.numpy().tobytes()).hexdigest()[:8] for v in outs.values()))
"""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                return line.split(":", 1)[1].strip() + (" (AVX-512)" if "avx512f" in flags else " (AVX2, no AVX-512)")
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def path_env(path: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SWITCH_VARS}
    env.update(PATHS[path])
    return env


def check_paths() -> list[str]:
    """One line per code path: the capability torch reports and the bit hashes of three ops."""
    lines = ["| path | torch capability | matmul | softmax | layer_norm |", "|---|---|---|---|---|"]
    for name in PATHS:
        out = subprocess.run([sys.executable, "-c", _BITS], env=path_env(name), capture_output=True, text=True,
                             check=True).stdout.split()
        lines.append(f"| {name} | " + " | ".join(out) + " |")
    return lines


def run_one(seed: int, path: str, out: Path, overrides: list[str], timeout: float) -> dict:
    name = f"seed{seed}-{path}"
    run_dir = out / name
    cmd = [sys.executable, "-m", "k3rl.rl.commands.quickstart", f"run.seed={seed}", f"run.output_dir={out}", f"run.name={name}",
           *overrides]
    log = out / f"{name}.log"
    started = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=path_env(path), stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.perf_counter() - started
    row = {"seed": seed, "path": path, "run_dir": str(run_dir), "log": str(log), "wall_s": seconds, "rc": rc}
    report = run_dir / "report.json"
    if rc == 0 and report.is_file():
        r = json.loads(report.read_text())
        row.update(before=r["before"]["successes"], after=r["after"]["successes"], tasks=r["after"]["tasks"],
                   difference=r["difference"], difference_ci95=r["difference_ci95"],
                   improved=bool(r["improved_beyond_ci"]), f1_before=r["before"].get("f1"),
                   f1_after=r["after"].get("f1"), collapses=len(r.get("collapses", [])),
                   hedged_before=r["before"].get("behaviour", {}).get("hedged"),
                   hedged_after=r["after"].get("behaviour", {}).get("hedged"),
                   gold_before=r["before"].get("behaviour", {}).get("contains_gold"),
                   gold_after=r["after"].get("behaviour", {}).get("contains_gold"))
    else:
        row["improved"] = False
    return row


def row_line(r: dict) -> str:
    if "before" not in r:
        return f"| {r['seed']} | {r['path']} | failed (rc {r['rc']}, see {r['log']}) |{' |' * 6} {r['wall_s']:.0f} |"
    lo, hi = r["difference_ci95"]
    f1 = f"{r['f1_before']:.2f} → {r['f1_after']:.2f}" if r.get("f1_before") is not None else "—"
    def shares(key: str) -> str:
        b, a = r.get(f"{key}_before"), r.get(f"{key}_after")
        return f"{100 * b:.0f}% → {100 * a:.0f}%" if b is not None and a is not None else "—"

    return (f"| {r['seed']} | {r['path']} | {r['before']}/{r['tasks']} | {r['after']}/{r['tasks']} | "
            f"{r['difference']:+.2f} [{lo:+.2f}, {hi:+.2f}] | {'yes' if r['improved'] else '**no**'} | {f1} | "
            f"{shares('hedged')} | {shares('gold')} | {r['wall_s']:.0f} |")


HEADER = ["| seed | code path | before RL | after RL | difference [95% CI] | beyond CI | F1 | hedged | right colour "
          "in the answer | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--path", nargs="+", choices=sorted(PATHS), default=["native"],
                        help="CPU code paths, each run for every seed")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "quickstart_seeds")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--check-paths", action="store_true", help="only print which switches change the bits")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run (after --)")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_name()}; {os.cpu_count()} cores; python {platform.python_version()}", flush=True)
    print("\n".join(check_paths()), flush=True)
    if args.check_paths:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    print("\n".join(HEADER), flush=True)
    for path in args.path:
        for seed in args.seeds:
            rows.append(run_one(seed, path, args.out, args.overrides, args.timeout))
            print(row_line(rows[-1]), flush=True)
    improved = sum(r["improved"] for r in rows)
    slowest = max(r["wall_s"] for r in rows)
    summary = (f"{improved}/{len(rows)} runs improved held-out success beyond the 95% interval; "
               f"slowest run {slowest:.0f} s ({cpu_name()})")
    table = "\n".join([*HEADER, *map(row_line, rows), "", summary])
    (args.out / "seeds.md").write_text(table + "\n")
    (args.out / "seeds.json").write_text(json.dumps({"cpu": cpu_name(), "overrides": args.overrides, "rows": rows},
                                                    indent=1))
    print("\n" + table, flush=True)
    return 0 if improved == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
