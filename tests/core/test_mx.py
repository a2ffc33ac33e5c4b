"""MX quantization (core/precision/mx.py) against two independent references: a naive Python loop
written from the OCP MX v1.0 definition (every E4M3 value enumerated, nearest with ties to even),
and torchao's ``to_mx`` (a test-only dependency; skipped where it is not installed), bit for bit."""

import math

import pytest
import torch

from moetron.core.precision.mx import E8M0_NAN, dequantize_mx, quantize_mx
from tests.interpreted import run_interpreted

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

E4M3_VALUES = sorted({float(v) for v in torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
                      if math.isfinite(float(v))})


def _nearest_e4m3(v: float) -> float:
    """Round to the nearest E4M3 value, ties to the even encoding, saturating at +-448."""
    v = max(-448.0, min(448.0, v))
    best = min(E4M3_VALUES, key=lambda c: abs(c - v))
    ties = [c for c in E4M3_VALUES if abs(c - v) == abs(best - v)]
    if len(ties) > 1:  # the one whose encoding's last mantissa bit is 0
        best = next(c for c in ties if int(torch.tensor(c).to(torch.float8_e4m3fn).view(torch.uint8)) % 2 == 0)
    return best


def _naive_block(values: list[float], mode: str) -> tuple[int, list[float]]:
    amax = max(abs(v) for v in values)
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return 255, [math.nan] * len(values)
    if amax == 0:
        exp = -127
    elif mode == "floor":
        exp = math.frexp(amax)[1] - 1 - 8                # floor(log2 amax) - floor(log2 448)
    else:
        d = float(torch.tensor(amax, dtype=torch.float32) / 448.0)  # the fp32 division, as hardware does
        m, e = math.frexp(d)
        exp = e - 1 if m == 0.5 else e                   # ceil(log2 d)
    exp = max(-127, min(127, exp))
    return exp + 127, [_nearest_e4m3(v / 2.0 ** exp) for v in values]


def _wide_range(shape, seed, lo=-40, hi=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    # a different magnitude per block of 32 along the last dim, and some blocks with one outlier
    blocks = shape[-1] // 32
    e = torch.randint(lo, hi, (*shape[:-1], blocks), generator=g).repeat_interleave(32, dim=-1)
    x = x * torch.exp2(e.float())
    x.view(-1)[::97] *= 300.0
    return x


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_against_the_naive_definition(mode):
    x = _wide_range((3, 128), 0)
    x[0, :32] = 0.0                                            # a zero block
    x[1, 32:64] = torch.linspace(-448, 448, 32)                # the 448 boundary
    x[1, 64:96] = torch.tensor([449.0] + [1.0625, 1.1875, 2 ** -10, 3 * 2 ** -10, 2 ** -9] * 6 + [1.0])  # ties, subnormals
    x[2, :32] = x[2, :32] * 2.0 ** -125                        # tiny: clamps at 2^-127
    data, scale = quantize_mx(x, scale_mode=mode)
    for r in range(3):
        for b in range(4):
            code, values = _naive_block(x[r, 32 * b:32 * (b + 1)].tolist(), mode)
            assert int(scale[r, b]) == code, (r, b)
            assert data[r, 32 * b:32 * (b + 1)].float().tolist() == values, (r, b)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_against_torchao(mode):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    # Blocks whose scale clamps at 2^-127 are left out: torchao divides those by 2^-126 (floor) or 1
    # (rceil) instead of 2^-127 (test_against_the_naive_definition covers them).
    x = _wide_range((64, 512), 1)
    ao_mode = ScaleCalculationMode.FLOOR if mode == "floor" else ScaleCalculationMode.RCEIL
    ao_scale, ao_data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, ao_mode)
    data, scale = quantize_mx(x, scale_mode=mode)
    assert torch.equal(scale, ao_scale.view(torch.uint8))
    assert torch.equal(data.view(torch.uint8), ao_data.view(torch.uint8))


