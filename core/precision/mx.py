"""MX (OCP Microscaling v1.0) quantization: FP8 E4M3 elements, one E8M0 power-of-two scale per 32
consecutive elements along a chosen axis (the GEMM's reduction dim). The torch reference here is
what the CPU runs and what any kernel is tested against.

    data, scale = quantize_mx(x, block=32, axis=-1, scale_mode="rceil")
    x_hat = dequantize_mx(data, scale, block=32, axis=-1)        # float32, = data * 2^(scale - 127)

``data`` is float8_e4m3fn of x's shape; ``scale`` is uint8 E8M0 codes of x's shape with the axis
dimension divided by ``block`` (natural layout; swizzled layouts are separate functions).

Scale modes (X is the block's scale, amax the largest |x| of the block, in fp32):

- ``floor`` (the OCP spec): X = 2^(floor(log2 amax) - 8), 8 = floor(log2 448) being E4M3's largest
  power of two, so amax / X lies in [256, 512): elements are x / X rounded to nearest even and
  saturated to +-448 (the top of the range clips);
- ``rceil`` (NVIDIA's and torchao's): X = 2^ceil(log2(amax / 448)), so amax / X <= 448: nothing
  saturates except through rounding; the exponent is computed exactly from the bits of amax / 448
  (as the hardware's round-to-+inf conversion does), not through a float log2.

Special blocks: an all-zero block (and one whose amax is below 2^-127 x the mode's offset) gets the
smallest scale, code 0 = 2^-127; exponents clamp to E8M0's [-127, 127]; a block holding a NaN or an
infinity gets the NaN scale, code 255, and dequantizes to NaN everywhere (E4M3 has no infinity, and
no finite scale stands for one; the data bits of such a block are unspecified). Scaling is by exact powers of two; the only rounding is the one
cast to E4M3 (torch's round-to-nearest-even, subnormals included).

The Triton kernel (mx_triton.quantize_mx_triton: 2-D, rows or columns) gives the same bits; tests
run it under TRITON_INTERPRET=1 on the CPU and on the GPU.

Legend: N elements along the axis, B = N / block blocks, K = block.
"""

from __future__ import annotations

import torch

__all__ = ["E4M3_MAX", "E8M0_BIAS", "E8M0_NAN", "MX_BLOCK", "dequantize_mx", "quantize_mx", "mx_scale_codes",
           "mx_scaled", "swizzle_mx_scales"]

MX_BLOCK = 32
E4M3_MAX = 448.0
E4M3_MAX_POW2 = 8
"""floor(log2(448)): the exponent of E4M3's largest power of two."""
E8M0_BIAS = 127
E8M0_NAN = 255
SCALE_MODES = ("rceil", "floor")


