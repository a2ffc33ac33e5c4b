"""Data parallelism with sharded parameters, gradients and optimizer state: FSDP2 / HSDP.

Each transformer block is its own FSDP2 unit (parameters all-gathered just before the block runs
and freed after, gradients reduce-scattered), and the root unit holds the embedding, final norm
and LM head. The optimizer then steps on local shards only: optimizer state lives on the shards.
With dp_replicate > 1 the mesh is 2-D (HSDP): shard within a replica group, all-reduce across.

MoE experts under expert parallelism are their own FSDP2 unit on the expert mesh (the data-parallel
ranks left once ep is taken). Their gradients already sum the tokens of all ep ranks (the
all-to-all brings them in), so besides FSDP2's average over the expert mesh they are scaled by
1/ep: every gradient is then the mean over all data-parallel ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from moetron.core.config import ConfigError
from moetron.core.moe.layer import MoELayer

from .registry import ParallelState, ParallelStrategy, register_strategy


def _blocks(part: nn.Module) -> list[nn.Module]:
    blocks = getattr(part, "blocks", None)
    if blocks is None:
        raise ConfigError(f"data parallelism needs a model exposing .blocks; {type(part).__name__} has none")
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


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
        dtype = state.extras.get("autocast_dtype")
        # bf16 compute and all-gathers, fp32 gradient reduction; fp32 throughout on the CPU.
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
        reshard = state.cfg.fsdp_reshard_after_forward
        if dtype is not None:
            # Parameters arrive in bf16, so the residual stream between pipeline stages is bf16 too.
            state.extras["pp_activation_dtype"] = dtype
        dense_mesh, expert_mesh = mesh.dense_fsdp, mesh.expert_fsdp
        for part in state.model_parts:
            for block in _blocks(part):
                moe = getattr(block, "mlp", None)
                if isinstance(moe, MoELayer):
                    if moe.balance_group is None:
                        moe.balance_group = mesh.group("dp")
                    if state.cfg.ep > 1:
                        # FSDP2 averages expert grads over the expert mesh (efsdp x dp_replicate);
                        # the remaining 1/ep makes them the mean over all data-parallel ranks.
                        moe.experts.grad_scale = 1.0 / state.cfg.ep
                        fully_shard(moe.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard)
                fully_shard(block, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=reshard)
            fully_shard(part, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=reshard)
