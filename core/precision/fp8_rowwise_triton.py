"""Triton kernels of the fp8_rowwise recipe's quantization (core.precision.fp8_rowwise, whose torch
functions are the reference): E4M3 with one power-of-two scale per line along a GEMM's reduction
dim. No float atomics (torch's scatter_reduce amax contended on the H200, session 11).

- ``quantize_rows`` (x, dy, w along I): ``_quantize_rows_kernel``, a block of whole rows read once
  (up to TILES' one_pass_cols columns; longer rows are read twice: amax, then scale and round from L2).
- ``quantize_stacked_cols`` (x [E, M, C] along M: w^T per expert, a dense wgrad's tokens) and the
  grouped wgrad's per-expert columns (``chunk_amax`` + ``group_amax`` + ``quantize_cols``):
  1. ``_chunk_amax_kernel``: per 16 rows (every expert's padded rows start at a multiple of 16, so a
     chunk never holds two experts) and column, |x|'s max: [P / 16, C] fp32; each thread walks the
     rows of its own columns, so no max crosses threads;
  2. ``_group_cols_amax_kernel``: per group and column, the max over its chunks' partials (the same
     per-thread walk);
  3. ``_quantize_cols_kernel`` / ``_quantize_stacked_cols_kernel``: each [128 columns x 64 rows]
     tile read once, scaled by 1 / scale (exact powers of two), rounded to E4M3, stored transposed.
- ``quantize_rows_chunks`` (a grouped operand quantized for both its GEMMs, precision.fp8_fused_amax):
  ``_quantize_rows_chunks_kernel``, 16 padded rows per program, their rows quantized and step 1's
  column maxima taken from the same read (the rows of a tile held per thread, its columns across
  the threads), so the operand is read twice in all (here and by step 3), not three times.

Maxima are taken over |x|'s bits (mx_triton.abs_bits: inf and NaN order above every finite value),
scales by blockwise_triton's rule, the E4M3 rounding and bf16 widening by mx_triton's helpers (the
GPU's conversion instructions; by bits under TRITON_INTERPRET=1): the same bits as the torch
reference (tests/core/test_fp8_rowwise.py, interpreted and on the GPU; NaN payloads aside).

Legend: R rows, P padded rows, C columns, E experts or slabs, M rows of a slab, K chunks of 16 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blockwise import pow2_scale
from .blockwise_triton import _block_scales
from .mx_triton import HW_CONVERT, abs_bits, amax_of_bits, as_loadable, to_e4m3, widen

__all__ = ["CHUNK", "TILES", "chunk_amax", "group_amax", "quantize_cols", "quantize_rows", "quantize_rows_chunks", "rows_chunks_fits",
           "quantize_stacked_cols"]

CHUNK = 16
"""Rows per partial amax: the alignment of every expert's padded rows (fp8_rowwise.ALIGN)."""

TILES = {
    "rows": {"elements": 16384, "max_rows": 64, "one_pass_cols": 8192, "cols": 1024, "num_warps": 8},
    "chunk_amax": {"chunks": 2, "cols": 1024, "num_warps": 4},
    "group_amax": {"unroll": 8, "cols": 256, "num_warps": 2, "programs": 1024},
    "rows_chunks": {"sub_rows": 8, "cols_per_warp": 512, "one_pass_cols": 8192, "cols": 1024, "num_warps": 0},
}
"""Tile sizes read at each launch (tools/bench_quantize.py --rowwise sweeps them): ``rows``, a
program's rows x columns about ``elements`` (at most ``max_rows`` rows), the whole row in one tile
(read once) up to ``one_pass_cols`` columns, else ``cols`` at a time in two passes;
``chunk_amax``, ``chunks`` chunks of CHUNK rows by ``cols`` columns per program; ``rows_chunks``,
one chunk per program, its whole rows (up to ``one_pass_cols`` columns) ``sub_rows`` at a time,
else ``cols`` columns of its rows at a time in two passes (the second from L2), on ``num_warps``
warps (0: one per ``cols_per_warp`` columns, at most 8; session 14's sweep: 8 rows on 4 warps at
2048 columns 2.84 TB/s, on 8 warps at 4096 2.79, where 16-byte loads on one warp per 256 columns
ran at 1.15 TB/s at 2048); ``group_amax``,
a group's rows by ``cols`` columns, ``unroll`` rows a step, the rows split over more programs until
about ``programs`` run. Defaults: the sweep's best on the H200 (session 12: rows 3.7 TB/s at both
OLMoE-8L's and olmoe3-4l-8e's activations; session 13: chunk_amax 3.3-3.5 TB/s, where the earlier
[rows, cols]-tile kernel, whose max crossed threads, stopped at 0.9 TB/s at every tile; group_amax
unsplit took 11.7 ms of OLMoE-8L's step, mostly the dense wgrads' one group walked by 8 programs)."""


