"""8-bit Adam moments (core/moments_q8.py, optimizer.state_dtype=q8 and fp8) and their Triton kernel.

- The code's table: its documented structure (monotone, 0 and exactly 1, the smallest non-zero 10^-6 / 10^-7,
  2^i codes a decade), and encode is the nearest code by an independent float64 search over the whole table
  (except where two codes are equally near within fp32 rounding).
- Through the trainer (tests/core/test_optim_state.py, with bf16 state): the tiny MoE's curve within 2% of fp32
  moments'; FSDP2, expert parallel and offload equal the single process; a DCP save resumes exactly.
- Block quantization: the round trip's error by magnitude, partial blocks, blocks that never cross rows (a
  slice of rows quantizes to the slice of the whole: the property that lets a checkpoint reshard codes and
  scales alike), the second moment non-negative.
- fp8's code: each element the nearest E4M3 value under its block's power of two (an independent float64 search
  over E4M3's 256 values, the scale from float64 logs); the root's stochastic rounding only ever picks the two
  grid values around it, is unbiased over steps, and its hash is murmur3's finalizer (a pure-Python one); the
  root's floor; through a stream of gradients that shrink 100x, both codes' second moments follow fp32 moments'
  where a root rounded to nearest freezes (the reason for the stochastic rounding).
- The Triton codec and the AdamW kernel (under TRITON_INTERPRET=1 in a subprocess, and on the GPU), both codes:
  bit for bit the torch reference (dequantize, tests/core/test_adamw_triton.py's reference_step, quantize_),
  fp32 and bf16 gradients, the bf16 copy, the split master, the clip scale, shapes with partial blocks and rows
  not a multiple of the tile.
"""

import math

import pytest
import torch

from moetron.core.moments_q8 import (CODE_DTYPES, FP8, FP8_ROOT_FLOOR, LEVELS_SIGNED, LEVELS_UNSIGNED, QBLOCK, TABLE,
                                     codebook, decode, dequantize, encode, fmix32, kernel_tables, load_moments,
                                     quantize_, scale_dtype, scale_shape, sqrt_rn, sr_e4m3, sr_key, store_moments)
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
    bound_v = 0.45 * 10 ** (level - 6) / 2**level * amax**2 + 1e-7 * amax**2
    assert torch.all(w >= 0) and torch.all((w - v).abs() <= bound_v)


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


@pytest.mark.parametrize("code", CODE_DTYPES)
def test_blocks_below_fp32s_normals(code):
    """A block whose largest magnitude is subnormal in fp32 (a moment decayed for hundreds of steps without
    gradient): no NaN, no crash, zeros stay zero, nothing grows; q8 stores such a block as zeros (1 / amax would
    overflow), fp8 keeps it under its least scale, 2^-127."""
    x = torch.zeros(3, 300)
    x[0, :5], x[1, :3], x[2, 7] = 1e-39, -3e-41, 2.0**-126  # subnormal blocks; the smallest normal amax
    for signed in (True, False):
        xx = x if signed else x.abs()
        codes, scales = torch.empty(x.shape, dtype=code), torch.empty(scale_shape(x.shape), dtype=scale_dtype(code))
        quantize_(xx, codes, scales, signed, sr_key(1))
        got = dequantize(codes, scales, signed)
        assert not torch.isnan(got).any() and torch.all(got[xx == 0] == 0) and torch.all(got.abs() <= xx.abs().amax())
        assert got[2, 7] == xx[2, 7]  # a normal amax kept exactly: q8's largest code is 1, fp8's 2^-126 on E4M3's grid
        if code == torch.uint8:
            assert torch.all(got[:2] == 0)


# ---------------------------------------------------------------------------------------------------------------
# fp8's code

E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).double()  # torch's own decoding
E4M3_GRID = E4M3_VALUES[torch.isfinite(E4M3_VALUES) & (E4M3_VALUES >= 0)].unique()  # 0, 2^-9, ..., 448


def _fp8_pair(shape):
    return torch.empty(shape, dtype=FP8), torch.empty(scale_shape(shape), dtype=scale_dtype(FP8))


