"""Torch references for the MoE routing kernels: the CPU path and the oracle for routing.py.

Every public function here has the same signature (but scatter_rows' weights, used only by this
file's combine_rows_backward) and the same results as its Triton twin in routing.py:
bit-exact for the integer outputs of `route`, and for the float ops the same fp32 arithmetic in the
same order (the K terms of a token are summed k = 0, 1, ..., K-1), so results match up to fp32
rounding of multiply-add contraction (the Triton kernels disable it) and reduction order over D in
`combine_rows_backward`'s weight gradient.

All functions are free of host-device syncs (no .item(), nonzero, boolean-mask indexing or
bincount without a fixed size), so they may run on CUDA inside the training step too.

Shape legend:
    T  tokens in the micro-batch           K  experts per token (top-k)
    E  experts                             D  model (hidden) dim
    R  rows of the expert-sorted buffer (`num_rows`: T*K dropless, min(T*K, E*capacity) otherwise)
    N  routed slots, N = T*K (slot n = t*K + k)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class RoutingPlan(NamedTuple):
    """Where each (token, k) slot goes in the expert-sorted buffer.

    tokens_per_expert_E: int32 [E], slots routed to each expert before capacity dropping.
    kept_per_expert_E:   int32 [E], slots kept after dropping (== tokens_per_expert_E if dropless).
    offsets_E:           int32 [E], inclusive cumsum of kept_per_expert_E: expert e owns rows
                         [offsets_E[e-1], offsets_E[e]) (torch._grouped_mm's `offs`).
    dest_row_TK:         int32 [T, K], the slot's row in the buffer, -1 if the slot was dropped.
    num_rows:            static Python int R, the buffer's row count; rows past offsets_E[-1] are
                         unused.
    """

    tokens_per_expert_E: Tensor
    kept_per_expert_E: Tensor
    offsets_E: Tensor
    dest_row_TK: Tensor
    num_rows: int


def num_buffer_rows(num_tokens: int, top_k: int, num_experts: int, capacity: int | None) -> int:
    """Static row count R of the expert-sorted buffer (static so sizing it never syncs)."""
    num_slots = num_tokens * top_k
    if capacity is None:
        return num_slots
    return min(num_slots, num_experts * capacity)


def check_route_args(topk_ids_TK: Tensor, num_experts: int, capacity: int | None) -> None:
    """Fail fast on arguments (never on values: checking ids would need a host sync)."""
    if topk_ids_TK.dim() != 2:
        raise ValueError(f"topk_ids_TK must be 2-D [T, K], got shape {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids_TK must be int32 or int64, got {topk_ids_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be None (dropless) or >= 0, got {capacity}")


def route_counts(
    topk_ids_TK: Tensor, num_experts: int, capacity: int | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The tensors of `route` (tokens_per_expert_E, kept_per_expert_E, offsets_E, dest_row_TK).

    Ids must lie in [0, num_experts); they are not checked (that would sync).
    Order: rows grouped by expert ascending; within an expert, slots by flat index t*K + k. With a
    capacity, each expert keeps its first `capacity` slots in that order (earlier tokens win).
    """
    check_route_args(topk_ids_TK, num_experts, capacity)
    T, K = topk_ids_TK.shape
    device = topk_ids_TK.device
    ids_N = topk_ids_TK.reshape(-1).long()
    N = ids_N.numel()

    # scatter_add into a fixed-size [E] histogram: bincount would size its output from the data.
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts_E.scatter_add_(0, ids_N, torch.ones_like(ids_N))
    kept_E = counts_E if capacity is None else counts_E.clamp(max=capacity)
    offsets_E = kept_E.cumsum(0)
    first_row_E = offsets_E - kept_E  # exclusive cumsum: the first row of each expert
    first_slot_E = counts_E.cumsum(0) - counts_E  # where each expert starts in sorted slot order

    # Stable sort by expert keeps ascending flat order within an expert (the documented order).
    order_N = torch.argsort(ids_N, stable=True)
    sorted_ids_N = ids_N[order_N]
    rank_N = torch.arange(N, device=device) - first_slot_E[sorted_ids_N]  # rank within expert
    dest_sorted_N = first_row_E[sorted_ids_N] + rank_N
    if capacity is not None:
        dest_sorted_N = torch.where(rank_N < capacity, dest_sorted_N, -1)
    dest_row_N = torch.empty_like(dest_sorted_N).scatter_(0, order_N, dest_sorted_N)

    i32 = torch.int32
    return (counts_E.to(i32), kept_E.to(i32), offsets_E.to(i32), dest_row_N.to(i32).view(T, K))


def route(topk_ids_TK: Tensor, num_experts: int, capacity: int | None = None) -> RoutingPlan:
    """Plan the expert-sorted layout of the top-k slots: see RoutingPlan and route_counts."""
    T, K = topk_ids_TK.shape
    tensors = route_counts(topk_ids_TK, num_experts, capacity)
    return RoutingPlan(*tensors, num_rows=num_buffer_rows(T, K, num_experts, capacity))


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for training dtypes; fp64 stays fp64 (so gradcheck can run in float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def padded_index_TK(dest_row_TK: Tensor, num_rows: int) -> Tensor:
    """dest_row_TK as int64 with dropped slots (-1) sent to a spare row `num_rows`."""
    dest_TK = dest_row_TK.long()
    return torch.where(dest_TK < 0, num_rows, dest_TK)


def scatter_rows(x_TD: Tensor, dest_row_TK: Tensor, num_rows: int, weights_TK: Tensor | None = None) -> Tensor:
    """x_RD[dest_row_TK[t, k]] = x_TD[t] (times weights_TK[t, k] in fp32 if given); unwritten rows 0.

    x_TD [T, D], dest_row_TK int [T, K] (-1 = dropped, each row >= 0 at most once) -> x_RD [R, D]
    in x's dtype. The weighted form is this file's combine_rows_backward for y (the Triton
    backward fuses it into its own kernel, so routing.scatter_rows has no weights).
    """
    T, D = x_TD.shape
    K = dest_row_TK.shape[1]
    index_N = padded_index_TK(dest_row_TK, num_rows).reshape(-1)
    src_TKD = x_TD.unsqueeze(1).expand(T, K, D)
    if weights_TK is not None:
        acc = accumulator_dtype(x_TD.dtype)
        src_TKD = (weights_TK.to(acc).unsqueeze(-1) * src_TKD.to(acc)).to(x_TD.dtype)
    # One spare row absorbs the dropped slots, so no data-dependent mask is needed.
    x_RD = torch.zeros(num_rows + 1, D, dtype=x_TD.dtype, device=x_TD.device)
    x_RD.index_copy_(0, index_N, src_TKD.reshape(T * K, D))
    return x_RD[:num_rows]


def combine_rows(y_RD: Tensor, dest_row_TK: Tensor, weights_TK: Tensor | None = None) -> Tensor:
    """out_TD[t] = sum_k weights_TK[t, k] * y_RD[dest_row_TK[t, k]], dropped slots skipped.

    y_RD [R, D], dest_row_TK int [T, K], weights_TK [T, K] or None (all ones) -> out_TD [T, D] in
    y's dtype, accumulated in fp32 (fp64 for fp64 y) in k order. Unweighted, it is scatter_rows' backward.
    """
    R, D = y_RD.shape
    T, K = dest_row_TK.shape
    index_TK = padded_index_TK(dest_row_TK, R)
    y_pad_RD = torch.cat([y_RD, y_RD.new_zeros(1, D)])  # the spare row reads as zeros
    acc = accumulator_dtype(y_RD.dtype)
    out_TD = torch.zeros(T, D, dtype=acc, device=y_RD.device)
    for k in range(K):  # K <= 8 or so; an explicit loop fixes the fp32 summation order
        y_TD = y_pad_RD[index_TK[:, k]].to(acc)
        if weights_TK is not None:
            y_TD = weights_TK[:, k].to(acc).unsqueeze(-1) * y_TD
        out_TD = out_TD + y_TD
    return out_TD.to(y_RD.dtype)


def combine_rows_backward(
    grad_out_TD: Tensor, y_RD: Tensor, dest_row_TK: Tensor, weights_TK: Tensor
) -> tuple[Tensor, Tensor]:
    """Gradients of combine_rows: (grad_y_RD [R, D] in y's dtype, grad_weights_TK [T, K] in weights').

    grad_y_RD[dest_row_TK[t, k]] = weights_TK[t, k] * grad_out_TD[t] (unreferenced rows 0);
    grad_weights_TK[t, k] = dot(y_RD[dest_row_TK[t, k]], grad_out_TD[t]) in fp32, 0 if dropped.
    """
    R, D = y_RD.shape
    grad_y_RD = scatter_rows(grad_out_TD.to(y_RD.dtype), dest_row_TK, R, weights_TK)
    index_TK = padded_index_TK(dest_row_TK, R)
    y_pad_RD = torch.cat([y_RD, y_RD.new_zeros(1, D)])
    acc = accumulator_dtype(y_RD.dtype)
    y_TKD = y_pad_RD[index_TK].to(acc)
    grad_w_TK = (y_TKD * grad_out_TD.to(acc).unsqueeze(1)).sum(-1)
    return grad_y_RD, grad_w_TK.to(weights_TK.dtype)
