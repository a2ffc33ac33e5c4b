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
    if cfg.num_params() > 3e11:
        pytest.skip("the 1T+ presets are counted analytically only (below)")
    model = cfg.build(device="meta")
    built = sum(p.numel() for p in model.parameters())
    assert built == cfg.num_params()
    if name in PINNED:
        assert built == PINNED[name]


def _moe_active_by_hand(cfg):
    """Count the parameters one token uses from the built modules (meta device)."""
    model = cfg.build(device="meta")
    active = 0
    for name, p in model.named_parameters():
        if ".experts." in name:  # stacked [E, ...]: a token uses top_k of them
            active += p.numel() // cfg.moe.num_experts * cfg.moe.router.top_k
        else:
            active += p.numel()
    return active


@pytest.mark.parametrize(
    "name,active,total",
    [
        ("olmo3-moe-64e", 3.17e9, 24.31e9),  # the published operating point
        ("olmo3-moe-8e", 3.17e9, 4.6e9),
        ("olmo3-moe-128e", 3.17e9, 47e9),
        ("olmoe-1b-7b", 1.28e9, 6.92e9),  # OLMoE-1B-7B: 1.3B active, 6.9B total
        ("moe-1t-proxy", 88.10e6, 1.258e9),  # docs/moe.md
    ],
)
def test_moe_family_counts(name, active, total):
    cfg = ModelConfig.preset(name)
    assert cfg.num_active_params() == pytest.approx(active, rel=0.01)
    assert cfg.num_params() == pytest.approx(total, rel=0.01)
    assert cfg.num_active_params() == _moe_active_by_hand(cfg)


def test_moe_1t_counts():
    cfg = ModelConfig.preset("moe-1t")
    assert cfg.num_active_params() == pytest.approx(58.4e9, rel=0.01)
    assert cfg.num_params() == pytest.approx(1.2e12, rel=0.01)
    assert ModelConfig.preset("moe-2.4t").num_params() == pytest.approx(2.38e12, rel=0.01)


def test_moe_block_design():
    cfg = ModelConfig.olmo3_moe(64)
    model = cfg.build(device="meta")
    assert not model.blocks["0"].is_moe and model.blocks["1"].is_moe  # first layer dense
    moe = model.blocks["1"].mlp
    assert moe.experts.w_gate_up.shape == (64, 2 * 4096, 4096) and moe.shared is not None
    assert cfg.moe.router.top_k == 4


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


@pytest.mark.parametrize("override,message", [
    ("--norm_eps=0", r"model\.norm_eps must be a positive finite number.*got 0\.0.*--model\.norm_eps=1e-6"),
    ("--norm_eps=-1e-6", r"model\.norm_eps must be a positive"),
    ("--norm_eps=nan", r"model\.norm_eps must be a positive finite number.*got nan"),
    ("--attention.n_kv_heads=0", r"model\.attention\.n_kv_heads must be positive, got 0.*divisor of n_heads=4"),
    ("--attention.n_kv_heads=-2", r"model\.attention\.n_kv_heads must be positive, got -2"),
    ("--attention.head_dim=0", r"model\.attention\.head_dim must be positive, got 0.*null for d_model // n_heads"),
    ("--attention.n_kv_heads=3", r"n_heads=4 is not a multiple of n_kv_heads=3"),
])
def test_model_range_checks(override, message):
    """0 or a negative count is an error naming the field, never a silent default (head_dim=0 used to
    mean d_model // n_heads, n_kv_heads=-2 passed the divisibility check)."""
    cfg = ModelConfig.tiny().apply_overrides([override])
    with pytest.raises(ConfigError, match=message):
        cfg.validate()
    with pytest.raises(ConfigError, match=message):
        cfg.build(device="meta")
