"""config.json <-> ModelConfig: the architectures moetron reads and writes, and which one a
config exports under (see the package docstring)."""

from __future__ import annotations

import json
import math
import os

import torch

from moetron.core.checkpoint import CheckpointError
from moetron.core.config import ConfigError
from moetron.core.layers.attention import AttentionConfig
from moetron.core.layers.rope import RopeScalingConfig, RopeScalingLayers
from moetron.core.moe.config import MoEConfig, RouterConfig, RouterScore

from ..config import BlockType, HFMetadata, LayerType, ModelConfig

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
    if not isinstance(hf, dict):
        raise CheckpointError(f"{where} holds a JSON {type(hf).__name__}, expected an object of config fields")
    archs = _field(hf, "architectures", list, where, default=[], nullable=True) or []
    arch = archs[0] if len(archs) == 1 else (archs or None)
    if arch not in (*SUPPORTED, MOETRON):
        raise CheckpointError(
            f"unsupported architecture {arch} in {where}: moetron converts Olmo3ForCausalLM and OlmoeForCausalLM "
            f"(and reads back its own {MOETRON} exports)"
        )
    return arch


# ---- typed fields -----------------------------------------------------------------------------
_REQUIRED = object()
_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object",
               list: "a list"}


def _field(d: dict, key: str, kind: type, where: str, default=_REQUIRED, nullable: bool = False, path: str = ""):
    """``d[key]`` checked to be a JSON ``kind`` (an integral float passes as an int, an int as a
    number); ``default`` when absent (CheckpointError if required); null is None only where
    ``nullable``. Errors name the field (``path`` + key) and ``where`` (the file)."""
    name = f"{path}{key}"
    if key not in d:
        if default is _REQUIRED:
            raise CheckpointError(f"{where}: missing {name!r}")
        return default
    value = d[key]
    if value is None:
        if nullable:
            return None
        raise CheckpointError(f"{where}: {name} is null, expected {_KIND_NAMES[kind]}")
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is int and isinstance(value, float) and value.is_integer():
        value, ok = int(value), True
    elif kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        value, ok = float(value), math.isfinite(value)
    if not ok:
        raise CheckpointError(f"{where}: {name} is {json.dumps(value)}, expected {_KIND_NAMES[kind]}")
    return value


def _token_ids(hf: dict, key: str, where: str, many: bool = True) -> int | list[int] | None:
    """A special-token id field: an integer, (``many``) a list of integers, or null."""
    value = hf.get(key)
    if isinstance(value, list) and many:
        for i, v in enumerate(value):
            _field({f"[{i}]": v}, f"[{i}]", int, where, path=key)
        return [int(v) for v in value]
    return _field(hf, key, int, where, default=None, nullable=True)


def _hf_metadata(hf: dict, where: str) -> HFMetadata | None:
    meta = HFMetadata(
        max_position_embeddings=_field(hf, "max_position_embeddings", int, where, default=None, nullable=True),
        bos_token_id=_token_ids(hf, "bos_token_id", where),
        eos_token_id=_token_ids(hf, "eos_token_id", where),
        pad_token_id=_token_ids(hf, "pad_token_id", where, many=False),
    )
    return None if meta.is_empty() else meta


def hf_architecture(hf_dir: str) -> str:
    """The (single) architecture named in HF_DIR/config.json; CheckpointError if unsupported."""
    path = os.path.join(hf_dir, CONFIG)
    return architecture_from_hf_dict(load_json(path), path)


