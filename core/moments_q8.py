"""Adam moments held in 8 bits (optimizer.state_dtype=q8): block-wise dynamic quantization, the torch reference.

The scheme is the published one of 8-bit optimizers (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", ICLR 2022): each block of ``QBLOCK`` consecutive elements along a tensor's last dim is divided
by its largest magnitude (kept in fp32), and the quotient r in [0, 1] is stored as one byte of a dynamic
code: a level by the decade r falls in, then a linear fraction whose width grows with the level, so that a
block's large values keep most bits and its small ones still keep a non-zero value down to 10^-LEVELS.

A byte's magnitude ``c`` (7 bits for the signed first moment, whose top bit is the sign; 8 for the second
moment, which is never negative) is read as: c = 0 is zero; otherwise level i = floor(log2 c) (the position
of its highest set bit, so level i has 2^i codes) and j = c - 2^i + 1 in [1, 2^i]; the value is

    10^(i - LEVELS + 1) * (0.1 + 0.9 * j / 2^i)        LEVELS = 7 signed, 8 unsigned

so level i spans (10^(i - LEVELS), 10^(i - LEVELS + 1)] in 2^i equal steps, its top is the next level's
floor (the code below a level's first is the level below's top), and the largest code is exactly 1: a
block's largest magnitude is kept exactly. Encoding rounds to the nearest code (ties up: a magnitude below
half the smallest non-zero code becomes 0). Relative error: under 0.8% near a block's largest magnitude, about 4.5
/ 2^i of the value at level i's floor.

Blocks run along the last dim only (a row's partial last block is its own block), so a tensor sharded on
any other dim (FSDP2's dim 0, expert parallel's expert dim) shards its scales with it: each scale lives
beside its rows, and a checkpoint reshards both alike.

Every step is written as fp32 operations in a fixed order (no fused multiply-add), so
core.adamw_triton's kernel encodes and decodes the same bytes and values bit for bit; the tests also check
the encoding against an independent float64 nearest-code search over the whole table.
"""

from __future__ import annotations

import torch

__all__ = ["LEVELS_SIGNED", "LEVELS_UNSIGNED", "QBLOCK", "codebook", "decode", "dequantize", "encode",
           "quantize_", "scale_shape"]

QBLOCK = 256
"""Elements of one quantization block along the last dim (the paper's block size for its optimizers)."""
LEVELS_SIGNED = 7
"""Decades of the first moment's code (7 magnitude bits under a sign bit): non-zero down to 10^-7."""
LEVELS_UNSIGNED = 8
"""Decades of the second moment's code (8 magnitude bits): non-zero down to 10^-8."""

INV_09 = 1 / 0.9
"""The encoding's 1 / 0.9 (rounded to fp32 where used, in both implementations)."""


def _f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _pow10(device: torch.device) -> torch.Tensor:
    """10^e for e in -8..8 as fp32 (index e + 8): the constants both implementations round from the same
    doubles."""
    return torch.tensor([10.0**e for e in range(-8, 9)], dtype=torch.float32, device=device)


def scale_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The fp32 scales' shape for a tensor of ``shape``: one per block of QBLOCK along the last dim."""
    if len(shape) == 0:
        return (1,)
    return (*shape[:-1], -(-shape[-1] // QBLOCK))


def encode(r: torch.Tensor, levels: int) -> torch.Tensor:
    """Magnitudes r (fp32, in [0, 1], a little above 1 allowed) -> codes (int32 in [0, 2^levels - 1]), the
    nearest code of the module docstring's table."""
    p10 = _pow10(r.device)
    count = torch.zeros(r.shape, dtype=torch.int32, device=r.device)
    for e in range(-levels, 0):
        count += r > p10[e + 8]
    i = (count - 1).clamp(min=0)
    pow2 = (1 << i).to(torch.float32)
    f = r * p10[(levels - count).clamp(max=8) + 8]  # r in level i times 10^(levels - 1 - i): in (0.1, 1]
    t = (f - _f32(0.1).to(r.device)) * pow2
    t = t * _f32(INV_09).to(r.device)
    lo = (1 << i) - 1
    c = (torch.floor(t + _f32(0.5).to(r.device)).to(torch.int32) + lo).clamp(min=lo, max=2 * lo + 1)
    c = torch.where(count == 1, (f >= _f32(0.5).to(r.device)).to(torch.int32), c)  # level 0: zero below it
    return torch.where(count == 0, 0, c)


def decode(c: torch.Tensor, levels: int) -> torch.Tensor:
    """Codes (integers in [0, 2^levels - 1]) -> their values (fp32 in [0, 1])."""
    c = c.to(torch.int32)
    i = torch.zeros_like(c)
    for k in range(1, levels):
        i += c >= (1 << k)
    pow2 = (1 << i).to(torch.float32)
    j = (c - (1 << i) + 1).to(torch.float32)
    frac = _f32(0.1).to(c.device) + _f32(0.9).to(c.device) * (j / pow2)
    value = _pow10(c.device)[i - levels + 1 + 8] * frac
    return torch.where(c == 0, 0.0, value)


def codebook(signed: bool) -> torch.Tensor:
    """Every byte's value (fp32 [256], index = the byte): the table the codes are read through."""
    levels = LEVELS_SIGNED if signed else LEVELS_UNSIGNED
    byte = torch.arange(256, dtype=torch.int32)
    if not signed:
        return decode(byte, levels)
    value = decode(byte & 127, levels)
    return torch.where(byte >= 128, -value, value)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x viewed [rows, blocks, QBLOCK] (zero-padded at each row's end to whole blocks; a copy when padded)."""
    c = x.shape[-1] if x.dim() else 1
    rows = x.reshape(-1, c)
    pad = -c % QBLOCK
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.view(rows.shape[0], rows.shape[1] // QBLOCK, QBLOCK)


@torch.no_grad()
def quantize_(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> None:
    """``codes`` (uint8, x's shape) and ``scales`` (fp32, scale_shape(x.shape)) <- x (fp32) quantized block by
    block: each block's largest magnitude, and each element's byte (the first moment signed, the second
    not; a negative x in an unsigned code is an error of the caller)."""
    levels = LEVELS_SIGNED if signed else LEVELS_UNSIGNED
    if x.numel() == 0:
        scales.zero_()
        return
    b = _blocks(x.float())
    amax = b.abs().amax(-1)
    inv = torch.where(amax > 0, 1.0 / amax, 0.0)  # fp32 division, IEEE
    c = encode(b.abs() * inv[..., None], levels)
    if signed:
        c = torch.where((b < 0) & (c > 0), c + 128, c)
    n = x.shape[-1] if x.dim() else 1
    codes.view(-1, n).copy_(c.reshape(c.shape[0], -1)[:, :n].to(torch.uint8))
    scales.view(-1).copy_(amax.view(-1))


@torch.no_grad()
def dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 values of quantize_'s ``codes`` and ``scales`` (a new tensor of codes' shape)."""
    levels = LEVELS_SIGNED if signed else LEVELS_UNSIGNED
    if codes.numel() == 0:
        return torch.zeros(codes.shape, dtype=torch.float32, device=codes.device)
    b = _blocks(codes.to(torch.int32))
    mag = b & 127 if signed else b
    value = decode(mag, levels) * scales.view(b.shape[0], -1, 1)
    if signed:
        value = torch.where(b >= 128, -value, value)
    n = codes.shape[-1] if codes.dim() else 1
    return value.reshape(value.shape[0], -1)[:, :n].reshape(codes.shape)
