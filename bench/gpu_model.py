"""A whole tiny K3 on a CUDA GPU through the Triton kernels: a learner step and a decode, checked against the PyTorch
paths, then timed.

Paths: "triton" is the default on CUDA tensors (kernels/dispatch.py; K3RL_DISABLE_TRITON unset), "torch" sets
K3RL_DISABLE_TRITON=1 around the call; the reference is the torch path in float64 (the Triton entry points keep
float64 on PyTorch). Every Triton entry point (chunked KDA, KDA decode step, AttnRes mix, routed experts, SiTU-GLU)
is wrapped and counted, as tests/model/test_triton_dispatch.py does: a Triton run that calls none of them, or a
torch run that calls any, fails. The model: hidden 256, 4 layers (3 KDA with head_dim 64, 1 MLA), 8 experts top-2
+ 1 shared, vocab 1024.

1. Forward + backward, both KDA gate forms (lower bound -5, and the unbounded softplus form): logits and every
   parameter's gradient of B = 2 × T = 1000 tokens (not a multiple of the 64-token chunk) under a random linear
   loss, fp32 and bf16 (model.to(bfloat16); the model keeps its gate and conv parameters fp32), each path, as
   relative errors ‖x − ref‖/‖ref‖ against the float64 torch path on the same (for bf16: rounded) weights, its
   routing replayed so that a near-tie in a router cannot flip an expert. Tolerances: fp32 5e-3 logits, 2e-2
   gradients (tl.dot may run fp32 tiles in TF32); bf16 3e-2 logits, 1e-1 gradients; 5× those for A_log and
   dt_bias (sums over every token of a head: cancellation; bench/kda_gpu.py). The worst parameter (by error ÷ its
   tolerance) is named. A NaN always fails.
2. A learner step: `rl.train.learner.Learner` (GRPO, AdamW) on CUDA from a saved directory, 2 groups × 4
   trajectories with behaviour logprobs and routing from the float64 model, in fp32 through each path and in
   float64: log π before and after the step (fp32 logits tolerance), grad_norm and entropy (gradient and logits
   tolerances), |Δ loss| (the first step's loss is near 0: advantages sum to 0 per group; logits tolerance).
3. Decode: `rollout.torch_engine.TorchEngine`, greedy, 8 prompts × 64 new tokens, each path; tokens must agree,
   or first diverge where the float64 logits of the two chosen tokens are within max(1e-3, 2 × the Triton path's
   logit error there) (a near-tie); prefill + 4 decode steps through Triton reproduce the float64 full forward's
   logits (fp32 logits tolerance).
4. Time: decode tokens/s at batch 1, 8, 32 over 32 steps (the model's decode step alone, and the engine's whole
   loop), and the training forward + backward (next-token loss, B = 1) at T = 1000, 4096, 16384 in bf16 and fp32;
   warm-up first, torch.cuda.synchronize around each call, median of up to 20 calls (about 1 s per case).

    python bench/gpu_model.py                   # on a CUDA machine (about 3 minutes on an H200, half of it
                                                # compiling the Triton kernels on a cold cache)
    python bench/gpu_model.py --smoke-cpu       # every step at tiny shapes on the CPU (Triton interpreted):
                                                # checks this script, its times mean nothing

Writes gpu_model.json (every number) and gpu_model.md (the tables) into --out (default bench/out). Without CUDA
(and without --smoke-cpu) it says so and exits 0. Exit status 1 if a check fails or a step raises (the traceback is
recorded, the other steps still run, the files are still written).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "--smoke-cpu" in sys.argv
if SMOKE:
    # before anything imports triton: the kernels run on CPU tensors under the interpreter, forced by dispatch
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["K3RL_FORCE_TRITON"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

try:
    import k3rl.kernels  # noqa: F401
except ImportError:
    # not installed (a bare GPU image): the namespace's subpackages are this checkout's top-level folders
    sys.modules["k3rl"] = ModuleType("k3rl")
    sys.modules["k3rl"].__path__ = [str(ROOT)]

LOWER_BOUND = -5.0
GATES = {"lb": LOWER_BOUND, "softplus": None}
TOL = {torch.float32: dict(logits=5e-3, grad=2e-2), torch.bfloat16: dict(logits=3e-2, grad=1e-1)}
GATE_PARAMS, GATE_PARAM_FACTOR = ("A_log", "dt_bias"), 5.0
TIE_MARGIN = 1e-3
FAMILIES = ("chunk_kda", "fused_recurrent_kda", "attn_res", "moe", "situ")
TRAIN_FAMILIES = ("chunk_kda", "attn_res", "moe", "situ")
MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             attn_res_block_size=2, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32, num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=128,
             first_k_dense_replace=1, max_position_embeddings=32768,
             linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=4, head_dim=64))
SHAPES = dict(check=(2, 1000), groups=2, group_size=4, prompt=200, completion=(100, 300), decode_prompts=8,
              decode_new=64, decode_prompt=(48, 96), prefill=200, decode_batches=(1, 8, 32), decode_steps=32,
              train_T=(1000, 4096, 16384), train_dtypes=(torch.bfloat16, torch.float32))
TIME_BUDGET_S, MAX_REPS, MIN_REPS, DECODE_REPS = 1.0, 20, 3, 3
DEVICE = "cuda"
CALLS: Counter = Counter()  # every Triton entry call of this run, by family


def use_smoke_sizes():
    """--smoke-cpu: a 2-layer model (KDA, then MLA with MoE) and a few dozen tokens, so the interpreter is quick."""
    global DEVICE, TIME_BUDGET_S, MAX_REPS, MIN_REPS, DECODE_REPS
    DEVICE, TIME_BUDGET_S, MAX_REPS, MIN_REPS, DECODE_REPS = "cpu", 0.0, 1, 1, 1
    MODEL.update(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                 q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=4,
                 moe_intermediate_size=16, max_position_embeddings=512,
                 linear_attn_config=dict(kda_layers=[1], full_attn_layers=[2], num_heads=2, head_dim=16))
    SHAPES.update(check=(2, 45), groups=1, group_size=2, prompt=10, completion=(5, 9), decode_prompts=2, decode_new=4,
                  decode_prompt=(5, 9), prefill=21, decode_batches=(1, 2), decode_steps=2, train_T=(40,),
                  train_dtypes=(torch.float32,))


# ---------------------------------------------------------------- paths, counters, checks


def count_triton_entries():
    """Wrap each Triton entry point so that CALLS counts its calls."""
    import k3rl.kernels.attn_res as attn_res
    import k3rl.kernels.kda.chunk_triton as kda_chunk
    import k3rl.kernels.kda.recurrent_triton as kda_recurrent
    import k3rl.kernels.moe as moe
    import k3rl.kernels.situ.fused as situ

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            CALLS[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    kda_chunk.chunk_kda_triton = counted("chunk_kda", kda_chunk.chunk_kda_triton)
    kda_recurrent.fused_recurrent_kda_triton = counted("fused_recurrent_kda", kda_recurrent.fused_recurrent_kda_triton)
    attn_res.attn_res_mix_triton = counted("attn_res", attn_res.attn_res_mix_triton)
    moe.IMPLEMENTATIONS["triton"] = counted("moe", moe.IMPLEMENTATIONS["triton"])
    situ.situ_glu_triton = counted("situ", situ.situ_glu_triton)


@contextmanager
def kernel_path(path: str):
    """Run the block on the Triton ("triton") or PyTorch ("torch") paths; yields the Triton calls it makes."""
    old, before, calls = os.environ.pop("K3RL_DISABLE_TRITON", None), CALLS.copy(), Counter()
    if path == "torch":
        os.environ["K3RL_DISABLE_TRITON"] = "1"
    try:
        yield calls
    finally:
        calls.update(CALLS - before)
        os.environ.pop("K3RL_DISABLE_TRITON", None)
        if old is not None:
            os.environ["K3RL_DISABLE_TRITON"] = old


def add(rows: list, what: str, value: float, tol: float | None = None, ok: bool | None = None, detail: str = ""):
    """One check: passes when value < tol (NaN never does), or as `ok` says."""
    ok = bool(value < tol) if ok is None else ok and not math.isnan(value)
    rows.append(dict(what=what, value=value, tol=tol, ok=ok, detail=detail))


def add_calls(rows: list, label: str, path: str, calls: Counter, families: tuple[str, ...]):
    """The Triton run called every family; the torch run called none."""
    if path == "triton":
        missing = [f for f in families if not calls[f]]
        add(rows, f"{label}: Triton entries ran", min(calls[f] for f in families), ok=not missing,
            detail=f"{dict(calls)}" + (f"; missing {missing}" if missing else ""))
    else:
        add(rows, f"{label}: no Triton entry ran", sum(calls.values()), ok=not calls, detail=f"{dict(calls)}")


def rel_err(x: torch.Tensor | None, ref: torch.Tensor) -> float:
    if x is None:
        return math.inf
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build_model(lower_bound: float | None, dtype: torch.dtype, seed: int = 0):
    """A random K3 of MODEL on DEVICE in eval mode. The AttnRes queries (zero at init: a uniform mix) are drawn
    N(0, 1/d), so a mix's scores q·RMSNorm(v) are about N(0, 1): non-uniform, and not so peaked that bf16
    rounding flips which source dominates (at std 0.5, d = 256, the PyTorch bf16 path itself is 5e-2 off in logits)."""
    from k3rl.model.config import K3Config
    from k3rl.model.modeling import AttnResProj, K3ForCausalLM

    lac = dict(MODEL["linear_attn_config"], short_conv_kernel_size=4, gate_lower_bound=lower_bound,
               use_full_rank_gate=True)
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config(**dict(MODEL, linear_attn_config=lac)))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, AttnResProj):
                m.weight.normal_(0.0, MODEL["hidden_size"] ** -0.5)
    return model.to(device=DEVICE, dtype=dtype).eval()


def random_ids(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(3, MODEL["vocab_size"], shape, generator=gen).to(DEVICE)


# ---------------------------------------------------------------- 1. forward + backward


def logits_and_grads(model, ids, weights, routing=None):
    model.zero_grad(set_to_none=True)
    logits = model(ids, routed_expert_ids=routing).logits  # [B, T, V]
    w = weights if logits.dtype == torch.float64 else weights.float()
    (logits.to(w.dtype) * w).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_tol(name: str, dtype: torch.dtype) -> float:
    return TOL[dtype]["grad"] * (GATE_PARAM_FACTOR if name.endswith(GATE_PARAMS) else 1.0)


def step_forward_backward(rows: list, info: dict):
    B, T = SHAPES["check"]
    for gate, lb in GATES.items():
        model64 = build_model(lb, torch.float64)  # fp32-drawn weights: the fp32 model holds the same values
        gen = torch.Generator().manual_seed(1)
        ids = random_ids(gen, B, T)
        weights = torch.randn(B, T, MODEL["vocab_size"], generator=gen, dtype=torch.float64).to(DEVICE)
        for dtype in (torch.float32, torch.bfloat16):
            model = copy.deepcopy(model64).to(dtype)
            ref = model64 if dtype == torch.float32 else copy.deepcopy(model).double()  # on the rounded weights
            with kernel_path("torch") as calls:
                ref_logits, ref_grads = logits_and_grads(ref, ids, weights)
            add_calls(rows, f"{gate} gate, float64 reference ({str(dtype)[6:]} weights)", "torch", calls, ())
            routing = ref.last_routed_expert_ids()  # [B, T, n_moe, k]: replayed below
            for path in ("triton", "torch"):
                with kernel_path(path) as calls:
                    logits, grads = logits_and_grads(model, ids, weights, routing)
                    sync()
                label = f"{gate} gate, {path}, {str(dtype)[6:]}"
                add(rows, f"{label}: logits", rel_err(logits, ref_logits), TOL[dtype]["logits"])
                errs = {n: rel_err(grads.get(n), g) for n, g in ref_grads.items()}
                worst = max(errs, key=lambda n: math.inf if math.isnan(errs[n]) else errs[n] / grad_tol(n, dtype))
                add(rows, f"{label}: worst grad ({worst})", errs[worst], grad_tol(worst, dtype),
                    detail=f"largest error {max(errs.values()):.2e} ({max(errs, key=errs.get)})")
                add_calls(rows, label, path, calls, TRAIN_FAMILIES)
                info[label] = dict(grad_errors=errs, calls=dict(calls))
            del model, ref


# ---------------------------------------------------------------- 2. the learner step


def make_trajectories(model64) -> list:
    """Groups sharing a prompt, random completions; behaviour logprobs and routing from the float64 model."""
    from k3rl.rollout.trajectory import Trajectory

    gen = torch.Generator().manual_seed(5)
    P, (lo, hi) = SHAPES["prompt"], SHAPES["completion"]
    out = []
    for g in range(SHAPES["groups"]):
        prompt = random_ids(gen, P)
        for j in range(SHAPES["group_size"]):
            tokens = torch.cat([prompt, random_ids(gen, int(torch.randint(lo, hi + 1, (1,), generator=gen)))])
            N = len(tokens)
            with torch.no_grad(), kernel_path("torch"):
                logits = model64(tokens[None]).logits[0]  # [N, V]
                routed = model64.last_routed_expert_ids()[0]  # [N, n_moe, k]
            logp = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[1:, None])[:, 0]  # [N-1]
            mask = np.zeros(N, dtype=np.uint8)
            mask[P:] = 1
            behaviour = np.concatenate([[0.0], logp.cpu().numpy()]) * mask
            out.append(Trajectory(tokens=tokens.cpu().numpy().astype(np.int32), loss_mask=mask,
                                  logprobs=behaviour.astype(np.float32), versions=np.where(mask == 1, 0, -1),
                                  turn_spans=np.array([[P, N]], dtype=np.int32), prompt_len=P, reward=float(j % 2),
                                  group_id=f"g{g}", task_id=f"t{g}", routed_experts=routed.cpu().numpy().astype(np.int16)))
    return out


def step_learner(rows: list, info: dict):
    from k3rl.model.formats.save import save_model
    from k3rl.rl.train.learner import Learner, LearnerConfig

    model = build_model(LOWER_BOUND, torch.float32)
    trajectories = make_trajectories(copy.deepcopy(model).double())
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model.cpu(), tmp)
        for label, dtype, path in (("float64", "float64", "torch"), ("triton", "float32", "triton"),
                                   ("torch", "float32", "torch")):
            cfg = LearnerConfig(model_path=tmp, device=DEVICE, dtype=dtype, lr=1e-4, compute_entropy=True,
                                micro_batch_tokens=4096)
            with kernel_path(path) as calls:
                learner = Learner(cfg)
                before = np.concatenate(learner.score(trajectories))
                metrics = learner.train_step(trajectories)
                after = np.concatenate(learner.score(trajectories))
            runs[label] = dict(before=before, after=after, metrics=metrics, calls=calls)
            add(rows, f"learner {label}: step not skipped", metrics["skipped"], ok=metrics["skipped"] == 0.0,
                detail=metrics["skip_reason"])
            add_calls(rows, f"learner {label}", path, calls, TRAIN_FAMILIES)
            del learner
    ref = runs["float64"]
    for label in ("triton", "torch"):
        run, tol = runs[label], TOL[torch.float32]
        for when in ("before", "after"):
            add(rows, f"learner {label}: log π {when} the step", rel_err(torch.from_numpy(run[when]),
                                                                         torch.from_numpy(ref[when])), tol["logits"])
        m, m_ref = run["metrics"], ref["metrics"]
        add(rows, f"learner {label}: grad_norm", abs(m["grad_norm"] / m_ref["grad_norm"] - 1), tol["grad"])
        add(rows, f"learner {label}: entropy", abs(m["entropy"] / m_ref["entropy"] - 1), tol["logits"])
        add(rows, f"learner {label}: |Δ loss|", abs(m["loss"] - m_ref["loss"]), tol["logits"])
    info["metrics"] = {label: {k: v for k, v in r["metrics"].items() if not k.startswith("maxvio/")}
                       for label, r in runs.items()}
    info["driver"] = "rl.train.learner.Learner"


# ---------------------------------------------------------------- 3. decode


def step_decode(rows: list, info: dict):
    from k3rl.rollout.engine import SamplingParams
    from k3rl.rollout.torch_engine import TorchEngine

    model = build_model(LOWER_BOUND, torch.float32)
    model64 = copy.deepcopy(model).double()
    engine = TorchEngine(model, SimpleNamespace(eos_token_id=None, pad_token_id=0), device=DEVICE)
    gen = torch.Generator().manual_seed(7)
    lo, hi = SHAPES["decode_prompt"]
    prompts = [random_ids(gen, int(torch.randint(lo, hi + 1, (1,), generator=gen))).tolist()
               for _ in range(SHAPES["decode_prompts"])]
    params = SamplingParams(n=1, temperature=0.0, max_tokens=SHAPES["decode_new"])
    tokens = {}
    for path in ("triton", "torch"):
        with kernel_path(path) as calls:
            tokens[path] = [c[0].token_ids for c in engine.generate(prompts, params)]
        add_calls(rows, f"greedy decode, {path}", path, calls, FAMILIES)
    divergences = []
    for i, (a, b) in enumerate(zip(tokens["triton"], tokens["torch"])):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            continue
        context = torch.tensor([prompts[i] + a[:j]], device=DEVICE)
        with torch.no_grad():
            with kernel_path("torch"):
                l64 = model64(context).logits[0, -1]  # [V]
            with kernel_path("triton"):
                err = (model(context).logits[0, -1].double() - l64).abs().max().item()
        margin = abs(l64[a[j]] - l64[b[j]]).item()
        divergences.append(dict(prompt=i, step=j, margin=margin, triton_logit_err=err,
                                explained=margin < max(TIE_MARGIN, 2 * err)))
    same = sum(a == b for a, b in zip(tokens["triton"], tokens["torch"]))
    add(rows, "greedy decode: Triton vs torch tokens", len(divergences),
        ok=all(d["explained"] for d in divergences),
        detail=f"{same}/{len(prompts)} identical" + "".join(
            f"; prompt {d['prompt']} diverges at {d['step']}, float64 margin {d['margin']:.1e} "
            f"({'a near-tie' if d['explained'] else 'NOT a near-tie'})" for d in divergences))
    info["divergences"] = divergences

    # prefill + decode steps through Triton against the float64 full forward
    Tp, n = SHAPES["prefill"], 4
    ids = random_ids(gen, 2, Tp + n)
    with torch.no_grad():
        with kernel_path("torch"):
            full = model64(ids).logits
        with kernel_path("triton") as calls:
            out = model(ids[:, :Tp], use_cache=True)
            steps = [out.logits] + [model(ids[:, t:t + 1], cache=out.cache).logits for t in range(Tp, Tp + n)]
    add(rows, f"prefill {Tp} + {n} decode steps vs full forward: logits", rel_err(torch.cat(steps, 1), full),
        TOL[torch.float32]["logits"])
    add_calls(rows, "prefill + decode", "triton", calls, ("chunk_kda", "fused_recurrent_kda"))
    info["timing"] = [time_decode(engine, path, B) for B in SHAPES["decode_batches"] for path in ("triton", "torch")]


def time_decode(engine, path: str, B: int) -> dict:
    """The model's decode step alone (prefill untimed) and the engine's loop (generate N+1 tokens minus 1)."""
    from k3rl.rollout.engine import SamplingParams

    gen = torch.Generator().manual_seed(11)
    P, N = SHAPES["decode_prompt"][1], SHAPES["decode_steps"]
    ids = random_ids(gen, B, P)

    @torch.no_grad()
    def model_steps() -> float:
        logits, state = engine.policy.prefill(ids, torch.ones_like(ids), P + N + 1)
        sync()
        t0 = time.perf_counter()
        for _ in range(N):
            logits, state = engine.policy.decode(logits.argmax(-1), state)
        sync()
        return time.perf_counter() - t0

    def generate(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        engine.generate(ids.tolist(), SamplingParams(n=1, temperature=0.0, max_tokens=n))
        sync()
        return time.perf_counter() - t0

    with kernel_path(path):
        model_steps(), generate(N + 1)  # warm-up
        model_s = statistics.median(model_steps() for _ in range(DECODE_REPS))
        engine_s = statistics.median(generate(N + 1) for _ in range(DECODE_REPS))
        engine_s -= statistics.median(generate(1) for _ in range(DECODE_REPS))
    return dict(B=B, path=path, prompt=P, steps=N, step_ms=model_s / N * 1e3, model_tok_s=B * N / model_s,
                engine_tok_s=B * N / engine_s if engine_s > 0 else None)


# ---------------------------------------------------------------- 4. training step time


def timed(fn) -> tuple[float, int]:
    """Median ms of fn() after one warm-up call, each call between two synchronizes."""
    fn()
    times, reps = [], MAX_REPS
    while len(times) < reps:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if len(times) == 1:
            reps = max(MIN_REPS, min(MAX_REPS, int(TIME_BUDGET_S * 1e3 / max(times[0], 1e-3))))
    return statistics.median(times), len(times)


def step_train_time(rows: list, info: dict):
    gen = torch.Generator().manual_seed(13)
    info["timing"] = []
    for dtype in SHAPES["train_dtypes"]:
        model = build_model(LOWER_BOUND, dtype)
        for T in SHAPES["train_T"]:
            ids = random_ids(gen, 1, T)

            def fn():
                model.zero_grad(set_to_none=True)
                model(ids, labels=ids).loss.backward()

            for path in ("triton", "torch"):
                row = dict(T=T, dtype=str(dtype)[6:], path=path, ms=None)
                try:
                    with kernel_path(path) as calls:
                        row["ms"], row["reps"] = timed(fn)
                    if T == SHAPES["train_T"][0]:
                        add_calls(rows, f"train time {row['dtype']} T={T}, {path}", path, calls, TRAIN_FAMILIES)
                except torch.cuda.OutOfMemoryError:
                    row["skipped"] = "out of memory"
                info["timing"].append(row)
                model.zero_grad(set_to_none=True)
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()


# ---------------------------------------------------------------- tables and main


def fmt(v, spec=".3g") -> str:
    return "—" if v is None else f"{v:{spec}}"


def tables(result: dict) -> str:
    lines = ["| step | check | value | tol | ok | detail |", "|---|---|---|---|---|---|"]
    for name, step in result["steps"].items():
        if step.get("error"):
            lines.append(f"| {name} | raised | — | — | NO | {step['error'].strip().splitlines()[-1]} |")
        for c in step["checks"]:
            lines.append(f"| {name} | {c['what']} | {fmt(c['value'], '.2e')} | {fmt(c['tol'], '.0e')} | "
                         f"{'yes' if c['ok'] else 'NO'} | {c['detail']} |")
    learner = result["steps"].get("learner", {}).get("info", {}).get("metrics", {})
    if learner:
        keys = ("loss", "grad_norm", "entropy", "mismatch_kl", "step_time_s")
        lines += ["", "| learner | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {label} | " + " | ".join(fmt(m.get(k), ".5g") for k in keys) + " |" for label, m in learner.items()]
    decode = result["steps"].get("decode", {}).get("info", {}).get("timing", [])
    if decode:
        lines += ["", "| decode B | path | step ms | model tok/s | engine tok/s |", "|---|---|---|---|---|"]
        lines += [f"| {r['B']} | {r['path']} | {r['step_ms']:.2f} | {r['model_tok_s']:.0f} | {fmt(r['engine_tok_s'], '.0f')} |"
                  for r in decode]
    train = result["steps"].get("train_time", {}).get("info", {}).get("timing", [])
    if train:
        lines += ["", "| train T | dtype | path | fwd+bwd ms | torch ÷ triton |", "|---|---|---|---|---|"]
        by = {(r["T"], r["dtype"], r["path"]): r for r in train}
        for r in train:
            other = by.get((r["T"], r["dtype"], "torch"))
            ratio = other["ms"] / r["ms"] if r["path"] == "triton" and other and other["ms"] and r["ms"] else None
            lines.append(f"| {r['T']} | {r['dtype']} | {r['path']} | {fmt(r['ms'], '.2f')} "
                         f"{r.get('skipped', '')}| {fmt(ratio, '.2f')} |")
    return "\n".join(lines)


STEPS = {"forward_backward": step_forward_backward, "learner": step_learner, "decode": step_decode,
         "train_time": step_train_time}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/out"))
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="run every step at tiny shapes on the CPU (Triton interpreted) to test this script")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)} (default: all)")
    args = ap.parse_args(argv)
    chosen = args.steps.split(",")
    if unknown := [s for s in chosen if s not in STEPS]:
        ap.error(f"--steps: unknown {unknown}; choose from {list(STEPS)}")
    if args.smoke_cpu:
        use_smoke_sizes()
    elif not torch.cuda.is_available():
        print("bench/gpu_model.py needs a CUDA GPU; none is visible here (torch.cuda.is_available() is False). "
              "Nothing was measured.")
        return 0
    import triton

    count_triton_entries()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (--smoke-cpu)"
    print(f"{name}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    start = time.perf_counter()
    result = dict(meta=dict(device=name, torch=torch.__version__, triton=triton.__version__, smoke=args.smoke_cpu,
                            model=MODEL, shapes={k: str(v) for k, v in SHAPES.items()},
                            tolerances={str(k)[6:]: v for k, v in TOL.items()},
                            date=datetime.datetime.now().isoformat(timespec="seconds")), steps={})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for step, fn in ((s, STEPS[s]) for s in chosen):
        rows, info, t0 = [], {}, time.perf_counter()
        entry = dict(checks=rows, info=info, error=None)
        try:
            fn(rows, info)
        except Exception:
            entry["error"] = traceback.format_exc()
            print(entry["error"], file=sys.stderr)
        entry["seconds"] = time.perf_counter() - t0
        entry["ok"] = entry["error"] is None and all(c["ok"] for c in rows)
        result["steps"][step] = entry
        print(f"{step}: {'ok' if entry['ok'] else 'FAILED'} ({entry['seconds']:.1f} s)", flush=True)
        # written after every step, so a run cut short still leaves what it measured
        result.update(triton_calls=dict(CALLS), seconds=time.perf_counter() - start,
                      ok=all(s["ok"] for s in result["steps"].values()))
        md = tables(result)
        (out / "gpu_model.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "gpu_model.md").write_text(f"{name}, torch {torch.__version__}, triton {triton.__version__}; "
                                          f"{result['seconds']:.0f} s\n\n{md}\n")
    print(f"\n{md}\n\nwrote {out / 'gpu_model.json'} and {out / 'gpu_model.md'} in {result['seconds']:.0f} s; "
          f"{'all checks passed' if result['ok'] else 'SOME CHECKS FAILED'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
