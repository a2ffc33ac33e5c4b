"""Native -> HF: config.json and safetensors shards written one tensor at a time into a staged
directory that is renamed into place at the end."""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Callable

import torch

from moetron.core.checkpoint import CheckpointError, fsync_path, staged_dir
from moetron.core.config import ConfigError, parse_size

from ..config import ModelConfig, native_config
from .config import CONFIG, export_architecture, hf_config_dict
from .load import native_specs, source_shape
from .names import native_to_hf
from .reading import INDEX, SAFETENSORS_DTYPE_NAMES, SINGLE


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
    progress: Callable[[int, int], None] | None = None,
) -> str:
    """Write the native checkpoint ``native_ckpt_dir`` as a HF checkpoint at ``out_dir``; returns it.

    The architecture follows export_architecture (Olmo3ForCausalLM, OlmoeForCausalLM, else
    MoetronForCausalLM). Tensors are read and written one at a time into shards of at most
    ``max_shard_size`` bytes (one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
    + ``model.safetensors.index.json``), cast to ``dtype`` if given; the size reads as
    core.config.parse_size does ("5GB" = 5 * 10^9, "2GiB" = 2^31), a bad one is a CheckpointError.
    Everything goes to a hidden temp dir renamed into place at the end: on any error nothing is
    written, and a failed write (a full disk) is a CheckpointError naming ``out_dir``, the free space
    there, the export's size and the fix. An ``out_dir`` that already holds a checkpoint is an error
    unless ``overwrite`` (and is kept if the export fails).
    ``progress(done_bytes, total_bytes)`` is called after each tensor (tools/convert_hf.py points
    it at data.progress.Progress.update).
    """
    from moetron.core.weights import iter_weights, read_weight_specs

    try:
        shard_bytes = parse_size(max_shard_size, "shard size")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    cfg = native_config(native_ckpt_dir)
    specs = read_weight_specs(native_ckpt_dir)
    expected = native_specs(cfg)
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
        piece_shape = source_shape(native, expected[native][0], len(pieces) > 1)
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
    total = sum(math.prod(s) * out_dtype.itemsize for shard in shards for _, s in shard)
    with staged_dir(out_dir, overwrite, _hf_checkpoint_exists, "Hugging Face checkpoint", total) as tmp:
        writer = _ShardWriter(tmp, names, shards, out_dtype)
        pieces_of = dict(plan)
        done = 0
        for native, tensor in iter_weights(native_ckpt_dir, [native for native, _ in plan]):
            tensor = tensor.to(out_dtype)
            for hf_name, extract in pieces_of[native]:
                writer.write(hf_name, extract(tensor))
            done += tensor.numel() * out_dtype.itemsize
            if progress is not None:
                progress(done, total)
        writer.close()
        if n > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {h: names[i] for i, shard in enumerate(shards) for h, _ in shard}}
            with open(os.path.join(tmp, INDEX), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, CONFIG), "w", encoding="utf-8") as f:
            json.dump(hf_config_dict(cfg, out_dtype), f, indent=2)
        for name in os.listdir(tmp):
            fsync_path(os.path.join(tmp, name))
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
            header[hf_name] = {"dtype": SAFETENSORS_DTYPE_NAMES[self.dtype], "shape": list(shape),
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
