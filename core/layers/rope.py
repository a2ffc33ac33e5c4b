"""Rotary position embeddings (RoPE), half-split layout: dims [0, d/2) pair with [d/2, d).

Optional YaRN scaling (Peng et al. 2023, as HF transformers computes it) stretches the low
frequencies for long context; released Olmo 3 checkpoints use it on their full-attention layers only.

Legend: B batch, S sequence, H heads, Dh head dim.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..config import Config, ConfigError, StrEnum


class RopeScalingType(StrEnum):
    yarn = "yarn"
    """YaRN: interpolate low frequencies by `factor`, keep high ones, scale cos/sin by attention_factor."""


class RopeScalingLayers(StrEnum):
    full = "full"
    """Only full-attention layers are scaled (Olmo 3's long-context releases)."""
    sliding = "sliding"
    """Only sliding-window layers are scaled."""
    all = "all"
    """Every layer is scaled."""


@dataclasses.dataclass
class RopeScalingConfig(Config):
    type: RopeScalingType = RopeScalingType.yarn
    """Scaling method (see RopeScalingType)."""
    factor: float = 1.0
    """Context extension factor (new context / original_max_position_embeddings)."""
    original_max_position_embeddings: int = 4096
    """Context length the model was pre-trained at, before the extension."""
    beta_fast: float = 32.0
    """YaRN: rotations above which a frequency is kept as is (extrapolated)."""
    beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is fully interpolated."""
    attention_factor: float | None = None
    """Multiplies cos and sin; None derives it from factor (and mscale, mscale_all_dim) as YaRN does."""
    mscale: float | None = None
    """DeepSeek-style attention_factor numerator scale (only with mscale_all_dim)."""
    mscale_all_dim: float | None = None
    """DeepSeek-style attention_factor denominator scale (only with mscale)."""
    truncate: bool = True
    """Round the correction range to whole dims (YaRN's default)."""
    layers: RopeScalingLayers = RopeScalingLayers.full
    """Which layers are scaled (see RopeScalingLayers)."""

    def validate(self) -> None:
        super().validate()
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ConfigError("attention.rope_scaling.factor and original_max_position_embeddings must be positive")

    def applies_to(self, sliding: bool) -> bool:
        return self.layers == RopeScalingLayers.all or (self.layers == RopeScalingLayers.sliding) == sliding

    def resolved_attention_factor(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return get_mscale(self.factor)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/Dh) for i in [0, Dh/2), fp32, shape [Dh/2]."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponent)


def yarn_inv_freq(head_dim: int, theta: float, cfg: RopeScalingConfig, device=None) -> torch.Tensor:
    """YaRN inverse frequencies [Dh/2] (fp32), op for op as transformers' _compute_yarn_parameters."""

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(cfg.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp_F = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs_F = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
    extrapolation_F = 1.0 / pos_freqs_F
    interpolation_F = 1.0 / (cfg.factor * pos_freqs_F)
    keep_F = 1 - ramp_F  # 1 where the frequency is kept (extrapolated), 0 where interpolated
    return interpolation_F * (1 - keep_F) + extrapolation_F * keep_F


class RotaryEmbedding(nn.Module):
    """Produces cos/sin tables [S, Dh] in fp32 for positions 0..S-1 (cached per length and device)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScalingConfig | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.triton = False  # apply_rotary's triton for the tensors this module's tables rotate (model.triton_rope)
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, Dh] fp32, computed (no cache)."""
        if self.scaling is None:
            inv_freq_F = rope_inv_freq(self.head_dim, self.theta, device)
        else:
            inv_freq_F = yarn_inv_freq(self.head_dim, self.theta, self.scaling, device)
        pos_S = torch.arange(seq_len, dtype=torch.float32, device=device)
        angles_SF = torch.outer(pos_S, inv_freq_F)
        angles_SD = torch.cat([angles_SF, angles_SF], dim=-1)
        cos_SD, sin_SD = angles_SD.cos(), angles_SD.sin()
        if self.scaling is not None:
            scale = self.scaling.resolved_attention_factor()
            cos_SD, sin_SD = cos_SD * scale, sin_SD * scale
        return cos_SD, sin_SD

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        if torch.compiler.is_compiling():
            # Not filled yet (see prefill): the compiled graph computes the tables itself. Writing
            # the cache from inside it is a side effect that torch.compile refuses under activation
            # checkpointing (the whole block then ran eagerly with memory.recompute=full).
            return self.tables(seq_len, device)
        self._cache = {key: self.tables(seq_len, device)}
        return self._cache[key]

    def prefill(self, seq_len: int, device: torch.device) -> None:
        """Fill the cache outside any compiled region (the model's forward calls it before its
        blocks): a compiled block then reads the tables instead of computing cos/sin inside its
        fused RoPE and norm kernels, once per element of q and k (3.5 ms of an OLMoE-8L step)."""
        if not torch.compiler.is_compiling():
            self(seq_len, device)


KERNEL = "auto"
"""Where the Triton rotation runs when asked for (apply_rotary's ``triton``): "auto" (CUDA tensors),
"triton" (also CPU ones, under TRITON_INTERPRET=1: the tests)."""


class _TritonRotary(torch.autograd.Function):
    """forward(x, cos, sin) = apply_rotary's torch path bit for bit, in one pass; backward the same
    pass rotating the other way (core/layers/rope_triton.py)."""

    @staticmethod
    def forward(ctx, x, cos_SD, sin_SD):
        from .rope_triton import rotate

        ctx.save_for_backward(cos_SD, sin_SD)
        return rotate(x, cos_SD, sin_SD)

    @staticmethod
    def backward(ctx, grad):
        from .rope_triton import rotate

        cos_SD, sin_SD = ctx.saved_tensors
        return rotate(grad, cos_SD, sin_SD, backward=True), None, None


def _takes_triton(x: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> bool:
    if torch.compiler.is_compiling() or (KERNEL != "triton" and x.device.type != "cuda"):
        return False
    return (x.dim() == 4 and x.dtype in (torch.float32, torch.bfloat16) and cos_SD.dtype == sin_SD.dtype == torch.float32
            and cos_SD.shape == sin_SD.shape == (x.shape[2], x.shape[3]) and cos_SD.is_contiguous()
            and sin_SD.is_contiguous() and not cos_SD.requires_grad and not sin_SD.requires_grad)


def apply_rotary(x_BHSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor, triton: bool = False) -> torch.Tensor:
    """Rotate x [B, H, S, Dh] by position; math in fp32, result in x's dtype. ``triton``
    (model.triton_rope, RotaryEmbedding.triton): in eager steps on CUDA, one Triton pass each way with
    the same bits (core/layers/rope_triton.py); compiled regions and the CPU take the torch path."""
    if triton and _takes_triton(x_BHSD, cos_SD, sin_SD):
        return _TritonRotary.apply(x_BHSD, cos_SD, sin_SD)
    x_f = x_BHSD.to(torch.promote_types(x_BHSD.dtype, torch.float32))
    half = x_f.shape[-1] // 2
    rotated = torch.cat([-x_f[..., half:], x_f[..., :half]], dim=-1)
    return (x_f * cos_SD.to(x_f.dtype) + rotated * sin_SD.to(x_f.dtype)).to(x_BHSD.dtype)


def prefill_ropes(ropes: list[RotaryEmbedding], seq_len: int, device: torch.device) -> None:
    """Fill every RoPE table for ``seq_len`` before the blocks run (RotaryEmbedding.prefill): the
    one call the model's forward and each pipeline stage's forward make."""
    for rope in ropes:
        rope.prefill(seq_len, device)


def rope_modules(module: nn.Module) -> list[RotaryEmbedding]:
    """The RotaryEmbedding modules under ``module`` (look them up once: the tree is fixed after build)."""
    return [m for m in module.modules() if isinstance(m, RotaryEmbedding)]
