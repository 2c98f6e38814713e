"""Compile every Triton kernel in kernels/ for sm_90 (H100/H200) on a machine without a GPU: a compile-only check.

    python bench/compile_sm90.py            # [--only kda|moe|situ|attn_res] [--keep-ptx DIR]

The interpreter (TRITON_INTERPRET=1, how the tests run the kernels on the CPU) executes the kernels' Python
with numpy and so never meets the GPU front end and code generator: plain Python globals inside @triton.jit,
ops without a lowering, wrong constexpr use, shared-memory overflow and register spills only show when the
kernel is compiled for a GPU target. This script compiles each kernel with `triton.compile` for
`GPUTarget("cuda", 90, 32)` and runs the bundled `ptxas -v` on the PTX for registers and spills. Nothing
runs on a GPU; TRITON_INTERPRET is cleared before triton is imported (the module-level INTERPRET switches
in kernels/ must pick their GPU settings).

Where the signatures come from: not from a hand-written table. Each scenario in `SCENARIOS` calls a
host entry point (chunk_kda_triton forward + backward, fused_recurrent_kda_triton, triton_experts forward +
backward, situ_glu_triton, attn_res_mix_triton) on CPU tensors at K3-like shapes; `JITFunction.run` is
replaced by a recorder that binds the launch arguments with Triton's own binder for the CUDA backend
(pointer dtypes from the tensors, i32/i64 and divisibility-16 specialisation from the ints, constexprs as
passed, num_warps/num_stages from the launch) and compiles that instead of launching. So the block sizes,
warps and stages are the ones the host code's own selection functions pick (`blocks`, `_blocks`,
`block_size`, `LAUNCH`, ...). Outputs of the recorded "launches" stay uninitialised; the host code only
reads shapes, so the next launches of the same op are still recorded with the right arguments.

One departure: kernels/kda/chunk_bwd_inter.py `dot_args` picks bf16 dot operands only for CUDA tensors;
the recorder calls it with the tensors reported as CUDA so the backward compiles with the operands it
would get on an H200 (`_as_cuda`).

A kernel of kernels/ that no scenario launched is reported as NOT COVERED and fails the run like a
compile error. Exit status 1 if any kernel fails to compile or is not covered.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before triton (and kernels/) are imported
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)

import argparse
import contextlib
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB opt-in; 228 KB per SM)

# ---------------------------------------------------------------------------------------------------------
# scenarios: host calls at K3-like shapes (head dim 128, chunk 64, d = 7168, I = 2048; bf16 and fp32)
# ---------------------------------------------------------------------------------------------------------

H, DK, DV = 2, 128, 128  # KDA heads (the head count changes no constexpr but H), head dim 128
D_MODEL, D_EXPERT = 7168, 2048


def _grads(outs, *leaves):
    """Backward through `outs` with random cotangents (a real dO is dense, not the stride-0 ones of .sum())."""
    outs = [o for o in outs if o is not None]
    torch.autograd.backward(outs, [torch.randn_like(o) for o in outs], inputs=[x for x in leaves if x is not None])


def kda_chunk(dtype, gate: str, varlen: bool = False):
    """chunk_kda_triton forward + backward; gate: 'given' (g tensor, fp32), 'softplus' or 'lower_bound' (FusedGate)."""
    def run():
        from k3rl.kernels.kda.chunk_triton import chunk_kda_triton
        from k3rl.kernels.kda.gate import FusedGate
        B, T = 1, 200  # 200 = 3 full chunks of 64 and a partial one
        q, k = (torch.randn(B, T, H, DK, dtype=dtype, requires_grad=True) for _ in range(2))  # [B, T, H, K]
        v = torch.randn(B, T, H, DV, dtype=dtype, requires_grad=True)  # [B, T, H, V]
        beta = torch.rand(B, T, H, dtype=dtype, requires_grad=True)  # [B, T, H]
        cu = torch.tensor([0, 70, T], dtype=torch.int32) if varlen else None
        n = 2 if varlen else B
        h0 = torch.randn(n, H, DK, DV, dtype=torch.float32, requires_grad=True)  # [N, H, K, V]
        if gate == "given":
            g = (-torch.rand(B, T, H, DK, dtype=torch.float32)).requires_grad_()  # [B, T, H, K]
            leaves = [g]
        else:
            f = torch.randn(B, T, H * DK, dtype=dtype, requires_grad=True)  # [B, T, H*K]
            A_log = torch.randn(H, dtype=torch.float32, requires_grad=True)
            dt_bias = torch.randn(H * DK, dtype=torch.float32, requires_grad=True)
            g = FusedGate(f, A_log, dt_bias, -5.0 if gate == "lower_bound" else None)
            leaves = [f, A_log, dt_bias]
        o, ht = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        _grads([o, ht], q, k, v, beta, h0, *leaves)
    return run


def kda_recurrent(dtype, gate: str, pool: bool = False, T: int = 1):
    """fused_recurrent_kda_triton (decode, forward only); `pool`: state pool updated in place by index."""
    def run():
        from k3rl.kernels.kda.gate import FusedGate
        from k3rl.kernels.kda.recurrent_triton import fused_recurrent_kda_triton
        B = 4
        q, k = (torch.randn(B, T, H, DK, dtype=dtype) for _ in range(2))  # [B, T, H, K]
        v = torch.randn(B, T, H, DV, dtype=dtype)  # [B, T, H, V]
        beta = torch.rand(B, T, H, dtype=dtype)  # [B, T, H]
        if gate == "given":
            g = -torch.rand(B, T, H, DK, dtype=torch.float32)  # [B, T, H, K]
        else:
            g = FusedGate(torch.randn(B, T, H * DK, dtype=dtype), torch.randn(H), torch.randn(H * DK),
                          -5.0 if gate == "lower_bound" else None)
        if pool:
            state = torch.zeros(8, H, DK, DV, dtype=torch.float32)  # [P, H, K, V]
            idx = torch.tensor([3, 0, -1, 5], dtype=torch.int32)
            kw = dict(initial_state=state, state_indices=idx, output_final_state=True)
        else:
            kw = dict(initial_state=torch.zeros(B, H, DK, DV), output_final_state=True)
        with torch.no_grad():
            fused_recurrent_kda_triton(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw)
    return run


def moe(dtype, rows_per_expert: int, linear_beta: float | None):
    """triton_experts with the fused SiTU-GLU, forward + backward; E = 4 experts, top-2 routing."""
    def run():
        from k3rl.kernels.moe.triton import SituGLU, triton_experts
        E, top = 4, 2
        N = rows_per_expert * E // top
        z = torch.randn(N, D_MODEL, dtype=dtype, requires_grad=True)  # [N, d]
        ids = torch.stack([torch.arange(N) % E, (torch.arange(N) + 1) % E], 1)  # [N, 2], balanced
        w = torch.rand(N, top, requires_grad=True)  # [N, 2]
        w1, w3 = (torch.empty(E, D_EXPERT, D_MODEL, dtype=dtype).normal_().requires_grad_() for _ in range(2))
        w2 = torch.empty(E, D_MODEL, D_EXPERT, dtype=dtype).normal_().requires_grad_()  # [E, d, I]
        y = triton_experts(z, ids, w, w1, w3, w2, SituGLU(1.0, linear_beta))
        _grads([y], z, w, w1, w3, w2)
    return run


def situ(dtype, linear_beta: float | None):
    def run():
        from k3rl.kernels.situ.fused import situ_glu_triton
        g, u = (torch.randn(512, D_EXPERT, dtype=dtype, requires_grad=True) for _ in range(2))  # [M, I]
        _grads([situ_glu_triton(g, u, 1.0, linear_beta)], g, u)
    return run


def attn_res(dtype, d: int):
    def run():
        from k3rl.kernels.attn_res.fused import attn_res_mix_triton
        srcs = [torch.randn(1, 64, d, dtype=dtype, requires_grad=True) for _ in range(4)]  # 4 × [B, T, d]
        q = torch.randn(d, dtype=torch.float32, requires_grad=True)  # [d] pseudo-query
        _grads([attn_res_mix_triton(srcs, q, 1e-6)], q, *srcs)
    return run


BF16, FP32 = torch.bfloat16, torch.float32
SCENARIOS = {  # name → (op folder, host call)
    "kda chunk bf16 g": ("kda", kda_chunk(BF16, "given")),
    "kda chunk bf16 gate lb": ("kda", kda_chunk(BF16, "lower_bound")),
    "kda chunk bf16 gate softplus": ("kda", kda_chunk(BF16, "softplus")),
    "kda chunk bf16 varlen lb": ("kda", kda_chunk(BF16, "lower_bound", varlen=True)),
    "kda chunk fp32 g": ("kda", kda_chunk(FP32, "given")),
    "kda chunk fp32 gate lb": ("kda", kda_chunk(FP32, "lower_bound")),
    "kda recur bf16 g": ("kda", kda_recurrent(BF16, "given")),
    "kda recur bf16 softplus pool": ("kda", kda_recurrent(BF16, "softplus", pool=True)),
    "kda recur bf16 lb T=4": ("kda", kda_recurrent(BF16, "lower_bound", T=4)),
    "kda recur fp32 g": ("kda", kda_recurrent(FP32, "given")),
    "moe bf16 train": ("moe", moe(BF16, 256, 0.5)),
    "moe bf16 decode": ("moe", moe(BF16, 4, None)),
    "moe fp32 train": ("moe", moe(FP32, 256, 0.5)),
    "situ bf16": ("situ", situ(BF16, 0.5)),
    "situ bf16 nolin": ("situ", situ(BF16, None)),
    "situ fp32": ("situ", situ(FP32, 0.5)),
    "attn_res bf16 d=7168": ("attn_res", attn_res(BF16, D_MODEL)),
    "attn_res fp32 d=7168": ("attn_res", attn_res(FP32, D_MODEL)),
}

# ---------------------------------------------------------------------------------------------------------
# recording launches and compiling them
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Launch:
    kernel: str  # module:function
    scenario: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: object
    fn: JITFunction
    result: dict = field(default_factory=dict)


BACKEND = make_backend(TARGET)
_binders: dict[int, object] = {}
_launches: dict[tuple, Launch] = {}
_current = [""]


def _record(self: JITFunction, *args, grid, warmup, **kwargs):
    """Stands in for JITFunction.run: bind as Triton does for a CUDA launch, keep one Launch per distinct key."""
    kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
    binder = _binders.get(id(self))
    if binder is None:
        binder = _binders[id(self)] = create_function_from_signature(self.signature, self.params, BACKEND)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound, spec, opts)
    name = f"{self.fn.__module__}:{self.fn.__name__}"
    key = (name, str(signature), str(sorted(constexprs.items(), key=str)), str(sorted(attrs.items(), key=str)),
           options.num_warps, options.num_stages)
    _launches.setdefault(key, Launch(name, _current[0], signature, constexprs, attrs, options, self))
    return None


@contextlib.contextmanager
def _as_cuda():
    """Tensors answer is_cuda = True inside (only around chunk_bwd's `dot_args`, see the module docstring)."""
    prev = torch.Tensor.__dict__.get("is_cuda")
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        if prev is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = prev


def _patch_dot_args():
    import k3rl.kernels.kda.chunk_bwd as cb
    orig = cb.dot_args

    def dot_args_on_gpu(*inputs):
        with _as_cuda():
            return orig(*inputs)
    cb.dot_args = dot_args_on_gpu


def _ptxas_usage(ptx: str) -> dict:
    """registers, spill stores/loads (bytes) from the bundled ptxas -v for sm_90a (the arch Triton compiles to)."""
    ptxas = get_ptxas(TARGET.arch).path  # the ptxas Triton itself uses for sm_90 (the "blackwell" one)
    arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True)
    text = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return dict(regs=int(regs.group(1)) if regs else None,
                spill_st=int(spill.group(1)) if spill else None, spill_ld=int(spill.group(2)) if spill else None)


