"""Triton MX quantization: the GPU path of mx.quantize_mx, with the same signature and results.

One program quantizes ROWS x 32 elements: ROWS rows of a 2-D view, one 32-element block each, read
with the view's strides, so blocks along the last dim (row-wise, x [M, K]) and along the first dim
(column-wise, the same x for its transpose's GEMM) are the same kernel without a copy. The scale
exponent comes from the bits of amax (floor) or of amax / 448 (rceil, exact ceil); scaling is by an
exact power of two built from bits; the only rounding is the hardware's fp32 -> e4m3 conversion
(round to nearest even, saturating).

Legend: M rows, K the quantized dim (blocks of 32 along it), B = K / 32 blocks per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mx import E4M3_MAX, MX_BLOCK, SCALE_MODES

__all__ = ["quantize_mx_triton"]


@triton.jit
def _round_to_e4m3(q):
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
def _mx_quantize_kernel(
    x_ptr, data_ptr, scale_ptr, M, B,
    stride_xm, stride_xk, stride_dm, stride_dk, stride_sm, stride_sb,
    FLOOR: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid_m, b = tl.program_id(0), tl.program_id(1)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < M)[:, None]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # max ignores NaN on the GPU: look for them apart
    finite = (tl.max((x != x).to(tl.int32), axis=1) == 0) & (amax < float("inf"))
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
    e = tl.minimum(tl.maximum(e, -127), 127)
    code = tl.where(finite, e + 127, 255)
    e = tl.where(finite, e, 0)  # a NaN-scale block dequantizes to NaN: its data bits are unspecified
    # 2^-e from its bits: exponent field 127 - e in [0, 254]; 0 (e = 127) is the subnormal 2^-127.
    inv_bits = tl.where(e == 127, 1 << 22, (127 - e) << 23)
    inv = inv_bits.to(tl.float32, bitcast=True)
    q = _round_to_e4m3(tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0))
    # the sign bit from x's own bits, set by bits (negation may lower to 0 - q, which loses -0.0)
    sign = x.to(tl.int32, bitcast=True) & (-2147483648)
    q = (tl.abs(q).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    tl.store(data_ptr + rows[:, None] * stride_dm + cols[None, :] * stride_dk, q.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + rows * stride_sm + b * stride_sb, code.to(tl.uint8), mask=rows < M)


def quantize_mx_triton(x: torch.Tensor, block: int = MX_BLOCK, axis: int = -1,
                       scale_mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_mx for a 2-D x (axis 0 or -1/1), on the GPU (or under TRITON_INTERPRET=1)."""
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if x.dim() != 2 or block != MX_BLOCK:
        raise ValueError(f"the Triton MX kernel takes 2-D tensors and blocks of {MX_BLOCK}; use quantize_mx")
    axis = axis % 2
    n = x.shape[axis]
    if n % block:
        raise ValueError(f"MX blocks of {block} must divide the quantized dimension (axis {axis}, size {n}): "
                         f"pad it to a multiple of {block}")
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale_shape = (x.shape[0] // block, x.shape[1]) if axis == 0 else (x.shape[0], x.shape[1] // block)
    scale = torch.empty(scale_shape, dtype=torch.uint8, device=x.device)
    # A [M, K] view with the blocks along K: the tensor itself (axis 1) or its transpose (axis 0).
    xv, dv, sv = (x, data, scale) if axis == 1 else (x.t(), data.t(), scale.t())
    M, B = xv.shape[0], xv.shape[1] // block
    rows = 32
    grid = (triton.cdiv(M, rows), B)
    _mx_quantize_kernel[grid](
        xv, dv, sv, M, B, xv.stride(0), xv.stride(1), dv.stride(0), dv.stride(1), sv.stride(0), sv.stride(1),
        FLOOR=scale_mode == "floor", ROWS=rows, BLOCK=block,
    )
    assert E4M3_MAX == 448.0  # the kernel's clamp
    return data, scale
