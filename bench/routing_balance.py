"""Router balance per step: quantile balancing (QB) vs the DeepSeek sign update vs none.

One K3 router (`model.moe.Router`, E=64 experts, top-8, sigmoid scores) with a strong
per-expert skew: its logits are `skew_j + w_j·x_i`, skew_j ~ N(0, 1) carried by a constant input
feature, token noise w_j·x_i with std ≈ 1. The router weights are kept FIXED (no training), so
the imbalance is stationary and only the bias moves. Each step draws a fresh batch of tokens,
runs the router in training mode (collecting statistics) and calls `balance_routers`, exactly
as a learner does after `optimizer.step()`. MaxVio `(max_j load_j − T)/T` of step t is measured
on batch t with the bias of steps < t, i.e. out of sample. With m tokens per step the sampling
noise alone gives a MaxVio floor of about 2.5·sqrt((1 − k/E)/T), T = m·k/E.

    python bench/routing_balance.py [--steps 120] [--tokens 65536] [--out bench/out/routing_balance.png]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

METHODS = [("quantile (step 0.5)", "quantile", dict(step_size=0.5)),
           ("sign (γ=1e-3)", "sign", dict(sign_gamma=1e-3)),
           ("sign (γ=1e-2)", "sign", dict(sign_gamma=1e-2)),
           ("none", "none", {})]
REPORT_STEPS = (1, 10, 25, 50, 100)
# Run as a plain script from anywhere: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--tokens", type=int, default=65536, help="tokens per step (the global batch)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--out", default="bench/out/routing_balance.png")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def run(method: str, kw: dict, args) -> list[float]:
    import torch

    from k3rl.model.config import ModelConfig, RouterBalanceConfig
    from k3rl.model.moe import Router
    from k3rl.rl.train.router_balance import balance_routers

    d = 64
    cfg = ModelConfig(hidden_size=d, num_experts=args.experts, num_experts_per_token=args.top_k,
                      router_balance=RouterBalanceConfig(method=method, **kw))
    torch.manual_seed(args.seed)
    router = Router(cfg).train()
    with torch.no_grad():
        router.weight.normal_(0, 1 / (d - 1) ** 0.5)
        router.weight[:, 0] = torch.randn(args.experts)
    router.weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(args.seed + 1)
    history = []
    for _ in range(args.steps):
        x = torch.randn(args.tokens, d, generator=gen)  # [m, d]
        x[:, 0] = 1.0
        router(x)
        history.append(balance_routers(router)[""])
    return history


def main() -> None:
    args = parse_args()
    import torch

    torch.manual_seed(args.seed)
    results = {}
    for label, method, kw in METHODS:
        t0 = time.time()
        results[label] = run(method, kw, args)
        print(f"# {label}: {time.time() - t0:.1f}s", file=sys.stderr)

    steps = [s for s in REPORT_STEPS if s <= args.steps]
    print(f"MaxVio per step, E={args.experts}, top-{args.top_k}, {args.tokens} tokens/step, fixed skewed router")
    print("| method | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for label, hist in results.items():
        print(f"| {label} | " + " | ".join(f"{hist[s - 1]:.3f}" for s in steps) + " |")
    qb = results[METHODS[0][0]]
    first = next((i + 1 for i, v in enumerate(qb) if v <= 0.05), None)
    tail = f"; max over steps 50..{args.steps}: {max(qb[49:]):.3f}" if len(qb) >= 50 else ""
    print(f"QB first step with MaxVio ≤ 0.05: {first}{tail}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, hist in results.items():
        ax.plot(range(1, len(hist) + 1), hist, label=label)
    ax.axhline(0.05, color="gray", linestyle="--", linewidth=0.8)
    ax.set(yscale="log", xlabel="step", ylabel="MaxVio (batch)",
           title=f"Router balance: E={args.experts}, top-{args.top_k}, {args.tokens} tokens/step")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