def test_fp8_code_is_the_nearest_e4m3_under_a_power_of_two():
    gen = torch.Generator().manual_seed(5)
    shape = (6, 2 * QBLOCK + 41)
    x = torch.randn(shape, generator=gen) * torch.logspace(-7, 1, shape[1])
    codes, scales = _fp8_pair(shape)
    quantize_(x, codes, scales, True)
    blocks = torch.nn.functional.pad(x, (0, -shape[1] % QBLOCK)).view(6, 3, QBLOCK).double()
    # the scale: the least power of two 2^k with amax / 2^k <= 448, from float64 logs
    k = torch.ceil(torch.log2(blocks.abs().amax(-1) / 448))
    assert torch.equal(scales.int() - 127, k.int())
    s = (2.0 ** k).repeat_interleave(QBLOCK, 1)[:, :shape[1]]
    q = (x.double() / s)
    grid = torch.cat([-E4M3_GRID.flip(0), E4M3_GRID])
    dist = (q[..., None] - grid).abs()
    nearest = grid[dist.argmin(-1)]
    tie = (dist.sort(-1).values[..., 1] - dist.min(-1).values) < 1e-12
    got = dequantize(codes, scales, True).double()
    assert torch.equal(got[~tie], (nearest * s)[~tie])
    assert not ((codes.view(torch.uint8) & 0x7F) == 0x7F).any()  # no E4M3 NaN code from finite input
    assert not torch.isnan(got).any() and torch.equal(got.abs().amax(-1) > 0, x.abs().amax(-1) > 0)


def test_fmix32_is_murmur3s_finalizer():
    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    xs = torch.randint(0, 2**32, (2000,), dtype=torch.int64, generator=torch.Generator().manual_seed(6))
    xs[:3] = torch.tensor([0, 1, 2**32 - 1])
    assert fmix32(xs).tolist() == [fmix(int(x)) for x in xs]
    assert sr_key(1) == fmix(1) - 2**32 * (fmix(1) >= 2**31)


def test_fp8_root_rounds_stochastically_without_bias():
    """sr_e4m3 picks one of the two E4M3 values around y (y itself when on the grid), up with the probability of
    y's distance from the lower, over the keys of 4,000 steps: normal and subnormal values, the top of the range."""
    ys = torch.tensor([1.1, 300.0, 447.0, 448.0, 0.003, 2.0**-9, 2.0**-9 * 1.3, 0.015, 1.0])
    out = torch.stack([sr_e4m3(ys, sr_key(step)) for step in range(4000)]).double()
    for y, o in zip(ys.double(), out.t()):
        below = E4M3_GRID[E4M3_GRID <= y].max()
        above = E4M3_GRID[E4M3_GRID >= y].min()
        assert set(o.unique().tolist()) <= {below.item(), above.item()}, y
        if above == below:  # on the grid: kept
            continue
        p = ((y - below) / (above - below)).item()
        assert abs((o == above).double().mean().item() - p) < 4 * math.sqrt(p * (1 - p) / 4000), y


def test_fp8_root_floor():
    """A positive root far below its block's largest is stored as 2^-9 of the scale, never 0 (so the update's
    denominator is not 0 where the first moment is kept); a zero stays zero."""
    x = torch.zeros(1, QBLOCK)
    x[0, 0], x[0, 1], x[0, 2] = 1.0, 1e-9, 0.0
    codes, scales = _fp8_pair(x.shape)
    quantize_(x, codes, scales, False, sr_key(3))
    got = dequantize(codes, scales, False)
    assert got[0, 0] == 1.0 and got[0, 2] == 0
    assert got[0, 1] == FP8_ROOT_FLOOR * 2.0 ** (scales[0, 0].item() - 127)


