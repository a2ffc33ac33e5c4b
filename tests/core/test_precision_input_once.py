"""precision.quantize_input_once: linears that read one input (attention's q, k, v; a SwiGLU's gate
and up) quantize it once for all of them (GemmBackend.linears, core.layers.linear.shared_input).

Checked against independent references: every output and weight gradient against a float64
computation on the independently quantized operands (tests/core/test_precision_emulated.py's
references and tolerance), x's gradient against the float64 sum of the dgrads; the saved tensors
(one wgrad operand, not one per linear); the modules bit for bit against the switch off where the
computation is the same (forward, weight gradients); the config rule; a traced graph.
"""

import pytest
import torch

from moetron.core.config import ConfigError
from moetron.core.layers.attention import Attention, AttentionConfig
from moetron.core.layers.linear import shared_input
from moetron.core.layers.mlp import SwiGLU
from moetron.core.precision.config import InputOnce, PrecisionConfig, input_once_on
from moetron.core.precision.emulated import EmulatedGemm, MXFormat
from moetron.core.precision.fp8_rowwise import Fp8RowwiseGemm, dequantize_rows, quantize_rows
from moetron.core.precision.gemm import TorchGemm
from tests.core.test_precision_emulated import FORMATS, close, wide

WIDTHS = (384, 128, 256)  # q, k, v of a GQA attention: three output widths, whole blocks of 128


def _run(gemm, T: int = 200, I: int = 256, dtype=torch.float32, device: str = "cpu"):
    """x [T, I] through three weights by ``gemm.linears``, backward from wide gradients: (x, ws, ys,
    dys, the tensors saved for the backward)."""
    x = wide(T, I, seed=1).to(device, dtype).requires_grad_()
    ws = [wide(o, I, seed=2 + i).to(device).requires_grad_() for i, o in enumerate(WIDTHS)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ys = gemm.linears(x, tuple(ws))
    dys = [wide(T, o, seed=7 + i).bfloat16().float().to(device) for i, o in enumerate(WIDTHS)]
    torch.autograd.backward(ys, [dy.to(y.dtype) for dy, y in zip(dys, ys)])
    return x, ws, ys, dys, saved


@pytest.mark.parametrize("save_x_bf16", [False, True])
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_emulated_linears_match_float64(fmt_name, save_x_bf16):
    make, act, wq = FORMATS[fmt_name]
    gemm = EmulatedGemm(make(), save_x_bf16=save_x_bf16)
    gemm.quantize_input_once = True
    x, ws, ys, dys, _ = _run(gemm)
    for i, (w, y, dy) in enumerate(zip(ws, ys, dys)):
        assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
        close(y, act(x.detach(), -1), wq(w.detach(), -1).T, f"forward {i}")
        close(w.grad, act(dy, 0).T, act(x.detach(), 0), f"wgrad {i}")
    # dx = sum_i qdq(dy_i) @ qdq(w_i along O): one float64 product over the concatenated outputs
    close(x.grad, torch.cat([act(dy, -1) for dy in dys], 1), torch.cat([wq(w.detach(), 0) for w in ws], 0), "dgrad")


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_rowwise_linears_match_float64(fp8_wgrad):
    gemm = Fp8RowwiseGemm(native=False, wgrad=fp8_wgrad)
    gemm.quantize_input_once = True
    x, ws, ys, dys, _ = _run(gemm, T=37, I=64)  # 37 tokens: padded to 48 inside
    f64 = torch.float64
    q = lambda t, a=-1: dequantize_rows(*quantize_rows(t, a), a).to(f64)  # noqa: E731
    xd = x.detach()

    def check(got, ref, name, tol=2.0 ** -8):
        err = (got.to(f64) - ref).abs().max().item()
        assert err <= tol * ref.abs().max().item() + 1e-6, (name, err)

    for i, (w, y, dy) in enumerate(zip(ws, ys, dys)):
        wd = w.detach()
        check(y, q(xd) @ q(wd).t(), f"y{i}")
        ref_dw = q(dy, 0).t() @ q(xd, 0) if fp8_wgrad else dy.bfloat16().to(f64).t() @ xd.bfloat16().to(f64)
        check(w.grad, ref_dw, f"dw{i}")
    ref_dx = sum(q(dy) @ q(w.detach().t().contiguous()).t() for w, dy in zip(ws, dys))
    check(x.grad, ref_dx, "dx", tol=2.0 ** -7)  # three bf16 dgrads added in bf16


def check_blockwise_linears(device: str = "cpu", dense: str = "triton") -> None:
    """The native fp8_blockwise linears (``dense``: its Triton dense GEMM, interpreted on the CPU, or on the
    GPU cuBLAS's blockwise F.scaled_mm) with the input
    quantized once: every output and weight gradient against float64 on the independently quantized
    operands, x's gradient against the float64 sum of the dgrads (fp32 sum, rounded once); one saved
    wgrad operand of x instead of three."""
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    _, act, wq = FORMATS["fp8_blockwise"]
    saved_fp8 = {}
    for on in (False, True):
        gemm = Fp8BlockwiseGemm(dense=dense, quant="auto" if device != "cpu" else "torch")
        gemm.quantize_input_once = on
        x, ws, ys, dys, saved = _run(gemm, device=device)
        saved_fp8[on] = len([t for t in saved if t.dtype == torch.float8_e4m3fn and t.numel() >= 200 * 256])
    xc, dys = x.detach().cpu(), [dy.cpu() for dy in dys]
    for i, (w, y, dy) in enumerate(zip(ws, ys, dys)):
        wc = w.detach().cpu()
        close(y.float().cpu(), act(xc, -1), wq(wc, -1).T, f"forward {i}")
        close(w.grad.cpu(), act(dy, 0).T, act(xc, 0), f"wgrad {i}")
    close(x.grad.cpu(), torch.cat([act(dy, -1) for dy in dys], 1), torch.cat([wq(w.detach().cpu(), 0) for w in ws], 0),
          "dgrad")
    assert saved_fp8 == {False: 3, True: 1}, saved_fp8


def test_native_blockwise_linears_interpreted_match_float64():
    from tests.interpreted import run_interpreted

    run_interpreted("tests.core.test_precision_input_once", "check_blockwise_linears()")


@pytest.mark.gpu
@pytest.mark.parametrize("dense", ["scaled_mm", "triton"])
def test_native_blockwise_linears_on_gpu_match_float64(dense):
    check_blockwise_linears("cuda", dense)


@pytest.mark.parametrize("backend", ["mxfp8", "fp8_rowwise"])
def test_the_input_is_saved_once_not_once_per_linear(backend):
    """Off: each linear saves its own wgrad operand of x (three); on: one, shared."""
    counts = {}
    for on in (False, True):
        gemm = EmulatedGemm(MXFormat()) if backend == "mxfp8" else Fp8RowwiseGemm(native=False)
        gemm.quantize_input_once = on
        *_, saved = _run(gemm, T=64, I=128)
        counts[on] = len([t for t in saved if t.dtype == torch.float8_e4m3fn and t.numel() >= 64 * 128])
    assert counts == {False: 3, True: 1}, counts


def _module(kind: str, gemm, seed=0):
    torch.manual_seed(seed)
    m = (Attention(128, AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=64, qk_norm=True)) if kind == "attention"
         else SwiGLU(128, 256))
    for sub in m.modules():
        if hasattr(sub, "gemm"):
            sub.gemm = gemm
    return m


