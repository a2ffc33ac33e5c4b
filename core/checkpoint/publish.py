"""Atomic publication of a finished checkpoint directory: write beside it, then rename into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from typing import Callable, Iterator

from .layout import CheckpointError, dcp_cause, failed_write, free_bytes, fsync_path, gib

__all__ = ["publish_dir", "staged_dir"]


def publish_dir(tmp: str, final: str, nonce: str) -> None:
    """Rename the finished ``tmp`` dir to ``final`` atomically; an existing ``final`` is moved aside
    first and deleted only once the new one holds the name (if the rename fails, it is moved back)."""
    root = os.path.dirname(final)
    old = None
    if os.path.exists(final):
        old = os.path.join(root, f".{os.path.basename(final)}.old-{nonce}")
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)  # else the next prune would delete it as a leftover
        raise
    fsync_path(root, directory=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(path: str, overwrite: bool, holds_checkpoint: Callable[[str], bool], what: str = "checkpoint",
               size_bytes: int | None = None) -> Iterator[str]:
    """Write a single-process checkpoint directory atomically.

    Checks that ``path`` may be written (absent, an empty directory, or, with ``overwrite``, a
    checkpoint that ``holds_checkpoint(path)`` recognises), yields a fresh hidden tmp dir beside it,
    and publishes that dir as ``path`` when the block ends; if the block raises, the tmp dir is
    removed and ``path`` is left as it was. A failed write (layout.failed_write: an OSError, as on a
    full disk, or torch's zip writer's short write, also inside DCP's wrapper) raises one
    CheckpointError chained from it that names the failure, ``what`` and ``path``, the free space
    there now, ``size_bytes`` (about what the output takes, if given) and the fix; anything else is
    raised as it was."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a directory")
    replacing = holds_checkpoint(path)
    if replacing:
        if not overwrite:
            raise CheckpointError(f"{path} already holds a checkpoint: pass --overwrite or choose another output")
    elif os.path.isdir(path) and os.listdir(path):
        raise CheckpointError(f"{path} is a non-empty directory that is not a checkpoint: choose another output")
    parent = os.path.dirname(path)
    nonce = uuid.uuid4().hex[:12]
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{nonce}")
    try:
        os.makedirs(parent, exist_ok=True)
        os.makedirs(tmp)
        yield tmp
        publish_dir(tmp, path, nonce)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = dcp_cause(e)
        reason = failed_write(cause, tmp, path)
        if reason is None:
            raise  # a bug rather than the disk: as raised
        room = free_bytes(parent)  # once the partial output is gone: the room a retry has
        room = "an unknown amount of space" if room is None else gib(room)
        size = "" if size_bytes is None else f" and the {what} takes about {gib(size_bytes)}"
        kept = f"the {what} already at {path} is unchanged" if replacing else f"nothing was written to {path}"
        raise CheckpointError(
            f"writing the {what} {path} failed: {reason}; {parent} now has {room} free{size}; the partial "
            f"output {tmp} was removed and {kept}; free space there or write to a file system with room, "
            "then run again"
        ) from cause
