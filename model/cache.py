"""Hybrid decode cache of the K3 model: conv + KDA states and MLA latents (docs/model_spec.md §5.6, §6, §11).

What one sequence keeps, per layer:
  * KDA layer: the conv state, the last W−1 raw q/k/v inputs `[3·H·K, W−1]` in the model dtype,
    and the recurrent state `[H, K, V]` (fp32, or fp64 for an fp64 model): constant in length.
  * MLA layer: the latent of every past token, `kv_lora_rank + qk_rope_head_dim` values per
    token (`[kv_c ; k_pe]`, k_pe already rotated when RoPE is on) and nothing else.
AttnRes needs no cache: its bank and partial sums are per token.

Batches may be left-padded in their first (prefill) step: `pad_len[b]` counts the padding
columns of row b. Padding tokens enter KDA as zero inputs, which leaves the state exactly as
for the unpadded sequence, and MLA masks them out as keys; positions (for RoPE) start at each
row's first real token. Without a cache (training), `position_ids` may pack several documents into
a row (HF-style packing): a document starts wherever a position does not continue the previous one,
and `StepInfo.documents` / `cu_seqlens` tell KDA to restart its states there and MLA to attend
within the document only. `nbytes()` counts the state tensors only (conv, recurrent, latent);
`layout_bytes()` gives the same number from the config, which `bench/decode_memory.py` checks.

The cache grows in place (amortised doubling of the latent buffers), can be snapshotted
(a trimmed deep copy) and restored, and re-indexed along the batch (`select`), e.g. to fork a
prefilled prompt into a group of samples. `unstack` cuts rows out as one-sequence caches (padding
dropped) and `K3Cache.stack` merges such caches of different lengths into one left-padded batch,
so the native engine can keep an episode's state between turns and decode it beside others
(rollout/torch_engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepInfo:
    """Where the tokens of one forward call sit; built by `make_step`, read by every mixer."""

    start: int
    """Tokens already in the cache before this call (0 without a cache)."""
    positions: torch.Tensor
    """[B, T] position of each new token within its own sequence (padding excluded)."""
    valid: torch.Tensor | None
    """[B, T] False at left-padding tokens; None when every token is real."""
    pad: torch.Tensor
    """[B] left-padding columns of each row (they sit at the start of the cache)."""
    cache: K3Cache | None
    documents: torch.Tensor | None = None
    """[B, T] int64 document of each token, counted from 0 in each row (packed rows, no cache); None when
    every row is one sequence."""
    cu_seqlens: torch.Tensor | None = None
    """[N + 1] int64 boundaries of the N documents of all rows laid end to end (row-major, B·T tokens), the
    packed layout of `chunk_kda`; set with `documents`."""

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[1]

    @property
    def plain_causal(self) -> bool:
        """True when MLA needs no explicit mask: no padding, one document per row, and either no past or a
        one-token step."""
        return self.documents is None and self.valid is None and not bool(self.pad.any()) and (self.start == 0 or self.num_tokens == 1)

    def attn_mask(self, lo: int = 0, hi: int | None = None, keys: int | None = None) -> torch.Tensor | None:
        """[B, 1, hi−lo, keys] bool mask of the new tokens lo..hi−1 over the first `keys` keys (default all
        start+T); None when `plain_causal`. Built per query block, so a long prefill never holds T×S of it."""
        if self.plain_causal:
            return None
        T = self.num_tokens
        hi = T if hi is None else hi
        keys = self.start + T if keys is None else keys
        device = self.positions.device
        absolute = self.start + torch.arange(lo, hi, device=device)  # [t]
        k = torch.arange(keys, device=device)  # [S]
        causal = k[None, :] <= absolute[:, None]  # [t, S]
        real_key = k[None, :] >= self.pad[:, None]  # [B, S]
        own = k[None, :] == absolute[:, None]  # [t, S]: a padding query attends to itself (no empty rows)
        mask = causal[None] & (real_key[:, None, :] | own[None])  # [B, t, S]
        if self.documents is not None:  # packed rows have no cache: keys are the new tokens
            mask = mask & (self.documents[:, lo:hi, None] == self.documents[:, None, :keys])
        return mask[:, None]  # [B, 1, t, S]


class K3Cache:
    """Decode state of a batch; create with `K3Cache.create(config, batch_size, ...)`."""

    def __init__(self, config, batch_size: int, capacity: int, dtype: torch.dtype, device) -> None:
        lac = config.linear_attn_config
        H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
        self.config = config
        self.batch_size, self.capacity, self.seq_len = batch_size, capacity, 0
        self.dtype, self.device = dtype, torch.device(device)
        self.state_dtype = torch.promote_types(dtype, torch.float32)
        self.pad_len = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.latent: dict[int, torch.Tensor] = {}
        width = config.kv_lora_rank + config.qk_rope_head_dim
        for i in range(config.num_hidden_layers):
            if config.is_kda_layer(i):
                self.conv[i] = torch.zeros(batch_size, 3 * H * K, W - 1, dtype=dtype, device=device)
                self.recurrent[i] = torch.zeros(batch_size, H, K, K, dtype=self.state_dtype, device=device)
            else:
                self.latent[i] = torch.zeros(batch_size, capacity, width, dtype=dtype, device=device)

    @classmethod
    def create(cls, config, batch_size: int, capacity: int = 256, dtype: torch.dtype = torch.float32,
               device="cpu") -> K3Cache:
        """An empty cache for `batch_size` sequences with room for `capacity` tokens each."""
        if batch_size <= 0 or capacity < 0:
            raise ValueError(f"batch_size/capacity: need batch_size > 0 and capacity ≥ 0, got {batch_size}, {capacity}")
        return cls(config, batch_size, capacity, dtype, device)

    def grow(self, extra_tokens: int) -> None:
        """Make room for `extra_tokens` more tokens (doubling, so repeated decode steps are amortised)."""
        needed = self.seq_len + extra_tokens
        if needed <= self.capacity:
            return
        new_capacity = max(needed, 2 * self.capacity)
        for i, buf in self.latent.items():
            grown = buf.new_zeros(buf.shape[0], new_capacity, buf.shape[2])
            grown[:, : self.seq_len] = buf[:, : self.seq_len]
            self.latent[i] = grown
        self.capacity = new_capacity

    def append_latent(self, layer_idx: int, latent: torch.Tensor, start: int) -> torch.Tensor:
        """Write `latent` [B, T, D] at positions start..start+T-1; return all latents [B, start+T, D]."""
        end = start + latent.shape[1]
        buf = self.latent[layer_idx]
        buf[:, start:end] = latent
        return buf[:, :end]

    def commit(self, num_tokens: int) -> None:
        """Called by the model once every layer has consumed a step of `num_tokens` tokens."""
        self.seq_len += num_tokens

    def nbytes(self) -> int:
        """Bytes held by the state tensors (conv, recurrent, latent buffers at their capacity)."""
        tensors = [*self.conv.values(), *self.recurrent.values(), *self.latent.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def layout_bytes(config, batch_size: int, num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of a cache holding `num_tokens` tokens per sequence, computed from the layout alone."""
        lac = config.linear_attn_config
        H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
        item = torch.empty(0, dtype=dtype).element_size()
        state_item = torch.empty(0, dtype=torch.promote_types(dtype, torch.float32)).element_size()
        n_kda = len(lac["kda_layers"])
        n_mla = config.num_hidden_layers - n_kda
        kda = n_kda * (3 * H * K * (W - 1) * item + H * K * K * state_item)
        mla = n_mla * num_tokens * (config.kv_lora_rank + config.qk_rope_head_dim) * item
        return batch_size * (kda + mla)

    def snapshot(self) -> K3Cache:
        """A deep copy trimmed to the tokens held (capacity = seq_len)."""
        return self._rebuild(torch.arange(self.batch_size, device=self.device), capacity=self.seq_len)

    def restore(self, snapshot: K3Cache) -> None:
        """Make this cache equal to `snapshot` (which stays usable for further restores)."""
        copy = snapshot._rebuild(torch.arange(snapshot.batch_size, device=snapshot.device), snapshot.capacity)
        self.__dict__.update(copy.__dict__)

    def select(self, index: torch.Tensor | list[int]) -> K3Cache:
        """A new cache whose row r is row index[r] of this one (reorder, drop or repeat sequences)."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.device)
        if index.ndim != 1 or index.numel() == 0 or int(index.min()) < 0 or int(index.max()) >= self.batch_size:
            raise ValueError(f"index: need a non-empty 1-D index into a batch of {self.batch_size}, got {index.tolist()}")
        return self._rebuild(index, self.capacity)

    @staticmethod
    def stack(caches: list[K3Cache], capacity: int = 0) -> K3Cache:
        """One batch of every row of `caches`, in order, left-padded to the longest; room for `capacity` tokens.

        A row keeps its real tokens only (its own padding dropped) and is shifted right so that all rows end
        at the batch's last column; `pad_len` counts the new padding. Conv and recurrent states are per row
        and copied as they are. Positions are `absolute − pad` (`make_step`), so each row's next token gets
        the position it has in its own cache, and the stored k_pe (rotated at their own positions) stay
        valid: decoding the stack equals decoding each row alone, with RoPE as without."""
        if not caches:
            raise ValueError("stack: need at least one cache")
        first = caches[0]
        for c in caches[1:]:
            if c.config is not first.config and c.config.to_dict() != first.config.to_dict():
                raise ValueError("stack: the caches belong to different model configs")
            if c.dtype != first.dtype or c.device != first.device:
                raise ValueError(f"stack: caches in {first.dtype} on {first.device} and {c.dtype} on {c.device}")
        lengths = torch.cat([c.seq_len - c.pad_len for c in caches])  # [B] real tokens per row
        L = int(lengths.max())
        new = K3Cache(first.config, int(lengths.numel()), max(capacity, L), first.dtype, first.device)
        new.seq_len, new.pad_len = L, L - lengths
        new.conv = {i: torch.cat([c.conv[i] for c in caches]) for i in first.conv}
        new.recurrent = {i: torch.cat([c.recurrent[i] for c in caches]) for i in first.recurrent}
        row = 0
        for c in caches:
            for b, p in enumerate(c.pad_len.tolist()):
                n = c.seq_len - p
                for i, buf in new.latent.items():
                    buf[row, L - n:L] = c.latent[i][b, p:c.seq_len]
                row += 1
        return new

    def unstack(self, index: torch.Tensor | list[int] | None = None) -> list[K3Cache]:
        """Rows `index` (default all) as one-sequence caches holding their real tokens only (no padding,
        capacity = length): the inverse of `stack`, e.g. to keep a sequence's state after its batch is gone."""
        rows = range(self.batch_size) if index is None else torch.as_tensor(index).tolist()
        out = []
        for b in rows:
            p = int(self.pad_len[b])
            one = K3Cache.__new__(K3Cache)
            one.__dict__.update(self.__dict__)
            one.batch_size, one.seq_len = 1, self.seq_len - p
            one.capacity = one.seq_len
            one.pad_len = self.pad_len.new_zeros(1)
            one.conv = {i: t[b:b + 1].clone() for i, t in self.conv.items()}
            one.recurrent = {i: t[b:b + 1].clone() for i, t in self.recurrent.items()}
            one.latent = {i: t[b:b + 1, p:self.seq_len].clone() for i, t in self.latent.items()}
            out.append(one)
        return out

    def _rebuild(self, index: torch.Tensor, capacity: int) -> K3Cache:
        new = K3Cache.__new__(K3Cache)
        new.__dict__.update(self.__dict__)
        new.batch_size, new.capacity = index.numel(), capacity
        new.pad_len = self.pad_len[index].clone()
        new.conv = {i: t[index].clone() for i, t in self.conv.items()}
        new.recurrent = {i: t[index].clone() for i, t in self.recurrent.items()}
        new.latent = {}
        for i, t in self.latent.items():
            buf = t.new_zeros(index.numel(), capacity, t.shape[2])
            buf[:, : self.seq_len] = t[index, : self.seq_len]
            new.latent[i] = buf
        return new


