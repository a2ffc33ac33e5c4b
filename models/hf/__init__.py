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

Modules: config (config.json <-> ModelConfig), names (weight-name maps), reading (safetensors
headers and tensors), load (HF -> native), export (native -> HF).
"""

from __future__ import annotations

from ..config import native_config
from .config import (
    CONFIG,
    MOETRON,
    OLMO3,
    OLMOE,
    SUPPORTED,
    architecture_from_hf_dict,
    config_from_hf_dict,
    export_architecture,
    hf_architecture,
    hf_config_dict,
    read_hf_config,
)
from .export import export_hf
from .load import hf_native_specs, load_hf_model, native_specs
from .names import hf_to_native, native_to_hf
from .reading import INDEX, SINGLE, iter_hf_tensors

__all__ = [
    "OLMO3",
    "OLMOE",
    "MOETRON",
    "SUPPORTED",
    "CONFIG",
    "SINGLE",
    "INDEX",
    "read_hf_config",
    "config_from_hf_dict",
    "hf_architecture",
    "architecture_from_hf_dict",
    "hf_config_dict",
    "export_architecture",
    "hf_to_native",
    "native_to_hf",
    "iter_hf_tensors",
    "hf_native_specs",
    "native_specs",
    "load_hf_model",
    "export_hf",
    "native_config",
]
