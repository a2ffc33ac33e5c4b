"""Expert parallelism: experts split over the ``ep`` ranks, tokens moved to them by all-to-all.

Each of the P ranks of the ep group owns L = E / P consecutive experts (rank r: global experts
[r*L, (r+1)*L)). The MoE layer does not know it: it calls the same TokenDispatcher interface
as with LocalDispatcher, and the expert weights become DTensors sharded Shard(0) over the ep mesh
(a DCP checkpoint holds the global [E, ...] tensors, so it loads under any other layout).

Dispatch, as the data flows:
    route over all E experts (rows grouped by global expert, so each peer's rows are contiguous)
    -> scatter the tokens into the send buffer
    -> all_to_all the per-(peer, local expert) row counts
    -> all_to_all the rows (synced: exact uneven splits read on the host once per layer;
       sync_free: static blocks of ``cap`` rows per peer, overflow dropped and counted)
    -> reorder the received rows (source rank major) into local-expert-major order (route, K=1)
Combine reverses each step; the all-to-alls are differentiable (backward = the reverse exchange).
The modes are three dispatcher classes behind one interface (SyncedDispatcher, SyncFreeDispatcher,
AllGatherDispatcher), registered in DISPATCHERS under their ``parallel.ep_dispatch`` names.

all_gather mode sends each token once to every rank instead (P equal blocks of T rows, with the
token's K expert ids and weights), so a token routed to several experts of one rank crosses the link
once: each rank routes the P*T gathered tokens to its local experts (ids of other ranks' experts go
to a trash group past the last local expert and are skipped), combines its experts' outputs with
the routing weights into one partial row per gathered token, and the reverse exchange brings the P
partials of each token home, where they are summed in fp32.

Legend: T tokens, D model dim, K experts per token, E experts (all ranks'), P ep ranks, L = E / P
this rank's experts, S rows this rank sends, N rows it receives, R rows of the local experts'
buffer, C = cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moetron.core.config import ConfigError
from moetron.core.registry import Registry
from moetron.core.moe.dispatcher import DispatchResult, TokenDispatcher
from moetron.core.moe.kernels.ops import combine_rows, route, scatter_rows
from moetron.core.moe.kernels.reference import RoutingPlan
from moetron.core.moe.layer import moe_layers

from .config import ExpertDispatch
from .registry import ParallelState, ParallelStrategy, register_strategy

__all__ = ["DISPATCHERS", "AllGatherDispatcher", "ExpertParallel", "ExpertParallelDispatcher", "SyncFreeDispatcher",
           "SyncedDispatcher", "all_to_all_rows", "register_dispatcher", "resolve_dispatch"]


# ---------------------------------------------------------------------------------------------
# A differentiable all-to-all over rows
# ---------------------------------------------------------------------------------------------


class _AllToAllRows(torch.autograd.Function):
    """out = all_to_all_single(x) with the given splits; backward sends the gradient back."""

    @staticmethod
    def forward(ctx, x_SD: Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
                group: dist.ProcessGroup) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        num_out = x_SD.shape[0] if out_splits is None else sum(out_splits)
        out_ND = x_SD.new_empty((num_out, *x_SD.shape[1:]))
        dist.all_to_all_single(out_ND, x_SD.contiguous(), out_splits, in_splits, group=group)
        return out_ND

    @staticmethod
    def backward(ctx, grad_ND: Tensor):
        return _AllToAllRows.apply(grad_ND, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def all_to_all_rows(x_SD: Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
                    group: dist.ProcessGroup) -> Tensor:
    """Differentiable all_to_all_single along dim 0.

    x_SD [S, ...]: in_splits[p] rows go to peer p (None: S / P each); returns [N, ...] where
    out_splits[p] rows came from peer p (None: equal). Backward is the reverse exchange.
    """
    return _AllToAllRows.apply(x_SD, out_splits, in_splits, group)


# ---------------------------------------------------------------------------------------------
# The dispatcher
# ---------------------------------------------------------------------------------------------


@dataclass
class SyncedState:
    """What SyncedDispatcher.combine() needs to undo dispatch()."""

    dest_row_TK: Tensor
    """int32 [T, K]: each slot's row in the send buffer (-1 dropped)."""
    local_dest_N1: Tensor
    """int32 [N, 1]: each received row's row in the local experts' buffer."""
    send_splits: list[int]
    """Rows sent to each peer."""
    recv_splits: list[int]
    """Rows received from each peer."""


