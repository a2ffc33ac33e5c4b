"""The fp8_rowwise recipe (core/precision/fp8_rowwise.py): the quantization against an independent
per-line reference, the emulated GEMMs' outputs and gradients against float64 on the dequantized
operands, the config's errors, a tiny MoE trained through the trainer, and on the GPU the native
scaled GEMMs (torch._scaled_mm, torch._scaled_grouped_mm) against the emulation."""

import math

import pytest
import torch

from moetron.core.config import ConfigError
from moetron.core.precision import PrecisionConfig
from moetron.core.precision.fp8_rowwise import (ALIGN, Fp8RowwiseGemm, dequantize_group_cols, dequantize_rows,
                                                quantize_group_cols, quantize_rows)
from moetron.core.precision.grouping import padded_source_rows

from tests.core.test_precision_recipes import assert_trains_close_to_fp32
from tests.interpreted import run_interpreted

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)


def _line_reference(v: list[float]) -> tuple[list[float], float]:
    """One line quantized with Python floats: scale 2^ceil(log2(amax / 448)) (2^-127 for a zero line),
    elements v / scale rounded to E4M3 (torch's cast of a single float, exact for these)."""
    amax = max(abs(a) for a in v)
    if amax == 0:
        scale = 2.0 ** -127
    else:
        m, e = math.frexp(amax / 448.0)  # amax / 448 = m 2^e, 0.5 <= m < 1: ceil(log2) = e, or e - 1 at m = 0.5
        scale = 2.0 ** (e - 1 if m == 0.5 else e)
    data = [float(torch.tensor(a / scale, dtype=torch.float32).to(torch.float8_e4m3fn).float()) for a in v]
    return data, scale


def test_quantize_rows_against_a_per_line_reference():
    torch.manual_seed(0)
    x = torch.randn(6, 40) * torch.logspace(-30, 30, 6)[:, None]  # wide dynamic range, one per row
    x[2] = 0.0  # a zero row
    x[3] = x[3] / x[3].abs().max()
    x[3, 5] = 448.0 * 2.0 ** 10  # a 448 boundary: the scale is exactly 2^10, the element 448
    x[4, :3] = torch.tensor([1e-40, -3e-39, 0.0])  # subnormal fp32 inputs
    data, scale = quantize_rows(x, -1)
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (6,)
    for r in range(x.shape[0]):
        ref_data, ref_scale = _line_reference(x[r].tolist())
        assert scale[r].item() == ref_scale, r
        assert data[r].float().tolist() == ref_data, r
    assert scale[3].item() == 2.0 ** 10 and data[3, 5].item() == 448.0
    # along dim 0 (the dense wgrad's operands): the transposed lines
    d0, s0 = quantize_rows(x, 0)
    dt, st = quantize_rows(x.t(), -1)
    assert torch.equal(s0, st) and torch.equal(d0.t().float(), dt.float())
    # dequantized in bf16 exactly (power-of-two scales on E4M3 values)
    deq = dequantize_rows(data, scale)
    assert torch.equal(deq.to(torch.bfloat16).float(), deq)


def test_group_cols_are_rowwise_per_expert_and_padded():
    torch.manual_seed(1)
    sizes = [5, 0, 21, 16]
    R = sum(sizes) + 3  # rows past the last group: not in any group
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(R, 24, dtype=torch.bfloat16) * torch.logspace(-3, 3, 24)
    src, padded = padded_source_rows(offsets, R, ALIGN)
    assert all(int(p) % ALIGN == 0 for p in padded)
    data_CP, scale_EC = quantize_group_cols(x, src, padded)
    assert data_CP.shape == (24, src.numel()) and data_CP.is_contiguous() and scale_EC.shape == (4, 24)
    starts, ends = [0] + offsets[:-1].tolist(), offsets.tolist()
    pstarts = [0] + padded[:-1].tolist()
    for e, (s, t) in enumerate(zip(starts, ends)):
        if s == t:  # an empty expert: zero scales' codes (2^-127), no data
            assert (scale_EC[e] == 2.0 ** -127).all()
            continue
        ref_d, ref_s = quantize_rows(x[s:t], 0)  # the group's rows alone
        assert torch.equal(scale_EC[e], ref_s), e
        got = data_CP[:, pstarts[e]:pstarts[e] + t - s].t()
        assert torch.equal(got.float(), ref_d.float()), e
        assert (data_CP[:, pstarts[e] + t - s:padded[e]].float() == 0).all()  # the padding
    full = dequantize_group_cols(data_CP, scale_EC, padded)
    assert full.shape == (src.numel(), 24)


