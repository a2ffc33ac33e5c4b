"""Named run recipes: functions returning a full PretrainConfig (model, data and batch, parallel
layout, precision, recompute, optimizer and schedule), registered with the world size they are laid
out for.

    cfg = recipe("moe-1t")                      # a PretrainConfig; change any field before build()
    RECIPES["moe-1t"].world_size                # 512
    python tools/pretrain.py --recipe moe-1t --data.train_paths=[...]   # overrides apply on top

The published points (moe-1t, moe-2.4t) take the model, layout, batch and recompute from the
OLMo-core 3 report; their optimizer and schedule are not published with them and are this file's
choice, as are the layouts and schedules of the other recipes. Recipes that train on real data
set data.source=files and leave data.train_paths for the user (validation asks for them).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from moetron.core.memory import MemoryConfig, Recompute
from moetron.core.optim import OptimizerConfig, SchedulerConfig
from moetron.core.precision import PrecisionConfig
from moetron.core.precision.config import PrecisionRecipe
from moetron.core.registry import Registry
from moetron.core.trainer import TrainerConfig
from moetron.data.loader import DataConfig, DataSource
from moetron.models import ModelConfig
from moetron.parallel import ParallelConfig, PipelineSchedule

from .config import PretrainConfig


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named recipe: ``make()`` returns a fresh PretrainConfig laid out for ``world_size`` ranks."""

    name: str
    world_size: int
    """Ranks (GPUs; processes for the CPU proxy) the recipe's parallel layout is written for."""
    make: Callable[[], PretrainConfig]

    def __call__(self) -> PretrainConfig:
        return self.make()

    @property
    def summary(self) -> str:
        """The first line of the recipe function's docstring."""
        return (self.make.__doc__ or "").strip().splitlines()[0]


RECIPES: Registry[Recipe] = Registry("recipe")
"""Recipe name -> Recipe (callable: returns the recipe's PretrainConfig)."""


def register_recipe(name: str, world_size: int) -> Callable[[Callable[[], PretrainConfig]], Callable[[], PretrainConfig]]:
    """Decorator: register a function returning a PretrainConfig as recipe ``name``."""

    def register(make: Callable[[], PretrainConfig]) -> Callable[[], PretrainConfig]:
        RECIPES.add(name, Recipe(name, world_size, make))
        return make

    return register


def recipe(name: str) -> PretrainConfig:
    """A fresh PretrainConfig of the recipe ``name``; ConfigError names the recipes if it is unknown."""
    return RECIPES.lookup(name.replace("_", "-").lower(), "--recipe")()


def _token_files(seq_len: int, global_batch_size: int) -> DataConfig:
    """Real token data (the user names data.train_paths) cut into global batches of sequences."""
    return DataConfig(source=DataSource.files, seq_len=seq_len, global_batch_size=global_batch_size)


def _ultra(name: str, num_experts: int, ep: int) -> PretrainConfig:
    """The OLMo-core 3 "Ultra" points: the moe_1t model, EP ep x PP 8 on 512 GPUs, 64Mi-token batches."""
    return PretrainConfig(
        name=name,
        model=ModelConfig.moe_1t(num_experts),
        data=_token_files(seq_len=8192, global_batch_size=8192),  # 8192 x 8192 = 64Mi tokens per step
        # 512 = pp 8 x dp_shard 64; ep borrows from dp_shard. 32 micro-batches of 4 sequences per rank
        # keep the 1F1B bubble at 7/39 of a step (our choice: the report gives no micro-batch count).
        parallel=ParallelConfig(ep=ep, pp=8, pp_schedule=PipelineSchedule.one_f_one_b, pp_microbatches=32),
        memory=MemoryConfig(recompute=Recompute.full),  # per-layer recompute, as published
        precision=PrecisionConfig(recipe=PrecisionRecipe.bf16),
        optimizer=OptimizerConfig(lr=2e-4, weight_decay=0.1),
        scheduler=SchedulerConfig(warmup_steps=2000),
        trainer=TrainerConfig(steps=50_000, eval_interval=1000),  # 50k x 64Mi = 3.4T tokens
    )


@register_recipe("moe-1t", world_size=512)
def moe_1t() -> PretrainConfig:
    """OLMo-core 3 "Ultra-128E", 1.2T total / 58.4B active: EP 8 x PP 8 on 512 GPUs, 64Mi-token batches.

    63 layers x 6144, 64 heads x 128 (32 KV), 128 routed experts of hidden 8192 + 1 shared, top-4,
    seq 8192, global batch 8192 sequences, full per-layer recompute. The source trains it in MXFP8:
    ``--precision.recipe=mxfp8`` gives that (native MX GEMMs on SM100/SM103, written against torch's
    documented API and not yet run on Blackwell; exact emulation elsewhere, docs/precision.md). The
    recipe stays bf16 until the native path has run. LR, warmup, length and the load balancing (the
    Switch loss plus the aux-loss-free expert bias, ModelConfig.moe_1t) are our choice (not
    published with the point)."""
    return _ultra("moe-1t", num_experts=128, ep=8)