@dataclass
class SyncFreeState:
    """What SyncFreeDispatcher.combine() needs to undo dispatch()."""

    dest_row_TK: Tensor
    """int32 [T, K]: each slot's row in the [P*C] send buffer (-1 dropped or past a full block)."""
    local_dest_N1: Tensor
    """int32 [N, 1], N = P*C: each received row's row in the local experts' buffer (-1: padding)."""


@dataclass
class AllGatherState:
    """What AllGatherDispatcher.combine() needs to undo dispatch()."""

    local_dest_NK: Tensor
    """int32 [N, K], N = P*T gathered tokens: each slot's row in this rank's expert buffer (-1:
    another rank's expert, dropped by the layer's capacity or past the buffer)."""


DISPATCHERS: Registry[type["ExpertParallelDispatcher"]] = Registry("expert-parallel dispatcher")
"""The expert-parallel dispatch modes by name (parallel.ep_dispatch); add one with register_dispatcher."""


def register_dispatcher(cls: type["ExpertParallelDispatcher"]) -> type["ExpertParallelDispatcher"]:
    """Add a dispatcher class under its ``mode`` (usable as a decorator); "auto" is reserved."""
    if cls.mode == ExpertDispatch.auto:
        raise ConfigError("ep_dispatch=auto is reserved for the strategy's choice: name the mode otherwise")
    return DISPATCHERS.add(str(cls.mode), cls)
    return cls


class ExpertParallelDispatcher(TokenDispatcher):
    """All-to-all token dispatch to the ranks of ``group`` that own the experts: the base of the
    modes in DISPATCHERS. ``ExpertParallelDispatcher(num_experts, group, mode, capacity_factor)``
    builds the registered class of ``mode``.

    num_experts: E (all of them); group: the ep process group (size P, E % P == 0); this rank owns
    the L = E / P experts [rank*L, (rank+1)*L).

    dispatch(x_TD [T, D], topk_ids_TK [T, K], E, capacity) -> DispatchResult whose x_RD / offsets_L
    are this rank's experts' rows; tokens_per_expert_E / kept_per_expert_E stay per global expert
    and count this rank's tokens only (the balance group sums them). combine(y_RD, topk_weights_TK,
    result) -> [T, D] in token order. ``overflow_rows`` (int64 scalar on the device, accumulated;
    pop_overflow() reads and resets) counts rows a static buffer dropped for lack of room.
    """

    mode: str

    def __new__(cls, num_experts: int = 0, group: dist.ProcessGroup | None = None,
                mode: str = ExpertDispatch.synced, capacity_factor: float = 2.0):
        if cls is ExpertParallelDispatcher:
            if mode not in DISPATCHERS:
                why = "is resolved by the strategy (resolve_dispatch)" if mode == ExpertDispatch.auto else "is unknown"
                raise ValueError(f"ep_dispatch={mode} {why}: pass one of {sorted(DISPATCHERS)}")
            cls = DISPATCHERS[mode]
        return super().__new__(cls)

    def __init__(self, num_experts: int, group: dist.ProcessGroup, mode: ExpertDispatch | str | None = None,
                 capacity_factor: float = 2.0):
        if mode is not None and mode != self.mode:
            raise ValueError(f"{type(self).__name__} dispatches in mode {self.mode}, not {mode}")
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not split over {self.ep_size} ep ranks")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.group = group
        self.capacity_factor = capacity_factor
        self.overflow_rows: Tensor | None = None

    def peer_capacity(self, num_slots: int) -> int:
        """Static rows of a buffer sized for num_slots slots split over P ranks, times capacity_factor."""
        return max(1, math.ceil(self.capacity_factor * num_slots / self.ep_size))

    @torch.no_grad()
    def pop_overflow(self) -> Tensor:
        """Rows dropped for lack of room (sync_free, all_gather) since the last call (a device scalar); resets."""
        if self.overflow_rows is None:
            return torch.zeros((), dtype=torch.int64)
        out = self.overflow_rows.clone()
        self.overflow_rows.zero_()
        return out

    def _count_overflow(self, rows: Tensor) -> None:
        rows = rows.to(torch.int64).detach()
        self.overflow_rows = rows if self.overflow_rows is None else self.overflow_rows + rows

    def _exchange_counts(self, send_PL: Tensor) -> Tensor:
        """recv_PL[p, l]: rows of local expert l that peer p sends here (send_PL: what we send)."""
        recv_PL = torch.empty_like(send_PL)
        dist.all_to_all_single(recv_PL, send_PL.contiguous(), group=self.group)
        return recv_PL

    def dispatch(self, x_TD, topk_ids_TK, num_experts, capacity):
        if num_experts != self.num_experts:
            raise ValueError(f"dispatcher built for {self.num_experts} experts, called with {num_experts}")
        return self._dispatch(x_TD, topk_ids_TK, route(topk_ids_TK, num_experts, capacity))

    def combine(self, y_RD, topk_weights_TK, result):
        if result.x_RD.requires_grad and not y_RD.requires_grad:
            # No rows arrived here (e.g. the loop experts ran nothing): keep the output on the
            # autograd graph anyway, or this rank would skip the backward all-to-alls its peers
            # wait in. x_RD[:0].sum() is an exact 0 that links y back to the received rows.
            y_RD = y_RD + result.x_RD[:0].sum()
        return self._combine(y_RD, topk_weights_TK, result.state)

    def _dispatch(self, x_TD: Tensor, topk_ids_TK: Tensor, plan: RoutingPlan) -> DispatchResult:
        raise NotImplementedError

    def _combine(self, y_RD: Tensor, topk_weights_TK: Tensor, state: Any) -> Tensor:
        raise NotImplementedError


