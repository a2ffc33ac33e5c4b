"""HF interop: config mapping, name maps, logits equal to transformers' own Olmo3/Olmoe (the oracle),
export reloads in transformers, native -> HF -> native is bit-exact."""

from __future__ import annotations

import json
import re
import os
import shutil

import pytest
import torch

tf = pytest.importorskip("transformers")

from moetron.core.checkpoint import CheckpointError
from moetron.core.layers.rope import RopeScalingLayers
from moetron.core.weights import iter_weights, save_weights
from moetron.models import ModelConfig
from moetron.models.config import BlockType, LayerType
from moetron.models.hf import (
    MOETRON,
    OLMO3,
    OLMOE,
    export_architecture,
    export_hf,
    hf_native_specs,
    hf_to_native,
    iter_hf_tensors,
    load_hf_model,
    native_config,
    native_to_hf,
    read_hf_config,
)

SEQ = 40  # longer than the sliding window (8) and than YaRN's original context (16)


def _perturb(model) -> None:
    """Random norms too (HF inits them to ones), so a swapped norm would show in the logits."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def olmo3_hf_config(**kw):
    args = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, rms_norm_eps=1e-6, max_position_embeddings=64,
        # not the default pattern: importing must follow config.json
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        # as the long-context releases: YaRN on full layers only
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                               "original_max_position_embeddings": 16, "attention_factor": 1.2},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5_000.0},
        },
        pad_token_id=None, eos_token_id=None,
    )
    args.update(kw)
    return tf.Olmo3Config(**args)


def olmoe_hf_config(**kw):
    args = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, pad_token_id=None, eos_token_id=None)
    args.update(kw)
    return tf.OlmoeConfig(**args)


def _save(config_cls_model, path, **save_kw):
    torch.manual_seed(0)
    model = config_cls_model.eval()
    _perturb(model)
    model.save_pretrained(path, **save_kw)
    return model


@pytest.fixture(scope="module")
def olmo3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "olmo3")
    return path, _save(tf.Olmo3ForCausalLM(olmo3_hf_config()), path)


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "olmoe")
    model = _save(tf.OlmoeForCausalLM(olmoe_hf_config()), path)
    sharded = str(tmp_path_factory.mktemp("hf") / "olmoe_sharded")
    model.save_pretrained(sharded, max_shard_size="40KB")
    return path, sharded, model


def _ids(vocab=128):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _max_diff(hf_model, model) -> float:
    ids = _ids()
    with torch.no_grad():
        return (hf_model(ids).logits - model(ids)).abs().max().item()


# ---- config ---------------------------------------------------------------------------------


def test_read_olmo3_config_follows_config_json(olmo3):
    cfg = read_hf_config(olmo3[0])
    assert (cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.mlp_hidden) == (64, 4, 128, 96)
    assert cfg.moe is None and cfg.block_type == BlockType.reordered_norm
    assert cfg.layer_types == [LayerType.sliding, LayerType.full, LayerType.sliding, LayerType.full]
    assert cfg.sliding_window == 8 and cfg.norm_eps == 1e-6
    att = cfg.attention
    assert (att.n_heads, att.kv_heads(), att.qk_norm) == (4, 2, True)
    assert att.rope_theta == 10_000.0 and att.sliding_rope_theta == 5_000.0
    assert att.rope_scaling.layers == RopeScalingLayers.full and att.rope_scaling.factor == 4.0
    assert att.rope_scaling.original_max_position_embeddings == 16 and att.rope_scaling.attention_factor == 1.2


def test_read_olmoe_config(olmoe):
    cfg = read_hf_config(olmoe[0])
    assert cfg.block_type == BlockType.pre_norm and cfg.sliding_window is None
    assert cfg.moe.num_experts == 8 and cfg.moe.expert_hidden == 32
    assert cfg.moe.router.top_k == 2 and cfg.moe.router.renormalize is False
    assert cfg.moe.num_shared_experts == 0 and cfg.moe.dense_layers == []
    assert cfg.norm_eps == 1e-5 and cfg.attention.rope_theta == 10_000.0


def test_legacy_rope_format_is_scaled_on_full_layers_only(olmo3, tmp_path):
    """Released Olmo 3 config.json files: top-level rope_theta + rope_scaling (YaRN), which
    transformers applies to the full-attention layers only."""
    legacy = str(tmp_path / "legacy")
    shutil.copytree(olmo3[0], legacy)
    path = os.path.join(legacy, "config.json")
    hf = json.load(open(path))
    del hf["rope_parameters"]
    hf["rope_theta"] = 500_000.0
    hf["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                          "attention_factor": 1.2, "beta_fast": 32, "beta_slow": 1}
    json.dump(hf, open(path, "w"))
    cfg = read_hf_config(legacy)
    assert cfg.attention.rope_theta == 500_000.0 and cfg.attention.sliding_rope_theta is None
    assert cfg.attention.rope_scaling.layers == RopeScalingLayers.full
    hf_model = tf.AutoModelForCausalLM.from_pretrained(legacy).eval()
    _, model = load_hf_model(legacy)
    assert _max_diff(hf_model, model) < 1e-4


def test_export_architecture():
    assert export_architecture(ModelConfig.tiny())[0] == OLMO3
    assert export_architecture(ModelConfig.olmoe_1b_7b())[0] == OLMOE
    arch, why = export_architecture(ModelConfig.tiny_moe())
    assert arch == MOETRON and "shared experts" in why and "dense layers" in why


# ---- names ----------------------------------------------------------------------------------


def test_name_maps():
    assert hf_to_native("model.layers.3.post_attention_layernorm.weight", OLMO3) == "blocks.3.attention_norm.weight"
    assert hf_to_native("model.layers.3.post_attention_layernorm.weight", OLMOE) == "blocks.3.mlp_norm.weight"
    assert hf_to_native("model.layers.0.input_layernorm.weight", OLMOE) == "blocks.0.attention_norm.weight"
    assert hf_to_native("model.layers.1.mlp.experts.5.up_proj.weight", OLMOE) == "blocks.1.mlp.experts.w_gate_up"
    assert hf_to_native("model.layers.1.mlp.experts.gate_up_proj", OLMOE) == "blocks.1.mlp.experts.w_gate_up"
    assert hf_to_native("model.layers.1.mlp.gate.weight", OLMOE) == "blocks.1.mlp.router.weight"
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.gate.weight"):
        hf_to_native("model.layers.0.mlp.gate.weight", OLMO3)
    cfg = ModelConfig.olmoe_1b_7b()
    names = native_to_hf("blocks.2.mlp.experts.w_gate_up", cfg)
    assert len(names) == 128 and names[:2] == ["model.layers.2.mlp.experts.0.gate_proj.weight",
                                               "model.layers.2.mlp.experts.0.up_proj.weight"]
    assert native_to_hf("embed.weight", cfg) == ["model.embed_tokens.weight"]
    assert native_to_hf("blocks.0.mlp.experts.w_down", ModelConfig.tiny_moe()) == ["blocks.0.mlp.experts.w_down"]


def test_iter_hf_tensors_single_and_sharded_agree(olmoe):
    single, sharded, _ = olmoe
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 2
    a = dict(iter_hf_tensors(single))
    b = dict(iter_hf_tensors(sharded))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # against safetensors' own reader of what transformers wrote
    from safetensors.torch import load_file

    want = load_file(os.path.join(single, "model.safetensors"))
    assert a.keys() == want.keys() and all(torch.equal(a[k], want[k]) for k in a)


# ---- logits equal transformers' -------------------------------------------------------------


def test_olmo3_logits_match_transformers(olmo3):
    path, hf_model = olmo3
    cfg, model = load_hf_model(path)
    assert _max_diff(hf_model, model) < 1e-4
    # the check has teeth: without YaRN or with one RoPE base the logits differ
    for change in ({"rope_scaling": None}, {"sliding_rope_theta": None}):
        other = cfg.replace(attention=cfg.attention.replace(**change)).build()
        other.load_state_dict(model.state_dict())
        assert _max_diff(hf_model, other) > 1e-3


@pytest.mark.parametrize("which", ["single", "sharded"])
def test_olmoe_logits_match_transformers(olmoe, which):
    single, sharded, hf_model = olmoe
    _, model = load_hf_model(single if which == "single" else sharded)
    assert _max_diff(hf_model, model.eval()) < 1e-4


def test_fused_expert_layout_is_read(olmoe, tmp_path):
    """transformers v5 in memory (and possibly future files) keeps experts fused: gate_up_proj [E, 2F, D]."""
    from safetensors.torch import save_file

    single, _, hf_model = olmoe
    fused = str(tmp_path / "fused")
    os.makedirs(fused)
    shutil.copy(os.path.join(single, "config.json"), fused)
    tensors = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in tensors)
    save_file(tensors, os.path.join(fused, "model.safetensors"))
    _, model = load_hf_model(fused)
    assert _max_diff(hf_model, model) < 1e-4


# ---- export ---------------------------------------------------------------------------------


def _import(hf_dir, out):
    cfg = read_hf_config(hf_dir)
    specs, produce = hf_native_specs(hf_dir, cfg)
    return save_weights(out, specs, produce, {"config": {"model": cfg.to_dict()}})


@pytest.mark.parametrize("which", ["olmo3", "olmoe"])
def test_export_reloads_in_transformers(which, olmo3, olmoe, tmp_path):
    src, hf_model = (olmo3[0], olmo3[1]) if which == "olmo3" else (olmoe[1], olmoe[2])
    native = _import(src, str(tmp_path / "native"))
    out = export_hf(native, str(tmp_path / "hf"), max_shard_size="30KB")
    files = os.listdir(out)
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    reloaded = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _ids()
    with torch.no_grad():
        assert (reloaded(ids).logits - hf_model(ids).logits).abs().max().item() < 1e-4
    # the HF tensors themselves are the originals
    before, after = dict(iter_hf_tensors(src)), dict(iter_hf_tensors(out))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _native_tiny_moe(path, cfg):
    torch.manual_seed(0)
    state = cfg.build().state_dict()
    specs = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    return save_weights(path, specs, lambda n: state[n], {"config": {"model": cfg.to_dict()}})


def _olmoe_like():
    cfg = ModelConfig.olmoe_1b_7b()
    cfg.d_model, cfg.n_layers, cfg.vocab_size = 64, 2, 128
    cfg.attention.n_heads = 4
    cfg.moe.num_experts, cfg.moe.expert_hidden, cfg.moe.router.top_k = 8, 16, 2
    return cfg


def _small_tiny_moe():
    cfg = ModelConfig.tiny_moe()
    cfg.d_model, cfg.vocab_size, cfg.mlp_hidden = 64, 128, 96
    cfg.moe.num_experts, cfg.moe.expert_hidden = 4, 16
    return cfg


def _olmo3_like():
    cfg = ModelConfig.tiny()
    cfg.d_model, cfg.vocab_size, cfg.mlp_hidden, cfg.sliding_window = 64, 128, 96, 8
    return cfg


@pytest.mark.parametrize("make", [_olmo3_like, _olmoe_like, _small_tiny_moe], ids=["olmo3", "olmoe", "moetron"])
def test_native_hf_native_is_bit_exact(make, tmp_path):
    from moetron.core.weights import read_weight_specs

    cfg = make()
    native = _native_tiny_moe(str(tmp_path / "a"), cfg)
    hf_dir = export_hf(native, str(tmp_path / "hf"), max_shard_size="20KB")
    arch = json.load(open(os.path.join(hf_dir, "config.json")))["architectures"][0]
    assert arch == export_architecture(cfg)[0]
    back = _import(hf_dir, str(tmp_path / "b"))
    explicit = cfg.replace(layer_types=cfg.resolved_layer_types())
    back_cfg = read_hf_config(hf_dir)
    if cfg.moe is not None and not cfg.moe.dense_layers:  # mlp_hidden is unused: OLMoE has no field for it
        back_cfg.mlp_hidden = cfg.mlp_hidden
    assert back_cfg.replace(layer_types=back_cfg.resolved_layer_types()).to_dict() == explicit.to_dict()
    specs_a, specs_b = read_weight_specs(native), read_weight_specs(back)
    assert specs_a == specs_b
    for (na, ta), (nb, tb) in zip(iter_weights(native), iter_weights(back)):
        assert na == nb and torch.equal(ta, tb), na
    # the rebuilt model computes the same function
    ids = _ids()
    _, m_hf = load_hf_model(hf_dir)
    m = cfg.build()
    m.load_state_dict(dict(iter_weights(native)))
    with torch.no_grad():
        assert torch.equal(m(ids), m_hf(ids))


def test_export_bf16(tmp_path):
    native = _native_tiny_moe(str(tmp_path / "a"), _olmo3_like())
    out = export_hf(native, str(tmp_path / "hf"), dtype=torch.bfloat16)
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for _, t in iter_hf_tensors(out))
    reloaded = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16


# ---- config.json edge cases -----------------------------------------------------------------


def _variant(src, tmp_path, name, edit):
    """A copy of the HF checkpoint ``src`` whose config.json went through ``edit(dict)``."""
    out = str(tmp_path / name)
    shutil.copytree(src, out)
    path = os.path.join(out, "config.json")
    hf = json.load(open(path))
    edit(hf)
    json.dump(hf, open(path, "w"))
    return out


def _matches_transformers(path):
    hf_model = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    cfg, model = load_hf_model(path)
    return cfg, hf_model, _max_diff(hf_model, model.eval())


def _legacy(theta, scaling=None, layer_types=None):
    def edit(hf):
        del hf["rope_parameters"]
        hf["rope_theta"] = theta
        if scaling is not None:
            hf["rope_scaling"] = scaling
        if layer_types is not None:
            hf["layer_types"] = layer_types
    return edit


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain", "yarn"])
def test_legacy_top_level_theta_is_refused_where_transformers_versions_disagree(olmo3, tmp_path, scaling):
    """Old-style config.json, rope_theta 10000: transformers 5 gives the sliding layers 500000 (4.x gave
    them 10000; moetron used to, a logit error of 1.30, 1.78 with YaRN): refused by name."""
    path = _variant(olmo3[0], tmp_path, "legacy", _legacy(10_000.0, scaling))
    assert tf.AutoConfig.from_pretrained(path).rope_parameters["sliding_attention"]["rope_theta"] == 500_000.0
    with pytest.raises(CheckpointError, match=r"config\.json: rope_theta=10000 is given only at the top level.*"
                                              r"2 sliding_attention layers.*state both thetas in rope_parameters"):
        read_hf_config(path)
    # without sliding layers nothing is ambiguous: it loads, and equals transformers
    full = _variant(olmo3[0], tmp_path, "legacy_full", _legacy(10_000.0, scaling, ["full_attention"] * 4))
    cfg, _, diff = _matches_transformers(full)
    assert cfg.attention.rope_theta == 10_000.0 and diff < 1e-4
    assert (cfg.attention.rope_scaling is None) == (scaling is None)


def test_top_level_theta_beside_rope_parameters_is_the_full_layers_theta(olmo3, tmp_path):
    """transformers 5 fills a full_attention entry without rope_theta from the top-level rope_theta
    (moetron used to take 500000 there: a logit error of 1.67)."""
    def edit(hf):
        del hf["rope_parameters"]["full_attention"]["rope_theta"]
        hf["rope_theta"] = 10_000.0
    cfg, hf_model, diff = _matches_transformers(_variant(olmo3[0], tmp_path, "mixed", edit))
    assert cfg.attention.rope_theta == 10_000.0 and cfg.attention.sliding_rope_theta == 5_000.0
    assert hf_model.config.rope_parameters["full_attention"]["rope_theta"] == 10_000.0
    assert cfg.attention.rope_scaling.layers == RopeScalingLayers.full and diff < 1e-4


def test_missing_yarn_original_context_defaults_to_max_position_embeddings(olmo3, tmp_path):
    def edit(hf):
        del hf["rope_parameters"]["full_attention"]["original_max_position_embeddings"]
    cfg, _, diff = _matches_transformers(_variant(olmo3[0], tmp_path, "no_orig", edit))
    assert cfg.attention.rope_scaling.original_max_position_embeddings == 64 and diff < 1e-4


def _nested_truncate(hf):
    hf["rope_parameters"]["full_attention"]["truncate"] = False


@pytest.mark.parametrize("edit,message", [
    (_nested_truncate, r"rope_parameters\.full_attention\.truncate is false, which transformers 5's Olmo3 ignores"),
    (_legacy(500_000.0, dict(YARN, truncate=False)), r"rope_parameters\.full_attention\.truncate is false"),
    (lambda hf: hf.update(rope_parameters=dict(YARN, rope_theta=10_000.0)),
     r"rope_parameters has \['factor', 'original_max_position_embeddings', 'rope_theta', 'rope_type'\] beside"),
], ids=["truncate", "legacy_truncate", "flat_rope_parameters"])
def test_configs_transformers_reads_against_their_words_are_refused(olmo3, tmp_path, edit, message):
    """YaRN truncate=false (transformers 5 truncates anyway; moetron used to honour it: a logit error of
    1.51) and a flat rope_parameters dict (transformers' Olmo3 ignores it: default RoPE at 500000)."""
    path = _variant(olmo3[0], tmp_path, "refused", edit)
    with pytest.raises(CheckpointError, match=message):
        read_hf_config(path)


def test_olmoe_top_level_theta_fills_rope_parameters(olmoe, tmp_path):
    def edit(hf):
        hf["rope_parameters"] = {"rope_type": "default"}
        hf["rope_theta"] = 2_500.0
    cfg, _, diff = _matches_transformers(_variant(olmoe[0], tmp_path, "olmoe_theta", edit))
    assert cfg.attention.rope_theta == 2_500.0 and diff < 1e-4


@pytest.mark.parametrize("which,field,value,message", [
    ("olmo3", "hidden_size", "64", r"hidden_size is \"64\", expected an integer"),
    ("olmo3", "hidden_size", None, r"hidden_size is null, expected an integer"),
    ("olmo3", "num_hidden_layers", 1.5, r"num_hidden_layers is 1\.5, expected an integer"),
    ("olmo3", "num_attention_heads", True, r"num_attention_heads is true, expected an integer"),
    ("olmo3", "rms_norm_eps", "1e-6", r"rms_norm_eps is \"1e-6\", expected a number"),
    ("olmo3", "tie_word_embeddings", "false", r"tie_word_embeddings is \"false\", expected true or false"),
    ("olmo3", "layer_types", "sliding_attention", r"layer_types is \"sliding_attention\", expected a list"),
    ("olmo3", "layer_types", [{"a": 1}] * 4, r"unknown layer_types"),
    ("olmo3", "sliding_window", [8], r"sliding_window is \[8\], expected an integer"),
    ("olmo3", "rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": "4"}},
     r"rope_parameters\.full_attention\.factor is \"4\", expected a number"),
    ("olmo3", "rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": None}},
     r"rope_parameters\.full_attention\.rope_theta is null, expected a number"),
    ("olmo3", "eos_token_id", [1, "2"], r"eos_token_id\[1\] is \"2\", expected an integer"),
    ("olmo3", "architectures", "Olmo3ForCausalLM", r"architectures is \"Olmo3ForCausalLM\", expected a list"),
    ("olmoe", "num_experts", "8", r"num_experts is \"8\", expected an integer"),
    ("olmoe", "rope_theta", "1e4", r"rope_theta is \"1e4\", expected a number"),
])
def test_wrong_field_type_is_one_checkpoint_error(olmo3, olmoe, tmp_path, which, field, value, message):
    """A field of the wrong JSON type: one CheckpointError naming the field and the file (it used to be a
    traceback, or, for "64" and 1.5, a silent int())."""
    path = _variant((olmo3 if which == "olmo3" else olmoe)[0], tmp_path, "typed", lambda hf: hf.update({field: value}))
    with pytest.raises(CheckpointError, match=re.escape(os.path.join(path, "config.json")) + ": " + message):
        read_hf_config(path)


