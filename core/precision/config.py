"""The ``precision`` config section: what a run computes in, resolved into a PrecisionPolicy."""

from __future__ import annotations

import dataclasses

import torch

from ..config import Config, StrEnum
from .gemm import gemm_backend
from .policy import PrecisionPolicy

__all__ = ["PrecisionConfig", "PrecisionRecipe"]


class PrecisionRecipe(StrEnum):
    auto = "auto"
    """bf16 on GPU, fp32 on the CPU."""
    fp32 = "fp32"
    """Everything in fp32 (bit-exact reproducibility on the CPU)."""
    bf16 = "bf16"
    """bf16 autocast for the GEMMs with fp32 master weights; norms, softmax, router and loss in fp32."""


# Each recipe: (compute dtype, GEMM backend). Low-precision recipes add a row and a backend.
_RECIPES = {
    PrecisionRecipe.fp32: (None, "torch"),
    PrecisionRecipe.bf16: (torch.bfloat16, "torch"),
}


@dataclasses.dataclass
class PrecisionConfig(Config):
    recipe: PrecisionRecipe = PrecisionRecipe.auto
    """Compute precision (see PrecisionRecipe)."""

    def resolved_recipe(self, device_type: str) -> PrecisionRecipe:
        if self.recipe == PrecisionRecipe.auto:
            return PrecisionRecipe.bf16 if device_type == "cuda" else PrecisionRecipe.fp32
        return self.recipe

    def build(self, device: torch.device | str) -> PrecisionPolicy:
        """The policy for a run on ``device``."""
        device_type = torch.device(device).type
        dtype, backend = _RECIPES[self.resolved_recipe(device_type)]
        return PrecisionPolicy(device_type, dtype, gemm_backend(backend))