def _local_order(local_ids_N: Tensor, num_groups: int) -> RoutingPlan:
    """Plan the local-expert-major order of received rows (K = 1 routing, no sync)."""
    return route(local_ids_N.view(-1, 1), num_groups, None)


@register_dispatcher
class SyncedDispatcher(ExpertParallelDispatcher):
    """Exact uneven splits: the per-(peer, local expert) counts are exchanged and read on the host,
    one sync per layer forward (none in backward, which reuses the splits); nothing is dropped."""

    mode = ExpertDispatch.synced

    def _dispatch(self, x_TD: Tensor, topk_ids_TK: Tensor, plan: RoutingPlan) -> DispatchResult:
        P, L = self.ep_size, self.num_local_experts
        # Kept rows are packed from row 0, grouped by global expert: peer p's rows are contiguous.
        send_PL = plan.kept_per_expert_E.view(P, L)
        recv_PL = self._exchange_counts(send_PL)
        # THE host sync of this layer's forward: the all-to-all's split sizes must be Python ints.
        send_splits, recv_splits = torch.stack([send_PL.sum(1), recv_PL.sum(1)]).tolist()
        num_send, num_recv = sum(send_splits), sum(recv_splits)

        x_SD = scatter_rows(x_TD, plan.dest_row_TK, plan.num_rows)[:num_send]
        x_ND = all_to_all_rows(x_SD, recv_splits, send_splits, self.group)
        # Received rows are ordered (source peer, local expert); sort them local-expert-major.
        local_ids_N = torch.arange(L, device=x_TD.device).repeat(P).repeat_interleave(
            recv_PL.reshape(-1).long(), output_size=num_recv)
        local = _local_order(local_ids_N, L)
        x_RD = scatter_rows(x_ND, local.dest_row_TK, num_recv)
        state = SyncedState(plan.dest_row_TK, local.dest_row_TK, send_splits, recv_splits)
        return DispatchResult(x_RD, local.offsets_E, plan.tokens_per_expert_E, plan.kept_per_expert_E, state)

    def _combine(self, y_RD: Tensor, topk_weights_TK: Tensor, st: SyncedState) -> Tensor:
        y_ND = combine_rows(y_RD, st.local_dest_N1, None)  # back to (source peer, local expert) order
        # The backward's all-to-all reuses these splits: no second host sync.
        y_SD = all_to_all_rows(y_ND, st.send_splits, st.recv_splits, self.group)
        return combine_rows(y_SD, st.dest_row_TK, topk_weights_TK)


