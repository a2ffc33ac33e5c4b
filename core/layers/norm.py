"""RMSNorm computed in fp32 whatever the activation dtype (bf16 statistics are too coarse).

``triton`` (model.triton_rmsnorm): eager steps on CUDA run the norm as one Triton pass forward and one
backward (core/layers/norm_triton.py) instead of torch's separate fp32 kernels, and autograd keeps x and
one fp32 scale a row instead of fp32 copies of the rows. Under torch.compile the torch path is traced
(inductor fuses it with the residual adds beside it), and elsewhere (the CPU, fp64, DTensor weights,
rows wider than norm_triton.MAX_D) the torch path runs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["RMSNorm"]

KERNEL = "auto"
"""Where the Triton norm runs when asked for: "auto" (CUDA tensors), "triton" (also CPU ones, under
TRITON_INTERPRET=1: the tests)."""


class _TritonRMSNorm(torch.autograd.Function):
    """forward(x, weight, eps) = RMSNorm's torch path to fp32 rounding; backward in one pass."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        from .norm_triton import rmsnorm_forward

        y, rstd = rmsnorm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        from .norm_triton import rmsnorm_backward

        x, weight, rstd = ctx.saved_tensors
        dx, dw = rmsnorm_backward(dy, x, weight, rstd, weight_grad=ctx.needs_input_grad[1])
        return dx, dw, None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dim; returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, device: torch.device | None = None, triton: bool = False):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.triton = bool(triton)

    def _takes_triton(self, x: torch.Tensor) -> bool:
        if not self.triton or torch.compiler.is_compiling():
            return False
        if KERNEL != "triton" and x.device.type != "cuda":
            return False
        from .norm_triton import MAX_D

        w = self.weight
        return (not isinstance(w, DTensor) and x.dtype in (torch.float32, torch.bfloat16)
                and w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous() and self.dim <= MAX_D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_triton(x):
            return _TritonRMSNorm.apply(x, self.weight, self.eps)
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 or wider
        x_f = x.to(dtype)
        x_f = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(dtype) * x_f).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}" + (", triton=True" if self.triton else "")
