"""8-bit Adam moments (core/moments_q8.py, optimizer.state_dtype=q8) and their Triton kernel.

- The code's table: its documented structure (monotone, 0 and exactly 1, the smallest non-zero 10^-6 / 10^-7,
  2^i codes a decade), and encode is the nearest code by an independent float64 search over the whole table
  (except where two codes are equally near within fp32 rounding).
- Block quantization: the round trip's error by magnitude, partial blocks, blocks that never cross rows (a
  slice of rows quantizes to the slice of the whole: the property that lets a checkpoint reshard codes and
  scales alike), the second moment non-negative.
- The Triton codec and the AdamW kernel (under TRITON_INTERPRET=1 in a subprocess, and on the GPU): bit for bit
  the torch reference (dequantize, tests/core/test_adamw_triton.py's reference_step, quantize_), fp32 and bf16
  gradients, the bf16 copy, the split master, the clip scale, shapes with partial blocks and rows not a
  multiple of the tile.
"""

import math

import pytest
import torch

from moetron.core.moments_q8 import (LEVELS_SIGNED, LEVELS_UNSIGNED, QBLOCK, codebook, decode, dequantize, encode,
                                     quantize_, scale_shape)
from tests.interpreted import run_interpreted


@pytest.mark.parametrize("signed", [True, False])
def test_codebook_structure(signed):
    levels = LEVELS_SIGNED if signed else LEVELS_UNSIGNED
    mags = decode(torch.arange(2**levels), levels).double()
    assert mags[0] == 0 and mags[-1] == 1.0
    assert torch.all(mags[1:] > mags[:-1])  # strictly increasing: every code distinct
    assert math.isclose(mags[1].item(), 10.0 ** (1 - levels), rel_tol=1e-6)
    for i in range(levels):  # level i: 2^i codes, equally spaced, up to 10^(i - levels + 1)
        lvl = mags[2**i:2**(i + 1)]
        top = 10.0 ** (i - levels + 1)
        assert math.isclose(lvl[-1].item(), top, rel_tol=1e-6)
        steps = torch.diff(torch.cat([mags[2**i - 1:2**i], lvl]))
        if i > 0:
            assert torch.allclose(steps, torch.full_like(steps, 0.9 * top / 2**i), rtol=1e-5)
    cb = codebook(signed)
    assert cb.shape == (256,)
    if signed:
        assert torch.equal(cb[128 + 1:], -cb[1:128]) and cb.min() == -1
    else:
        assert torch.equal(cb, decode(torch.arange(256), levels))


@pytest.mark.parametrize("signed", [True, False])
def test_encode_is_nearest_code(signed):
    levels = LEVELS_SIGNED if signed else LEVELS_UNSIGNED
    mags = decode(torch.arange(2**levels), levels).double()
    gen = torch.Generator().manual_seed(0)
    r = torch.cat([10 ** (-(levels + 1) * torch.rand(200_000, generator=gen, dtype=torch.float64)),
                   mags, (mags[1:] + mags[:-1]) / 2, torch.tensor([0.0, 1e-12, 1.0])]).float()
    got = encode(r, levels).long()
    dist = (r.double()[:, None] - mags[None, :]).abs()
    best = dist.argmin(1)
    wrong = got != best
    # where they differ, the code chosen must be as near as the best within fp32 rounding (a tie)
    gap = dist.gather(1, got[:, None])[:, 0] - dist.gather(1, best[:, None])[:, 0]
    assert torch.all(gap[wrong] <= 4e-7 * r.double()[wrong].clamp(min=1e-30)), r[wrong][:5]
    assert wrong.float().mean() < 1e-3
    assert torch.equal(encode(mags.float(), levels), torch.arange(2**levels, dtype=torch.int32))