# ---- export keeps the HF-only fields --------------------------------------------------------


def test_export_keeps_token_ids_and_context_length(tmp_path):
    """max_position_embeddings and the special token ids of an imported config.json survive
    HF -> native -> HF (they used to come back as 64 -> factor x original and null)."""
    src = str(tmp_path / "src")
    config = olmo3_hf_config(max_position_embeddings=96, eos_token_id=[7, 9], pad_token_id=3, bos_token_id=5)
    _save(tf.Olmo3ForCausalLM(config), src)
    native = _import(src, str(tmp_path / "native"))
    meta = native_config(native).hf_metadata
    assert (meta.max_position_embeddings, meta.eos_token_id, meta.pad_token_id, meta.bos_token_id) == (96, [7, 9], 3, 5)
    out = export_hf(native, str(tmp_path / "hf"))
    written = json.load(open(os.path.join(out, "config.json")))
    assert (written["max_position_embeddings"], written["eos_token_id"], written["pad_token_id"],
            written["bos_token_id"]) == (96, [7, 9], 3, 5)
    reloaded = tf.AutoConfig.from_pretrained(out)
    assert (reloaded.max_position_embeddings, reloaded.eos_token_id, reloaded.pad_token_id) == (96, [7, 9], 3)
    # a model that never came from HF: null ids (not transformers' defaults), YaRN's extended context
    cfg = _olmo3_like()
    cfg.attention.rope_scaling = read_hf_config(src).attention.rope_scaling
    written = json.load(open(os.path.join(export_hf(_native_tiny_moe(str(tmp_path / "n2"), cfg), str(tmp_path / "hf2")),
                                          "config.json")))
    assert written["eos_token_id"] is None and written["pad_token_id"] is None
    assert written["max_position_embeddings"] == 4 * 16


