"""The one-pass Triton SwiGLU of the routed experts (core/precision/swiglu_triton.py, behind
precision.triton_swiglu): under TRITON_INTERPRET=1 on the CPU and on the GPU, against the torch
composition it replaces (swiglu() and autograd's backward of it, bf16), and grouped_swiglu_down
with the kernel against it without.

Tolerance: the kernel rounds where the torch ops round (silu's output, the product, each multiply),
so the only difference is exp/sigmoid's last bits in fp32 before a bf16 rounding: at most one bf16
ulp (2^-8 relative) on a small fraction of elements; measured here: the values agree to that.
"""

from __future__ import annotations

import pytest
import torch

from moetron.core.layers.mlp import swiglu
from tests.interpreted import run_interpreted

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)


def _close_bf16(a: torch.Tensor, b: torch.Tensor, what: str, max_frac: float = 0.02) -> None:
    diff = (a.float() - b.float()).abs()
    tol = b.float().abs() * 2**-7 + 1e-6  # one bf16 ulp (rounding either way)
    assert bool((diff <= tol).all()), (what, float((diff - tol).max()))
    assert float((diff > 0).float().mean()) <= max_frac, (what, float((diff > 0).float().mean()))


def _down_grads(down, h, w, gy):
    """(y, grad h, grad w) of y = down(h, w) against the output gradient gy."""
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = down(hh, ww)
    return (y, *torch.autograd.grad(y, (hh, ww), gy))


def _assert_same(got, want, tol):
    for a, b, what in zip(got, want, ("y", "grad h", "grad w")):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=what)


# Run in one interpreted subprocess (tests/interpreted.py), each test checking its own.
INTERPRETED = ("check('cpu')", "check_rows('cpu')")


def check(device: str) -> None:
    from moetron.core.precision.bf16_grouped import grouped_swiglu_down
    from moetron.core.precision.swiglu_triton import swiglu_backward, swiglu_forward

    torch.manual_seed(0)
    # F not a multiple of the kernel's block (but of 8: _grouped_mm's 16-byte strides); R few rows (a
    # program each per block: the interpreter pays ~0.05 s a program)
    R, F = 9, 1104
    h = (torch.randn(R, 2 * F) * 3).to(device, torch.bfloat16)
    ga = torch.randn(R, F).to(device, torch.bfloat16)
    gate, up = h.chunk(2, dim=-1)
    want = swiglu(gate, up)
    _close_bf16(swiglu_forward(h), want, "forward")
    hh = h.clone().requires_grad_(True)
    g2, u2 = hh.chunk(2, dim=-1)
    (want_grad,) = torch.autograd.grad(swiglu(g2, u2), hh, ga)
    act, grad_h = swiglu_backward(h, ga)
    _close_bf16(act, want, "backward's product")
    _close_bf16(grad_h, want_grad, "backward's gradient")

    # Through the grouped op, with and without the kernel.
    E, D = 3, 24
    offsets = torch.tensor([3, 3, R], dtype=torch.int32, device=device)
    w = (torch.randn(E, D, F) / F**0.5).to(device)
    gy = torch.randn(R, D).to(device, torch.bfloat16)
    outs = [_down_grads(lambda hh, ww: grouped_swiglu_down(hh, ww, offsets, torch.bfloat16, triton_swiglu=kernel),
                        h, w, gy) for kernel in (False, True)]
    _assert_same(outs[1], outs[0], 2e-2)
    # precision.save_swiglu_product: the kernel's forward product kept, its backward writing none;
    # the same bits as its recompute.
    saved = _down_grads(lambda hh, ww: grouped_swiglu_down(hh, ww, offsets, torch.bfloat16, triton_swiglu=True,
                                                           save_product=True), h, w, gy)
    assert all(torch.equal(a, b) for a, b in zip(saved, outs[1]))
    act_only, grad_only = swiglu_backward(h, ga, want_act=False)
    assert act_only is None and torch.equal(grad_only, grad_h)


