"""A bias-free linear layer whose GEMM runs through the run's GEMM backend (core.precision)."""

from __future__ import annotations

import torch
from torch import nn

from ..precision.gemm import DEFAULT_GEMM, GemmBackend


class Linear(nn.Linear):
    """nn.Linear without bias (same ``weight`` [out, in], same init, same state-dict names);
    forward x [..., in] -> [..., out] is ``self.gemm.linear(x, compute_weight)``, the backend that
    PrecisionPolicy.apply() installs (PyTorch's F.linear until then)."""

    def __init__(self, in_features: int, out_features: int, device: torch.device | None = None):
        super().__init__(in_features, out_features, bias=False, device=device)
        self.gemm: GemmBackend = DEFAULT_GEMM
        # precision.dense_weight_copies: the optimizer's bf16 copy of ``weight``, a leaf the GEMM uses
        # and differentiates in its place (its .grad is the master's gradient; set by
        # core.precision.gemm.attach_dense_copies). None: the parameter itself.
        self.weight_copy: torch.Tensor | None = None

    @property
    def compute_weight(self) -> torch.Tensor:
        """What the GEMM reads: the optimizer's bf16 copy where there is one, else ``weight``."""
        return self.weight if self.weight_copy is None else self.weight_copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm.linear(x, self.compute_weight)


def shared_input(x: torch.Tensor, *linears: Linear) -> tuple[torch.Tensor, ...]:
    """``tuple(m(x) for m in linears)``: several Linear modules reading one input (attention's q, k,
    v; a SwiGLU's gate and up). Where they share one backend with ``quantize_input_once``
    (precision.quantize_input_once) or ``fused_shared_input`` (precision.fused_shared_input), one
    call of its ``linears`` quantizes x once for all of them, or runs them as one GEMM; otherwise
    each module runs as usual (its hooks included)."""
    gemm = linears[0].gemm
    if (gemm.quantize_input_once or gemm.fused_shared_input) and all(m.gemm is gemm for m in linears):
        return gemm.linears(x, tuple(m.compute_weight for m in linears))
    return tuple(m(x) for m in linears)
