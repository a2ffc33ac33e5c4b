"""Triton kernels of the fp8_rowwise grouped wgrad's operand (fp8_rowwise.quantize_group_cols, whose
torch ops are the reference): x[src_P] quantized along each expert's rows separately, one scale per
(expert, column), written transposed (data^T [C, P], P contiguous: the K-major operand the grouped
GEMM reads). No float atomics (torch's scatter_reduce amax contended: session 11), three passes:

1. ``_chunk_amax_kernel``: per 16 padded rows (every expert's rows start at a multiple of 16, so a
   chunk never holds two experts) and 128 columns, |x|'s max: [P / 16, C] fp32, all chunks in parallel;
2. ``_group_cols_amax_kernel``: per expert and 64 columns, the max over its chunks' partials (a loop
   over rows [start, end) of a row-gathered input; also the reference-free path of group_cols_amax);
3. ``_quantize_cols_kernel``: each [128 columns x 64 rows] tile read once, scaled by its rows'
   experts' 1 / scale (exact powers of two), rounded to E4M3 and stored transposed.

The E4M3 rounding and the bf16 widening are mx_triton's (the GPU's conversion instructions, by bits
under TRITON_INTERPRET=1): the same bits as the torch reference for finite inputs
(tests/core/test_fp8_rowwise.py, interpreted and on the GPU).

Legend: R rows, P padded rows, C columns, E experts, K chunks of 16 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mx_triton import HW_CONVERT, as_loadable, to_e4m3, widen

__all__ = ["CHUNK", "chunk_amax", "group_amax", "quantize_cols"]

CHUNK = 16
"""Rows per partial amax: the alignment of every expert's padded rows (fp8_rowwise.ALIGN)."""


@triton.jit
def _chunk_amax_kernel(x_ptr, src_ptr, out_ptr, P, C, s_x, IN_BF16: tl.constexpr, CHUNK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr, HW: tl.constexpr):
    k = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = k * CHUNK_R + tl.arange(0, CHUNK_R)
    src = tl.load(src_ptr + rows, mask=rows < P, other=-1)
    bits = tl.load(x_ptr + src.to(tl.int64)[:, None] * s_x + cols[None, :],
                   mask=(src >= 0)[:, None] & (cols < C)[None, :], other=0)
    amax = tl.max(tl.abs(widen(bits, IN_BF16, HW)), 0)
    tl.store(out_ptr + k.to(tl.int64) * C + cols, amax, mask=cols < C)


@triton.jit
def _group_cols_amax_kernel(x_ptr, src_ptr, poff_ptr, out_ptr, C, s_x, IN_BF16: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HW: tl.constexpr):
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(poff_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(poff_ptr + e)
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        src = tl.load(src_ptr + rows, mask=rows < end, other=-1)
        bits = tl.load(x_ptr + src.to(tl.int64)[:, None] * s_x + cols[None, :],
                       mask=(src >= 0)[:, None] & (cols < C)[None, :], other=0)
        amax = tl.maximum(amax, tl.max(tl.abs(widen(bits, IN_BF16, HW)), 0))
    tl.store(out_ptr + e * C + cols, amax, mask=cols < C)


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


def _loadable(x_RC: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """x as the kernels read it: rows C-contiguous (a copy otherwise), bf16 as its int16 bits."""
    return as_loadable(x_RC if x_RC.stride(1) == 1 else x_RC.contiguous())


def chunk_amax(x_RC: torch.Tensor, src_P: torch.Tensor) -> torch.Tensor:
    """max |x[src_P]| over each CHUNK rows, per column: fp32 [P / CHUNK, C] (zero rows where src_P < 0)."""
    P, C = src_P.numel(), x_RC.shape[1]
    if P % CHUNK:
        raise ValueError(f"the padded rows ({P}) must be a multiple of {CHUNK}")
    out = torch.empty(P // CHUNK, C, dtype=torch.float32, device=x_RC.device)
    xk, in_bf16 = _loadable(x_RC)
    _chunk_amax_kernel[(triton.cdiv(C, 128), P // CHUNK)](xk, src_P, out, P, C, xk.stride(0), IN_BF16=in_bf16,
                                                          CHUNK_R=CHUNK, BLOCK_C=128, HW=HW_CONVERT)
    return out


def group_amax(x_RC: torch.Tensor, src_P: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
    """max |x[src_P]| over each group's rows [ends_E[e-1], ends_E[e]) of the gathered rows, per
    column: fp32 [E, C] (0 for an empty group)."""
    E, C = ends_E.numel(), x_RC.shape[1]
    out = torch.empty(E, C, dtype=torch.float32, device=x_RC.device)
    xk, in_bf16 = _loadable(x_RC)
    _group_cols_amax_kernel[(E, triton.cdiv(C, 64))](xk, src_P, ends_E, out, C, xk.stride(0), IN_BF16=in_bf16,
                                                     BLOCK_R=32, BLOCK_C=64, HW=HW_CONVERT)
    return out


def quantize_cols(x_RC: torch.Tensor, src_P: torch.Tensor, group_P: torch.Tensor, inv_EC: torch.Tensor) -> torch.Tensor:
    """x[src_P] x inv_EC[group_P] (per row's group and column) as E4M3, transposed: [C, P] contiguous."""
    P, C = src_P.numel(), x_RC.shape[1]
    out = torch.empty(C, P, dtype=torch.float8_e4m3fn, device=x_RC.device)
    xk, in_bf16 = _loadable(x_RC)
    _quantize_cols_kernel[(triton.cdiv(C, 128), triton.cdiv(P, 64))](
        xk, src_P, group_P.to(torch.int32), inv_EC.contiguous(), out, P, C, xk.stride(0), IN_BF16=in_bf16,
        BLOCK_C=128, BLOCK_P=64, HW=HW_CONVERT)
    return out
