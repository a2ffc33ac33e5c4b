"""Adam moments held in 8 bits, the torch reference: optimizer.state_dtype=q8 (block-wise dynamic quantization,
uint8 codes) and optimizer.state_dtype=fp8 (block-scaled E4M3, float8_e4m3fn codes); the codes' dtype names the
code everywhere (quantize_, dequantize, core.adamw_triton's kernel).

q8 (below, to the FP8 section):

The scheme is that of 8-bit optimizers (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR
2022): each block of ``QBLOCK`` consecutive elements along a tensor's last dim is divided by its largest
magnitude (kept in fp32), and the quotient r in [0, 1] is stored as one byte of a dynamic code: a level by the
decade r falls in, then a linear fraction whose width grows with the level, so that a block's large values
keep most bits and its small ones still keep a non-zero value down to 10^-LEVELS. One change from the paper:
the second moment is held as its square root (load_moments), so its dynamic range is the first moment's
squared and no element's denominator rounds to zero while its first moment is kept (with v itself coded, an
element 10^4 below its block's largest gradient keeps m but loses v, and steps several times too far).

A byte's magnitude ``c`` (7 bits for the signed first moment, whose top bit is the sign; 8 for the second
moment's root, which is never negative) is read as: c = 0 is zero; otherwise level i = floor(log2 c) (the
position of its highest set bit, so level i has 2^i codes) and j = c - 2^i + 1 in [1, 2^i]; the value is

    10^(i - LEVELS + 1) * (0.1 + 0.9 * j / 2^i)        LEVELS = 7 signed, 8 unsigned

so level i spans (10^(i - LEVELS), 10^(i - LEVELS + 1)] in 2^i equal steps, its top is the next level's
floor (the code below a level's first is the level below's top), and the largest code is exactly 1: a
block's largest magnitude is kept exactly. Encoding rounds to the nearest code (ties up: a magnitude below
half the smallest non-zero code becomes 0); it finds the level from r's binary exponent and at most one
threshold compare, then the code as floor(r * mul + add) of that level's constants (_encode_tables), so the
kernel does it in a few table reads and no division. Relative error: under 0.8% near a block's largest
magnitude, about 4.5 / 2^i of the value at level i's floor.

Blocks run along the last dim only (a row's partial last block is its own block), so a tensor sharded on
any other dim (FSDP2's dim 0, expert parallel's expert dim) shards its scales with it: each scale lives
beside its rows, and a checkpoint reshards both alike.

Every step is written as fp32 operations in a fixed order (no fused multiply-add), so
core.adamw_triton's kernel encodes and decodes the same bytes and values bit for bit through the same tables
(kernel_tables); the tests also check the encoding against an independent float64 nearest-code search over
the whole table.

fp8: each block of QBLOCK along the last dim is scaled by a power of two and its elements stored as E4M3
(core.precision.mx's quantize_mx at a block of QBLOCK: the scale 2^ceil(log2(amax / 448)) as an E8M0 code, a
uint8 a block), the first moment rounded to nearest even, as torchao's FP8 Adam codes both moments (block-wise
E4M3; facts, not code). The second moment differs: it is held as its root (as in q8), floored at E4M3's smallest
subnormal (a positive root never becomes 0: 2^-9 of the scale, about 4e-6 of the block's largest, so a
denominator is never 0 where the first moment is kept; a smaller root is held too large, its update smaller
than Adam's, never larger), and rounded stochastically (sr_e4m3): up with the probability of its distance from
the grid value below, so the code is unbiased. Rounded to nearest it would not be: with three mantissa bits a
root moves by at least 3% to 6% of its value to change its code, and one step of beta2 = 0.95 without gradient
moves it by 2.5%, so a second moment whose gradients shrink stays where it was (measured on a stream of
gradients dropped 100x: v 3,900x too large 150 steps later, and 2.2x too large already before the drop, since
growth is registered and decay is not). The random bits are a hash (murmur3's 32-bit finalizer) of the rounded
value's top bits and the step (sr_key): the same in every parallel layout and in the kernel, with no state. Three
mantissa bits: a value is within 6.25% (half of E4M3's ulp) near its block's largest (q8: 0.8%), and so in every
binade down to E4M3's smallest normal, 2^-6 of the scale (q8's error grows a decade at a time instead), and the
GPU codes and decodes it with its conversion instructions instead of table reads.
"""

from __future__ import annotations

import torch

__all__ = ["CODE_DTYPES", "CODE_NAMES", "FP8", "FP8_ROOT_FLOOR", "LEVELS_SIGNED", "LEVELS_UNSIGNED", "QBLOCK",
           "TABLE", "codebook", "decode", "dequantize", "encode", "fmix32", "kernel_tables", "load_moments",
           "quantize_", "scale_dtype", "scale_shape", "sqrt_rn", "sr_e4m3", "sr_key", "store_moments"]

