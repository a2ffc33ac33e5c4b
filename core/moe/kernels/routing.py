"""Triton routing kernels: the GPU path of reference.py, with the same signatures and results.

route: two deterministic passes over the flat slots, no atomics. Pass 1 counts each block's slots per
expert; a tiny integer cumsum over blocks (torch, exact in any order) gives each block its first
rank per expert; pass 2 ranks every slot within its expert and writes its destination row. The
counts are stored expert-major ([E, B]), so that scan runs along the innermost dimension: at OLMoE-8L's
512 blocks x 64 experts, 9 us alone against 81 us along the outer dimension of [B, E] (H200, session 56;
91 us a layer in session 55's H100 profile). Ranks equal the reference's stable-sort ranks, so all integer
outputs are bit-exact.

scatter_rows / combine_rows and their backward: gather-style kernels, one program per
(token block, D block); each row >= 0 has exactly one source slot, so no atomics are needed. The
K terms of a token are summed in k order in fp32 with multiply-add contraction disabled, which is
the reference's arithmetic exactly.

Every wrapper is free of host-device syncs: all sizes come from shapes and Python ints.

Shape legend:
    T  tokens                   K  experts per token (top-k)      E  experts
    D  model (hidden) dim       R  rows of the expert-sorted buffer
    N  flat slots (N = T*K)     B  route blocks of BLOCK_N slots   P  D blocks of a backward pass
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moetron.core.moe.kernels.reference import accumulator_dtype, check_route_args, padded_index_TK

# ---------------------------------------------------------------------------------------------
# route
# ---------------------------------------------------------------------------------------------


@triton.jit
def _route_count_kernel(
    ids_ptr, counts_EB_ptr, N, E, B,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
):
    """counts_EB[e, b] = number of slots of block b routed to expert e."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    # CHUNK x E_PAD one-hot tiles keep the register footprint flat for any E up to a few hundred.
    for c in range(0, BLOCK_N, CHUNK):
        slots = pid * BLOCK_N + c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + slots, mask=slots < N, other=-1).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        counts += tl.sum(onehot, axis=0)
    tl.store(counts_EB_ptr + experts * B + pid, counts, mask=experts < E)


