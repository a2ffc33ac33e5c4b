"""FP8 blockwise on the hardware path (core/precision/fp8_gemm.py, fp8_triton.py): the Triton grouped
GEMMs (forward, dgrad, wgrad) and the dense linear, against a float64 computation on the
independently quantized and dequantized operands (1x128 / 128x128 tiles, per expert), with the
emulation's tolerance (tests/core/test_precision_emulated.py: 2^-7 of the products' magnitude).
The kernels run under TRITON_INTERPRET=1 on the CPU, and on the GPU."""

import os
import subprocess
import tempfile

import pytest
import torch

from tests.core.test_precision_emulated import FORMATS, TOL, check_grouped, close, rel_err, wide
from tests.interpreted import run_interpreted

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)


def _bf16(t, axis=None):
    """The bf16 wgrad's operands: t rounded to bf16, float64."""
    return t.bfloat16().double()


def check_fp8(device: str, dense_modes=("triton",), quant: str = "auto", experts: str = "triton",
              wgrad: str = "all") -> None:
    """``experts``, ``wgrad``: Fp8BlockwiseGemm's. With wgrad="none" the weight gradients are checked
    against the float64 product of the bf16-rounded operands, and the FP8 wgrad of the same inputs
    is checked to miss that (so the check tells the two apart)."""
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    _, act, wq = FORMATS["fp8_blockwise"]
    wgrad_act = _bf16 if wgrad == "none" else act
    E, I, O = 3, 256, 128
    # an empty expert, ragged sizes (100 and 10 rows: not whole 4s for cuBLAS), 10 rows past the end
    offsets = torch.tensor([40, 40, 140, 150], device=device)
    cpu = lambda t: t.detach().cpu()  # noqa: E731
    x = wide(160, I, seed=1).to(device)
    w = wide(E + 1, O, I, seed=2).to(device)
    dy = wide(160, O, seed=3).bfloat16().float().to(device)
    dy[150:] = 0
    grads = {}
    for run in dict.fromkeys((wgrad, "all")):
        gemm = Fp8BlockwiseGemm("triton", quant, experts, wgrad=run)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = gemm.grouped_mm(xr, wr, offsets)
        y.backward(dy)
        grads[run] = cpu(wr.grad)
        if run == wgrad:
            xc, wc, dyc = cpu(xr), cpu(wr), cpu(dy)
            xc.grad, wc.grad = cpu(xr.grad), cpu(wr.grad)
            check_grouped(act, wq, xc, wc, offsets.cpu(), cpu(y).float(), dyc, wgrad_act)
    if wgrad == "none":  # the FP8 wgrad is not within the tolerance of the bf16 one's reference
        xc, dyc = cpu(x), cpu(dy)
        assert max(rel_err(grads["all"][e], _bf16(dyc[a:b]).T, _bf16(xc[a:b]))
                   for e, (a, b) in ((0, (0, 40)), (2, (40, 140)), (3, (140, 150)))) > 2 * TOL
    for dense in dense_modes:
        x2 = wide(200, I, seed=4).to(device)  # not a whole number of 128 tokens
        w2 = wide(O, I, seed=5).to(device)
        dy2 = wide(200, O, seed=6).bfloat16().float().to(device)
        for run in dict.fromkeys((wgrad, "all")):
            gemm = Fp8BlockwiseGemm(dense, quant, wgrad=run)
            x2r, w2r = x2.clone().requires_grad_(), w2.clone().requires_grad_()
            y2 = gemm.linear(x2r, w2r)
            y2.backward(dy2)
            x2c, w2c, dy2c = cpu(x2), cpu(w2), cpu(dy2)
            if run == wgrad:
                close(cpu(y2).float(), act(x2c, -1), wq(w2c, -1).T, f"{dense} forward")
                close(cpu(x2r.grad), act(dy2c, -1), wq(w2c, 0), f"{dense} dgrad")
                close(cpu(w2r.grad), wgrad_act(dy2c, 0).T, wgrad_act(x2c, 0), f"{dense} wgrad")
            else:
                assert rel_err(cpu(w2r.grad), _bf16(dy2c).T, _bf16(x2c)) > 2 * TOL, f"{dense}: fp8 wgrad"


def test_cublas_experts_on_cpu_match_float64():
    """experts="cublas" (core/precision/fp8_cublas.py) on the CPU: each expert's GEMM is the stand-in
    that applies torch's blockwise scaled_mm layout checks (scale strides, rows in 4s), so this
    checks the per-expert slicing, the spare rows and the scale layouts of forward, dgrad and wgrad."""
    check_fp8("cpu", dense_modes=(), quant="torch", experts="cublas")


def test_bf16_wgrad_on_cpu_matches_float64(monkeypatch):
    """wgrad="none" (precision.fp8_wgrad=false): forward and dgrad still FP8, the weight gradients
    the bf16 GEMM's (per expert, through the cuBLAS experts' CPU stand-in); nothing builds the FP8
    wgrad's padded-rows index."""
    import moetron.core.precision.fp8_gemm as fp8_gemm

    built = []
    index = fp8_gemm.padded_source_rows
    monkeypatch.setattr(fp8_gemm, "padded_source_rows", lambda *a: built.append(a) or index(*a))
    check_fp8("cpu", dense_modes=(), quant="torch", experts="cublas", wgrad="none")
    assert len(built) == 1  # check_fp8's second, FP8-wgrad run only


