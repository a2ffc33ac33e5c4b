"""MoE auxiliary losses join the training loss inside the autograd graph, on the layer's own output.

``attach_aux_loss(out, aux)`` is the identity on ``out``; its backward also sends the gradient
``scale`` into ``aux``, so the aux loss is trained without any caller collecting it (OLMo-core's
``attach_auxiliary_loss``, Megatron's ``MoEAuxLossAutoScaler``). ``scale`` is the weight the
training loop gives this micro-batch's LM loss (1 / micro-batches for equal micro-batches): the one
number core.layers.loss.loss_weight sets once per micro-batch or per step, which the fused LM loss
reads too; the plain loop, gradient accumulation and every pipeline schedule weight aux losses the
same way through it. :func:`aux_loss_scale` sets it for the aux losses alone.
"""

from __future__ import annotations

import contextlib

import torch

from ..layers.loss import current_loss_weight, loss_weight


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``out``; backward injects ``scale`` as the gradient of ``aux``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_out, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``out`` unchanged, with ``aux`` (a scalar loss) trained at ``scale`` (default: the current
    aux_loss_scale(); a caller that also logs the weighted value reads it once and passes it)."""
    return AuxLossScaler.apply(out, aux, current_aux_loss_scale() if scale is None else scale)


def current_aux_loss_scale() -> float:
    """The weight attach_aux_loss() gives aux losses now (what the layer's metrics weight them by):
    the micro-batch's LM loss weight (core.layers.loss.current_loss_weight)."""
    return current_loss_weight()


def aux_loss_scale(scale: float) -> contextlib.AbstractContextManager[None]:
    """Aux losses attached in this block get gradient ``scale`` (the micro-batch's LM loss weight),
    without declaring it to the fused LM loss (core.layers.loss.loss_weight(scale, declared=False))."""
    return loss_weight(scale, declared=False)