QBLOCK = 256
"""Elements of one quantization block along the last dim (the paper's block size for its optimizers)."""
LEVELS_SIGNED = 7
"""Decades of the first moment's code (7 magnitude bits under a sign bit): non-zero down to 10^-7."""
LEVELS_UNSIGNED = 8
"""Decades of the second moment's code (8 magnitude bits): non-zero down to 10^-8."""

FP8 = torch.float8_e4m3fn
"""The codes' dtype of optimizer.state_dtype=fp8 (q8's are torch.uint8)."""
CODE_NAMES = {torch.uint8: "q8", FP8: "fp8"}
"""The dtypes of 8-bit moments' codes, by the optimizer.state_dtype that holds them."""
CODE_DTYPES = tuple(CODE_NAMES)
FP8_ROOT_FLOOR = 2.0**-9
"""The least value a positive second moment's root is stored as, in units of its block's scale: E4M3's smallest
subnormal (the module docstring)."""
E4M3_MIN_NORMAL = 2.0**-6
FP32_MIN_NORMAL = 2.0**-126
"""q8: a block whose largest magnitude is below this is stored as zeros (quantize_)."""


def _f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _pow10(device: torch.device) -> torch.Tensor:
    """10^e for e in -8..8 as fp32 (index e + 8): the constants both implementations round from the same
    doubles."""
    return torch.tensor([10.0**e for e in range(-8, 9)], dtype=torch.float32, device=device)