def _rope_scaling(params: dict, layers: RopeScalingLayers, max_positions: int, where: str, path: str):
    """A moetron RopeScalingConfig from one HF rope parameter dict (None for plain RoPE); ``path``
    names the dict in errors (e.g. "rope_parameters.full_attention.")."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise CheckpointError(
            f"{where}: {path}rope_type {rope_type!r} is not supported: moetron implements default and yarn RoPE"
        )

    def num(key: str, kind: type = float):
        return _field(params, key, kind, where, default=None, nullable=True, path=path)

    # transformers' defaults: original_max_position_embeddings = max_position_embeddings, factor from the two
    original = num("original_max_position_embeddings", int) or max_positions
    factor = num("factor")
    if factor is None:
        factor = max_positions / original
    # transformers reads "or 32" / "or 1": a 0 or null means the default
    return RopeScalingConfig(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=num("beta_fast") or 32.0,
        beta_slow=num("beta_slow") or 1.0,
        attention_factor=num("attention_factor"),
        mscale=num("mscale"),
        mscale_all_dim=num("mscale_all_dim"),
        truncate=_field(params, "truncate", bool, where, default=True, path=path),
        layers=layers,
    )


def _olmo3_rope(hf: dict, n_sliding: int, where: str) -> tuple[float, float, RopeScalingConfig | None]:
    """(full-layer theta, sliding-layer theta, scaling) from Olmo 3's per-layer-type RoPE, resolved as
    transformers 5's Olmo3Config does: ``rope_parameters`` = {"full_attention": {...},
    "sliding_attention": {...}} (a missing or null entry is default RoPE); the legacy top-level
    ``rope_scaling`` updates the full-attention entry; the legacy top-level ``rope_theta`` is the
    full-attention theta where its entry has none; every other theta is 500000.

    Refused by name, as transformers versions read them differently: a top-level ``rope_theta``
    other than 500000 while ``n_sliding`` > 0 sliding layers have no theta of their own
    (transformers 4 gave them that theta, 5 gives them 500000), and YaRN ``truncate: false``
    (transformers 5 ignores it here, 4 honoured it in ``rope_scaling``)."""
    default_theta = 500_000.0
    max_pos = _field(hf, "max_position_embeddings", int, where, default=2048)
    params = _field(hf, "rope_parameters", dict, where, default=None, nullable=True) or {}
    extra = sorted(set(params) - set(_HF_LAYER_TYPES))
    if extra:
        raise CheckpointError(
            f"{where}: rope_parameters has {extra} beside the layer types: transformers' Olmo3 reads RoPE per "
            f"layer type only and would ignore them; write rope_parameters as "
            f'{{"full_attention": {{"rope_type": ..., "rope_theta": ...}}, "sliding_attention": {{...}}}}'
        )
    entries = {}
    for layer_type in _HF_LAYER_TYPES:
        entry = _field(params, layer_type, dict, where, default=None, nullable=True, path="rope_parameters.")
        entries[layer_type] = dict(entry or {"rope_type": "default"})
    full, sliding = entries["full_attention"], entries["sliding_attention"]
    full.update(_field(hf, "rope_scaling", dict, where, default=None, nullable=True) or {})
    top_theta = _field(hf, "rope_theta", float, where, default=None)
    if top_theta is not None and top_theta != default_theta and "rope_theta" not in sliding and n_sliding:
        raise CheckpointError(
            f"{where}: rope_theta={top_theta:g} is given only at the top level, which transformers versions "
            f"read differently for the {n_sliding} sliding_attention layers (4.x: {top_theta:g}, 5.x: "
            f"{default_theta:g}): state both thetas in rope_parameters, e.g. "
            f'{{"full_attention": {{"rope_type": "default", "rope_theta": {top_theta:g}}}, '
            f'"sliding_attention": {{"rope_type": "default", "rope_theta": {top_theta:g}}}}}'
        )
    full.setdefault("rope_theta", default_theta if top_theta is None else top_theta)
    sliding.setdefault("rope_theta", default_theta)
    full_path, sliding_path = "rope_parameters.full_attention.", "rope_parameters.sliding_attention."
    full_theta = _field(full, "rope_theta", float, where, path=full_path)
    sliding_theta = _field(sliding, "rope_theta", float, where, path=sliding_path)
    full_scaling = _rope_scaling(full, RopeScalingLayers.full, max_pos, where, full_path)
    sliding_scaling = _rope_scaling(sliding, RopeScalingLayers.sliding, max_pos, where, sliding_path)
    for scaling, path in ((full_scaling, full_path), (sliding_scaling, sliding_path)):
        if scaling is not None and not scaling.truncate:
            raise CheckpointError(
                f"{where}: {path}truncate is false, which transformers 5's Olmo3 ignores (it always truncates "
                f"the YaRN correction range) and 4.x honoured: remove it if the model was trained truncating "
                f"(the YaRN default), else the checkpoint is not an Olmo3ForCausalLM"
            )
    scaling = full_scaling or sliding_scaling
    if full_scaling is not None and sliding_scaling is not None:
        if dict(full_scaling.to_dict(), layers=None) != dict(sliding_scaling.to_dict(), layers=None):
            raise CheckpointError(
                f"{where}: different yarn parameters on full and sliding layers are not supported"
            )
        scaling = full_scaling.replace(layers=RopeScalingLayers.all)
    return full_theta, sliding_theta, scaling


def _check_common(hf: dict, where: str) -> None:
    if _field(hf, "tie_word_embeddings", bool, where, default=False):
        raise CheckpointError(
            f"{where}: tie_word_embeddings is true but moetron's models have untied input and output embeddings"
        )
    if _field(hf, "attention_bias", bool, where, default=False):
        raise CheckpointError(f"{where}: attention_bias is true but moetron's attention has no biases")
    act = _field(hf, "hidden_act", str, where, default="silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act {act!r} is not supported: moetron's MLPs are SwiGLU (silu)")


def config_from_hf_dict(hf: dict, where: str = CONFIG) -> ModelConfig:
    """ModelConfig from a parsed HF config.json (``where`` names it in errors): every field read as
    transformers reads it, a field of the wrong JSON type is a CheckpointError naming it."""
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
    d_model, n_layers = _field(hf, "hidden_size", int, where), _field(hf, "num_hidden_layers", int, where)
    n_heads = _field(hf, "num_attention_heads", int, where)
    vocab, hidden = _field(hf, "vocab_size", int, where), _field(hf, "intermediate_size", int, where)
    n_kv = _field(hf, "num_key_value_heads", int, where, default=None, nullable=True) or n_heads
    n_kv = None if n_kv == n_heads else n_kv  # moetron's spelling of multi-head attention
    head_dim = _field(hf, "head_dim", int, where, default=None, nullable=True)
    if head_dim is not None and head_dim * n_heads == d_model:
        head_dim = None  # moetron's default, so configs round-trip unchanged
    norm_eps = _field(hf, "rms_norm_eps", float, where, default=1e-5)
    hf_metadata = _hf_metadata(hf, where)
    if arch == OLMO3:
        types = _field(hf, "layer_types", list, where, default=None, nullable=True)
        if types is None:  # transformers' default: every 4th layer full (no forced last full layer)
            types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layers)]
        bad = [t for t in types if not isinstance(t, str) or t not in _HF_LAYER_TYPES]
        if bad:
            raise CheckpointError(f"{where}: unknown layer_types {sorted(set(map(json.dumps, bad)))}: expected "
                                  f"full_attention or sliding_attention")
        layer_types = [_HF_LAYER_TYPES[t] for t in types]
        full_theta, sliding_theta, scaling = _olmo3_rope(hf, layer_types.count(LayerType.sliding), where)
        sliding_window = _field(hf, "sliding_window", int, where, default=4096, nullable=True)
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
            norm_eps=norm_eps,
            hf_metadata=hf_metadata,
        )
    else:  # OLMoE
        if _field(hf, "clip_qkv", float, where, default=None, nullable=True) is not None:
            raise CheckpointError(f"{where}: clip_qkv={hf['clip_qkv']} is not supported (moetron does not clip q/k/v)")
        # transformers' generic reading: the legacy rope_scaling replaces rope_parameters; the top-level
        # rope_theta (else 10000) fills a missing theta
        legacy = _field(hf, "rope_scaling", dict, where, default=None, nullable=True)
        current = _field(hf, "rope_parameters", dict, where, default=None, nullable=True)
        params = dict(legacy or current or {})
        params.setdefault("rope_theta", _field(hf, "rope_theta", float, where, default=10_000.0))
        path = "rope_scaling." if legacy else "rope_parameters."
        max_pos = _field(hf, "max_position_embeddings", int, where, default=4096)
        scaling = _rope_scaling(params, RopeScalingLayers.all, max_pos, where, path)
        theta = _field(params, "rope_theta", float, where, path=path)
        num_experts = _field(hf, "num_experts", int, where)
        top_k = _field(hf, "num_experts_per_tok", int, where)
        cfg = ModelConfig(
            d_model=d_model,
            n_layers=n_layers,
            vocab_size=vocab,
            # OLMoE sizes heads as hidden_size // num_attention_heads whatever head_dim says
            attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv, qk_norm=True,
                                      rope_theta=theta, rope_scaling=scaling),
            mlp_hidden=hidden,
            block_type=BlockType.pre_norm,
            sliding_window=None,
            layer_types=[LayerType.full] * n_layers,
            norm_eps=norm_eps,
            moe=MoEConfig(
                num_experts=num_experts,
                expert_hidden=hidden,
                router=RouterConfig(
                    score=RouterScore.softmax,
                    top_k=top_k,
                    renormalize=_field(hf, "norm_topk_prob", bool, where, default=False),
                    lb_loss_weight=_field(hf, "router_aux_loss_coef", float, where, default=0.01),
                ),
            ),
            hf_metadata=hf_metadata,
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
    meta = cfg.hf_metadata or HFMetadata()
    # What an import kept; unknown: YaRN's extended context, else left out (transformers' class default),
    # and null token ids (transformers' defaults, pad 1 / eos 50279, are another tokenizer's).
    max_pos = meta.max_position_embeddings
    if max_pos is None and scaling is not None:
        max_pos = int(scaling.factor * scaling.original_max_position_embeddings)
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
        **({} if max_pos is None else {"max_position_embeddings": max_pos}),
        pad_token_id=meta.pad_token_id,
        bos_token_id=meta.bos_token_id,
        eos_token_id=meta.eos_token_id,
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