def _stream_v(code, steps=300, drop_at=150, rne_root=False):
    """Adam's moments over a stream of gradients (per-element scales over two decades) that shrink 100x at
    ``drop_at``, held in fp32 and round-tripped through ``code`` after every step; the medians of v / fp32's v
    just before the drop and at the end. ``rne_root``: fp8 with the root rounded to nearest instead."""
    from moetron.core.precision.mx import dequantize_mx, quantize_mx

    gen = torch.Generator().manual_seed(7)
    shape = (32, 2 * QBLOCK)
    sig = torch.exp(torch.empty(shape).uniform_(-4.6, 0.0, generator=gen))
    m32, v32 = torch.zeros(shape), torch.zeros(shape)
    m8, v8 = torch.zeros(shape), torch.zeros(shape)
    ratios = []
    for t in range(1, steps + 1):
        g = sig * torch.randn(shape, generator=gen) * (0.01 if t > drop_at else 1.0)
        m32, v32 = 0.9 * m32 + 0.1 * g, 0.95 * v32 + 0.05 * g * g
        m8, v8 = 0.9 * m8 + 0.1 * g, 0.95 * v8 + 0.05 * g * g
        if rne_root:
            d, c = quantize_mx(sqrt_rn(v8).view(32, 2, QBLOCK), QBLOCK, -1, "rceil")
            v8 = dequantize_mx(d, c, QBLOCK, -1).view(shape) ** 2
        else:
            codes = [torch.empty(shape, dtype=code) for _ in range(2)]
            scales = [torch.empty(scale_shape(shape), dtype=scale_dtype(code)) for _ in range(2)]
            store_moments(m8, v8, codes[0], scales[0], codes[1], scales[1], t)
            m8, v8 = load_moments(codes[0], scales[0], codes[1], scales[1])
        if t in (drop_at, steps):
            ratios.append((v8 / v32).median().item())
    return ratios


@pytest.mark.parametrize("code", CODE_DTYPES)
def test_second_moment_follows_shrinking_gradients(code):
    """Both codes' second moments follow fp32 moments' (the median of their ratio): within 5% before the gradients
    shrink 100x, within 30% 150 steps after (measured: q8 0.998 / 0.982; fp8 0.998 / 0.812, lagging while v
    decays by 0.95 a step with only rounding noise to move it, the median of a multiplicative walk below its
    mean; 0.952 at 200 steps). The control, fp8 with its root rounded to nearest: at least 1.5x too large before
    (growth registers, decay does not) and 100x after (frozen): the reason for fp8's stochastic rounding."""
    before, after = _stream_v(code)
    assert abs(before - 1) < 0.05 and abs(after - 1) < 0.3, (before, after)
    if code == FP8:
        rne_before, rne_after = _stream_v(code, rne_root=True)
        assert rne_before > 1.5 and rne_after > 100, (rne_before, rne_after)


# ---------------------------------------------------------------------------------------------------------------
# The Triton codec and kernel

SHAPES = [(3,), (7, 300), (17, QBLOCK), (2, 3, 2 * QBLOCK + 5)]