def scale_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The scales' shape for a tensor of ``shape``: one per block of QBLOCK along the last dim."""
    if len(shape) == 0:
        return (1,)
    return (*shape[:-1], -(-shape[-1] // QBLOCK))


def scale_dtype(codes: torch.dtype) -> torch.dtype:
    """The dtype of the scales beside codes of dtype ``codes``: fp32 (q8: the block's largest magnitude) or
    uint8 (fp8: the block's E8M0 code)."""
    if codes not in CODE_DTYPES:
        raise ValueError(f"8-bit moments' codes are torch.uint8 (q8) or {FP8} (fp8), got {codes}")
    return torch.uint8 if codes == FP8 else torch.float32


EXP_MIN = -32
"""Binary exponents below this one share its row of the encoding tables (every magnitude under 2^-32 is 0)."""


def _encode_tables(levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The encoder's tables for a code of ``levels`` decades (fp32 from float64, the kernel's too):
    ``count`` and ``next_t`` by binary exponent e in [EXP_MIN, 0] (index e - EXP_MIN): the decade
    thresholds 10^-levels .. 10^-1 below 2^e, and the least one above it (a binade spans a factor 2, so holds
    at most one); ``mul`` and ``add`` by count (0 .. levels): the code is floor(r * mul + add), the nearest
    code of the count's level as an affine map of r (level 0's: 1 from half its one code up)."""
    t = [float(torch.tensor(10.0 ** (k - levels), dtype=torch.float32)) for k in range(levels)]
    exps = range(EXP_MIN, 1)
    count = torch.tensor([sum(x < 2.0**e for x in t) for e in exps], dtype=torch.int32)
    next_t = torch.tensor([min([x for x in t if x > 2.0**e], default=3.0e38) for e in exps], dtype=torch.float32)
    mul, add = [0.0, 2 * 10.0 ** (levels - 1)], [0.0, 0.0]
    for i in range(1, levels):  # c = 2^i - 1 + floor((r * 10^(levels-1-i) - 0.1) * 2^i / 0.9 + 0.5)
        mul.append(10.0 ** (levels - 1 - i) * 2**i / 0.9)
        add.append(2**i - 1 + 0.5 - 0.1 * 2**i / 0.9)
    return count, next_t, torch.tensor(mul, dtype=torch.float32), torch.tensor(add, dtype=torch.float32)


def encode(r: torch.Tensor, levels: int) -> torch.Tensor:
    """Magnitudes r (fp32, in [0, 1], a little above 1 allowed) -> codes (int32 in [0, 2^levels - 1]), the
    nearest code of the module docstring's table (its level from r's binary exponent and one threshold, then
    an affine map, through kernel_tables' encoding tables as the kernel reads them; its operations in its order)."""
    t = kernel_tables(r.device)
    base = TABLE.ENC_M if levels == LEVELS_SIGNED else TABLE.ENC_V
    e = ((r.view(torch.int32) >> 23) & 0xFF) - 127
    row = (e.clamp(EXP_MIN, 0) - EXP_MIN).long()
    count = t[base + TABLE.COUNT + row].to(torch.int32) + (r > t[base + TABLE.NEXT + row]).to(torch.int32)
    lo = (1 << (count - 1).clamp(min=0)) - 1
    c = torch.floor(r * t[base + TABLE.MUL + count.long()] + t[base + TABLE.ADD + count.long()]).to(torch.int32)
    return torch.minimum(torch.maximum(c, lo), 2 * lo + 1)


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


def _unblock(b: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """_blocks' inverse: [rows, blocks, QBLOCK] (or [rows, blocks, QBLOCK, ...] flattened alike) back to ``shape``,
    each row's padding dropped."""
    n = shape[-1] if len(shape) else 1
    return b.reshape(b.shape[0], -1)[:, :n].reshape(shape)


@torch.no_grad()
def quantize_(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool, key: int = 0) -> None:
    """``codes`` (x's shape) and ``scales`` (scale_shape(x.shape)) <- x (fp32) quantized block by block in the
    code of codes' dtype (module docstring): q8, uint8 codes and each block's largest magnitude (fp32); fp8,
    E4M3 codes and each block's E8M0 code (uint8). The first moment signed, the second moment's root not (a
    negative x in an unsigned code is an error of the caller); fp8's unsigned code is floored and rounded
    stochastically under ``key`` (sr_key of the step)."""
    levels = LEVELS_SIGNED if signed else LEVELS_UNSIGNED
    if x.numel() == 0:
        scales.zero_()
        return
    if codes.dtype == FP8:
        _quantize_fp8(x, codes, scales, signed, key)
        return
    b = _blocks(x.float())
    amax = b.abs().amax(-1)
    # a block below fp32's smallest normal is stored as zeros: 1 / amax would overflow (a moment decaying for
    # hundreds of steps without gradient, an unseen token's embedding row, gets there), and 0 * inf is NaN
    amax = torch.where(amax >= FP32_MIN_NORMAL, amax, 0.0)
    inv = torch.where(amax > 0, 1.0 / amax, 0.0)  # fp32 division, IEEE
    c = encode(b.abs() * inv[..., None], levels)
    if signed:
        c = torch.where((b < 0) & (c > 0), c + 128, c)
    codes.copy_(_unblock(c.to(torch.uint8), codes.shape))
    scales.view(-1).copy_(amax.view(-1))


@torch.no_grad()
def dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 values of quantize_'s ``codes`` and ``scales`` (a new tensor of codes' shape): q8, each byte's
    codebook value (looked up in kernel_tables, as the kernel does) times its block's scale; fp8, each E4M3
    value times its block's power of two (exact)."""
    if codes.numel() == 0:
        return torch.zeros(codes.shape, dtype=torch.float32, device=codes.device)
    if codes.dtype == FP8:
        from .precision.mx import dequantize_mx

        b = _blocks(codes.view(torch.uint8)).view(FP8)
        return _unblock(dequantize_mx(b, scales.reshape(b.shape[0], -1, 1), QBLOCK, -1), codes.shape)
    b = _blocks(codes.to(torch.int64))
    book = kernel_tables(codes.device)[TABLE.DEC_M if signed else TABLE.DEC_V:][:256]
    return _unblock(book[b] * scales.view(b.shape[0], -1, 1), codes.shape)


def _quantize_fp8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool, key: int) -> None:
    """quantize_ in fp8's code: core.precision.mx's scale rule (mx_scaled) along the last dim at a block of QBLOCK
    (a row's partial last block zero-padded), the scaled values rounded to nearest as quantize_mx does; unsigned,
    the scaled root floored and rounded by sr_e4m3 instead."""
    from .precision.mx import E4M3_MAX, mx_scaled

    code, y = mx_scaled(_blocks(x.float()), "rceil")
    if not signed:
        y = sr_e4m3(torch.where(y > 0, y.clamp_min(FP8_ROOT_FLOOR), y), key)
    data = y.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)  # saturate, then to nearest even (exact for sr_e4m3's values)
    codes.view(torch.uint8).copy_(_unblock(data.view(torch.uint8), codes.shape))
    scales.view(-1).copy_(code.reshape(-1))


