"""config.json <-> ModelConfig: the architectures moetron reads and writes, and which one a
config exports under (see the package docstring)."""

from __future__ import annotations

import json
import os

import torch

from moetron.core.checkpoint import CheckpointError
from moetron.core.config import ConfigError
from moetron.core.layers.attention import AttentionConfig
from moetron.core.layers.rope import RopeScalingConfig, RopeScalingLayers
from moetron.core.moe.config import MoEConfig, RouterConfig, RouterScore

from ..config import BlockType, LayerType, ModelConfig

OLMO3 = "Olmo3ForCausalLM"
OLMOE = "OlmoeForCausalLM"
MOETRON = "MoetronForCausalLM"
SUPPORTED = (OLMO3, OLMOE)

CONFIG = "config.json"

_HF_LAYER_TYPES = {"full_attention": LayerType.full, "sliding_attention": LayerType.sliding}
_NATIVE_LAYER_TYPES = {v: k for k, v in _HF_LAYER_TYPES.items()}

JSON_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float64": torch.float64}
_DTYPE_JSON = {v: k for k, v in JSON_DTYPES.items()}


def load_json(path: str) -> dict:
    """The parsed JSON file at ``path``; CheckpointError if it is missing or not JSON."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist: expected a Hugging Face checkpoint directory")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def architecture_from_hf_dict(hf: dict, where: str) -> str:
    """The (single) architecture a parsed config.json names; CheckpointError (naming ``where``) if
    moetron does not read it."""
    archs = hf.get("architectures") or []
    arch = archs[0] if len(archs) == 1 else (archs or None)
    if arch not in (*SUPPORTED, MOETRON):
        raise CheckpointError(
            f"unsupported architecture {arch} in {where}: moetron converts Olmo3ForCausalLM and OlmoeForCausalLM "
            f"(and reads back its own {MOETRON} exports)"
        )
    return arch


def hf_architecture(hf_dir: str) -> str:
    """The (single) architecture named in HF_DIR/config.json; CheckpointError if unsupported."""
    path = os.path.join(hf_dir, CONFIG)
    return architecture_from_hf_dict(load_json(path), path)


def _rope_scaling(params: dict, layers: RopeScalingLayers, max_positions: int | None, where: str):
    """A moetron RopeScalingConfig from one HF rope parameter dict (None for plain RoPE)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise CheckpointError(
            f"{where}: rope_type {rope_type!r} is not supported: moetron implements default and yarn RoPE"
        )
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise CheckpointError(f"{where}: yarn RoPE needs original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:  # transformers derives it from the context lengths
        if not max_positions:
            raise CheckpointError(f"{where}: yarn RoPE without factor needs max_position_embeddings")
        factor = max_positions / original
    # transformers reads "or 32" / "or 1": a 0 or null means the default
    return RopeScalingConfig(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        layers=layers,
    )


def _theta(params: dict, default: float) -> float:
    return float(params.get("rope_theta", default))


def _olmo3_rope(hf: dict, where: str) -> tuple[float, float, RopeScalingConfig | None]:
    """(full-layer theta, sliding-layer theta, scaling) from Olmo 3's per-layer-type RoPE."""
    default_theta = 500_000.0
    max_pos = hf.get("max_position_embeddings", 2048)
    params = hf.get("rope_parameters")
    if params is None:  # older config.json: rope_theta + rope_scaling, scaling on full layers only
        flat = {"rope_type": "default", "rope_theta": hf.get("rope_theta", default_theta)}
        full = dict(flat, **(hf.get("rope_scaling") or {}))
        sliding = flat
    elif set(params) <= set(_HF_LAYER_TYPES):
        full = params.get("full_attention") or {"rope_type": "default"}
        sliding = params.get("sliding_attention") or {"rope_type": "default"}
    else:  # one dict for every layer type
        full = sliding = params
    full_theta, sliding_theta = _theta(full, default_theta), _theta(sliding, default_theta)
    full_scaling = _rope_scaling(full, RopeScalingLayers.full, max_pos, where)
    sliding_scaling = _rope_scaling(sliding, RopeScalingLayers.sliding, max_pos, where)
    scaling = full_scaling or sliding_scaling
    if full_scaling is not None and sliding_scaling is not None:
        if dict(full_scaling.to_dict(), layers=None) != dict(sliding_scaling.to_dict(), layers=None):
            raise CheckpointError(
                f"{where}: different yarn parameters on full and sliding layers are not supported"
            )
        scaling = full_scaling.replace(layers=RopeScalingLayers.all)
    return full_theta, sliding_theta, scaling


def _check_common(hf: dict, where: str) -> None:
    if hf.get("tie_word_embeddings", False):
        raise CheckpointError(
            f"{where}: tie_word_embeddings is true but moetron's models have untied input and output embeddings"
        )
    if hf.get("attention_bias", False):
        raise CheckpointError(f"{where}: attention_bias is true but moetron's attention has no biases")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act {act!r} is not supported: moetron's MLPs are SwiGLU (silu)")


def config_from_hf_dict(hf: dict, where: str = CONFIG) -> ModelConfig:
    """ModelConfig from a parsed HF config.json (``where`` names it in errors)."""
    arch = architecture_from_hf_dict(hf, where)
    if arch == MOETRON:
        if "moetron_config" not in hf:
            raise CheckpointError(f"{where}: {MOETRON} config without a moetron_config entry")
        try:
            cfg = ModelConfig.from_dict(hf["moetron_config"])
            cfg.validate()
        except ConfigError as e:
            raise CheckpointError(f"{where}: invalid moetron_config: {e}") from None
        return cfg
    _check_common(hf, where)
    try:
        d_model, n_layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
        n_heads = int(hf["num_attention_heads"])
        vocab, hidden = int(hf["vocab_size"]), int(hf["intermediate_size"])
    except KeyError as e:
        raise CheckpointError(f"{where}: missing {e.args[0]!r}") from None
    n_kv = hf.get("num_key_value_heads") or n_heads
    n_kv = None if n_kv == n_heads else int(n_kv)  # moetron's spelling of multi-head attention
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * n_heads == d_model:
        head_dim = None  # moetron's default, so configs round-trip unchanged
    if arch == OLMO3:
        full_theta, sliding_theta, scaling = _olmo3_rope(hf, where)
        types = hf.get("layer_types")
        if types is None:  # transformers' default: every 4th layer full (no forced last full layer)
            types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layers)]
        bad = [t for t in types if t not in _HF_LAYER_TYPES]
        if bad:
            raise CheckpointError(f"{where}: unknown layer_types {sorted(set(bad))}: expected full_attention or "
                                  f"sliding_attention")
        layer_types = [_HF_LAYER_TYPES[t] for t in types]
        sliding_window = hf.get("sliding_window", 4096)
        if LayerType.sliding in layer_types and not sliding_window:
            raise CheckpointError(f"{where}: sliding_attention layers but no sliding_window")
        cfg = ModelConfig(
            d_model=d_model,
            n_layers=n_layers,
            vocab_size=vocab,
            attention=AttentionConfig(
                n_heads=n_heads,
                n_kv_heads=n_kv,
                head_dim=head_dim,
                qk_norm=True,
                rope_theta=full_theta,
                sliding_rope_theta=sliding_theta if sliding_theta != full_theta else None,
                rope_scaling=scaling,
            ),
            mlp_hidden=hidden,
            block_type=BlockType.reordered_norm,
            sliding_window=sliding_window,
            layer_types=layer_types,
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        )
    else:  # OLMoE
        if hf.get("clip_qkv") is not None:
            raise CheckpointError(f"{where}: clip_qkv={hf['clip_qkv']} is not supported (moetron does not clip q/k/v)")
        params = hf.get("rope_parameters") or dict(
            {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10_000.0)}, **(hf.get("rope_scaling") or {})
        )
        scaling = _rope_scaling(params, RopeScalingLayers.all, hf.get("max_position_embeddings", 4096), where)
        try:
            num_experts, top_k = int(hf["num_experts"]), int(hf["num_experts_per_tok"])
        except KeyError as e:
            raise CheckpointError(f"{where}: missing {e.args[0]!r}") from None
        cfg = ModelConfig(
            d_model=d_model,
            n_layers=n_layers,
            vocab_size=vocab,
            # OLMoE sizes heads as hidden_size // num_attention_heads whatever head_dim says
            attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv, qk_norm=True,
                                      rope_theta=_theta(params, 10_000.0), rope_scaling=scaling),
            mlp_hidden=hidden,
            block_type=BlockType.pre_norm,
            sliding_window=None,
            layer_types=[LayerType.full] * n_layers,
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            moe=MoEConfig(
                num_experts=num_experts,
                expert_hidden=hidden,
                router=RouterConfig(
                    score=RouterScore.softmax,
                    top_k=top_k,
                    renormalize=bool(hf.get("norm_topk_prob", False)),
                    lb_loss_weight=float(hf.get("router_aux_loss_coef", 0.01)),
                ),
            ),
        )
    try:
        cfg.validate()
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return cfg