# ---- reading through safetensors' own reader ------------------------------------------------


def test_unreadable_shards_are_one_checkpoint_error(olmoe, tmp_path):
    """safe_open reads the headers; what it refuses (garbage, a truncated file) or a dtype moetron
    cannot hold is a CheckpointError naming the file, before any tensor is produced."""
    from safetensors.torch import save_file

    single = olmoe[0]
    bad = str(tmp_path / "bad")
    shutil.copytree(single, bad)
    path = os.path.join(bad, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])  # header intact, data cut
    with pytest.raises(CheckpointError, match=re.escape(path) + " is not a readable safetensors file"):
        hf_native_specs(bad)
    open(path, "wb").write(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match="is not a readable safetensors file"):
        iter_hf_tensors(bad).__next__()
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2, dtype=torch.float8_e4m3fn)}, path)
    with pytest.raises(CheckpointError, match="tensor model.embed_tokens.weight has unsupported dtype F8_E4M3"):
        hf_native_specs(bad)


def test_export_and_load_report_progress(tmp_path):
    """The conversion functions report (done_bytes, total_bytes) to one callback
    (tools/convert_hf.py points it at data.progress.Progress.update)."""
    native = _native_tiny_moe(str(tmp_path / "a"), _olmo3_like())
    calls = []
    hf_dir = export_hf(native, str(tmp_path / "hf"), progress=lambda done, total: calls.append((done, total)))
    total = calls[-1][1]
    assert calls[-1][0] == total == sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir)
                                        if f.endswith(".safetensors")) - _header_bytes(hf_dir)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    calls.clear()
    load_hf_model(hf_dir, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1][0] == calls[-1][1] == total


