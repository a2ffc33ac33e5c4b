"""Global gradient-norm clipping that works for plain tensors and DTensors on several meshes.

FSDP2 shards dense parameters on one mesh and expert parameters on another; pipeline stages hold
disjoint parameters. torch's clip_grad_norm_ cannot stack norms of DTensors from different meshes,
so the squared norm is summed locally per (mesh, placements), all-reduced over the sharded mesh
dims only (replicated dims hold copies), and then over any extra groups (the pipeline stages).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor


def _sum_of_squares(tensors: list[torch.Tensor], triton: bool = False) -> torch.Tensor:
    """sum(t**2) over all ``tensors`` in fp32 or wider: one fused foreach norm per dtype, not a
    few kernels and a full-size temporary per tensor. The per-tensor norms are summed in the order
    of ``tensors`` whatever their dtypes, so a gradient held in bf16 instead of fp32 (the same
    values) gives the same total bit for bit. ``triton`` (trainer.triton_grad_norm): the squares
    summed by core/grad_norm_triton.py where it takes the tensors (contiguous fp32 / bf16 on a GPU),
    with the same bf16 / fp32 property; a different summation order, so other bits."""
    if triton:
        from . import grad_norm_triton

        if grad_norm_triton.supported(tensors):
            return grad_norm_triton.sum_of_squares_(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    acc = torch.float32
    for dtype in by_dtype:
        acc = torch.promote_types(acc, dtype)
    norms: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype, idx in by_dtype.items():
        for i, n in zip(idx, torch._foreach_norm([tensors[i] for i in idx], 2,
                                                 dtype=torch.promote_types(dtype, torch.float32))):
            norms[i] = n.to(acc)  # a no-op unless fp64 and narrower gradients mix
    return torch.stack(norms).square().sum()


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, extra_groups: Iterable[dist.ProcessGroup | None] = (),
    defer_to: Any = None, triton: bool = False,
) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most max_norm; returns the norm before clipping
    (a 0-dim fp32 tensor on the gradients' device; no host sync). ``max_norm=inf`` only measures:
    the gradients are not touched. ``defer_to``: an optimizer with ``defer_grad_scale(coef)``
    (core.adamw.PrecisionAwareAdamW) applies the coefficient inside its next step instead of a
    multiply pass over every gradient here (the same update; its Triton kernel leaves the gradients
    unscaled). ``triton``: the local squared norms through core/grad_norm_triton.py (_sum_of_squares)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    locals_ = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    total = torch.zeros((), device=locals_[0].device, dtype=torch.promote_types(grads[0].dtype, torch.float32))
    plain: list[torch.Tensor] = []
    by_layout: dict[tuple, tuple[Any, list[torch.Tensor]]] = {}  # (mesh id, placements) -> (mesh, local grads)
    for g, local in zip(grads, locals_):
        if isinstance(g, DTensor):
            by_layout.setdefault((id(g.device_mesh), tuple(g.placements)), (g.device_mesh, []))[1].append(local)
        else:
            plain.append(local)
    if plain:
        total += _sum_of_squares(plain, triton)
    for (_, placements), (mesh, local) in by_layout.items():
        sq = _sum_of_squares(local, triton)
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():  # Shard, _StridedShard or Partial: sum over the dim
                dist.all_reduce(sq, group=mesh.get_group(dim))
        total += sq
    for group in extra_groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    norm = total.sqrt()
    if math.isfinite(max_norm):  # an infinite bound scales by 1: skip the pass over every gradient
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        if defer_to is not None:
            defer_to.defer_grad_scale(coef.to(torch.float32))
        else:
            torch._foreach_mul_(locals_, coef.to(locals_[0].dtype))
    return norm
