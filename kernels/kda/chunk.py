"""Chunked KDA for training and prefill (docs/model_spec.md §5.5, §5.7): the WY / UT-transform form in plain PyTorch.

Chunks of C = 64 tokens, split into four 16-token sub-chunks. With Γ_t the chunk-local cumsum of g and S₀
the state entering the chunk (here stored as h = S₀ᵀ ∈ R^{K×V}):

    Aqk[t, j] = Σ_c q_t[c] k_j[c] e^{Γ_t[c] − Γ_j[c]}          (j ≤ t)
    Akk[t, j] = β_t Σ_c k_t[c] k_j[c] e^{Γ_t[c] − Γ_j[c]}      (j < t)
    [w | u]   = (I + Akk)⁻¹ [β ⊙ K ⊙ e^{Γ} | β ⊙ V]
    Vnew = u − w h,   O = (Q ⊙ e^{Γ}) h + Aqk Vnew,   h ← e^{Γ_C} ⊙ h + (K ⊙ e^{Γ_C − Γ})ᵀ Vnew

Everything except the last line is computed for all chunks at once; only the state pass h → h is a loop
over chunks (two matmuls per chunk). Autograd differentiates the whole thing. Inputs longer than
SEGMENT_TOKENS token-heads run in segments of whole chunks with the state carried (same math, bounded
buffers).

The pair decays e^{Γ_t − Γ_j} are never formed as e^{Γ_t} · e^{−Γ_j} over a chunk (e^{−Γ_j} overflows).
The rows of sub-chunk i are factored through its midpoint n_i (§5.7): a_t e^{Γ_t − Γ_{n_i}} against
k_j e^{Γ_{n_i} − Γ_j}. Left of the diagonal tile the column factor is ≤ 1; inside the tile both factors are
within e^{±span}, span = max |Γ_t − Γ_{n_i}|, and with the lower-bound gate span < 8·|lb| ≤ 40 nats, so
each row sub-chunk is one plain matmul (no token-pair special path).
If any tile's span exceeds `SAFE_SPAN` (the unbounded softplus gate can do that), the call takes the safe
path: off-diagonal blocks factored through the start r of the row's sub-chunk, e^{Γ_t − r} · e^{r − Γ_j}
(both ≤ 1, safe for any gate); diagonal tiles by the midpoint matmul with clamped exponents, and the tiles
beyond SAFE_SPAN recomputed exactly from the pairwise differences e^{Γ_t − Γ_j}, j ≤ t (vLLM's
token-parallel path). Exponents are floored (`EXP_FLOOR`) only where the result is below resolution.
(I + Akk)⁻¹ is built by block forward substitution (triangular solves on the 16×16 diagonal blocks,
matmuls for the rest) and applied to [βV | βK e^Γ] in one matmul.

Inputs are padded with zeros to a multiple of 64 (a padded token has k = 0, β = 0, g = 0: it leaves the
state alone), bf16/fp16 inputs are computed in float32, the output is returned in the input dtype and the
final state in the compute dtype. With `cu_seqlens` (packed variable-length sequences) each sequence is
padded to a multiple of 64 and the chunks of all sequences are processed as one flat list; only the state
pass arranges them as [step, sequence] to run the sequences side by side (`ChunkedVarlen`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3rl.kernels.kda.utils import ChunkedVarlen, check_inputs, compute_dtype, prepare_qk

CHUNK_SIZE = 64
SUB_CHUNK = 16
N_SUB = CHUNK_SIZE // SUB_CHUNK
# Largest |Γ_t − Γ_n| (nats) around a 16-token tile's midpoint n for which the tile is one matmul of factors
# e^{±span}: normal numbers of the compute dtype. fp32: 48 > 8·|lb| = 40, so every lower-bound gate qualifies.
SAFE_SPAN = {torch.float32: 48.0, torch.float64: 300.0}
# Token-heads (B·T·H) per segment of a long input, see `_chunk`.
SEGMENT_TOKENS = 8192
# Decays are floored at e^-80 (fp32) / e^-700 (fp64) before exp: below that the CPU's exp takes a slow path
# for underflowing results (12-35x slower). Times a factor of at most e^{SAFE_SPAN}, the floor leaves an
# error under e^-32 (fp32) / e^-400 (fp64) of |q||k|: nothing a result can resolve.
EXP_FLOOR = {torch.float32: -80.0, torch.float64: -700.0}


def _decay(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for a log decay x ≤ 0, floored at exp(EXP_FLOOR)."""
    return x.clamp_min(EXP_FLOOR[x.dtype]).exp()


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA in chunked form; same results as `naive_recurrent_kda` for any T.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log decay ≤ 0 (e.g. `kda_gate`); beta: [B, T, H].
        scale: multiplies q; default K^-1/2.
        initial_state: [B, H, K, V] (or [N, H, K, V] with cu_seqlens); zeros if None.
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (docs/model_spec.md §5.1; the K3 layer passes True).
        cu_seqlens: int64 [N + 1] boundaries of N sequences packed along T (then B must be 1).

    Returns:
        o [B, T, H, V] in the input dtype, final state [B or N, H, K, V] (compute dtype) or None.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens is None:
        return _chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)
    varlen = ChunkedVarlen.build(cu_seqlens, CHUNK_SIZE)
    flat = [varlen.pack(x, CHUNK_SIZE) for x in (q, k, v, g, beta)]  # [1, chunks·64, H, ·]
    o, state = _chunk(*flat, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, varlen)
    return varlen.unpack(o), state


