"""Probe: does a backward run under autocast cast the backward's own matmuls? A router-style fp32
matmul (autocast disabled in its forward) has its weight gradient compared against float64, with the
backward outside autocast and inside it."""
import torch

dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
x = torch.randn(8192, 2048, device=dev)
w = torch.randn(64, 2048, device=dev, requires_grad=True)
g = torch.randn(8192, 64, device=dev)

def fwd():
    with torch.autocast(dev, dtype=torch.bfloat16):
        with torch.autocast(dev, enabled=False):
            return x.float() @ w.float().t()

truth = (g.double().t() @ x.double())
for where in ("outside", "inside"):
    w.grad = None
    y = fwd()
    if where == "inside":
        with torch.autocast(dev, dtype=torch.bfloat16):
            y.backward(g)
    else:
        y.backward(g)
    err = float((w.grad.double() - truth).norm() / truth.norm())
    print(f"{dev} torch {torch.__version__}: router-style fp32 weight grad, backward {where} autocast: rel err vs fp64 {err:.2e}")
