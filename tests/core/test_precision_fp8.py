"""FP8 blockwise on the hardware path (core/precision/fp8_gemm.py, fp8_triton.py): the Triton grouped
GEMMs (forward, dgrad, wgrad) and the dense linear, against a float64 computation on the
independently quantized and dequantized operands (1x128 / 128x128 tiles, per expert), with the
emulation's tolerance (tests/core/test_precision_emulated.py: 2^-7 of the products' magnitude).
The kernels run under TRITON_INTERPRET=1 on the CPU, and on the GPU."""


import pytest
import torch

from tests.core.test_precision_emulated import FORMATS, check_grouped, close, wide
from tests.interpreted import run_interpreted



def check_fp8(device: str, dense_modes=("triton",), quant: str = "auto") -> None:
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    _, act, wq = FORMATS["fp8_blockwise"]
    E, I, O = 3, 256, 128
    offsets = torch.tensor([40, 40, 140, 150], device=device)  # an empty expert, ragged sizes
    gemm = Fp8BlockwiseGemm("triton", quant)
    x = wide(160, I, seed=1).to(device).requires_grad_()
    w = wide(E + 1, O, I, seed=2).to(device).requires_grad_()
    dy = wide(160, O, seed=3).bfloat16().float().to(device)
    dy[150:] = 0
    y = gemm.grouped_mm(x, w, offsets)
    y.backward(dy)
    cpu = lambda t: t.detach().cpu()  # noqa: E731
    xc, wc, dyc = cpu(x), cpu(w), cpu(dy)
    xc.grad, wc.grad = cpu(x.grad), cpu(w.grad)
    check_grouped(act, wq, xc, wc, offsets.cpu(), cpu(y).float(), dyc)
    for dense in dense_modes:
        gemm = Fp8BlockwiseGemm(dense, quant)
        x2 = wide(200, I, seed=4).to(device).requires_grad_()  # not a whole number of 128 tokens
        w2 = wide(O, I, seed=5).to(device).requires_grad_()
        dy2 = wide(200, O, seed=6).bfloat16().float().to(device)
        y2 = gemm.linear(x2, w2)
        y2.backward(dy2)
        x2c, w2c, dy2c = cpu(x2), cpu(w2), cpu(dy2)
        close(cpu(y2).float(), act(x2c, -1), wq(w2c, -1).T, f"{dense} forward")
        close(cpu(x2.grad), act(dy2c, -1), wq(w2c, 0), f"{dense} dgrad")
        close(cpu(w2.grad), act(dy2c, 0).T, act(x2c, 0), f"{dense} wgrad")


@pytest.mark.parametrize("quant", ["torch", "triton"])
def test_triton_fp8_interpreted_matches_float64(quant):
    """The GEMM kernels with the torch quantization and with the fused quantization kernels."""
    run_interpreted("tests.core.test_precision_fp8", f"check_fp8('cpu', quant={quant!r})")


@pytest.mark.gpu
def test_fp8_on_gpu_matches_float64():
    check_fp8("cuda", dense_modes=("triton", "scaled_mm"))
