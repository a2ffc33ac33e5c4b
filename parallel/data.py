"""Data parallelism with sharded parameters, gradients and optimizer state: FSDP2 / HSDP.

Each transformer block is its own FSDP2 unit (parameters all-gathered just before the block runs
and freed after, gradients reduce-scattered), and the root unit holds the embedding, final norm
and LM head. The optimizer then steps on local shards only: optimizer state lives on the shards.
With dp_replicate > 1 the mesh is 2-D (HSDP): shard within a replica group, all-reduce across.

MoE experts under expert parallelism are their own FSDP2 unit on the expert mesh (the data-parallel
ranks left once ep is taken). Their gradients already sum the tokens of all ep ranks (the
all-to-all brings them in); the expert strategy scales them by 1/ep, so that with FSDP2's average
over the expert mesh every gradient is the mean over all data-parallel ranks.

parallel.fsdp_offload passes CPUOffloadPolicy to every unit: shards, gradients and optimizer state in
host memory, the optimizer stepping on the CPU.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from moetron.core.config import ConfigError
from moetron.core.moe.layer import moe_layers

from .model import require_parts
from .registry import ParallelState, ParallelStrategy, register_strategy


@register_strategy
class DataParallel(ParallelStrategy):
    name = "data"
    order = 40

    def enabled(self, state: ParallelState) -> bool:
        return (state.mesh.world is not None and state.mesh.dp_size > 1) or self.name in state.cfg.strategies

    def validate(self, state: ParallelState) -> None:
        if state.mesh.world is None:
            raise ConfigError("the data strategy (FSDP2) needs torch.distributed: launch with torchrun")

    def apply(self, state: ParallelState) -> None:
        mesh = state.mesh
        # bf16 compute and all-gathers, fp32 gradient reduction; fp32 throughout on the CPU.
        mp = state.precision.fsdp_mp_policy()
        reshard = state.cfg.fsdp_reshard_after_forward
        # parallel.fsdp_offload: shards in host memory (pinned only where there is a GPU to copy to).
        on_gpu = state.device is not None and torch.device(state.device).type == "cuda"
        offload = CPUOffloadPolicy(pin_memory=on_gpu) if state.cfg.fsdp_offload else OffloadPolicy()
        shard = dict(mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
        dense_mesh, expert_mesh = mesh.dense_fsdp, mesh.expert_fsdp
        for part in state.model_parts:
            require_parts(part, "data parallelism (FSDP2)", ("blocks",))
            for block in part.blocks.values():
                for moe in moe_layers(block).values():
                    if moe.balance_group is None:
                        moe.balance_group = mesh.group("dp")
                    if state.cfg.ep > 1:
                        # Experts split over ep shard over the rest of the dp ranks (efsdp x dp_replicate).
                        fully_shard(moe.experts, mesh=expert_mesh, **shard)
                fully_shard(block, mesh=dense_mesh, **shard)
            fully_shard(part, mesh=dense_mesh, **shard)
        roots = list(state.model_parts)

        def grad_sync(enabled: bool) -> None:
            for root in roots:  # recurses into every FSDP2 unit below the root
                root.set_requires_gradient_sync(enabled)

        state.grad_sync = grad_sync
