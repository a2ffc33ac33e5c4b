"""Causal self-attention with grouped-query heads, QK-norm and an optional sliding window.

Legend: B batch, S sequence, D model dim, H query heads, G kv heads, Dh head dim.
QK-norm is an RMSNorm over the whole q (H*Dh) and k (G*Dh) projection, as in Olmo 2/3, not per head.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config, ConfigError, StrEnum
from .linear import Linear, shared_input
from .norm import RMSNorm
from .rope import RopeScalingConfig, RotaryEmbedding, apply_rotary


class AttentionBackend(StrEnum):
    auto = "auto"
    """flex on GPU (measured faster for sliding windows: docs/performance.md) where its kernel exists
    (head_dim >= 16, not float64), sdpa elsewhere."""
    sdpa = "sdpa"
    """torch SDPA: flash kernel for full layers; sliding layers pass a boolean [S, S] mask."""
    flex = "flex"
    """torch flex_attention (compiled) with a block-sparse sliding-window mask: skips the blocks
    outside the window instead of masking them; needs torch.compile to be fast (GPU)."""


@dataclasses.dataclass
class AttentionConfig(Config):
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means n_heads (multi-head attention)."""
    head_dim: int | None = None
    """Per-head width; None means d_model // n_heads."""
    qk_norm: bool = True
    """RMSNorm over the full q and k projections before RoPE."""
    rope_theta: float = 500_000.0
    """RoPE base."""
    sliding_rope_theta: float | None = None
    """RoPE base of the sliding-window layers; None means rope_theta (HF keeps RoPE per layer type)."""
    rope_scaling: RopeScalingConfig | None = None
    """Long-context RoPE scaling (YaRN) and the layers it applies to; None = plain RoPE."""
    backend: AttentionBackend = AttentionBackend.auto
    """Kernel for sliding-window layers (full layers always use SDPA's causal flash path)."""

    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def head_width(self, d_model: int) -> int:
        return d_model // self.n_heads if self.head_dim is None else self.head_dim

    def num_params(self, d_model: int) -> int:
        dh = self.head_width(d_model)
        q, kv = self.n_heads * dh, self.kv_heads() * dh
        norms = (q + kv) if self.qk_norm else 0
        return d_model * q + 2 * d_model * kv + q * d_model + norms

    def validate_for(self, d_model: int, prefix: str = "attention") -> None:
        if self.n_heads <= 0:
            raise ConfigError(f"{prefix}.n_heads must be positive, got {self.n_heads}")
        # 0 is not a spelling of the defaults: those are null (None)
        if self.n_kv_heads is not None and self.n_kv_heads <= 0:
            raise ConfigError(
                f"{prefix}.n_kv_heads must be positive, got {self.n_kv_heads}: set it to a divisor of "
                f"n_heads={self.n_heads}, or null for multi-head attention"
            )
        if self.head_dim is not None and self.head_dim <= 0:
            raise ConfigError(
                f"{prefix}.head_dim must be positive, got {self.head_dim}: set it, or null for d_model // n_heads"
            )
        if self.n_heads % self.kv_heads():
            raise ConfigError(
                f"{prefix}.n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads()}: "
                f"choose n_kv_heads among the divisors of {self.n_heads}"
            )
        if self.head_dim is None and d_model % self.n_heads:
            raise ConfigError(
                f"d_model={d_model} is not divisible by {prefix}.n_heads={self.n_heads}: "
                f"set {prefix}.head_dim explicitly or change n_heads"
            )
        if self.head_width(d_model) % 2:
            raise ConfigError(f"{prefix}: head dim {self.head_width(d_model)} must be even for RoPE")


_MASKS: dict[tuple, torch.Tensor] = {}


def sliding_window_causal_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean [S, S], True where query i may attend key j: 0 <= i - j < window."""
    key = (seq_len, window, str(device))
    mask = _MASKS.get(key)
    if mask is None:
        pos = torch.arange(seq_len, device=device)
        dist_SS = pos[:, None] - pos[None, :]
        mask = (dist_SS >= 0) & (dist_SS < window)
        if len(_MASKS) > 16:
            _MASKS.clear()
        _MASKS[key] = mask
    return mask


_FLEX: dict[tuple, Any] = {}


def use_flex(backend: AttentionBackend, q_BHSD: torch.Tensor) -> bool:
    """Whether a sliding-window layer runs flex_attention: always when asked for, and under auto on
    GPU where its kernel exists (head_dim >= 16, which Triton's tl.dot needs; not float64)."""
    if backend == AttentionBackend.flex:
        return True
    return (backend == AttentionBackend.auto and q_BHSD.device.type == "cuda" and q_BHSD.shape[-1] >= 16
            and q_BHSD.dtype != torch.float64)


def _flex_sliding(q_BHSD, k_BGSD, v_BGSD, window: int, gqa: bool) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    S, device = q_BHSD.shape[2], q_BHSD.device
    if device.type == "cpu" and torch.is_grad_enabled() and q_BHSD.requires_grad:
        raise ConfigError("attention.backend=flex has no backward on the CPU: use --model.attention.backend=sdpa")
    key = (S, window, str(device))
    if key not in _FLEX:

        def sliding_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        block_mask = create_block_mask(sliding_causal, None, None, S, S, device=device)
        fn = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
        _FLEX[key] = (block_mask, fn)
    block_mask, fn = _FLEX[key]
    return fn(q_BHSD, k_BGSD, v_BGSD, block_mask=block_mask, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(
        self,
        d_model: int,
        cfg: AttentionConfig,
        sliding_window: int | None = None,
        norm_eps: float = 1e-6,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads()
        self.head_dim = cfg.head_width(d_model)
        self.sliding_window = sliding_window
        self.backend = cfg.backend
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = Linear(d_model, q_width, device)
        self.k_proj = Linear(d_model, kv_width, device)
        self.v_proj = Linear(d_model, kv_width, device)
        self.o_proj = Linear(q_width, d_model, device)
        self.q_norm = RMSNorm(q_width, norm_eps, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(kv_width, norm_eps, device) if cfg.qk_norm else None
        sliding = sliding_window is not None
        theta = cfg.sliding_rope_theta if sliding and cfg.sliding_rope_theta is not None else cfg.rope_theta
        scaling = cfg.rope_scaling if cfg.rope_scaling is not None and cfg.rope_scaling.applies_to(sliding) else None
        self.rope = RotaryEmbedding(self.head_dim, theta, scaling)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q, k, v = shared_input(x_BSD, self.q_proj, self.k_proj, self.v_proj)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q_BHSD = q.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k_BGSD = k.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_BGSD = v.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos_SD, sin_SD = self.rope(S, x_BSD.device)
        q_BHSD = apply_rotary(q_BHSD, cos_SD, sin_SD, self.rope.triton)
        k_BGSD = apply_rotary(k_BGSD, cos_SD, sin_SD, self.rope.triton)
        gqa = self.n_kv_heads != self.n_heads
        if self.sliding_window is None or self.sliding_window >= S:
            # Full causal: lets SDPA pick the flash kernel on GPU.
            o_BHSD = F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, is_causal=True, enable_gqa=gqa)
        elif use_flex(self.backend, q_BHSD):
            o_BHSD = _flex_sliding(q_BHSD, k_BGSD, v_BGSD, self.sliding_window, gqa)
        else:
            mask_SS = sliding_window_causal_mask(S, self.sliding_window, x_BSD.device)
            o_BHSD = F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, attn_mask=mask_SS, enable_gqa=gqa)
        return self.o_proj(o_BHSD.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))