def test_axis_and_dequantize():
    x = _wide_range((96, 64), 2)
    data0, scale0 = quantize_mx(x, axis=0)                    # blocks run down the columns
    data1, scale1 = quantize_mx(x.t().contiguous(), axis=-1)
    assert scale0.shape == (3, 64) and data0.shape == x.shape
    assert torch.equal(scale0, scale1.t()) and torch.equal(data0.view(torch.uint8), data1.t().view(torch.uint8))
    x_hat = dequantize_mx(data0, scale0, axis=0)
    assert x_hat.dtype == torch.float32
    # dequantized values are MX-representable: quantizing them again is exact
    d2, s2 = quantize_mx(x_hat, axis=0)
    assert torch.equal(dequantize_mx(d2, s2, axis=0), x_hat)
    assert ((x_hat - x).abs() <= x.abs().amax(0, keepdim=True).repeat_interleave(1, 0) * 2 ** -3).all()


def test_nan_and_inf_blocks_dequantize_to_nan():
    x = torch.ones(2, 64)
    x[0, 3] = math.nan
    x[1, 40] = math.inf
    data, scale = quantize_mx(x)
    assert scale.tolist() == [[E8M0_NAN, 119], [119, E8M0_NAN]]  # rceil: ceil(log2(1 / 448)) = -8
    out = dequantize_mx(data, scale)
    assert out[0, :32].isnan().all() and out[1, 32:].isnan().all()
    assert torch.equal(out[0, 32:], x[0, 32:]) and torch.equal(out[1, :32], x[1, :32])


def test_bad_shapes():
    with pytest.raises(ValueError, match="must divide the quantized dimension"):
        quantize_mx(torch.ones(4, 48))
    with pytest.raises(ValueError, match="scale_mode"):
        quantize_mx(torch.ones(4, 32), scale_mode="ceil")
    data, scale = quantize_mx(torch.ones(4, 64))
    with pytest.raises(ValueError, match="does not match"):
        dequantize_mx(data, scale[:, :1])


def _triton_vs_reference(device: str) -> None:
    """The Triton kernel against the reference: every scale code, and every data bit of the blocks
    whose scale is finite (a NaN-scale block's data is unspecified), rows and columns, both modes."""
    from moetron.core.precision.mx_triton import quantize_mx_triton

    x = _wide_range((96, 256), 3)
    x[0, :32] = 0.0
    x[1, :32] *= 2.0 ** -125
    x[2, 5], x[3, 40] = math.nan, math.inf
    x[4, 32:64] = torch.tensor([449.0, 1.0625, 1.1875, 2 ** -10, 3 * 2 ** -10, -0.0, 2 ** -9, 448.0] * 4)
    x = x.to(device)
    for mode in ("floor", "rceil"):
        # x[:, :160]: rows of 5 blocks, the last column tile part-filled (its empty blocks once
        # overwrote the next row's scale codes)
        for xx, axis in ((x, -1), (x[:, :160].contiguous(), -1), (x.t().contiguous().t(), 0), (x[:64, :128].t(), 0)):
            want_d, want_s = quantize_mx(xx, axis=axis, scale_mode=mode)
            got_d, got_s = quantize_mx_triton(xx, axis=axis, scale_mode=mode)
            assert torch.equal(got_s, want_s), (mode, axis)
            finite = (want_s != E8M0_NAN).repeat_interleave(32, dim=1 if axis == -1 else 0)
            assert torch.equal(got_d.view(torch.uint8)[finite], want_d.view(torch.uint8)[finite]), (mode, axis)


@pytest.mark.gpu
def test_triton_on_gpu_matches_reference():
    _triton_vs_reference("cuda")