def _exponent(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For fp32 v >= 0: (e, exact) with v = m * 2^e, m in [1, 2) for normal v; ``exact`` where v is a
    power of two. Zero and subnormals give e <= -127 (clamped later)."""
    mantissa, e = torch.frexp(v)  # v = mantissa * 2^e, mantissa in [0.5, 1), exact for subnormals
    return e.to(torch.int32) - 1, mantissa == 0.5


def mx_scale_codes(amax_B: torch.Tensor, scale_mode: str = "rceil") -> torch.Tensor:
    """E8M0 codes (uint8) of the blocks' scales from their fp32 amax (see the module docstring)."""
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    amax_B = amax_B.to(torch.float32)
    if scale_mode == "floor":
        e, _ = _exponent(amax_B)
        unbiased = e - E4M3_MAX_POW2
    else:
        e, exact = _exponent(amax_B / E4M3_MAX)
        unbiased = torch.where(exact, e, e + 1)  # ceil(log2 d) for d = m * 2^e, m in [1, 2)
    unbiased = torch.where(amax_B > 0, unbiased, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = (unbiased + E8M0_BIAS).to(torch.uint8)
    return torch.where(torch.isfinite(amax_B), codes, torch.full_like(codes, E8M0_NAN))


def _blocks(x: torch.Tensor, block: int, axis: int) -> torch.Tensor:
    """x moved so that ``axis`` is last and split into [..., B, K] (fp32)."""
    xm = x.movedim(axis, -1)
    n = xm.shape[-1]
    if n % block:
        raise ValueError(f"MX blocks of {block} must divide the quantized dimension (axis {axis}, size {n}): "
                         f"pad it to a multiple of {block}")
    return xm.to(torch.float32).reshape(*xm.shape[:-1], n // block, block)


def _pow2(codes: torch.Tensor, sign: int) -> torch.Tensor:
    """2^(sign * (code - 127)) in fp32, exact (ldexp of 1)."""
    exponent = sign * (codes.to(torch.int32) - E8M0_BIAS)
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)


def mx_scaled(x_BK: torch.Tensor, scale_mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks along the last dim of fp32 ``x_BK`` ([..., B, K]) -> (their E8M0 codes [..., B, 1], x_BK scaled by
    each block's 2^-(code - 127), fp32, exact; a NaN-scale block is left unscaled: any value will do, it
    dequantizes to NaN). quantize_mx rounds the scaled values to nearest; core.moments_q8 rounds a second
    moment's root stochastically instead."""
    codes_B1 = mx_scale_codes(x_BK.abs().amax(dim=-1, keepdim=True), scale_mode)
    return codes_B1, x_BK * _pow2(torch.where(codes_B1 == E8M0_NAN, E8M0_BIAS, codes_B1), -1)


def quantize_mx(x: torch.Tensor, block: int = MX_BLOCK, axis: int = -1,
                scale_mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """x (any float dtype) -> (data float8_e4m3fn of x's shape, scale uint8 E8M0 codes of x's shape
    with dim ``axis`` divided by ``block``)."""
    axis = axis % x.dim()
    codes_B1, scaled_BK = mx_scaled(_blocks(x, block, axis), scale_mode)
    data_BK = scaled_BK.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # saturate, then RNE
    moved = x.movedim(axis, -1).shape
    data = data_BK.reshape(moved).movedim(-1, axis)
    scale = codes_B1.squeeze(-1).movedim(-1, axis)
    return data, scale


def dequantize_mx(data: torch.Tensor, scale: torch.Tensor, block: int = MX_BLOCK, axis: int = -1) -> torch.Tensor:
    """(data float8_e4m3fn, scale uint8 E8M0 codes) -> float32 of data's shape: data x 2^(code - 127),
    NaN where the code is 255. Exact: every product is representable in fp32."""
    axis = axis % data.dim()
    d_BK = _blocks(data, block, axis)
    codes_B1 = scale.movedim(axis, -1).unsqueeze(-1)
    if codes_B1.shape[:-1] != d_BK.shape[:-1]:
        raise ValueError(f"scale of shape {tuple(scale.shape)} does not match data {tuple(data.shape)} in "
                         f"blocks of {block} along axis {axis}")
    out_BK = d_BK * _pow2(codes_B1, 1)
    out_BK = torch.where(codes_B1 == E8M0_NAN, torch.nan, out_BK)
    return out_BK.reshape(data.movedim(axis, -1).shape).movedim(-1, axis)


def swizzle_mx_scales(scale_MB: torch.Tensor) -> torch.Tensor:
    """Natural [M, B] scales (M rows, B = K / 32 blocks) -> the 128x4-tile layout Blackwell's MX GEMMs
    read (cuBLAS's "block scaling factors layout"; torch's SwizzleType.SWIZZLE_32_4_4): rows padded
    to a multiple of 128 and blocks to a multiple of 4 (with zeros), tiles of 128 rows x 4 blocks
    stored one after another row-major over the tiles, and inside a tile row r = 32 a + b, block c
    at byte 16 b + 4 a + c. Returns the flat [ceil(M/128) * 128 * ceil(B/4) * 4] tensor."""
    M, B = scale_MB.shape
    Mt, Bt = -(-M // 128), -(-B // 4)
    padded = scale_MB.new_zeros(Mt * 128, Bt * 4)
    padded[:M, :B] = scale_MB
    # (tile row i, a, b, tile col j, c) -> (i, j, b, a, c)
    return padded.view(Mt, 4, 32, Bt, 4).permute(0, 3, 2, 1, 4).reshape(-1)
