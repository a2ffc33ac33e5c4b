"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), no biases."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear, shared_input


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise: the activation of every SwiGLU (dense, shared and routed)."""
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, device: torch.device | None = None):
        super().__init__()
        self.act = swiglu  # recompute may swap in a checkpointed twin (core/memory.py)
        self.gate_proj = Linear(d_model, hidden, device)
        self.up_proj = Linear(d_model, hidden, device)
        self.down_proj = Linear(hidden, d_model, device)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(*shared_input(x_BSD, self.gate_proj, self.up_proj)))
