"""Global gradient-norm clipping that works for plain tensors and DTensors on several meshes.

FSDP2 shards dense parameters on one mesh and expert parameters on another; pipeline stages hold
disjoint parameters. torch's clip_grad_norm_ cannot stack norms of DTensors from different meshes,
so the squared norm is summed locally per (mesh, placements), all-reduced over the sharded mesh
dims only (replicated dims hold copies), and then over any extra groups (the pipeline stages).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, extra_groups: Iterable[dist.ProcessGroup | None] = ()
) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most max_norm; returns the norm before clipping
    (a 0-dim fp32 tensor on the gradients' device; no host sync)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = (grads[0]._local_tensor if isinstance(grads[0], DTensor) else grads[0]).device
    total = torch.zeros((), device=device, dtype=torch.promote_types(grads[0].dtype, torch.float32))
    by_layout: dict[tuple, torch.Tensor] = {}
    meshes = {}
    for g in grads:
        if isinstance(g, DTensor):
            key = (id(g.device_mesh), tuple(g.placements))
            meshes[key] = g.device_mesh
            sq = _wide(g._local_tensor).pow(2).sum()
            by_layout[key] = by_layout[key] + sq if key in by_layout else sq
        else:
            total += _wide(g).pow(2).sum()
    for key, sq in by_layout.items():
        mesh, placements = meshes[key], key[1]
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():  # Shard, _StridedShard or Partial: sum over the dim
                dist.all_reduce(sq, group=mesh.get_group(dim))
        total += sq
    for group in extra_groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    locals_ = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    torch._foreach_mul_(locals_, coef.to(locals_[0].dtype))
    return norm
