"""Each preset built on the meta device: its parameter count is pinned and equals the config's count."""

import pytest
import torch

from moetron.core.config import ConfigError
from moetron.models import PRESETS, LayerType, ModelConfig

# Olmo 3 7B: 7.30B (32 x 4096, MHA, MLP 11008, vocab 100352, untied);
# Olmo 3 32B: 32.23B (64 x 5120, 40 heads / 8 KV, MLP 27648).
PINNED = {"tiny": 5_246_720, "olmo3-7b": 7_298_617_344, "olmo3-32b": 32_234_279_936}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_counts_on_meta(name):
    cfg = ModelConfig.preset(name)
    model = cfg.build(device="meta")
    built = sum(p.numel() for p in model.parameters())
    assert built == cfg.num_params() == PINNED[name]


def test_olmo3_7b_shapes():
    cfg = ModelConfig.olmo3_7b()
    model = cfg.build(device="meta")
    block = model.blocks["0"]
    assert block.attention.q_norm.weight.shape == (4096,)  # QK-norm over the whole projection
    assert block.mlp.gate_proj.weight.shape == (11008, 4096)
    assert model.lm_head.weight.shape == (100352, 4096)
    assert model.lm_head.weight is not model.embed.weight


def test_olmo3_32b_gqa_shapes():
    block = ModelConfig.olmo3_32b().build(device="meta").blocks["0"]
    assert block.attention.k_proj.weight.shape == (8 * 128, 5120)
    assert block.attention.k_norm.weight.shape == (1024,)


def test_layer_pattern_three_of_four_windowed_last_full():
    types = ModelConfig.olmo3_7b().resolved_layer_types()
    assert types[:4] == [LayerType.sliding] * 3 + [LayerType.full]
    assert types.count(LayerType.full) == 8
    odd = ModelConfig(n_layers=6, sliding_window=8).resolved_layer_types()
    assert odd == ["sliding", "sliding", "sliding", "full", "sliding", "full"]


def test_explicit_layer_types_win_and_are_checked():
    cfg = ModelConfig(n_layers=2, layer_types=["full", "sliding"], sliding_window=8)
    assert cfg.window_of(0) is None and cfg.window_of(1) == 8
    with pytest.raises(ConfigError, match="layer_types lists 3 layers"):
        ModelConfig(n_layers=2, layer_types=["full"] * 3).validate()


def test_flops_per_token_standard_formula():
    cfg = ModelConfig.olmo3_7b()
    non_embedding = cfg.num_params() - cfg.vocab_size * cfg.d_model
    attn = 12 * 4096 * (8 * 8192 + 24 * 4096)  # 8 full layers at 8192, 24 windowed at 4096
    assert cfg.flops_per_token(8192) == 6 * non_embedding + attn


def test_bad_model_configs():
    with pytest.raises(ConfigError, match="not a multiple of n_kv_heads"):
        ModelConfig.from_dict({"attention": {"n_heads": 6, "n_kv_heads": 4}}).validate()
    with pytest.raises(ConfigError, match="unknown model preset 'olmo3-8b'"):
        ModelConfig.preset("olmo3-8b")
