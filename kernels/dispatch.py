"""Which path an op entry point takes: the Triton kernels on CUDA tensors, the PyTorch path elsewhere.

Every op folder's `__init__.py` asks `use_triton(x)` once per call. `K3RL_DISABLE_TRITON=1` forces the
PyTorch path on a GPU too (to compare, or to work around a kernel). On the CPU the entry points pick the
Triton kernels only when `K3RL_FORCE_TRITON=1` (with TRITON_INTERPRET=1): that is how a test runs the whole
model through the kernels here (tests/model/test_triton_dispatch.py); the interpreter is orders of magnitude
slower than PyTorch, so nothing else should set it.
"""

from __future__ import annotations

import os

import torch


def use_triton(x: torch.Tensor) -> bool:
    """True when `x` lives on a CUDA device (or K3RL_FORCE_TRITON=1) and K3RL_DISABLE_TRITON is not 1."""
    if os.environ.get("K3RL_DISABLE_TRITON") == "1":
        return False
    return x.is_cuda or os.environ.get("K3RL_FORCE_TRITON") == "1"