def test_dense_wgrad_runs_the_experts_wgrad_in_bf16():
    """wgrad="dense" (precision.fp8_wgrad=dense): the grouped experts' forward, dgrad and wgrad are
    bit for bit those of wgrad="none" (and their wgrad differs from the FP8 one); the dense linears
    keep the FP8 wgrad (the flag their backward reads)."""
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    offsets = torch.tensor([40, 40, 140, 150])
    x, w, dy = wide(160, 256, seed=1), wide(4, 128, 256, seed=2), wide(160, 128, seed=3).bfloat16().float()
    out = {}
    for wgrad in ("all", "none", "dense"):
        gemm = Fp8BlockwiseGemm("triton", "torch", "cublas", wgrad=wgrad)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = gemm.grouped_mm(xr, wr, offsets)
        y.backward(dy)
        out[wgrad] = (y.detach()[:150], xr.grad[:150], wr.grad)  # rows past the last group: unspecified
    assert all(torch.equal(a, b) for a, b in zip(out["dense"], out["none"]))
    assert not torch.equal(out["dense"][2], out["all"][2])
    dense = Fp8BlockwiseGemm("triton", "torch", "cublas", wgrad="dense")
    assert dense.fp8_wgrad and not dense.fp8_wgrad_experts


def test_cublas_rows_refuses_a_without_spare_rows():
    from moetron.core.precision.blockwise import quantize_128x128, quantize_1x128

    a_q, a_s = quantize_1x128(torch.randn(10, 128), -1)
    w_q, w_s = quantize_128x128(torch.randn(2, 128, 128))
    with pytest.raises(ValueError, match="spare rows"):
        torch.ops.moetron.fp8_cublas_rows(a_q, a_s, w_q, w_s, torch.tensor([4, 10]))


def check_kblock_major_scales(device: str, quant: str) -> None:
    """fp8_gemm.KBLOCK_MAJOR_TOKEN_SCALES: the grouped wgrad's operand scales laid out K-block-major
    (storage [P / 128, C]) give the same outputs and gradients, bit for bit, as the row-major ones, and
    the layout is the one asked for (the scales the backward saved, and the wgrad's dy operand)."""
    import moetron.core.precision.fp8_gemm as fp8_gemm
    import moetron.core.precision.fp8_triton as fp8_triton
    from moetron.core.precision.blockwise_triton import quantize_1x128_fused

    offsets = torch.tensor([40, 40, 140, 150], device=device)
    x, w = wide(160, 256, seed=1).to(device), wide(4, 128, 256, seed=2).to(device)
    dy = wide(160, 128, seed=3).bfloat16().float().to(device)
    out, strides = {}, []
    default, wgrad_k = fp8_gemm.KBLOCK_MAJOR_TOKEN_SCALES, fp8_triton.fp8_grouped_mm_k

    def spy(a, sa, bt, sbt, *args, **kw):  # the wgrad's operand scales as the kernel receives them
        strides.append((sa.stride(), sbt.stride()))
        return wgrad_k(a, sa, bt, sbt, *args, **kw)

    fp8_triton.fp8_grouped_mm_k = spy
    try:
        for major in (False, True):
            fp8_gemm.KBLOCK_MAJOR_TOKEN_SCALES = major
            gemm = fp8_gemm.Fp8BlockwiseGemm("triton", quant, "triton")
            assert gemm.kblock_major_token_scales == major
            assert not fp8_gemm.Fp8BlockwiseGemm("triton", quant, "cublas").kblock_major_token_scales
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = gemm.grouped_mm(xr, wr, offsets)
            y.backward(dy)
            out[major] = (y.detach()[:150], xr.grad[:150], wr.grad)
    finally:
        fp8_gemm.KBLOCK_MAJOR_TOKEN_SCALES, fp8_triton.fp8_grouped_mm_k = default, wgrad_k
    assert all(torch.equal(a, b) for a, b in zip(out[False], out[True]))
    (sa0, sbt0), (sa1, sbt1) = strides  # dy^T [128, P] and x^T [256, P]: K-blocks fastest, then columns
    assert sa0[1] == sbt0[1] == 1 and (sa1, sbt1) == ((1, 128), (1, 256)), strides
    if quant == "triton":
        _, (d0, s0) = quantize_1x128_fused(x, False, True)
        _, (d1, s1) = quantize_1x128_fused(x, False, True, tokens_outer_major=True)
        assert torch.equal(d0, d1) and torch.equal(s0, s1)
        assert s0.stride() == (2, 1) and s1.stride() == (1, 256), (s0.stride(), s1.stride())


