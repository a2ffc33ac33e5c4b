"""Triton MX quantization: the GPU path of mx.quantize_mx / dequantize_mx and of the emulation's fused
quantize-dequantize, bit for bit the reference's results.

One kernel (``_mx_quantize_kernel``) reads a 2-D view [P, C] once and writes what the caller asks:
the fp8 payload (e4m3 data + E8M0 codes) and/or the dequantized bf16 (the emulated GEMMs' operand:
one read, one write, nothing in between). Blocks of 32 run along C (``axis=-1``, each row's) or
along P (``axis=0``, each column's: the wgrad operand along the tokens, read in [32, 256] tiles so
the loads stay coalesced, no transposed copy). The rows of the view may be gathered: row p reads
x[src_rows[p]], or zeros where src_rows[p] < 0, which is grouping.pad_groups fused into the load.
``_mx_rows_and_cols_kernel`` gives a GEMM operand both of its quantizations from one read (its
rows, the bf16 operand of the forward or dgrad; its gathered columns, the wgrad's payload or bf16
operand), in [32, 128] tiles that hold whole blocks both ways. ``_mx_dequantize_kernel`` turns a
payload back into bf16.

Bits: the scale exponent comes from the bits of amax (floor) or of amax / 448 (rceil, exact ceil);
scaling is by exact powers of two built from bits; the only rounding is to E4M3, nearest even: on
the GPU by its conversion instruction, under the interpreter by bit arithmetic (``round_to_e4m3``),
the same values (``signed_e4m3``). The jit helpers here (``signed_e4m3``, ``round_to_e4m3``,
``mx_exponent``, ``exp2_int``, and core/triton_round.py's ``load_fp32``, ``store_rounded``) are shared
with blockwise_triton; the lean arithmetic's (``abs_bits``, ``widen``, ``lean_block_scale``, ``lean_qdq``, ``lean_rows_qdq``,
``store_bf16``) with
core/adamw_triton.py's MX-pair update.

Legend: P rows of the view, C its columns, R rows of the source (gathered views), B blocks.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..triton_round import load_fp32, store_rounded, widen_fp32

from .mx import E4M3_MAX, MX_BLOCK, SCALE_MODES

__all__ = ["GRID_COLS_FIRST", "HW_CONVERT", "LEAN", "abs_bits", "amax_of_bits", "as_loadable", "dequantize_mx_triton", "exp2_int",
           "lean_block_scale", "lean_qdq", "lean_rows_qdq", "load_fp32", "mx_exponent", "mx_qdq_triton", "mx_rows_and_cols_triton", "quantize_mx_triton", "round_to_e4m3", "signed_e4m3",
           "store_bf16", "store_rounded", "tile_grid", "tile_ids", "to_e4m3", "widen", "widen_fp32"]

# The GPU rounds to E4M3 with its conversion instruction; the interpreter by bits (signed_e4m3)
HW_CONVERT = os.environ.get("TRITON_INTERPRET") != "1"
LEAN = os.environ.get("MOETRON_MX_LEAN", "1") != "0"
"""The MX quantize kernel's arithmetic (``MOETRON_MX_LEAN=0`` at import turns it off; default on). True:
the FP8 blockwise kernels' (session 7): a block's amax and inf / NaN from one integer max over |x|'s
bits, the E4M3 rounding by the one conversion instruction, the bf16 output by the GPU's conversion
(nearest even, as torch's cast). False: the float max with a NaN count, the clamp and round trip, the
bf16 rounding by bits. The same bits either way (tests/core/test_mx.py: both settings under the
interpreter and on the H200); SM90 PTX: about 40% fewer instructions. On the H200 (session 9,
mxfp8 emulated, compiled) it took olmoe3-4l-8e from 48,263 to 50,005 tok/s (+3.6%) and OLMoE-8L from
66,509 to 70,767 (+6.4%): docs/performance.md."""
_ROWS_TILE = (32, 128)   # axis -1: 32 rows x 4 blocks of 32
_COLS_TILE = (32, 256)   # axis 0: one block of 32 rows x 256 columns


def _both_tile(spec: str) -> dict:
    """MOETRON_MX_BOTH_TILE's 'cols,warps[,tile-codes]' -> TILES["both"] (ValueError naming the form
    otherwise)."""
    parts = spec.split(",")
    codes = parts[2:] == ["tile-codes"]
    try:
        cols, warps = map(int, parts[:2]) if len(parts) == 2 + codes else (0, 0)
    except ValueError:
        cols = warps = 0
    if not (32 <= cols <= 1024 and cols & (cols - 1) == 0 and warps in (1, 2, 4, 8, 16)):
        raise ValueError(f"MOETRON_MX_BOTH_TILE={spec!r}: want 'cols,warps' or 'cols,warps,tile-codes', cols a power "
                         f"of two from 32 to 1024, warps 1, 2, 4, 8 or 16 (e.g. '128,4,tile-codes', the default)")
    return {"cols": cols, "num_warps": warps, "codes_from_tile": codes}


def _grid_order(spec: str) -> bool:
    """MOETRON_MX_GRID's value -> GRID_COLS_FIRST (ValueError naming the choices otherwise)."""
    if spec not in ("rows-first", "cols-first"):
        raise ValueError(f"MOETRON_MX_GRID={spec!r}: want 'rows-first' or 'cols-first'")
    return spec == "cols-first"


