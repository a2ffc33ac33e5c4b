"""PretrainConfig: a whole run (model, data, optimizer, schedule, trainer, precision, memory,
checkpoints, parallel layout, experiment tracking), and check_layout: whether a run's layout fits a
world size, decided from the config alone (nothing is built)."""

from __future__ import annotations

import dataclasses

from moetron.core.checkpoint import CheckpointConfig
from moetron.core.config import Config, ConfigError
from moetron.core.memory import MemoryConfig
from moetron.core.optim import EIGHT_BIT_STATES, OptimizerConfig, SchedulerConfig
from moetron.core.precision import PrecisionConfig
from moetron.core.tracking import LoggingConfig
from moetron.core.trainer import TrainerConfig
from moetron.data.loader import DataConfig
from moetron.models import ModelConfig
from moetron.parallel import ParallelConfig, PipelineSchedule
from moetron.parallel.pipeline.runtime import n_microbatches


@dataclasses.dataclass
class PretrainConfig(Config):
    """A whole run: model, data, optimizer, schedule, trainer, checkpoints and experiment tracking."""

    name: str = "tiny-local"
    """Run name shown in logs."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig.tiny)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=lambda: OptimizerConfig(lr=3e-3))
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def validate(self) -> None:
        super().validate()
        if self.scheduler.warmup_steps > self.trainer.steps:
            raise ConfigError(
                f"scheduler.warmup_steps={self.scheduler.warmup_steps} exceeds trainer.steps={self.trainer.steps}"
            )
        self.precision.check_gemm_widths(self.model.gemm_widths())
        if self.optimizer.state_dtype in EIGHT_BIT_STATES and self.precision.quantized_expert_copies:
            raise ConfigError(f"optimizer.state_dtype={self.optimizer.state_dtype} with "
                              "precision.quantized_expert_copies is not built (the "
                              "optimizer's MX-pair kernel steps bf16 or fp32 moments): use "
                              "--optimizer.state_dtype=bf16, or drop quantized_expert_copies")


def check_layout(cfg: PretrainConfig, world_size: int) -> ParallelConfig:
    """The run's parallel layout resolved for ``world_size`` ranks, checked against its model and batch
    without building anything: the sizes multiply to the world, EP divides the experts, every
    pipeline stage gets a block, and the global batch splits over the data-parallel ranks and then
    into micro-batches. Returns the resolved ParallelConfig; ConfigError says what to change."""
    par = cfg.parallel.resolve(world_size)
    moe = cfg.model.moe
    if par.ep > 1 and (moe is None or moe.num_experts % par.ep):
        experts = moe.num_experts if moe is not None else 0
        raise ConfigError(f"parallel.ep={par.ep} must divide model.moe.num_experts={experts}")
    stages = par.pp * par.pp_stages_per_rank
    if stages > cfg.model.n_layers:
        raise ConfigError(
            f"parallel.pp x pp_stages_per_rank = {stages} stages but the model has {cfg.model.n_layers} layers"
        )
    dp = par.dp_replicate * par.dp_shard
    if cfg.data.global_batch_size % dp:
        raise ConfigError(
            f"data.global_batch_size={cfg.data.global_batch_size} does not split over {dp} data-parallel ranks"
        )
    local = cfg.data.global_batch_size // dp
    if par.pp > 1:  # the pipeline schedule cuts each rank's batch into pp_microbatches
        micro = n_microbatches(par, stages)
        if par.pp_schedule == PipelineSchedule.one_f_one_b and micro < stages:
            raise ConfigError(f"parallel.pp_microbatches={micro} must be >= the {stages} stages under 1f1b")
        if local % micro:
            raise ConfigError(
                f"each rank's {local} sequences (data.global_batch_size / {dp} data-parallel ranks) do not split "
                f"into parallel.pp_microbatches={micro} micro-batches"
            )
    elif cfg.trainer.micro_batch_size is not None and local % cfg.trainer.micro_batch_size:
        raise ConfigError(
            f"each rank's {local} sequences (data.global_batch_size / {dp} data-parallel ranks) do not split "
            f"into micro-batches of trainer.micro_batch_size={cfg.trainer.micro_batch_size}"
        )
    return par
