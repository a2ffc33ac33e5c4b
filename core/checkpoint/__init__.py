"""Crash-safe training checkpoints on top of torch.distributed.checkpoint (DCP).

A checkpoint is a plain DCP directory (readable with ``dcp.load`` alone) plus a few small files:

    <dir>/step_00001000/
        .metadata, __<rank>_<n>.distcp   DCP: "model", "optim" (via get_state_dict, so a checkpoint
                                         saved on one mesh loads on another) and "extra/<name>"
        rng_rank<r>.pt                   each rank's python / numpy / torch (CPU, CUDA) RNG states, as
                                         plain data (tensors, numbers: loads with weights_only=True)
        meta.json                        the caller's metadata (run config ...) + step, world size,
                                         torch version
        manifest.json                    every other file with its size and sha256; written last

Saving writes everything into ``<dir>/.step_<step>.tmp-<nonce>`` and renames it to its final name
only once the manifest is on disk, so a crash at any point leaves either a complete checkpoint or a
hidden tmp dir that :meth:`Checkpointer.latest` ignores. Older checkpoints are pruned only after a
newer one is complete. Loading verifies the manifest first and raises :class:`CheckpointError`
instead of ever falling back silently to an older checkpoint or a fresh start.

Loading never runs code from the checkpoint: :mod:`.safe_load` reads DCP's pickled ``.metadata``
through a restricted unpickler and every other pickle with ``weights_only=True``.

The package, one idea a file: :mod:`.layout` (names, the manifest, durable writes, sha256),
:mod:`.publish` (atomic publication of a finished directory), :mod:`.merge` (one module over a
model's pipeline parts), :mod:`.safe_load` (reading without running code) and :mod:`.checkpointer`
(the config and the DCP Checkpointer).
"""

from .checkpointer import CheckpointConfig, Checkpointer
from .layout import (
    MANIFEST, META, STALE_DIR_RE, STEP_DIR_RE, CheckpointError, dcp_cause, failed_write, fsync_path,
    is_complete, read_manifest, sha256_file, step_name, write_durable, write_manifest,
)
from .merge import as_one_module
from .publish import publish_dir, staged_dir
from .safe_load import SafeFileSystemReader, SafeLoadPlanner, load_dcp, load_plain

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "MANIFEST",
    "META",
    "STALE_DIR_RE",
    "STEP_DIR_RE",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "as_one_module",
    "dcp_cause",
    "failed_write",
    "fsync_path",
    "is_complete",
    "load_dcp",
    "load_plain",
    "read_manifest",
    "publish_dir",
    "sha256_file",
    "staged_dir",
    "step_name",
    "write_durable",
    "write_manifest",
]
