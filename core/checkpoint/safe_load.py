"""Reading a checkpoint without running code from it (docs/checkpoints.md, "Trust model").

DCP stores ``.metadata`` as a pickle and every non-tensor value (``extra/...``, the optimizer's param
groups) as ``torch.save`` bytes, and its own reader unpickles both unrestricted: a ``__reduce__``
planted in a checkpoint would run on load, and the manifest does not help (whoever ships a
checkpoint ships its manifest). Here nothing from a file is unpickled unrestricted:

- :class:`SafeFileSystemReader` reads ``.metadata`` with an unpickler that admits only DCP's metadata
  classes, ``torch.Size``, torch dtypes / layouts / memory formats and builtin containers, and names
  the data file whose entry is not plain data;
- :class:`SafeLoadPlanner` loads the byte entries with ``torch.load(weights_only=True)``;
- :func:`load_plain` reads a ``torch.save`` file (the RNG states) the same way;
- :func:`load_dcp` runs ``dcp.load`` with both and raises the CheckpointError they found.

Refusals are CheckpointErrors that name the file.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import os
import pathlib
import pickle
import re
import sys
import warnings
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.futures import Future

from .layout import CheckpointError

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "load_dcp", "load_plain"]

_TRUST = "loading a checkpoint never runs code from it (docs/checkpoints.md, 'Trust model')"


# ---- .metadata: a restricted unpickler -----------------------------------------------------


def _layout_named(name: str) -> torch.layout:
    """torch pickles a layout as ``torch.serialization._get_layout("torch.strided")``: the same lookup."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise pickle.UnpicklingError(f"unknown torch layout {name!r}")


def _metadata_classes() -> list[type]:
    names = ["Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
             "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"]
    classes = [getattr(dcp_metadata, n) for n in names if hasattr(dcp_metadata, n)]
    if hasattr(dcp_filesystem, "_StorageInfo"):  # where each entry lives: file, offset, length
        classes.append(dcp_filesystem._StorageInfo)
    return classes


def _allowed_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {}
    for cls in _metadata_classes():
        allowed[cls.__module__, cls.__qualname__] = cls
    allowed["torch", "Size"] = torch.Size
    allowed["torch.serialization", "_get_layout"] = _layout_named
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed["torch", name] = value
    for cls in (dict, list, tuple, set, frozenset, int, float, complex, bool, str, bytes):
        allowed["builtins", cls.__name__] = cls
    allowed["collections", "OrderedDict"] = collections.OrderedDict
    for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):  # StorageMeta's checkpoint_id
        cls = getattr(pathlib, name)
        allowed["pathlib", name] = allowed[cls.__module__, name] = cls
    return allowed


_ALLOWED = _allowed_globals()
# BUILD (set an object's state) only on instances of DCP's dataclasses: never on a class or a module.
_BUILDABLE = tuple(c for c in _metadata_classes() if not issubclass(c, enum.Enum))


class _MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its opcodes can be restricted
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[module, name]
        except KeyError:
            raise pickle.UnpicklingError(
                f"it refers to {module}.{name}, which is not DCP checkpoint metadata") from None

    def _load_build(self) -> None:
        target = self.stack[-2] if len(self.stack) >= 2 else None
        if type(target) not in _BUILDABLE:
            raise pickle.UnpicklingError(f"it sets the state of a {type(target).__name__}, not of DCP metadata")
        pickle._Unpickler.load_build(self)

    def _refuse_extension(self) -> None:
        raise pickle.UnpicklingError("it uses the copyreg extension registry")

    dispatch[pickle.BUILD[0]] = _load_build
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _refuse_extension
    del _op


