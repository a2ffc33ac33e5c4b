"""Mixture-of-experts: router, experts, dispatcher interface, Triton routing kernels, load metrics."""

from .config import ExpertsBackend, LoadBalanceGranularity, MoEConfig, RouterConfig, RouterScore
from .dispatcher import DispatchResult, LocalDispatcher, TokenDispatcher
from .experts import GroupedExperts
from .layer import MoELayer, moe_layers
from .router import Router, RouterOutput, load_balance_loss, z_loss
from .spec import MoESpec

__all__ = [
    "DispatchResult",
    "ExpertsBackend",
    "GroupedExperts",
    "LoadBalanceGranularity",
    "LocalDispatcher",
    "MoEConfig",
    "MoELayer",
    "MoESpec",
    "Router",
    "RouterConfig",
    "RouterOutput",
    "RouterScore",
    "TokenDispatcher",
    "load_balance_loss",
    "moe_layers",
    "z_loss",
]
