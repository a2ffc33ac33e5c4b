"""The fused loss's Triton chunk kernel (core/layers/cross_entropy_triton.py), run by
linear_cross_entropy on CUDA: under TRITON_INTERPRET=1 on the CPU (a subprocess: the variable must
be set before triton is imported) and on the GPU.

Oracles: float64 cross entropy (F.cross_entropy on float64 logits of the same bf16 operands) and
the torch chunk path (CE_KERNEL="torch"), for the loss and both gradients; ignored tokens, z-loss,
a chunk that does not divide T, a vocabulary that is not a multiple of the kernel's block, the
gradient written in place in bf16 and fp32, a declared incoming gradient folded into the kernel, and the kernel's settings (block, warps, the
gradient pass's direction) giving the same bits.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.interpreted import run_interpreted


def _case(device, dtype, T=40, D=48, V=5000, seed=0):  # T: a whole 32-token chunk and a part
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g).to(device, dtype)
    w = (torch.randn(V, D, generator=g) / D**0.5).to(device)  # fp32 master weight
    labels = torch.randint(0, V, (T,), generator=g).to(device)
    labels[::7] = -100
    return h, w, labels


def _reference(h, w, labels, z_loss_weight):
    """float64 loss and gradients of the same (compute-dtype) operands."""
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().to(h.dtype).double().requires_grad_(True)
    logits = h64 @ w64.t()
    valid = labels != -100
    loss = F.cross_entropy(logits, labels)
    if z_loss_weight:
        loss = loss + z_loss_weight * (torch.logsumexp(logits, -1)[valid] ** 2).mean()
    gh, gw = torch.autograd.grad(loss, (h64, w64))
    return loss, gh, gw


def check(device: str) -> None:
    from moetron.core.layers import loss as L

    for dtype in (torch.bfloat16, torch.float32):
        for z in (0.0, 1e-3):
            h, w, labels = _case(device, dtype)
            results = {}
            for kernel in ("triton", "torch"):
                L.CE_KERNEL = kernel
                hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
                loss = L.linear_cross_entropy(hh, ww, labels, z_loss_weight=z, chunk_tokens=32)
                gh, gw = torch.autograd.grad(loss * 2.0, (hh, ww))  # a grad_output != 1
                results[kernel] = (loss, gh, gw)
            # The same gradient declared (model.fused_loss_prescale): folded into the
            # kernel's row coefficient; a power of two, so the same bits as scaling afterwards.
            L.CE_KERNEL = "triton"
            hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
            with L.loss_weight(2.0):
                loss = L.linear_cross_entropy(hh, ww, labels, z_loss_weight=z, chunk_tokens=32)
            for got, want in zip(torch.autograd.grad(loss * 2.0, (hh, ww)), results["triton"][1:]):
                assert torch.equal(got, want), (dtype, z)
            L.CE_KERNEL = "auto"
            ref_loss, ref_gh, ref_gw = _reference(h, w, labels, z)
            # bf16: the logits themselves are rounded to bf16 (the GEMM's output) on both paths.
            bf16 = dtype == torch.bfloat16
            tol = dict(rtol=2e-2, atol=2e-3) if bf16 else dict(rtol=1e-4, atol=1e-6)
            loss_tol = 1e-3 if bf16 else 1e-5
            for kernel, (loss, gh, gw) in results.items():
                assert abs(loss.double().item() - ref_loss.item()) < loss_tol, (kernel, dtype, z)
                torch.testing.assert_close(gh.double().cpu(), 2 * ref_gh.cpu(), **tol)
                torch.testing.assert_close(gw.double().cpu(), 2 * ref_gw.cpu(), **tol)
            # The kernel and the torch path agree closer than either does with float64.
            torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=0, atol=2e-5)
    # Without gradients: the loss only, the logits untouched.
    from moetron.core.layers.cross_entropy_triton import ce_rows_

    logits = torch.randn(5, 4100, device=device).to(torch.bfloat16)
    before = logits.clone()
    target = torch.tensor([0, 4099, 17, 4096, 2], device=device)
    lse, tgt = ce_rows_(logits, target, None, 0.0, grad=False)
    assert torch.equal(logits, before)
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), -1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(tgt, logits.float().gather(1, target[:, None])[:, 0])
    # The kernel's settings: the gradient pass walked backwards reorders independent element-wise
    # work only (the same bits); block and warps also regroup the row's max / sum (fp32 rounding
    # only). A row that no block divides and an ignored row included.
    coef = torch.tensor([0.25, 0.0, 0.5, 0.125, 1.0], device=device)
    outputs = {}
    for block, warps in ((4096, 8), (1024, 4)):
        for reverse in (False, True):
            g = before.clone()
            lse, tgt = ce_rows_(g, target, coef, 1e-3, grad=True, block=block, num_warps=warps,
                                reversed_grad=reverse)
            outputs[block, reverse] = (g, lse, tgt)
    for block in (4096, 1024):
        assert all(torch.equal(a, b) for a, b in zip(outputs[block, False], outputs[block, True]))
    g, lse, tgt = outputs[4096, False]
    torch.testing.assert_close(outputs[1024, True][1], lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outputs[1024, True][0].float(), g.float(), rtol=1e-2, atol=1e-8)
    p = torch.softmax(before.float(), -1) * (coef * (1 + 2e-3 * lse))[:, None]
    p[torch.arange(5), target] -= coef
    torch.testing.assert_close(g.float(), p, rtol=1e-2, atol=1e-6)


def check_interpreted() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check("cpu")


def test_ce_kernel_interpreted():
    run_interpreted("tests.core.test_loss_triton", "check_interpreted()")


@pytest.mark.gpu
def test_ce_kernel_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check("cuda")


def test_ce_kernel_compiles_for_sm90_without_spills():
    """The row kernel compiles for Hopper on the CPU (ptxas ships with Triton) at the loss' shape (V 100,352, bf16,
    the default block and warps) without spilling registers, and stages nothing in shared memory (its loads are not
    pipelined: sessions 57-58 measured that no faster)."""
    triton = pytest.importorskip("triton")

    from moetron.core.layers import cross_entropy_triton as K
    from tests.core.test_precision_fp8 import _compile_sm90, assert_no_spills

    V = 100352
    values = dict(logits_ptr="*bf16", target_ptr="*i64", coef_ptr="*fp32", lse_ptr="*fp32", tgt_logit_ptr="*fp32",
                  V=V, stride=V, z_loss_weight=0.0)
    compiled = _compile_sm90(K._ce_rows_kernel, triton.Config({}, num_warps=K.NUM_WARPS, num_stages=1), values,
                             dict(GRAD=True, BLOCK=K.BLOCK_V, REVERSE=K.REVERSED))
    assert_no_spills(compiled, "_ce_rows_kernel")
    assert compiled.metadata.shared <= 1024  # the row reductions' scratch only