@pytest.mark.parametrize("quant", ["torch", "triton"])
def test_kblock_major_token_scales_interpreted_give_the_same_bits(quant):
    run_interpreted("tests.core.test_precision_fp8", f"check_kblock_major_scales('cpu', {quant!r})")


def check_bf16_weight_copies(device: str, experts: str = "triton", quant: str = "auto") -> None:
    """Fp8BlockwiseGemm on bf16 expert weights (the optimizer's copies: precision.expert_weight_copies=
    optimizer, expert_grads_bf16=true): the forward's and the dgrad's bits are those of the same values
    held in fp32 (one quantization of the same tiles, read from 2 bytes instead of 4), and the weight
    gradient is bf16, the fp32 one rounded once, stored so by the wgrad kernel itself (asked for bf16
    out: no fp32 tensor of the weight's shape made and cast)."""
    import moetron.core.precision.fp8_triton as fp8_triton
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    _, act, wq = FORMATS["fp8_blockwise"]
    offsets = torch.tensor([40, 40, 140, 150], device=device)
    x0, w16 = wide(160, 256, seed=1).to(device), wide(4, 128, 256, seed=2).bfloat16().to(device)
    dy = wide(160, 128, seed=3).bfloat16().float().to(device)
    out, asked = {}, []
    wgrad_k = fp8_triton.fp8_grouped_mm_k

    def spy(*args, **kw):
        asked.append(kw.get("out_dtype", torch.float32))
        return wgrad_k(*args, **kw)

    fp8_triton.fp8_grouped_mm_k = spy
    try:
        for w0 in (w16.float(), w16):
            gemm = Fp8BlockwiseGemm("triton", quant, experts, expert_copies=w0.dtype == torch.bfloat16)
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            y = gemm.grouped_mm(x, w, offsets)
            y.backward(dy)
            out[w0.dtype] = (y.detach()[:150], x.grad[:150], w.grad)
    finally:
        fp8_triton.fp8_grouped_mm_k = wgrad_k
    # the bf16 run against float64 on the independently quantized operands, expert by expert
    xc, wc = x.detach().cpu(), w.detach().cpu().float()
    xc.grad, wc.grad = x.grad.cpu(), w.grad.cpu().float()
    check_grouped(act, wq, xc, wc, offsets.cpu(), y.detach().cpu().float(), dy.cpu())
    (y32, dx32, dw32), (y16, dx16, dw16) = out[torch.float32], out[torch.bfloat16]
    assert torch.equal(y32, y16) and torch.equal(dx32, dx16)
    assert dw32.dtype == torch.float32 and dw16.dtype == torch.bfloat16
    # the GPU's store rounds to nearest even (cvt.rn); Triton's interpreter truncates a store's fp32 -> bf16
    # (rounding modes ignored; the CPU never runs these kernels outside the tests)
    want = dw32.bfloat16() if device != "cpu" else (dw32.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    assert torch.equal(dw16, want) and dw32.abs().sum() > 0
    assert asked == [torch.float32, torch.bfloat16], asked


@pytest.mark.parametrize("quant", ["torch", "triton"])
def test_bf16_weight_copies_interpreted(quant):
    run_interpreted("tests.core.test_precision_fp8", f"check_bf16_weight_copies('cpu', quant={quant!r})")


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["triton", "gluon"])
def test_bf16_weight_copies_on_gpu(experts):
    check_bf16_weight_copies("cuda", experts)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["triton", "gluon"])
def test_native_fp8_trains_on_the_optimizers_bf16_copies_on_gpu(experts):
    """The native fp8_blockwise recipe with precision.expert_weight_copies=optimizer, expert_grads_bf16=true
    (a tiny MoE through the trainer, 3 steps): the experts compute on the optimizer's bf16 copies, which
    it rewrites from the updated fp32 weights, and the run follows the one on the fp32 weights."""
    from tests.core.test_bf16_grouped import assert_quantized_copies_run_follows_fp32

    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    gemms = assert_quantized_copies_run_follows_fp32("fp8_blockwise", "native", "cuda", must_decrease=False,
                                                     fp8_experts=experts)
    assert all(isinstance(g, Fp8BlockwiseGemm) and g.experts == experts for g in gemms.values())


