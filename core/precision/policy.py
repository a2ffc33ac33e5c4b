"""The run's precision, resolved once for a device: the one place that says which dtype compute,
FSDP2 all-gathers and reductions, and pipeline boundaries use, and which GEMM backend runs."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ContextManager

import torch
from torch import nn

from .gemm import GemmBackend

__all__ = ["PrecisionPolicy"]


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    device_type: str
    """Where the run computes ("cpu", "cuda")."""
    compute_dtype: torch.dtype | None
    """Autocast dtype of the GEMMs (bf16), or None: everything in the parameters' dtype (fp32)."""
    gemm: GemmBackend
    """The backend installed in every GEMM module (apply())."""

    @classmethod
    def full(cls, device_type: str = "cpu") -> "PrecisionPolicy":
        """No autocast, PyTorch's GEMMs in the parameters' dtype."""
        from .gemm import DEFAULT_GEMM

        return cls(device_type, None, DEFAULT_GEMM)

    def autocast(self) -> ContextManager:
        """The context every forward of the run enters (trainer, pipeline, evaluation)."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def fsdp_mp_policy(self):
        """FSDP2's mixed precision: parameters all-gathered in the compute dtype (bf16 compute
        copies, one cast per gather), gradients reduced in fp32; fp32 throughout without autocast."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.compute_dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)

    def boundary_dtype(self, param_dtype: torch.dtype, sharded: bool) -> torch.dtype:
        """The residual stream's dtype between pipeline stages: the compute dtype when FSDP2
        hands the blocks compute-dtype parameters (``sharded``), else the parameters' own."""
        return self.compute_dtype if sharded and self.compute_dtype is not None else param_dtype

    def apply(self, model: nn.Module) -> None:
        """Install this policy's GEMM backend in every module that runs GEMMs through one."""
        for module in model.modules():
            if isinstance(getattr(module, "gemm", None), GemmBackend):
                module.gemm = self.gemm
