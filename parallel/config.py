"""The parallel layout of a run: sizes of each mesh dimension and the strategies' settings."""

from __future__ import annotations

import dataclasses

from moetron.core.config import Config, ConfigError, StrEnum


class PipelineSchedule(StrEnum):
    gpipe = "gpipe"
    """All forwards, then all backwards (torch ScheduleGPipe)."""
    one_f_one_b = "1f1b"
    """One forward, one backward in the steady state (torch Schedule1F1B)."""
    interleaved_1f1b = "interleaved_1f1b"
    """Several virtual stages per rank, looped (torch ScheduleInterleaved1F1B)."""
    zero_bubble = "zero_bubble"
    """Interleaved zero-bubble: backward split into input and weight gradients (ScheduleInterleavedZeroBubble)."""


class PipelineSplit(StrEnum):
    layers = "layers"
    """The same number of blocks per stage (earlier stages take the remainder)."""
    flops = "flops"
    """Consecutive blocks per stage, balanced by training FLOPs per token with the LM head on the last
    stage. FLOPs are not time: on OLMoE (2 x H200, docs/performance.md) it cut 5 | 3 and ran no
    faster than 4 | 4, because MoE blocks run at lower efficiency than the head's dense GEMM."""


class ExpertDispatch(StrEnum):
    auto = "auto"
    """all_gather when top_k >= ep (measured fastest there: docs/performance.md), synced otherwise."""
    synced = "synced"
    """Exchange per-expert counts, read them on the host, all-to-all exactly the rows (one sync per layer)."""
    sync_free = "sync_free"
    """Static per-rank receive buffers of a capacity bound; no host sync; rows past it are counted and dropped."""
    all_gather = "all_gather"
    """Every token goes once to every ep rank (equal all-to-all blocks, an all-gather); each rank runs
    its experts on the tokens routed to them and sends back one weighted partial sum per token. No
    host sync; P*T rows each way instead of about T*K*(P-1)/P: fewer bytes when K >= P. The expert
    buffer is bounded by ep_capacity_factor (rows past it dropped and counted, none at ep=2)."""