def make_step(input_shape: tuple[int, int], device, cache: K3Cache | None,
              attention_mask: torch.Tensor | None, max_positions: int,
              position_ids: torch.Tensor | None = None) -> StepInfo:
    """Positions, padding and the MLA mask of one forward call over `input_shape` = (B, T) tokens.

    `attention_mask` ([B, T] for the new tokens, or [B, start+T]) may only mark left padding,
    and only in a sequence's first step; anything else raises ValueError.
    `position_ids` [B, T] (no cache only) are the RoPE positions and mark packed documents: one starts at
    column 0 and wherever position_ids[b, t] != position_ids[b, t−1] + 1 (transformers'
    `find_packed_sequence_indices` rule), e.g. 0 1 2 0 1 0 1 2 3 holds three documents.
    """
    B, T = input_shape
    start = cache.seq_len if cache is not None else 0
    if cache is not None and cache.batch_size != B:
        raise ValueError(f"cache: holds {cache.batch_size} sequences but input_ids has batch size {B}")
    if position_ids is not None:
        return _packed_step(input_shape, device, attention_mask, max_positions, position_ids, cache)
    if start + T > max_positions:
        raise ValueError(f"input_ids: {start + T} tokens exceed max_position_embeddings={max_positions}")
    pad = cache.pad_len if cache is not None else torch.zeros(B, dtype=torch.long, device=device)
    if attention_mask is not None:
        new = attention_mask[:, -T:].to(device=device, dtype=torch.bool)
        if attention_mask.shape[0] != B or attention_mask.shape[1] not in (T, start + T):
            raise ValueError(f"attention_mask: expected shape [{B}, {T}] or [{B}, {start + T}], "
                             f"got {list(attention_mask.shape)}")
        n_pad = T - new.sum(1)
        left_padded = torch.arange(T, device=device)[None, :] >= n_pad[:, None]
        if not torch.equal(new, left_padded):
            raise ValueError("attention_mask: only left padding (zeros before each row's first token) is supported")
        if start > 0 and bool(n_pad.any()):
            raise ValueError("attention_mask: padding is only allowed in a sequence's first step (empty cache)")
        if start == 0:
            pad = n_pad
            if cache is not None:
                cache.pad_len = n_pad.clone()
    if cache is not None:
        cache.grow(T)
    absolute = start + torch.arange(T, device=device)  # [T]
    positions = (absolute[None, :] - pad[:, None]).clamp_min(0)  # [B, T]
    valid = absolute[None, :] >= pad[:, None] if bool(pad.any()) else None  # [B, T]
    return StepInfo(start=start, positions=positions, valid=valid, pad=pad, cache=cache)