def check_fused_swiglu(device: str, quant: str = "auto", experts: str = "triton", compiled: bool = False) -> None:
    """precision.fp8_fused_swiglu: the experts' whole SwiGLU MLP as one function (the product and h's
    gradient quantized by the kernels that compute them) gives the bits of the composition it replaces
    (two _Fp8GroupedMM around the SwiGLU: swiglu_triton's kernels with the Triton quantization, swiglu()
    and autograd with the torch one): output, input gradient, both weight gradients. Ragged experts, an
    empty one, 10 rows past the end. ``compiled``: the fused function also under torch.compile
    (fullgraph, aot_eager), the same bits."""
    from moetron.core.layers.mlp import swiglu
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    E, D, F = 4, 256, 128
    offsets = torch.tensor([40, 40, 140, 150], device=device)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(160, D, generator=g).bfloat16().to(device)
    wgu0 = (torch.randn(E, 2 * F, D, generator=g) / 8).to(device)
    wd0 = (torch.randn(E, D, F, generator=g) / 8).to(device)
    dy = torch.randn(160, D, generator=g).bfloat16().to(device)
    dy[150:] = 0
    out = {}
    runs = [(False, False), (True, False)] + ([(True, True)] if compiled else [])
    for fused, compile_ in runs:
        gemm = Fp8BlockwiseGemm("triton", quant, experts, fused_swiglu=fused)
        gemm.triton_swiglu = quant != "torch"  # the composition's SwiGLU: the kernels the fused path computes in
        x, wgu, wd = (t.clone().requires_grad_() for t in (x0, wgu0, wd0))
        fn = gemm.grouped_swiglu_mlp
        if compile_:
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
        y = fn(x, wgu, wd, offsets, swiglu)
        if not compile_:  # (compiled: one CompiledFunctionBackward)
            assert ("SwiGLU" in type(y.grad_fn).__name__) == fused, type(y.grad_fn).__name__
        y.backward(dy)
        out[fused, compile_] = (y.detach()[:150], x.grad[:150], wgu.grad, wd.grad)
    for key in runs[1:]:
        for a, b, name in zip(out[False, False], out[key], ("y", "dx", "dw_gate_up", "dw_down")):
            assert torch.equal(a, b), f"{name} (fused, compiled={key[1]}): {(a.float() - b.float()).abs().max()}"
    assert all(t.abs().sum() > 0 for t in out[True, False])


@pytest.mark.parametrize("quant", ["torch", "triton"])
def test_fused_swiglu_interpreted_gives_the_compositions_bits(quant):
    run_interpreted("tests.core.test_precision_fp8", f"check_fused_swiglu('cpu', {quant!r}, compiled={quant == 'torch'})")


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["triton", "gluon"])
def test_fused_swiglu_on_gpu_gives_the_compositions_bits(experts):
    check_fused_swiglu("cuda", experts=experts, compiled=True)


def check_compiled_fullgraph(device: str) -> None:
    """The Triton experts' grouped GEMM (forward, dgrad, wgrad: the pipelined kernels behind their custom
    ops) compiles with fullgraph=True and gives eager's bits: before the ops, Dynamo could not trace the
    TMA descriptors' data_ptr() check, and under torch.compile the whole autograd.Function ran eagerly
    (session 36 call 2b)."""
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    offsets = torch.tensor([40, 40, 140, 150], device=device)
    x0, w0 = wide(160, 256, seed=1).to(device), wide(4, 128, 256, seed=2).to(device)
    dy = wide(160, 128, seed=3).bfloat16().float().to(device)
    out = []
    for compiled in (False, True):
        gemm = Fp8BlockwiseGemm("triton", "torch", "triton")
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn = torch.compile(gemm.grouped_mm, fullgraph=True, backend="aot_eager") if compiled else gemm.grouped_mm
        y = fn(x, w, offsets)
        y.backward(dy)
        out.append((y.detach()[:150], x.grad[:150], w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*out))
    op = torch.ops.moetron
    a_q, a_s = torch.zeros(200, 256, dtype=torch.float8_e4m3fn), torch.ones(200, 2)
    b_q, b_s = torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn).transpose(1, 2), torch.ones(2, 2, 1)
    torch.library.opcheck(op.fp8_pipelined_rows.default, (a_q, a_s, b_q, b_s, torch.tensor([100, 200], dtype=torch.int32),
                                                          torch.bfloat16), test_utils=("test_faketensor", ))
    torch.library.opcheck(op.fp8_pipelined_k.default, (torch.zeros(128, 256, dtype=torch.float8_e4m3fn), torch.ones(128, 2),
                                                       torch.zeros(256, 256, dtype=torch.float8_e4m3fn), torch.ones(256, 2),
                                                       torch.tensor([128, 256], dtype=torch.int32), torch.float32),
                          test_utils=("test_faketensor", ))


def test_triton_experts_compile_fullgraph_interpreted():
    run_interpreted("tests.core.test_precision_fp8", "check_compiled_fullgraph('cpu')")


# Run in one interpreted subprocess (tests/interpreted.py), each test checking its own.
INTERPRETED = ("check_fp8('cpu', quant='torch')", "check_fp8('cpu', quant='triton')",
               "check_fp8('cpu', quant='triton', wgrad='none')", "check_pipelined('cpu')")


@pytest.mark.parametrize("quant", ["torch", "triton"])
def test_triton_fp8_interpreted_matches_float64(quant):
    """The GEMM kernels with the torch quantization and with the fused quantization kernels."""
    run_interpreted("tests.core.test_precision_fp8", f"check_fp8('cpu', quant={quant!r})")


def test_triton_fp8_bf16_wgrad_interpreted_matches_float64():
    """wgrad="none" with the Triton experts and the Triton dense GEMM (fused quantization, rows only)."""
    run_interpreted("tests.core.test_precision_fp8", "check_fp8('cpu', quant='triton', wgrad='none')")