try:  # defined at import (Triton resolves a kernel's names in its module); the subprocess sets TRITON_INTERPRET
    import triton
    import triton.language as tl

    from moetron.core.adamw_triton import q8_encode

    @triton.jit
    def _codec(r_ptr, c_ptr, v_ptr, tab_ptr, n, ENC: tl.constexpr, DEC: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        c = q8_encode(tl.load(r_ptr + offs, mask=mask, other=0.0), tab_ptr, ENC)
        tl.store(c_ptr + offs, c, mask=mask)
        tl.store(v_ptr + offs, tl.load(tab_ptr + DEC + c, mask=mask, other=0.0), mask=mask)
except ImportError:  # no triton: the kernel tests are skipped by run_interpreted
    pass


def check_codec(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    for levels, enc, dec in ((LEVELS_SIGNED, TABLE.ENC_M, TABLE.DEC_M), (LEVELS_UNSIGNED, TABLE.ENC_V, TABLE.DEC_V)):
        mags = decode(torch.arange(2**levels), levels)
        r = torch.cat([10 ** (-(levels + 1) * torch.rand(50_000, generator=gen)), mags,
                       (mags[1:] + mags[:-1]) / 2, torch.tensor([0.0, 1.0000001])]).to(device)
        c = torch.empty(r.shape, dtype=torch.int32, device=device)
        v = torch.empty_like(r)
        _codec[(triton_cdiv(r.numel(), 1024),)](r, c, v, kernel_tables(device), r.numel(), ENC=enc, DEC=dec,
                                                 BLOCK=1024, enable_fp_fusion=False)
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
    for code, shape in [(code, shape) for code in CODE_DTYPES for shape in SHAPES]:
        for grad_dtype, split, clip in ((torch.float32, False, False), (torch.bfloat16, False, True),
                                        (torch.bfloat16, True, False)):
            p = torch.randn(shape, generator=gen).to(device)
            mine = [torch.zeros(shape, dtype=code, device=device) for _ in range(2)]
            mine += [torch.zeros(scale_shape(shape), dtype=scale_dtype(code), device=device) for _ in range(2)]
            # row 0: a first moment at fp32's smallest normals and no gradient: decayed, it falls below them
            # (q8 then stores zeros; fp8 keeps it under its least scale)
            tiny = shape == (7, 300)
            if tiny:
                m0 = torch.randn(shape, generator=gen)
                m0[0] = (1 + 0.1 * torch.rand(shape[1], generator=gen)) * 2.0**-126
                store_moments(m0.to(device), (m0 * m0).to(device), *mine[::2], *mine[1::2], 1)
            ref = [t.clone() for t in mine]
            ref_p, copy = p.clone(), torch.empty(shape, dtype=torch.bfloat16, device=device)
            hi, lo = torch.empty(shape, dtype=torch.bfloat16, device=device), torch.empty(shape, dtype=torch.int16,
                                                                                          device=device)
            if split:
                split_fp32(p, hi, lo)
                ref_p = join_fp32(hi, lo, torch.empty(shape, device=device))
            for step in range(1, 5):
                g = torch.randn(shape, generator=gen) * 10.0 ** (step - 3)
                g[:1] *= 0 if tiny else 1
                g = g.to(device, grad_dtype)
                scale = torch.tensor(0.5, device=device) if clip else None
                if split:
                    adamw_update_q8_(hi, g, *mine, lo=lo, step=step, grad_scale=scale, **hyper)
                else:
                    adamw_update_q8_(p, g, *mine, step=step, out_bf16=copy, grad_scale=scale, **hyper)
                m, v = load_moments(ref[0], ref[2], ref[1], ref[3])
                reference_step(ref_p, g.float() * 0.5 if clip else g, m, v, step=step, **hyper)
                store_moments(m, v, ref[0], ref[2], ref[1], ref[3], step)
                what = f"{code}, shape {shape}, grad {grad_dtype}, split {split}, clip {clip}, step {step}"
                for name, got, want in zip(("exp_avg", "exp_avg_sq", "exp_avg scales", "exp_avg_sq scales"), mine,
                                           ref):
                    assert torch.equal(_bytes(got), _bytes(want)), f"{name}: {what}"
                if split:  # the kernel writes the master back split: at a bf16 tie it moves one ulp (split_fp32)
                    ref_hi, ref_lo = torch.empty_like(hi), torch.empty_like(lo)
                    split_fp32(ref_p, ref_hi, ref_lo)
                    join_fp32(ref_hi, ref_lo, ref_p)
                    assert torch.equal(hi, ref_hi) and torch.equal(lo, ref_lo), f"split master: {what}"
                else:
                    assert torch.equal(p, ref_p), f"p: {what}"
                    assert torch.equal(copy, p.to(torch.bfloat16)), f"copy: {what}"
    with pytest.raises(TypeError, match="8-bit moments are both uint8 codes .q8. or both torch.float8_e4m3fn"):
        adamw_update_q8_(p, g.float(), p, p, *mine[2:], step=1, **hyper)
    with pytest.raises(ValueError, match="scales must be contiguous torch.uint8 of shape"):  # fp8's: E8M0 codes
        adamw_update_q8_(p, g.float(), *mine[:2], mine[2][..., :1], mine[3], step=1, **hyper)
    with pytest.raises(ValueError, match="scales must be contiguous torch.uint8"):  # fp8's codes, q8's scales
        adamw_update_q8_(p, g.float(), *mine[:2], mine[2].float(), mine[3].float(), step=1, **hyper)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """E4M3 codes as their bytes (torch.equal compares float8 as values: NaN never equal), others as they are."""
    return t.view(torch.uint8) if t.dtype == FP8 else t





def check_interpreted() -> None:
    check_codec("cpu")
    check_kernel("cpu")
    check_optimizer("cpu")


def test_q8_kernel_interpreted():
    run_interpreted("tests.core.test_moments_q8", "check_interpreted()")


@pytest.mark.gpu
def test_q8_kernel_on_gpu():
    check_codec("cuda")
    check_kernel("cuda")
    check_optimizer("cuda")


# ---------------------------------------------------------------------------------------------------------------
# Through the optimizer

OPT_SHAPES = [(3, 600), (300,), (2, 3, 40), (1,), (0, 4)]


def _opt_params(device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in OPT_SHAPES]
    return ps + [torch.nn.Parameter(torch.randn(7, 300, generator=gen).to(device).t())]  # not contiguous


def _opt_groups(ps):
    return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]


def _grads(ps, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) * 10.0 ** ((step + i) % 4 - 3) for i, p in enumerate(ps)]
            for step in range(steps)]


