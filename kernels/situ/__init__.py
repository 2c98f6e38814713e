"""SiTU-GLU activation: `situ_glu(gate, up, beta, linear_beta)`.

Picks the Triton kernel on CUDA tensors (or when TRITON_INTERPRET=1 asks for it on the CPU)
and the plain PyTorch expression otherwise.
"""

from kernels.situ.naive import naive_situ_glu, situ
from kernels.situ.fused import situ_glu, situ_glu_triton

__all__ = ["situ_glu", "situ_glu_triton", "naive_situ_glu", "situ"]