GRID_COLS_FIRST = _grid_order(os.environ.get("MOETRON_MX_GRID", "cols-first"))
"""The order in which the [32, TC]-tile kernels (``_mx_rows_and_cols_kernel`` here and
core/adamw_triton.py's MX-pair update) hand out their tiles. False (``rows-first``, before session
30): a 2-D grid whose first axis walks down the blocks of 32 rows, so programs launched together read
one column strip of many row blocks (TC columns of each row: 256 bytes of a bf16 row at 128
columns, rows C elements apart). True (``cols-first``, the default): a 1-D grid in which consecutive
programs take consecutive column tiles of one block of 32 rows, so programs launched together read
whole rows, contiguous memory. The same bits either way (tests). On an H100 (session 30,
docs/performance.md) cols-first took the MX pair's 3.77B parameters from 32.30 to 31.14 ms (its
32-column tile from 44.7 to 33.8) and the fused kernel's OLMoE-8L operands from 0.624 / 0.627 /
0.076 ms to 0.599 / 0.602 / 0.076 (routed x, its gradient, a dense x); the step -0.4 ms (mxcXI) and
-0.8 ms (with quantized_expert_copies), within its noise. Read at each call
(tools/bench_quantize.py --mx and tools/bench_optim.py --mx-order sweep it);
``MOETRON_MX_GRID=rows-first|cols-first`` at import sets it for a process."""


@triton.jit
def tile_ids(C, TC: tl.constexpr, COLS_FIRST: tl.constexpr):
    """(pid_p, pid_c): this program's block of 32 rows and its tile of TC columns, in the order of
    ``tile_grid`` (GRID_COLS_FIRST's)."""
    if COLS_FIRST:
        n_c = tl.cdiv(C, TC)
        pid = tl.program_id(0)
        pid_p = pid // n_c
        pid_c = pid % n_c
    else:
        pid_p = tl.program_id(0)
        pid_c = tl.program_id(1)
    return pid_p, pid_c


def tile_grid(n_p: int, n_c: int, cols_first: bool) -> tuple:
    """The launch grid of ``n_p`` row blocks x ``n_c`` column tiles that ``tile_ids`` reads."""
    return (n_p * n_c,) if cols_first else (n_p, n_c)


TILES = {"both": _both_tile(os.environ.get("MOETRON_MX_BOTH_TILE", "128,4,tile-codes"))}
"""mx_rows_and_cols_triton's tile: 32 rows (one block of the columns output) x ``cols`` columns
(cols / 32 blocks of the rows output), ``num_warps`` warps, and ``codes_from_tile`` (absent: False):
the payload's E8M0 codes stored from the tile's own layout (the kernel's CODES_FROM_TILE) instead of
through shared memory one byte at a time. The default, 128 columns on 4 warps with the codes from the
tile, since session 23: the same bytes; on the H200 the routed x's payload form 0.614 -> 0.594 ms
(OLMoE-8L's [131072, 2048]), the step within noise (210.9 against 211.1 ms; docs/performance.md).
Read at each call (tools/bench_quantize.py --mx sweeps it); ``MOETRON_MX_BOTH_TILE=cols,warps[,tile-codes]`` at import sets the tile for a whole process."""


