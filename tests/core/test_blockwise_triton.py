"""The fused FP8 blockwise quantization kernels (core/precision/blockwise_triton.py) against the
torch reference (core/precision/blockwise.py), bit for bit: 1x128 rows, the transposed token tiles
(plain, padded to 128, and gathered through grouping.padded_source_rows = quantizing pad_groups'
output), outer-major scales, 128x128 weights and their transpose (together and each alone); bf16 and fp32 inputs, wide
dynamic range, zero and tiny blocks, inf and NaN; the SwiGLU computed inside the 1x128 kernel (its product and
h's gradient) against swiglu_triton's kernels then the plain quantization (bit for bit: they share the
SwiGLU's math) and against float64 (within e4m3's rounding: the independent check of that math). Under
TRITON_INTERPRET=1 on the CPU, and on the GPU."""

import math

import pytest
import torch
from tests.interpreted import run_interpreted



def _same(got, want, what):
    """Equal bits, NaN where the reference has NaN (a NaN's payload bits aside)."""
    got8, want8 = got.float().isnan(), want.float().isnan()
    assert torch.equal(got8, want8), what
    assert torch.equal(got.view(torch.uint8)[~got8], want.view(torch.uint8)[~want8]), what


def check_blockwise_triton(device: str) -> None:
    """Each autotune config of the 1x128 kernel alone (both warp counts on the GPU), then plain x's rows and
    tokens from the one-read kernel (blockwise_triton.TOKENS_FROM_TILE: the tokens transposed in registers):
    the same bits."""
    from moetron.core.precision import blockwise_triton as bt

    default = bt.TOKENS_FROM_TILE
    try:
        bt.TOKENS_FROM_TILE = False
        for config in bt._quantize_configs(device == "cpu"):
            bt.use_quantize_configs([config])
            _check_blockwise_triton(device)
        bt.use_quantize_configs(bt.QUANTIZE_CONFIGS)
        bt.TOKENS_FROM_TILE = True
        _check_blockwise_triton(device)
    finally:
        bt.use_quantize_configs(bt.QUANTIZE_CONFIGS)
        bt.TOKENS_FROM_TILE = default


