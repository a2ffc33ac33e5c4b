"""One device mesh for the whole run, viewed per strategy.

World mesh dims, outermost first: ``pp``, ``dp_replicate``, ``efsdp``, ``ep``. Expert parallelism
borrows data-parallel ranks: ``dp_shard = efsdp x ep``. Views:

- ``dense_fsdp``: dense parameters shard over ``dp_shard`` (1-D), or HSDP over
  ``(dp_replicate, dp_shard)`` when dp_replicate > 1;
- ``expert_fsdp``: expert parameters shard over ``efsdp`` (the dp_shard ranks left once ep is
  taken), or ``(dp_replicate, efsdp)``;
- ``ep``: the ranks that split the experts and exchange tokens;
- ``dp``: every data-parallel rank (``dp_replicate x dp_shard``): data loading and load balancing;
- ``pp``: the pipeline stages.

Process groups are handed to the modules that need them; no layer reads globals.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ParallelConfig


@dataclass
class ParallelMesh:
    cfg: ParallelConfig
    """The resolved layout (dp_shard filled in)."""
    world: DeviceMesh | None
    """The 4-D world mesh; None in a single process without a process group."""

    @classmethod
    def build(cls, cfg: ParallelConfig, world_size: int, device_type: str) -> "ParallelMesh":
        cfg = cfg.resolve(world_size)
        if world_size == 1 and not dist.is_initialized():
            return cls(cfg, None)
        shape = (cfg.pp, cfg.dp_replicate, cfg.dp_shard // cfg.ep, cfg.ep)
        world = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
        world["efsdp", "ep"]._flatten("dp_shard")
        world["dp_replicate", "efsdp", "ep"]._flatten("dp")
        return cls(cfg, world)

    # ---- views ------------------------------------------------------------------------------
    def _sub(self, *names: str) -> DeviceMesh | None:
        if self.world is None:
            return None
        with warnings.catch_warnings():
            # torch >= 2.11 warns that slicing flattened dims back out of the root mesh "will be
            # deprecated"; it is the one way that works on 2.11 and 2.13 alike (HSDP needs the 2-D
            # (dp_replicate, dp_shard) view). Revisit when DeviceMesh grows a stable replacement.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return self.world[names if len(names) > 1 else names[0]]

    @property
    def dense_fsdp(self) -> DeviceMesh | None:
        return self._sub("dp_replicate", "dp_shard") if self.cfg.dp_replicate > 1 else self._sub("dp_shard")

    @property
    def expert_fsdp(self) -> DeviceMesh | None:
        return self._sub("dp_replicate", "efsdp") if self.cfg.dp_replicate > 1 else self._sub("efsdp")

    @property
    def ep(self) -> DeviceMesh | None:
        return self._sub("ep")

    @property
    def pp(self) -> DeviceMesh | None:
        return self._sub("pp")

    @property
    def dp(self) -> DeviceMesh | None:
        return self._sub("dp")

    def group(self, name: str) -> dist.ProcessGroup | None:
        mesh = self._sub(name)
        return None if mesh is None else mesh.get_group()

    def rank_in(self, name: str) -> int:
        mesh = self._sub(name)
        return 0 if mesh is None else mesh.get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.rank_in("dp")

    @property
    def dp_size(self) -> int:
        return self.cfg.dp_replicate * self.cfg.dp_shard

    @property
    def pp_rank(self) -> int:
        return self.rank_in("pp")

    @property
    def ep_rank(self) -> int:
        return self.rank_in("ep")

    def describe(self) -> str:
        c = self.cfg
        return f"pp={c.pp} x dp_replicate={c.dp_replicate} x dp_shard={c.dp_shard} (ep={c.ep} x efsdp={c.dp_shard // c.ep})"
