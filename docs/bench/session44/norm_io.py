"""Session 44: model.triton_rmsnorm on the inputs each norm of the proxy's model really gets. One bf16-autocast
forward and backward of moe-1t-proxy (4 layers, one sequence of 256 tokens) through the torch path, every
RMSNorm's x, weight, output and incoming gradient kept; then the kernel on each of those, against the torch
path: the output's and dx's differing elements, dx's and dw's relative L2 differences.
Run from the repo root: TRITON_INTERPRET=1 python docs/bench/session44/norm_io.py (CPU, about 2 minutes), or
python docs/bench/session44/norm_io.py cuda (the proxy's batch, 8 x 2048 tokens, and the compiled kernel)."""
import sys

import torch
from moetron.core.layers.norm import RMSNorm
from moetron.core.layers.norm_triton import rmsnorm_backward, rmsnorm_forward
from moetron.models import ModelConfig

cfg = ModelConfig.moe_1t_proxy()
cfg.apply_overrides(["n_layers=4", "triton_rope=false"])
torch.manual_seed(0)
device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
model = cfg.build(device=device)
saved = {}


def keep(name):
    def hook(mod, inp, out):
        saved[name] = {"x": inp[0].detach().clone(), "w": mod.weight.detach().clone(), "y": out.detach().clone()}
        out.register_hook(lambda g: saved[name].__setitem__("dy", g.detach().clone()))
    return hook


for n, m in model.named_modules():
    if isinstance(m, RMSNorm):
        m.register_forward_hook(keep(n))
shape = (8, 2049) if device == "cuda" else (1, 257)
batch = torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(1)).to(device)
with torch.autocast(device, dtype=torch.bfloat16):
    model(batch[:, :-1], batch[:, 1:]).backward()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


for n, d in saved.items():
    x, w, dy = d["x"], d["w"], d["dy"]
    y, rstd = rmsnorm_forward(x, w, cfg.norm_eps)
    dx, dw = rmsnorm_backward(dy, x, w, rstd)
    ref = RMSNorm(x.shape[-1], cfg.norm_eps, device=device)
    ref.weight.data = w.clone()
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    print(f"{n:26s} {str(x.dtype)[6:]:8s} y differs {(y != d['y']).float().mean().item():.1e}; dx differs "
          f"{(dx != xr.grad).float().mean().item():.1e}, rel {rel(dx, xr.grad):.1e}; dw rel {rel(dw, ref.weight.grad):.1e}")
