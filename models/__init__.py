"""Olmo 3 dense (and, later, MoE) models as one configurable model with named presets."""

from .config import PRESETS, BlockType, LayerType, ModelConfig
from .transformer import Block, Transformer, cross_entropy_loss

__all__ = ["PRESETS", "Block", "BlockType", "LayerType", "ModelConfig", "Transformer", "cross_entropy_loss"]