def test_block_round_trip():
    gen = torch.Generator().manual_seed(1)
    shape = (5, 3 * QBLOCK + 37)  # a partial block at each row's end
    x = torch.randn(shape, generator=gen) * torch.logspace(-6, 0, shape[1])  # magnitudes over 6 decades a row
    codes, scales = torch.empty(shape, dtype=torch.uint8), torch.empty(scale_shape(shape))
    assert scales.shape == (5, 4)
    quantize_(x, codes, scales, True)
    y = dequantize(codes, scales, True)
    blocks = torch.nn.functional.pad(x, (0, -shape[1] % QBLOCK)).view(5, 4, QBLOCK)
    assert torch.equal(scales, blocks.abs().amax(-1))
    amax = scales.repeat_interleave(QBLOCK, 1)[:, :shape[1]]
    r = x.abs() / amax
    err = (y - x).abs() / amax
    # at most half a step of the value's level: 0.45 * 10^(level top) / 2^level, and 5e-7 below the code's floor
    level = (torch.floor(torch.log10(r.clamp(min=1e-12))) + LEVELS_SIGNED).clamp(min=0)
    bound = 0.45 * 10 ** (level - LEVELS_SIGNED + 1) / 2**level + 1e-7
    assert torch.all(err <= torch.where(r < 1e-6, 5e-7, bound) * 1.0001)
    assert torch.all(torch.sign(y) * torch.sign(x) >= 0)
    assert torch.equal(y.abs().amax(-1), x.abs().amax(-1))  # a row's largest is exact
    # blocks never cross rows: rows quantized apart give the same codes and scales
    c2, s2 = torch.empty(2, shape[1], dtype=torch.uint8), torch.empty(scale_shape((2, shape[1])))
    quantize_(x[1:3].contiguous(), c2, s2, True)
    assert torch.equal(c2, codes[1:3]) and torch.equal(s2, scales[1:3])
    v = x * x
    quantize_(v, codes, scales, False)
    w = dequantize(codes, scales, False)
    assert torch.all(w >= 0) and torch.all((w - v).abs() <= 0.45 * 10 ** (level - 6) / 2**level * amax**2 + 1e-7 * amax**2)


def test_zero_and_tiny_blocks():
    x = torch.zeros(3, 10)
    x[1, 3] = -2.5
    x[2] = 1e-30
    codes, scales = torch.empty(3, 10, dtype=torch.uint8), torch.empty(3, 1)
    quantize_(x, codes, scales, True)
    assert torch.equal(dequantize(codes, scales, True), x)
    s = torch.tensor(3.0)
    c0, s0 = torch.empty((), dtype=torch.uint8), torch.empty(1)
    quantize_(s, c0, s0, False)
    assert dequantize(c0, s0, False).item() == 3.0


# ---------------------------------------------------------------------------------------------------------------
# The Triton codec and kernel

SHAPES = [(3,), (7, 300), (17, QBLOCK), (2, 3, 2 * QBLOCK + 5)]


