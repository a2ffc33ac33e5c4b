"""A bias-free linear layer whose GEMM runs through the run's GEMM backend (core.precision)."""

from __future__ import annotations

import torch
from torch import nn

from ..precision.gemm import DEFAULT_GEMM, GemmBackend


class Linear(nn.Linear):
    """nn.Linear without bias (same ``weight`` [out, in], same init, same state-dict names);
    forward x [..., in] -> [..., out] is ``self.gemm.linear(x, weight)``, the backend that
    PrecisionPolicy.apply() installs (PyTorch's F.linear until then)."""

    def __init__(self, in_features: int, out_features: int, device: torch.device | None = None):
        super().__init__(in_features, out_features, bias=False, device=device)
        self.gemm: GemmBackend = DEFAULT_GEMM

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm.linear(x, self.weight)
