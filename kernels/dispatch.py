"""Which path an op entry point takes: the Triton kernels on CUDA tensors, the PyTorch path elsewhere.

Every op folder's `__init__.py` asks `use_triton(x)` once per call. `K3RL_DISABLE_TRITON=1` forces the
PyTorch path on a GPU too (to compare, or to work around a kernel). On the CPU the Triton functions are
still callable directly (tests run them under TRITON_INTERPRET=1), but the entry points never pick them
there: the interpreter is orders of magnitude slower than PyTorch.
"""

from __future__ import annotations

import os

import torch


def use_triton(x: torch.Tensor) -> bool:
    """True when `x` lives on a CUDA device and Triton is not disabled by K3RL_DISABLE_TRITON=1."""
    return x.is_cuda and os.environ.get("K3RL_DISABLE_TRITON") != "1"