def _header_bytes(hf_dir):
    import struct

    return sum(8 + struct.unpack("<Q", open(os.path.join(hf_dir, f), "rb").read(8))[0]
               for f in os.listdir(hf_dir) if f.endswith(".safetensors"))


def test_expert_bias_survives_export_and_import(tmp_path):
    """A router with the expert bias (moe-1t's balancing) exports as MoetronForCausalLM, and the
    trained bias values (not the zeros a fresh build holds) come back bit for bit, into the
    imported checkpoint and into the model load_hf_model builds."""
    cfg = _small_tiny_moe()
    cfg.moe.router.expert_bias = True
    torch.manual_seed(0)
    state = cfg.build().state_dict()
    biases = [k for k in state if k.endswith("router.expert_bias")]
    assert biases
    for i, k in enumerate(biases):
        state[k] = torch.linspace(-0.05, 0.05, state[k].numel()) * (i + 1)
    specs = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    native = save_weights(str(tmp_path / "a"), specs, lambda n: state[n], {"config": {"model": cfg.to_dict()}})
    hf_dir = export_hf(native, str(tmp_path / "hf"))
    assert json.load(open(os.path.join(hf_dir, "config.json")))["architectures"] == [MOETRON]
    back = dict(iter_weights(_import(hf_dir, str(tmp_path / "b"))))
    _, model = load_hf_model(hf_dir)
    loaded = dict(model.named_buffers())
    for k in biases:
        assert torch.equal(back[k], state[k]) and torch.equal(loaded[k], state[k]), k
