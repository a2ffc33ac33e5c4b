"""The MoE layer on a GPU: no host syncs, grouped GEMM equals the per-expert loop (skipped without CUDA)."""

import pytest
import torch

from moetron.core.moe import ExpertsBackend, MoEConfig, MoELayer, RouterConfig
from moetron.core.moe.kernels.ops import use_backend

pytestmark = pytest.mark.gpu


def _layer(backend, **kw):
    cfg = MoEConfig(num_experts=16, expert_hidden=256, router=RouterConfig(top_k=4, z_loss_weight=1e-3, **kw.pop("router", {})),
                    num_shared_experts=1, experts_backend=backend, **kw)
    torch.manual_seed(0)
    layer = MoELayer(512, cfg, device="cuda")
    layer.init_weights(0.02)
    return layer


@pytest.mark.parametrize("kw", [{}, {"capacity_factor": 1.0}, {"router": {"score": "sigmoid", "expert_bias": True}}])
def test_moe_forward_backward_has_no_host_sync(kw):
    layer = _layer(ExpertsBackend.grouped_mm, **kw)
    x = torch.randn(4, 512, 512, device="cuda", requires_grad=True)
    for _ in range(2):  # the second pass runs with every lazy initialisation done
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
                loss = y.float().square().mean()  # the z-loss rides on y
            loss.backward()
            layer.update_expert_bias()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(x.grad).all()


def test_grouped_mm_matches_loop_and_torch_kernels():
    fast = _layer(ExpertsBackend.grouped_mm)
    ref = _layer(ExpertsBackend.loop)
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 1000, 512, device="cuda")
    xf, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        yf = fast(xf)
        with use_backend("torch"):
            yr = ref(xr)
    torch.testing.assert_close(yf.float(), yr.float(), rtol=2e-2, atol=2e-3)
    g = torch.randn_like(yf)
    yf.backward(g)
    with use_backend("torch"):
        yr.backward(g)
    torch.testing.assert_close(xf.grad, xr.grad, rtol=2e-2, atol=2e-3)
    for (n, a), b in zip(fast.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=3e-2, atol=3e-3, msg=n)
