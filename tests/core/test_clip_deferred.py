"""Gradient clipping folded into the optimizer step (core.grad.clip_grad_norm_(defer_to=...),
core.adamw.PrecisionAwareAdamW.defer_grad_scale): against clipping's own multiply pass followed by
torch.optim.AdamW, bit for bit; the Triton kernel's grad_scale under TRITON_INTERPRET=1 against the
multiply then the kernel without it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetron.core.adamw import PrecisionAwareAdamW
from moetron.core.grad import clip_grad_norm_
from tests.interpreted import run_interpreted


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _grads(model, seed):
    torch.manual_seed(100 + seed)
    model(torch.randn(4, 16)).square().sum().backward()


def test_deferred_clip_equals_clip_then_adamw():
    ref, new = _model(), _model()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    opt_new = PrecisionAwareAdamW(new.parameters(), lr=1e-2, state_dtype=torch.float32, kernel="foreach")
    for step in range(4):
        for m in (ref, new):
            _grads(m, step)
        norm_ref = clip_grad_norm_(list(ref.parameters()), 0.05)
        norm_new = clip_grad_norm_(list(new.parameters()), 0.05, defer_to=opt_new)
        assert torch.equal(norm_ref, norm_new) and norm_ref > 0.05  # clipping is active
        opt_ref.step()
        opt_new.step()
        for a, b in zip(ref.parameters(), new.parameters()):
            assert torch.equal(a, b)
        for a, b in zip(ref.parameters(), new.parameters()):
            assert torch.equal(a.grad, b.grad)  # the foreach path scales them in place, as clipping does
        opt_ref.zero_grad()
        opt_new.zero_grad()


def test_zero_grad_forgets_a_deferred_scale():
    model = _model()
    opt = PrecisionAwareAdamW(model.parameters(), lr=1e-2, state_dtype=torch.float32, kernel="foreach")
    _grads(model, 0)
    clip_grad_norm_(list(model.parameters()), 1e-3, defer_to=opt)
    opt.zero_grad()  # a skipped step (the trainer's non-finite path)
    assert opt._grad_scale is None


def check_kernel(device: str) -> None:
    """The kernel's grad_scale against clipping's multiply followed by the kernel without it: the
    same parameters and moments bit for bit, the gradient left unscaled."""
    from moetron.core.adamw_triton import adamw_update_

    torch.manual_seed(0)
    for state in (torch.float32, torch.bfloat16):
        # two whole 1024-element blocks and a part-filled one (interpreted, a program costs ~0.1 s)
        p, g = torch.randn(2_051, device=device), torch.randn(2_051, device=device)
        m = torch.zeros(2_051, device=device, dtype=state)
        v = torch.zeros_like(m)
        scale = torch.tensor(0.37, dtype=torch.float32, device=device)
        a, b = [t.clone() for t in (p, g, m, v)], [t.clone() for t in (p, g, m, v)]
        kw = dict(step=1.0, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        adamw_update_(*a, grad_scale=scale, **kw)
        torch._foreach_mul_([b[1]], scale)
        adamw_update_(*b, **kw)
        for x, y in zip(a[0:1] + a[2:], b[0:1] + b[2:]):
            assert torch.equal(x, y), state
        assert torch.equal(a[1], g)  # the gradient left unscaled


def test_kernel_grad_scale_interpreted():
    run_interpreted("tests.core.test_clip_deferred", "check_kernel('cpu')")


@pytest.mark.gpu
def test_deferred_clip_on_gpu_equals_clip_then_kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_kernel("cuda")