def _check_modules(backend: str, kind: str, device: str = "cpu", native: bool = False) -> None:
    """Attention (q, k, v, with GQA) and a SwiGLU (gate, up) with the switch on against off: the same
    output and weight gradients bit for bit (the same operands through the same GEMMs); x's gradient
    is the same sum accumulated otherwise (in the GEMMs, or bf16 adds in another order than
    autograd's), so equal within bf16 rounding (measured 2^-8.6 of its largest element)."""
    from moetron.core.precision.config import low_precision_gemm

    x0 = wide(2, 64, 128, seed=11).to(device)
    out = {}
    for on in (False, True):
        gemm = low_precision_gemm(backend, "native" if native else "emulated")
        gemm.quantize_input_once = on
        m = _module(kind, gemm).to(device)
        x = x0.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = m(x)
        y.float().square().mean().backward()
        out[on] = (y.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()})
    assert torch.equal(out[False][0], out[True][0])
    assert len(out[True][2]) >= 3 and all(torch.equal(g, out[True][2][n]) for n, g in out[False][2].items())
    on, off = out[True][1], out[False][1]
    err = ((on - off).abs().max() / off.abs().max()).item()
    assert off.abs().max() > 0 and err <= 2 ** -7


@pytest.mark.parametrize("kind", ["attention", "mlp"])
@pytest.mark.parametrize("backend", ["mxfp8", "fp8_blockwise", "fp8_rowwise"])
def test_modules_on_equal_off_but_for_the_dx_sum(backend, kind):
    _check_modules(backend, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["attention", "mlp"])