@triton.jit
def _row_bits(x_ptr, src_ptr, r, end, cols, C, s_x, GATHER: tl.constexpr):
    """The bits of one row, x[src[r]] (GATHER; x[r] otherwise), at ``cols``: 0 where r >= end,
    src < 0 (padding) or cols >= C."""
    if GATHER:  # an in-bounds scalar load (end >= 1 wherever a program runs), then masked
        src = tl.where(r < end, tl.load(src_ptr + tl.minimum(r, end - 1)), -1)
    else:
        src = tl.where(r < end, r, -1)
    # the masks as one compare with a scalar bound (a 0-d bool and-ed into a vector mask fails interpreted)
    return tl.load(x_ptr + src.to(tl.int64) * s_x + cols, mask=cols < tl.where(src >= 0, C, 0), other=0)


@triton.jit
def _chunk_amax_kernel(x_ptr, src_ptr, out_ptr, P, C, s_x, GATHER: tl.constexpr, IN_BF16: tl.constexpr,
                       CHUNK_R: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr):
    # CHUNKS chunks of CHUNK_R rows per program; each thread walks the rows of its own columns (a
    # vector of them per load, the chunk's loads unrolled), so the max takes no cross-thread step
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    for k in range(CHUNKS):
        chunk = tl.program_id(1) * CHUNKS + k
        top = tl.zeros([BLOCK_C], dtype=tl.int32)
        for i in tl.static_range(CHUNK_R):
            top = tl.maximum(top, abs_bits(_row_bits(x_ptr, src_ptr, chunk * CHUNK_R + i, P, cols, C, s_x, GATHER),
                                           IN_BF16))
        amax, _ = amax_of_bits(top, IN_BF16)  # NaN and inf kept as such
        tl.store(out_ptr + chunk.to(tl.int64) * C + cols, amax, mask=cols < tl.where(chunk < P // CHUNK_R, C, 0))


@triton.jit
def _group_cols_amax_kernel(x_ptr, poff_ptr, out_ptr, E, C, s_x, SPLIT, IN_BF16: tl.constexpr, UNROLL: tl.constexpr,
                            BLOCK_C: tl.constexpr):
    # one group's rows for BLOCK_C columns, the s-th of SPLIT interleaved shares of them (UNROLL rows
    # each), per thread as in _chunk_amax_kernel -> out[s, e]
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.program_id(2)
    start = tl.load(poff_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(poff_ptr + e)
    top = tl.zeros([BLOCK_C], dtype=tl.int32)
    for r0 in range(start + s * UNROLL, end, SPLIT * UNROLL):
        for i in tl.static_range(UNROLL):
            top = tl.maximum(top, abs_bits(_row_bits(x_ptr, x_ptr, r0 + i, end, cols, C, s_x, False), IN_BF16))
    amax, _ = amax_of_bits(top, IN_BF16)
    tl.store(out_ptr + (s * E + e).to(tl.int64) * C + cols, amax, mask=cols < C)


@triton.jit
def _quantize_cols_kernel(x_ptr, src_ptr, group_ptr, inv_ptr, out_ptr, P, C, s_x, IN_BF16: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, HW: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    src = tl.load(src_ptr + p, mask=p < P, other=-1)
    group = tl.load(group_ptr + p, mask=p < P, other=0)
    ok = (cols < C)[:, None] & (p < P)[None, :]
    # the tile as [columns, rows]: x's rows are C-contiguous, the output's are P-contiguous
    bits = tl.load(x_ptr + src.to(tl.int64)[None, :] * s_x + cols[:, None], mask=ok & (src >= 0)[None, :], other=0)
    inv = tl.load(inv_ptr + group.to(tl.int64)[None, :] * C + cols[:, None], mask=ok, other=1.0)
    q = to_e4m3(widen(bits, IN_BF16, HW), inv, HW)
    tl.store(out_ptr + cols.to(tl.int64)[:, None] * P + p[None, :], q, mask=ok)


@triton.jit
def _quantize_rows_kernel(x_ptr, d_ptr, s_ptr, R, C, s_x, s_d, IN_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr, ONE_PASS: tl.constexpr, HW: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r64 = rows.to(tl.int64)
    if ONE_PASS:  # the whole rows in one tile (BLOCK_C >= C): read once
        cols = tl.arange(0, BLOCK_C)
        ok = (rows < R)[:, None] & (cols < C)[None, :]
        bits = tl.load(x_ptr + r64[:, None] * s_x + cols[None, :], mask=ok, other=0)
        inv, scale = _block_scales(tl.max(abs_bits(bits, IN_BF16), 1), IN_BF16)
        tl.store(s_ptr + rows, scale, mask=rows < R)
        tl.store(d_ptr + r64[:, None] * s_d + cols[None, :], to_e4m3(widen(bits, IN_BF16, HW), inv[:, None], HW), mask=ok)
    else:
        top = tl.zeros([BLOCK_R], dtype=tl.int32)
        for c0 in range(0, C, BLOCK_C):  # the rows' amax
            cols = c0 + tl.arange(0, BLOCK_C)
            bits = tl.load(x_ptr + r64[:, None] * s_x + cols[None, :], mask=(rows < R)[:, None] & (cols < C)[None, :],
                           other=0)
            top = tl.maximum(top, tl.max(abs_bits(bits, IN_BF16), 1))
        inv, scale = _block_scales(top, IN_BF16)
        tl.store(s_ptr + rows, scale, mask=rows < R)
        for c0 in range(0, C, BLOCK_C):  # read again (from L2: BLOCK_R rows), scaled and rounded
            cols = c0 + tl.arange(0, BLOCK_C)
            ok = (rows < R)[:, None] & (cols < C)[None, :]
            bits = tl.load(x_ptr + r64[:, None] * s_x + cols[None, :], mask=ok, other=0)
            tl.store(d_ptr + r64[:, None] * s_d + cols[None, :], to_e4m3(widen(bits, IN_BF16, HW), inv[:, None], HW),
                     mask=ok)


@triton.jit
def _quantize_rows_chunks_kernel(x_ptr, src_ptr, d_ptr, s_ptr, c_ptr, C, s_x, s_d, IN_BF16: tl.constexpr,
                                 CHUNK_R: tl.constexpr, SUB_R: tl.constexpr, BLOCK_C: tl.constexpr,
                                 ONE_PASS: tl.constexpr, HW: tl.constexpr):
    # one chunk of CHUNK_R padded rows, x[src] (zero where src < 0): the rows' scales and E4M3 rows
    # (stored at row src), and the chunk's column maxima (the grouped wgrad's partials, as
    # _chunk_amax_kernel's). Tiles of [SUB_R, BLOCK_C] whose columns are spread over the threads and
    # rows held by each (the launch picks the warps to fit BLOCK_C): the column max stays in each
    # thread, only a row's max crosses them.
    chunk = tl.program_id(0)
    if ONE_PASS:  # the whole rows in one tile (BLOCK_C >= C), SUB_R rows at a time: read once
        cols = tl.arange(0, BLOCK_C)
        ctop = tl.zeros([BLOCK_C], dtype=tl.int32)
        for j in tl.static_range(CHUNK_R // SUB_R):
            src = tl.load(src_ptr + chunk * CHUNK_R + j * SUB_R + tl.arange(0, SUB_R))
            s64 = src.to(tl.int64)
            ok = (src >= 0)[:, None] & (cols < C)[None, :]
            bits = tl.load(x_ptr + s64[:, None] * s_x + cols[None, :], mask=ok, other=0)
            top_bits = abs_bits(bits, IN_BF16)
            ctop = tl.maximum(ctop, tl.max(top_bits, 0))
            inv, scale = _block_scales(tl.max(top_bits, 1), IN_BF16)
            tl.store(s_ptr + src, scale, mask=src >= 0)
            tl.store(d_ptr + s64[:, None] * s_d + cols[None, :], to_e4m3(widen(bits, IN_BF16, HW), inv[:, None], HW),
                     mask=ok)
        amax, _ = amax_of_bits(ctop, IN_BF16)
        tl.store(c_ptr + chunk.to(tl.int64) * C + cols, amax, mask=cols < C)
    else:  # long rows: BLOCK_C columns of the chunk's rows at a time, twice (the second from L2)
        src = tl.load(src_ptr + chunk * CHUNK_R + tl.arange(0, CHUNK_R))
        s64 = src.to(tl.int64)
        top = tl.zeros([CHUNK_R], dtype=tl.int32)
        for c0 in range(0, C, BLOCK_C):  # the column maxima, and the rows' amax
            cols = c0 + tl.arange(0, BLOCK_C)
            ok = (src >= 0)[:, None] & (cols < C)[None, :]
            top_bits = abs_bits(tl.load(x_ptr + s64[:, None] * s_x + cols[None, :], mask=ok, other=0), IN_BF16)
            amax, _ = amax_of_bits(tl.max(top_bits, 0), IN_BF16)
            tl.store(c_ptr + chunk.to(tl.int64) * C + cols, amax, mask=cols < C)
            top = tl.maximum(top, tl.max(top_bits, 1))
        inv, scale = _block_scales(top, IN_BF16)
        tl.store(s_ptr + src, scale, mask=src >= 0)
        for c0 in range(0, C, BLOCK_C):  # scaled and rounded
            cols = c0 + tl.arange(0, BLOCK_C)
            ok = (src >= 0)[:, None] & (cols < C)[None, :]
            bits = tl.load(x_ptr + s64[:, None] * s_x + cols[None, :], mask=ok, other=0)
            tl.store(d_ptr + s64[:, None] * s_d + cols[None, :], to_e4m3(widen(bits, IN_BF16, HW), inv[:, None], HW),
                     mask=ok)


@triton.jit
def _quantize_stacked_cols_kernel(x_ptr, inv_ptr, out_ptr, M, C, s_xe, s_xm, IN_BF16: tl.constexpr,
                                  BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, HW: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    e = tl.program_id(2).to(tl.int64)
    ok = (cols < C)[:, None] & (m < M)[None, :]
    bits = tl.load(x_ptr + e * s_xe + m.to(tl.int64)[None, :] * s_xm + cols[:, None], mask=ok, other=0)
    inv = tl.load(inv_ptr + e * C + cols, mask=cols < C, other=1.0)
    q = to_e4m3(widen(bits, IN_BF16, HW), inv[:, None], HW)
    tl.store(out_ptr + e * C * M + cols.to(tl.int64)[:, None] * M + m[None, :], q, mask=ok)


def quantize_rows(x_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_rowwise.quantize_rows(x, -1) of a 2-D x: (e4m3 [R, C], fp32 [R]); each row read once
    (twice past TILES' one_pass_cols, the second from L2)."""
    R, C = x_RC.shape
    data = torch.empty(R, C, dtype=torch.float8_e4m3fn, device=x_RC.device)
    scale = torch.empty(R, dtype=torch.float32, device=x_RC.device)
    if R:
        xk, in_bf16 = _loadable(x_RC)
        t = TILES["rows"]
        block_c = triton.next_power_of_2(C) if C <= t["one_pass_cols"] else t["cols"]
        block_r = max(1, min(t["max_rows"], t["elements"] // block_c))
        _quantize_rows_kernel[(triton.cdiv(R, block_r),)](xk, data, scale, R, C, xk.stride(0), data.stride(0),
                                                          IN_BF16=in_bf16, BLOCK_R=block_r, BLOCK_C=block_c,
                                                          ONE_PASS=block_c >= C, HW=HW_CONVERT, num_warps=t["num_warps"])
    return data, scale


def _rows_chunks_tile(C: int) -> tuple[bool, int, int, int]:
    """(one pass, BLOCK_C, warps, SUB_R) of quantize_rows_chunks for rows of C columns (TILES)."""
    t = TILES["rows_chunks"]
    one_pass = C <= t["one_pass_cols"]
    block_c = triton.next_power_of_2(C) if one_pass else t["cols"]
    # the warps along the columns, so each thread holds whole columns of a tile: about
    # ``cols_per_warp`` columns a warp (two 16-byte bf16 loads a row per thread), sub_rows rows a tile
    warps = t["num_warps"] or max(1, min(8, block_c // t["cols_per_warp"]))
    return one_pass, block_c, warps, min(CHUNK, triton.next_power_of_2(max(1, t["sub_rows"])))


def rows_chunks_fits(C: int) -> bool:
    """Whether quantize_rows_chunks's default tile serves rows of C columns: at most ``cols_per_warp``
    columns a warp on its (at most 8) warps, so C <= 4096 by default (rows past one_pass_cols run
    two passes of ``cols``-column blocks, which fit). Wider one-pass rows put more columns on each
    thread than its registers hold (measured on the H200, session 15: 1024 and 2048 columns a warp
    ran 2.83 and 2.50 ms against 0.34 at [65664, 4096], and olmoe3-4l-8e's [65664, 8192] gate|up
    gradient made the fused path 4% slower a step than the two kernels); fp8_rowwise then runs the
    two kernels. A tile with its warps given (the sweep's) is taken as it is."""
    _, block_c, warps, _ = _rows_chunks_tile(C)
    return bool(TILES["rows_chunks"]["num_warps"]) or block_c <= warps * TILES["rows_chunks"]["cols_per_warp"]


def quantize_rows_chunks(x_RC: torch.Tensor, src_P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_rows(x) and chunk_amax(x, src_P) in one read of x: (e4m3 [R, C], fp32 [R], fp32
    [P / CHUNK, C]). The rows are those src_P names (padded_source_rows': each row of x once, -1 for
    padding); a row of x that src_P does not name (past the last group) is left unspecified in the
    data and scale, as the grouped GEMMs leave its output."""
    (R, C), P = x_RC.shape, src_P.numel()
    if P % CHUNK:
        raise ValueError(f"the padded rows ({P}) must be a multiple of {CHUNK}")
    data = torch.empty(R, C, dtype=torch.float8_e4m3fn, device=x_RC.device)
    scale = torch.empty(R, dtype=torch.float32, device=x_RC.device)
    chunks = torch.empty(P // CHUNK, C, dtype=torch.float32, device=x_RC.device)
    if P:
        xk, in_bf16 = _loadable(x_RC)
        one_pass, block_c, warps, sub_r = _rows_chunks_tile(C)
        _quantize_rows_chunks_kernel[(P // CHUNK,)](xk, src_P, data, scale, chunks, C, xk.stride(0), data.stride(0),
                                                   IN_BF16=in_bf16, CHUNK_R=CHUNK, SUB_R=sub_r, BLOCK_C=block_c,
                                                   ONE_PASS=one_pass, HW=HW_CONVERT, num_warps=warps)
    return data, scale, chunks


def quantize_stacked_cols(x_EMC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [E, M, C] quantized along M for each (e, c): (data^T e4m3 [E, C, M] contiguous, scale fp32
    [E, C]) = fp8_rowwise.quantize_rows(x.transpose(-2, -1), -1) without the transposed fp32 copy
    (a weight's dgrad orientation, a dense wgrad's token operand). M a multiple of CHUNK."""
    E, M, C = x_EMC.shape
    if M % CHUNK:
        raise ValueError(f"the quantized dim ({M}) must be a multiple of {CHUNK}")
    x = x_EMC.contiguous()
    amax_EC = group_amax(chunk_amax(x.view(E * M, C), None),
                         torch.arange(1, E + 1, dtype=torch.int32, device=x.device) * (M // CHUNK))
    scale_EC = pow2_scale(amax_EC)
    out = torch.empty(E, C, M, dtype=torch.float8_e4m3fn, device=x.device)
    xk, in_bf16 = _loadable(x.view(E * M, C))
    _quantize_stacked_cols_kernel[(triton.cdiv(C, 128), triton.cdiv(M, 64), E)](
        xk, (1.0 / scale_EC).contiguous(), out, M, C, M * C, C, IN_BF16=in_bf16, BLOCK_C=128, BLOCK_M=64,
        HW=HW_CONVERT)
    return out, scale_EC


def _loadable(x_RC: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """x as the kernels read it: rows C-contiguous (a copy otherwise), bf16 as its int16 bits."""
    return as_loadable(x_RC if x_RC.stride(1) == 1 else x_RC.contiguous())


def chunk_amax(x_RC: torch.Tensor, src_P: torch.Tensor | None) -> torch.Tensor:
    """max |x[src_P]| over each CHUNK rows, per column: fp32 [P / CHUNK, C] (zero rows where src_P < 0;
    without src_P the rows of x as they are, P = R). NaN and inf blocks give NaN / inf."""
    P, C = (src_P.numel() if src_P is not None else x_RC.shape[0]), x_RC.shape[1]
    if P % CHUNK:
        raise ValueError(f"the padded rows ({P}) must be a multiple of {CHUNK}")
    out = torch.empty(P // CHUNK, C, dtype=torch.float32, device=x_RC.device)
    xk, in_bf16 = _loadable(x_RC)
    t = TILES["chunk_amax"]
    _chunk_amax_kernel[(triton.cdiv(C, t["cols"]), triton.cdiv(P // CHUNK, t["chunks"]))](
        xk, src_P if src_P is not None else xk, out, P, C, xk.stride(0), GATHER=src_P is not None, IN_BF16=in_bf16,
        CHUNK_R=CHUNK, CHUNKS=t["chunks"], BLOCK_C=t["cols"], num_warps=t["num_warps"])
    return out


def group_amax(x_RC: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
    """max |x| over each group's rows [ends_E[e-1], ends_E[e]) of x, per column: fp32 [E, C] (0 for
    an empty group). Few groups (a dense wgrad's one) split their rows over TILES' ``programs``."""
    E, C = ends_E.numel(), x_RC.shape[1]
    xk, in_bf16 = _loadable(x_RC)
    t = TILES["group_amax"]
    col_blocks = triton.cdiv(C, t["cols"])
    split = max(1, min(triton.cdiv(t["programs"], E * col_blocks), triton.cdiv(x_RC.shape[0], E * t["unroll"])))
    out = torch.empty(split, E, C, dtype=torch.float32, device=x_RC.device)
    _group_cols_amax_kernel[(E, col_blocks, split)](xk, ends_E, out, E, C, xk.stride(0), split, IN_BF16=in_bf16,
                                                    UNROLL=t["unroll"], BLOCK_C=t["cols"], num_warps=t["num_warps"])
    return out[0] if split == 1 else out.amax(0)  # NaN kept: amax propagates it


def quantize_cols(x_RC: torch.Tensor, src_P: torch.Tensor, group_P: torch.Tensor, inv_EC: torch.Tensor) -> torch.Tensor:
    """x[src_P] x inv_EC[group_P] (per row's group and column) as E4M3, transposed: [C, P] contiguous."""
    P, C = src_P.numel(), x_RC.shape[1]
    out = torch.empty(C, P, dtype=torch.float8_e4m3fn, device=x_RC.device)
    xk, in_bf16 = _loadable(x_RC)
    _quantize_cols_kernel[(triton.cdiv(C, 128), triton.cdiv(P, 64))](
        xk, src_P, group_P.to(torch.int32), inv_EC.contiguous(), out, P, C, xk.stride(0), IN_BF16=in_bf16,
        BLOCK_C=128, BLOCK_P=64, HW=HW_CONVERT)
    return out
