"""Shared input handling of the KDA ops: shape checks, compute dtype, in-kernel q/k L2 norm, varlen packing.

All three KDA entry points (`naive_recurrent_kda`, `chunk_kda`, `fused_recurrent_kda`) take the same
tensors, [B, T, H, K] for q, k, g; [B, T, H, V] for v; [B, T, H] for beta; [B, H, K, V] for the state,
and share the conventions that live here:

* compute dtype: float32 for bf16/fp16 inputs, else the input dtype (so float64 tests are exact);
* `use_qk_l2norm_in_kernel`: docs/model_spec.md §5.1 puts the per-head L2 norm of q and k *inside* the kernel
  (`q / sqrt(Σq² + 1e-6)`, same for k), before the `K^-1/2` scale; vLLM passes the flag as True;
* `cu_seqlens`: packed sequences [1, ΣT, H, ·] are zero-padded, into a batch [N, T_max, H, ·] for the
  recurrent op, into a flat list of 64-token chunks for the chunked op (`ChunkedVarlen`).
  Zero padding is exact for KDA: a padded token has k = 0, β = 0 and g = 0, so it leaves the state unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

L2NORM_EPS = 1e-6


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 accumulation for half types; float32/float64 inputs compute in their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def l2norm(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale · x / sqrt(Σ_K x² + 1e-6) over the last dim (docs/model_spec.md §5.1, §13.1)."""
    inv = torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)  # [..., 1]
    return x * (inv * scale if scale != 1.0 else inv)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    """Raise ValueError with the offending shape when the KDA inputs do not fit together."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    for name, x, want in (
        ("k", k, (B, T, H, K)),
        ("g", g, (B, T, H, K)),
        ("v", v, (B, T, H, V)),
        ("beta", beta, (B, T, H)),
    ):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must be {want} to match q {tuple(q.shape)}, got {tuple(x.shape)}")
    n_state = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be 1 (packed), got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor [N + 1]")
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T or bool((cu_seqlens.diff() < 0).any()):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu_seqlens.tolist()}")
        n_state = cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (n_state, H, K, V):
        raise ValueError(
            f"initial_state must be {(n_state, H, K, V)} ([N or B, H, K, V]), got {tuple(initial_state.shape)}"
        )


def prepare_qk(
    q: torch.Tensor, k: torch.Tensor, scale: float | None, use_qk_l2norm_in_kernel: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast q, k to the compute dtype, L2-normalise them if asked, and scale q (default K^-1/2)."""
    q, k = q.to(dtype), k.to(dtype)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_qk_l2norm_in_kernel:
        return l2norm(q, scale), l2norm(k)
    return q * scale, k


def varlen_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sequence id, position in sequence) of every packed token, and the longest length."""
    cu = cu_seqlens.to(device="cpu", dtype=torch.long)
    lengths = cu.diff()
    seq_idx = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # [ΣT]
    pos_idx = torch.arange(int(cu[-1])) - cu[:-1][seq_idx]  # [ΣT]
    return seq_idx, pos_idx, int(lengths.max()) if lengths.numel() else 0


def pack_to_padded(x: torch.Tensor, seq_idx: torch.Tensor, pos_idx: torch.Tensor, n: int, t_max: int) -> torch.Tensor:
    """[1, ΣT, ...] packed -> [N, T_max, ...] zero-padded; differentiable."""
    seq_idx, pos_idx = seq_idx.to(x.device), pos_idx.to(x.device)
    out = x.new_zeros((n, t_max) + tuple(x.shape[2:]))  # [N, T_max, ...]
    return out.index_put((seq_idx, pos_idx), x[0])


def padded_to_packed(y: torch.Tensor, seq_idx: torch.Tensor, pos_idx: torch.Tensor) -> torch.Tensor:
    """[N, T_max, ...] -> [1, ΣT, ...], keeping only the real tokens; differentiable."""
    return y[seq_idx.to(y.device), pos_idx.to(y.device)].unsqueeze(0)  # [1, ΣT, ...]


@dataclass
class ChunkedVarlen:
    """Where the tokens of N packed sequences go in `chunk_kda`'s flat chunk list, and back.

    Each sequence is zero-padded to a multiple of `chunk` and the sequences' chunks are laid end to end, so
    the intra-chunk work has no padding beyond 63 tokens per sequence. Only the state pass, which must run
    the chunks of a sequence in order, sees a [max chunks, N] grid (`loop_idx`; a sequence shorter than the
    longest is filled with the index `n_chunks`, a no-op chunk).
    """

    flat_pos: torch.Tensor  # [ΣT] position of each packed token in the flat padded sequence
    n_chunks: int  # chunks over all sequences
    loop_idx: torch.Tensor  # [max chunks, N] chunk id of sequence s's n-th chunk, or n_chunks
    chunk_step: torch.Tensor  # [n_chunks] n: the chunk's index inside its sequence
    chunk_seq: torch.Tensor  # [n_chunks] s: the chunk's sequence

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, chunk: int) -> ChunkedVarlen:
        cu = cu_seqlens.to(device="cpu", dtype=torch.long)
        lengths = cu.diff()  # [N]
        per_seq = (lengths + chunk - 1) // chunk  # [N]
        first = torch.cumsum(per_seq, 0) - per_seq  # [N] first chunk of each sequence
        seq_idx = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # [ΣT]
        flat_pos = first[seq_idx] * chunk + torch.arange(int(cu[-1])) - cu[:-1][seq_idx]  # [ΣT]
        n_chunks = int(per_seq.sum())
        steps = torch.arange(int(per_seq.max()) if per_seq.numel() else 0).unsqueeze(1)  # [max chunks, 1]
        loop_idx = torch.where(steps < per_seq, first + steps, n_chunks)  # [max chunks, N]
        chunk_seq = torch.repeat_interleave(torch.arange(lengths.numel()), per_seq)  # [n_chunks]
        chunk_step = torch.arange(n_chunks) - first[chunk_seq]  # [n_chunks]
        return cls(flat_pos, n_chunks, loop_idx, chunk_step, chunk_seq)

    def pack(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """[1, ΣT, ...] packed -> [1, n_chunks·chunk, ...] flat and zero-padded; differentiable."""
        out = x.new_zeros((self.n_chunks * chunk,) + tuple(x.shape[2:]))
        return out.index_put((self.flat_pos.to(x.device),), x[0]).unsqueeze(0)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """[1, n_chunks·chunk, ...] -> [1, ΣT, ...]."""
        return y[:, self.flat_pos.to(y.device)]


def chunk_indices(cu_seqlens: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk grid of packed sequences, as the Triton kernels read it (fla's convention).

    Returns `indices` int32 [NT, 2]: (sequence s, chunk c within s) of each of the NT chunks, sequences in
    order, and `offsets` int32 [N + 1]: the first chunk of each sequence (offsets[-1] = NT). Chunk i covers the
    tokens [cu[s] + c·chunk, min(cu[s] + (c+1)·chunk, cu[s+1])); its state slot is i.
    """
    cu = cu_seqlens.to(device="cpu", dtype=torch.long)
    per_seq = (cu.diff() + chunk - 1) // chunk  # [N]
    offsets = torch.cat([per_seq.new_zeros(1), per_seq.cumsum(0)])  # [N + 1]
    seq = torch.repeat_interleave(torch.arange(per_seq.numel()), per_seq)  # [NT]
    within = torch.arange(int(offsets[-1])) - offsets[:-1][seq]  # [NT]
    device = cu_seqlens.device
    return (torch.stack([seq, within], dim=1).to(device=device, dtype=torch.int32),
            offsets.to(device=device, dtype=torch.int32))
