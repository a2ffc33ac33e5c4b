"""HF -> native: check an HF checkpoint against its config from the safetensors headers, then
produce native tensors lazily (one stacked expert tensor at a time for MoE layers).

Legend: E experts, F expert hidden, D model dim.
"""

from __future__ import annotations

import os
import re
from typing import Callable

import torch

from moetron.core.checkpoint import CheckpointError

from ..config import ModelConfig
from .config import CONFIG, JSON_DTYPES, architecture_from_hf_dict, config_from_hf_dict, load_json, read_hf_config
from .names import FUSED_EXPERTS_RE, hf_to_native, native_to_hf
from .reading import HFFiles

# Buffers some exporters save that carry no weights.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def native_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{native name: (shape, dtype)} of the model ``cfg`` builds (on the meta device: no memory)."""
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
    hf = load_json(config_path)
    arch = architecture_from_hf_dict(hf, config_path)
    cfg = cfg if cfg is not None else config_from_hf_dict(hf, config_path)
    dtype_name = hf.get("dtype") or hf.get("torch_dtype")
    declared = JSON_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    files = HFFiles(hf_dir)
    expected = native_specs(cfg)
    fused = {}  # native name -> fused HF name when the checkpoint stores experts fused
    for hf_name in files.meta:
        if _IGNORED.match(hf_name):
            continue
        native = hf_to_native(hf_name, arch)
        if native not in expected:
            raise CheckpointError(f"{hf_dir}: tensor {hf_name} does not fit the model in config.json "
                                  f"(no {native} in a {cfg.n_layers}-layer {cfg.describe()} model)")
        if FUSED_EXPERTS_RE.fullmatch(hf_name):
            fused[native] = hf_name

    sources: dict[str, list[str]] = {}
    for native, (shape, _) in expected.items():
        names = [fused[native]] if native in fused else native_to_hf(native, cfg, arch)
        missing = [n for n in names if n not in files.meta]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{hf_dir}: tensor {missing[0]}{more} is missing (needed for {native})")
        per_source = source_shape(native, shape, len(names) > 1)
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


def source_shape(native: str, shape: tuple[int, ...], per_expert: bool) -> tuple[int, ...]:
    """Shape of each HF tensor that makes native tensor ``native`` of ``shape``."""
    if not per_expert:
        return shape
    if native.endswith("w_gate_up"):  # [E, 2F, D] from gate/up [F, D] each
        return (shape[1] // 2, shape[2])
    return tuple(shape[1:])  # w_down [E, D, F] from down [D, F]


def load_hf_model(hf_dir: str, dtype: torch.dtype = torch.float32, device="cpu",
                  progress: Callable[[int, int], None] | None = None):
    """(ModelConfig, Transformer) with the weights of the HF checkpoint in ``hf_dir`` (for small
    models: the whole model is materialized on ``device`` in ``dtype``). ``progress(done_bytes,
    total_bytes)`` is called after each tensor (data.progress.Progress.update fits it)."""
    cfg = read_hf_config(hf_dir)
    specs, produce = hf_native_specs(hf_dir, cfg)
    model = cfg.build(device="meta")
    model.to_empty(device=device)
    model.to(dtype)
    state = model.state_dict()
    total = sum(state[name].nbytes for name in specs)
    done = 0
    with torch.no_grad():
        for name in specs:
            state[name].copy_(produce(name))
            done += state[name].nbytes
            if progress is not None:
                progress(done, total)
    return cfg, model
