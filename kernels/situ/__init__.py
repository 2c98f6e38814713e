"""SiTU-GLU activation: `situ_glu(gate, up, beta, linear_beta)`.

Picks the Triton kernel (kernels/situ/fused.py) on CUDA tensors (kernels/dispatch.py `use_triton`),
the plain PyTorch expression (kernels/situ/naive.py) otherwise; `situ_glu_triton` is the Triton
path itself (on CPU tensors under TRITON_INTERPRET=1). Kernels that fuse the activation import
its `@triton.jit` pieces from `kernels.situ.fused` (`situ_glu_fwd_tl`, `situ_glu_bwd_tl`, …).
"""

from k3rl.kernels.situ.fused import situ_glu, situ_glu_triton
from k3rl.kernels.situ.naive import naive_situ_glu, situ

__all__ = ["situ_glu", "situ_glu_triton", "naive_situ_glu", "situ"]