def _compile(launch: Launch, keep_ptx: Path | None) -> None:
    src = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
    try:
        k = triton.compile(src, target=TARGET, options=launch.options.__dict__)
    except Exception as e:  # noqa: BLE001 — any compiler error is a result to report
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        err = next((ln for ln in lines if "rror" in ln), lines[0] if lines else type(e).__name__)
        launch.result = dict(ok=False, error=f"{type(e).__name__}: {err}"[:160], full="".join(
            traceback.format_exception_only(type(e), e)))
        return
    if keep_ptx is not None:
        keep_ptx.mkdir(parents=True, exist_ok=True)
        (keep_ptx / f"{launch.fn.fn.__name__}_{abs(hash(str(launch.constexprs))) % 10**6}.ptx").write_text(
            k.asm["ptx"])
    launch.result = dict(ok=True, smem=k.metadata.shared, **_ptxas_usage(k.asm["ptx"]))


def _all_kernels(only: str | None) -> set[str]:
    """Every @triton.jit function of kernels/ that some host code launches (`name[grid](...)`)."""
    import k3rl.kernels as kernels
    found = set()
    for mod in pkgutil.walk_packages(kernels.__path__, "kernels."):
        if only and not mod.name.startswith(f"kernels.{only}"):
            continue
        m = importlib.import_module(mod.name)
        source = inspect.getsource(m)
        for name, obj in vars(m).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == m.__name__ \
                    and re.search(rf"\b{name}\[", source):
                found.add(f"{m.__name__}:{name}")
    return found


