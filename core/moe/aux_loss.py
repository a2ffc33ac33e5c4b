"""MoE auxiliary losses join the training loss inside the autograd graph, on the layer's own output.

``attach_aux_loss(out, aux)`` is the identity on ``out``; its backward also sends the gradient
``scale`` into ``aux``, so the aux loss is trained without any caller collecting it (OLMo-core's
``attach_auxiliary_loss``, Megatron's ``MoEAuxLossAutoScaler``). ``scale`` is the weight the
training loop gives this micro-batch's LM loss (1 / micro-batches for equal micro-batches), set
once per micro-batch or per step with :func:`aux_loss_scale`: the plain loop, gradient accumulation
and every pipeline schedule weight aux losses the same way, through this one number.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``out``; backward injects ``scale`` (read at forward) as the gradient of ``aux``."""

    scale: float = 1.0
    """The LM loss weight of the micro-batch now running; set through aux_loss_scale()."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.scale = AuxLossScaler.scale  # torch.compile guards on it: a new value recompiles, never goes stale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_out, torch.full(shape, ctx.scale, dtype=dtype, device=device)


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged, with ``aux`` (a scalar loss) trained at the current aux_loss_scale()."""
    return AuxLossScaler.apply(out, aux)


def current_aux_loss_scale() -> float:
    """The weight attach_aux_loss() gives aux losses now (what the layer's metrics weight them by)."""
    return AuxLossScaler.scale


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """Aux losses attached in this block get gradient ``scale`` (the micro-batch's LM loss weight)."""
    previous, AuxLossScaler.scale = AuxLossScaler.scale, float(scale)
    try:
        yield
    finally:
        AuxLossScaler.scale = previous
