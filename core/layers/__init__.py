"""Model-agnostic transformer layers: norms, rotary embeddings, attention, MLPs."""

from .attention import Attention, AttentionBackend, AttentionConfig, sliding_window_causal_mask
from .linear import Linear
from .mlp import SwiGLU
from .norm import RMSNorm
from .rope import RopeScalingConfig, RopeScalingLayers, RopeScalingType, RotaryEmbedding, apply_rotary

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionConfig",
    "Linear",
    "RMSNorm",
    "RopeScalingConfig",
    "RopeScalingLayers",
    "RopeScalingType",
    "RotaryEmbedding",
    "SwiGLU",
    "apply_rotary",
    "sliding_window_causal_mask",
]
