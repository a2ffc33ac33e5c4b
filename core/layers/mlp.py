"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), no biases."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, device: torch.device | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False, device=device)
        self.up_proj = nn.Linear(d_model, hidden, bias=False, device=device)
        self.down_proj = nn.Linear(hidden, d_model, bias=False, device=device)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BSD)) * self.up_proj(x_BSD))