def test_swiglu_kernel_interpreted():
    run_interpreted("tests.core.test_swiglu_triton", "check('cpu')")


@pytest.mark.gpu
def test_swiglu_kernel_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check("cuda")


def check_rows(device: str) -> None:
    """swiglu_rows (the low-precision backends' SwiGLU) against swiglu() and autograd, forward and
    backward; and an FP8 backend's down projection with it against without it."""
    from moetron.core.precision import PrecisionConfig
    from moetron.core.precision import swiglu_triton as st
    from moetron.core.precision.swiglu_triton import swiglu_rows

    torch.manual_seed(1)
    R, F = 9, 1104
    h = (torch.randn(R, 2 * F) * 3).to(device, torch.bfloat16)
    ga = torch.randn(R, F).to(device, torch.bfloat16)
    h1, h2 = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
    y1 = swiglu_rows(h1)
    g, u = h2.chunk(2, dim=-1)
    y2 = swiglu(g, u)
    _close_bf16(y1, y2, "swiglu_rows forward")
    (g1,), (g2,) = torch.autograd.grad(y1, h1, ga), torch.autograd.grad(y2, h2, ga)
    _close_bf16(g1, g2, "swiglu_rows backward")
    # The ops' fake (compile-time) and autograd registrations, and a whole graph through them, on a
    # few rows of the same width (opcheck runs each op many times: interpreted, the full rows took 25 s)
    hs, gs = h[:5].contiguous(), ga[:5].contiguous()
    torch.library.opcheck(st._swiglu_rows_op, (hs.clone().requires_grad_(True),))
    torch.library.opcheck(st._swiglu_rows_backward_op, (hs, gs))
    h3, h4 = hs.clone().requires_grad_(True), hs.clone().requires_grad_(True)
    compiled = torch.compile(lambda x: swiglu_rows(x), backend="aot_eager", fullgraph=True)
    (g3,), (g4,) = torch.autograd.grad(compiled(h3), h3, gs), torch.autograd.grad(swiglu_rows(h4), h4, gs)
    assert torch.equal(g3, g4)

    E, D = 3, 32
    offsets = torch.tensor([4, 4, 12], dtype=torch.int32, device=device)
    hx = (torch.randn(12, 2 * 64) * 2).to(device, torch.bfloat16)
    w = (torch.randn(E, D, 64) / 8).to(device)
    gy = torch.randn(12, D).to(device, torch.bfloat16)
    outs, calls = [], []
    forward, backward = st.swiglu_forward, st.swiglu_backward
    st.swiglu_forward = lambda *a: calls.append("fwd") or forward(*a)
    st.swiglu_backward = lambda *a, **k: calls.append("bwd") or backward(*a, **k)
    for kernel in (False, True):
        gemm = PrecisionConfig(recipe="fp8_rowwise", backend="emulated", triton_swiglu=kernel).build(device, verbose=False).gemm
        assert gemm.triton_swiglu is kernel
        outs.append(_down_grads(lambda hh, ww: gemm.grouped_swiglu_down(hh, ww, offsets, swiglu), hx, w, gy))
        assert calls == (["fwd", "bwd"] if kernel else []), (kernel, calls)
    # memory.recompute's checkpointed twin of swiglu takes the kernel too (same bits as without it).
    from moetron.core.memory import recomputed

    twin = _down_grads(lambda hh, ww: gemm.grouped_swiglu_down(hh, ww, offsets, recomputed(swiglu)), hx, w, gy)
    assert calls == ["fwd", "bwd"] * 2, calls
    st.swiglu_forward, st.swiglu_backward = forward, backward
    _assert_same(outs[1], outs[0], 3e-2)
    for a, b in zip(twin, outs[1]):
        assert torch.equal(a, b)


def test_swiglu_rows_interpreted():
    run_interpreted("tests.core.test_swiglu_triton", "check_rows('cpu')")


@pytest.mark.gpu
def test_swiglu_rows_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_rows("cuda")