@triton.jit
def _route_rank_kernel(
    ids_ptr, first_rank_EB_ptr, first_row_E_ptr, dest_ptr, N, E, B, capacity,
    HAS_CAPACITY: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
):
    """dest[n] = first_row[e] + rank of slot n within expert e (or -1 past the capacity)."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    # Running per-expert count of this block's earlier slots, seeded with all earlier blocks'.
    seen = tl.load(first_rank_EB_ptr + experts * B + pid, mask=experts < E, other=0)
    for c in range(0, BLOCK_N, CHUNK):
        slots = pid * BLOCK_N + c + tl.arange(0, CHUNK)
        in_range = slots < N
        ids = tl.load(ids_ptr + slots, mask=in_range, other=-1).to(tl.int32)
        valid = in_range & (ids >= 0) & (ids < E)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        # Inclusive cumsum down the chunk: entry (i, e) counts slots <= i routed to e.
        before = tl.cumsum(onehot, axis=0) - onehot + seen[None, :]
        rank = tl.sum(before * onehot, axis=1)
        seen += tl.sum(onehot, axis=0)
        first_row = tl.load(first_row_E_ptr + ids, mask=valid, other=0)
        dest = first_row + rank
        if HAS_CAPACITY:
            dest = tl.where(rank < capacity, dest, -1)
        dest = tl.where(valid, dest, -1)
        tl.store(dest_ptr + slots, dest, mask=in_range)


def _route_blocks(num_slots: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_N, CHUNK, E_PAD): CHUNK x E_PAD one-hot tiles of about 8K int32 per chunk."""
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(1, min(64, 8192 // e_pad))
    # ~512 programs fill an H100/H200 (132 SMs) at T*K = 131072; each walks its block serially.
    block_n = max(chunk, min(1024, triton.next_power_of_2(triton.cdiv(max(num_slots, 1), 512))))
    return block_n, chunk, e_pad


def route_counts(
    topk_ids_TK: Tensor, num_experts: int, capacity: int | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton twin of reference.route_counts: (tokens_per_expert_E, kept_per_expert_E, offsets_E,
    dest_row_TK), all int32, bit-exact with the reference."""
    check_route_args(topk_ids_TK, num_experts, capacity)
    T, K = topk_ids_TK.shape
    device = topk_ids_TK.device
    ids_N = topk_ids_TK.contiguous().view(-1)
    N, E = ids_N.numel(), num_experts
    dest_row_TK = torch.empty(T, K, dtype=torch.int32, device=device)
    if N == 0:
        zeros_E = torch.zeros(E, dtype=torch.int32, device=device)
        return zeros_E, zeros_E.clone(), zeros_E.clone(), dest_row_TK

    BLOCK_N, CHUNK, E_PAD = _route_blocks(N, E)
    B = triton.cdiv(N, BLOCK_N)
    counts_EB = torch.empty(E, B, dtype=torch.int32, device=device)
    _route_count_kernel[(B,)](ids_N, counts_EB, N, E, B, BLOCK_N=BLOCK_N, CHUNK=CHUNK, E_PAD=E_PAD, num_warps=4)

    # [E, B] integer scans along the blocks, the innermost dimension: exact in any order, so deterministic.
    cum_EB = counts_EB.cumsum(1, dtype=torch.int32)
    first_rank_EB = cum_EB - counts_EB
    tokens_per_expert_E = cum_EB[:, -1].clone()  # own (contiguous) storage: custom ops' outputs may not alias
    kept_E = tokens_per_expert_E.clone() if capacity is None else tokens_per_expert_E.clamp(max=capacity)
    offsets_E = kept_E.cumsum(0, dtype=torch.int32)
    first_row_E = offsets_E - kept_E

    _route_rank_kernel[(B,)](
        ids_N, first_rank_EB, first_row_E, dest_row_TK, N, E, B, 0 if capacity is None else capacity,
        HAS_CAPACITY=capacity is not None, BLOCK_N=BLOCK_N, CHUNK=CHUNK, E_PAD=E_PAD, num_warps=4,
    )
    return tokens_per_expert_E, kept_E, offsets_E, dest_row_TK


# ---------------------------------------------------------------------------------------------
# row movement
# ---------------------------------------------------------------------------------------------


def _row_blocks(D: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps): 16-byte vectors per thread, ~8-16 KB of rows per program."""
    vec = max(1, 16 // element_size)
    block_d = min(triton.next_power_of_2(max(D, 1)), 2048 if element_size <= 2 else 1024)
    num_warps = max(1, min(8, block_d // (vec * 32)))
    block_t = max(1, min(8, 4096 // block_d))
    return block_t, block_d, num_warps


@triton.jit
def _scatter_rows_kernel(
    x_ptr, dest_ptr, out_ptr, T, D, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[dest[t, k]] = x[t]: read a token tile once, write it K times."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = tokens < T
    d_ok = cols < D
    x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * D + cols[None, :], mask=t_ok[:, None] & d_ok[None, :])
    for k in tl.static_range(K):
        dest = tl.load(dest_ptr + tokens * K + k, mask=t_ok, other=-1)
        keep = (dest >= 0)[:, None] & d_ok[None, :]
        tl.store(out_ptr + dest.to(tl.int64)[:, None] * D + cols[None, :], x, mask=keep)


@triton.jit
def _zero_unwritten_rows_kernel(
    out_ptr, written_ptr, R, D, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Zero the rows no slot wrote (rows past offsets[-1], or holes left by the caller's plan). Each program
    reads ROWS rows' flags and writes only where it finds a hole, so a plan without holes (dropless routing:
    every row written) costs one flag read a row."""
    first = tl.program_id(0) * ROWS
    rows = first + tl.arange(0, ROWS)
    holes = (rows < R) & (tl.load(written_ptr + rows, mask=rows < R, other=1) == 0)
    if tl.sum(holes.to(tl.int32)) > 0:  # a window without holes (every window of a dropless plan) writes nothing
        zeros = tl.zeros([BLOCK_R, BLOCK_D], dtype=out_ptr.dtype.element_ty)
        for r in range(0, ROWS, BLOCK_R):
            sub = first + r + tl.arange(0, BLOCK_R)
            hole = (sub < R) & (tl.load(written_ptr + sub, mask=sub < R, other=1) == 0)
            if tl.sum(hole.to(tl.int32)) > 0:
                for d in range(0, D, BLOCK_D):
                    cols = d + tl.arange(0, BLOCK_D)
                    tl.store(out_ptr + sub.to(tl.int64)[:, None] * D + cols[None, :], zeros,
                             mask=hole[:, None] & (cols < D)[None, :])


_HOLE_SCAN_ROWS = 256
"""Rows one program of _zero_unwritten_rows_kernel checks: 512 programs at OLMoE-8L's 131,072 rows. One
program a (row, D) tile, as before session 55, launched 65,536 programs that found nothing to do on dropless
plans: 41 us a call, 16 calls a step on OLMoE-8L (H100, session 55's profile); this one 1.5 us a call in the same
step (H200, session 56's profile)."""


def _hole_rows_block(BLOCK_D: int) -> int:
    """Rows _zero_unwritten_rows_kernel zeroes at a time with BLOCK_D columns: 16K elements, a power of two
    that divides the program's _HOLE_SCAN_ROWS."""
    return min(_HOLE_SCAN_ROWS, max(1, 16384 // BLOCK_D))


def _zero_unwritten_rows(out_RD: Tensor, dest_row_TK: Tensor, BLOCK_D: int, num_warps: int) -> None:
    """Zero the rows of out_RD that no slot of dest_row_TK writes.

    Flags the written rows in an [R + 1] byte map (the spare row takes the dropped slots): an
    R-byte pass instead of zero-filling the whole R x D buffer before the kernel writes it.
    """
    R, D = out_RD.shape
    written_R = torch.zeros(R + 1, dtype=torch.uint8, device=out_RD.device)
    written_R.index_fill_(0, padded_index_TK(dest_row_TK, R).view(-1), 1)
    grid = (triton.cdiv(R, _HOLE_SCAN_ROWS),)
    _zero_unwritten_rows_kernel[grid](out_RD, written_R, R, D, ROWS=_HOLE_SCAN_ROWS, BLOCK_R=_hole_rows_block(BLOCK_D),
                                      BLOCK_D=BLOCK_D, num_warps=num_warps)


def scatter_rows(x_TD: Tensor, dest_row_TK: Tensor, num_rows: int) -> Tensor:
    """Triton twin of reference.scatter_rows (unweighted): x_TD [T, D] -> x_RD [R, D], unwritten rows 0."""
    T, D = x_TD.shape
    K = dest_row_TK.shape[1]
    x_TD = x_TD.contiguous()
    dest_row_TK = dest_row_TK.contiguous()
    out_RD = torch.empty(num_rows, D, dtype=x_TD.dtype, device=x_TD.device)
    if num_rows == 0 or D == 0:
        return out_RD
    BLOCK_T, BLOCK_D, num_warps = _row_blocks(D, x_TD.element_size())
    if T > 0:
        grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))
        _scatter_rows_kernel[grid](
            x_TD, dest_row_TK, out_RD, T, D, K=K, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=num_warps
        )
    _zero_unwritten_rows(out_RD, dest_row_TK, BLOCK_D, num_warps)
    return out_RD


@triton.jit
def _combine_rows_kernel(
    y_ptr, dest_ptr, w_ptr, out_ptr, T, D,
    K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[t] = sum_k w[t, k] * y[dest[t, k]], fp32, k = 0..K-1 in order, dropped slots skipped."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = tokens < T
    d_ok = cols < D
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
    for k in tl.static_range(K):
        dest = tl.load(dest_ptr + tokens * K + k, mask=t_ok, other=-1)
        keep = (dest >= 0)[:, None] & d_ok[None, :]
        y = tl.load(y_ptr + dest.to(tl.int64)[:, None] * D + cols[None, :], mask=keep, other=0.0).to(ACC)
        if HAS_WEIGHTS:
            w = tl.load(w_ptr + tokens * K + k, mask=t_ok, other=0.0).to(ACC)
            y = w[:, None] * y
        acc = acc + y
    tl.store(
        out_ptr + tokens.to(tl.int64)[:, None] * D + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=t_ok[:, None] & d_ok[None, :],
    )


def combine_rows(y_RD: Tensor, dest_row_TK: Tensor, weights_TK: Tensor | None = None) -> Tensor:
    """Triton twin of reference.combine_rows: y_RD [R, D] -> out_TD [T, D] in y's dtype."""
    R, D = y_RD.shape
    T, K = dest_row_TK.shape
    y_RD = y_RD.contiguous()
    dest_row_TK = dest_row_TK.contiguous()
    out_TD = torch.empty(T, D, dtype=y_RD.dtype, device=y_RD.device)
    if T == 0 or D == 0:
        return out_TD
    BLOCK_T, BLOCK_D, num_warps = _row_blocks(D, y_RD.element_size())
    w = weights_TK.contiguous() if weights_TK is not None else dest_row_TK  # dummy pointer
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))
    _combine_rows_kernel[grid](
        y_RD, dest_row_TK, w, out_TD, T, D,
        K=K, HAS_WEIGHTS=weights_TK is not None, ACC=_acc(y_RD.dtype), BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=num_warps,
        **_NO_FMA,
    )
    return out_TD


@triton.jit
def _combine_rows_backward_kernel(
    grad_out_ptr, y_ptr, dest_ptr, w_ptr, grad_y_ptr, partial_ptr, T, D, P,
    K: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """grad_y[dest[t, k]] = w[t, k] * g[t]; partial[t, k, p] = dot of D block p of y[dest] and g."""
    pid_d = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = tokens < T
    d_ok = cols < D
    g = tl.load(
        grad_out_ptr + tokens.to(tl.int64)[:, None] * D + cols[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0
    ).to(ACC)
    for k in tl.static_range(K):
        dest = tl.load(dest_ptr + tokens * K + k, mask=t_ok, other=-1)
        w = tl.load(w_ptr + tokens * K + k, mask=t_ok, other=0.0).to(ACC)
        keep = (dest >= 0)[:, None] & d_ok[None, :]
        row_ptrs = dest.to(tl.int64)[:, None] * D + cols[None, :]
        tl.store(grad_y_ptr + row_ptrs, (w[:, None] * g).to(grad_y_ptr.dtype.element_ty), mask=keep)
        y = tl.load(y_ptr + row_ptrs, mask=keep, other=0.0).to(ACC)
        tl.store(partial_ptr + (tokens * K + k).to(tl.int64) * P + pid_d, tl.sum(y * g, axis=1), mask=t_ok)


def combine_rows_backward(
    grad_out_TD: Tensor, y_RD: Tensor, dest_row_TK: Tensor, weights_TK: Tensor
) -> tuple[Tensor, Tensor]:
    """Triton twin of reference.combine_rows_backward: (grad_y_RD [R, D], grad_weights_TK [T, K])."""
    R, D = y_RD.shape
    T, K = dest_row_TK.shape
    grad_out_TD = grad_out_TD.contiguous()
    y_RD = y_RD.contiguous()
    dest_row_TK = dest_row_TK.contiguous()
    weights_TK = weights_TK.contiguous()
    grad_y_RD = torch.empty_like(y_RD)
    BLOCK_T, BLOCK_D, num_warps = _row_blocks(D, y_RD.element_size())
    P = triton.cdiv(D, BLOCK_D)
    partial_TKP = torch.zeros(T, K, max(P, 1), dtype=accumulator_dtype(y_RD.dtype), device=y_RD.device)
    if T > 0 and D > 0:
        grid = (triton.cdiv(T, BLOCK_T), P)
        _combine_rows_backward_kernel[grid](
            grad_out_TD, y_RD, dest_row_TK, weights_TK, grad_y_RD, partial_TKP, T, D, P,
            K=K, ACC=_acc(y_RD.dtype), BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=num_warps, **_NO_FMA,
        )
    if R > 0 and D > 0:
        _zero_unwritten_rows(grad_y_RD, dest_row_TK, BLOCK_D, num_warps)
    # P <= a few partial sums per slot; a fixed-order fp32 sum keeps the result deterministic.
    grad_w_TK = partial_TKP.sum(-1)
    return grad_y_RD, grad_w_TK.to(weights_TK.dtype)


def _acc(dtype: torch.dtype) -> tl.dtype:
    """The kernels' accumulator: fp32, or fp64 for fp64 inputs (matching reference.accumulator_dtype)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


# Multiply-add contraction would round w * y + acc once instead of twice and break bit-equality
# with the torch reference; the kernels are memory-bound, so FMA buys nothing here.
_NO_FMA = {"enable_fp_fusion": False}