def _check_metadata(md: Any) -> None:
    """The unpickled object must be a Metadata whose entries live in plain files of the checkpoint."""
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise pickle.UnpicklingError(f"it holds a {type(md).__name__}, not a DCP Metadata")
    for info in (md.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or os.path.basename(relative) != relative or relative in ("", ".", ".."):
            raise pickle.UnpicklingError(f"an entry points outside the checkpoint directory ({relative!r})")


# ---- plain data: torch.load(weights_only=True) ---------------------------------------------


def _plain_globals() -> list[Any]:
    """What weights_only admits beyond tensors and containers: numpy arrays (RNG files of checkpoints
    written before the RNG state was stored as tensors) and moetron's own enums (config choices; the
    LR schedule's state holds its ScheduleKind). Only modules already imported are looked at."""
    try:
        from numpy._core.multiarray import _reconstruct as reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct as reconstruct
    found: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), reconstruct,
                        (reconstruct, "numpy.core.multiarray._reconstruct"),
                        (reconstruct, "numpy._core.multiarray._reconstruct")]
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "moetron" or name.startswith("moetron.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, enum.Enum) and value.__module__ == name:
                found.append(value)
    return found


def _load_plain_data(f: BinaryIO) -> Any:
    with torch.serialization.safe_globals(_plain_globals()):
        return torch.load(f, weights_only=True)


def _why(e: BaseException) -> str:
    """One line from torch's weights_only error (which goes on to suggest weights_only=False or an
    allowlist: advice not to pass on)."""
    text = str(e)
    m = re.search(r"GLOBAL ([\w.]+)", text)
    if m:
        return f"it refers to {m.group(1)}"
    m = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    if m:
        return m.group(1).strip()
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    useful = [p for p in paragraphs if not p.startswith(("Weights only load failed", "Check the documentation"))]
    return (useful or paragraphs or [type(e).__name__])[0].splitlines()[0]


def load_plain(path: str) -> Any:
    """The object ``torch.save``d in file ``path``, loaded with ``weights_only=True`` (tensors,
    containers, numbers, strings; no code runs). Raises CheckpointError naming the file."""
    try:
        with open(path, "rb") as f:
            return _load_plain_data(f)
    except OSError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path} is not plain data ({_why(e)}): refusing to load it; {_TRUST}") from None


# ---- DCP -------------------------------------------------------------------------------------


class _NotPlainEntry(pickle.UnpicklingError):
    """A byte entry that SafeLoadPlanner refused; the message names the entry."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with byte entries loaded by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = _load_plain_data(value)
        except Exception as e:
            raise _NotPlainEntry(f"its entry {read_item.dest_index.fqn!r} is not plain data ({_why(e)})") from e
        # The default planner puts the value where it belongs in the nested state; it unpickles
        # unrestricted, so it gets a fresh serialization of the plain data loaded above.
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        super().load_bytes(read_item, buf)


class SafeFileSystemReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` that reads ``.metadata`` with a restricted unpickler and names the data
    file that does not load as plain data. ``refused`` holds the CheckpointError it raised, if any
    (DCP wraps errors raised inside ``dcp.load``)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.root = os.path.abspath(os.fspath(path))
        self.refused: CheckpointError | None = None

    def _refuse(self, name: str, why: str) -> CheckpointError:
        self.refused = CheckpointError(
            f"checkpoint {self.root}: {name} is not safe to load ({why}); refusing to load it "
            f"(the file was altered, or not written by moetron / torch.distributed.checkpoint); {_TRUST}"
        )
        return self.refused

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(os.path.join(self.root, name), "rb") as f:
            try:
                md = _MetadataUnpickler(f).load()
                _check_metadata(md)
            except Exception as e:  # anything but a well-formed Metadata of the allowed classes
                raise self._refuse(name, str(e) or type(e).__name__) from None
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan, planner) -> Future:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():  # one file at a time, so a refusal names its file
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except _NotPlainEntry as e:
                raise self._refuse(name, str(e)) from None
            except pickle.UnpicklingError as e:  # DCP's own torch.load(weights_only=True) of a tensor
                raise self._refuse(name, f"a tensor entry is not plain data ({_why(e)})") from None
        done: Future = Future()
        done.set_result(None)
        return done


def load_dcp(state: dict[str, Any], reader: SafeFileSystemReader, no_dist: bool = True) -> None:
    """``dcp.load(state)`` through ``reader`` and :class:`SafeLoadPlanner`. A file refused by the reader
    raises its CheckpointError; other failures propagate as DCP raised them."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except (Exception, CheckpointException):
        if reader.refused is not None:
            raise reader.refused from None
        raise
