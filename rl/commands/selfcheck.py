"""`k3rl selfcheck`: prove the stack works on this machine, end to end, in about a minute.

Three checks, each a real run with a numeric verdict:
1. Ray: start (or join) a cluster, create an actor, round-trip a tensor through it.
2. Triton: the fused SiTU-GLU kernel (under TRITON_INTERPRET=1 when there is no GPU) against the
   float64 PyTorch reference, forward and backward.
3. vLLM: a tiny Qwen3 and tokenizer built on the spot; vLLM samples from it and its per-token
   logprobs must match a transformers forward pass over the same tokens within 1e-4.
The verdicts are printed as a table and written to `<run dir>/selfcheck.json`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from k3rl.rl.commands.cli import config_parser

LOGPROB_TOL = 1e-4
TRITON_TOL = 1e-4


def check_ray(ray_cfg) -> dict:
    import numpy as np
    import ray

    from k3rl.rl.orchestrator.cluster import init_ray

    t0 = time.perf_counter()
    init_ray(ray_cfg, log_to_driver=False)
    started = time.perf_counter() - t0

    @ray.remote(num_cpus=0)
    class Accumulator:
        def __init__(self):
            self.total = None

        def add(self, x):
            self.total = x if self.total is None else self.total + x
            return self.total, ray.get_runtime_context().get_node_id()

    actor = Accumulator.remote()
    x = np.random.default_rng(0).standard_normal((256, 256))
    ray.get(actor.add.remote(np.zeros_like(x)))
    t1 = time.perf_counter()
    total, node = ray.get(actor.add.remote(x))
    rtt = time.perf_counter() - t1
    ok = bool(np.array_equal(total, x))
    ray.kill(actor)
    return {"ok": ok, "detail": f"{len(ray.nodes())} node(s), actor on {node[:8]}, 512 KiB round trip "
                                f"{rtt * 1e3:.1f} ms, cluster ready in {started:.1f} s"}


def check_triton() -> dict:
    import torch

    interpreted = not torch.cuda.is_available()
    if interpreted:
        os.environ["TRITON_INTERPRET"] = "1"
    from k3rl.kernels.situ import naive_situ_glu, situ_glu_triton

    device = "cpu" if interpreted else "cuda"
    gen = torch.Generator().manual_seed(0)
    g, u, dy = (torch.randn(4, 777, generator=gen) * 4 for _ in range(3))
    g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
    ref = naive_situ_glu(g64, u64, 4.0, 25.0)
    ref.backward(dy.double())
    gt, ut = g.to(device).requires_grad_(), u.to(device).requires_grad_()
    out = situ_glu_triton(gt, ut, 4.0, 25.0)
    out.backward(dy.to(device))

    def rel(a, b):
        return ((a.detach().double().cpu() - b.detach()).norm() / b.detach().norm()).item()

    errs = {"y": rel(out, ref), "dgate": rel(gt.grad, g64.grad), "dup": rel(ut.grad, u64.grad)}
    kda_errs = _check_kda_chunk(device, rel)
    mode = "interpreter (CPU)" if interpreted else torch.cuda.get_device_name()
    return {"ok": max(errs.values()) < TRITON_TOL and max(kda_errs.values()) < TRITON_TOL,
            "detail": f"on {mode}, rel. error: SiTU-GLU " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
                      + "; chunked KDA (gate in-kernel, lb −5) "
                      + ", ".join(f"{k} {v:.1e}" for k, v in kda_errs.items())}


def _check_kda_chunk(device: str, rel) -> dict:
    """The Triton chunked KDA (forward + backward, fused lower-bound gate) on 40 tokens vs the float64 recurrence."""
    import torch

    from k3rl.kernels.kda import FusedGate, kda_gate, naive_recurrent_kda
    from k3rl.kernels.kda.chunk_triton import chunk_kda_triton

    gen = torch.Generator().manual_seed(1)
    B, T, H, K = 1, 40, 2, 16
    q, k, v, f = (torch.randn(B, T, H, K, generator=gen) for _ in range(4))
    beta, A_log = torch.rand(B, T, H, generator=gen), torch.randn(H, generator=gen)
    do = torch.randn(B, T, H, K, generator=gen)
    ref_in = [x.double().requires_grad_() for x in (q, k, v, f, beta)]
    o_ref, _ = naive_recurrent_kda(*ref_in[:3], kda_gate(ref_in[3], A_log.double(), None, -5.0), ref_in[4],
                                   use_qk_l2norm_in_kernel=True)
    o_ref.backward(do.double())
    got_in = [x.to(device).requires_grad_() for x in (q, k, v, f, beta)]
    o, _ = chunk_kda_triton(*got_in[:3], FusedGate(got_in[3], A_log.to(device), None, -5.0), got_in[4],
                            use_qk_l2norm_in_kernel=True)
    o.backward(do.to(device))
    return {"o": rel(o, o_ref), **{f"d{n}": rel(a.grad, b.grad) for n, a, b in zip("qkvf", got_in, ref_in)}}


def check_vllm(work_dir: Path) -> dict:
    from k3rl.rollout.vllm_cpu import configure_cpu_env, make_cpu_llm

    configure_cpu_env()
    import torch
    import vllm

    from k3rl.model.policy import load_policy
    from k3rl.model.tokenizer import load_tokenizer
    from k3rl.rollout.tiny_qwen3 import build_tiny_qwen3

    model_dir = build_tiny_qwen3(work_dir / "tiny-qwen3")
    tokenizer = load_tokenizer(model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Which module parses JSON?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    llm = make_cpu_llm(str(model_dir), max_model_len=512)
    params = vllm.SamplingParams(n=2, max_tokens=24, temperature=1.0, logprobs=0, seed=0)
    out = llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    # the toolkit's own scoring path (the learner's): final hidden states → chunked selected log-probs
    policy = load_policy(model_dir, dtype=torch.float32)
    policy.model.eval()
    worst, n_tokens = 0.0, 0
    for sample in out.outputs:
        ids = list(sample.token_ids)
        seq = torch.tensor([prompt + ids])  # [1, P + n]
        rows = torch.zeros_like(seq, dtype=torch.bool)
        rows[0, len(prompt) - 1:-1] = True  # the positions that predict the sampled tokens
        with torch.no_grad():
            hidden = policy.final_hidden(seq, attention_mask=torch.ones_like(seq), rows=rows)  # [n, d]
            ref = policy.selected_logprobs(hidden, torch.tensor(ids)).double()  # [n]
        got = torch.tensor([step[tok].logprob for step, tok in zip(sample.logprobs, ids)], dtype=torch.float64)
        worst = max(worst, (ref - got).abs().max().item())
        n_tokens += len(ids)
    text = tokenizer.decode(out.outputs[0].token_ids)
    return {"ok": worst < LOGPROB_TOL,
            "detail": f"vLLM {vllm.__version__}: {n_tokens} sampled tokens, max |logprob − transformers| "
                      f"{worst:.1e} (tolerance {LOGPROB_TOL:g}); sample {text[:40]!r}"}


def main(argv: list[str]) -> int:
    parser = config_parser("k3rl selfcheck", __doc__.splitlines()[0])
    parser.set_defaults(config=None)
    parser.add_argument("--skip", action="append", default=[], choices=["ray", "triton", "vllm"],
                        help="leave out a check (repeatable)")
    args = parser.parse_args(argv) if argv else parser.parse_args(["configs/rl/quickstart.yaml"])
    from rich.console import Console
    from rich.table import Table

    from k3rl.rl.config import load_config

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(cfg.run.output_dir) / "selfcheck"
    run_dir.mkdir(parents=True, exist_ok=True)
    console = Console()
    checks = {"ray": lambda: check_ray(cfg.ray), "triton": check_triton, "vllm": lambda: check_vllm(run_dir)}
    results = {}
    for name, check in checks.items():
        if name in args.skip:
            continue
        with console.status(f"[bold]checking {name}…"):
            t0 = time.perf_counter()
            try:
                results[name] = check()
            except Exception as e:  # a failed check is reported, and the others still run
                results[name] = {"ok": False, "detail": f"{type(e).__name__}: {e}"}
            results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        console.print(f"{'[green]✓' if results[name]['ok'] else '[red]✗'}[/] {name}: {results[name]['detail']}")
    table = Table(title="k3rl selfcheck")
    for col in ("check", "ok", "seconds", "detail"):
        table.add_column(col, overflow="fold")
    for name, r in results.items():
        table.add_row(name, "yes" if r["ok"] else "NO", str(r["seconds"]), r["detail"])
    console.print(table)
    (run_dir / "selfcheck.json").write_text(json.dumps(results, indent=2))
    console.print(f"wrote {run_dir / 'selfcheck.json'}")
    return 0 if all(r["ok"] for r in results.values()) else 1
