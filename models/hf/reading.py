"""Reading safetensors checkpoints through the ``safetensors`` package's own reader
(``safe_open(..., framework="pt")``): where each tensor lives (from the file headers alone: the
files are memory-mapped, no tensor data is touched) and the tensors themselves, one at a time."""

from __future__ import annotations

import os
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from moetron.core.checkpoint import CheckpointError

from .config import load_json

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# The writer (export.py) streams shards itself (safetensors has no streaming writer) with these names.
SAFETENSORS_DTYPE_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _open(path: str):
    """``safe_open(path)``; a file safetensors refuses (bad header, truncated data) is a CheckpointError."""
    try:
        return safe_open(path, framework="pt")
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def _read_specs(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of every tensor in the safetensors file ``path`` (headers only)."""
    specs = {}
    with _open(path) as f:
        for key in f.keys():
            sl = f.get_slice(key)
            dtype = sl.get_dtype()
            if dtype not in _ST_DTYPES:
                raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {dtype}")
            specs[key] = (tuple(sl.get_shape()), _ST_DTYPES[dtype])
    return specs


class HFFiles:
    """Where each tensor of an HF checkpoint lives, with its shape and dtype (from the headers)."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index, single = os.path.join(hf_dir, INDEX), os.path.join(hf_dir, SINGLE)
        if os.path.exists(index):
            weight_map = load_json(index).get("weight_map")
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
            for key, spec in _read_specs(os.path.join(hf_dir, name)).items():
                self.location[key] = name
                self.meta[key] = spec
        if weight_map is not None:
            for key, name in weight_map.items():
                if self.location.get(key) != name:
                    raise CheckpointError(f"{index} places {key} in {name}, but that shard does not hold it")

    def read(self, names: list[str]) -> list[torch.Tensor]:
        """Load the named tensors, opening each needed file once and closing it right after."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.location[n], []).append(n)
        out: dict[str, torch.Tensor] = {}
        for fname, keys in by_file.items():
            out.update(zip(keys, _get_tensors(os.path.join(self.dir, fname), keys)))
        return [out[n] for n in names]


def _get_tensors(path: str, keys: list[str]) -> Iterator[torch.Tensor]:
    """The tensors ``keys`` of ``path``, read one at a time (the file is open only meanwhile)."""
    with _open(path) as f:
        for k in keys:
            try:
                tensor = f.get_tensor(k)
            except SafetensorError as e:
                raise CheckpointError(f"{path}: tensor {k} cannot be read: {e}") from None
            yield tensor


def iter_hf_tensors(hf_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) from ``model.safetensors`` or the shards named by
    ``model.safetensors.index.json``, one tensor at a time (a missing shard is a CheckpointError)."""
    files = HFFiles(hf_dir)
    for fname in files.files:
        keys = sorted(k for k, f in files.location.items() if f == fname)
        yield from zip(keys, _get_tensors(os.path.join(hf_dir, fname), keys))
