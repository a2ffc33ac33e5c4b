"""Public, differentiable routing ops: Triton on CUDA tensors, the torch reference on CPU.

Each op is a `torch.library.custom_op` ("moetron::...") with a fake (meta) implementation, so
torch.compile traces through it without graph breaks, and with `register_autograd` for its backward.
The backend is chosen in Python before the op is called (and passed to it as a bool), so a test can
force the torch path on a GPU or the Triton path on the CPU (under TRITON_INTERPRET=1):

    set_backend("torch")              # or "triton", or "auto" (the default)
    with use_backend("triton"): ...   # scoped

Shape legend:
    T  tokens        K  experts per token (top-k)     E  experts
    D  model dim     R  rows of the expert-sorted buffer (RoutingPlan.num_rows)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from enum import StrEnum

import torch
from torch import Tensor

from moetron.core.moe.kernels import reference, routing
from moetron.core.moe.kernels.reference import RoutingPlan, num_buffer_rows


class KernelBackend(StrEnum):
    """Which implementation the routing ops run."""

    auto = "auto"
    """Triton for CUDA tensors, the torch reference otherwise."""
    triton = "triton"
    """Always Triton (on CPU tensors only under TRITON_INTERPRET=1)."""
    torch = "torch"
    """Always the torch reference (reference.py), on any device."""


_backend = KernelBackend.auto


def set_backend(backend: KernelBackend | str) -> None:
    """Select the routing ops' implementation for the whole process (see KernelBackend)."""
    global _backend
    _backend = KernelBackend(backend)


def get_backend() -> KernelBackend:
    return _backend


@contextlib.contextmanager
def use_backend(backend: KernelBackend | str) -> Iterator[None]:
    """Run a block with another backend, restoring the previous one after."""
    previous = _backend
    set_backend(backend)
    try:
        yield
    finally:
        set_backend(previous)


def _use_triton(t: Tensor) -> bool:
    if _backend == KernelBackend.torch:
        return False
    if _backend == KernelBackend.auto:
        return t.is_cuda
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "routing backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before moetron is "
            "imported; use set_backend('torch') or 'auto' for the CPU path"
        )
    return True


