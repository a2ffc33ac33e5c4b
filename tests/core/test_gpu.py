"""GPU paths against the CPU fp32 results (skipped without CUDA)."""

import pytest
import torch

from moetron.core.layers import Attention, AttentionConfig
from moetron.models import ModelConfig, cross_entropy_loss

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("window", [None, 128])
def test_attention_gpu_matches_cpu(backend, window):
    torch.manual_seed(0)
    cpu = Attention(512, AttentionConfig(n_heads=8, n_kv_heads=2, head_dim=64), sliding_window=window)
    gpu_cfg = AttentionConfig(n_heads=8, n_kv_heads=2, head_dim=64, backend=backend)
    gpu = Attention(512, gpu_cfg, sliding_window=window, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(2, 1024, 512)
    xg = x.cuda().requires_grad_()
    x.requires_grad_()
    ref = cpu(x)  # fp32 SDPA on the CPU is the reference for both GPU backends
    out = gpu(xg)
    torch.testing.assert_close(out.cpu(), ref, rtol=2e-3, atol=2e-4)
    ref.square().sum().backward()
    out.square().sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), x.grad, rtol=2e-3, atol=2e-3)


def test_tiny_model_trains_on_gpu_like_cpu():
    """Same init, same batches: bf16-autocast GPU losses track fp32 CPU losses."""
    cfg = ModelConfig.tiny()
    torch.manual_seed(0)
    cpu = cfg.build()
    gpu = cfg.build(device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    batches = torch.randint(0, cfg.vocab_size, (5, 4, 129))
    losses = {}
    for name, model, dev in (("cpu", cpu, "cpu"), ("gpu", gpu, "cuda")):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for b in batches:
            b = b.to(dev)
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                logits = model(b[:, :-1])
            loss = cross_entropy_loss(logits, b[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[name] = out
    for a, b in zip(losses["cpu"], losses["gpu"]):
        assert abs(a - b) < 2e-2, losses