def _ref_err(out, a, b) -> float:
    """Max over elements of |out - a @ b| / (|a| @ |b|), in float64."""
    a, b = a.double(), b.double()
    return ((out.double() - a @ b).abs() / (a.abs() @ b.abs()).clamp_min(1e-300)).max().item()


def _agree(out, masked, device: str) -> bool:
    """The pipelined kernel's output against the masked one's: to fp32 summation order on the CPU
    (1e-5 of the largest element: an element-wise rtol fails on sums that cancel near zero; measured
    3e-7 on an AMD EPYC's numpy); within the hardware's FP8 accumulation (2^-9 of the largest
    element) on the GPU."""
    if device == "cpu":
        return bool((out - masked).abs().max() <= 1e-5 * masked.abs().max())
    return bool((out - masked).abs().max() <= 2 ** -9 * masked.abs().max())


def check_rows(out, offsets, a_d, w_d, other, device: str, tol: float, what: str) -> None:
    """A rows kernel's output [R, N], expert by expert: against float64 on the dequantized operands
    (a_d [R, K], w_d [E, N, K]) within ``tol``, and against ``other`` (another kernel's output, _agree)."""
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            err = _ref_err(out[start:end], a_d[start:end], w_d[e].T)
            assert err <= tol, f"{what}: expert {e} error {err:.2e} against float64"
            assert _agree(out[start:end], other[start:end], device), what
        start = end


def check_pipelined(device: str, configs=None) -> None:
    """GroupedKernel.pipelined under each interpreted config (BN 128 / 256, pointer / TMA loads), for
    B laid out K-contiguous (TMA-able) and N-contiguous (pointer loads only): the same outputs as the
    masked kernels and float64 on the dequantized operands, up to fp32 summation order. Rows: ragged
    experts, empty ones (one last), 10 rows past the end, group ends off the 32-row tiles; N 384 is
    a whole and a partial BN 256 tile, three BN 128 tiles. A TMA config on a layout descriptors cannot
    read runs the pointer config's path (USE_TMA = TMA and TMA_OK), so that pair runs once: the
    interpreter spends about 0.1 s a program. ``configs``: default the interpreted ones."""
    from moetron.core.precision import fp8_triton as ft
    from moetron.core.precision.blockwise import (dequantize_1x128, dequantize_128x128, quantize_1x128,
                                                  quantize_128x128)

    # fp32 summation order alone on the CPU; on Hopper the FP8 MMA itself sums each 128-long K-block
    # with fewer bits than fp32 (DeepSeek-V3, section 3.3.2: about 14), 4.4e-4 measured on the H200
    K, R, tol = 256, 150, 1e-5 if device == "cpu" else 2 ** -9
    offsets = torch.tensor([40, 40, 101, 140, 140], dtype=torch.int32, device=device)
    for N in (384,) if device == "cpu" else (256, 384):  # the GPU's configs: BN 256 whole alone too
        x, w = wide(R, K, seed=1).to(device), wide(5, N, K, seed=2).to(device)  # w [E, N, K]: a forward's [E, O, I]
        a_q, a_s = quantize_1x128(x, -1)
        w_q, w_s = quantize_128x128(w)
        a_d, w_d = dequantize_1x128(a_q, a_s, -1).cpu(), dequantize_128x128(w_q, w_s).cpu()
        layouts = {"K-contiguous": (w_q.transpose(1, 2), w_s.transpose(1, 2)),
                   "N-contiguous": (w_q.transpose(1, 2).contiguous(), w_s.transpose(1, 2).contiguous())}
        masked = ft.fp8_grouped_mm_rows(a_q, a_s, *layouts["K-contiguous"], offsets, torch.float32,
                                        kernel=ft.GroupedKernel.masked).cpu()
        for config in configs or ft.pipelined_configs(interpret=True):
            ft.use_pipelined_configs([config])
            for layout, (b, sb) in layouts.items():
                if config.kwargs["TMA"] and layout == "N-contiguous" and device == "cpu":
                    continue  # the pointer config's path (no descriptor for this layout)
                out = ft.fp8_grouped_mm_rows(a_q, a_s, b, sb, offsets, torch.float32,
                                             kernel=ft.GroupedKernel.pipelined).cpu()
                check_rows(out, offsets, a_d, w_d, masked, device, tol, f"rows N {N} {ft.config_name(config)} {layout}")
        fp32, bf16 = (ft.fp8_grouped_mm_rows(a_q, a_s, *layouts["K-contiguous"], offsets, dtype, kernel="pipelined")
                      for dtype in (torch.float32, torch.bfloat16))
        if device == "cpu":  # GroupedKernel.gluon off SM90: the pipelined kernel, the same bits
            gluon = ft.fp8_grouped_mm_rows(a_q, a_s, *layouts["K-contiguous"], offsets, torch.float32, kernel="gluon")
            assert torch.equal(gluon[:140], fp32[:140])
        # the interpreter's bf16 store may round differently from torch's cast: within one bf16 step
        assert bf16.dtype == torch.bfloat16 and torch.allclose(bf16[:140].float(), fp32[:140], rtol=2 ** -7, atol=0)
    # wgrad: out[e] = A[:, rows of e] @ Bt[:, rows of e]^T over padded 128-row groups, one empty
    # M: two 32-row tiles (the interpreted BM) on the CPU; N 384: a whole and a partial BN 256
    M, N, P = 64 if device == "cpu" else 256, 384, 384
    padded = torch.tensor([128, 128, 384], dtype=torch.int32, device=device)
    dyt, xt = wide(M, P, seed=3).to(device), wide(N, P, seed=4).to(device)
    a_q, a_s = quantize_1x128(dyt, -1)
    b_q, b_s = quantize_1x128(xt, -1)
    a_d, b_d = dequantize_1x128(a_q, a_s, -1).cpu(), dequantize_1x128(b_q, b_s, -1).cpu()
    masked = ft.fp8_grouped_mm_k(a_q, a_s, b_q, b_s, padded, kernel=ft.GroupedKernel.masked).cpu()
    layouts = {"P-contiguous": (a_q, b_q), "M-contiguous": (a_q.t().contiguous().t(), b_q)}
    for config in configs or ft.pipelined_configs(interpret=True):
        ft.use_pipelined_configs([config])
        for layout, (a, b) in layouts.items():
            if config.kwargs["TMA"] and layout == "M-contiguous" and device == "cpu":
                continue  # the pointer config's path (no descriptor for this layout)
            out = ft.fp8_grouped_mm_k(a, a_s, b, b_s, padded, kernel=ft.GroupedKernel.pipelined).cpu()
            what = f"wgrad {ft.config_name(config)} {layout}"
            assert torch.equal(out[1], torch.zeros(M, N)), f"{what}: the empty expert"
            for e, (s, t) in enumerate(((0, 128), (128, 384))):
                err = _ref_err(out[2 * e], a_d[:, s:t], b_d[:, s:t].T)
                assert err <= tol, f"{what}: expert {2 * e} error {err:.2e} against float64"
            assert _agree(out, masked, device), what
    if device == "cpu":  # GroupedKernel.gluon off SM90: the pipelined kernel, the same bits
        pipelined = ft.fp8_grouped_mm_k(a_q, a_s, b_q, b_s, padded, kernel="pipelined")
        assert torch.equal(ft.fp8_grouped_mm_k(a_q, a_s, b_q, b_s, padded, kernel="gluon"), pipelined)