@dataclasses.dataclass
class ParallelConfig(Config):
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's outer dimension: parameters replicated, gradients all-reduced)."""
    dp_shard: int = -1
    """Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2); -1 takes
    whatever the world size leaves after the other dimensions."""
    ep: int = 1
    """Expert-parallel ranks; borrowed from dp_shard (experts are split over ep ranks and sharded
    over the dp_shard / ep ranks left), so dp_shard must be a multiple of ep."""
    pp: int = 1
    """Pipeline stages (ranks)."""
    tp: int = 1
    """Tensor parallelism: not implemented yet (must be 1)."""
    pp_schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    """Pipeline schedule (see PipelineSchedule)."""
    pp_microbatches: int | None = None
    """Micro-batches per step through the pipeline; None = 2 x the number of stages."""
    pp_stages_per_rank: int = 1
    """Virtual stages per rank (interleaved and zero-bubble schedules need >= 2)."""
    pp_split: PipelineSplit = PipelineSplit.layers
    """How blocks are cut into stages (see PipelineSplit)."""
    ep_dispatch: str = ExpertDispatch.auto
    """How expert-parallel dispatch sizes its all-to-all: auto or a registered dispatcher's mode
    (the built-in ones: see ExpertDispatch; more through parallel.expert.register_dispatcher)."""
    ep_capacity_factor: float = 2.0
    """sync_free: each rank receives at most factor x its fair share of rows from each peer;
    all_gather: each rank's expert buffer holds at most factor x its fair share of all slots (at
    ep=2 and factor 2 that is every slot, so nothing can drop). Rows past it are dropped and counted."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (re-gather for backward); saves memory."""
    fsdp_offload: bool = False
    """FSDP2 CPUOffloadPolicy: the sharded fp32 parameters, their gradients and so the optimizer state
    live in host memory (pinned on GPUs) and the optimizer steps on the CPU; each unit's parameters are
    copied to the GPU for its all-gather and its gradients back after the reduce-scatter. Saves all
    per-parameter device memory but activations and the gathered units, costs host-device traffic and
    a CPU optimizer step. Needs FSDP2 in the layout (dp_shard or dp_replicate > 1, or the data
    strategy named); on GPUs the process group also gets gloo for the CPU gradients' collectives."""
    strategies: list[str] = dataclasses.field(default_factory=list)
    """Extra registered strategies to apply, by name (see docs/parallel.md)."""

    def validate(self) -> None:
        for name in ("dp_replicate", "ep", "pp", "tp", "pp_stages_per_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(f"parallel.dp_shard must be >= 1 or -1 (the rest of the world), got {self.dp_shard}")
        if self.tp != 1:
            raise ConfigError("parallel.tp > 1 is not implemented yet: use dp_shard, ep and pp")
        if self.pp_microbatches is not None and self.pp_microbatches < 1:
            raise ConfigError(f"parallel.pp_microbatches must be >= 1, got {self.pp_microbatches}")
        from .expert import DISPATCHERS  # registered beside the dispatchers (they import this module)

        if self.ep_dispatch != ExpertDispatch.auto:
            DISPATCHERS.lookup(self.ep_dispatch, "parallel.ep_dispatch")
        if self.ep_capacity_factor <= 0:
            raise ConfigError("parallel.ep_capacity_factor must be positive")
        multi = self.pp_schedule in (PipelineSchedule.interleaved_1f1b, PipelineSchedule.zero_bubble)
        if multi and self.pp_stages_per_rank < 2:
            raise ConfigError(f"parallel.pp_schedule={self.pp_schedule} needs parallel.pp_stages_per_rank >= 2")
        if not multi and self.pp_stages_per_rank != 1:
            raise ConfigError(f"parallel.pp_stages_per_rank > 1 needs an interleaved schedule, not {self.pp_schedule}")

    def one_rank(self, world_size: int) -> bool:
        """Whether a run of ``world_size`` processes keeps the whole model as one GPU's plain parameters: one
        process, every mesh size 1 (dp_shard -1 resolves to 1 there) and no strategy asked for by name (FSDP2
        or the pipeline's runtime on one rank). What precision's ``auto`` weight copies need
        (core.precision.config.copies_auto_on); run/build.py and the planner both ask here."""
        return (world_size == 1 and not self.strategies and self.dp_replicate == 1 and self.dp_shard in (1, -1)
                and self.ep == 1 and self.pp == 1 and self.tp == 1)

    def resolve(self, world_size: int) -> "ParallelConfig":
        """A copy with dp_shard filled in, checked against the world size (ConfigError says why)."""
        self.validate()
        fixed = self.dp_replicate * self.pp * self.tp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"world size {world_size} is not divisible by dp_replicate x pp x tp = "
                    f"{self.dp_replicate} x {self.pp} x {self.tp} = {fixed}: choose sizes whose product divides {world_size}"
                )
            dp_shard = world_size // fixed
        total = fixed * dp_shard
        if total != world_size:
            raise ConfigError(
                f"parallel sizes dp_replicate x dp_shard x pp x tp = {self.dp_replicate} x {dp_shard} x {self.pp} x "
                f"{self.tp} = {total} do not match the world size {world_size}: set parallel.dp_shard=-1 to take "
                f"the rest, or change the sizes"
            )
        if dp_shard % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep} must divide dp_shard={dp_shard} (expert parallelism borrows data-parallel "
                f"ranks): choose ep among {[d for d in range(1, dp_shard + 1) if dp_shard % d == 0]}"
            )
        if self.fsdp_offload and self.dp_replicate * dp_shard == 1 and "data" not in self.strategies:
            raise ConfigError(
                f"parallel.fsdp_offload=true offloads FSDP2's shards, but this layout has no FSDP2 (dp_replicate x "
                f"dp_shard = 1 at world size {world_size}): use more data-parallel ranks, add 'data' to "
                f"parallel.strategies (FSDP2 on one rank), or set parallel.fsdp_offload=false"
            )
        return dataclasses.replace(self, dp_shard=dp_shard)
