"""Depthwise causal short convolution with a decode-time state (docs/model_spec.md §5.1, §5.6).

`causal_conv1d(x, weight, state=None, activation="silu", cu_seqlens=None) -> (y, new_state)` is the entry
point (vectorised, one `F.conv1d` over the state followed by the new tokens; `cu_seqlens` runs packed
sequences, each from a zero state); `naive_causal_conv1d`
is the per-token reference that the tests compare it with.
"""

from k3rl.kernels.short_conv.conv import causal_conv1d
from k3rl.kernels.short_conv.naive import naive_causal_conv1d

__all__ = ["causal_conv1d", "naive_causal_conv1d"]
