"""Weights-only native checkpoints, written and read one tensor at a time.

Conversion (HF <-> native) and upcycling must handle checkpoints far larger than RAM (a 32B model
is 64 GB in bf16; the machine may have 24 GiB). ``save_weights`` takes the tensors' shapes up front
and a ``produce(name)`` function that makes each tensor only when DCP writes it (one file per
tensor), so peak memory is a few tensors. The result is the same format the trainer writes: a DCP
directory with ``model.<fqn>`` keys, ``meta.json`` (the model config) and ``manifest.json``
(sizes and sha256, written last), published by an atomic rename; ``Checkpointer.load(...,
model_only=True)`` and ``--checkpoint.init_from`` read it, and DCP reshards it for any layout.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from .checkpoint import (
    MANIFEST, META, CheckpointError, SafeFileSystemReader, dcp_cause, failed_write, load_dcp, sha256_file,
    staged_dir, write_durable, write_manifest,
)

__all__ = ["save_weights", "iter_weights", "read_weight_specs", "checkpoint_exists"]


class _LazySavePlanner(DefaultSavePlanner):
    """Plans from meta tensors; each tensor's data comes from ``produce(name)`` at write time."""

    def __init__(self, produce: Callable[[str], torch.Tensor], specs: dict[str, tuple]):
        super().__init__(dedup_save_to_lowest_rank=False)
        self.produce, self.specs = produce, specs

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        name = fqn[len("model."):]
        tensor = self.produce(name)
        shape, dtype = self.specs[name]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise CheckpointError(
                f"tensor {name}: produced {tuple(tensor.shape)} {tensor.dtype}, declared {tuple(shape)} {dtype}"
            )
        return tensor.detach().contiguous().cpu()


def checkpoint_exists(path: str) -> bool:
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, MANIFEST)) or
                                    os.path.exists(os.path.join(path, ".metadata")))


def save_weights(
    path: str,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, Any],
    overwrite: bool = False,
) -> str:
    """Stream tensors into a weights-only checkpoint at ``path``; returns the path.

    ``specs`` maps each parameter name (as in the model's state dict) to (shape, dtype);
    ``produce(name)`` returns that tensor (called once per name, in DCP's order). ``metadata``
    (JSON-able; put the model config under "config": {"model": ...}) becomes meta.json. An existing
    checkpoint at ``path`` is an error unless ``overwrite``; then it is replaced only once the new
    one is complete. Nothing is left at ``path`` if writing fails; a failed write (a full disk) is a
    CheckpointError naming ``path``, the free space there, the checkpoint's size and the fix.
    """
    path = os.path.abspath(path)
    size = sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())
    with staged_dir(path, overwrite, checkpoint_exists, "weights-only checkpoint", size) as tmp:
        meta = dict(metadata, world_size=1, torch_version=torch.__version__, weights_only=True)
        state = {f"model.{n}": torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype) in specs.items()}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(
                    state,
                    storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=False, thread_count=1,
                                                        sync_files=True),
                    planner=_LazySavePlanner(produce, specs),
                    no_dist=True,
                )
        except dcp.api.CheckpointException as e:  # DCP wraps the producer's error: surface it as ours
            cause = dcp_cause(e)
            if isinstance(cause, CheckpointError):  # e.g. a source tensor refused by the safe reader
                raise cause from None
            if failed_write(cause, tmp, path) is not None:
                raise  # the disk: staged_dir says so, with the room there and the fix
            raise CheckpointError(f"writing {path} failed: {cause}") from e
        write_durable(os.path.join(tmp, META), json.dumps(meta, indent=2, sort_keys=True).encode())
        files = {}
        for name in sorted(os.listdir(tmp)):
            full = os.path.join(tmp, name)
            files[name] = {"size": os.path.getsize(full), "sha256": sha256_file(full)}
        write_manifest(tmp, meta.get("step", 0), 1, files)
    return path


def read_weight_specs(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of the model tensors stored in a native checkpoint."""
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} is not a native (DCP) checkpoint: no .metadata file")
    md = SafeFileSystemReader(path).read_metadata().state_dict_metadata  # restricted unpickler
    out = {}
    for key, value in md.items():
        if key.startswith("model.") and hasattr(value, "size"):
            out[key[len("model."):]] = (tuple(value.size), value.properties.dtype)
    return out


def iter_weights(path: str, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) from a native checkpoint, reading one tensor at a time."""
    specs = read_weight_specs(path)
    for name in names if names is not None else sorted(specs):
        if name not in specs:
            raise CheckpointError(f"{path} has no tensor {name!r}")
        shape, dtype = specs[name]
        state = {f"model.{name}": torch.empty(shape, dtype=dtype)}
        load_dcp(state, SafeFileSystemReader(path), no_dist=True)
        yield name, state[f"model.{name}"]