@triton.jit
def round_to_e4m3(q):
    """Round fp32 |q| <= 448 to the nearest E4M3 value, ties to even, in fp32 (so the final cast is
    exact whatever the conversion's own rounding, and the interpreter agrees with the GPU)."""
    bits = q.to(tl.int32, bitcast=True)
    # normal E4M3 (|q| >= 2^-6): keep 3 mantissa bits of the fp32 value, round half to even
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & ~0xFFFFF).to(tl.float32, bitcast=True)
    # subnormal E4M3 (|q| < 2^-6): multiples of 2^-9; adding 1.5 * 2^14 (whose ulp is 2^-9) rounds
    # to nearest even, and subtracting it back is exact
    magic = 24576.0
    sub = (tl.abs(q) + magic) - magic  # >= 0; the caller sets the sign
    return tl.where(tl.abs(q) >= 0.015625, normal, sub)


@triton.jit
def mx_exponent(amax, FLOOR: tl.constexpr):
    """The block scale's unbiased exponent from fp32 amax >= 0, clamped to [-127, 127], -127 for a
    zero block: floor(log2 amax) - 8 (FLOOR) or ceil(log2(amax / 448)) from the bits."""
    if FLOOR:
        bits = amax.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 - 8  # floor(log2 amax) - floor(log2 448); subnormal amax clamps anyway
    else:
        bits = (amax / 448.0).to(tl.int32, bitcast=True)
        field, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        e_normal = field - 127 + (mantissa != 0).to(tl.int32)
        e_subnormal = tl.where(mantissa > (1 << 22), -126, -127)  # d = mantissa * 2^-149 > 2^-127 ?
        e = tl.where(field == 0, e_subnormal, e_normal)
    e = tl.where(amax > 0, e, -127)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def exp2_int(e):
    """fp32 2^e for int32 e in [-127, 127], from its bits (2^-127 is the subnormal 1 << 22)."""
    return tl.where(e == -127, 1 << 22, (e + 127) << 23).to(tl.float32, bitcast=True)