@register_recipe("moe-2.4t", world_size=512)
def moe_2_4t() -> PretrainConfig:
    """moe-1t with 256 routed experts and EP 32: 2.38T total, 58.4B active, on 512 GPUs.

    Everything else as moe-1t, bf16 included (the native MXFP8 GEMMs need Blackwell and have not run)."""
    return _ultra("moe-2.4t", num_experts=256, ep=32)


@register_recipe("moe-1t-proxy", world_size=8)
def moe_1t_proxy(num_gpus: int = 8) -> PretrainConfig:
    """moe-1t's routing at one-host size: what examples/pretrain_moe_1t.sh trains on ``num_gpus`` GPUs.

    Preset moe-1t-proxy (128 routed experts + 1 shared, top-4, d_model 768) with 2 + 2 x num_gpus
    layers, expert parallel over every GPU, seq 2048, 8 sequences (16K tokens) per GPU per step."""
    model = ModelConfig.moe_1t_proxy()
    model.n_layers = 2 + 2 * num_gpus
    return PretrainConfig(
        name="moe-1t-proxy",
        model=model,
        data=DataConfig(seq_len=2048, global_batch_size=8 * num_gpus),
        parallel=ParallelConfig(ep=num_gpus),
        trainer=TrainerConfig(steps=240, eval_interval=60),
        scheduler=SchedulerConfig(warmup_steps=20),
    )


@register_recipe("tiny-moe-local", world_size=1)
def tiny_moe_local() -> PretrainConfig:
    """The CPU proxy of moe-1t (examples/pretrain_moe_1t.sh without GPUs): preset tiny-moe on the embedded corpus.

    top-4 over 16 experts + 1 shared, first layer dense, Olmo 3 attention; one process, a few
    minutes on 2 cores. Its router keeps the Switch loss alone: its 16 experts stay balanced without
    moe-1t's expert bias, which showed no gain here (docs/moe.md, "Balancing in the recipes")."""
    return PretrainConfig(
        name="moe-1t-proxy",
        model=ModelConfig.tiny_moe(),
        trainer=TrainerConfig(steps=240, eval_interval=60),
        scheduler=SchedulerConfig(warmup_steps=20),
    )


def _fsdp(name: str, model: ModelConfig, seq_len: int, global_batch_size: int, lr: float,
          micro_batch_size: int) -> PretrainConfig:
    """A bf16 run sharded over every rank (FSDP2, no EP/PP) on token files, 100k steps of cosine."""
    return PretrainConfig(
        name=name,
        model=model,
        data=_token_files(seq_len=seq_len, global_batch_size=global_batch_size),
        precision=PrecisionConfig(recipe=PrecisionRecipe.bf16),
        optimizer=OptimizerConfig(lr=lr, weight_decay=0.1),
        scheduler=SchedulerConfig(warmup_steps=2000),
        trainer=TrainerConfig(steps=100_000, micro_batch_size=micro_batch_size, eval_interval=1000),
    )


@register_recipe("olmo3-7b", world_size=64)
def olmo3_7b() -> PretrainConfig:
    """Olmo 3 7B (dense, 32 x 4096) on 64 GPUs: FSDP over all of them, seq 8192, 4Mi-token batches.

    512 sequences per step, 8 per rank in micro-batches of 1; LR 3e-4 cosine. The layout and
    schedule are our choice (the source gives the architecture, not this run)."""
    return _fsdp("olmo3-7b", ModelConfig.olmo3_7b(), seq_len=8192, global_batch_size=512, lr=3e-4,
                 micro_batch_size=1)


@register_recipe("olmoe-1b-7b", world_size=64)
def olmoe_1b_7b() -> PretrainConfig:
    """OLMoE-1B-7B (64 experts top-8, 1.3B active / 6.9B total) on 64 GPUs: FSDP, seq 4096, 4Mi-token batches.

    1024 sequences per step, 16 per rank in micro-batches of 4; LR 4e-4 cosine. The layout and
    schedule are our choice."""
    return _fsdp("olmoe-1b-7b", ModelConfig.olmoe_1b_7b(), seq_len=4096, global_batch_size=1024, lr=4e-4,
                 micro_batch_size=4)
