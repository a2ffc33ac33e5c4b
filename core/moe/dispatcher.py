"""The token dispatcher interface: dispatch -> experts -> combine.

The MoE layer never knows where its experts live. A dispatcher takes the tokens and their
routing, returns the rows for *this rank's* experts in one contiguous expert-sorted buffer with
the per-local-expert offsets, and later brings the expert outputs back into token order with the
routing weights. ``LocalDispatcher`` (all experts on this rank) is here; the expert-parallel
all-to-all dispatcher lives in moetron.parallel and implements the same interface.

Legend: T tokens, D model dim, K experts per token, E experts (all of them), L this rank's experts
(E without expert parallelism), R expert-sorted rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .kernels.ops import combine_rows, route, scatter_rows


@dataclass
class DispatchResult:
    """What dispatch() hands the experts (x_RD, offsets_L), the layer's metrics (the counts) and
    combine() (state)."""

    x_RD: torch.Tensor
    """[R, D] rows for this rank's experts, grouped by local expert (compute dtype)."""
    offsets_L: torch.Tensor
    """int32 [L], inclusive cumsum of rows per local expert (torch._grouped_mm's offs)."""
    tokens_per_expert_E: torch.Tensor
    """int32 [all experts], slots routed to each expert by this rank's tokens, before dropping."""
    kept_per_expert_E: torch.Tensor
    """int32 [all experts], the same after capacity dropping."""
    state: Any
    """Whatever combine() needs to undo the dispatch."""


class TokenDispatcher:
    """Interface: the MoE layer calls dispatch(), runs the local experts, then combine()."""

    num_local_experts: int
    """L: the experts whose rows dispatch() returns."""

    def dispatch(
        self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int, capacity: int | None
    ) -> DispatchResult:
        """x_TD [T, D] tokens, topk_ids_TK int [T, K] their experts (of all E = num_experts),
        capacity: slots each expert may take (None: dropless) -> this rank's experts' rows."""
        raise NotImplementedError

    def combine(self, y_RD: torch.Tensor, topk_weights_TK: torch.Tensor | None, result: DispatchResult) -> torch.Tensor:
        """y_RD [R, D] the experts' outputs for result.x_RD, topk_weights_TK [T, K] -> [T, D]:
        each token's weighted sum over its kept slots, in token order (None: the unweighted sum)."""
        raise NotImplementedError

    def row_weights(self, topk_weights_TK: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        """topk_weights_TK [T, K] -> [R]: each slot's weight at its row of result.x_RD (0 for rows no
        slot fills), differentiable (model.moe.weights_before_down)."""
        raise NotImplementedError(f"{type(self).__name__} cannot place the combine weights on its rows: "
                                  f"model.moe.weights_before_down needs the local dispatcher (no expert parallel)")


class LocalDispatcher(TokenDispatcher):
    """Every expert on this rank: a routing plan, a scatter into the buffer, a weighted gather back."""

    def __init__(self, num_experts: int):
        self.num_local_experts = num_experts

    def dispatch(self, x_TD, topk_ids_TK, num_experts, capacity):
        plan = route(topk_ids_TK, num_experts, capacity)
        x_RD = scatter_rows(x_TD, plan.dest_row_TK, plan.num_rows)
        return DispatchResult(x_RD, plan.offsets_E, plan.tokens_per_expert_E, plan.kept_per_expert_E, plan)

    def combine(self, y_RD, topk_weights_TK, result):
        return combine_rows(y_RD, result.state.dest_row_TK, topk_weights_TK)

    def row_weights(self, topk_weights_TK, result):
        dest_TK = result.state.dest_row_TK.long()
        R = result.x_RD.shape[0]
        # Dropped slots (-1) write into a spare row past the end, cut off after: no host sync.
        index = torch.where(dest_TK >= 0, dest_TK, R).flatten()
        w_R = topk_weights_TK.new_zeros(R + 1).scatter(0, index, topk_weights_TK.flatten())
        return w_R[:R]
