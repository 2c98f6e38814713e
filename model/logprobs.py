"""Log-probabilities of chosen tokens through the LM head, in chunks, never materialising [N, V] logits.

    logits = scale · hidden @ Wᵀ         hidden [N, d], W [V, d]
    out[n] = log_softmax(logits[n])[targets[n]]        entropy[n] = −Σ_v p_nv log p_nv

With a 160K vocabulary, the fp32 logits of 100K loss tokens are 64 GB; frameworks that compute
them for the whole packed batch (and keep them, or their softmax, for backward) are what run out
of memory at long context (slime #2253, #1523). Here a custom autograd Function walks the rows in
chunks of `chunk_size`: the forward keeps only the per-row log-sum-exp [N]; the backward
recomputes each chunk's logits and turns them straight into the chunk's gradients for hidden and
W. Peak extra memory is one [chunk, V] block (fp32) plus the fp32 gradient of W, whatever N is.

Call it on the loss-mask rows only (hidden of the position before each sampled token): the
prompt and tool-output rows never reach the LM head. `scale` folds in a logit multiplier or 1/T.
Matmuls run in the inputs' dtype; softmax, log-sum-exp and entropy in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    """[C, d] × [V, d] -> [C, V] logits in the compute dtype."""
    return (h @ weight.T).to(_compute_dtype(h.dtype)) * scale


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size: int, scale: float, with_entropy: bool):
        n = hidden.shape[0]
        dtype = _compute_dtype(hidden.dtype)
        logp = torch.zeros(n, dtype=dtype, device=hidden.device)  # [N]
        lse = torch.zeros(n, dtype=dtype, device=hidden.device)  # [N]
        entropy = torch.zeros(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(hidden[rows], weight, scale)  # [C, V]
            lse[rows] = torch.logsumexp(logits, dim=-1)
            logp[rows] = logits.gather(-1, targets[rows, None])[:, 0] - lse[rows]
            if with_entropy:
                p = torch.exp(logits - lse[rows, None])  # [C, V]
                entropy[rows] = lse[rows] - torch.einsum("cv,cv->c", p, logits)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size, ctx.scale, ctx.with_entropy = chunk_size, scale, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        dtype = lse.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        use_entropy = ctx.with_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]
            # two [C, V] buffers, updated in place: log p (then the logits' gradient) and p
            log_p = _chunk_logits(h, weight, ctx.scale).sub_(lse[rows, None])  # [C, V]
            p = torch.exp(log_p)  # [C, V]
            g_lp = grad_logp[rows, None]  # [C, 1]
            if use_entropy:
                # d H / d logits_v = −p_v (log p_v + H)
                ent = -torch.einsum("cv,cv->c", p, log_p)[:, None]  # [C, 1]
                g = log_p.add_(ent).mul_(p).mul_(-grad_entropy[rows, None])
                g.sub_(p.mul_(g_lp))
            else:
                g = p.mul_(-g_lp)
            # d logp_target / d logits = onehot(target) − p
            g.scatter_add_(-1, targets[rows, None], g_lp)
            g.mul_(ctx.scale)
            if need_h:
                grad_h[rows] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w += g.T @ h.to(dtype)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def selected_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      chunk_size: int = 1024, scale: float = 1.0,
                      return_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(scale · hidden @ weightᵀ)[n, targets[n]] for every row, computed `chunk_size` rows at a time.

    Args:
        hidden: [N, d] final hidden states (after the final norm) of the rows to score.
        weight: [V, d] LM-head weight.
        targets: [N] int64 token ids in [0, V).
        chunk_size: rows per chunk; peak extra memory is about chunk_size × V × 4 bytes (×3 in backward).
        scale: logit multiplier (a model's logit scale, or 1/temperature).
        return_entropy: also return the entropy of each row's distribution [N] (differentiable).

    Returns logprobs [N] in fp32 (fp64 for fp64 inputs), or (logprobs [N], entropy [N]).
    Differentiable with respect to hidden and weight.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, d] and weight [V, d] expected, got {list(hidden.shape)} and {list(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {list(targets.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: must be > 0, got {chunk_size}")
    logp, entropy = _SelectedLogprobs.apply(hidden, weight, targets.long(), chunk_size, float(scale), return_entropy)
    return (logp, entropy) if return_entropy else logp


def naive_selected_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain reference: full [N, V] logits at once; (logprobs [N], entropy [N])."""
    logits = (hidden @ weight.T).to(_compute_dtype(hidden.dtype)) * scale  # [N, V]
    log_p = torch.log_softmax(logits, dim=-1)
    return log_p.gather(-1, targets.long()[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


__all__ = ["naive_selected_logprobs", "selected_logprobs"]
