"""Parallel strategies as plug-ins: one module each, applied in a fixed, documented order.

A strategy is a class with a ``name``, an ``order`` and three methods::

    class MyStrategy(ParallelStrategy):
        name = "my_strategy"
        order = 35                       # between expert (20) and data (40)
        def enabled(self, state) -> bool: ...
        def validate(self, state) -> None: ...   # raise ConfigError saying what to change
        def apply(self, state) -> None: ...      # edit state.model_parts / state.step_fn in place

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

from .config import ParallelConfig
from .mesh import ParallelMesh


@dataclass
class ParallelState:
    """What the strategies transform: the model parts this rank runs, and how a step runs."""

    model_parts: list[nn.Module]
    """This rank's modules: the whole model, or its pipeline stages (several when interleaved)."""
    mesh: ParallelMesh
    cfg: ParallelConfig
    model_cfg: Any
    """The model's config (counts, layer types); strategies read it, never import models."""
    device: Any = None
    step_fn: Callable | None = None
    """If set (pipeline), runs forward+backward of one rank batch: step_fn(batch) -> loss."""
    extras: dict[str, Any] = field(default_factory=dict)


class ParallelStrategy:
    name: str = ""
    order: int = 100

    def enabled(self, state: ParallelState) -> bool:
        return self.name in state.cfg.strategies

    def validate(self, state: ParallelState) -> None:
        pass

    def apply(self, state: ParallelState) -> None:
        raise NotImplementedError


STRATEGIES: dict[str, type[ParallelStrategy]] = {}


def register_strategy(cls: type[ParallelStrategy]) -> type[ParallelStrategy]:
    """Add a strategy class (usable as a decorator); its name must be new."""
    if not cls.name:
        raise ConfigError(f"strategy {cls.__name__} needs a name")
    if cls.name in STRATEGIES and STRATEGIES[cls.name] is not cls:
        raise ConfigError(f"a parallel strategy named {cls.name!r} is already registered")
    STRATEGIES[cls.name] = cls
    return cls


def apply_strategies(state: ParallelState) -> ParallelState:
    """Validate every enabled strategy first (so nothing is half-applied), then apply in order."""
    unknown = [n for n in state.cfg.strategies if n not in STRATEGIES]
    if unknown:
        raise ConfigError(f"unknown parallel strategies {unknown}: registered are {sorted(STRATEGIES)}")
    chosen = sorted((cls() for cls in STRATEGIES.values()), key=lambda s: s.order)
    chosen = [s for s in chosen if s.enabled(state)]
    for s in chosen:
        s.validate(state)
    for s in chosen:
        s.apply(state)
    state.extras["applied"] = [s.name for s in chosen]
    return state
