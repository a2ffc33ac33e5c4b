"""Parallel strategies as plug-ins: one module each, applied in a fixed, documented order.

A strategy is a class with a ``name``, an ``order`` and three methods::

    class MyStrategy(ParallelStrategy):
        name = "my_strategy"
        order = 35                       # between expert (20) and data (40)
        def enabled(self, state) -> bool: ...
        def validate(self, state) -> None: ...   # raise ConfigError saying what to change
        def apply(self, state) -> None: ...      # edit state.model_parts / state.step_fn ... in place

    register_strategy(MyStrategy)

Application order (lower first), so each strategy sees the model the earlier ones left:

    10 pipeline  split the model into stage modules (state.model_parts) and set the step function
    20 expert    swap each MoE layer's dispatcher for the all-to-all one; keep the local experts
    30 tensor    (reserved)
    40 data      FSDP2 / HSDP: shard every block's parameters, gradients and optimizer state
    50 compile   (reserved)

A strategy is enabled by its own sizes (ep > 1, pp > 1, ...) or by naming it in
``parallel.strategies``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from moetron.core.config import ConfigError
from moetron.core.precision import PrecisionPolicy
from moetron.core.registry import Registry

from .config import ParallelConfig
from .mesh import ParallelMesh
from .model import ModelShape


@dataclass
class PipelineLayout:
    """How the pipeline strategy cut the model (for logs and tests)."""

    num_stages: int
    stage_ids: list[int]
    """The stages this rank runs."""
    blocks: list[list[str]]
    """Block keys of each of this rank's stages."""
    n_microbatches: int
    schedule: str


@dataclass
class ParallelState:
    """What the strategies transform, and what they read and report, as typed fields.

    The run fills the inputs; apply_strategies() fills ``enabled`` before any strategy applies
    (so a strategy may ask whether a later one will run) and ``applied`` after.
    """

    model_parts: list[nn.Module]
    """This rank's modules: the whole model, or its pipeline stages (several when interleaved);
    each is a ParallelModel (moetron.parallel.model) or a stage of one."""
    mesh: ParallelMesh
    cfg: ParallelConfig
    model_cfg: ModelShape
    """The model's config (counts, layer types); strategies read it, never import models."""
    device: Any = None

    # ---- inputs from the run ----------------------------------------------------------------
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy.full)
    """The run's precision: autocast, FSDP2 mixed precision, pipeline boundary dtype."""
    loss_fn: Callable | None = None
    """loss(logits [b, S, V], labels [b, S]) -> mean, over the last pipeline stage's logits; None:
    the model's LM head computes the loss itself (lm_head(hidden, labels), core.layers.LMHead)."""
    seq_len: int | None = None
    """Training sequence length (the pipeline's FLOPs split reads it)."""
    local_batch_size: int | None = None
    """Sequences per rank per step (checked against the pipeline's micro-batches up front)."""

    # ---- set by the strategies --------------------------------------------------------------
    enabled: list[str] = field(default_factory=list)
    """Names of the strategies that will be applied, in order (set before any applies)."""
    applied: list[str] = field(default_factory=list)
    step_fn: Callable | None = None
    """If set (pipeline), runs forward+backward of one rank batch: step_fn(batch) -> loss."""
    eval_fn: Callable | None = None
    """If set (pipeline), the forward-only loss of one rank batch: eval_fn(batch) -> loss."""
    grad_norm_groups: tuple = ()
    """Groups across which the model is split (pipeline stages): grad norms and MoE stats span them."""
    ep_dispatch: str | None = None
    """The expert-parallel dispatch chosen (auto resolved), None without expert parallelism."""
    pipeline: PipelineLayout | None = None
    grad_sync: Callable[[bool], None] | None = None
    """If set (FSDP2), grad_sync(False) keeps the next backward's gradients unreduced (accumulated
    locally), grad_sync(True) reduces them; the trainer calls it per micro-batch when
    parallel.grad_sync=step."""


class ParallelStrategy:
    name: str = ""
    order: int = 100

    def enabled(self, state: ParallelState) -> bool:
        return self.name in state.cfg.strategies

    def validate(self, state: ParallelState) -> None:
        pass

    def apply(self, state: ParallelState) -> None:
        raise NotImplementedError


STRATEGIES: Registry[type[ParallelStrategy]] = Registry("parallel strategy")


def register_strategy(cls: type[ParallelStrategy]) -> type[ParallelStrategy]:
    """Add a strategy class (usable as a decorator); its name must be new."""
    return STRATEGIES.add(cls.name, cls)


def apply_strategies(state: ParallelState) -> ParallelState:
    """Validate every enabled strategy first (so nothing is half-applied), then apply in order."""
    unknown = [n for n in state.cfg.strategies if n not in STRATEGIES]
    if unknown:
        raise ConfigError(f"unknown parallel strategies {unknown}: registered are {sorted(STRATEGIES)}")
    chosen = sorted((cls() for cls in STRATEGIES.values()), key=lambda s: s.order)
    chosen = [s for s in chosen if s.enabled(state)]
    state.enabled = [s.name for s in chosen]
    for s in chosen:
        s.validate(state)
    for s in chosen:
        s.apply(state)
        state.applied.append(s.name)
    return state