@register_dispatcher
class SyncFreeDispatcher(ExpertParallelDispatcher):
    """No host sync: static blocks of C = ceil(capacity_factor * T*K / P) rows per peer; within a
    block rows run expert-major, so a full block drops its last experts' rows (counted as
    overflow and left out of kept_per_expert_E, so the layer's ``dropped`` metric includes them)."""

    mode = ExpertDispatch.sync_free

    def _dispatch(self, x_TD: Tensor, topk_ids_TK: Tensor, plan: RoutingPlan) -> DispatchResult:
        P, L = self.ep_size, self.num_local_experts
        T, K = topk_ids_TK.shape
        C = self.peer_capacity(T * K)
        kept_PL = plan.kept_per_expert_E.view(P, L).long()
        sent_PL = kept_PL.cumsum(1).clamp(max=C).diff(dim=1, prepend=kept_PL.new_zeros(P, 1))
        self._count_overflow(kept_PL.sum() - sent_PL.sum())

        # Each slot's row in the [P*C] send buffer: its row within its peer's block, if < C.
        peer_start_P = plan.offsets_E.view(P, L)[:, -1].long() - kept_PL.sum(1)
        peer_TK = topk_ids_TK.long() // L
        row_in_peer_TK = plan.dest_row_TK.long() - peer_start_P[peer_TK]
        keep_TK = (plan.dest_row_TK >= 0) & (row_in_peer_TK < C)
        dest_row_TK = torch.where(keep_TK, peer_TK * C + row_in_peer_TK, -1).to(torch.int32)

        recv_PL = self._exchange_counts(sent_PL)
        x_SD = scatter_rows(x_TD, dest_row_TK, P * C)  # padding rows are zero
        x_ND = all_to_all_rows(x_SD, None, None, self.group)
        # Row j of peer p's block holds local expert searchsorted(cumsum(recv_PL[p]), j, right);
        # the value L marks padding, a trash group after the last local expert.
        slot_PC = torch.arange(C, device=x_TD.device).expand(P, C).contiguous()
        local_ids_N = torch.searchsorted(recv_PL.cumsum(1).contiguous(), slot_PC, right=True).reshape(-1)
        local = _local_order(local_ids_N, L + 1)
        local_dest_N1 = torch.where(local_ids_N.view(-1, 1) == L, -1, local.dest_row_TK).to(torch.int32)
        x_RD = scatter_rows(x_ND, local_dest_N1, P * C)
        kept_E = sent_PL.reshape(-1).to(torch.int32)
        state = SyncFreeState(dest_row_TK, local_dest_N1)
        return DispatchResult(x_RD, local.offsets_E[:L], plan.tokens_per_expert_E, kept_E, state)

    def _combine(self, y_RD: Tensor, topk_weights_TK: Tensor, st: SyncFreeState) -> Tensor:
        y_ND = combine_rows(y_RD, st.local_dest_N1, None)  # back to (source peer, local expert) order
        y_SD = all_to_all_rows(y_ND, None, None, self.group)
        return combine_rows(y_SD, st.dest_row_TK, topk_weights_TK)


@register_dispatcher
class AllGatherDispatcher(ExpertParallelDispatcher):
    """No host sync: every token goes once to every rank (equal all-to-all blocks), each rank runs
    its experts on the slots routed to them and sends back one weighted partial sum per token. The
    local expert buffer holds R = min(P*T*K, ceil(capacity_factor * T*K)) rows; its last experts'
    rows past R are dropped by the receiving rank, which takes them out of its own experts' kept
    counts (so the sums over the balance group, all the metric uses, stay right)."""

    mode = ExpertDispatch.all_gather

    def _dispatch(self, x_TD: Tensor, topk_ids_TK: Tensor, plan: RoutingPlan) -> DispatchResult:
        P, L = self.ep_size, self.num_local_experts
        # Slots dropped by the layer's capacity travel as -1 and find no expert anywhere.
        ids_TK = torch.where(plan.dest_row_TK >= 0, topk_ids_TK.long(), -1)
        x_ND = all_to_all_rows(x_TD.repeat(P, 1), None, None, self.group)  # block p: peer p's tokens
        ids_NK = all_to_all_rows(ids_TK.repeat(P, 1), None, None, self.group)
        # This rank's experts are local ids 0..L-1; everything else goes to the trash group L.
        local_NK = ids_NK - self.ep_rank * L
        local_NK = torch.where((ids_NK >= 0) & (local_NK >= 0) & (local_NK < L), local_NK, L)
        local = route(local_NK, L + 1, None)
        # A static buffer of R rows, the local experts' rows first (expert-major), the trash group's
        # never written: the slots past R (the last experts' rows) are dropped and counted.
        N, K = local_NK.shape
        R = min(N * K, self.peer_capacity(N * K))
        keep_NK = (local_NK < L) & (local.dest_row_TK < R)
        local_dest_NK = torch.where(keep_NK, local.dest_row_TK, -1).to(torch.int32)
        offsets_L = local.offsets_E[:L].clamp(max=R)
        over_L = local.kept_per_expert_E[:L] - torch.diff(offsets_L, prepend=offsets_L.new_zeros(1))
        self._count_overflow(over_L.sum())
        kept_E = plan.kept_per_expert_E.clone()
        kept_E[self.ep_rank * L:(self.ep_rank + 1) * L] -= over_L.to(kept_E.dtype)
        x_RD = scatter_rows(x_ND, local_dest_NK, R)
        return DispatchResult(x_RD, offsets_L, plan.tokens_per_expert_E, kept_E, AllGatherState(local_dest_NK))

    def _combine(self, y_RD: Tensor, topk_weights_TK: Tensor, st: AllGatherState) -> Tensor:
        P, T = self.ep_size, topk_weights_TK.shape[0]
        w_NK = all_to_all_rows(topk_weights_TK.repeat(P, 1), None, None, self.group)
        # One weighted partial sum per gathered token over this rank's experts (fp32 accumulation).
        part_ND = combine_rows(y_RD, st.local_dest_NK, w_NK)
        part_PTD = all_to_all_rows(part_ND, None, None, self.group).view(P, T, -1)
        return part_PTD.sum(0, dtype=torch.promote_types(part_PTD.dtype, torch.float32)).to(part_PTD.dtype)