def test_pipelined_interpreted_matches_masked_and_float64():
    run_interpreted("tests.core.test_precision_fp8", "check_pipelined('cpu')")


def _ptxas_spills(ptx: str) -> int | None:
    """Bytes of spill stores ptxas reports for ``ptx`` at SM90 (the ptxas Triton ships), or None where
    there is none to run."""
    import re

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.access(ptxas, os.X_OK):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True)
    found = re.search(r"(\d+) bytes spill stores", out.stdout + out.stderr)
    return int(found.group(1)) if found else None


def _compile_sm90(kernel, config, values: dict, constexprs: dict, gluon: bool = False, options: dict | None = None):
    """triton.compile of an autotuned kernel's jit function (or, ``gluon``, a Gluon kernel) for SM90
    with ``config``, the arguments specialized as a launch would (pointers and ints divisible by 16
    marked so, ints equal to 1 made constexpr): no GPU needed. ``options``: more compile options (a launch's
    enable_fp_fusion=False)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton.runtime.jit import JITFunction

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: F811
    fn = kernel if isinstance(kernel, JITFunction) else kernel.fn  # a jit function, or an autotuned kernel's
    signature, attrs, constants = {}, {}, {**constexprs, **config.kwargs}
    for i, name in enumerate(fn.arg_names):
        value = values.get(name)
        if name in constants:
            signature[name] = "constexpr"
        elif isinstance(value, str):  # "*fp8e4nv", "tensordesc<...>"
            signature[name] = value
            if value.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif value == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages, **(options or {})))


def assert_no_spills(compiled, what: str) -> None:
    """ptxas's register allocation of a compiled kernel (cuobjdump, shipped with Triton, where present):
    no spills to local memory, no stack."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.path.exists(cuobjdump):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        assert "LOCAL:0" in usage and "STACK:0" in usage, f"{what}: spills ({usage.strip()[-200:]})"


def _gpu_configs():
    pytest.importorskip("triton")
    from moetron.core.precision.fp8_triton import pipelined_configs

    return pipelined_configs()


