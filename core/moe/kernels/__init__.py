"""GPU routing kernels: plan the expert-sorted buffer, scatter tokens into it, combine them back.

`ops` holds the public differentiable ops (Triton on CUDA, torch reference on CPU); `routing` the
Triton kernels; `reference` their torch twins, also the CPU path and the tests' oracle.
"""

from .ops import KernelBackend, combine_rows, get_backend, route, scatter_rows, set_backend, use_backend
from .reference import RoutingPlan, num_buffer_rows

__all__ = [
    "KernelBackend",
    "RoutingPlan",
    "combine_rows",
    "get_backend",
    "num_buffer_rows",
    "route",
    "scatter_rows",
    "set_backend",
    "use_backend",
]
