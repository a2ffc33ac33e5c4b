"""Triton FP8 blockwise quantization (the GPU path of core.precision.blockwise), bit for bit the
torch reference's codes: every output written from registers, no transposed copy made.

- ``quantize_1x128_fused``: x [R, C] -> its 1x128 tiles along C ("rows": the forward's and the
  dgrad's A operand, [R, C] e4m3 + [R, C / 128] scales) and/or along the rows ("tokens": the wgrad's
  operand, written transposed, [C, P] e4m3 contiguous + [C, P / 128] scales: x^T is never made),
  from each 128 x 128 tile read twice (the second time transposed, from L1 / L2, for the tokens
  output: no transpose in registers). The tokens output may be grouped: row p of the padded
  layout reads x[src_rows[p]], or zeros where src_rows[p] < 0 (grouping.padded_source_rows; the
  same bits as quantizing grouping.pad_groups' output). Rows output then go to the source rows.
- ``quantize_1x128_swiglu``: the same outputs for a SwiGLU product, or h's gradient, computed in the
  kernel from h = [gate | up] (and the product's gradient), never written in bf16: its own kernel,
  the 128 x 128 tile computed once and the tokens' tile transposed through shared memory
  (precision.fp8_fused_swiglu; TILE_WARPS says how it measured). The same kernel serves plain x
  with TOKENS_FROM_TILE (measured no faster, off).
- ``quantize_128x128_triton``: a weight [..., O, I] -> (e4m3 w, e4m3 w^T [..., I, O] contiguous,
  scales [..., O / 128, I / 128]), each tile read twice likewise; or either of w / w^T alone, each
  tile read once.

Scales are 2^ceil(log2(amax / 448)) from the bits (mx_triton.mx_exponent, rceil), 1 for a block
holding NaN or inf (the reference's choice); a block's amax, and whether it holds inf or NaN, is one
integer max over |x|'s bits. data = x / scale saturated to +-448 and rounded to E4M3, nearest even:
on the GPU by its one conversion instruction (cvt.rn.satfinite, which also saturates inf and keeps
NaN), under the interpreter by bits; a NaN element is e4m3's NaN (0x7F). Scale tensors may be
given any strides (F.scaled_mm wants the 1x128 scales outer-major: ``outer_major=True``).

Legend: R rows, C columns, P padded rows (the tokens output), O / I a weight's dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blockwise import FP8_BLOCK
from .mx_triton import HW_CONVERT, abs_bits, amax_of_bits, as_loadable, exp2_int, mx_exponent, to_e4m3, widen
from .swiglu_triton import swiglu_grads, swiglu_product

__all__ = ["QUANTIZE_CONFIGS", "quantize_128x128_triton", "quantize_1x128_fused", "quantize_1x128_swiglu",
           "set_quantize_warps", "use_quantize_configs"]


@triton.jit
def _block_scales(amax_bits, IN_BF16: tl.constexpr):
    """(1 / scale, scale), fp32, of blocks whose largest |x| has the bits amax_bits (mx_triton.abs_bits):
    2^ceil(log2(amax / 448)) (mx_exponent, rceil), 1 for a block holding inf or NaN."""
    amax, finite = amax_of_bits(amax_bits, IN_BF16)
    e = tl.where(finite, mx_exponent(amax, False), 0)
    return exp2_int(-e), exp2_int(e)


def _quantize_configs(interpret: bool) -> list[triton.Config]:
    """The 1x128 kernel's launch configs the tests run each of (use_quantize_configs): 4 or 8 warps;
    the interpreter runs one."""
    if interpret:
        return [triton.Config({}, num_warps=4)]
    return [triton.Config({}, num_warps=w) for w in (4, 8)]


QUANTIZE_WARPS = 4
"""The 1x128 kernel's warps: 8 warps and autotuning over 4 / 8 never beat 4 at the measured shapes
(the H200, session 7, tools/bench_quantize.py: [65536, 4096] 0.470 / 0.484 / autotuned 0.478 ms, [65536,
8192] 0.884 / 0.882 / 0.891, [131072, 2048] 0.457 / 0.459 / 0.469); on the H100 neither wins everywhere
(session 38 call 1: 0.551 / 0.572, 1.038 / 1.024, 0.557 / 0.535; the sums 0.7% apart; session 39 call 1,
another H100: 0.585 / 0.488, 1.078 / 0.984, 0.564 / 0.513, 8 warps 9-17% faster). The machines disagree,
and in steps (precision.fp8_quantize_warps=8, set_quantize_warps; session 40 call 2) 8 is within noise
(OLMoE-8L f8gc +0.3% / +0.4%, olmoe3-4l-8e -0.1% / +0.5%): 4 stays. The
autotuner's lookup is host time at every call (96 calls a step at OLMoE-8L, session 37; its size there
not measured): one config, no tuning."""
QUANTIZE_CONFIGS = [triton.Config({}, num_warps=QUANTIZE_WARPS)]


@triton.jit
def _tile_bits(x_ptr, h_ptr, rows, cols, mask, s_xr, s_xc, s_hr, F, PROLOGUE: tl.constexpr, HW: tl.constexpr):
    """The bf16 bits (int16) of a SwiGLU computed here at ``rows`` x ``cols`` (broadcast; zeros where not
    ``mask``) from the int16 view of h = [gate | up] [R, 2F] (row stride s_hr): PROLOGUE 1 the product
    silu(gate) * up [R, F]; PROLOGUE 2 h's gradient [R, 2F] from the product's gradient x [R, F]
    (swiglu_triton's math: the same bits as its kernels)."""
    rows = rows.to(tl.int64)
    f = cols % F  # the gate / up column (PROLOGUE 2: the up half's columns F..2F read column c - F)
    g = widen(tl.load(h_ptr + rows * s_hr + f, mask=mask, other=0), True, HW)
    if PROLOGUE == 1:
        u = widen(tl.load(h_ptr + rows * s_hr + F + f, mask=mask, other=0), True, HW)
        v = swiglu_product(g, u)
    else:
        gate = cols < F  # up is read only where the gate's gradient needs it
        u = widen(tl.load(h_ptr + rows * s_hr + F + f, mask=mask & gate, other=0), True, HW)
        ga = widen(tl.load(x_ptr + rows * s_xr + f * s_xc, mask=mask, other=0), True, HW)
        grad_g, grad_u = swiglu_grads(g, u, ga)
        v = tl.where(gate, grad_g, grad_u)
    return v.to(tl.int16, bitcast=True)


@triton.jit
def _view_rows(src_ptr, p, R, P, R_OUT, GATHER: tl.constexpr):
    """(source row, whether it is read, whether its rows output is written) of padded rows p: x[src[p]]
    (GATHER: zeros where src[p] < 0, rows output only to the rows read), else x[p] (zeros past R; rows
    R..R_OUT are zero padding rows, quantized as zeros)."""
    if GATHER:
        src = tl.load(src_ptr + p, mask=p < P, other=-1)
        valid = src >= 0
        row_out = valid
    else:
        src = p
        valid = p < R
        row_out = p < R_OUT
    return src, valid, row_out


@triton.autotune(configs=QUANTIZE_CONFIGS, key=["C", "P", "GATHER", "ROWS", "TOKENS"])
@triton.jit
def _fp8_quantize_1x128_kernel(
    x_ptr, src_ptr, rd_ptr, rs_ptr, td_ptr, ts_ptr, R, P, C, R_OUT,
    s_xr, s_xc, s_rdr, s_rdc, s_rsr, s_rsb, s_tdc, s_tdp, s_tsc, s_tsb,
    GATHER: tl.constexpr, ROWS: tl.constexpr, TOKENS: tl.constexpr, IN_BF16: tl.constexpr, BLOCK: tl.constexpr,
    HW: tl.constexpr,
):
    pid_c, pid_p = tl.program_id(0), tl.program_id(1)
    p = pid_p * BLOCK + tl.arange(0, BLOCK)
    c = pid_c * BLOCK + tl.arange(0, BLOCK)
    src, valid, row_out = _view_rows(src_ptr, p, R, P, R_OUT, GATHER)
    bits = tl.load(x_ptr + src[:, None].to(tl.int64) * s_xr + c[None, :] * s_xc, mask=valid[:, None], other=0)
    x = widen(bits, IN_BF16, HW)
    if ROWS:
        inv, scale = _block_scales(tl.max(abs_bits(bits, IN_BF16), axis=1), IN_BF16)
        src64 = src.to(tl.int64)
        tl.store(rd_ptr + src64[:, None] * s_rdr + c[None, :] * s_rdc, to_e4m3(x, inv[:, None], HW),
                 mask=row_out[:, None])
        tl.store(rs_ptr + src64 * s_rsr + pid_c * s_rsb, scale, mask=row_out)
    if TOKENS:
        # the tile loaded again as [C tile, P tile] (from L1 / L2) and quantized along its rows: no
        # transpose in registers (with tl.trans of its e4m3 tile the 128 x 128 kernel's w^T came out
        # wrong on the H200, Triton 3.6, this kernel's new code path; the old one's passed)
        bt = tl.load(x_ptr + src[None, :].to(tl.int64) * s_xr + c[:, None] * s_xc, mask=valid[None, :], other=0)
        inv, st = _block_scales(tl.max(abs_bits(bt, IN_BF16), axis=1), IN_BF16)
        qt = to_e4m3(widen(bt, IN_BF16, HW), inv[:, None], HW)
        tl.store(td_ptr + c[:, None].to(tl.int64) * s_tdc + p[None, :] * s_tdp, qt, mask=(p < P)[None, :])
        tl.store(ts_ptr + c.to(tl.int64) * s_tsc + pid_p * s_tsb, st)


@triton.jit
def _fp8_quantize_tile_kernel(
    x_ptr, h_ptr, src_ptr, rd_ptr, rs_ptr, td_ptr, ts_ptr, R, P, R_OUT, F,
    s_xr, s_xc, s_hr, s_rdr, s_rdc, s_rsr, s_rsb, s_tdc, s_tdp, s_tsc, s_tsb,
    GATHER: tl.constexpr, ROWS: tl.constexpr, TOKENS: tl.constexpr, BLOCK: tl.constexpr, HW: tl.constexpr,
    PROLOGUE: tl.constexpr, IN_BF16: tl.constexpr,
):
    """_fp8_quantize_1x128_kernel's outputs from one read: its 128 x 128 tile loaded (PROLOGUE 0: x's own
    values) or computed (a SwiGLU: _tile_bits' PROLOGUE 1 or 2) once, the rows' scales from its rows,
    the tokens' from its columns, and the tokens' e4m3 tile from the scaled fp32 values transposed in
    registers (through shared memory), where the plain kernel reads the tile a second time, transposed."""
    pid_c, pid_p = tl.program_id(0), tl.program_id(1)
    p = pid_p * BLOCK + tl.arange(0, BLOCK)
    c = pid_c * BLOCK + tl.arange(0, BLOCK)
    src, valid, row_out = _view_rows(src_ptr, p, R, P, R_OUT, GATHER)
    if PROLOGUE == 0:
        bits = tl.load(x_ptr + src[:, None].to(tl.int64) * s_xr + c[None, :] * s_xc, mask=valid[:, None], other=0)
    else:
        bits = _tile_bits(x_ptr, h_ptr, src[:, None], c[None, :], valid[:, None], s_xr, s_xc, s_hr, F, PROLOGUE, HW)
    x = widen(bits, IN_BF16, HW)
    a = abs_bits(bits, IN_BF16)
    if ROWS:
        inv, scale = _block_scales(tl.max(a, axis=1), IN_BF16)
        src64 = src.to(tl.int64)
        tl.store(rd_ptr + src64[:, None] * s_rdr + c[None, :] * s_rdc, to_e4m3(x, inv[:, None], HW),
                 mask=row_out[:, None])
        tl.store(rs_ptr + src64 * s_rsr + pid_c * s_rsb, scale, mask=row_out)
    if TOKENS:
        inv_t, st = _block_scales(tl.max(a, axis=0), IN_BF16)
        # x / scale (exact: a power of two) transposed as fp32, then rounded to e4m3: the bits of the
        # reference's x^T quantized along its rows
        qt = to_e4m3(tl.trans(x * inv_t[None, :]), 1.0, HW)
        tl.store(td_ptr + c[:, None].to(tl.int64) * s_tdc + p[None, :] * s_tdp, qt, mask=(p < P)[None, :])
        tl.store(ts_ptr + c.to(tl.int64) * s_tsc + pid_p * s_tsb, st)


TILE_WARPS = 8
"""The one-read kernel's warps (_fp8_quantize_tile_kernel): its 128 x 128 tile of gate, up (and the
product's gradient) in fp32 spills at 4 warps, takes 162-174 registers a thread at 8 and 91-96 at 16
(ptxas for SM90, Triton 3.6, no spills: tests/core/test_precision_fp8.py). For the fused SwiGLU, 8 beat
16 at both shapes each way (H100, session 38 call 4, docs/bench/session38/swiglu_quant_probe.py:
forward 0.512 / 0.555 ms at OLMoE's, 0.969 / 1.039 at olmoe3-4l-8e's; backward 1.352 / 1.391, 2.469 /
2.639). Against the two kernels it replaces (0.506, 1.006; 0.914, 1.829 ms) it was level in the forward
and 0.68x / 0.74x in the backward, so precision.fp8_fused_swiglu stays off (its steps 0.970x / 0.987x).
Its earlier forms: the plain kernel's two reads with the SwiGLU computed in each (call 2: 2.2 KB of
spills a thread, steps 0.71x / 0.85x of the unfused), then 32 rows or columns a step (call 3: forward 0.74-0.78x,
backward 0.46-0.48x; steps 0.947x / 0.980x)."""

TOKENS_FROM_TILE = False
"""Plain x's rows and tokens (quantize_1x128_fused with both) from _fp8_quantize_tile_kernel's one read,
the tokens transposed in registers, instead of _fp8_quantize_1x128_kernel's second, transposed read
from L1 / L2 (the same bits). Off: no faster (H100, session 39 call 1, tools/bench_quantize.py's "one
read" column against the plain kernel at 8 warps: 0.505 / 0.488 ms at [65536, 4096], 0.988 / 0.984 at
[65536, 8192], 0.563 / 0.513 at [131072, 2048]), though the plain kernel moves rows + tokens at only
about 2.0-2.2 TB/s, 1.5x the time of a copy of the same bytes."""


def set_quantize_warps(warps: int) -> None:
    """The product's 1x128 kernel on ``warps`` warps (precision.fp8_quantize_warps: 4, QUANTIZE_WARPS, or
    8) from now on; nothing if it runs on them already."""
    if warps not in (4, 8):
        raise ValueError(f"the 1x128 quantization kernel runs on 4 or 8 warps, got {warps}")
    if [c.num_warps for c in _fp8_quantize_1x128_kernel.configs] != [warps]:
        use_quantize_configs([triton.Config({}, num_warps=warps)])


def use_quantize_configs(configs: list[triton.Config]) -> None:
    """Run the 1x128 kernel over ``configs`` from now on (autotuned where more than one; the tests'
    one at a time; QUANTIZE_CONFIGS is the product's); what was tuned is forgotten."""
    _fp8_quantize_1x128_kernel.configs = list(configs)
    _fp8_quantize_1x128_kernel.cache.clear()


@triton.jit
def _fp8_quantize_128x128_kernel(w_ptr, d_ptr, dt_ptr, s_ptr, O, I, IN_BF16: tl.constexpr, BLOCK: tl.constexpr,
                                 HW: tl.constexpr, DATA: tl.constexpr, DATA_T: tl.constexpr):
    """w [G, O, I] contiguous; one program per 128 x 128 tile: d [G, O, I] (DATA), dt [G, I, O] (DATA_T),
    s [G, O/128, I/128]. The tile is read once for one of d / dt, twice for both."""
    pid_i, pid_o, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o = pid_o * BLOCK + tl.arange(0, BLOCK)
    i = pid_i * BLOCK + tl.arange(0, BLOCK)
    base = g.to(tl.int64) * O * I
    if DATA:
        bits = tl.load(w_ptr + base + o[:, None] * I + i[None, :], mask=(o < O)[:, None], other=0)
        inv, scale = _block_scales(tl.max(tl.max(abs_bits(bits, IN_BF16), axis=1), axis=0), IN_BF16)
        tl.store(d_ptr + base + o[:, None] * I + i[None, :], to_e4m3(widen(bits, IN_BF16, HW), inv, HW))
    if DATA_T:
        # w^T from the tile loaded transposed (as the 1x128 kernel's tokens output): again, from L2,
        # after d; alone, the one read, its amax the same tile's
        bt = tl.load(w_ptr + base + o[None, :] * I + i[:, None], mask=(o < O)[None, :], other=0)
        if not DATA:
            inv, scale = _block_scales(tl.max(tl.max(abs_bits(bt, IN_BF16), axis=1), axis=0), IN_BF16)
        tl.store(dt_ptr + base + i[:, None] * O + o[None, :], to_e4m3(widen(bt, IN_BF16, HW), inv, HW))
    tl.store(s_ptr + g.to(tl.int64) * (O // BLOCK) * (I // BLOCK) + pid_o * (I // BLOCK) + pid_i, scale)


def _scales(rows: int, blocks: int, outer_major: bool, device) -> torch.Tensor:
    if outer_major:
        return torch.empty(blocks, rows, dtype=torch.float32, device=device).t()
    return torch.empty(rows, blocks, dtype=torch.float32, device=device)


def quantize_1x128_fused(x_RC: torch.Tensor, rows: bool = True, tokens: bool = True,
                         src_rows_P: torch.Tensor | None = None, rows_out: int | None = None,
                         outer_major: bool = False, tokens_outer_major: bool | None = None):
    """x [R, C] (C a multiple of 128) -> (rows, tokens), each (data, scale) or None:

    - rows: quantize_1x128(x, -1) over ``rows_out`` rows (default R; rows past R are zeros): e4m3
      [rows_out, C], fp32 [rows_out, C / 128]. With ``src_rows_P``, only the rows some p reads are
      written (the rest of the outputs is unspecified).
    - tokens: quantize_1x128(x_P^T, -1) for x_P = x padded with zero rows to P = ceil(R / 128) x 128,
      or x_P = x[src_rows_P] (zeros where < 0; P = len(src_rows_P), a multiple of 128): e4m3 [C, P],
      fp32 [C, P / 128].

    ``outer_major``: scales laid out rows-fastest (stride (1, rows)), as F.scaled_mm wants them;
    ``tokens_outer_major`` (default ``outer_major``): the tokens' alone so (K-block-major: a K-block's
    scales of every column contiguous, as the wgrad kernels read them a K-block at a time)."""
    return _quantize_1x128(x_RC, None, 0, x_RC.shape[1], rows, tokens, src_rows_P, rows_out, outer_major,
                           tokens_outer_major)


def quantize_1x128_swiglu(h_R2F: torch.Tensor, grad_act_RF: torch.Tensor | None = None, rows: bool = True,
                          tokens: bool = True, src_rows_P: torch.Tensor | None = None, rows_out: int | None = None,
                          outer_major: bool = False, tokens_outer_major: bool | None = None):
    """quantize_1x128_fused's outputs for the SwiGLU of h_R2F = [gate | up] [R, 2F] (bf16, F a multiple
    of 128), computed in the kernel and never written: without ``grad_act_RF``, of the product
    silu(gate) * up [R, F]; with it (bf16 [R, F], the product's gradient), of h's gradient [R, 2F]. The
    same bits as quantize_1x128_fused(swiglu_triton.swiglu_forward(h)) and (swiglu_backward(h,
    grad_act)[1]): one kernel instead of two, the bf16 product or gradient neither written nor read
    back (the expert MLP of fp8_gemm's fused_swiglu)."""
    R, F2 = h_R2F.shape
    if h_R2F.dtype != torch.bfloat16 or F2 % (2 * FP8_BLOCK):
        raise ValueError(f"the fused SwiGLU quantization takes bf16 [gate | up] of F a multiple of {FP8_BLOCK} "
                         f"each, got {h_R2F.dtype} {tuple(h_R2F.shape)}")
    if h_R2F.stride(1) != 1:
        raise ValueError("the fused SwiGLU quantization reads h's rows contiguous: pass h.contiguous()")
    if grad_act_RF is None:
        return _quantize_1x128(h_R2F, h_R2F, 1, F2 // 2, rows, tokens, src_rows_P, rows_out, outer_major,
                               tokens_outer_major)
    if grad_act_RF.dtype != torch.bfloat16 or grad_act_RF.shape != (R, F2 // 2):
        raise ValueError(f"the product's gradient must be bf16 [{R}, {F2 // 2}], got {grad_act_RF.dtype} "
                         f"{tuple(grad_act_RF.shape)}")
    return _quantize_1x128(grad_act_RF, h_R2F, 2, F2, rows, tokens, src_rows_P, rows_out, outer_major,
                           tokens_outer_major)


def _quantize_1x128(x: torch.Tensor, h: torch.Tensor | None, prologue: int, C: int, rows: bool, tokens: bool,
                    src_rows_P: torch.Tensor | None, rows_out: int | None, outer_major: bool,
                    tokens_outer_major: bool | None):
    """The 1x128 kernel over C columns of R = x.shape[0] rows; ``prologue`` (_tile_bits' PROLOGUE) says
    what they are: x's own (0), or a SwiGLU of h (1, 2)."""
    R = x.shape[0]
    if C % FP8_BLOCK:
        raise ValueError(f"fp8 1x128 tiles must divide the columns ({C}): pad them to a multiple of {FP8_BLOCK}")
    dev = x.device
    P = src_rows_P.numel() if src_rows_P is not None else -(-R // FP8_BLOCK) * FP8_BLOCK
    if P % FP8_BLOCK:
        raise ValueError(f"the padded rows ({P}) must be a multiple of {FP8_BLOCK}")
    R_OUT = R if rows_out is None else rows_out
    if src_rows_P is None and R_OUT > P:
        raise ValueError(f"rows_out ({R_OUT}) may pad R ({R}) by less than {FP8_BLOCK}")
    B = C // FP8_BLOCK
    rq = (torch.empty(R_OUT, C, dtype=torch.float8_e4m3fn, device=dev), _scales(R_OUT, B, outer_major, dev)) if rows else None
    t_outer = outer_major if tokens_outer_major is None else tokens_outer_major
    tq = (torch.empty(C, P, dtype=torch.float8_e4m3fn, device=dev), _scales(C, P // FP8_BLOCK, t_outer, dev)) if tokens else None
    if not (rows or tokens) or P == 0:
        return rq, tq
    rd, rs = rq if rows else (x, x)
    td, ts = tq if tokens else (x, x)
    grid = (B, P // FP8_BLOCK)
    xk, in_bf16 = as_loadable(x)
    if prologue == 0 and not (TOKENS_FROM_TILE and tokens):
        _fp8_quantize_1x128_kernel[grid](
            xk, src_rows_P if src_rows_P is not None else x, rd, rs, td, ts, R, P, C, R_OUT,
            x.stride(0), x.stride(1), rd.stride(0), rd.stride(1), rs.stride(0), rs.stride(1),
            td.stride(0), td.stride(1), ts.stride(0), ts.stride(1),
            GATHER=src_rows_P is not None, ROWS=rows, TOKENS=tokens, IN_BF16=in_bf16, BLOCK=FP8_BLOCK, HW=HW_CONVERT,
        )
    else:
        hk = h.view(torch.int16) if h is not None else xk
        _fp8_quantize_tile_kernel[grid](
            xk, hk, src_rows_P if src_rows_P is not None else x, rd, rs, td, ts, R, P, R_OUT,
            h.shape[1] // 2 if h is not None else 1,
            x.stride(0), x.stride(1), hk.stride(0), rd.stride(0), rd.stride(1), rs.stride(0), rs.stride(1),
            td.stride(0), td.stride(1), ts.stride(0), ts.stride(1),
            GATHER=src_rows_P is not None, ROWS=rows, TOKENS=tokens, BLOCK=FP8_BLOCK, HW=HW_CONVERT, PROLOGUE=prologue,
            IN_BF16=in_bf16 or prologue > 0, num_warps=TILE_WARPS,
        )
    return rq, tq


def quantize_128x128_triton(w: torch.Tensor, data: bool = True, data_t: bool = True):
    """w [..., O, I] -> (data e4m3 [..., O, I], data^T [..., I, O] contiguous, scale fp32
    [..., O / 128, I / 128]): quantize_128x128(w) and its transpose, each tile read twice (the
    second transposed, from L2). ``data`` / ``data_t`` False: that output is None, not written (a
    compiled step's forward needs only the data, its backward only data^T: each tile read once)."""
    *lead, O, I = w.shape
    if O % FP8_BLOCK or I % FP8_BLOCK:
        raise ValueError(f"fp8 128x128 weight tiles must divide both dims of the weight {tuple(w.shape)}: "
                         f"make them multiples of {FP8_BLOCK}")
    if not (data or data_t):
        raise ValueError("quantize_128x128_triton writes the data, its transpose or both: ask for one")
    w3 = w.reshape(-1, O, I).contiguous()
    G = w3.shape[0]
    d = torch.empty(G, O, I, dtype=torch.float8_e4m3fn, device=w.device) if data else None
    dt = torch.empty(G, I, O, dtype=torch.float8_e4m3fn, device=w.device) if data_t else None
    s = torch.empty(G, O // FP8_BLOCK, I // FP8_BLOCK, dtype=torch.float32, device=w.device)
    if G:
        wk, in_bf16 = as_loadable(w3)
        _fp8_quantize_128x128_kernel[(I // FP8_BLOCK, O // FP8_BLOCK, G)](
            wk, d if data else s, dt if data_t else s, s, O, I, IN_BF16=in_bf16, BLOCK=FP8_BLOCK, HW=HW_CONVERT,
            DATA=data, DATA_T=data_t, num_warps=8)
    return (d.reshape(w.shape) if data else None, dt.reshape(*lead, I, O) if data_t else None,
            s.reshape(*lead, O // FP8_BLOCK, I // FP8_BLOCK))