def _step(opt, ps, grads, step):
    for i, (p, g) in enumerate(zip(ps, grads)):
        p.grad = None if (i == 2 and step % 3 == 2) else g.to(p.device).as_strided(p.shape, p.stride()).clone()
    opt.step()


@pytest.mark.parametrize("code", CODE_DTYPES)
def test_foreach_q8_is_torch_adamw_with_round_tripped_moments(code):
    """The oracle: torch.optim.AdamW (fp32 state) whose moments are replaced after every step by their
    round trip through the 8-bit code (the first moment's code, the second's root's, squared back; fp8's root
    rounded under the parameter's own step count). The parameters must be bit for bit ours: the update from the
    unrounded moments, the stored moments the code's values."""
    from moetron.core.adamw import PrecisionAwareAdamW

    mine, ref = _opt_params(), _opt_params()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    opt = PrecisionAwareAdamW(_opt_groups(mine), state_dtype=code, kernel="foreach", chunk_numel=256, **kw)
    ref_opt = torch.optim.AdamW(_opt_groups(ref), foreach=True, **kw)
    for step, grads in enumerate(_grads(mine, 12)):
        _step(opt, mine, grads, step)
        _step(ref_opt, ref, grads, step)
        for q in ref:
            st = ref_opt.state.get(q)
            if not st or q.dim() < 2:  # 1-D parameters keep fp32 moments
                continue
            codes = [torch.empty(q.shape, dtype=code) for _ in range(2)]
            scales = [torch.empty(scale_shape(q.shape), dtype=scale_dtype(code)) for _ in range(2)]
            store_moments(st["exp_avg"].contiguous(), st["exp_avg_sq"].contiguous(), codes[0], scales[0], codes[1],
                          scales[1], int(st["step"]))
            m, v = load_moments(codes[0], scales[0], codes[1], scales[1])
            st["exp_avg"].copy_(m)
            st["exp_avg_sq"].copy_(v)
    for i, (p, q) in enumerate(zip(mine, ref)):
        assert torch.equal(p, q), f"param {i} {tuple(p.shape)}"
        st = opt.state[p]
        if p.dim() < 2:
            assert st["exp_avg"].dtype == torch.float32 and "exp_avg_scales" not in st
            assert torch.equal(st["exp_avg"], ref_opt.state[q]["exp_avg"]) if p.numel() else True
        elif p.numel():
            assert st["exp_avg"].dtype == code and st["exp_avg_scales"].shape == scale_shape(p.shape)
            assert st["exp_avg_scales"].dtype == scale_dtype(code)
            got = load_moments(st["exp_avg"].contiguous(), st["exp_avg_scales"], st["exp_avg_sq"].contiguous(),
                               st["exp_avg_sq_scales"])
            for key, value in zip(("exp_avg", "exp_avg_sq"), got):
                assert torch.equal(value, ref_opt.state[q][key]), f"{key}, param {i}"


@pytest.mark.parametrize("code", CODE_DTYPES)
def test_q8_trains_like_fp32_state(code):
    """A small regression trained 300 steps: 8-bit moments (either code) end within 2% of fp32 moments' loss
    decrease."""
    from moetron.core.adamw import PrecisionAwareAdamW

    def run(state_dtype):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 16))
        opt = PrecisionAwareAdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01,
                                  state_dtype=state_dtype, kernel="foreach")
        gen = torch.Generator().manual_seed(1)
        w = torch.randn(64, 16, generator=gen)
        losses = []
        for _ in range(300):
            x = torch.randn(128, 64, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ w))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return torch.tensor(losses)

    fp32, q8 = run(torch.float32), run(code)
    drop = fp32[:10].mean() - fp32[-20:].mean()
    assert drop > 0.5 * fp32[:10].mean()  # it learns
    assert abs(q8[-20:].mean() - fp32[-20:].mean()) < 0.02 * drop, (q8[-20:].mean(), fp32[-20:].mean())
    assert not torch.equal(fp32, q8)  # the moments really are held in 8 bits