def _triton_qdq_vs_reference(device: str) -> None:
    """The fused quantize-dequantize (bf16 and fp32 out), the dequantize kernel and the gathered
    rows (a padded wgrad operand read through an index) against the reference, bit for bit."""
    from moetron.core.precision.grouping import pad_groups, padded_source_rows
    from moetron.core.precision.mx_triton import dequantize_mx_triton, mx_qdq_triton, quantize_mx_triton

    # scales clamp at both ends, bf16 subnormal products; 160 columns: a part-filled last tile both
    # ways (128 columns a program along rows, 256 along columns); 64 rows (~0.2 s a program interpreted)
    x = _wide_range((64, 160), 5, lo=-130, hi=120)
    x[0, :32] = 0.0
    x[2, 5], x[3, 40] = math.nan, math.inf
    x[4, 32:64] = torch.tensor([449.0, 1.0625, 1.1875, 2 ** -10, 3 * 2 ** -10, -0.0, 2 ** -9, 448.0] * 4)
    x = x.to(device)

    def same(got, want, what):
        assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan()), what
        assert torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32)[~got.isnan()],
                           want.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32)[~want.isnan()]), what

    for mode in ("floor", "rceil"):
        for xx, axis in ((x, -1), (x, 0), (x.bfloat16(), -1), (x.bfloat16(), 0), (x[:64, :128].t(), 0)):
            data, scale = quantize_mx(xx, axis=axis, scale_mode=mode)
            ref = dequantize_mx(data, scale, axis=axis)
            for dtype in (torch.bfloat16, torch.float32):
                same(mx_qdq_triton(xx, axis, mode, dtype), ref.to(dtype), (mode, axis, dtype, "qdq"))
                same(dequantize_mx_triton(data, scale, axis=axis, out_dtype=dtype), ref.to(dtype), (mode, axis, "deq"))
            out, d2, s2 = mx_qdq_triton(xx, axis, mode, payload=True)
            finite = (scale != E8M0_NAN).repeat_interleave(32, dim=1 if axis == -1 else 0)
            assert torch.equal(s2, scale) and torch.equal(d2.view(torch.uint8)[finite], data.view(torch.uint8)[finite])
        offsets = torch.tensor([10, 10, 40, 60], device=device)  # an empty group, rows 60.. dropped
        src, _ = padded_source_rows(offsets, x.shape[0], 32)
        padded, _ = pad_groups(x, offsets, 32)
        want_d, want_s = quantize_mx(padded, axis=0, scale_mode=mode)
        got_d, got_s = quantize_mx_triton(x, axis=0, scale_mode=mode, src_rows=src)
        assert torch.equal(got_s, want_s)
        finite = (want_s != E8M0_NAN).repeat_interleave(32, dim=0)
        assert torch.equal(got_d.view(torch.uint8)[finite], want_d.view(torch.uint8)[finite])
        same(mx_qdq_triton(x, 0, mode, src_rows=src), dequantize_mx(want_d, want_s, axis=0).bfloat16(), "gathered")


# Run in one interpreted subprocess (tests/interpreted.py), each test checking its own.
INTERPRETED = (*(f"_with_lean({lean}, '{check}', 'cpu')" for check in ("_triton_qdq_vs_reference", "_triton_vs_reference")
                 for lean in (False, True)), "_rows_and_cols_vs_reference('cpu')")


def _with_lean(lean: bool, check: str, *args) -> None:
    """This module's ``check(*args)`` with mx_triton.LEAN set to ``lean`` (the MX kernel's two arithmetics)."""
    from moetron.core.precision import mx_triton

    saved, mx_triton.LEAN = mx_triton.LEAN, lean
    try:
        globals()[check](*args)
    finally:
        mx_triton.LEAN = saved


@pytest.mark.parametrize("lean", [False, True])
def test_triton_qdq_interpreted_matches_reference(lean):
    run_interpreted("tests.core.test_mx", f"_with_lean({lean}, '_triton_qdq_vs_reference', 'cpu')", timeout=300)


@pytest.mark.parametrize("lean", [False, True])
def test_triton_interpreted_matches_reference(lean):
    run_interpreted("tests.core.test_mx", f"_with_lean({lean}, '_triton_vs_reference', 'cpu')", timeout=300)


@pytest.mark.gpu
@pytest.mark.parametrize("lean", [False, True])
def test_triton_qdq_on_gpu_matches_reference(lean):
    _with_lean(lean, "_triton_qdq_vs_reference", "cuda")


@pytest.mark.gpu
def test_triton_lean_on_gpu_matches_reference():
    _with_lean(True, "_triton_vs_reference", "cuda")


