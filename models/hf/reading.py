"""Reading safetensors checkpoints: where each tensor lives (from the file headers alone) and the
tensors themselves, one at a time."""

from __future__ import annotations

import json
import os
import struct
from typing import Iterator

import torch

from moetron.core.checkpoint import CheckpointError

from .config import load_json

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_DTYPE_NAMES = {v: k for k, v in _ST_DTYPES.items()}


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
    files = HFFiles(hf_dir)
    from safetensors import safe_open

    for fname in files.files:
        keys = sorted(k for k, f in files.location.items() if f == fname)
        for k in keys:
            with safe_open(os.path.join(hf_dir, fname), framework="pt") as f:
                tensor = f.get_tensor(k)
            yield k, tensor