# ---------------------------------------------------------------------------------------------
# The strategy
# ---------------------------------------------------------------------------------------------


def _moe_cfg(state: ParallelState):
    """The model's MoEConfig: model_cfg.moe, else the first MoE layer's; None for a dense model."""
    moe = getattr(state.model_cfg, "moe", None)
    if moe is not None:
        return moe
    return next((layer.cfg for layer in moe_layers(state.model_parts).values()), None)


def resolve_dispatch(mode: str, ep: int, top_k: int | None) -> str:
    """The dispatch that ``auto`` stands for: all_gather when each token's top_k slots would cross to
    at least as many rows as there are ep ranks (top_k >= ep: gathering every token is no more bytes,
    and on 2 H200s it was the fastest for top-4 and top-8), synced otherwise. Other modes as given."""
    if mode != ExpertDispatch.auto:
        return ExpertDispatch(mode) if mode in ExpertDispatch.__members__ else mode
    return ExpertDispatch.all_gather if top_k is not None and top_k >= ep else ExpertDispatch.synced


@register_strategy
class ExpertParallel(ParallelStrategy):
    """ep > 1: each MoE layer keeps its local experts (DTensor Shard(0) on the ep mesh) and
    dispatches tokens by all-to-all over the ep group; load balancing spans every dp rank."""

    name = "expert"
    order = 20

    def enabled(self, state: ParallelState) -> bool:
        return state.cfg.ep > 1 or super().enabled(state)

    def validate(self, state: ParallelState) -> None:
        ep = state.cfg.ep
        moe = _moe_cfg(state)
        if moe is None:
            raise ConfigError(f"parallel.ep={ep} needs an MoE model (model.moe is not set): set parallel.ep=1")
        E = moe.num_experts
        if ep > E:
            raise ConfigError(
                f"parallel.ep={ep} exceeds model.moe.num_experts={E}: every ep rank needs at least one expert; "
                f"choose ep among {[d for d in range(1, E + 1) if E % d == 0]}"
            )
        if E % ep:
            raise ConfigError(
                f"model.moe.num_experts={E} is not divisible by parallel.ep={ep}: each ep rank owns an equal "
                f"share of the experts; choose ep among {[d for d in range(1, E + 1) if E % d == 0]}"
            )

    def apply(self, state: ParallelState) -> None:
        from torch.distributed.tensor import DTensor, Shard

        mesh = state.mesh.ep
        group = state.mesh.group("ep")
        if mesh is None or group is None:
            raise ConfigError(f"parallel.ep={state.cfg.ep} needs an initialized process group and world mesh")
        P, r = mesh.size(), mesh.get_local_rank()
        moe = _moe_cfg(state)
        mode = resolve_dispatch(state.cfg.ep_dispatch, P, moe.router.top_k if moe is not None else None)
        state.ep_dispatch = mode
        for layer in moe_layers(state.model_parts).values():
            experts = layer.experts
            L = experts.num_experts // P
            for name in ("w_gate_up", "w_down"):
                full = getattr(experts, name)
                if isinstance(full, DTensor):
                    raise ConfigError(f"MoE expert weight {name} is already a DTensor: apply expert parallelism first")
                # Every rank built the same full tensor (same seed): take this rank's slice, no comm.
                local = full.detach()[r * L:(r + 1) * L].clone()
                dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                        shape=full.shape, stride=full.stride())
                setattr(experts, name, torch.nn.Parameter(dt, requires_grad=full.requires_grad))
            layer.set_dispatcher(ExpertParallelDispatcher(
                layer.num_experts, group, mode, state.cfg.ep_capacity_factor))
            layer.balance_group = state.mesh.group("dp")
            # An expert's gradient sums the tokens of all P ranks (the all-to-all brings them in),
            # while dense gradients are averaged over the data-parallel ranks: 1/P makes the
            # expert gradient that mean too once the data strategy averages it over efsdp.
            experts.grad_scale = 1.0 / P
