"""Parallel strategies on one device mesh: data (FSDP2/HSDP), expert (all-to-all), pipeline.

Importing this package registers the built-in strategies; see registry.py for adding one.
"""

from .config import ExpertDispatch, ParallelConfig, PipelineSchedule
from .mesh import ParallelMesh
from .registry import STRATEGIES, ParallelState, ParallelStrategy, apply_strategies, register_strategy
from . import data, expert, pipeline  # noqa: F401  (register "data", "expert", "pipeline")

__all__ = [
    "STRATEGIES",
    "ExpertDispatch",
    "ParallelConfig",
    "ParallelMesh",
    "ParallelState",
    "ParallelStrategy",
    "PipelineSchedule",
    "apply_strategies",
    "register_strategy",
]