def check_group_cols_amax_kernel(device: str) -> None:
    """The Triton per-group column amax against the torch reference (scatter_reduce), bit for bit:
    ragged groups (an empty one, one past a 32-row block), a column count not a multiple of 64,
    rows past the last group, a wide dynamic range."""
    from moetron.core.precision.fp8_rowwise import group_cols_amax

    torch.manual_seed(5)
    sizes = [37, 0, 70, 16, 1]
    R = sum(sizes) + 5
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
    x = (torch.randn(R, 100) * torch.logspace(-20, 20, 100)).to(torch.bfloat16).to(device)
    src, padded = padded_source_rows(offsets, R, ALIGN)
    got = group_cols_amax(x, src, padded, kernel="triton")
    want = group_cols_amax(x, src, padded, kernel="torch")
    assert got.dtype == want.dtype == torch.float32 and got.shape == (5, 100)
    assert torch.equal(got.cpu(), want.cpu())
    assert (got[1] == 0).all()  # the empty expert
    for xin in (x, x.float()):  # bf16 (read by bits) and fp32 inputs
        d1, s1 = quantize_group_cols(xin, src, padded, kernel="triton")
        d2, s2 = quantize_group_cols(xin, src, padded, kernel="torch")
        assert torch.equal(s1, s2) and torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)), xin.dtype


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal e4m3 bits, NaN where the reference has NaN (a NaN's sign and payload aside)."""
    nan_g, nan_w = got.float().isnan(), want.float().isnan()
    return torch.equal(nan_g, nan_w) and torch.equal(got.view(torch.uint8)[~nan_g], want.view(torch.uint8)[~nan_w])


def check_rows_and_stacked_cols_kernels(device: str) -> None:
    """fp8_rowwise_triton's rows and stacked-columns quantization against the torch reference
    (quantize_rows along the last dim, and along dim -2 through a transposed copy), bit for bit:
    bf16 and fp32, rows not a multiple of the row block, columns not a multiple of the column block,
    whole rows in one tile and in two passes, a zero row, inf and NaN rows, wide dynamic range."""
    from moetron.core.precision import fp8_rowwise_triton as kernels
    from moetron.core.precision.fp8_rowwise import quantize_rows as reference

    torch.manual_seed(6)
    x = torch.randn(37, 600) * torch.logspace(-15, 15, 37)[:, None]
    x[3] = 0.0
    x[5, 7] = float("inf")
    x[6, 9] = float("nan")
    default = dict(kernels.TILES["rows"])
    # whole rows in one tile (the default), then two passes of 128 columns (rows longer than one_pass_cols)
    for tiles in (default, {**default, "one_pass_cols": 512, "cols": 128, "elements": 512}):
        kernels.TILES["rows"] = tiles
        try:
            for xin in (x.to(torch.bfloat16).to(device), x.to(device)):
                d, s = kernels.quantize_rows(xin)
                rd, rs = reference(xin, -1)
                assert torch.equal(s, rs), (xin.dtype, tiles)
                assert _same_bits(d, rd), (xin.dtype, tiles)
        finally:
            kernels.TILES["rows"] = default
    w = (torch.randn(3, 48, 200) * torch.logspace(-5, 5, 200)).to(device)  # [E, M, C], M a multiple of 16
    for win in (w, w.to(torch.bfloat16)):
        d, s = kernels.quantize_stacked_cols(win)
        rd, rs = reference(win.transpose(-2, -1).contiguous(), -1)
        assert d.shape == (3, 200, 48) and d.is_contiguous() and s.shape == (3, 200)
        assert torch.equal(s, rs) and _same_bits(d, rd), win.dtype
    # one slab of many rows (a dense wgrad's tokens): the group max split over several programs
    # (kernels.group_amax's ``split``), inf and NaN in different shares of the rows
    # (256 rows: the default split of group_amax gives two shares of 128; NaN in one, inf in both)
    xd = torch.randn(1, 256, 200) * torch.logspace(-5, 5, 200)
    xd[0, 200, 7], xd[0, 17, 9], xd[0, 40, 9] = float("inf"), float("nan"), float("inf")
    for xin in (xd.to(device), xd.to(torch.bfloat16).to(device)):
        d, s = kernels.quantize_stacked_cols(xin)
        rd, rs = reference(xin.transpose(-2, -1).contiguous(), -1)
        assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(s[~s.isnan()], rs[~rs.isnan()]), xin.dtype
        assert _same_bits(d, rd), xin.dtype


def check_rows_chunks_kernel(device: str) -> None:
    """fp8_rowwise_triton.quantize_rows_chunks (one read of x for its rows and its per-16-row column
    maxima) against the torch references, bit for bit: the rows as quantize_rows gives them, the
    chunks as the gathered, zero-padded rows' |x| max per 16 rows (torch amax: NaN and inf kept);
    ragged groups (an empty one), rows past the last group (left unspecified: not compared), bf16 and
    fp32, the whole rows in one tile and in two passes of a column block not dividing C."""
    from moetron.core.precision import fp8_rowwise_triton as kernels
    from moetron.core.precision.grouping import gather_rows

    torch.manual_seed(8)
    sizes = [21, 0, 40, 3, 17]
    R = sum(sizes) + 4
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
    x = torch.randn(R, 200) * torch.logspace(-12, 12, R)[:, None]
    x[4] = 0.0
    x[30, 7], x[31, 9], x[70, 199] = float("inf"), float("nan"), -float("inf")
    src, padded = padded_source_rows(offsets, R, ALIGN)
    named = sum(sizes)
    default = dict(kernels.TILES["rows_chunks"])
    # whole rows 4 at a time (SUB_R), 16 at a time; two passes of 64 columns (200 % 64 != 0)
    for tiles in ({**default, "sub_rows": 4}, {**default, "sub_rows": 16},
                  {**default, "one_pass_cols": 64, "cols": 64}):
        kernels.TILES["rows_chunks"] = tiles
        try:
            for xin in (x.to(torch.bfloat16).to(device), x.to(device)):
                d, sc, chunks = kernels.quantize_rows_chunks(xin, src)
                rd, rs = quantize_rows(xin, -1)
                assert torch.equal(sc[:named], rs[:named]), (xin.dtype, tiles)
                assert _same_bits(d[:named], rd[:named]), (xin.dtype, tiles)
                want = gather_rows(xin, src).float().abs().view(-1, kernels.CHUNK, 200).amax(1)
                assert chunks.shape == want.shape
                assert torch.equal(chunks.isnan(), want.isnan()), (xin.dtype, tiles)
                assert torch.equal(chunks[~chunks.isnan()], want[~want.isnan()]), (xin.dtype, tiles)
        finally:
            kernels.TILES["rows_chunks"] = default


def check_gemms_with_triton_quantization(device: str) -> None:
    """The emulated grouped GEMM and linear, forward and backward, give the same bits with every
    quantization in the Triton kernels as with the torch ops."""
    from moetron.core.precision import fp8_rowwise

    torch.manual_seed(7)
    sizes = [21, 0, 40, 3]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
    x0 = torch.randn(sum(sizes), 64, device=device)
    w0 = torch.randn(4, 48, 64, device=device)
    xl, wl = torch.randn(37, 64, device=device), torch.randn(32, 64, device=device)
    results = {}
    for kernels, fused in (("torch", True), ("triton", True), ("triton", False)):
        fp8_rowwise.KERNELS = kernels
        try:
            gemm = Fp8RowwiseGemm(native=False, fused_amax=fused)
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            y = gemm.grouped_mm(x, w, offsets)
            y.backward(torch.ones_like(y))
            a, b = xl.clone().requires_grad_(), wl.clone().requires_grad_()
            z = gemm.linear(a, b)
            z.backward(torch.ones_like(z))
            results[kernels, fused] = (y, x.grad, w.grad, z, a.grad, b.grad)
        finally:
            fp8_rowwise.KERNELS = "auto"
    for fused in (True, False):  # the rows and column maxima in one kernel (fused_amax) or two
        for got, want in zip(results["triton", fused], results["torch", True]):
            assert torch.equal(got, want), fused


def test_fused_kernel_serves_rows_up_to_4096_columns():
    """The fused rows + column maxima kernel's default tile holds at most 512 columns a warp on 8
    warps: wider rows (olmoe3-4l-8e's 8192-column gate|up gradient) take the two kernels; a tile
    with its warps given (the sweep's) serves any width."""
    pytest.importorskip("triton")
    from moetron.core.precision import fp8_rowwise_triton as kernels

    assert kernels.rows_chunks_fits(2048) and kernels.rows_chunks_fits(4096) and kernels.rows_chunks_fits(3000)
    assert not kernels.rows_chunks_fits(8192) and not kernels.rows_chunks_fits(4100)
    assert kernels.rows_chunks_fits(16384)  # past one_pass_cols: two passes of 1024-column blocks
    saved = dict(kernels.TILES["rows_chunks"])
    try:
        kernels.TILES["rows_chunks"]["num_warps"] = 8
        assert kernels.rows_chunks_fits(8192)
    finally:
        kernels.TILES["rows_chunks"] = saved


def check_all(device: str) -> None:
    """Every kernel check of this file, in one process (one interpreter start-up)."""
    check_group_cols_amax_kernel(device)
    check_rows_and_stacked_cols_kernels(device)
    check_rows_chunks_kernel(device)
    check_gemms_with_triton_quantization(device)


def test_kernels_interpreted():
    run_interpreted("tests.core.test_fp8_rowwise", "check_all('cpu')", timeout=300)


@pytest.mark.parametrize("name", ["_chunk_amax_kernel", "_group_cols_amax_kernel", "_quantize_cols_kernel",
                                  "_quantize_rows_kernel", "_quantize_rows_chunks_kernel",
                                  "_quantize_stacked_cols_kernel"])
def test_kernels_compile_for_sm90(name):
    """Each kernel compiles for Hopper on the CPU (ptxas included); the quantization rounds by the
    conversion instruction; the amax kernels take no shuffle or reduction (no cross-thread max)."""
    triton = pytest.importorskip("triton")
    from moetron.core.precision import fp8_rowwise_triton as kernels

    from tests.core.test_precision_fp8 import _compile_sm90

    quantizes = name.startswith("_quantize")
    values = {"x_ptr": "*i16", "src_ptr": "*i32", "c_ptr": "*fp32", "group_ptr": "*i32", "poff_ptr": "*i32", "inv_ptr": "*fp32",
              "out_ptr": "*fp8e4nv" if quantizes else "*fp32", "d_ptr": "*fp8e4nv", "s_ptr": "*fp32",
              "P": 8192, "R": 8192, "M": 4096, "C": 2048, "E": 8, "SPLIT": 4, "s_x": 2048, "s_d": 2048, "s_xe": 2048 * 4096, "s_xm": 2048}
    if name == "_group_cols_amax_kernel":  # it reads the chunks' fp32 partials
        values["x_ptr"] = "*fp32"
    blocks = {"_group_cols_amax_kernel": (32, 512), "_quantize_rows_kernel": (4, 2048),
              "_chunk_amax_kernel": (64, 1024), "_quantize_rows_chunks_kernel": (16, 2048)}.get(name, (32, 128))
    constexprs = {"IN_BF16": True, "HW": True, "GATHER": True, "ONE_PASS": True, "CHUNK_R": 16, "BLOCK_R": blocks[0], "BLOCK_C": blocks[1],
                  "BLOCK_P": 64, "BLOCK_M": 64, "CHUNKS": 2, "UNROLL": 8, "SUB_R": 8}
    kernel = getattr(kernels, name)
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    constexprs["IN_BF16"] = values["x_ptr"] == "*i16"
    compiled = _compile_sm90(kernel, triton.Config({}, num_warps=4, num_stages=3), values, constexprs)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx
    if quantizes:
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    else:  # the column maxima: each thread its own columns, 16-byte loads, no max across threads (a
        # barrier may remain where the result changes layout for its fp32 store)
        import re

        assert not re.search(r"^\s*(shfl|red|atom)\.", ptx, re.M) and "ld.global.v4" in ptx


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernels_on_gpu():
    check_all("cuda")


def _groups(offsets):
    ends = offsets.tolist()
    return list(zip([0] + ends[:-1], ends))


@pytest.mark.parametrize("sizes", [[5, 0, 22], [16, 16], [1, 2, 3, 40]])
def test_emulated_grouped_gemm_and_grads_against_float64(sizes):
    torch.manual_seed(2)
    E, I, O = len(sizes), 64, 48
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    R = sum(sizes)
    x = torch.randn(R, I, requires_grad=True)
    w = torch.randn(E, O, I, requires_grad=True)
    gemm = Fp8RowwiseGemm(native=False)
    y = gemm.grouped_mm(x, w, offsets)
    dy = torch.randn_like(y)
    y.backward(dy)
    f64 = torch.float64
    xd = dequantize_rows(*quantize_rows(x.detach())).to(f64)
    wd = dequantize_rows(*quantize_rows(w.detach())).to(f64)
    dyd = dequantize_rows(*quantize_rows(dy)).to(f64)
    wtd = dequantize_rows(*quantize_rows(w.detach().transpose(1, 2).contiguous())).to(f64)
    ref_y = torch.cat([xd[s:t] @ wd[e].t() for e, (s, t) in enumerate(_groups(offsets))])
    ref_dx = torch.cat([dyd[s:t] @ wtd[e].t() for e, (s, t) in enumerate(_groups(offsets))])
    ref_dw = torch.stack([dequantize_rows(*quantize_rows(dy[s:t], 0), 0).to(f64).t()
                          @ dequantize_rows(*quantize_rows(x.detach()[s:t], 0), 0).to(f64) if t > s
                          else torch.zeros(O, I, dtype=f64) for s, t in _groups(offsets)])
    for got, ref, name in ((y, ref_y, "y"), (x.grad, ref_dx, "dx"), (w.grad, ref_dw, "dw")):
        # the only roundings: the bf16 GEMM output (2^-9 relative) and fp32 summation order
        err = (got.to(f64) - ref).abs().max().item()
        assert err <= 2.0 ** -8 * ref.abs().max().item() + 1e-6, (name, err)
    # and close to the exact fp64 product (FP8's own error: a few percent)
    exact = torch.cat([x.detach()[s:t].double() @ w.detach()[e].double().t() for e, (s, t) in enumerate(_groups(offsets))])
    assert ((y.double() - exact).norm() / exact.norm()).item() < 0.06


def test_bf16_wgrad_against_float64_and_unlike_the_fp8_one():
    """precision.fp8_wgrad=false: the weight gradients from bf16 operands (float64 on the bf16-rounded
    dy and x, to bf16 output rounding), the forward and dgrad unchanged; the FP8 wgrad misses that
    tolerance (the check tells the two apart)."""
    torch.manual_seed(8)
    sizes = [5, 0, 22, 17]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x0, w0 = torch.randn(sum(sizes), 64), torch.randn(4, 48, 64)
    dy = torch.randn(sum(sizes), 48)
    grads = {}
    for wgrad in ("all", "none"):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = Fp8RowwiseGemm(native=False, wgrad=wgrad).grouped_mm(x, w, offsets)
        y.backward(dy)
        grads[wgrad] = (y.detach(), x.grad, w.grad)
    assert torch.equal(grads["all"][0], grads["none"][0]) and torch.equal(grads["all"][1], grads["none"][1])
    f64 = torch.float64
    ref = torch.stack([dy[s:t].to(torch.bfloat16).to(f64).t() @ x0[s:t].to(torch.bfloat16).to(f64) if t > s
                       else torch.zeros(48, 64, dtype=f64) for s, t in _groups(offsets)])
    tol = 2.0 ** -8 * ref.abs().max().item()
    assert (grads["none"][2].to(f64) - ref).abs().max().item() <= tol
    assert (grads["all"][2].to(f64) - ref).abs().max().item() > tol
    # the dense linear likewise
    xl, wl, dyl = torch.randn(37, 64), torch.randn(32, 64), torch.randn(37, 32)
    a, b = xl.clone().requires_grad_(), wl.clone().requires_grad_()
    Fp8RowwiseGemm(native=False, wgrad="none").linear(a, b).backward(dyl)
    refl = dyl.to(torch.bfloat16).to(f64).t() @ xl.to(torch.bfloat16).to(f64)
    assert (b.grad.to(f64) - refl).abs().max().item() <= 2.0 ** -8 * refl.abs().max().item()


def test_dense_wgrad_is_fp8_for_the_linears_and_bf16_for_the_experts():
    """wgrad="dense" (precision.fp8_wgrad=dense): the dense linear's gradients are bit for bit those
    of wgrad="all", the grouped experts' those of wgrad="none" (the forward and dgrad FP8 in all)."""
    torch.manual_seed(9)
    sizes = [7, 0, 19, 12]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x0, w0, dy = torch.randn(sum(sizes), 64), torch.randn(4, 48, 64), torch.randn(sum(sizes), 48)
    xl, wl, dyl = torch.randn(37, 64), torch.randn(32, 64), torch.randn(37, 32)
    out = {}
    for wgrad in ("all", "none", "dense"):
        gemm = Fp8RowwiseGemm(native=False, wgrad=wgrad)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = gemm.grouped_mm(x, w, offsets)
        y.backward(dy)
        a, b = xl.clone().requires_grad_(), wl.clone().requires_grad_()
        yl = gemm.linear(a, b)
        yl.backward(dyl)
        out[wgrad] = dict(grouped=(y, x.grad, w.grad), linear=(yl, a.grad, b.grad))
    for name in ("grouped", "linear"):
        same = "none" if name == "grouped" else "all"
        other = "all" if name == "grouped" else "none"
        for got, want in zip(out["dense"][name], out[same][name]):
            assert torch.equal(got, want), name
        assert not torch.equal(out["dense"][name][2], out[other][name][2]), name  # the two wgrads differ
    # the experts' loop path (the CPU's, core.moe.experts.loop_grouped_mm) takes the experts' wgrad too
    from moetron.core.moe.experts import loop_grouped_mm

    loop = {}
    for wgrad in ("all", "none", "dense"):
        w = w0.clone().requires_grad_()
        loop_grouped_mm(Fp8RowwiseGemm(native=False, wgrad=wgrad), x0, w, offsets).backward(dy)
        loop[wgrad] = w.grad
    assert torch.equal(loop["dense"], loop["none"]) and not torch.equal(loop["dense"], loop["all"])


def test_emulated_linear_against_float64():
    torch.manual_seed(3)
    x = torch.randn(37, 64, requires_grad=True)  # 37 tokens: padded to 48 inside, not in the output
    w = torch.randn(48, 64, requires_grad=True)
    y = Fp8RowwiseGemm(native=False).linear(x, w)
    assert y.shape == (37, 48)
    dy = torch.randn_like(y)
    y.backward(dy)
    f64 = torch.float64
    q = lambda t, a=-1: dequantize_rows(*quantize_rows(t, a), a).to(f64)  # noqa: E731
    ref_y = q(x.detach()) @ q(w.detach()).t()
    ref_dx = q(dy) @ q(w.detach().t().contiguous()).t()
    ref_dw = q(dy, 0).t() @ q(x.detach(), 0)
    for got, ref, name in ((y, ref_y, "y"), (x.grad, ref_dx, "dx"), (w.grad, ref_dw, "dw")):
        err = (got.to(f64) - ref).abs().max().item()
        assert err <= 2.0 ** -8 * ref.abs().max().item() + 1e-6, (name, err)


def test_config_resolution_and_errors():
    def cfg(**kw):
        return PrecisionConfig.from_dict(kw)

    assert cfg(recipe="fp8_rowwise").resolved_backend("cuda", 9) == "native"
    assert cfg(recipe="fp8_rowwise").resolved_backend("cuda", 10) == "emulated"  # no SM100 build of the kernel
    assert cfg(recipe="fp8_rowwise").resolved_backend("cpu") == "emulated"
    with pytest.raises(ConfigError, match="SM90 \\(Hopper\\).*SM10x.*recipe=mxfp8"):
        cfg(recipe="fp8_rowwise", backend="native").resolved_backend("cuda", 10)
    with pytest.raises(ConfigError, match="SM90.*the CPU.*backend=emulated"):
        cfg(recipe="fp8_rowwise", backend="native").build("cpu")
    assert not cfg(recipe="fp8_rowwise", fp8_wgrad=False).build("cpu", verbose=False).gemm.fp8_wgrad  # emulated too
    assert cfg(recipe="fp8_rowwise").build("cpu", verbose=False).gemm.fp8_wgrad
    with pytest.raises(ConfigError, match="fp8_wgrad=none.*needs --precision.recipe=fp8_blockwise or fp8_rowwise"):
        cfg(recipe="mxfp8", fp8_wgrad=False).validate()
    # true / false read as all / none; dense: the dense linears' wgrads FP8, the experts' bf16
    dense = cfg(recipe="fp8_rowwise", fp8_wgrad="dense").build("cpu", verbose=False).gemm
    assert (dense.fp8_wgrad, dense.fp8_wgrad_experts) == (True, False)
    assert cfg(recipe="fp8_rowwise", fp8_wgrad="true").fp8_wgrad == "all"
    assert cfg(recipe="fp8_rowwise", fp8_wgrad="false").fp8_wgrad == "none"
    with pytest.raises(ConfigError, match="'experts_only' is not one of 'all', 'none', 'dense'"):
        cfg(recipe="fp8_rowwise", fp8_wgrad="experts_only")
    with pytest.raises(ConfigError, match="fp8_fast_accum.*needs --precision.recipe=fp8_rowwise"):
        cfg(recipe="fp8_blockwise", fp8_fast_accum=True).validate()
    with pytest.raises(ConfigError, match="fp8_fast_accum=true is an option of the native.*backend=emulated"):
        cfg(recipe="fp8_rowwise", fp8_fast_accum=True).build("cpu", verbose=False)
    assert cfg(recipe="fp8_rowwise").build("cpu", verbose=False).gemm.fused_amax
    assert not cfg(recipe="fp8_rowwise", fp8_fused_amax=False).build("cpu", verbose=False).gemm.fused_amax
    with pytest.raises(ConfigError, match="fp8_fused_amax=false.*needs --precision.recipe=fp8_rowwise"):
        cfg(recipe="fp8_blockwise", fp8_fused_amax=False).validate()
    gemm = cfg(recipe="fp8_rowwise").build("cpu", verbose=False).gemm
    assert isinstance(gemm, Fp8RowwiseGemm) and not gemm.native and "emulated" in gemm.label
    assert "blockwise" not in gemm.label and "mx" not in gemm.label.lower()
    from moetron.core.precision.config import low_precision_gemm

    native = low_precision_gemm("fp8_rowwise", "native", fp8_fast_accum=True)
    assert native.native and native.fast_accum and "fast accumulation" in native.label
    assert cfg(recipe="fp8_rowwise", quantize_weights_once=True).build("cpu", verbose=False).gemm.quantize_weights_once


def test_tiny_moe_trains_in_fp8_rowwise_emulated_close_to_fp32(tmp_path, monkeypatch):
    assert_trains_close_to_fp32(["--precision.recipe=fp8_rowwise", "--precision.backend=emulated"], "Fp8RowwiseGemm",
                                tmp_path, monkeypatch)


def test_expert_weight_copies_quantize_from_the_optimizers_bf16_copies():
    """fp8_rowwise with precision.expert_weight_copies=optimizer, expert_grads_bf16=true: the experts
    compute with the optimizer's bf16 copies and the run follows the one quantizing the fp32 weights
    (E4M3 of bf16(w) against E4M3 of w)."""
    from tests.core.test_bf16_grouped import assert_quantized_copies_run_follows_fp32

    gemms = assert_quantized_copies_run_follows_fp32("fp8_rowwise")
    assert all(isinstance(g, Fp8RowwiseGemm) for g in gemms.values())


def test_expert_weight_copies_config_errors(monkeypatch):
    def cfg(**kw):
        return PrecisionConfig.from_dict(kw)

    with pytest.raises(ConfigError, match="only as --precision.expert_weight_copies=optimizer.*expert_grads_bf16=true"):
        cfg(recipe="fp8_rowwise", expert_weight_copies="optimizer").validate()
    with pytest.raises(ConfigError, match="expert_weight_copies=step with precision.recipe=fp8_rowwise"):
        cfg(recipe="fp8_rowwise", expert_weight_copies="step").validate()
    with pytest.raises(ConfigError, match="expert_weight_copies=step with precision.recipe=mxfp8"):
        cfg(recipe="mxfp8", expert_weight_copies="step").validate()
    # mxfp8 takes the copies on the emulated backend, not on its native GEMMs; fp8_blockwise on both
    for recipe in ("mxfp8", "fp8_blockwise"):
        emulated = cfg(recipe=recipe, backend="emulated", expert_weight_copies="optimizer",
                       expert_grads_bf16=True).build("cpu", verbose=False).gemm
        assert emulated.expert_copies and "expert_copies=True" in repr(emulated)
    import moetron.core.precision.config as config_module

    # an explicit native backend: refused by validate, before anything resolves
    with pytest.raises(ConfigError, match="recipe=mxfp8 on precision.backend=native: the native mxfp8 "
                                          "GEMMs do not take.*--precision.backend=emulated"):
        cfg(recipe="mxfp8", backend="native", expert_weight_copies="optimizer", expert_grads_bf16=True).validate()
    # auto resolving to native (mxfp8 on a Blackwell): refused by build; fp8_blockwise on a Hopper: built
    monkeypatch.setattr(config_module, "_capability_major", lambda device_type: 10)
    with pytest.raises(ConfigError, match="recipe=mxfp8 on precision.backend=native.*backend=emulated"):
        cfg(recipe="mxfp8", expert_weight_copies="optimizer", expert_grads_bf16=True).build("cuda", verbose=False)
    monkeypatch.setattr(config_module, "_capability_major", lambda device_type: 9)
    native = cfg(recipe="fp8_blockwise", expert_weight_copies="optimizer", expert_grads_bf16=True).build(
        "cuda", verbose=False).gemm
    assert type(native).__name__ == "Fp8BlockwiseGemm" and native.expert_copies and "expert_copies=True" in repr(native)
    monkeypatch.undo()
    from moetron.core.precision.config import takes_expert_copies

    assert [takes_expert_copies(r, b) for r, b in [("bf16", "native"), ("fp8_rowwise", "native"), ("mxfp8", "native"),
                                                   ("mxfp8", "emulated"), ("fp8_blockwise", "native"),
                                                   ("fp8_blockwise", "emulated")]] == [True, True, False, True, True, True]
    gemm = cfg(recipe="fp8_rowwise", expert_weight_copies="optimizer", expert_grads_bf16=True).build(
        "cpu", verbose=False).gemm
    assert gemm.expert_copies and "expert_copies=True" in repr(gemm)


def _native_available():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _native_available(), reason="needs an SM90 GPU (torch._scaled_grouped_mm rowwise)")
@pytest.mark.parametrize("fast_accum,wgrad", [(False, "all"), (True, "all"), (False, "none")])
def test_native_matches_the_emulation_on_the_gpu(fast_accum, wgrad):
    torch.manual_seed(4)
    dev = "cuda"
    sizes = [37, 0, 300, 16, 3]  # ragged, an empty expert
    E, I, O = len(sizes), 256, 384
    offsets = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    R = sum(sizes)
    x0 = torch.randn(R, I, device=dev, dtype=torch.bfloat16)
    w0 = torch.randn(E, O, I, device=dev) * 0.05
    dy = torch.randn(R, O, device=dev, dtype=torch.bfloat16)
    outs = {}
    for native in (True, False):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = Fp8RowwiseGemm(native=native, fast_accum=fast_accum and native, wgrad=wgrad).grouped_mm(x, w, offsets)
        y.backward(dy)
        outs[native] = (y.float(), x.grad.float(), w.grad.float())
    tol = 2.0 ** -6 if fast_accum else 2.0 ** -8  # bf16 outputs in both; fast accumulation's own error
    for got, ref, name in zip(outs[True], outs[False], ("y", "dx", "dw")):
        rel = ((got - ref).norm() / ref.norm()).item()
        print(name, rel)
        assert rel < tol, (name, rel)
    # dense linear: T not a multiple of 16
    x, w = torch.randn(77, I, device=dev, requires_grad=True), torch.randn(O, I, device=dev, requires_grad=True)
    res = {}
    for native in (True, False):
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = Fp8RowwiseGemm(native=native, fast_accum=fast_accum and native, wgrad=wgrad).linear(xi, wi)
        y.backward(torch.ones_like(y))
        res[native] = (y.float(), xi.grad, wi.grad)
    for got, ref, name in zip(res[True], res[False], ("y", "dx", "dw")):
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < tol, ("linear " + name, rel)


