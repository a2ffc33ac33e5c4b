"""Precision: the ``precision`` config section, the run's PrecisionPolicy and the GEMM backends.

Every precision decision of a run is made here: the autocast the forward passes enter, FSDP2's
mixed-precision policy, the dtype between pipeline stages, the dtype the MoE layer moves rows in,
and the GEMM backend that dense linears and the grouped expert GEMM call (docs/precision.md).
"""

from .config import Fp8Wgrad, PrecisionBackend, PrecisionConfig, PrecisionRecipe
from .gemm import DEFAULT_GEMM, GEMM_BACKENDS, GemmBackend, TorchGemm, compute_dtype, gemm_backend, register_gemm_backend
from .policy import GemmModule, PrecisionPolicy

__all__ = [
    "DEFAULT_GEMM",
    "Fp8Wgrad",
    "GEMM_BACKENDS",
    "GemmModule",
    "GemmBackend",
    "PrecisionBackend",
    "PrecisionConfig",
    "PrecisionPolicy",
    "PrecisionRecipe",
    "TorchGemm",
    "compute_dtype",
    "gemm_backend",
    "register_gemm_backend",
]
