"""The run's precision, resolved once for a device: the one place that says which dtype compute,
FSDP2 all-gathers and reductions, and pipeline boundaries use, and which GEMM backend runs."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ContextManager

import torch
from torch import nn

from ..config import StrEnum
from .gemm import GemmBackend

__all__ = ["GemmModule", "PrecisionPolicy"]


class GemmModule(StrEnum):
    """The kinds of modules whose GEMMs a low-precision recipe may take (precision.modules)."""

    experts = "experts"
    """core.moe.experts.GroupedExperts: the routed experts' grouped GEMMs."""
    attention = "attention"
    """core.layers.attention.Attention: the q, k, v and o projections."""
    mlp = "mlp"
    """core.layers.mlp.SwiGLU: dense MLPs, and the MoE layer's shared expert."""


def _module_kinds() -> dict[type, GemmModule]:
    # imported here: core.layers and core.moe import core.precision
    from ..layers.attention import Attention
    from ..layers.mlp import SwiGLU
    from ..moe.experts import GroupedExperts

    return {GroupedExperts: GemmModule.experts, Attention: GemmModule.attention, SwiGLU: GemmModule.mlp}


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    device_type: str
    """Where the run computes ("cpu", "cuda")."""
    compute_dtype: torch.dtype | None
    """Autocast dtype of the GEMMs (bf16), or None: everything in the parameters' dtype (fp32)."""
    gemm: GemmBackend
    """The backend installed in the GEMM modules of ``modules`` (apply())."""
    modules: frozenset[GemmModule] | None = None
    """The kinds of modules that get ``gemm``; the others (the LM head, any GEMM module outside an
    attention, MLP or experts module) get PyTorch's GEMMs. None: every GEMM module gets ``gemm``."""
    residual_dtype: torch.dtype | None = None
    """The residual stream's dtype where precision.bf16_residual sets it (the compute dtype): apply()
    makes it every token embedding's output dtype (core.layers.embedding.Embedding.out_dtype, so the
    model and the pipeline stages that share its embedding hand it on), and pipeline stages pass it
    between them (boundary_dtype). None: the embedding's own dtype (fp32 master weights, or bf16
    where FSDP2 gathers bf16)."""

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
        hands the blocks compute-dtype parameters (``sharded``) or precision.bf16_residual asks for it,
        else the parameters' own."""
        if self.residual_dtype is not None:
            return self.residual_dtype
        return self.compute_dtype if sharded and self.compute_dtype is not None else param_dtype

    @property
    def label(self) -> str:
        """How this run's precision is reported: "bf16", "fp32", or the backend's label."""
        return self.gemm.label or ("fp32" if self.compute_dtype is None else str(self.compute_dtype).split(".")[-1])

    def apply(self, model: nn.Module) -> None:
        """Install this policy's GEMM backend in every module that runs GEMMs through one (in the
        modules of ``self.modules`` only, when it is set; the others get PyTorch's GEMMs). A GEMM
        module's kind is that of its nearest enclosing attention / MLP / experts module."""
        from ..layers.embedding import Embedding  # here: core.layers imports core.precision

        for module in model.modules():  # the residual stream starts at the token embedding
            if isinstance(module, Embedding):
                module.out_dtype = self.residual_dtype
        if self.modules is None:
            for module in model.modules():
                if isinstance(getattr(module, "gemm", None), GemmBackend):
                    module.gemm = self.gemm
            return
        from .gemm import DEFAULT_GEMM

        kinds = _module_kinds()

        def visit(module: nn.Module, kind: GemmModule | None) -> None:
            kind = next((k for cls, k in kinds.items() if isinstance(module, cls)), kind)
            if isinstance(getattr(module, "gemm", None), GemmBackend):
                module.gemm = self.gemm if kind in self.modules else DEFAULT_GEMM
            for child in module.children():
                visit(child, kind)

        visit(model, None)

    def attach_optimizer(self, optimizer, parts: list[nn.Module]) -> None:
        """Let the GEMM backend register what the optimizer should keep current (called once by the
        trainer; precision.expert_weight_copies=optimizer)."""
        self.gemm.attach_optimizer(optimizer, parts)

    def after_optimizer_step(self, model: nn.Module | list[nn.Module] | None = None) -> None:
        """Tell the GEMM backends the weights changed (call after every optimizer step): backends
        that keep weights quantized once per step drop them. ``model`` (or its parts): also every
        backend installed in it, should another one have been put there by hand."""
        backends = {id(self.gemm): self.gemm}
        parts = model if isinstance(model, (list, tuple)) else [model] if model is not None else []
        for part in parts:
            for module in part.modules():
                gemm = getattr(module, "gemm", None)
                if isinstance(gemm, GemmBackend):
                    backends[id(gemm)] = gemm
        for gemm in backends.values():
            gemm.after_optimizer_step()