@pytest.mark.parametrize("index", range(14))
def test_pipelined_configs_compile_for_sm90(index):
    """Every GPU config of both pipelined kernels (the k kernel's list is shorter) compiles for Hopper (OLMoE's forward and wgrad
    shapes), its operand loads pipelined (cp.async or TMA, several stages of shared memory), with
    no register spills to local memory."""
    from moetron.core.precision import fp8_triton as ft

    configs = _gpu_configs()
    assert len(configs) == 14  # the parametrize range
    config = configs[index]
    bm, bn = config.kwargs["BM"], config.kwargs["BN"]
    desc = lambda rows: f"tensordesc<fp8e4nv[{rows}, 128]>"  # noqa: E731
    ptrs = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", sa_ptr="*fp32", sb_ptr="*fp32", off_ptr="*i32",
                a_desc=desc(bm), b_desc=desc(bn))
    R, K, N, E, P = 131072, 2048, 2048, 64, 131072 + 64 * 128
    rows = dict(ptrs, c_ptr="*bf16", E=E, R=R, N=N, K=K, s_am=K, s_ak=1, s_sam=K // 128, s_sak=1, s_be=N * K, s_bk=1,
                s_bn=K, s_sbe=N * K // 128 ** 2, s_sbk=1, s_sbn=K // 128, s_cm=N, s_cn=1)
    k = dict(ptrs, c_ptr="*fp32", M=N, N=K, s_am=P, s_ak=1, s_sam=P // 128, s_sak=1, s_bn=P, s_bk=1, s_sbn=P // 128,
             s_sbk=1, s_ce=N * K, s_cm=K, s_cn=1)
    kernels = [(ft._fp8_grouped_gemm_rows_pipelined_kernel, rows, dict(BK=128, EP=64, TMA_OK=1))]
    if config in ft.pipelined_configs(wgrad=True):
        kernels.append((ft._fp8_grouped_gemm_k_pipelined_kernel, k, dict(BK=128, TMA_OK=1)))
    for kernel, values, constexprs in kernels:
        compiled = _compile_sm90(kernel, config, values, constexprs)
        ptx = compiled.asm["ptx"]
        what = f"{kernel.fn.__name__} {ft.config_name(config)}"
        assert "wgmma.mma_async" in ptx, what
        loads = "cp.async.bulk.tensor" if config.kwargs["TMA"] else "cp.async.cg"
        assert loads in ptx, f"{what}: operand loads not pipelined"
        assert compiled.metadata.shared >= min(config.num_stages, 2) * (bm + bn) * 128, f"{what}: one stage of smem"
        assert_no_spills(compiled, what)


@pytest.mark.gpu
def test_pipelined_on_gpu_matches_float64():
    from moetron.core.precision.fp8_triton import pipelined_configs

    check_pipelined("cuda", pipelined_configs())  # the k kernel: only those of pipelined_configs(wgrad=True)


@pytest.mark.gpu
def test_pipelined_configs_give_the_same_bits_on_gpu():
    """The config the autotuner picks (by timing, so it may differ from one process to the next) does not change
    the pipelined kernels' outputs: every GPU config gives the first one's bits, the rows kernel and the wgrad (k)
    kernel alike. Each output element sums its 128-long K-blocks in the same order whatever the tile, the warps
    or the load path. So trainer.deterministic needs no pinned config for the fp8_blockwise recipe's Triton
    GEMMs (docs/training.md). Ragged experts, empty ones, rows past the last group; N 384 (a whole and a partial
    BN 256 tile)."""
    from moetron.core.precision import fp8_triton as ft
    from moetron.core.precision.blockwise import quantize_1x128, quantize_128x128

    offsets = torch.tensor([40, 40, 101, 140, 140], dtype=torch.int32, device="cuda")
    a_q, a_s = quantize_1x128(wide(150, 256, seed=1).cuda(), -1)
    w_q, w_s = quantize_128x128(wide(5, 384, 256, seed=2).cuda())
    dy_q, dy_s = quantize_1x128(wide(256, 384, seed=3).cuda(), -1)
    x_q, x_s = quantize_1x128(wide(384, 384, seed=4).cuda(), -1)
    padded = torch.tensor([128, 128, 384], dtype=torch.int32, device="cuda")
    rows_configs, k_configs = ft.pipelined_configs(), ft.pipelined_configs(wgrad=True)
    outs = {}
    try:
        for config in rows_configs:
            ft.use_pipelined_configs([config], k_configs[:1])
            outs[f"rows {ft.config_name(config)}"] = ft.fp8_grouped_mm_rows(
                a_q, a_s, w_q.transpose(1, 2), w_s.transpose(1, 2), offsets, torch.float32,
                kernel=ft.GroupedKernel.pipelined)[:140]
        for config in k_configs:
            ft.use_pipelined_configs(rows_configs[:1], [config])
            outs[f"wgrad {ft.config_name(config)}"] = ft.fp8_grouped_mm_k(dy_q, dy_s, x_q, x_s, padded,
                                                                          kernel=ft.GroupedKernel.pipelined)
    finally:
        ft.use_pipelined_configs(rows_configs, k_configs)  # the autotuner's whole lists again
    for kind in ("rows", "wgrad"):
        named = {k: v for k, v in outs.items() if k.startswith(kind)}
        first_name, first = next(iter(named.items()))
        assert first.abs().max() > 0
        differ = [k for k, v in named.items() if not torch.equal(v, first)]
        assert not differ, f"{differ} differ from {first_name}: the autotuned choice changes the bits"


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["triton", "cublas", "gluon"])
@pytest.mark.parametrize("wgrad", ["all", "none"])
def test_fp8_on_gpu_matches_float64(experts, wgrad):
    check_fp8("cuda", dense_modes=("triton", "scaled_mm"), experts=experts, wgrad=wgrad)