def as_loadable(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(what to pass the kernel for x, IN_BF16): a bf16 tensor goes as its int16 view (load_fp32)."""
    return (x.view(torch.int16), True) if x.dtype == torch.bfloat16 else (x, False)


@triton.jit
def signed_e4m3(x, inv, HW: tl.constexpr):
    """x * inv saturated to +-448 and rounded to E4M3, nearest even (fp32 values, x's sign, -0.0
    kept). HW: by the GPU's conversion instruction (cvt.rn, a round trip through e4m3), else by
    bits (round_to_e4m3; the sign from x's bits, as negation may lower to 0 - q and lose -0.0) for
    the interpreter, whose own conversion rounds differently. The same values either way."""
    y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
    if HW:
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
    else:
        sign = x.to(tl.int32, bitcast=True) & (-2147483648)
        q = (tl.abs(round_to_e4m3(y)).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return q


@triton.jit
def abs_bits(bits, IN_BF16: tl.constexpr):
    """|x|'s bits as int32 from the loaded bits (a bf16's int16, else fp32 values), ordered as |x|
    is, with inf above every finite value and NaN above inf: an integer max gives a block's amax
    and whether it holds inf or NaN in one pass (no float compare, no NaN count)."""
    if IN_BF16:
        a = bits.to(tl.int32) & 0x7FFF
    else:
        a = bits.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return a


@triton.jit
def amax_of_bits(amax_bits, IN_BF16: tl.constexpr):
    """(amax fp32, finite) of blocks whose largest abs_bits is ``amax_bits``: finite is False for a
    block holding inf or NaN."""
    if IN_BF16:
        amax_bits = amax_bits.to(tl.int32)
        amax = (amax_bits << 16).to(tl.float32, bitcast=True)
        finite = amax_bits < 0x7F80
    else:
        amax = amax_bits.to(tl.float32, bitcast=True)
        finite = amax_bits < 0x7F800000
    return amax, finite


@triton.jit
def widen(bits, IN_BF16: tl.constexpr, HW: tl.constexpr):
    """The loaded bits as fp32 values: HW, the GPU's bf16 -> fp32 conversion (exact); else by bits
    (widen_fp32: the interpreter's conversion flushes subnormals)."""
    if HW and IN_BF16:
        x = bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        x = widen_fp32(bits, IN_BF16)
    return x


@triton.jit
def to_e4m3(x, inv, HW: tl.constexpr):
    """x * inv as e4m3, nearest even, saturated to +-448, NaN to e4m3's NaN. HW: the GPU's one
    conversion (cvt.rn.satfinite saturates inf and overflow and keeps NaN NaN: nothing around
    it); else by bits (signed_e4m3, then NaN set by bits: the interpreter's own conversion of NaN
    differs)."""
    if HW:
        q = (x * inv).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        r = signed_e4m3(x, inv, HW)
        q8 = tl.where(x == x, r, 0.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        q = tl.where(x == x, q8, 0x7F).to(tl.float8e4nv, bitcast=True)
    return q


@triton.jit
def _tile(pid_p, pid_c, ALONG_C: tl.constexpr, TP: tl.constexpr, TC: tl.constexpr):
    """A program's elements (p rows, c columns, i block ids). ALONG_C: [TP * TC / 32, 32], block i
    is row p[i], columns c[i, :]; else [32, TC], one block per column."""
    i = tl.arange(0, TP * (TC // 32))
    if ALONG_C:
        p = pid_p * TP + i // (TC // 32)
        c = pid_c * TC + (i % (TC // 32))[:, None] * 32 + tl.arange(0, 32)[None, :]
    else:
        p = pid_p * 32 + tl.arange(0, 32)
        c = pid_c * TC + tl.arange(0, TC)[None, :]
    return p, c, i


@triton.jit
def _view_rows(src_ptr, p, P, R, GATHER: tl.constexpr):
    """(source row, valid) of view rows p: x[src[p]] (GATHER; zeros where src[p] < 0), else x[p] (zeros past R)."""
    if GATHER:
        src = tl.load(src_ptr + p, mask=p < P, other=-1)
        valid = src >= 0
    else:
        src = p
        valid = p < R
    return src, valid


@triton.jit
def _mx_quantize_kernel(
    x_ptr, src_ptr, out_ptr, data_ptr, scale_ptr, P, R, C,
    s_xp, s_xc, s_op, s_oc, s_dp, s_dc, s_sp, s_sc,
    ALONG_C: tl.constexpr, GATHER: tl.constexpr, WRITE_OUT: tl.constexpr, WRITE_PAYLOAD: tl.constexpr,
    FLOOR: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr, TP: tl.constexpr, TC: tl.constexpr,
    HW: tl.constexpr, LEAN_MATH: tl.constexpr,
):
    pid_p, pid_c = tl.program_id(0), tl.program_id(1)
    p, c, i = _tile(pid_p, pid_c, ALONG_C, TP, TC)
    p2 = p[:, None]
    src, valid = _view_rows(src_ptr, p, P, R, GATHER)
    mask = (p2 < P) & (c < C)
    if LEAN_MATH:
        bits = tl.load(x_ptr + src[:, None].to(tl.int64) * s_xp + c * s_xc, mask=mask & valid[:, None], other=0)
        x = widen(bits, IN_BF16, HW)
        if ALONG_C:
            amax, finite = amax_of_bits(tl.max(abs_bits(bits, IN_BF16), axis=1), IN_BF16)
        else:
            amax, finite = amax_of_bits(tl.max(abs_bits(bits, IN_BF16), axis=0), IN_BF16)
    else:
        x = load_fp32(x_ptr + src[:, None].to(tl.int64) * s_xp + c * s_xc, mask & valid[:, None], IN_BF16)
        # max ignores NaN on the GPU: look for them apart
        if ALONG_C:
            amax = tl.max(tl.abs(x), axis=1)
            finite = (tl.max((x != x).to(tl.int32), axis=1) == 0) & (amax < float("inf"))
        else:
            amax = tl.max(tl.abs(x), axis=0)
            finite = (tl.max((x != x).to(tl.int32), axis=0) == 0) & (amax < float("inf"))
    e = mx_exponent(amax, FLOOR)
    code = tl.where(finite, e + 127, 255)
    e = tl.where(finite, e, 0)  # a NaN-scale block dequantizes to NaN: its data bits are unspecified
    if ALONG_C:
        e2, finite2 = e[:, None], finite[:, None]
    else:
        e2, finite2 = e[None, :], finite[None, :]
    if LEAN_MATH:
        q8 = to_e4m3(x, exp2_int(-e2), HW)
        q = q8.to(tl.float32)
    else:
        q = signed_e4m3(x, exp2_int(-e2), HW)
        q8 = q.to(tl.float8e4nv)
    if WRITE_OUT:
        deq = tl.where(finite2, q * exp2_int(e2), float("nan"))
        out_ptrs = out_ptr + p2.to(tl.int64) * s_op + c * s_oc
        if LEAN_MATH and HW and OUT_BF16:  # the GPU's conversion rounds to nearest even, as torch's cast
            tl.store(out_ptrs, deq.to(tl.bfloat16), mask=mask)
        else:
            store_rounded(out_ptrs, deq, mask, OUT_BF16)
    if WRITE_PAYLOAD:
        tl.store(data_ptr + p2.to(tl.int64) * s_dp + c * s_dc, q8, mask=mask)
        if ALONG_C:
            b = pid_c * (TC // 32) + i % (TC // 32)
            # A last tile past the row's end must not write its empty blocks' codes into the next row.
            tl.store(scale_ptr + p.to(tl.int64) * s_sp + b * s_sc, code.to(tl.uint8), mask=(p < P) & (b * 32 < C))
        else:
            cc = pid_c * TC + tl.arange(0, TC)
            tl.store(scale_ptr + pid_p.to(tl.int64) * s_sp + cc * s_sc, code.to(tl.uint8), mask=cc < C)


@triton.jit
def lean_block_scale(amax_bits, FLOOR: tl.constexpr, IN_BF16: tl.constexpr):
    """(exponent, E8M0 code, finite) of blocks whose largest abs_bits is ``amax_bits`` (the lean
    arithmetic: a NaN-scale block's exponent is 0, its data unspecified)."""
    amax, finite = amax_of_bits(amax_bits, IN_BF16)
    e = mx_exponent(amax, FLOOR)
    code = tl.where(finite, e + 127, 255)
    return tl.where(finite, e, 0), code, finite


@triton.jit
def lean_qdq(x, e, finite, HW: tl.constexpr):
    """(e4m3 data, dequantized fp32) of fp32 x in blocks of exponent e (broadcast to x)."""
    q8 = to_e4m3(x, exp2_int(-e), HW)
    return q8, tl.where(finite, q8.to(tl.float32) * exp2_int(e), float("nan"))


@triton.jit
def store_bf16(ptrs, v, mask, HW: tl.constexpr):
    """fp32 v stored as bf16, nearest even (the GPU's conversion; by bits under the interpreter)."""
    if HW:
        tl.store(ptrs, v.to(tl.bfloat16), mask=mask)
    else:
        store_rounded(ptrs, v, mask, True)


@triton.jit
def lean_rows_qdq(x, a, FLOOR: tl.constexpr, IN_BF16: tl.constexpr, HW: tl.constexpr, TC: tl.constexpr):
    """A [32, TC] tile quantized along its rows (blocks of 32 columns) and dequantized, fp32 (the
    lean arithmetic): ``x`` its values, ``a`` their abs_bits."""
    NB: tl.constexpr = TC // 32
    e_r, _, fin_r = lean_block_scale(tl.max(tl.reshape(a, (32, NB, 32)), axis=2), FLOOR, IN_BF16)
    e_r = tl.reshape(tl.broadcast_to(e_r[:, :, None], (32, NB, 32)), (32, TC))
    fin_r = tl.reshape(tl.broadcast_to(fin_r[:, :, None], (32, NB, 32)), (32, TC))
    _, deq_r = lean_qdq(x, e_r, fin_r, HW)
    return deq_r


@triton.jit
def _mx_rows_and_cols_kernel(
    x_ptr, src_ptr, end_ptr, rows_ptr, cols_ptr, data_ptr, scale_ptr, P, R, C,
    s_xp, s_xc, s_rp, s_rc, s_cp, s_cc, s_dp, s_dc, s_sp, s_sc,
    TAIL: tl.constexpr, GATHER: tl.constexpr, COLS_PAYLOAD: tl.constexpr, FLOOR: tl.constexpr,
    IN_BF16: tl.constexpr, HW: tl.constexpr, TC: tl.constexpr, CODES_FROM_TILE: tl.constexpr,
    COLS_FIRST: tl.constexpr,
):
    """One [32, TC] tile of x read once, quantized both ways (the lean arithmetic): along C (blocks
    of 32 in each row) to the bf16 rows output at the source rows, and along the 32 rows (one block
    per column) to the columns output at the view's rows: e4m3 + E8M0 (COLS_PAYLOAD) or bf16.
    GATHER: view row p is x[src[p]] (zeros where src[p] < 0). TAIL: the program covers source rows
    32 * pid .. and writes only the rows output of rows from ends[-1] on (rows past the last group,
    which no view row reads); programs whose rows all lie before it return at once. CODES_FROM_TILE:
    the columns' E8M0 codes stored from the tile's own layout by its first row's threads, not
    converted through shared memory byte by byte (TILES["both"]["codes_from_tile"]; the same bytes).
    COLS_FIRST: the tiles' order (GRID_COLS_FIRST)."""
    pid_p, pid_c = tile_ids(C, TC, COLS_FIRST)
    c = pid_c * TC + tl.arange(0, TC)[None, :]
    p = pid_p * 32 + tl.arange(0, 32)
    if TAIL:
        end = tl.load(end_ptr).to(tl.int32)
        if pid_p * 32 + 32 <= end:
            return
        src = p
        valid = (p >= end) & (p < R)
    else:
        src, valid = _view_rows(src_ptr, p, P, R, GATHER)
    cmask = c < C
    bits = tl.load(x_ptr + src[:, None].to(tl.int64) * s_xp + c * s_xc, mask=valid[:, None] & cmask, other=0)
    x = widen(bits, IN_BF16, HW)
    a = abs_bits(bits, IN_BF16)
    deq_r = lean_rows_qdq(x, a, FLOOR, IN_BF16, HW, TC)
    store_bf16(rows_ptr + src[:, None].to(tl.int64) * s_rp + c * s_rc, deq_r, valid[:, None] & cmask, HW)
    if not TAIL:
        e_c, code_c, fin_c = lean_block_scale(tl.max(a, axis=0), FLOOR, IN_BF16)
        q8, deq_c = lean_qdq(x, e_c[None, :], fin_c[None, :], HW)
        pmask = (p[:, None] < P) & cmask
        if COLS_PAYLOAD:
            tl.store(data_ptr + p[:, None].to(tl.int64) * s_dp + c * s_dc, q8, mask=pmask)
            if CODES_FROM_TILE:
                codes = tl.broadcast_to(code_c[None, :], (32, TC)).to(tl.uint8)
                first = (tl.arange(0, 32) == 0)[:, None]
                tl.store(scale_ptr + pid_p.to(tl.int64) * s_sp + (c + 0 * p[:, None]) * s_sc, codes,
                         mask=first & cmask)
            else:
                cc = pid_c * TC + tl.arange(0, TC)
                tl.store(scale_ptr + pid_p.to(tl.int64) * s_sp + cc * s_sc, code_c.to(tl.uint8), mask=cc < C)
        else:
            store_bf16(cols_ptr + p[:, None].to(tl.int64) * s_cp + c * s_cc, deq_c, pmask, HW)


@triton.jit
def _mx_dequantize_kernel(data_ptr, scale_ptr, out_ptr, P, C, s_dp, s_dc, s_sp, s_sc, s_op, s_oc,
                          ALONG_C: tl.constexpr, OUT_BF16: tl.constexpr, TP: tl.constexpr, TC: tl.constexpr):
    pid_p, pid_c = tl.program_id(0), tl.program_id(1)
    p, c, i = _tile(pid_p, pid_c, ALONG_C, TP, TC)
    if ALONG_C:
        b = pid_c * (TC // 32) + i % (TC // 32)
        code = tl.load(scale_ptr + p.to(tl.int64) * s_sp + b * s_sc, mask=(p < P) & (b * 32 < C), other=0)
        code2 = code.to(tl.int32)[:, None]
    else:
        code = tl.load(scale_ptr + pid_p.to(tl.int64) * s_sp + c * s_sc, mask=c < C, other=0)
        code2 = code.to(tl.int32)
    p2 = p[:, None]
    mask = (p2 < P) & (c < C)
    d = tl.load(data_ptr + p2.to(tl.int64) * s_dp + c * s_dc, mask=mask, other=0.0).to(tl.float32)
    deq = tl.where(code2 == 255, float("nan"), d * exp2_int(tl.where(code2 == 255, 127, code2) - 127))
    store_rounded(out_ptr + p2.to(tl.int64) * s_op + c * s_oc, deq, mask, OUT_BF16)


def _check(x: torch.Tensor, axis: int, block: int, scale_mode: str, rows: int) -> int:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if x.dim() != 2 or block != MX_BLOCK:
        raise ValueError(f"the Triton MX kernels take 2-D tensors and blocks of {MX_BLOCK}; use quantize_mx")
    axis = axis % 2
    n = rows if axis == 0 else x.shape[1]
    if n % block:
        raise ValueError(f"MX blocks of {block} must divide the quantized dimension (axis {axis}, size {n}): "
                         f"pad it to a multiple of {block}")
    assert E4M3_MAX == 448.0  # the kernels' clamp
    return axis


def _launch(x, axis, scale_mode, src_rows, out_dtype, payload):
    P = x.shape[0] if src_rows is None else src_rows.numel()
    C = x.shape[1]
    axis = _check(x, axis, MX_BLOCK, scale_mode, P)
    dev = x.device
    out = torch.empty(P, C, dtype=out_dtype, device=dev) if out_dtype is not None else None
    data = scale = None
    if payload:
        data = torch.empty(P, C, dtype=torch.float8_e4m3fn, device=dev)
        scale = torch.empty((P, C // MX_BLOCK) if axis == 1 else (P // MX_BLOCK, C), dtype=torch.uint8, device=dev)
    TP, TC = _ROWS_TILE if axis == 1 else _COLS_TILE
    grid = (triton.cdiv(P, TP if axis == 1 else MX_BLOCK), triton.cdiv(C, TC))
    dummy = x  # pointers the kernel never touches
    o, d, s = (out if out is not None else dummy), (data if payload else dummy), (scale if payload else dummy)
    xk, in_bf16 = as_loadable(x)
    _mx_quantize_kernel[grid](
        xk, src_rows if src_rows is not None else dummy, o, d, s, P, x.shape[0], C,
        x.stride(0), x.stride(1), o.stride(0), o.stride(1), d.stride(0), d.stride(1), s.stride(0), s.stride(1),
        ALONG_C=axis == 1, GATHER=src_rows is not None, WRITE_OUT=out is not None, WRITE_PAYLOAD=payload,
        FLOOR=scale_mode == "floor", IN_BF16=in_bf16, OUT_BF16=out_dtype == torch.bfloat16, TP=TP, TC=TC,
        HW=HW_CONVERT, LEAN_MATH=LEAN, num_warps=4,
    )
    return out, data, scale


def quantize_mx_triton(x: torch.Tensor, block: int = MX_BLOCK, axis: int = -1, scale_mode: str = "rceil",
                       src_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_mx for a 2-D x [P, C] (axis 0 or -1/1), on the GPU (or under TRITON_INTERPRET=1).
    ``src_rows`` (int32 [P], -1 for a zero row): quantize x[src_rows] without making it."""
    if block != MX_BLOCK:
        raise ValueError(f"the Triton MX kernels take blocks of {MX_BLOCK}; use quantize_mx")
    _, data, scale = _launch(x, axis, scale_mode, src_rows, None, True)
    return data, scale


def mx_qdq_triton(x: torch.Tensor, axis: int = -1, scale_mode: str = "rceil", out_dtype: torch.dtype = torch.bfloat16,
                  src_rows: torch.Tensor | None = None, payload: bool = False):
    """dequantize_mx(quantize_mx(x, axis)) in ``out_dtype`` for a 2-D x, one read and one write
    (``src_rows`` as quantize_mx_triton's). With ``payload`` -> (out, data, scale), else out."""
    out, data, scale = _launch(x, axis, scale_mode, src_rows, out_dtype, payload)
    return (out, data, scale) if payload else out


def mx_rows_and_cols_triton(x: torch.Tensor, src_rows: torch.Tensor | None = None, ends: torch.Tensor | None = None,
                            scale_mode: str = "rceil", cols_payload: bool = True):
    """Both quantizations a GEMM's operand needs, from one read of the 2-D x [R, C]:
    ``(rows, *cols)`` with rows = mx_qdq_triton(x, -1) (bf16 [R, C]) and cols, of the view
    x[src_rows] (x itself without ``src_rows``; rows padded with zeros to a multiple of 32), along
    axis 0: ``(data, scale)`` = quantize_mx_triton (``cols_payload``) or its bf16 quantize-dequantize.
    With ``src_rows`` (grouping.padded_source_rows), ``ends`` is the groups' inclusive cumsum on the
    device: rows from ends[-1] on belong to no group, and a second, mostly empty launch quantizes
    them for ``rows`` (no host sync). The same bits as the separate calls (the lean arithmetic)."""
    R, C = x.shape
    P = src_rows.numel() if src_rows is not None else -(-R // MX_BLOCK) * MX_BLOCK
    _check(x, -1, MX_BLOCK, scale_mode, R)
    _check(x, 0, MX_BLOCK, scale_mode, P)
    if src_rows is not None and ends is None:
        raise ValueError("mx_rows_and_cols_triton: src_rows needs ends (the groups' inclusive cumsum)")
    dev = x.device
    rows = torch.empty(R, C, dtype=torch.bfloat16, device=dev)
    if cols_payload:
        data = torch.empty(P, C, dtype=torch.float8_e4m3fn, device=dev)
        scale = torch.empty(P // MX_BLOCK, C, dtype=torch.uint8, device=dev)
        cols = data
    else:
        cols = torch.empty(P, C, dtype=torch.bfloat16, device=dev)
        data = scale = cols  # pointers the kernel never touches
    xk, in_bf16 = as_loadable(x)
    src = src_rows if src_rows is not None else rows
    end = ends[-1:] if ends is not None else rows
    tile = TILES["both"]
    TC, warps = tile["cols"], tile["num_warps"]
    strides = (x.stride(0), x.stride(1), rows.stride(0), rows.stride(1), cols.stride(0), cols.stride(1),
               data.stride(0), data.stride(1), scale.stride(0), scale.stride(1))
    common = dict(COLS_PAYLOAD=cols_payload, FLOOR=scale_mode == "floor", IN_BF16=in_bf16, HW=HW_CONVERT, TC=TC,
                  CODES_FROM_TILE=bool(tile.get("codes_from_tile", False)), COLS_FIRST=GRID_COLS_FIRST,
                  num_warps=warps)
    if P and C:
        _mx_rows_and_cols_kernel[tile_grid(P // MX_BLOCK, triton.cdiv(C, TC), GRID_COLS_FIRST)](
            xk, src, end, rows, cols, data, scale, P, R, C, *strides, TAIL=False, GATHER=src_rows is not None, **common)
    if src_rows is not None and R and C:
        _mx_rows_and_cols_kernel[tile_grid(triton.cdiv(R, MX_BLOCK), triton.cdiv(C, TC), GRID_COLS_FIRST)](
            xk, src, end, rows, cols, data, scale, P, R, C, *strides, TAIL=True, GATHER=False, **common)
    return (rows, data, scale) if cols_payload else (rows, cols)


def dequantize_mx_triton(data: torch.Tensor, scale: torch.Tensor, block: int = MX_BLOCK, axis: int = -1,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """dequantize_mx for 2-D data, in ``out_dtype`` (as the reference's fp32 result cast to it)."""
    axis = _check(data, axis, block, "rceil", data.shape[0])
    P, C = data.shape
    want = (P, C // block) if axis == 1 else (P // block, C)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale of shape {tuple(scale.shape)} does not match data {tuple(data.shape)} in "
                         f"blocks of {block} along axis {axis}")
    out = torch.empty(P, C, dtype=out_dtype, device=data.device)
    TP, TC = _ROWS_TILE if axis == 1 else _COLS_TILE
    grid = (triton.cdiv(P, TP if axis == 1 else MX_BLOCK), triton.cdiv(C, TC))
    _mx_dequantize_kernel[grid](data, scale, out, P, C, data.stride(0), data.stride(1), scale.stride(0),
                                scale.stride(1), out.stride(0), out.stride(1), ALONG_C=axis == 1,
                                OUT_BF16=out_dtype == torch.bfloat16, TP=TP, TC=TC,
                                num_warps=4)
    return out