# ---------------------------------------------------------------------------------------------
# route
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("moetron::route", mutates_args=())
def _route_op(
    topk_ids: Tensor, num_experts: int, capacity: int | None, use_triton: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    impl = routing if use_triton else reference
    return impl.route_counts(topk_ids, num_experts, capacity)


@_route_op.register_fake
def _(topk_ids, num_experts, capacity, use_triton):
    int_E = lambda: topk_ids.new_empty(num_experts, dtype=torch.int32)  # noqa: E731
    return int_E(), int_E(), int_E(), topk_ids.new_empty(topk_ids.shape, dtype=torch.int32)


def route(topk_ids_TK: Tensor, num_experts: int, capacity: int | None = None) -> RoutingPlan:
    """Plan the expert-sorted buffer for top-k routing, on the device, with no host sync.

    topk_ids_TK: int32 or int64 [T, K], each id in [0, num_experts) (not checked: it would sync).
    capacity: None for dropless; else each expert keeps its first `capacity` slots in flat order
        t*K + k (earlier tokens of the micro-batch win) and the rest are dropped (dest row -1).
    Returns RoutingPlan(tokens_per_expert_E int32 [E] before dropping, kept_per_expert_E int32 [E],
    offsets_E int32 [E] inclusive cumsum of kept (torch._grouped_mm's offs), dest_row_TK int32
    [T, K], num_rows: static int R = T*K dropless, else min(T*K, E*capacity)). Rows are grouped by
    expert ascending, slots in flat order within an expert, kept rows packed from row 0.
    """
    T, K = topk_ids_TK.shape
    tensors = _route_op(topk_ids_TK, num_experts, capacity, _use_triton(topk_ids_TK))
    return RoutingPlan(*tensors, num_rows=num_buffer_rows(T, K, num_experts, capacity))


# ---------------------------------------------------------------------------------------------
# scatter_rows
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("moetron::scatter_rows", mutates_args=())
def _scatter_rows_op(x: Tensor, dest_row: Tensor, num_rows: int, use_triton: bool) -> Tensor:
    impl = routing if use_triton else reference
    return impl.scatter_rows(x, dest_row, num_rows)


@_scatter_rows_op.register_fake
def _(x, dest_row, num_rows, use_triton):
    return x.new_empty(num_rows, x.shape[1])


def _scatter_rows_setup(ctx, inputs, output):
    _, dest_row, _, use_triton = inputs
    ctx.save_for_backward(dest_row)
    ctx.use_triton = use_triton


def _scatter_rows_backward(ctx, grad_RD):
    (dest_row,) = ctx.saved_tensors
    # grad_x[t] = sum_k grad_RD[dest_row[t, k]]: the unweighted combine, fp32 in k order.
    grad_x = _combine_rows_op(grad_RD, dest_row, None, ctx.use_triton)
    return grad_x, None, None, None


_scatter_rows_op.register_autograd(_scatter_rows_backward, setup_context=_scatter_rows_setup)


def scatter_rows(x_TD: Tensor, dest_row_TK: Tensor, num_rows: int) -> Tensor:
    """Copy each token into its experts' rows: x_RD[dest_row_TK[t, k]] = x_TD[t].

    x_TD [T, D]; dest_row_TK int32 [T, K] from `route` (-1 = dropped, skipped); num_rows R.
    Returns x_RD [R, D] in x's dtype; rows no slot writes are zero. Differentiable in x.
    """
    return _scatter_rows_op(x_TD, dest_row_TK, num_rows, _use_triton(x_TD))


# ---------------------------------------------------------------------------------------------
# combine_rows
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("moetron::combine_rows", mutates_args=())
def _combine_rows_op(y: Tensor, dest_row: Tensor, weights: Tensor | None, use_triton: bool) -> Tensor:
    impl = routing if use_triton else reference
    return impl.combine_rows(y, dest_row, weights)


@_combine_rows_op.register_fake
def _(y, dest_row, weights, use_triton):
    return y.new_empty(dest_row.shape[0], y.shape[1])


@torch.library.custom_op("moetron::combine_rows_backward", mutates_args=())
def _combine_rows_backward_op(
    grad_out: Tensor, y: Tensor, dest_row: Tensor, weights: Tensor, use_triton: bool
) -> tuple[Tensor, Tensor]:
    impl = routing if use_triton else reference
    return impl.combine_rows_backward(grad_out, y, dest_row, weights)


@_combine_rows_backward_op.register_fake
def _(grad_out, y, dest_row, weights, use_triton):
    return torch.empty_like(y), torch.empty_like(weights)


def _combine_rows_setup(ctx, inputs, output):
    y, dest_row, weights, use_triton = inputs
    # Only the weight gradient reads y: the unweighted form does not keep the [R, D] rows alive.
    ctx.save_for_backward(y if weights is not None else None, dest_row, weights)
    ctx.num_rows = y.shape[0]
    ctx.y_dtype = y.dtype
    ctx.use_triton = use_triton


def _combine_rows_backward(ctx, grad_out_TD):
    y, dest_row, weights = ctx.saved_tensors
    if weights is None:  # the unweighted form (scatter_rows' backward): grad_y is a plain scatter
        grad_y = _scatter_rows_op(grad_out_TD.to(ctx.y_dtype), dest_row, ctx.num_rows, ctx.use_triton)
        return grad_y, None, None, None
    grad_y, grad_w = _combine_rows_backward_op(grad_out_TD, y, dest_row, weights, ctx.use_triton)
    return grad_y, None, grad_w, None


_combine_rows_op.register_autograd(_combine_rows_backward, setup_context=_combine_rows_setup)


def combine_rows(y_RD: Tensor, dest_row_TK: Tensor, weights_TK: Tensor | None = None) -> Tensor:
    """Weighted sum of each token's expert outputs: out_TD[t] = sum_k w[t, k] * y_RD[dest_row[t, k]].

    y_RD [R, D] expert outputs in buffer order; dest_row_TK int32 [T, K] (-1 = dropped, skipped);
    weights_TK [T, K] (any float dtype) or None for all ones. Accumulates in fp32 in k order and
    returns out_TD [T, D] in y's dtype. Differentiable in y and weights (grad_weights in fp32,
    cast to weights' dtype; 0 for dropped slots).
    """
    return _combine_rows_op(y_RD, dest_row_TK, weights_TK, _use_triton(y_RD))
