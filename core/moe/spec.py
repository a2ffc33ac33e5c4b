"""The MoE layer's parts as a spec of builders (Megatron-Core's specs): which router, experts and
dispatcher a layer is made of is decided when it is built, never by an ``if`` in its forward."""

from __future__ import annotations

import dataclasses
from typing import Callable

from torch import nn

from .config import MoEConfig
from .dispatcher import LocalDispatcher, TokenDispatcher
from .experts import GroupedExperts
from .router import ROUTERS


@dataclasses.dataclass(frozen=True)
class MoESpec:
    router: Callable[..., nn.Module]
    """(d_model, num_experts, RouterConfig, device) -> a router (x_TD -> RouterOutput)."""
    experts: Callable[..., nn.Module] = GroupedExperts
    """(num_experts, d_model, hidden, ExpertsBackend, device) -> experts (x_RD, offsets_L -> y_RD)."""
    dispatcher: Callable[[int], TokenDispatcher] = LocalDispatcher
    """(num_experts) -> the single-rank dispatcher (expert parallelism swaps in its own)."""

    @classmethod
    def from_config(cls, cfg: MoEConfig) -> "MoESpec":
        """The registered router named by cfg.router.kind, grouped experts, the local dispatcher."""
        return cls(router=ROUTERS[cfg.router.kind])
