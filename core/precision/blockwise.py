"""FP8 blockwise quantization (DeepSeek-V3 / Transformer Engine's Float8BlockScaling): FP8 E4M3
elements with one fp32 power-of-two scale per 1 x 128 tile (activations and gradients, 128
consecutive elements along the GEMM's reduction dim) or per 128 x 128 tile (weights, which then
serve the forward and the dgrad GEMM alike: a 128 x 128 tile of w is one of w^T).

    data, scale = quantize_1x128(x, axis=-1)      # e4m3 [x.shape], fp32 [x.shape, axis / 128]
    data, scale = quantize_128x128(w)             # e4m3 [..., O, I], fp32 [..., O / 128, I / 128]
    x_hat = dequantize_1x128(data, scale, axis=-1)

The scale is 2^ceil(log2(amax / 448)) (the MX "rceil" exponent, computed exactly from the bits,
clamped to [2^-127, 2^127]), so amax / scale <= 448 and nothing saturates but through rounding;
scaling by a power of two is exact, the only rounding is the cast to E4M3. Because the scales are
powers of two, data x scale is exact in bf16: a bf16 GEMM on dequantized operands gives the FP8
GEMM's products (the emulation and the reference of the Triton kernel).

This is not MXFP8 (blocks of 128, fp32 scales, 2-D weight tiles) and is never reported as such.

Legend: N elements along the axis, B = N / 128 tiles.
"""

from __future__ import annotations

import torch

from .mx import E4M3_MAX, mx_scale_codes

__all__ = ["FP8_BLOCK", "dequantize_128x128", "dequantize_1x128", "pow2_scale", "quantize_128x128", "quantize_1x128"]

FP8_BLOCK = 128


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 2^ceil(log2(amax / 448)) (clamped to [2^-127, 2^127]; 2^-127 for zero blocks)."""
    codes = mx_scale_codes(amax, "rceil").to(torch.int32)
    codes = torch.where(codes == 255, 127, codes)  # non-finite blocks: any scale (their data is NaN)
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), codes - 127)


def _to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_1x128(x: torch.Tensor, axis: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any float dtype) -> (data e4m3 of x's shape, scale fp32 of x's shape with ``axis`` / 128)."""
    axis = axis % x.dim()
    xm = x.movedim(axis, -1).to(torch.float32)
    n = xm.shape[-1]
    if n % FP8_BLOCK:
        raise ValueError(f"fp8 1x128 tiles must divide the quantized dimension (axis {axis}, size {n}): "
                         f"pad it to a multiple of {FP8_BLOCK}")
    x_BK = xm.reshape(*xm.shape[:-1], n // FP8_BLOCK, FP8_BLOCK)
    scale_B1 = pow2_scale(x_BK.abs().amax(-1, keepdim=True))
    data = _to_e4m3(x_BK, scale_B1).reshape(xm.shape).movedim(-1, axis)
    return data, scale_B1.squeeze(-1).movedim(-1, axis)


def dequantize_1x128(data: torch.Tensor, scale: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """quantize_1x128's inverse: float32 of data's shape."""
    return (data.to(torch.float32) * scale.repeat_interleave(FP8_BLOCK, dim=axis % data.dim()))


def _tiles(w: torch.Tensor) -> torch.Tensor:
    *lead, O, I = w.shape
    if O % FP8_BLOCK or I % FP8_BLOCK:
        raise ValueError(f"fp8 128x128 weight tiles must divide both dims of the weight {tuple(w.shape)}: "
                         f"make them multiples of {FP8_BLOCK}")
    return w.to(torch.float32).reshape(*lead, O // FP8_BLOCK, FP8_BLOCK, I // FP8_BLOCK, FP8_BLOCK)


def quantize_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., O, I] -> (data e4m3 [..., O, I], scale fp32 [..., O / 128, I / 128])."""
    w_t = _tiles(w)
    scale = pow2_scale(w_t.abs().amax(dim=(-3, -1), keepdim=True))
    data = _to_e4m3(w_t, scale).reshape(w.shape)
    return data, scale.squeeze(-1).squeeze(-2)


def dequantize_128x128(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """quantize_128x128's inverse: float32 [..., O, I]."""
    full = scale.repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    return data.to(torch.float32) * full