def read_hf_config(hf_dir: str) -> ModelConfig:
    """The ModelConfig of the HF checkpoint in ``hf_dir``, from its config.json alone.

    Follows config.json field by field (layer_types, per-layer-type RoPE, sliding_window,
    rms_norm_eps, ...); a missing field takes the transformers class default, never a preset's.
    Raises CheckpointError for an unsupported architecture or feature.
    """
    path = os.path.join(hf_dir, CONFIG)
    return config_from_hf_dict(load_json(path), path)


def export_architecture(cfg: ModelConfig) -> tuple[str, str]:
    """(architecture, why) under which ``cfg`` exports: Olmo3ForCausalLM, OlmoeForCausalLM or
    MoetronForCausalLM when neither transformers class computes the same function."""
    att = cfg.attention
    reasons = []
    if not att.qk_norm:
        reasons.append("no QK-norm")
    scaling = att.rope_scaling
    if scaling is not None and not scaling.truncate:
        reasons.append("yarn with truncate=false")
    if cfg.moe is None:
        if cfg.block_type != BlockType.reordered_norm:
            reasons.append(f"block_type {cfg.block_type}")
        if not reasons:
            return OLMO3, "dense Olmo 3"
        return MOETRON, "dense but not Olmo 3 (" + ", ".join(reasons) + ")"
    moe, router = cfg.moe, cfg.moe.router
    if cfg.block_type != BlockType.pre_norm:
        reasons.append(f"block_type {cfg.block_type} (OLMoE is pre_norm)")
    if moe.num_shared_experts:
        reasons.append("shared experts")
    if moe.dense_layers:
        reasons.append("dense layers")
    if router.score != RouterScore.softmax:
        reasons.append(f"{router.score} router")
    if router.scale != 1.0 or router.n_groups is not None or router.expert_bias:
        reasons.append("router scale, groups or expert bias")
    if LayerType.sliding in cfg.resolved_layer_types():
        reasons.append("sliding-window layers")
    if att.head_dim is not None and att.head_dim * att.n_heads != cfg.d_model:
        reasons.append("head_dim * n_heads != d_model")
    if att.sliding_rope_theta is not None and LayerType.sliding in cfg.resolved_layer_types():
        reasons.append("per-layer-type RoPE")
    if scaling is not None and scaling.layers != RopeScalingLayers.all:
        reasons.append("RoPE scaling on some layers only")
    if not reasons:
        return OLMOE, "OLMoE-compatible MoE"
    return MOETRON, "MoE outside OLMoE's architecture (" + ", ".join(reasons) + ")"


