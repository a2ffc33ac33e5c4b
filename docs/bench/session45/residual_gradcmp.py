"""Session 45: how far does precision.bf16_residual move a bf16 step's loss and gradients, against the error
bf16 autocast already makes? The GPU proxy's model (moe-1t-proxy at 4 layers), one batch, the same weights:
the loss and every parameter's gradient in fp32 without autocast (the reference), then under bf16 autocast
with the fp32 residual stream (today's default), with the bf16 stream (the switch), and with the fp32 stream
and the norms perturbed at fp32 rounding (1 / sqrt for rsqrt: session 44's control), as relative L2
differences to the reference (median and worst over the parameters) and to the bf16 default.
Run from the repo root: python docs/bench/session45/residual_gradcmp.py [cpu|cuda] [tokens]"""
import sys

import torch
from moetron.core.layers import norm as N
from moetron.core.precision import PrecisionConfig
from moetron.models import ModelConfig

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 512
torch_forward = N.RMSNorm.forward


def perturbed(self, x):
    x_f = x.to(torch.promote_types(x.dtype, torch.float32))
    x_f = x_f / torch.sqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
    return (self.weight.to(x_f.dtype) * x_f).to(x.dtype)


runs = {}
for name, recipe, residual, control in (("fp32", "fp32", False, False), ("bf16", "bf16", False, False),
                                        ("bf16_residual", "bf16", True, False), ("bf16_control", "bf16", False, True)):
    N.RMSNorm.forward = perturbed if control else torch_forward
    cfg = ModelConfig.moe_1t_proxy()
    cfg.apply_overrides(["n_layers=4", "triton_rmsnorm=false", "triton_rope=false"])
    torch.manual_seed(0)
    model = cfg.build(device=device)
    policy = PrecisionConfig(recipe=recipe, bf16_residual=residual).build(device, verbose=False)
    policy.apply(model)
    batch = torch.randint(0, cfg.vocab_size, (tokens // 256, 257), generator=torch.Generator().manual_seed(1)).to(device)
    with policy.autocast():
        loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    runs[name] = loss.item(), {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    del model


def compare(name, ref):
    loss, grads = runs[name]
    loss0, base = runs[ref]
    rel = sorted((((grads[n] - g0).norm() / g0.norm().clamp_min(1e-30)).item(), n) for n, g0 in base.items())
    print(f"{name:14s} vs {ref:5s}: loss {loss:.6f} vs {loss0:.6f} ({(loss - loss0) / loss0:+.2e}); gradients median rel "
          f"{rel[len(rel) // 2][0]:.2e}, worst {rel[-1][0]:.2e} {rel[-1][1]}", flush=True)


for name in ("bf16", "bf16_residual", "bf16_control"):
    compare(name, "fp32")
for name in ("bf16_residual", "bf16_control"):
    compare(name, "bf16")
