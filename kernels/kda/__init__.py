"""Kimi Delta Attention ops (docs/model_spec.md §5): chunked (training/prefill), recurrent (decode), naive reference, gate.

Layer code calls `chunk_kda` for training and prefill and `fused_recurrent_kda` for decode steps that carry
the state; both equal `naive_recurrent_kda`, the literal §5.3 recurrence. `kda_gate` makes the log decay g.
"""

from kernels.kda.chunk import chunk_kda
from kernels.kda.gate import kda_gate
from kernels.kda.naive import naive_recurrent_kda
from kernels.kda.recurrent import fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda", "naive_recurrent_kda", "kda_gate"]
