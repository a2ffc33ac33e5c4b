"""Session 44 (queued): is model.triton_rmsnorm's gradient the torch path's on the GPU proxy's model? One batch
of the proxy's size (8 x 2048 tokens, moe-1t-proxy at 4 layers, bf16 autocast as the bf16 recipe runs), the
same weights: the loss and each parameter's gradient with the norm off twice (the step's own run-to-run
noise), on twice, and off with the torch path perturbed at fp32 rounding (1 / sqrt for rsqrt: the control
for how far one rounding apart in every norm moves a bf16 step's gradients), as relative L2 differences
against the first run without it. On the CPU at 256 tokens (session 44): the kernel 0.3% median, the
control 1.7%. Run from the repo root: python docs/bench/session44/gradcmp.py [cpu]"""
import sys

import torch
from moetron.core.layers import norm as N
from moetron.models import ModelConfig

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
shape = (8, 2049) if device == "cuda" else (1, 257)
if device == "cpu":
    N.KERNEL = "triton"  # the kernel on the CPU: run under TRITON_INTERPRET=1
torch_forward = N.RMSNorm.forward


def perturbed(self, x):
    x_f = x.to(torch.promote_types(x.dtype, torch.float32))
    x_f = x_f / torch.sqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
    return (self.weight.to(x_f.dtype) * x_f).to(x.dtype)


runs = []
for name, on in (("off", False), ("off2", False), ("on", True), ("on2", True), ("control", False)):
    N.RMSNorm.forward = perturbed if name == "control" else torch_forward
    cfg = ModelConfig.moe_1t_proxy()
    cfg.apply_overrides(["n_layers=4", f"triton_rmsnorm={str(on).lower()}", "triton_rope=false"])
    torch.manual_seed(0)
    model = cfg.build(device=device)
    batch = torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    runs.append((name, loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}))
    del model
base = runs[0][2]
for name, loss, grads in runs[1:]:
    rel = sorted((((grads[n] - g0).norm() / g0.norm().clamp_min(1e-30)).item(), n) for n, g0 in base.items())
    print(f"{name} vs off: loss {loss:.7f} vs {runs[0][1]:.7f}; median rel {rel[len(rel) // 2][0]:.2e}; worst:",
          "; ".join(f"{r:.2e} {n}" for r, n in rel[::-1][:6]), flush=True)
