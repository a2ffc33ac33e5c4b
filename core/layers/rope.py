"""Rotary position embeddings (RoPE), half-split layout: dims [0, d/2) pair with [d/2, d).

Legend: B batch, S sequence, H heads, Dh head dim.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/Dh) for i in [0, Dh/2), fp32, shape [Dh/2]."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponent)


class RotaryEmbedding(nn.Module):
    """Produces cos/sin tables [S, Dh] in fp32 for positions 0..S-1 (cached per length and device)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self._cache:
            inv_freq_F = rope_inv_freq(self.head_dim, self.theta, device)
            pos_S = torch.arange(seq_len, dtype=torch.float32, device=device)
            angles_SF = torch.outer(pos_S, inv_freq_F)
            angles_SD = torch.cat([angles_SF, angles_SF], dim=-1)
            self._cache = {key: (angles_SD.cos(), angles_SD.sin())}
        return self._cache[key]


def apply_rotary(x_BHSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, S, Dh] by position; math in fp32, result in x's dtype."""
    x_f = x_BHSD.to(torch.promote_types(x_BHSD.dtype, torch.float32))
    half = x_f.shape[-1] // 2
    rotated = torch.cat([-x_f[..., half:], x_f[..., :half]], dim=-1)
    return (x_f * cos_SD.to(x_f.dtype) + rotated * sin_SD.to(x_f.dtype)).to(x_BHSD.dtype)