@pytest.mark.parametrize("backend, native", [("mxfp8", False), ("fp8_rowwise", True), ("fp8_blockwise", True)])
def test_modules_on_equal_off_on_gpu(backend, native, kind):
    """The same on the GPU's paths: mxfp8's fused Triton kernels, fp8_rowwise's scaled GEMMs, fp8_blockwise's
    blockwise F.scaled_mm."""
    _check_modules(backend, kind, "cuda", native)


def test_shared_input_falls_back_to_the_modules():
    """Linears on different backends, or a backend without the switch, run as modules (hooks fire)."""
    from moetron.core.layers.linear import Linear

    q, k = Linear(64, 32), Linear(64, 32)
    calls = []
    for m in (q, k):
        m.register_forward_hook(lambda *args: calls.append(1))
    x = torch.randn(3, 64)
    ys = shared_input(x, q, k)
    assert len(calls) == 2 and torch.equal(ys[0], x @ q.weight.T)
    gemm = EmulatedGemm(MXFormat())
    gemm.quantize_input_once = True
    q.gemm = gemm  # k keeps torch's GEMM: no common backend
    shared_input(x, q, k)
    assert len(calls) == 4
    k.gemm = gemm
    shared_input(x, q, k)
    assert len(calls) == 4  # one op for both, not the modules


def test_config_rule_and_build(tmp_path):
    def cfg(**kw):
        return PrecisionConfig.from_dict(kw)

    for recipe in ("mxfp8", "fp8_blockwise", "fp8_rowwise"):
        gemm = cfg(recipe=recipe, backend="emulated", quantize_input_once=True).build("cpu", verbose=False).gemm
        assert gemm.quantize_input_once
    assert cfg(recipe="mxfp8", backend="emulated").build("cpu", verbose=False).gemm.quantize_input_once  # auto
    assert not cfg(recipe="mxfp8", backend="emulated", quantize_input_once=False).build("cpu", verbose=False).gemm.quantize_input_once
    for bad in ({"recipe": "bf16"}, {"recipe": "auto"}, {"recipe": "mxfp8", "backend": "native"}):
        with pytest.raises(ConfigError, match="quantize_input_once: an option of fp8_rowwise.*drop it"):
            cfg(quantize_input_once=True, **bad).validate()
    assert not TorchGemm.quantize_input_once
    # auto: on where the recipe and backend take it, off (and no error) where they do not
    for recipe, backend, on in (("mxfp8", "emulated", True), ("fp8_blockwise", "emulated", True),
                                ("fp8_rowwise", "auto", True), ("bf16", "auto", False)):
        c = cfg(recipe=recipe, backend=backend, quantize_input_once="auto")
        c.validate()
        assert bool(getattr(c.build("cpu", verbose=False).gemm, "quantize_input_once", False)) is on, (recipe, backend)
    for value in ("true", "false", "auto", True, False):  # a saved config reads back as it was written
        c = cfg(quantize_input_once=value)
        c.to_yaml(tmp_path / "precision.yaml")
        assert PrecisionConfig.from_yaml(tmp_path / "precision.yaml").quantize_input_once == InputOnce(value)
        assert c.quantize_input_once == InputOnce(value)
    # the native mxfp8 linears quantize per linear; native fp8_blockwise shares (since session 38)
    cfg(recipe="mxfp8", backend="native", quantize_input_once="auto").validate()
    assert not input_once_on("mxfp8", "native", "auto") and input_once_on("mxfp8", "emulated", "auto")
    assert input_once_on("fp8_blockwise", "native", "auto") and input_once_on("fp8_blockwise", "native", True)


def test_shared_linears_under_a_traced_graph_equal_eager():
    """The multi-output op in a real traced graph (torch.compile, aot_eager on the CPU): the compiled
    attention's forward and gradients equal eager's bit for bit."""
    torch._dynamo.reset()
    x0 = wide(2, 64, 128, seed=12)
    res = []
    for compiled in (False, True):
        gemm = EmulatedGemm(MXFormat(kernels="torch"))
        gemm.quantize_input_once = True
        attn = _module("attention", gemm)
        x = x0.clone().requires_grad_()
        fn = lambda t: attn(t).float().square().sum()  # noqa: E731
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (torch.compile(fn, backend="aot_eager") if compiled else fn)(x)
        loss.backward()
        res.append((loss.detach(), x.grad, attn.q_proj.weight.grad, attn.v_proj.weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*res))
    torch._dynamo.reset()
