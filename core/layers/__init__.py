"""Model-agnostic transformer layers: the token embedding, norms, rotary embeddings, attention, MLPs, the LM
head and its loss."""

from .attention import Attention, AttentionBackend, AttentionConfig, sliding_window_causal_mask
from .embedding import Embedding
from .linear import Linear
from .loss import LMHead, cross_entropy, linear_cross_entropy
from .mlp import SwiGLU
from .norm import RMSNorm
from .rope import RopeScalingConfig, RopeScalingLayers, RopeScalingType, RotaryEmbedding, apply_rotary

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionConfig",
    "Embedding",
    "LMHead",
    "Linear",
    "RMSNorm",
    "RopeScalingConfig",
    "RopeScalingLayers",
    "RopeScalingType",
    "RotaryEmbedding",
    "SwiGLU",
    "apply_rotary",
    "cross_entropy",
    "linear_cross_entropy",
    "sliding_window_causal_mask",
]