@pytest.mark.parametrize("code", CODE_DTYPES)
def test_q8_state_dict_resumes_bit_exact_and_refuses_other_moments(tmp_path, code):
    from moetron.core.adamw import PrecisionAwareAdamW

    kw = dict(lr=1e-2, betas=(0.9, 0.95), state_dtype=code, kernel="foreach")
    name = "q8" if code == torch.uint8 else "fp8"
    a = _opt_params()
    opt_a = PrecisionAwareAdamW(_opt_groups(a), **kw)
    grads = _grads(a, 8)
    for step in range(4):
        _step(opt_a, a, grads[step], step)
    torch.save({"params": [p.detach().clone() for p in a], "opt": opt_a.state_dict()}, tmp_path / "ck.pt")
    for step in range(4, 8):
        _step(opt_a, a, grads[step], step)
    saved = torch.load(tmp_path / "ck.pt", weights_only=True)  # plain tensors: no pickled code
    b = [torch.nn.Parameter(t) for t in saved["params"]]
    opt_b = PrecisionAwareAdamW(_opt_groups(b), **kw)
    opt_b.load_state_dict(saved["opt"])
    assert opt_b.state[b[0]]["exp_avg"].dtype == code
    assert opt_b.state[b[0]]["exp_avg_scales"].dtype == scale_dtype(code)
    assert opt_b.state[b[1]]["exp_avg"].dtype == torch.float32  # 1-D: fp32 moments
    for step in range(4, 8):
        _step(opt_b, b, grads[step], step)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    c = _opt_params()
    with pytest.raises(ValueError, match=rf"8-bit \({name}\) moments for a parameter of shape \(3, 600\), for which "
                                         r"this optimizer keeps torch.bfloat16 ones: resume with the "
                                         r"optimizer.state_dtype"):
        PrecisionAwareAdamW(_opt_groups(c), lr=1e-2, state_dtype=torch.bfloat16).load_state_dict(saved["opt"])
    other = torch.float8_e4m3fn if code == torch.uint8 else torch.uint8  # the other code: refused too
    with pytest.raises(ValueError, match=rf"holds 8-bit \({name}\) moments .* keeps 8-bit \((q8|fp8)\) ones"):
        PrecisionAwareAdamW(_opt_groups(c), lr=1e-2, state_dtype=other).load_state_dict(saved["opt"])
    bf16 = PrecisionAwareAdamW(_opt_groups(c), lr=1e-2, betas=(0.9, 0.95), state_dtype=torch.bfloat16)
    _step(bf16, c, grads[0], 0)
    with pytest.raises(ValueError, match="holds torch.bfloat16 moments for a parameter of shape .* keeps 8-bit"):
        PrecisionAwareAdamW(_opt_groups(_opt_params()), **kw).load_state_dict(bf16.state_dict())


def test_q8_config():
    from moetron.core.adamw import PrecisionAwareAdamW
    from moetron.core.config import ConfigError
    from moetron.core.optim import OptimizerConfig
    from moetron.run.config import PretrainConfig

    for name, code in (("q8", torch.uint8), ("fp8", torch.float8_e4m3fn)):
        opt = OptimizerConfig(state_dtype=name).build(torch.nn.Linear(4, 4))
        assert isinstance(opt, PrecisionAwareAdamW) and opt.eight_bit and opt.state_dtype == code
        with pytest.raises(ConfigError, match=f"state_dtype={name} leave optimizer.fused unset"):
            OptimizerConfig(state_dtype=name, fused=True).build(torch.nn.Linear(4, 4))
        mx_copies = ["--precision.recipe=mxfp8", "--precision.backend=emulated", "--precision.expert_grads_bf16=true",
                     "--precision.expert_weight_copies=optimizer", "--precision.quantized_expert_copies=true"]
        refused = f"state_dtype={name} with precision.quantized_expert_copies is not built"
        with pytest.raises(ConfigError, match=refused):
            PretrainConfig().apply_overrides([f"--optimizer.state_dtype={name}", *mx_copies]).validate()
    PretrainConfig().apply_overrides(["--optimizer.state_dtype=bf16", *mx_copies]).validate()  # the fix it names
    with pytest.raises(ValueError, match="mx_cols .* 8-bit moments"):
        p = torch.nn.Parameter(torch.zeros(32, 32))
        PrecisionAwareAdamW([p], state_dtype=torch.uint8).add_compute_copies(
            {p: torch.zeros(32, 32, dtype=torch.bfloat16)}, mx_cols={p: torch.zeros(32, 32, dtype=torch.bfloat16)})