def _packed_step(input_shape: tuple[int, int], device, attention_mask: torch.Tensor | None, max_positions: int,
                 position_ids: torch.Tensor, cache: K3Cache | None) -> StepInfo:
    """`make_step` with explicit positions: documents where the positions restart (see `make_step`)."""
    B, T = input_shape
    if cache is not None:
        raise ValueError("position_ids: packed documents are for training (no cache); pass either position_ids "
                         "or a cache / use_cache=True")
    if tuple(position_ids.shape) != (B, T) or position_ids.is_floating_point() or position_ids.dtype == torch.bool:
        raise ValueError(f"position_ids: expected integers of shape [{B}, {T}], got {position_ids.dtype} "
                         f"of shape {list(position_ids.shape)}")
    positions = position_ids.to(device=device, dtype=torch.long)  # [B, T]
    if bool((positions < 0).any()) or int(positions.max()) >= max_positions:
        raise ValueError(f"position_ids: must lie in [0, max_position_embeddings={max_positions}), got "
                         f"{int(positions.min())}..{int(positions.max())}")
    # A packed row may be longer than max_position_embeddings: only its positions are bounded.
    step = make_step(input_shape, device, None, attention_mask, T)
    starts = torch.ones(B, T, dtype=torch.bool, device=device)  # [B, T]
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    step.positions = positions
    if bool(starts[:, 1:].any()):
        step.documents = starts.cumsum(1) - 1  # [B, T]
        first = starts.flatten().nonzero()[:, 0]  # [N]
        step.cu_seqlens = torch.cat([first, first.new_tensor([B * T])])  # [N + 1]
    return step