def _variant(launch: Launch) -> str:
    """The constexprs (None/interp flags dropped) and launch options that distinguish this compile."""
    skip = {"INTERPRET"}
    names = [p.name for p in launch.fn.params]
    cs = [f"{names[p[0]]}={v.__name__ if hasattr(v, '__name__') else v}" for p, v in launch.constexprs.items()
          if len(p) == 1 and names[p[0]] not in skip and names[p[0]].isupper()]
    ptr = sorted({t for t in launch.signature.values() if t.startswith("*")})
    return f"{' '.join(cs)} w{launch.options.num_warps}s{launch.options.num_stages} {'/'.join(ptr)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["kda", "moe", "situ", "attn_res"])
    ap.add_argument("--keep-ptx", type=Path, help="write each kernel's PTX here")
    args = ap.parse_args()

    torch.manual_seed(0)
    JITFunction.run = _record
    _patch_dot_args()
    failed_hosts = []
    for name, (folder, call) in SCENARIOS.items():
        if args.only and folder != args.only:
            continue
        _current[0] = name
        try:
            call()
        except Exception as e:  # noqa: BLE001 — a host path that cannot run is reported, the rest still checked
            failed_hosts.append(f"{name}: {type(e).__name__}: {e}")

    launches = list(_launches.values())
    print(f"{len(launches)} distinct compiles from {len(SCENARIOS)} scenarios; target {TARGET}", flush=True)
    for i, ln in enumerate(launches):
        _compile(ln, args.keep_ptx)
        print(f"  [{i + 1}/{len(launches)}] {ln.kernel} {'ok' if ln.result['ok'] else 'FAILED'}", flush=True)

    rows = []
    for ln in sorted(launches, key=lambda x: (x.kernel, x.scenario)):
        r = ln.result
        if r["ok"]:
            st = "ok"
            regs, spills = str(r["regs"]), f"{r['spill_st']}/{r['spill_ld']}"
            smem = f"{r['smem']} ({100 * r['smem'] / SMEM_LIMIT:.0f}%)" + (" OVER" if r["smem"] > SMEM_LIMIT else "")
        else:
            st, regs, spills, smem = "ERROR " + r["error"], "", "", ""
        rows.append((ln.kernel.removeprefix("kernels."), ln.scenario, _variant(ln), st, regs, spills, smem))
    head = ("kernel", "first scenario", "variant (constexprs, warps/stages, pointer dtypes)", "compile",
            "regs", "spill st/ld B", "smem B (of 227 KB)")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")

    covered = {ln.kernel for ln in launches}
    missing = sorted(_all_kernels(args.only) - covered)
    errors = [ln for ln in launches if not ln.result["ok"]]
    over = [ln for ln in launches if ln.result["ok"] and ln.result["smem"] > SMEM_LIMIT]
    for ln in errors:
        print(f"\nERROR {ln.kernel} ({ln.scenario}; {_variant(ln)}):\n{ln.result['full']}")
    for m in missing:
        print(f"NOT COVERED: {m} (no scenario launched it)")
    for h in failed_hosts:
        print(f"HOST CALL FAILED: {h}")
    print(f"\n{len(launches) - len(errors)}/{len(launches)} compiled, {len(errors)} failed, {len(over)} over the "
          f"shared-memory limit, {len(missing)} kernels not covered, {len(failed_hosts)} host calls failed")
    return 1 if errors or missing or over or failed_hosts else 0


if __name__ == "__main__":
    sys.exit(main())