def test_lean_mx_kernel_rounds_with_the_conversion_instruction_on_sm90():
    """mx_triton.LEAN on SM90: the E4M3 rounding is cvt.rn.satfinite, the bf16 output cvt.rn.bf16,
    and none of the bit paths' constants (round_to_e4m3's 1.5 x 2^14) remain."""
    import triton

    from moetron.core.precision import mx_triton
    from tests.core.test_precision_fp8 import _compile_sm90

    ptrs = {"x_ptr": "*i16", "src_ptr": "*i32", "out_ptr": "*bf16", "data_ptr": "*fp8e4nv", "scale_ptr": "*u8"}
    ints = dict(P=65536, R=65536, C=4096, s_xp=4096, s_xc=1, s_op=4096, s_oc=1, s_dp=4096, s_dc=1, s_sp=128, s_sc=1)
    constexprs = dict(ALONG_C=True, GATHER=False, WRITE_OUT=True, WRITE_PAYLOAD=True, FLOOR=False, IN_BF16=True,
                      OUT_BF16=True, TP=32, TC=128, HW=True, LEAN_MATH=True)
    ptx = _compile_sm90(mx_triton._mx_quantize_kernel, triton.Config({}, num_warps=4, num_stages=1),
                        {**ptrs, **ints}, constexprs).asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "cvt.rn.bf16" in ptx
    assert "0f46C00000" not in ptx and "min.f32" not in ptx  # no bit rounding, no clamp before the conversion


def _rows_and_cols_vs_reference(device: str) -> None:
    """mx_rows_and_cols_triton (one read, both quantizations) against the reference's two, bit for
    bit: the rows (every row, those past the last group included), and the columns of the padded,
    gathered view as payload and as bf16; bf16 and fp32 inputs, both modes; the dense (ungathered)
    case with rows that are not a whole block."""
    from moetron.core.precision.grouping import pad_groups, padded_source_rows
    from moetron.core.precision.mx_triton import mx_rows_and_cols_triton

    # 160 columns: the last 128-column tile part-filled; 64 rows (the interpreter pays ~0.2 s a program)
    x = _wide_range((64, 160), 7, lo=-130, hi=120)
    x[0, :32] = 0.0
    x[2, 5], x[3, 40], x[50, 7] = math.nan, math.inf, -math.inf
    x[4, 32:64] = torch.tensor([449.0, 1.0625, 1.1875, 2 ** -10, 3 * 2 ** -10, -0.0, 2 ** -9, 448.0] * 4)
    x = x.to(device)

    def bits(t):
        return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.uint8)

    def same(got, want, what):
        assert got.dtype == want.dtype and got.shape == want.shape, what
        assert torch.equal(got.isnan(), want.isnan()), what
        assert torch.equal(bits(got)[~got.isnan()], bits(want)[~want.isnan()]), what

    def qdq(t, axis, mode):
        return dequantize_mx(*quantize_mx(t, axis=axis, scale_mode=mode), axis=axis).bfloat16()

    offsets = torch.tensor([10, 10, 40, 60], device=device)  # an empty group; rows 60.. in no group
    src, _ = padded_source_rows(offsets, x.shape[0], 32)
    for mode in ("floor", "rceil"):
        for xx in (x, x.bfloat16()):
            padded, _ = pad_groups(xx, offsets, 32)
            for view, s, ends in ((padded, src, offsets), (torch.cat([xx[:60], xx.new_zeros(4, 160)]), None, None)):
                src_x = xx if s is not None else xx[:60]
                rows, data, scale = mx_rows_and_cols_triton(src_x, s, ends, mode, cols_payload=True)
                same(rows, qdq(src_x, -1, mode), (mode, xx.dtype, s is None, "rows"))
                want_d, want_s = quantize_mx(view, axis=0, scale_mode=mode)
                assert torch.equal(scale, want_s), (mode, xx.dtype, s is None, "scale")
                finite = (want_s != E8M0_NAN).repeat_interleave(32, dim=0)
                assert torch.equal(bits(data)[finite], bits(want_d)[finite]), (mode, xx.dtype, s is None, "data")
                rows2, cols = mx_rows_and_cols_triton(src_x, s, ends, mode, cols_payload=False)
                same(rows2, rows, "rows again")
                same(cols, qdq(view, 0, mode), (mode, xx.dtype, s is None, "cols"))


def test_rows_and_cols_interpreted_matches_reference():
    run_interpreted("tests.core.test_mx", "_rows_and_cols_vs_reference('cpu')", timeout=600)


@pytest.mark.gpu
def test_rows_and_cols_on_gpu_matches_reference():
    _rows_and_cols_vs_reference("cuda")