def _to_chunks(x: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """[B, T_pad, H, D] -> [N, B, H, 4, 16, D], chunk-major so the state pass reads contiguous chunks."""
    return x.unflatten(1, (n_chunks, N_SUB, SUB_CHUNK)).permute(1, 0, 4, 2, 3, 5).contiguous()


def _chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, varlen=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    q, k = prepare_qk(q, k, scale, use_qk_l2norm_in_kernel, dtype)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    n_states = B if varlen is None else varlen.loop_idx.shape[1]
    h = q.new_zeros(n_states, H, K, V) if initial_state is None else initial_state.to(dtype)  # [B or N, H, K, V]
    if T == 0:
        return v.new_zeros(B, 0, H, V).to(out_dtype), (h if output_final_state else None)

    pad = -T % CHUNK_SIZE
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    beta = beta.unsqueeze(-1)  # [B, T_pad, H, 1]
    if varlen is not None:
        o, h = _chunk_segment(q, k, v, g, beta, h, varlen)
        return o.to(out_dtype), (h if output_final_state else None)
    # Long inputs run in segments of whole chunks, the state carried between them: the same math, but the
    # segment's buffers are reused from one segment to the next instead of growing with T (on the CPU a
    # 16K-token call otherwise spends a third of its time in page faults).
    step = CHUNK_SIZE * max(1, SEGMENT_TOKENS // (CHUNK_SIZE * B * H))
    outputs = []
    for start in range(0, T + pad, step):
        seg = [x[:, start : start + step] for x in (q, k, v, g, beta)]
        o, h = _chunk_segment(*seg, h)
        outputs.append(o)
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)  # [B, T_pad, H, V]
    return o[:, :T].to(out_dtype), (h if output_final_state else None)


def _chunk_segment(q, k, v, g, beta, h, varlen=None):
    """Chunked KDA over [B, T, H, ·] inputs with T a multiple of 64 and state h; returns o [B, T, H, V], h."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = T // CHUNK_SIZE
    # q and k of each sub-chunk stacked on one axis: the intra-chunk rows decay both in one pass
    qk = q.new_empty(N, B, H, N_SUB, 2, SUB_CHUNK, K)  # [N, B, H, 4, 2, 16, K]
    for j, x in enumerate((q, k)):
        qk[..., j, :, :].copy_(x.unflatten(1, (N, N_SUB, SUB_CHUNK)).permute(1, 0, 4, 2, 3, 5))
    k = qk[..., 1, :, :]  # [N, B, H, 4, 16, K]
    v, g, beta = (_to_chunks(x, N).flatten(3, 4) for x in (v, g, beta))  # [N, B, H, 64, V | K | 1]

    # Γ inside each sub-chunk; a matmul with a triangle of ones is several times faster than cumsum on the CPU
    ones = torch.ones(SUB_CHUNK, SUB_CHUNK, dtype=q.dtype, device=q.device).tril()
    gl = ones @ g.unflatten(3, (N_SUB, SUB_CHUNK))  # [N, B, H, 4, 16, K] Γ_t − Γ(start of its sub-chunk)
    tot = gl[..., -1, :]  # [N, B, H, 4, K] log decay over each sub-chunk
    # Γ at the sub-chunk edges (chunk-relative): 0, Γ(end of sub-chunk 0), ..., Γ_C
    bound = torch.cat([torch.zeros_like(tot[..., :1, :]), tot.cumsum(-2)], dim=-2)  # [N, B, H, 5, K]
    k_out = k * _decay(tot.unsqueeze(-2) - gl)  # [N, B, H, 4, 16, K] k_j e^{Γ(sub end) − Γ_j} ≤ k_j

    a_qk, a_kk = _intra_chunk(qk, gl, k_out, bound)  # [N, B, H, 64, 64] each
    e_in = _decay(gl + bound[..., :N_SUB, :].unsqueeze(-2))  # [N, B, H, 4, 16, K] e^{Γ_t}
    rhs = torch.cat([v, (e_in * k).flatten(3, 4)], dim=-1)  # [N, B, H, 64, V+K] [V | Ke^Γ]
    # [u | w] = (I + Akk)⁻¹ Diag(β) [V | Ke^Γ]; β scales the inverse's columns (64 per row, not V+K)
    uw = (_unit_lower_inverse(a_kk * beta) * beta.transpose(-1, -2)) @ rhs  # [N, B, H, 64, V+K]
    u, w = uw[..., :V], uw[..., V:]  # [N, B, H, 64, V], [N, B, H, 64, K]
    # k_j e^{Γ_C − Γ_j}
    k_dec = k_out * _decay(bound[..., -1:, :] - bound[..., 1:, :]).unsqueeze(-2)  # [N, B, H, 4, 16, K]
    k_dec_t = k_dec.flatten(3, 4).transpose(-1, -2)  # [N, B, H, K, 64]
    decay_c = _decay(bound[..., -1, :]).unsqueeze(-1)  # [N, B, H, K, 1] e^{Γ_C}

    if varlen is None:
        h, states, v_new = _state_pass(h, w, u, k_dec_t, decay_c)  # [N, B, H, K, V], [N, B, H, 64, V]
    else:
        # chunks of all sequences on a [step, sequence] grid; the filler chunk (w = u = k = 0, decay 1) is a no-op
        grid = [_to_grid(x, fill, varlen) for x, fill in ((w, 0.0), (u, 0.0), (k_dec_t, 0.0), (decay_c, 1.0))]
        h, states, v_new = _state_pass(h, *grid)  # [steps, N, H, ·, V]
        back = (varlen.chunk_step.to(h.device), varlen.chunk_seq.to(h.device))
        states, v_new = (x[back].unsqueeze(1) for x in (states, v_new))  # [chunks, 1, H, ·, V]
    q_dec = (e_in * qk[..., 0, :, :]).flatten(0, 2).flatten(1, 2)  # [N*B*H, 64, K] q e^{Γ_t}
    o = torch.baddbmm(a_qk.flatten(0, 2) @ v_new.flatten(0, 2), q_dec, states.flatten(0, 2))  # [N*B*H, 64, V]
    return o.view(N, B, H, CHUNK_SIZE, V).permute(1, 0, 3, 2, 4).reshape(B, T, H, V), h  # [B, T, H, V]


def _state_pass(h, w, u, k_dec_t, decay_c):
    """The only sequential part: chunk by chunk, Vnew = u − w h and h ← e^{Γ_C} ⊙ h + (K e^{Γ_C − Γ})ᵀ Vnew.
    Returns the final h [B, H, K, V], the state entering each chunk [N, B, H, K, V] and Vnew [N, B, H, 64, V]."""
    states, v_new = [], []
    for n in range(w.shape[0]):
        states.append(h)
        vn = u[n] - w[n] @ h  # [B, H, 64, V]
        h = h * decay_c[n] + k_dec_t[n] @ vn  # [B, H, K, V]
        v_new.append(vn)
    return h, torch.stack(states), torch.stack(v_new)


def _to_grid(x: torch.Tensor, fill: float, varlen: ChunkedVarlen) -> torch.Tensor:
    """[chunks, 1, H, ...] -> [steps, N, H, ...] by `varlen.loop_idx`, with a filler chunk of `fill`."""
    x = x[:, 0]
    return torch.cat([x, torch.full_like(x[:1], fill)])[varlen.loop_idx.to(x.device)]


def _intra_chunk(qk, gl, k_out, bound):
    """Aqk (j ≤ t) and Akk (j < t, before β) of every chunk, [N, B, H, 64, 64] each.

    Row sub-chunk i is factored around its midpoint n_i: rows a_t e^{Γ_t − Γ_{n_i}}, columns
    k_j e^{Γ_{n_i} − Γ_j}, one matmul per row sub-chunk. The columns left of sub-chunk i have factors ≤ 1,
    the diagonal tile's are within e^{±span}. If any tile's span exceeds SAFE_SPAN, `_intra_chunk_safe`
    takes over."""
    sub = SUB_CHUNK
    thr = SAFE_SPAN[gl.dtype]
    mid = gl[..., sub // 2, :]  # [N, B, H, 4, K] Γ_{n_i} − Γ(start of sub-chunk i)
    x = gl - mid.unsqueeze(-2)  # [N, B, H, 4, 16, K] Γ_t − Γ_{n_i}
    unsafe = (x.amax(dim=(-2, -1)) > thr) | (x.amin(dim=(-2, -1)) < -thr)  # [N, B, H, 4]
    if bool(unsafe.any()):
        return _intra_chunk_safe(qk, gl, x.clamp(-thr, thr), k_out, bound, unsafe)
    e_mid = x.exp()  # [N, B, H, 4, 16, K]
    rows = (qk * e_mid.unsqueeze(-3)).flatten(-3, -2)  # [N, B, H, 4, 32, K] q, k times e^{Γ_t − Γ_{n_i}}
    # e^{−x} rather than 1/e^{x}: the division's gradient is 1/e^{2x}, which overflows fp32 once |x| > 44 (a tile
    # holding strong and weak decays, e.g. −23 nats at two tokens), and 0·inf made dg NaN
    k_mid = qk[..., 1, :, :] * (-x).exp()  # [N, B, H, 4, 16, K] k_j e^{Γ_{n_i} − Γ_j}, j in sub-chunk i
    masks = _masks(gl.device)
    zero = rows.new_zeros(())
    blocks = []
    for i in range(N_SUB):
        cols = k_mid[..., i, :, :]  # [N, B, H, 16, K]
        if i > 0:
            # sub-chunks m < i: e^{Γ_{n_i} − Γ_j} = e^{mid_i + Γ(start i) − Γ(end m)} · e^{Γ(end m) − Γ_j}, both ≤ 1
            scale_m = _decay(mid[..., i : i + 1, :] + bound[..., i : i + 1, :] - bound[..., 1 : i + 1, :])
            left = (k_out[..., :i, :, :] * scale_m.unsqueeze(-2)).flatten(-3, -2)  # [N, B, H, 16·i, K]
            cols = torch.cat([left, cols], dim=-2)  # [N, B, H, 16·(i+1), K]
        blk = rows[..., i, :, :] @ cols.transpose(-1, -2)  # [N, B, H, 32, 16·(i+1)]
        blk = torch.where(masks[i], blk, zero)
        if i < N_SUB - 1:
            blk = torch.cat([blk, zero.expand(blk.shape[:-1] + (sub * (N_SUB - 1 - i),))], dim=-1)  # [N, B, H, 32, 64]
        blocks.append(blk.unflatten(-2, (2, sub)))
    a = torch.cat(blocks, dim=-2)  # [N, B, H, 2, 64, 64]
    return a[..., 0, :, :], a[..., 1, :, :]


def _masks(device) -> list[torch.Tensor]:
    """Per row sub-chunk i, the [32, 16·(i+1)] mask: all of the columns left of the tile, then j ≤ t for the
    16 q rows and j < t for the 16 k rows of the diagonal tile."""
    sub = SUB_CHUNK
    causal = torch.ones(sub, sub, dtype=torch.bool, device=device).tril()
    tile = torch.cat([causal, causal.tril(-1)], dim=0)  # [32, 16]
    return [torch.cat([tile.new_ones(2 * sub, sub * i), tile], dim=-1) for i in range(N_SUB)]


def _intra_chunk_safe(qk, gl, x, k_out, bound, unsafe):
    """Same result as `_intra_chunk` for any gate: off-diagonal blocks factored through the start of the row's
    sub-chunk (both factors ≤ 1), diagonal tiles by the clamped midpoint matmul, then the unsafe ones
    recomputed pairwise."""
    sub = SUB_CHUNK
    diag = _diag_tiles(qk, x, gl, unsafe)  # [N, B, H, 4, 2, 16, 16]
    rows_in = qk * _decay(gl).unsqueeze(-3)  # [N, B, H, 4, 2, 16, K] q, k decayed from their sub-chunk start
    zero = diag.new_zeros(())
    rows = []
    for i in range(N_SUB):
        parts = []
        if i > 0:
            # columns of sub-chunks m < i decayed to the start of sub-chunk i: e^{Γ(start i) − Γ_j} ≤ 1
            to_start = _decay(bound[..., i : i + 1, :] - bound[..., 1 : i + 1, :])  # [N, B, H, i, K]
            cols = (k_out[..., :i, :, :] * to_start.unsqueeze(-2)).flatten(-3, -2)  # [N, B, H, 16·i, K]
            off = rows_in[..., i, :, :, :].flatten(-3, -2) @ cols.transpose(-1, -2)  # [N, B, H, 32, 16·i]
            parts.append(off.unflatten(-2, (2, sub)))
        parts.append(diag[..., i, :, :, :])
        if i < N_SUB - 1:
            parts.append(zero.expand(diag.shape[:3] + (2, sub, sub * (N_SUB - 1 - i))))
        rows.append(torch.cat(parts, dim=-1))  # [N, B, H, 2, 16, 64]
    a = torch.cat(rows, dim=-2)  # [N, B, H, 2, 64, 64]
    return a[..., 0, :, :], a[..., 1, :, :]


def _diag_tiles(qk, x, gl, unsafe):
    """Diagonal tiles [N, B, H, 4, 2, 16, 16] of Aqk (j ≤ t) and Akk (j < t): matmul around the midpoint with the
    exponents x = Γ_t − Γ_n clamped to ±SAFE_SPAN (finite factors and finite gradients of both, e^{±x}), then
    the unsafe tiles overwritten by the exact pairwise form."""
    sub = SUB_CHUNK
    e_row = x.exp()  # [N, B, H, 4, 16, K]
    rows = (qk * e_row.unsqueeze(-3)).flatten(-3, -2)  # [N, B, H, 4, 32, K]
    cols = qk[..., 1, :, :] * (-x).exp()  # [N, B, H, 4, 16, K] e^{−x}, not 1/e^{x} (see `_intra_chunk`)
    tiles = (rows @ cols.transpose(-1, -2)).unflatten(-2, (2, sub))  # [N, B, H, 4, 2, 16, 16]
    idx = unsafe.reshape(-1).nonzero().squeeze(1)  # [m]
    qku = qk.reshape(-1, 2, sub, qk.shape[-1])[idx]  # [m, 2, 16, K]
    gu = gl.reshape(-1, sub, gl.shape[-1])[idx]  # [m, 16, K]
    causal = torch.ones(sub, sub, dtype=torch.bool, device=gl.device).tril()
    diff = gu.unsqueeze(2) - gu.unsqueeze(1)  # [m, 16, 16, K] Γ_t − Γ_j, ≤ 0 for j ≤ t
    pair = torch.where(causal.unsqueeze(-1), _decay(diff.clamp_max(0.0)), diff.new_zeros(()))  # [m, 16, 16, K]
    k_dec = pair * qku[:, 1].unsqueeze(1)  # [m, 16, 16, K] e^{Γ_t − Γ_j} k_j, zero for j > t
    exact = (k_dec.unsqueeze(1) @ qku.unsqueeze(-1)).squeeze(-1)  # [m, 2, 16, 16]
    tiles = tiles.reshape((-1, 2, sub, sub)).index_put((idx,), exact).view(tiles.shape)
    mask = torch.stack([causal, causal.tril(-1)])  # [2, 16, 16] Aqk keeps j ≤ t, Akk j < t
    return torch.where(mask, tiles, tiles.new_zeros(()))


def _unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + a)⁻¹ for strictly lower a [..., 64, 64]: triangular solves on the 16×16 diagonal blocks, then
    block forward substitution X_ij = −X_ii Σ_m a_im X_mj with matmuls."""
    sub = SUB_CHUNK
    eye = torch.eye(sub, dtype=a.dtype, device=a.device)
    tiles = [a[..., i * sub : (i + 1) * sub, i * sub : (i + 1) * sub] for i in range(N_SUB)]
    diag = torch.stack(tiles, dim=-3)  # [..., 4, 16, 16]
    inv_diag = torch.linalg.solve_triangular(diag + eye, eye.expand_as(diag), upper=False, unitriangular=True)
    inv = inv_diag[..., 0, :, :]  # [..., 16·i, 16·i] inverse of the leading block, grown below
    for i in range(1, N_SUB):
        below = -inv_diag[..., i, :, :] @ (a[..., i * sub : (i + 1) * sub, : i * sub] @ inv)  # [..., 16, 16·i]
        top = torch.cat([inv, inv.new_zeros(()).expand(inv.shape[:-1] + (sub,))], dim=-1)  # [..., 16·i, 16·(i+1)]
        inv = torch.cat([top, torch.cat([below, inv_diag[..., i, :, :]], dim=-1)], dim=-2)
    return inv  # [..., 64, 64]
