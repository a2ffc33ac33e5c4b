"""The on-disk vocabulary of a checkpoint: file and directory names, durable writes, the manifest.

A checkpoint directory is named ``step_XXXXXXXX``; a save in progress (or one a crash interrupted)
is a hidden ``.step_XXXXXXXX.tmp-<nonce>`` (or ``.old-<nonce>`` while being replaced or pruned).
``manifest.json`` lists every other file with its size and sha256 and is written last, so a
directory with a manifest is complete. A write that fails (a full disk, a file size limit) is told
apart from a bug by :func:`failed_write`, which every writer of a checkpoint dir asks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Any

__all__ = [
    "CheckpointError",
    "MANIFEST",
    "META",
    "STEP_DIR_RE",
    "STALE_DIR_RE",
    "step_name",
    "fsync_path",
    "write_durable",
    "sha256_file",
    "write_manifest",
    "is_complete",
    "read_manifest",
    "dcp_cause",
    "failed_write",
    "free_bytes",
    "gib",
    "os_reason",
]

MANIFEST = "manifest.json"
META = "meta.json"
STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")
"""A complete or damaged checkpoint dir's name; group 1 is the step."""
STALE_DIR_RE = re.compile(r"^\.step_\d{8,}\.(tmp|old)-[0-9a-f]+$")
"""A hidden dir left by an interrupted save or prune."""
_HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved, found or loaded; the message says which and what to do."""


def dcp_cause(e: BaseException) -> BaseException:
    """The first rank's original exception inside DCP's CheckpointException (which wraps what a
    save or load step raised, tracebacks and all), else ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for _, wrapped in sorted(failures.items()):
            cause = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            if isinstance(cause, BaseException):
                return dcp_cause(cause)
    return e


def os_reason(e: OSError) -> str:
    """'no space left on device', 'permission denied' ...: the OS's words for ``e``."""
    return (e.strerror or os.strerror(e.errno) if e.errno else str(e)).lower()


# torch's zip writer (torch.save, and DCP's tensor entries) reports a short write, the way a full disk
# shows up there, as "[enforce fail at inline_container.cc:NNN] . unexpected pos 704 vs 598" or
# "PytorchStreamWriter failed writing file ...": a RuntimeError, not an OSError.
_TORCH_WRITER_FAILED = re.compile(r"inline_container\.cc|PytorchStreamWriter")


def failed_write(e: BaseException, tmp: str, final: str | None = None) -> str | None:
    """What went wrong, in words, when ``e`` (raised while writing the dir ``tmp``) is a failed write:
    an OSError or torch's zip-writer RuntimeError; None for anything else (a bug rather than the disk).

    With ``final`` (the path ``tmp`` is published as), the writer also reads other files (a source
    checkpoint): an OSError naming a file other than ``tmp``, ``final``, what lies in them or a
    directory above them is that read's failure, not the write's, and gives None."""
    if isinstance(e, OSError):
        if final is not None and isinstance(e.filename, (str, bytes, os.PathLike)) and \
                not _on_the_way(os.fsdecode(e.filename), tmp, final):
            return None
        return f"{os_reason(e)} ({e.filename or tmp})"
    if isinstance(e, RuntimeError) and not isinstance(e, CheckpointError) and _TORCH_WRITER_FAILED.search(str(e)):
        first = str(e).strip().splitlines()[0]
        return f"a write under {tmp} came up short (torch: {first}), as when the disk is full"
    return None


def _on_the_way(name: str, *written: str) -> bool:
    """Whether the file ``name`` is one of the ``written`` paths, inside one, or a directory above one."""
    name = os.path.abspath(name)
    for path in map(os.path.abspath, written):
        if os.path.commonpath([name, path]) in (name, path):
            return True
    return False


def free_bytes(path: str) -> int | None:
    """Free bytes on ``path``'s file system, None if it cannot be asked."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def gib(n: int) -> str:
    """``n`` bytes as "1.25 GiB"."""
    return f"{n / 2**30:.2f} GiB"


def step_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``: ``step_<step:08d>``."""
    return f"step_{step:08d}"


def fsync_path(path: str, directory: bool = False) -> None:
    """fsync the file (or, with ``directory``, the directory) at ``path``."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sha256_file(path: str) -> str:
    """The hex sha256 of the file at ``path``, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(root: str, step: int, world_size: int, files: dict[str, dict[str, Any]]) -> None:
    """Write ``root``'s manifest (``files``: name -> size and sha256), the last file of a checkpoint."""
    manifest = {"format": 1, "step": step, "world_size": world_size, "files": files}
    write_durable(os.path.join(root, MANIFEST), json.dumps(manifest, indent=2).encode())
    fsync_path(root, directory=True)


def is_complete(path: str) -> bool:
    """Whether checkpoint dir ``path`` has its manifest (the save finished)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def read_manifest(path: str) -> tuple[str | None, dict[str, Any]]:
    """(problem, manifest) of checkpoint dir ``path``: problem is None and manifest the parsed
    manifest.json when it is well formed, else a sentence saying what is wrong and ``{}``.
    File sizes and hashes are not checked here."""
    if not os.path.isdir(path):
        return f"{path} is not a directory", {}
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return f"{MANIFEST} is missing (the save did not finish)", {}
    except (OSError, ValueError) as e:
        return f"{MANIFEST} cannot be read: {e}", {}
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or META not in files or ".metadata" not in files:
        return f"{MANIFEST} is garbled (no valid file list)", {}
    for name, entry in files.items():
        if os.path.basename(name) != name or not isinstance(entry, dict) or {"size", "sha256"} - set(entry):
            return f"{MANIFEST} is garbled (bad entry {name!r})", {}
    return None, manifest
