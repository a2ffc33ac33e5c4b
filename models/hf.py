"""Hugging Face checkpoint interop: the one place for HF config mapping and weight-name maps.

Import (HF -> native) reads config.json and the safetensors files (single ``model.safetensors``
or shards + ``model.safetensors.index.json``) one tensor at a time; export (native -> HF) writes
config.json and safetensors shards one tensor at a time. Peak memory is a few tensors (one
stacked expert tensor for MoE layers), never the whole checkpoint.

Architectures:
    Olmo3ForCausalLM    dense Olmo 3: reordered norms (h = x + norm(f(x))), QK-norm, per-layer-type
                        RoPE (YaRN on full-attention layers in the long-context releases)
    OlmoeForCausalLM    OLMoE: pre-norm, QK-norm, softmax top-k router, no shared experts;
                        HF stores each expert's gate/up/down separately (or, newer, fused
                        ``experts.gate_up_proj`` [E, 2F, D] / ``experts.down_proj`` [E, D, F]);
                        moetron stacks them into ``experts.w_gate_up`` [E, 2F, D] and ``w_down``
                        [E, D, F]
    MoetronForCausalLM  every other moetron model (e.g. the Olmo 3 MoE family: shared expert,
                        dense first layer): config.json holds the whole moetron config under
                        "moetron_config", tensors keep their native names (docs/checkpoints.md)

Legend: E experts, F expert hidden, D model dim.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Callable, Iterator

import torch

from moetron.core.checkpoint import CheckpointError, _fsync_path, staged_dir
from moetron.core.config import ConfigError
from moetron.core.layers.attention import AttentionConfig
from moetron.core.layers.rope import RopeScalingConfig, RopeScalingLayers
from moetron.core.moe.config import MoEConfig, RouterConfig, RouterScore

from .config import BlockType, LayerType, ModelConfig, native_config

__all__ = [
    "OLMO3",
    "OLMOE",
    "MOETRON",
    "read_hf_config",
    "hf_config_dict",
    "export_architecture",
    "hf_to_native",
    "native_to_hf",
    "iter_hf_tensors",
    "hf_native_specs",
    "load_hf_model",
    "export_hf",
    "native_config",
]

OLMO3 = "Olmo3ForCausalLM"
OLMOE = "OlmoeForCausalLM"
MOETRON = "MoetronForCausalLM"
SUPPORTED = (OLMO3, OLMOE)

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_HF_LAYER_TYPES = {"full_attention": LayerType.full, "sliding_attention": LayerType.sliding}
_NATIVE_LAYER_TYPES = {v: k for k, v in _HF_LAYER_TYPES.items()}

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_JSON_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}
_DTYPE_JSON = {v: k for k, v in _JSON_DTYPES.items()}


# ==== config.json <-> ModelConfig ===============================================================


def _load_json(path: str) -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist: expected a Hugging Face checkpoint directory")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _architecture(hf: dict, where: str) -> str:
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
    return _architecture(_load_json(path), path)


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
    arch = _architecture(hf, where)
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
    return config_from_hf_dict(_load_json(path), path)


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


# ==== weight names ==============================================================================

_ATTN = r"model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight"
_LAYER_NORMS = {
    OLMO3: {"post_attention_layernorm": "attention_norm", "post_feedforward_layernorm": "mlp_norm"},
    OLMOE: {"input_layernorm": "attention_norm", "post_attention_layernorm": "mlp_norm"},
}
_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight"}
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def hf_to_native(hf_name: str, arch: str = OLMO3) -> str:
    """The native tensor that HF tensor ``hf_name`` (of architecture ``arch``) goes into.

    Per-expert OLMoE tensors (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` ...) and the
    fused ``experts.gate_up_proj`` / ``experts.down_proj`` all land in the layer's stacked
    ``blocks.{i}.mlp.experts.w_gate_up`` [E, 2F, D] (gate rows, then up rows) or ``w_down`` [E, D, F].
    Raises CheckpointError for a name the architecture does not have.
    """
    if arch == MOETRON:
        return hf_name
    if hf_name in _TOP:
        return _TOP[hf_name]
    m = re.fullmatch(_ATTN, hf_name)
    if m:
        return f"blocks.{m[1]}.attention.{m[2]}.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(\w+)\.weight", hf_name)
    if m and m[2] in _LAYER_NORMS.get(arch, {}):
        return f"blocks.{m[1]}.{_LAYER_NORMS[arch][m[2]]}.weight"
    if arch == OLMO3:
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", hf_name)
        if m:
            return f"blocks.{m[1]}.mlp.{m[2]}.weight"
    elif arch == OLMOE:
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate\.weight", hf_name)
        if m:
            return f"blocks.{m[1]}.mlp.router.weight"
        m = _EXPERT_RE.fullmatch(hf_name)
        if m:
            return f"blocks.{m[1]}.mlp.experts." + ("w_down" if m[3] == "down_proj" else "w_gate_up")
        m = _FUSED_RE.fullmatch(hf_name)
        if m:
            return f"blocks.{m[1]}.mlp.experts." + ("w_down" if m[2] == "down_proj" else "w_gate_up")
    raise CheckpointError(f"tensor {hf_name} is not part of a {arch} checkpoint")


def native_to_hf(native_name: str, cfg: ModelConfig, arch: str | None = None) -> list[str]:
    """The HF tensors (in the layout transformers' save_pretrained writes) that make native tensor
    ``native_name``, in stacking order: for ``w_gate_up`` [gate_0, up_0, gate_1, up_1, ...], for
    ``w_down`` [down_0, down_1, ...]; a single name otherwise. ``arch`` defaults to cfg's export
    architecture."""
    arch = arch or export_architecture(cfg)[0]
    if arch == MOETRON:
        return [native_name]
    for hf, native in _TOP.items():
        if native == native_name:
            return [hf]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", native_name)
    if m:
        i, rest = m[1], m[2]
        m2 = re.fullmatch(r"attention\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight", rest)
        if m2:
            return [f"model.layers.{i}.self_attn.{m2[1]}.weight"]
        for hf_norm, native_norm in _LAYER_NORMS[arch].items():
            if rest == f"{native_norm}.weight":
                return [f"model.layers.{i}.{hf_norm}.weight"]
        if arch == OLMO3:
            m2 = re.fullmatch(r"mlp\.(gate_proj|up_proj|down_proj)\.weight", rest)
            if m2:
                return [f"model.layers.{i}.mlp.{m2[1]}.weight"]
        else:
            if rest == "mlp.router.weight":
                return [f"model.layers.{i}.mlp.gate.weight"]
            experts = range(cfg.moe.num_experts) if cfg.moe else range(0)
            if rest == "mlp.experts.w_gate_up":
                return [f"model.layers.{i}.mlp.experts.{e}.{p}.weight"
                        for e in experts for p in ("gate_proj", "up_proj")]
            if rest == "mlp.experts.w_down":
                return [f"model.layers.{i}.mlp.experts.{e}.down_proj.weight" for e in experts]
    raise CheckpointError(f"native tensor {native_name} has no {arch} counterpart")


# ==== reading safetensors ======================================================================


def _read_header(path: str) -> dict:
    """The safetensors header {name: {dtype, shape, data_offsets}} without mapping the file."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return header


class _HFFiles:
    """Where each tensor of an HF checkpoint lives, with its shape and dtype (from the headers)."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index, single = os.path.join(hf_dir, INDEX), os.path.join(hf_dir, SINGLE)
        if os.path.exists(index):
            weight_map = _load_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map")
            files = sorted(set(weight_map.values()))
            for name in files:
                if not os.path.exists(os.path.join(hf_dir, name)):
                    raise CheckpointError(f"shard {name} named in {index} is missing from {hf_dir}")
        elif os.path.exists(single):
            files, weight_map = [SINGLE], None
        else:
            raise CheckpointError(f"{hf_dir} has neither {SINGLE} nor {INDEX} (moetron reads safetensors only)")
        self.files = files
        self.location: dict[str, str] = {}
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name in files:
            path = os.path.join(hf_dir, name)
            for key, info in _read_header(path).items():
                if info["dtype"] not in _ST_DTYPES:
                    raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {info['dtype']}")
                self.location[key] = name
                self.meta[key] = (tuple(info["shape"]), _ST_DTYPES[info["dtype"]])
        if weight_map is not None:
            for key, name in weight_map.items():
                if self.location.get(key) != name:
                    raise CheckpointError(f"{index} places {key} in {name}, but that shard does not hold it")

    def read(self, names: list[str]) -> list[torch.Tensor]:
        """Load the named tensors, opening each needed file once and closing it right after."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.location[n], []).append(n)
        out: dict[str, torch.Tensor] = {}
        for fname, keys in by_file.items():
            with safe_open(os.path.join(self.dir, fname), framework="pt") as f:
                for k in keys:
                    out[k] = f.get_tensor(k)
        return [out[n] for n in names]


def iter_hf_tensors(hf_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) from ``model.safetensors`` or the shards named by
    ``model.safetensors.index.json``, one tensor at a time (a missing shard is a CheckpointError)."""
    files = _HFFiles(hf_dir)
    from safetensors import safe_open

    for fname in files.files:
        keys = sorted(k for k, f in files.location.items() if f == fname)
        for k in keys:
            with safe_open(os.path.join(hf_dir, fname), framework="pt") as f:
                tensor = f.get_tensor(k)
            yield k, tensor


# ==== HF -> native ==============================================================================

# Buffers some exporters save that carry no weights.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _expected_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    model = cfg.build(device="meta")
    return {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}


def hf_native_specs(
    hf_dir: str, cfg: ModelConfig | None = None, dtype: torch.dtype | None = None
) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Callable[[str], torch.Tensor]]:
    """(specs, produce) for core.weights.save_weights: convert ``hf_dir`` to native tensors lazily.

    ``cfg`` defaults to read_hf_config(hf_dir). ``specs`` maps each native name to (shape, dtype)
    (``dtype`` if given, else the HF tensors' dtype); ``produce(name)`` reads only that tensor's HF
    sources (a layer's experts for a stacked expert tensor). Every shape and dtype is checked
    against the config (and config.json's declared dtype) from the safetensors headers before
    anything is produced: a mismatch, a missing or an unexpected tensor raises CheckpointError
    naming the tensor.
    """
    config_path = os.path.join(hf_dir, CONFIG)
    hf = _load_json(config_path)
    arch = _architecture(hf, config_path)
    cfg = cfg if cfg is not None else config_from_hf_dict(hf, config_path)
    dtype_name = hf.get("dtype") or hf.get("torch_dtype")
    declared = _JSON_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    files = _HFFiles(hf_dir)
    expected = _expected_specs(cfg)
    fused = {}  # native name -> fused HF name when the checkpoint stores experts fused
    for hf_name in files.meta:
        if _IGNORED.match(hf_name):
            continue
        native = hf_to_native(hf_name, arch)
        if native not in expected:
            raise CheckpointError(f"{hf_dir}: tensor {hf_name} does not fit the model in config.json "
                                  f"(no {native} in a {cfg.n_layers}-layer {cfg.describe()} model)")
        if _FUSED_RE.fullmatch(hf_name):
            fused[native] = hf_name

    sources: dict[str, list[str]] = {}
    for native, (shape, _) in expected.items():
        names = [fused[native]] if native in fused else native_to_hf(native, cfg, arch)
        missing = [n for n in names if n not in files.meta]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{hf_dir}: tensor {missing[0]}{more} is missing (needed for {native})")
        per_source = _source_shape(native, shape, len(names) > 1)
        dtypes = set()
        for n in names:
            got_shape, got_dtype = files.meta[n]
            where = f"{hf_dir}/{files.location[n]}"
            if got_shape != per_source:
                raise CheckpointError(f"{where}: tensor {n} has shape {list(got_shape)} but the config in "
                                      f"config.json needs {list(per_source)}")
            if not got_dtype.is_floating_point:
                raise CheckpointError(f"{where}: tensor {n} has dtype {got_dtype}, expected floating point")
            if declared is not None and got_dtype != declared:
                raise CheckpointError(f"{where}: tensor {n} has dtype {got_dtype} but config.json declares "
                                      f"{declared}")
            dtypes.add(got_dtype)
        if len(dtypes) > 1:
            raise CheckpointError(f"{hf_dir}: the tensors of {native} mix dtypes {sorted(map(str, dtypes))}")
        sources[native] = names
    specs = {n: (shape, dtype or files.meta[sources[n][0]][1]) for n, (shape, _) in expected.items()}

    def produce(native: str) -> torch.Tensor:
        names = sources[native]
        shape, out_dtype = specs[native]
        parts = files.read(names)
        if len(parts) == 1:
            tensor = parts[0]
        elif native.endswith("w_gate_up"):  # [gate_0, up_0, gate_1, ...] -> [E, 2F, D]
            tensor = torch.stack([torch.cat(parts[2 * e: 2 * e + 2], dim=0) for e in range(len(parts) // 2)])
        else:
            tensor = torch.stack(parts)
        if tuple(tensor.shape) != shape:  # the headers were checked; this guards the stacking code
            raise CheckpointError(f"{hf_dir}: {native} assembled as {list(tensor.shape)}, expected {list(shape)}")
        return tensor.to(out_dtype)

    return specs, produce


def _source_shape(native: str, shape: tuple[int, ...], per_expert: bool) -> tuple[int, ...]:
    """Shape of each HF tensor that makes native tensor ``native`` of ``shape``."""
    if not per_expert:
        return shape
    if native.endswith("w_gate_up"):  # [E, 2F, D] from gate/up [F, D] each
        return (shape[1] // 2, shape[2])
    return tuple(shape[1:])  # w_down [E, D, F] from down [D, F]


def load_hf_model(hf_dir: str, dtype: torch.dtype = torch.float32, device="cpu"):
    """(ModelConfig, Transformer) with the weights of the HF checkpoint in ``hf_dir`` (for small
    models: the whole model is materialized on ``device`` in ``dtype``)."""
    cfg = read_hf_config(hf_dir)
    specs, produce = hf_native_specs(hf_dir, cfg)
    model = cfg.build(device="meta")
    model.to_empty(device=device)
    model.to(dtype)
    state = model.state_dict()
    with torch.no_grad():
        for name in specs:
            state[name].copy_(produce(name))
    return cfg, model


# ==== native -> HF ==============================================================================


def parse_size(text: str | int) -> int:
    """Bytes in "5GB" (10^9), "500MiB" (2^20), "1000" ...; CheckpointError if unreadable."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise CheckpointError(f"shard size {text!r} is not a size like 5GB, 500MB or 2GiB")
    unit = m[2].upper().rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}.get(unit)
    if scale is None:
        raise CheckpointError(f"shard size {text!r} has an unknown unit")
    size = int(float(m[1]) * scale)
    if size <= 0:
        raise CheckpointError(f"shard size {text!r} must be positive")
    return size


def _export_plan(cfg: ModelConfig, arch: str, expected: dict) -> list[tuple[str, list[tuple[str, Callable]]]]:
    """[(native name, [(hf name, native tensor -> hf tensor)])] in checkpoint order (``expected``:
    the model's {native name: (shape, dtype)})."""
    plan = []
    for native, (shape, _) in expected.items():
        hf_names = native_to_hf(native, cfg, arch)
        if len(hf_names) == 1:
            plan.append((native, [(hf_names[0], lambda t: t)]))
        elif native.endswith("w_gate_up"):
            F = shape[1] // 2
            pieces = []
            for k, name in enumerate(hf_names):
                e, half = divmod(k, 2)
                pieces.append((name, lambda t, e=e, half=half: t[e, half * F:(half + 1) * F]))
            plan.append((native, pieces))
        else:
            plan.append((native, [(name, lambda t, e=e: t[e]) for e, name in enumerate(hf_names)]))
    return plan


def _hf_checkpoint_exists(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, n)) for n in (CONFIG, SINGLE, INDEX)
    )


def export_hf(
    native_ckpt_dir: str,
    out_dir: str,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
) -> str:
    """Write the native checkpoint ``native_ckpt_dir`` as a HF checkpoint at ``out_dir``; returns it.

    The architecture follows export_architecture (Olmo3ForCausalLM, OlmoeForCausalLM, else
    MoetronForCausalLM). Tensors are read and written one at a time into shards of at most
    ``max_shard_size`` bytes (one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
    + ``model.safetensors.index.json``), cast to ``dtype`` if given. Everything goes to a hidden
    temp dir renamed into place at the end: on any error nothing is written. An ``out_dir`` that
    already holds a checkpoint is an error unless ``overwrite``.
    """
    from moetron.core.weights import iter_weights, read_weight_specs

    shard_bytes = parse_size(max_shard_size)
    cfg = native_config(native_ckpt_dir)
    specs = read_weight_specs(native_ckpt_dir)
    expected = _expected_specs(cfg)
    for name, (shape, _) in expected.items():
        if name not in specs:
            raise CheckpointError(f"{native_ckpt_dir} has no tensor {name} that its model config needs")
        if tuple(specs[name][0]) != shape:
            raise CheckpointError(f"{native_ckpt_dir}: tensor {name} has shape {list(specs[name][0])}, "
                                  f"its model config needs {list(shape)}")
    dtypes = {specs[n][1] for n in expected}
    out_dtype = dtype or (dtypes.pop() if len(dtypes) == 1 else torch.float32)
    arch, _ = export_architecture(cfg)
    plan = _export_plan(cfg, arch, expected)

    # Shards: pack the HF tensors in order, a new shard when the next tensor would overflow.
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for native, pieces in plan:
        piece_shape = _source_shape(native, expected[native][0], len(pieces) > 1)
        nbytes = math.prod(piece_shape) * out_dtype.itemsize
        for hf_name, _ in pieces:
            if shards[-1] and used + nbytes > shard_bytes:
                shards.append([])
                used = 0
            shards[-1].append((hf_name, piece_shape))
            used += nbytes
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    out_dir = os.path.abspath(out_dir)
    with staged_dir(out_dir, overwrite, _hf_checkpoint_exists) as tmp:
        writer = _ShardWriter(tmp, names, shards, out_dtype)
        pieces_of = dict(plan)
        for native, tensor in iter_weights(native_ckpt_dir, [native for native, _ in plan]):
            tensor = tensor.to(out_dtype)
            for hf_name, extract in pieces_of[native]:
                writer.write(hf_name, extract(tensor))
        writer.close()
        total = sum(math.prod(s) * out_dtype.itemsize for shard in shards for _, s in shard)
        if n > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {h: names[i] for i, shard in enumerate(shards) for h, _ in shard}}
            with open(os.path.join(tmp, INDEX), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, CONFIG), "w", encoding="utf-8") as f:
            json.dump(hf_config_dict(cfg, out_dtype), f, indent=2)
        for name in os.listdir(tmp):
            _fsync_path(os.path.join(tmp, name))
    return out_dir


class _ShardWriter:
    """Writes planned safetensors shards sequentially: each header up front (the shapes are known),
    then the tensors' bytes as they arrive, so no shard is ever held in memory."""

    def __init__(self, dir: str, names: list[str], shards: list[list[tuple[str, tuple]]], dtype: torch.dtype):
        self.dir, self.names, self.shards, self.dtype = dir, names, shards, dtype
        self.order = [(i, h) for i, shard in enumerate(shards) for h, _ in shard]
        self.pos = 0
        self.file = None
        self.current = -1

    def _open(self, i: int) -> None:
        if self.file is not None:
            self.file.close()
        header, offset = {}, 0
        for hf_name, shape in self.shards[i]:
            nbytes = math.prod(shape) * self.dtype.itemsize
            header[hf_name] = {"dtype": _ST_NAMES[self.dtype], "shape": list(shape),
                               "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
        self.file = open(os.path.join(self.dir, self.names[i]), "wb")
        self.file.write(struct.pack("<Q", len(blob)) + blob)
        self.current = i

    def write(self, hf_name: str, tensor: torch.Tensor) -> None:
        shard, expected = self.order[self.pos]
        if expected != hf_name:  # the plan and the iteration order are built from the same list
            raise CheckpointError(f"internal: wrote {hf_name} where {expected} was planned")
        if shard != self.current:
            self._open(shard)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))
        self.pos += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.pos != len(self.order):
            raise CheckpointError(f"internal: wrote {self.pos} of {len(self.order)} planned tensors")
