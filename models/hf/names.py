"""HF <-> native weight names: which native tensor each HF tensor goes into, and back.

Legend: E experts, F expert hidden, D model dim.
"""

from __future__ import annotations

import re

from moetron.core.checkpoint import CheckpointError

from ..config import ModelConfig
from .config import MOETRON, OLMO3, OLMOE, export_architecture

_ATTN = r"model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight"
_LAYER_NORMS = {
    OLMO3: {"post_attention_layernorm": "attention_norm", "post_feedforward_layernorm": "mlp_norm"},
    OLMOE: {"input_layernorm": "attention_norm", "post_attention_layernorm": "mlp_norm"},
}
_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight"}
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
FUSED_EXPERTS_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


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
        m = FUSED_EXPERTS_RE.fullmatch(hf_name)
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