@pytest.mark.parametrize("kernel_name", ["_fp8_quantize_1x128_kernel", "_fp8_quantize_128x128_kernel",
                                         "_fp8_quantize_tile_kernel"])
def test_quantize_kernels_round_with_the_conversion_instruction_on_sm90(kernel_name):
    """On the GPU the FP8 quantization rounds to E4M3 with cvt.rn.satfinite (blockwise_triton._e4m3,
    HW=True), not by the interpreter's bit arithmetic: the PTX for SM90 holds the conversion and
    none of round_to_e4m3's constants (its bits agreeing with torch's is the GPU test of
    tests/core/test_blockwise_triton.py). The kernels compile for SM90, at their launch's warps without
    spilling registers (ptxas, where Triton ships it: the SwiGLU kernel's first form spilled 2.2 KB a
    thread, session 38)."""
    import triton

    from moetron.core.precision import blockwise_triton as bt

    ptrs = {name: t for name, t in (("x_ptr", "*i16"), ("src_ptr", "*i32"), ("rd_ptr", "*fp8e4nv"),
                                    ("rs_ptr", "*fp32"), ("td_ptr", "*fp8e4nv"), ("ts_ptr", "*fp32"),
                                    ("w_ptr", "*i16"), ("d_ptr", "*fp8e4nv"), ("dt_ptr", "*fp8e4nv"),
                                    ("s_ptr", "*fp32"), ("h_ptr", "*i16"))}
    ints = dict(R=65536, P=65536 + 1024, C=4096, R_OUT=65536, F=2048, s_xr=4096, s_xc=1, s_rdr=4096, s_rdc=1,
                s_rsr=32, s_rsb=1, s_tdc=65536 + 1024, s_tdp=1, s_tsc=528, s_tsb=1, s_hr=4096, O=4096, I=4096)
    constexprs = dict(BLOCK=128, HW=True)
    variants, warps = [dict(DATA=True, DATA_T=True, IN_BF16=True)], (8,)
    if kernel_name == "_fp8_quantize_1x128_kernel":  # precision.fp8_quantize_warps: either
        variants, warps = [dict(GATHER=True, ROWS=True, TOKENS=True, IN_BF16=True)], (4, 8)
    elif kernel_name == "_fp8_quantize_tile_kernel":  # plain x (bf16, fp32), the SwiGLU's product and h's gradient
        variants = [dict(GATHER=True, ROWS=True, TOKENS=True, PROLOGUE=p, IN_BF16=b)
                    for p, b in ((0, True), (0, False), (1, True), (2, True))]
        warps = (bt.TILE_WARPS,)
    for variant, warps in [(v, w) for v in variants for w in warps]:
        x_ptr = {"x_ptr": "*i16" if variant.get("IN_BF16", True) else "*fp32"}  # fp32 x is loaded as it is
        ptx = _compile_sm90(getattr(bt, kernel_name), triton.Config({}, num_warps=warps), {**ptrs, **ints, **x_ptr},
                            {**constexprs, **variant}).asm["ptx"]
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        # round_to_e4m3's subnormal rounding adds and subtracts 1.5 x 2^14 (0f46C00000 in PTX): HW=False has it
        assert "0f46C00000" not in ptx
        spills = _ptxas_spills(ptx)
        assert spills in (None, 0), (variant, spills)


def test_cublas_ops_pass_torch_library_opcheck():
    """The per-expert cuBLAS ops' fake implementations (what torch.compile traces) agree with the real
    ones (the CPU stand-in) in shape, dtype and device, and they trace under AOT dispatch
    (torch.library.opcheck; its test_schema compares the fp8 inputs with allclose, which the CPU lacks
    for e4m3)."""
    from moetron.core.precision.blockwise import quantize_128x128, quantize_1x128
    from moetron.core.precision.fp8_cublas import ROW_SLACK
    from moetron.core.precision.grouping import pad_groups

    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([40, 40, 101], dtype=torch.int32)
    a_q, a_s = quantize_1x128(torch.randn(101 + ROW_SLACK, 256, generator=g), -1)
    w_q, w_s = quantize_128x128(torch.randn(3, 128, 256, generator=g))
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.moetron.fp8_cublas_rows, (a_q, a_s, w_q, w_s, offsets), test_utils=checks)
    dy_P, padded = pad_groups(torch.randn(101, 128, generator=g), offsets, 128)
    x_P, _ = pad_groups(torch.randn(101, 256, generator=g), offsets, 128)
    dyt, xt = quantize_1x128(dy_P.t().contiguous(), -1), quantize_1x128(x_P.t().contiguous(), -1)
    torch.library.opcheck(torch.ops.moetron.fp8_cublas_k, (*dyt, *xt, padded), test_utils=checks)