def _check_blockwise_triton(device: str) -> None:
    from moetron.core.precision.blockwise import quantize_128x128, quantize_1x128
    from moetron.core.precision.blockwise_triton import quantize_128x128_triton, quantize_1x128_fused
    from moetron.core.precision.grouping import pad_groups, padded_source_rows

    g = torch.Generator().manual_seed(0)
    R, C = 300, 384
    x = torch.randn(R, C, generator=g) * torch.exp2(torch.randint(-60, 60, (R, C // 32), generator=g).float()
                                                    ).repeat_interleave(32, dim=1)
    x[0, :128] = 0.0
    x[1, :128] *= 2.0 ** -100  # scales clamp at 2^-127
    x[2, 5], x[250, 7], x[7, 200] = math.inf, -math.inf, math.nan
    x[3, 128:136] = torch.tensor([449.0, 1.0625, 1.1875, 2 ** -10, 3 * 2 ** -10, -0.0, 2 ** -9, 448.0])
    x = x.to(device)
    for dtype in (torch.float32, torch.bfloat16):
        xx = x.to(dtype)
        (rd, rs), (td, ts) = quantize_1x128_fused(xx, rows_out=304)  # 4 zero rows, tokens padded to 384
        want_d, want_s = quantize_1x128(torch.cat([xx, xx.new_zeros(4, C)]), -1)
        _same(rd, want_d, (dtype, "rows"))
        assert torch.equal(rs, want_s)
        want_d, want_s = quantize_1x128(torch.cat([xx, xx.new_zeros(84, C)]).t().contiguous(), -1)
        _same(td, want_d, (dtype, "tokens"))
        assert torch.equal(ts, want_s)
        (rd, rs), none = quantize_1x128_fused(xx[:256], tokens=False, outer_major=True)
        assert none is None and rs.stride() == (1, 256)
        want_d, want_s = quantize_1x128(xx[:256], -1)
        _same(rd, want_d, (dtype, "outer-major rows"))
        assert torch.equal(rs, want_s)
        offsets = torch.tensor([40, 40, 140, 290], device=device)  # an empty expert, 10 rows past the end
        src, _ = padded_source_rows(offsets, R, 128)
        (rd, rs), (td, ts) = quantize_1x128_fused(xx, src_rows_P=src)
        want_d, want_s = quantize_1x128(pad_groups(xx, offsets, 128)[0].t().contiguous(), -1)
        _same(td, want_d, (dtype, "gathered tokens"))
        assert torch.equal(ts, want_s)
        want_d, want_s = quantize_1x128(xx, -1)
        _same(rd[:290], want_d[:290], (dtype, "gathered rows"))  # rows past the end: unspecified
        assert torch.equal(rs[:290], want_s[:290])
    w = torch.randn(3, 256, 384, generator=g) * torch.logspace(-3, 3, 384)
    w[1, :128, :128] = 0.0
    w[2, 5, 5] = math.inf
    w = w.to(device)
    d, dt, s = quantize_128x128_triton(w)
    want_d, want_s = quantize_128x128(w)
    _same(d, want_d, "weight")
    _same(dt, want_d.transpose(1, 2).contiguous(), "weight^T")
    assert dt.is_contiguous() and torch.equal(s, want_s)
    # each alone (a compiled step's forward and backward), its tile read once: the same bits
    d1, none, s1 = quantize_128x128_triton(w, data_t=False)
    none2, dt1, s2 = quantize_128x128_triton(w, data=False)
    assert none is None and none2 is None
    _same(d1, want_d, "weight alone")
    _same(dt1, want_d.transpose(1, 2).contiguous(), "weight^T alone")
    assert torch.equal(s1, want_s) and torch.equal(s2, want_s)
    _check_swiglu(device, g)


def _check_swiglu(device: str, g: torch.Generator) -> None:
    """quantize_1x128_swiglu: the SwiGLU product and h's gradient computed in the kernel give the bits of
    swiglu_triton's kernels' bf16 output quantized by quantize_1x128_fused: rows (padded, and where
    gathered) and tokens (padded, gathered, K-block-major scales)."""
    from moetron.core.precision.blockwise_triton import quantize_1x128_fused, quantize_1x128_swiglu
    from moetron.core.precision.grouping import padded_source_rows
    from moetron.core.precision.swiglu_triton import swiglu_backward, swiglu_forward

    R, F = 300, 256
    h = (torch.randn(R, 2 * F, generator=g) * torch.logspace(-2, 1, 2 * F)).bfloat16().to(device)
    h[5:9] = 0.0
    grad_act = (torch.randn(R, F, generator=g) * torch.logspace(-3, 2, F)).bfloat16().to(device)
    offsets = torch.tensor([40, 40, 140, 290], device=device)
    src, _ = padded_source_rows(offsets, R, 128)
    act, grad_h = swiglu_forward(h), swiglu_backward(h, grad_act, want_act=False)[1]
    for ga, made in ((None, act), (grad_act, grad_h)):
        for kw, rows in ((dict(rows_out=304), 304), (dict(src_rows_P=src, tokens_outer_major=True), 290)):
            got = quantize_1x128_swiglu(h, ga, **kw)
            want = quantize_1x128_fused(made, **kw)
            what = ("gradient" if ga is not None else "product", tuple(kw))
            _same(got[0][0][:rows], want[0][0][:rows], what + ("rows",))
            assert torch.equal(got[0][1][:rows], want[0][1][:rows]), what
            _same(got[1][0], want[1][0], what + ("tokens",))
            assert torch.equal(got[1][1], want[1][1]) and got[1][1].stride() == want[1][1].stride(), what
    # and against an independent reference: float64 SwiGLU (and its gradient) from h, the kernels' e4m3
    # rows dequantized, within e4m3's half step (2^-4 relative; 2^-10 of the block's scale below its normals)
    # plus the bf16 roundings on the way (2^-7)
    from moetron.core.precision.blockwise import dequantize_1x128

    g64, u64, ga64 = (t.double().cpu() for t in (*h.chunk(2, dim=-1), grad_act))
    sig = torch.sigmoid(g64)
    refs = {"product": (None, g64 * sig * u64),
            "gradient": (grad_act, torch.cat([ga64 * u64 * sig * (1 + g64 * (1 - sig)), ga64 * g64 * sig], dim=-1))}
    for what, (ga, ref) in refs.items():
        (d, sc), _ = quantize_1x128_swiglu(h, ga, tokens=False)
        got = dequantize_1x128(d.cpu(), sc.cpu()).double()
        step = sc.cpu().double().repeat_interleave(128, dim=1) * 2.0 ** -10
        assert ((got - ref).abs() <= (2.0 ** -4 + 2.0 ** -7) * ref.abs() + step).all(), what
    with pytest.raises(ValueError, match="bf16"):
        quantize_1x128_swiglu(h.float())
    with pytest.raises(ValueError, match="gradient"):
        quantize_1x128_swiglu(h, grad_act.float())


def test_padded_source_rows_is_pad_groups():
    from moetron.core.precision.grouping import gather_rows, pad_groups, padded_source_rows

    x = torch.randn(10, 3)
    offsets = torch.tensor([3, 3, 8])
    src, padded = padded_source_rows(offsets, 10, 4)
    assert src.tolist() == [0, 1, 2, -1, 3, 4, 5, 6, 7, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1]
    out, padded2 = pad_groups(x, offsets, 4)
    assert torch.equal(padded, padded2) and torch.equal(gather_rows(x, src), out)


def test_interpreted_matches_reference():
    run_interpreted("tests.core.test_blockwise_triton", "check_blockwise_triton('cpu')", timeout=300)


@pytest.mark.gpu
def test_on_gpu_matches_reference():
    check_blockwise_triton("cuda")