def _rope_dict(theta: float, scaling: RopeScalingConfig | None) -> dict:
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    out = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
    }
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if getattr(scaling, key) is not None:
            out[key] = getattr(scaling, key)
    return out


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """config.json contents for ``cfg`` under its export architecture (see export_architecture)."""
    arch, _ = export_architecture(cfg)
    base = {"architectures": [arch], "dtype": _DTYPE_JSON.get(dtype, str(dtype).replace("torch.", ""))}
    if arch == MOETRON:
        return dict(base, model_type="moetron", moetron_config=cfg.to_dict())
    att = cfg.attention
    scaling = att.rope_scaling
    max_pos = int(scaling.factor * scaling.original_max_position_embeddings) if scaling else 4096
    common = dict(
        base,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=att.n_heads,
        num_key_value_heads=att.kv_heads(),
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.norm_eps,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        max_position_embeddings=max_pos,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    if arch == OLMO3:
        types = cfg.resolved_layer_types()

        def rope_for(sliding: bool) -> dict:
            theta = att.sliding_rope_theta if sliding and att.sliding_rope_theta is not None else att.rope_theta
            return _rope_dict(theta, scaling if scaling is not None and scaling.applies_to(sliding) else None)

        return dict(
            common,
            model_type="olmo3",
            head_dim=att.head_width(cfg.d_model),
            intermediate_size=cfg.mlp_hidden,
            sliding_window=cfg.sliding_window,
            layer_types=[_NATIVE_LAYER_TYPES[t] for t in types],
            rope_parameters={"full_attention": rope_for(False), "sliding_attention": rope_for(True)},
        )
    moe = cfg.moe
    return dict(
        common,
        model_type="olmoe",
        intermediate_size=moe.expert_hidden,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.router.top_k,
        norm_topk_prob=moe.router.renormalize,
        router_aux_loss_coef=moe.router.lb_loss_weight,
        clip_qkv=None,
        rope_parameters=_rope_dict(att.rope_theta, scaling),
    )