def check_optimizer(device: str) -> None:
    """The Triton path (kernel=triton) against the foreach path, 10 steps, with bf16 copies, both codes: the same
    update but for torch's CPU addcmul / addcdiv rounding order (a few fp32 ulps, tests/core/test_adamw_triton.py),
    which moves a moment across a code boundary now and then (and, fp8, changes the root's random bits, which
    hash its value): then one code apart."""
    from moetron.core.adamw import PrecisionAwareAdamW

    for code in CODE_DTYPES:
        mine, ref = _opt_params(device), _opt_params(device)
        copies = {p: torch.empty_like(p, dtype=torch.bfloat16) for p in mine[::2]}
        kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, state_dtype=code)
        opt = PrecisionAwareAdamW(_opt_groups(mine), kernel="triton", compute_copies=copies, **kw)
        ref_opt = PrecisionAwareAdamW(_opt_groups(ref), kernel="foreach", **kw)
        for step, grads in enumerate(_grads(mine, 10)):
            _step(opt, mine, grads, step)
            _step(ref_opt, ref, grads, step)
        for i, (p, q) in enumerate(zip(mine, ref)):
            assert ((p - q).abs() <= 2**-6 * 1e-2 * 10).all(), f"{code} param {i}"
            if not p.numel():
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                got, want = opt.state[p][key], ref_opt.state[q][key]
                assert got.dtype == want.dtype == (code if p.dim() >= 2 else torch.float32), f"{key}, param {i}"
                if got.dtype == torch.float32:  # 1-D: fp32 moments, as test_adamw_triton's tolerances
                    assert ((got - want).abs() <= 2**-20 * want.abs().max()).all(), f"{key}, param {i}"
                    continue
                got, want = _bytes(got).int(), _bytes(want).int()
                assert (got != want).float().mean() <= 0.02, f"{code} {key}, param {i}"
                assert ((got - want).abs() <= 1).float().mean() >= 0.99, f"{code} {key}, param {i}"
        assert torch.equal(mine[-1], ref[-1])  # the non-contiguous parameter took the foreach path
        assert all(torch.equal(c, p.to(torch.bfloat16)) for p, c in copies.items())


