"""core/layers/rope_triton.py: RoPE's rotation in one Triton pass each way (model.triton_rope), under
TRITON_INTERPRET=1 on the CPU (a subprocess: the variable must be set before triton is imported) and on
the GPU.

Oracle: apply_rotary's torch path, which the kernel follows operation for operation: equal tensors
forward and backward (the incoming gradient through autograd), fp32 and bf16, q and k as the attention
makes them (views of [B, S, H x Dh] transposed), head counts below and above a program's block, a half
head dim that is no power of two, arbitrary tables; a whole model with the switch gives the same loss
and gradients as without it; compiled regions and the CPU without the interpreter take the torch path.
"""

from __future__ import annotations

import pytest
import torch

from moetron.core.layers.rope import RotaryEmbedding, apply_rotary
from tests.interpreted import run_interpreted, tiny_model_step

INTERPRETED = ("check('cpu')",)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, triton: bool, grad: torch.Tensor):
    """(apply_rotary's output, x's gradient for the incoming ``grad``)."""
    xr = x.detach().clone().requires_grad_()
    y = apply_rotary(xr, cos, sin, triton)
    y.backward(grad)
    return y.detach(), xr.grad


def check(device: str) -> None:
    from moetron.core.layers import rope as R

    g = torch.Generator().manual_seed(0)
    R.KERNEL = "triton"
    try:
        for B, S, H, D, dtype in ((2, 5, 3, 16, torch.float32), (1, 7, 20, 12, torch.bfloat16),
                                  (2, 3, 4, 8, torch.bfloat16)):
            # as the attention makes q: [B, S, H * Dh] viewed [B, S, H, Dh], transposed to [B, H, S, Dh]
            x = torch.randn(B, S, H * D, generator=g).to(dtype).to(device).view(B, S, H, D).transpose(1, 2)
            cos, sin = (torch.randn(S, D, generator=g).to(device) for _ in range(2))  # any tables
            grad = torch.randn(B, H, S, D, generator=g).to(dtype).to(device)
            want_y, want_dx = _rotated(x, cos, sin, False, grad)
            got_y, got_dx = _rotated(x, cos, sin, True, grad)
            assert got_y.dtype == dtype and got_y.stride() == want_y.stride(), (got_y.stride(), want_y.stride())
            assert torch.equal(got_y, want_y), (B, S, H, D, dtype)
            assert torch.equal(got_dx, want_dx), (B, S, H, D, dtype)
            assert not torch.equal(got_y, x)  # it rotated
        # The real tables (RotaryEmbedding's, YaRN's scaling included), on a contiguous x.
        from moetron.core.layers.rope import RopeScalingConfig

        rope = RotaryEmbedding(16, 10_000.0, RopeScalingConfig(factor=4.0, original_max_position_embeddings=8))
        cos, sin = rope(9, torch.device(device))
        x = torch.randn(2, 3, 9, 16, generator=g).to(torch.bfloat16).to(device)
        grad = torch.randn(2, 3, 9, 16, generator=g).to(torch.bfloat16).to(device)
        for want, got in zip(_rotated(x, cos, sin, False, grad), _rotated(x, cos, sin, True, grad)):
            assert torch.equal(got, want)
        # A whole tiny model with model.triton_rope: the loss and every gradient the same bits.
        runs = {}
        for on in (False, True):
            model, *runs[on] = tiny_model_step(device, f"triton_rope={str(on).lower()}")
            assert all(m.triton == on for m in model.modules() if isinstance(m, RotaryEmbedding))
        assert torch.equal(runs[True][0], runs[False][0])
        for n, grad in runs[False][1].items():
            assert torch.equal(runs[True][1][n], grad), n
    finally:
        R.KERNEL = "auto"


def test_rope_interpreted():
    run_interpreted("tests.core.test_rope_triton", "check('cpu')")


@pytest.mark.gpu
def test_rope_on_gpu():
    check("cuda")
    # At a step's size (olmoe3-4l-8e's q: 4 x 4096 tokens, 32 heads of 128, bf16): the same bits.
    x = torch.randn(4, 4096, 32 * 128, device="cuda").to(torch.bfloat16).view(4, 4096, 32, 128).transpose(1, 2)
    cos, sin = RotaryEmbedding(128, 500_000.0)(4096, torch.device("cuda"))
    grad = torch.randn(4, 32, 4096, 128, device="cuda").to(torch.bfloat16)
    for want, got in zip(_rotated(x, cos, sin, False, grad), _rotated(x, cos, sin, True, grad)):
        assert torch.equal(got, want)


def test_torch_path_where_it_should(monkeypatch):
    """triton=True on the CPU without the interpreter, and while torch.compile traces: the torch path."""
    from moetron.core.layers import rope as R

    x = torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(3, 8), torch.randn(3, 8)
    assert torch.equal(apply_rotary(x, cos, sin, True), apply_rotary(x, cos, sin))
    assert not R._takes_triton(x, cos, sin)
    monkeypatch.setattr(R, "KERNEL", "triton")
    assert R._takes_triton(x, cos, sin) and not R._takes_triton(x.double(), cos, sin)
    assert not R._takes_triton(x, cos.double(), sin.double())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not R._takes_triton(x, cos, sin)