try:  # defined at import (Triton resolves a kernel's names in its module); the subprocess sets TRITON_INTERPRET
    import triton
    import triton.language as tl

    from moetron.core.adamw_triton import q8_decode, q8_encode

    @triton.jit
    def _codec(r_ptr, c_ptr, v_ptr, n, LEVELS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        c = q8_encode(tl.load(r_ptr + offs, mask=mask, other=0.0), LEVELS)
        tl.store(c_ptr + offs, c, mask=mask)
        tl.store(v_ptr + offs, q8_decode(c, LEVELS), mask=mask)
except ImportError:  # no triton: the kernel tests are skipped by run_interpreted
    pass


def check_codec(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    for levels in (LEVELS_SIGNED, LEVELS_UNSIGNED):
        mags = decode(torch.arange(2**levels), levels)
        r = torch.cat([10 ** (-(levels + 1) * torch.rand(50_000, generator=gen)), mags,
                       (mags[1:] + mags[:-1]) / 2, torch.tensor([0.0, 1.0000001])]).to(device)
        c = torch.empty(r.shape, dtype=torch.int32, device=device)
        v = torch.empty_like(r)
        _codec[(triton_cdiv(r.numel(), 1024),)](r, c, v, r.numel(), LEVELS=levels, BLOCK=1024,
                                                 enable_fp_fusion=False)
        want = encode(r.cpu(), levels)
        assert torch.equal(c.cpu(), want), f"levels {levels}: {(c.cpu() != want).sum()} codes differ"
        assert torch.equal(v.cpu(), decode(want, levels)), f"levels {levels}: values differ"


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_kernel(device: str) -> None:
    from moetron.core.adamw import join_fp32, split_fp32
    from moetron.core.adamw_triton import adamw_update_q8_
    from tests.core.test_adamw_triton import reference_step

    gen = torch.Generator().manual_seed(3)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for shape in SHAPES:
        for grad_dtype, split, clip in ((torch.float32, False, False), (torch.bfloat16, False, True),
                                        (torch.bfloat16, True, False)):
            p = torch.randn(shape, generator=gen).to(device)
            mine = [torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(2)]
            mine += [torch.zeros(scale_shape(shape), device=device) for _ in range(2)]
            ref = [t.clone() for t in mine]
            ref_p, copy = p.clone(), torch.empty(shape, dtype=torch.bfloat16, device=device)
            hi, lo = torch.empty(shape, dtype=torch.bfloat16, device=device), torch.empty(shape, dtype=torch.int16,
                                                                                          device=device)
            if split:
                split_fp32(p, hi, lo)
                ref_p = join_fp32(hi, lo, torch.empty(shape, device=device))
            for step in range(1, 5):
                g = (torch.randn(shape, generator=gen) * 10.0 ** (step - 3)).to(device, grad_dtype)
                scale = torch.tensor(0.5, device=device) if clip else None
                if split:
                    adamw_update_q8_(hi, g, *mine, lo=lo, step=step, grad_scale=scale, **hyper)
                else:
                    adamw_update_q8_(p, g, *mine, step=step, out_bf16=copy, grad_scale=scale, **hyper)
                m = dequantize(ref[0], ref[2], True)
                v = dequantize(ref[1], ref[3], False)
                reference_step(ref_p, g.float() * 0.5 if clip else g, m, v, step=step, **hyper)
                quantize_(m, ref[0], ref[2], True)
                quantize_(v, ref[1], ref[3], False)
                what = f"shape {shape}, grad {grad_dtype}, split {split}, clip {clip}, step {step}"
                for name, got, want in zip(("exp_avg", "exp_avg_sq", "exp_avg scales", "exp_avg_sq scales"), mine,
                                           ref):
                    assert torch.equal(got, want), f"{name}: {what}"
                if split:  # the kernel writes the master back split: at a bf16 tie it moves one ulp (split_fp32)
                    ref_hi, ref_lo = torch.empty_like(hi), torch.empty_like(lo)
                    split_fp32(ref_p, ref_hi, ref_lo)
                    join_fp32(ref_hi, ref_lo, ref_p)
                    assert torch.equal(hi, ref_hi) and torch.equal(lo, ref_lo), f"split master: {what}"
                else:
                    assert torch.equal(p, ref_p), f"p: {what}"
                    assert torch.equal(copy, p.to(torch.bfloat16)), f"copy: {what}"
    with pytest.raises(TypeError, match="uint8 codes"):
        adamw_update_q8_(p, g.float(), p, p, *mine[2:], step=1, **hyper)
    with pytest.raises(ValueError, match="scales must be contiguous fp32 of shape"):
        adamw_update_q8_(p, g.float(), *mine[:2], mine[2][..., :1], mine[3], step=1, **hyper)


def check_interpreted() -> None:
    check_codec("cpu")
    check_kernel("cpu")


def test_q8_kernel_interpreted():
    run_interpreted("tests.core.test_moments_q8", "check_interpreted()")


@pytest.mark.gpu
def test_q8_kernel_on_gpu():
    check_codec("cuda")
    check_kernel("cuda")