def fmix32(x):
    """murmur3's 32-bit finalizer of uint32 values, as int64 tensors or Python ints (x ^= x >> 16;
    x *= 0x85ebca6b; x ^= x >> 13; x *= 0xc2b2ae35; x ^= x >> 16, each product modulo 2^32, formed in halves so
    no int64 overflows): core.adamw_triton's fmix32 does the same in int32."""
    def mul(x, c):
        return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF

    x = x ^ (x >> 16)
    x = mul(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = mul(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def sr_key(step: int) -> int:
    """The step's key for sr_e4m3 (fmix32 of the step count, as a signed int32 for the kernel's argument), in
    Python integers: the optimizer asks for it every step for every parameter, so no tensor ops on the host."""
    k = fmix32(int(step) & 0xFFFFFFFF)
    return k - (1 << 32) if k >= 1 << 31 else k


def sr_e4m3(y: torch.Tensor, key: int) -> torch.Tensor:
    """fp32 y in [0, 448] rounded stochastically to E4M3's grid (fp32 values on it): down to the grid value
    below or up to the one above, up with probability (y - below) / (above - below) to 2^-20, the 20 random bits
    fmix32((bits(y) >> 8) ^ key)'s lowest: y's lowest 8 bits left out, so that two computations of y a few ulps
    apart (torch's CPU ops against the kernel's) mostly draw the same bits. A normal y adds them below its 3 kept
    mantissa bits and truncates; a subnormal one (below 2^-6) is moved up by 2^-6 first, where fp32's grid of 3
    mantissa bits is E4M3's subnormal grid (2^-9), then back (exact)."""
    sub = y < E4M3_MIN_NORMAL
    z = torch.where(sub, y + E4M3_MIN_NORMAL, y)
    bits = y.view(torch.int32).to(torch.int64) >> 8  # y >= 0: its top 23 bits
    r = fmix32(bits ^ (key & 0xFFFFFFFF)) & 0xFFFFF
    out = ((z.view(torch.int32).to(torch.int64) + r) & ~0xFFFFF).to(torch.int32).view(torch.float32)
    return torch.where(sub, out - E4M3_MIN_NORMAL, out)


class TABLE:
    """Offsets into kernel_tables' one fp32 tensor: the two codebooks (decoding is a lookup), then each code's
    encoding tables (_encode_tables: count and next threshold by exponent row, mul and add by count)."""

    DEC_M = 0  # codebook(True): the first moment's bytes, signed
    DEC_V = 256  # codebook(False): the second moment's square root's bytes
    ENC_M = 512
    ENC_V = ENC_M + 84
    COUNT, NEXT, MUL, ADD = 0, 33, 66, 75  # within an ENC_* block (33 exponent rows, at most 9 counts)
    SIZE = ENC_V + 84


_TABLES: dict[torch.device, torch.Tensor] = {}


def kernel_tables(device: torch.device) -> torch.Tensor:
    """The codebooks and encoding tables as one fp32 tensor on ``device`` (TABLE's offsets; the counts as
    exact floats), made once a device: core.adamw_triton's kernel reads its codes through it."""
    device = torch.device(device)
    if device not in _TABLES:
        t = torch.zeros(TABLE.SIZE, dtype=torch.float32)
        t[TABLE.DEC_M:TABLE.DEC_M + 256] = codebook(True)
        t[TABLE.DEC_V:TABLE.DEC_V + 256] = codebook(False)
        for base, levels in ((TABLE.ENC_M, LEVELS_SIGNED), (TABLE.ENC_V, LEVELS_UNSIGNED)):
            count, next_t, mul, add = _encode_tables(levels)
            t[base + TABLE.COUNT:base + TABLE.COUNT + 33] = count.float()
            t[base + TABLE.NEXT:base + TABLE.NEXT + 33] = next_t
            t[base + TABLE.MUL:base + TABLE.MUL + levels + 1] = mul
            t[base + TABLE.ADD:base + TABLE.ADD + levels + 1] = add
        _TABLES[device] = t.to(device)
    return _TABLES[device]


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root rounded once to nearest (through float64: exact, as the kernel's sqrt_rn; torch's CPU
    sqrt is not correctly rounded)."""
    return x.double().sqrt().float()


@torch.no_grad()
def load_moments(m_codes: torch.Tensor, m_scales: torch.Tensor, v_codes: torch.Tensor,
                 v_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's two moments in fp32 from their 8-bit form (either code): the first moment's code, and the second
    moment's square root's (v = s * s): held as its root, the second moment keeps the first's dynamic range
    squared (q8: down to 10^-16 of its block's largest), so no element's denominator is rounded to 0 while its
    first moment is kept."""
    s = dequantize(v_codes, v_scales, False)
    return dequantize(m_codes, m_scales, True), s * s


@torch.no_grad()
def store_moments(m: torch.Tensor, v: torch.Tensor, m_codes: torch.Tensor, m_scales: torch.Tensor,
                  v_codes: torch.Tensor, v_scales: torch.Tensor, step: int = 0) -> None:
    """load_moments' inverse: m (fp32) quantized signed, sqrt_rn(v) unsigned (fp8: rounded stochastically, its
    random bits keyed by ``step``, the optimizer's step count)."""
    quantize_(m, m_codes, m_scales, True)
    quantize_(sqrt_rn(v), v_codes, v_scales, False, sr_key(step))