def test_second_moment_root_keeps_the_denominator_where_the_first_moment_is_kept():
    """An element whose gradient is 10^4 below its block's largest: coded directly its second moment (10^-8
    of the block's) would round to 0 while its first moment (10^-4) is kept, and its update m / (sqrt(v) + eps)
    would jump; held as its root (10^-4 of the block's) it stays within the code's error."""
    g = torch.full((1, QBLOCK), 1e-4)
    g[0, 0] = 1.0
    m, v = 0.1 * g, 0.05 * g * g
    codes = [torch.empty(g.shape, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.empty(scale_shape(g.shape)) for _ in range(2)]
    store_moments(m, v, codes[0], scales[0], codes[1], scales[1])
    m2, v2 = load_moments(codes[0], scales[0], codes[1], scales[1])
    ratio = (m2 / v2.sqrt()) / (m / v.sqrt())
    assert torch.all((ratio - 1).abs() < 0.15), ratio[0, :3]
    direct_codes, direct_scales = torch.empty(g.shape, dtype=torch.uint8), torch.empty(scale_shape(g.shape))
    quantize_(v, direct_codes, direct_scales, False)
    assert dequantize(direct_codes, direct_scales, False)[0, 1] == 0  # what coding v itself would have kept
    # sqrt_rn is correctly rounded where torch's CPU sqrt need not be: at every fp32 the nearest of its neighbours
    x = torch.rand(10_000, generator=torch.Generator().manual_seed(4)) * 100
    y = sqrt_rn(x).double()
    err = (y * y - x.double()).abs()
    for other in (torch.nextafter(y.float(), torch.tensor(0.0)), torch.nextafter(y.float(), torch.tensor(1e3))):
        assert torch.all(err <= (other.double() ** 2 - x.double()).abs())


def test_kernel_tables_hold_the_codebooks():
    t = kernel_tables(torch.device("cpu"))
    assert t.shape == (TABLE.SIZE,) and torch.equal(t[TABLE.DEC_M:TABLE.DEC_M + 256], codebook(True))
    assert torch.equal(t[TABLE.DEC_V:TABLE.DEC_V + 256], codebook(False))
    assert kernel_tables("cpu") is t  # made once a device


def test_q8_kernel_compiles_for_sm90_without_spills():
    """The AdamW kernel with 8-bit moments compiles for Hopper on the CPU (ptxas ships with Triton) at the default
    rows a program, in both codes and both its forms (split master with bf16 gradients and the clip scale; fp32
    master with a bf16 copy), without spilling registers or keeping a stack, and within 128 registers a thread
    (at least 16 warps an SM resident: a memory-bound kernel needs them in flight)."""
    triton = pytest.importorskip("triton")

    from moetron.core import adamw_triton as K
    from tests.core.test_precision_fp8 import _compile_sm90, assert_no_spills

    scalars = {n: "fp32" for n in ("decay", "lerp_weight", "beta2", "one_minus_beta2", "bc2_sqrt", "eps",
                                "neg_step_size")}
    for fp8, split in ((fp8, split) for fp8 in (False, True) for split in (True, False)):
        codes, scales = ("*fp8e4nv", "*u8") if fp8 else ("*u8", "*fp32")
        values = dict(p_ptr="*i16" if split else "*fp32", g_ptr="*bf16" if split else "*fp32", m_ptr=codes,
                      v_ptr=codes, ms_ptr=scales, vs_ptr=scales, out_ptr="*i16" if split else "*bf16",
                      scale_ptr="*fp32", tab_ptr=scales if fp8 else "*fp32", R=4096, C=2048, NB=8, sr_key="i32",
                      **scalars)
        compiled = _compile_sm90(K._adamw_q8_kernel, triton.Config({}, num_warps=4, num_stages=1), values,
                                 dict(GRAD_BF16=split, LERP_SMALL=True, WRITE_OUT=not split, GRAD_SCALE=split,
                                      SPLIT=split, TR=K.FP8_ROWS if fp8 else K.Q8_ROWS, QB=QBLOCK, FP8=fp8,
                                      HW=True))
        assert_no_spills(compiled, f"_adamw_q8_kernel fp8={fp8} split={split}")
        regs = _registers(compiled)
        assert regs is None or regs <= 128, (fp8, split, regs)


def _registers(compiled) -> int | None:
    """Registers a thread of a compiled kernel (cuobjdump -res-usage, shipped with Triton), or None without it."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1))


def test_a_checkpoint_with_other_moments_is_refused(tmp_path):
    """A DCP checkpoint saved with bf16 moments, loaded into an optimizer with 8-bit ones: one CheckpointError that
    names the scales the checkpoint lacks (its key check); saved with q8's, loaded into fp8's (the same keys and
    shapes): one that names the codes' dtypes; nothing loaded half-way."""
    from torch import nn

    from moetron.core.checkpoint import CheckpointConfig, CheckpointError, Checkpointer
    from moetron.core.optim import OptimizerConfig

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 16))

    def train(m, opt):
        ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
        loss = nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.roll(1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()

    saved = model()
    opt = OptimizerConfig(lr=1e-2, state_dtype="bf16").build(saved)
    train(saved, opt)
    cp = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    cp.save(1, saved, opt, {}, {})
    fresh = model()
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(CheckpointError, match="keys missing from the checkpoint: .*exp_avg_scales"):
        cp.load(cp.latest(), fresh, OptimizerConfig(lr=1e-2, state_dtype="q8").build(fresh), {})
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), before))
    # q8's codes and scales into fp8's (the same keys and shapes: DCP would cast the bytes as numbers)
    q8 = model()
    opt = OptimizerConfig(lr=1e-2, state_dtype="q8").build(q8)
    train(q8, opt)
    cp8 = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt8")))
    cp8.save(1, q8, opt, {}, {})
    with pytest.raises(CheckpointError, match=r"dtype mismatches that a cast would not convert .*exp_avg "
                                              r"\(checkpoint torch.uint8, now torch.float8_e4m3fn\)"):
        cp8.load(cp8.latest(), fresh, OptimizerConfig(lr=1e-2, state_dtype="fp8").build(fresh), {})
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), before))