def test_the_planner_resolves_fp8_rowwise_as_pretrain_would():
    """The planner plans fp8_rowwise (since session 17): native on SM90 (H200), emulated on SM100+
    (B200: torch builds the grouped kernel for SM90 only), its switches carried over."""
    from moetron.core.optim import OptimizerConfig
    from moetron.models.config import ModelConfig
    from moetron.parallel import ParallelConfig
    from moetron.run.planner.hardware import GPUS
    from moetron.run.planner.switches import switches

    precision = PrecisionConfig(recipe="fp8_rowwise", fp8_fast_accum=True, fp8_wgrad="none",
                                expert_weight_copies="optimizer", expert_grads_bf16=True)
    h200 = switches(ModelConfig.preset("tiny-moe"), ParallelConfig(), precision, OptimizerConfig(), GPUS["h200"],
                    compiled=True)
    assert h200.rowwise_native and h200.fp8_fast_accum and h200.expert_weight_copies and h200.expert_grads_bf16
    assert h200.bf16_wgrad("experts") and h200.low("attention")
    b200 = switches(ModelConfig.preset("tiny-moe"), ParallelConfig(), PrecisionConfig(recipe="fp8_rowwise"),
                    OptimizerConfig(), GPUS["b200"], compiled=True)
    assert b200.recipe == "fp8_rowwise" and b200.backend == "emulated" and not b200.rowwise_native
