"""KDA on a CUDA GPU: correctness first, then the time of the chunked op (training/prefill) and the decode step.

Paths compared, on the same inputs:
- torch: the PyTorch chunked path `kernels.kda.chunk.chunk_kda_torch` (the gate by `kda_gate` before it);
- ours: `kernels.kda.chunk_kda`, the dispatch entry point, which takes the Triton kernels
  (kernels/kda/chunk_triton.py) on CUDA tensors unless K3RL_DISABLE_TRITON=1; the gate fused (`FusedGate`);
- ours, bf16 dots: the same with K3RL_KDA_BWD_BF16_DOTS=1 (kernels/kda/chunk_bwd_inter.py `dot_args`), the
  backward's fast bf16-operand form, kept to time what the default fp32 operands cost;
- fla: flash-linear-attention's `fla.ops.kda.chunk_kda`, if importable, the gate fused in its kernel
  (`use_gate_in_kernel=True`; with the bound, `lower_bound=-5, safe_gate=True`), whichever of those arguments its
  version has (the gate is computed outside when it lacks them, and the table says so).
Decode step (T = 1, 64 sequences): our Triton `fused_recurrent_kda_triton` (returned state, and the engine's
in-place state pool) against the PyTorch `fused_recurrent_kda_torch` and, if present, fla's `fused_recurrent_kda`.

1. Check (B = 1, T = 1000, H = 4, d = 64; fp32 and bf16 inputs; both gate forms and a plain g tensor): each path's
   output and the gradients of q, k, v, g (or f, A_log, dt_bias), β against `chunk_kda_torch` in float64 on the same
   (rounded) inputs, q/k L2-normalised in the kernel as the K3 layer runs it. Relative errors
   ‖x − ref‖/‖ref‖ under: fp32 5e-3 (Triton's tl.dot on fp32 tiles may run in TF32, 2^-11), bf16 1e-2 for the
   output (rounded to bf16) and 2e-2 for gradients, 5× those for dA_log and d dt_bias (sums over every token of
   a head: cancellation). A path whose check fails (or raises) is not timed in that gate form.
2. Time (B = 1, T ∈ {4K, 32K, 128K}, and 8 × 4K; H = 16, d = 128, bf16; both gate forms): the forward under
   torch.no_grad() (prefill, old-logprob pass; fla may route it to FlashKDA) and forward + backward (autograd on,
   gradients of every input). CUDA events around each call, L2 flushed (a 256 MB write) before each, warm-up
   first, median of up to 50 calls (fewer for slow paths: ~2 s per case). A case that runs out of memory is
   reported as skipped with the reason.
3. Compare: speed-up = other path's ms ÷ this path's ms against fla (else against the PyTorch path), and the
   forward's distance to the memory-bound floor: the bytes the forward must move, q, k, v, g (or f) and o
   ([B, T, H, d] bf16 each) and β ([B, T, H] bf16), ≈ 1.3 KB per token per head (docs/performance.md's traffic
   floor), over the GPU's bandwidth: 4.3 TB/s on an H200, the measured figure issue 17's floor of 0.16–0.19 ms
   at T = 32K, H = 16 rests on (this count gives 0.156 ms), a spec-sheet figure for
   other known GPUs, else this run's measured copy bandwidth (printed either way). The decode floor is the fp32
   state read and written once (+ its inputs).

    python bench/kda_gpu.py                      # everything above (a few minutes on an H200)
    python bench/kda_gpu.py --quick              # check, then T = 4K and the decode step only
    python bench/kda_gpu.py --shapes 1x32768     # B×T list

    python bench/kda_gpu.py --smoke-cpu          # the whole flow at tiny shapes on the CPU (Triton interpreted):
                                                 # checks this script, its times mean nothing

Writes bench/out/kda_gpu.json and bench/out/kda_gpu.md (the tables). Without CUDA it says so and exits 0.
Exit status 1 if our kernels fail a check or `chunk_kda` cannot be imported (the rest still runs and is written).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import inspect
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SMOKE = "--smoke-cpu" in sys.argv
if SMOKE:
    # before anything imports triton: the kernels run on CPU tensors under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from k3rl.kernels.kda.chunk import chunk_kda_torch  # noqa: E402
from k3rl.kernels.kda.gate import FusedGate, kda_gate  # noqa: E402
from k3rl.kernels.kda.naive import naive_recurrent_kda  # noqa: E402
from k3rl.kernels.kda.recurrent import fused_recurrent_kda_torch  # noqa: E402

LOWER_BOUND = -5.0
GATES = {"lb": LOWER_BOUND, "softplus": None}  # the two fused forms; "tensor" (g given) is checked only
CHECK_SHAPE = dict(B=1, T=1000, H=4, D=64)
BENCH_H, BENCH_D = 16, 128
DEFAULT_SHAPES = "1x4096,1x32768,1x131072,8x4096"
DECODE = dict(B=64, H=16, D=128)
TOL = {torch.float32: dict(o=5e-3, grad=5e-3), torch.bfloat16: dict(o=1e-2, grad=2e-2)}
PARAM_GRAD_FACTOR = 5.0
PARAM_LEAVES = ("A_log", "dt_bias")
LEAVES = {"tensor": ("q", "k", "v", "g", "beta"), "fused": ("q", "k", "v", "f", "A_log", "dt_bias", "beta")}
# Memory bandwidth, bytes/s, by a substring of the device name. H200: the measured figure issue 17 uses;
# the rest are vendor spec sheets (the measured copy rate is printed beside them).
BANDWIDTH = [
    ("H200", 4.3e12, "measured figure of issue 17"),
    ("H100 PCIe", 2.0e12, "spec sheet"),
    ("H100", 3.35e12, "spec sheet (SXM)"),
    ("H800", 3.35e12, "spec sheet"),
    ("H20", 4.0e12, "spec sheet"),
    ("B200", 8.0e12, "spec sheet"),
    ("A100", 2.0e12, "spec sheet (80 GB SXM)"),
    ("L40S", 0.864e12, "spec sheet"),
    ("4090", 1.008e12, "spec sheet"),
]
TIME_BUDGET_S = 2.0
MAX_REPS = 50
DEVICE = "cuda"
DEFAULT_PATHS = "ours,ours_bf16dots,fla"  # `torch` is the float64 reference; as a timed path it is slow at 128K


# ---------------------------------------------------------------- inputs and paths


def make_inputs(B, T, H, D, dtype, seed, device=None):
    """K3-like KDA inputs: q, k, v, f ~ N(0, 1), β = σ(N(0, 1)); A_log = log U(1, 16) and dt_bias = softplus⁻¹(dt),
    dt log-uniform in [1e-3, 1e-1] (fla's initialisation, as bench/kda_cpu.py); g = the bounded gate, fp32."""
    device = device or DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    x = dict(q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, H, D), f=randn(B, T, H, D))
    x["beta"] = torch.sigmoid(randn(B, T, H, dt=torch.float32)).to(dtype)
    x["A_log"] = torch.empty(H, device=device).uniform_(1.0, 16.0, generator=gen).log()
    dt = torch.exp(torch.empty(H * D, device=device).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    x["dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # softplus⁻¹(dt), fp32
    x["g"] = kda_gate(x["f"], x["A_log"], x["dt_bias"], LOWER_BOUND)  # [B, T, H, D] fp32
    return x


def leaves_of(gate: str) -> tuple[str, ...]:
    return LEAVES["tensor" if gate == "tensor" else "fused"]


def torch_chunk(x, gate):
    g = x["g"] if gate == "tensor" else kda_gate(x["f"], x["A_log"], x["dt_bias"], GATES[gate])
    return chunk_kda_torch(x["q"], x["k"], x["v"], g, x["beta"], use_qk_l2norm_in_kernel=True)[0]


def make_ours_chunk(chunk_kda):
    def run(x, gate):
        g = x["g"] if gate == "tensor" else FusedGate(x["f"], x["A_log"], x["dt_bias"], GATES[gate])
        return chunk_kda(x["q"], x["k"], x["v"], g, x["beta"], use_qk_l2norm_in_kernel=True)[0]
    return run


def make_fla_chunk(fla_chunk):
    """An adapter over fla's chunk_kda that uses its fused gate when its version has the arguments; returns
    (run, note)."""
    params = inspect.signature(fla_chunk).parameters
    fused = "use_gate_in_kernel" in params
    has_lb = "lower_bound" in params
    notes = []
    if not fused:
        notes.append("gate outside (no use_gate_in_kernel)")
    elif not has_lb:
        notes.append("bounded gate outside (no lower_bound)")

    def run(x, gate):
        kw = dict(use_qk_l2norm_in_kernel=True)
        lb = GATES.get(gate)
        if gate == "tensor" or not fused or (lb is not None and not has_lb):
            g = x["g"] if gate == "tensor" else kda_gate(x["f"], x["A_log"], x["dt_bias"], lb)
            out = fla_chunk(x["q"], x["k"], x["v"], g, x["beta"], **kw)
        else:
            kw.update(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
            if lb is not None:
                kw["lower_bound"] = lb
                if "safe_gate" in params:
                    kw["safe_gate"] = True
            out = fla_chunk(x["q"], x["k"], x["v"], x["f"], x["beta"], **kw)
        return out[0] if isinstance(out, (tuple, list)) else out
    return run, "; ".join(notes)


def load_ours():
    try:
        from k3rl.kernels.kda import chunk_kda
    except ImportError as e:
        return None, f"kernels.kda.chunk_kda is not importable ({e})"
    if DEVICE == "cuda":
        # chunk_kda imports its Triton module at the first CUDA call; find out now whether it is there
        try:
            import k3rl.kernels.kda.chunk_triton  # noqa: F401
        except ImportError as e:
            present = (ROOT / "kernels/kda/chunk_triton.py").exists()
            return None, f"kernels/kda/chunk_triton.py {'fails to import' if present else 'is missing'} ({e})"
    if os.environ.get("K3RL_DISABLE_TRITON") == "1":
        print("WARNING: K3RL_DISABLE_TRITON=1: chunk_kda runs its PyTorch path, 'ours' is not the Triton kernel")
    return chunk_kda, None


def load_fla():
    try:
        import fla
        from fla.ops.kda import chunk_kda as fla_chunk
    except Exception as e:  # not installed, or a version without KDA / one that fails to import here
        return None, None, None, f"fla not available ({type(e).__name__}: {e})"
    try:
        from fla.ops.kda import fused_recurrent_kda as fla_recurrent
    except Exception:
        fla_recurrent = None
    return fla_chunk, fla_recurrent, getattr(fla, "__version__", "?"), None


@contextlib.contextmanager
def path_env(env: dict[str, str]):
    """A path's environment variables, set around its forward and its backward (the kernels read them at launch)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------- correctness


def rel_err(x: torch.Tensor | None, ref: torch.Tensor) -> float:
    if x is None:
        return math.inf
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def check_chunk(run, gate, dtype, seed=0, env=None) -> dict:
    """Output and input gradients of `run` against torch_chunk in float64 on the same rounded inputs."""
    s = CHECK_SHAPE
    x = make_inputs(s["B"], s["T"], s["H"], s["D"], dtype, seed)
    names = leaves_of(gate)
    x64 = {n: t.detach().double().requires_grad_(n in names) for n, t in x.items()}
    o_ref = torch_chunk(x64, gate)
    do = torch.randn(o_ref.shape, generator=torch.Generator(device=DEVICE).manual_seed(seed + 1),
                     device=DEVICE, dtype=torch.float64)
    ref_grads = torch.autograd.grad(o_ref, [x64[n] for n in names], do)
    row = dict(gate=gate, dtype=str(dtype).replace("torch.", ""), errs={}, error=None)
    try:
        xl = {n: t.detach().clone().requires_grad_(n in names) for n, t in x.items()}
        with path_env(env or {}):
            o = run(xl, gate)
            grads = torch.autograd.grad(o, [xl[n] for n in names], do.to(o.dtype), allow_unused=True)
            sync()
    except Exception as e:  # a kernel that fails to compile or launch is a failed check, reported, not fatal
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        return row
    tol = TOL[dtype]
    ok = o.shape == o_ref.shape and o.dtype == dtype
    row["errs"]["o"] = rel_err(o, o_ref)
    ok &= row["errs"]["o"] < tol["o"]
    for n, gr, ref in zip(names, grads, ref_grads):
        err = rel_err(gr, ref)
        row["errs"]["d" + n] = err
        ok &= err < tol["grad"] * (PARAM_GRAD_FACTOR if n in PARAM_LEAVES else 1.0)
    row["ok"] = bool(ok)
    return row


# ---------------------------------------------------------------- timing


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Timer:
    """Median CUDA-event time of a call in ms, L2 flushed before each (wall clock with --smoke-cpu)."""

    def __init__(self):
        self.flush = torch.empty(256 * 2**20 if DEVICE == "cuda" else 2**20, dtype=torch.int8, device=DEVICE)

    def __call__(self, fn, warmup=2) -> tuple[float, int]:
        for _ in range(warmup):
            fn()
        sync()
        times = []
        reps = MAX_REPS
        while len(times) < reps:
            self.flush.zero_()
            if DEVICE == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            if len(times) == 1:
                reps = max(3, min(MAX_REPS, int(TIME_BUDGET_S * 1e3 / max(times[0], 1e-3))))
        return statistics.median(times), len(times)


def is_oom(e: Exception) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def free_memory():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def time_case(timer, run, x, gate, mode, env=None) -> dict:
    """mode 'fwd': forward under no_grad; 'fwdbwd': forward and the gradients of every input."""
    names = leaves_of(gate)
    try:
        if mode == "fwd":
            def fn():
                with torch.no_grad():
                    run(x, gate)
        else:
            xl = {n: t.detach().requires_grad_(n in names) for n, t in x.items()}
            do = torch.randn_like(x["v"])

            def fn():
                o = run(xl, gate)
                torch.autograd.grad(o, [xl[n] for n in names], do)
        with path_env(env or {}):
            ms, reps = timer(fn)
        return dict(ms=ms, reps=reps)
    except Exception as e:
        reason = "out of memory" if is_oom(e) else f"{type(e).__name__}: {str(e)[:200]}"
        return dict(ms=None, skipped=reason)
    finally:
        free_memory()


def forward_floor_bytes(B, T, H, D) -> int:
    """q, k, v, g (or f), o: [B, T, H, D] bf16; β: [B, T, H] bf16."""
    return B * T * H * (5 * D * 2 + 2)


def decode_floor_bytes(B, H, D) -> int:
    """The fp32 state read and written once, plus q, k, v, f, o [B, 1, H, D] bf16 and β."""
    return B * H * (2 * D * D * 4 + 5 * D * 2 + 2)


def bandwidth(timer) -> tuple[float, str, float]:
    """(bytes/s used for the floors, where it comes from, this run's measured copy rate)."""
    n = 2**30 if DEVICE == "cuda" else 2**24
    a, b = torch.empty(n, dtype=torch.int8, device=DEVICE), torch.empty(n, dtype=torch.int8, device=DEVICE)
    ms, _ = timer(lambda: b.copy_(a))  # noqa: F821 (ruff misreads the later `del a, b`)
    measured = 2 * n / (ms * 1e-3)
    del a, b
    free_memory()
    name = device_name()
    for key, bw, source in BANDWIDTH:
        if key in name:
            return bw, f"{key}: {source}", measured
    return measured, "unknown GPU: this run's measured copy bandwidth", measured


# ---------------------------------------------------------------- the decode step


def decode_paths(fla_recurrent):
    from k3rl.kernels.kda.recurrent_triton import fused_recurrent_kda_triton

    def torch_rec(x):
        g = kda_gate(x["f"], x["A_log"], x["dt_bias"], LOWER_BOUND)
        return fused_recurrent_kda_torch(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["h0"],
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)

    def ours(x):
        gate = FusedGate(x["f"], x["A_log"], x["dt_bias"], LOWER_BOUND)
        return fused_recurrent_kda_triton(x["q"], x["k"], x["v"], gate, x["beta"], initial_state=x["h0"],
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)

    def ours_pool(x):
        # the engine's form: states live in a pool, updated in place at the sequences' slots
        gate = FusedGate(x["f"], x["A_log"], x["dt_bias"], LOWER_BOUND)
        o, _ = fused_recurrent_kda_triton(x["q"], x["k"], x["v"], gate, x["beta"], initial_state=x["pool"],
                                          use_qk_l2norm_in_kernel=True, state_indices=x["slots"])
        return o, x["pool"][x["slots"]]

    paths = {"torch fused_recurrent_kda": torch_rec, "ours (Triton)": ours, "ours, in-place pool": ours_pool}
    if fla_recurrent is not None:
        params = inspect.signature(fla_recurrent).parameters
        if "use_gate_in_kernel" in params and "lower_bound" in params:
            def fla_rec(x):
                return fla_recurrent(x["q"], x["k"], x["v"], x["f"], x["beta"], A_log=x["A_log"],
                                     dt_bias=x["dt_bias"], use_gate_in_kernel=True, lower_bound=LOWER_BOUND,
                                     initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
        else:
            def fla_rec(x):
                g = kda_gate(x["f"], x["A_log"], x["dt_bias"], LOWER_BOUND)
                return fla_recurrent(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["h0"],
                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
        paths["fla fused_recurrent_kda"] = fla_rec
    return paths


def run_decode(timer, fla_recurrent, bw) -> tuple[list[dict], list[dict]]:
    B, H, D = DECODE["B"], DECODE["H"], DECODE["D"]
    x = make_inputs(B, 1, H, D, torch.bfloat16, seed=3)
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    x["h0"] = 0.1 * torch.randn(B, H, D, D, generator=gen, device=DEVICE)  # [B, H, K, V] fp32
    slots = torch.randperm(2 * B, generator=gen, device=DEVICE)[:B]
    x["slots"] = slots  # [B] distinct slots of a pool twice the batch
    pool = torch.zeros(2 * B, H, D, D, device=DEVICE)
    pool[slots] = x["h0"]
    g64 = kda_gate(x["f"].double(), x["A_log"].double(), x["dt_bias"].double(), LOWER_BOUND)
    o_ref, s_ref = naive_recurrent_kda(x["q"].double(), x["k"].double(), x["v"].double(), g64, x["beta"].double(),
                                       initial_state=x["h0"].double(), output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
    checks, rows = [], []
    floor_ms = decode_floor_bytes(B, H, D) / bw * 1e3
    for name, fn in decode_paths(fla_recurrent).items():
        x["pool"] = pool.clone()
        check = dict(path=name, gate="lb", dtype="bfloat16", what=f"decode B={B} T=1 H={H} d={D}", errs={}, error=None)
        try:
            with torch.no_grad():
                o, s = fn(x)
            check["errs"] = dict(o=rel_err(o, o_ref), state=rel_err(s, s_ref))
            check["ok"] = check["errs"]["o"] < TOL[torch.bfloat16]["o"] and check["errs"]["state"] < 1e-4
        except Exception as e:
            check.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        checks.append(check)
        row = dict(path=name, B=B, H=H, D=D, floor_ms=floor_ms, ms=None)
        if check["ok"]:
            with torch.no_grad():
                row.update(time_case_decode(timer, fn, x))
        else:
            row["skipped"] = "check failed"
        rows.append(row)
    return checks, rows


def time_case_decode(timer, fn, x) -> dict:
    try:
        ms, reps = timer(lambda: fn(x))
        return dict(ms=ms, reps=reps)
    except Exception as e:
        return dict(skipped="out of memory" if is_oom(e) else f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        free_memory()


# ---------------------------------------------------------------- tables


def fmt_ms(r: dict | None, key="ms") -> str:
    if r is None:
        return "—"
    if r.get(key) is None:
        return f"skipped ({r.get('skipped', '?')})"
    return f"{r[key]:.3f}"


def ratio(other: dict | None, mine: dict | None) -> str:
    if not other or not mine or other.get("ms") is None or mine.get("ms") is None:
        return "—"
    return f"{other['ms'] / mine['ms']:.3g}×"


def chunk_table(rows: list[dict], baseline: str) -> str:
    head = (f"| B×T | gate | path | fwd ms | fwd+bwd ms | fwd speed-up vs {baseline} | fwd+bwd speed-up vs "
            f"{baseline} | fwd floor ms | fwd ÷ floor |")
    lines = [head, "|" + "---|" * 9]
    by_case = {}
    for r in rows:
        by_case.setdefault((r["B"], r["T"], r["gate"]), {})[r["path"]] = r
    for (B, T, gate), paths in by_case.items():
        base = paths.get(baseline)
        for path, r in paths.items():
            fwd, fb = r.get("fwd"), r.get("fwdbwd")
            floor = r["floor_ms"]
            of_floor = f"{fwd['ms'] / floor:.1f}×" if fwd and fwd.get("ms") is not None else "—"
            lines.append(
                f"| {B}×{T} | {gate} | {path}{' (' + r['note'] + ')' if r.get('note') else ''} | {fmt_ms(fwd)} | "
                f"{fmt_ms(fb)} | {ratio(base and base.get('fwd'), fwd) if path != baseline else ''} | "
                f"{ratio(base and base.get('fwdbwd'), fb) if path != baseline else ''} | {floor:.3f} | {of_floor} |")
    return "\n".join(lines)


def decode_table(rows: list[dict]) -> str:
    lines = ["| path | ms | speed-up vs torch | speed-up vs fla | floor ms | ÷ floor |", "|" + "---|" * 6]
    by = {r["path"]: r for r in rows}
    base, fla = by.get("torch fused_recurrent_kda"), by.get("fla fused_recurrent_kda")
    for r in rows:
        of_floor = f"{r['ms'] / r['floor_ms']:.1f}×" if r.get("ms") is not None else "—"
        lines.append(f"| {r['path']} | {fmt_ms(r)} | {ratio(base, r)} | {ratio(fla, r)} | {r['floor_ms']:.4f} | "
                     f"{of_floor} |")
    return "\n".join(lines)


def check_table(checks: list[dict]) -> str:
    lines = ["| path | what | gate | dtype | ok | errors (relative) |", "|" + "---|" * 6]
    for c in checks:
        errs = c["error"] or ", ".join(f"{k} {v:.1e}" for k, v in c["errs"].items())
        lines.append(f"| {c['path']} | {c.get('what', 'chunk')} | {c['gate']} | {c['dtype']} | "
                     f"{'yes' if c['ok'] else 'NO'} | {errs} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (--smoke-cpu)"


def use_smoke_sizes():
    """--smoke-cpu: the CPU and tiny shapes, so the interpreter gets through every path in a minute or two."""
    global DEVICE, BENCH_H, BENCH_D, TIME_BUDGET_S, MAX_REPS
    DEVICE, BENCH_H, BENCH_D, TIME_BUDGET_S, MAX_REPS = "cpu", 2, 32, 0.2, 3
    CHECK_SHAPE.update(T=70, H=2, D=32)
    DECODE.update(B=3, H=2, D=32)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in item.lower().split("x")) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"B×T list (default {DEFAULT_SHAPES})")
    ap.add_argument("--paths", default=DEFAULT_PATHS,
                    help=f"chunked paths to check and time, of torch, ours, ours_bf16dots, fla (default {DEFAULT_PATHS})")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode step")
    ap.add_argument("--stack-every", type=float, default=60.0,
                    help="print every thread's stack every this many seconds (0: never), so a run cut at its time "
                         "limit says where it was")
    ap.add_argument("--quick", action="store_true", help="check, then B×T = 1×4096 and the decode step only")
    ap.add_argument("--out", default=str(ROOT / "bench/out"))
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="run every step at tiny shapes on the CPU (Triton interpreted) to test this script")
    args = ap.parse_args(argv)
    wanted = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(wanted) - {"torch", "ours", "ours_bf16dots", "fla"})
    if unknown:
        ap.error(f"--paths: unknown path(s) {unknown}; the paths are torch, ours, ours_bf16dots, fla")
    if args.stack_every > 0:
        faulthandler.dump_traceback_later(args.stack_every, repeat=True)
    if args.smoke_cpu:
        use_smoke_sizes()
        shapes = [(1, 100)]
    elif not torch.cuda.is_available():
        print("bench/kda_gpu.py needs a CUDA GPU; none is visible here (torch.cuda.is_available() is False). "
              "Nothing was measured.")
        return 0
    else:
        shapes = [(1, 4096)] if args.quick else parse_shapes(args.shapes)
    torch.manual_seed(0)
    import triton

    name = device_name()
    timer = Timer()
    bw, bw_source, bw_measured = bandwidth(timer)
    print(f"GPU {name}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"bandwidth for the floors {bw / 1e12:.3g} TB/s ({bw_source}); measured copy {bw_measured / 1e12:.3g} TB/s")

    chunk_kda, ours_missing = load_ours()
    fla_chunk, fla_recurrent, fla_version, fla_missing = load_fla()
    print(f"fla: {fla_missing or 'version ' + fla_version}")
    paths = {}  # name → (run, note, environment)
    if "torch" in wanted:
        paths["torch"] = (torch_chunk, "", {})
    if chunk_kda is not None:
        if "ours" in wanted:
            paths["ours"] = (make_ours_chunk(chunk_kda), "", {})
        if "ours_bf16dots" in wanted:
            paths["ours_bf16dots"] = (make_ours_chunk(chunk_kda), "K3RL_KDA_BWD_BF16_DOTS=1",
                                      {"K3RL_KDA_BWD_BF16_DOTS": "1"})
    else:
        print(f"ours: MISSING — {ours_missing}")
    if fla_chunk is not None and "fla" in wanted:
        paths["fla"] = (*make_fla_chunk(fla_chunk), {})

    # 1. correctness
    checks, passed = [], {}
    for path, (run, _, env) in paths.items():
        for gate in ("tensor", *GATES):
            for dtype in (torch.float32, torch.bfloat16):
                started = time.perf_counter()
                print(f"check {path} {gate} {str(dtype).removeprefix('torch.')} ...", flush=True)
                c = check_chunk(run, gate, dtype, env=env)
                c["path"] = path
                checks.append(c)
                print(f"check {path} {gate} {str(dtype).removeprefix('torch.')}: {'ok' if c['ok'] else 'FAILED'} "
                      f"({time.perf_counter() - started:.1f} s, compiles included)", flush=True)
                passed[(path, gate)] = passed.get((path, gate), True) and c["ok"]
                free_memory()
    print(f"\nChecks (chunked op vs chunk_kda_torch in float64, B=1 T={CHECK_SHAPE['T']} H={CHECK_SHAPE['H']} "
          f"d={CHECK_SHAPE['D']}):")
    print(check_table(checks))

    # 2-3. timing
    rows = []
    for B, T in shapes:
        for gate in GATES:
            try:
                x = make_inputs(B, T, BENCH_H, BENCH_D, torch.bfloat16, seed=1)
            except Exception as e:
                print(f"{B}×{T} {gate}: inputs do not fit ({type(e).__name__}); skipped")
                free_memory()
                continue
            for path, (run, note, env) in paths.items():
                row = dict(B=B, T=T, gate=gate, path=path, note=note,
                           floor_ms=forward_floor_bytes(B, T, BENCH_H, BENCH_D) / bw * 1e3)
                if not passed[(path, gate)]:
                    row["fwd"] = row["fwdbwd"] = dict(ms=None, skipped="check failed")
                else:
                    for mode in ("fwd", "fwdbwd"):
                        row[mode] = time_case(timer, run, x, gate, mode, env)
                print(f"{B}×{T} {gate:8s} {path:6s} fwd {fmt_ms(row['fwd'])} ms, fwd+bwd {fmt_ms(row['fwdbwd'])} ms",
                      flush=True)
                rows.append(row)
            del x
            free_memory()
    baseline = "fla" if "fla" in paths else "torch" if "torch" in paths else "ours"
    chunk_md = chunk_table(rows, baseline)
    print(f"\nChunked KDA, H={BENCH_H}, d={BENCH_D}, bf16 ({name}):")
    print(chunk_md)

    decode_checks, decode_rows = ([], []) if args.no_decode else run_decode(timer, fla_recurrent, bw)
    checks += decode_checks
    decode_md = decode_table(decode_rows)
    print(f"\nDecode step, B={DECODE['B']} T=1 H={DECODE['H']} d={DECODE['D']}, bf16 inputs, fp32 state, lb gate:")
    print(check_table(decode_checks))
    print(decode_md)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=name, torch=torch.__version__, triton=triton.__version__, fla=fla_version,
                fla_missing=fla_missing, ours_missing=ours_missing, bandwidth=bw, bandwidth_source=bw_source,
                bandwidth_measured=bw_measured, date=datetime.datetime.now().isoformat(timespec="seconds"),
                k3rl_disable_triton=os.environ.get("K3RL_DISABLE_TRITON"))
    (out / "kda_gpu.json").write_text(json.dumps(dict(meta=meta, checks=checks, chunk=rows, decode=decode_rows),
                                                 indent=1, default=str))
    (out / "kda_gpu.md").write_text(
        f"GPU {name}, torch {torch.__version__}, triton {triton.__version__}, fla {fla_version or 'absent'}; "
        f"floors at {bw / 1e12:.3g} TB/s ({bw_source}), measured copy {bw_measured / 1e12:.3g} TB/s\n\n"
        f"{check_table(checks)}\n\n{chunk_md}\n\n{decode_md}\n")
    print(f"\nwrote {out / 'kda_gpu.json'} and {out / 'kda_gpu.md'}")
    ours_ok = ours_missing is None and all(c["ok"] for c in checks if c["path"] in ("ours", "ours (Triton)",
                                                                                   "ours, in-place pool"))
    return 0 if ours_ok else 1


if __name__ == "__main__":
    sys.exit(main())
