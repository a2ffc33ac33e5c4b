"""The DCP checkpointer: its config, and saving, finding, verifying and loading ``step_XXXXXXXX``
checkpoints (model and optimizer through get_state_dict, extras, each rank's RNG states)."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import random
import shutil
import uuid
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from moetron.core.config import Config, ConfigError

from .layout import (
    MANIFEST,
    META,
    STALE_DIR_RE,
    STEP_DIR_RE,
    CheckpointError,
    dcp_cause,
    failed_write,
    free_bytes,
    gib,
    is_complete,
    os_reason,
    read_manifest,
    sha256_file,
    step_name,
    write_durable,
    write_manifest,
)
from .merge import as_one_module
from .publish import publish_dir
from .safe_load import SafeFileSystemReader, load_dcp, load_plain

__all__ = ["CheckpointConfig", "Checkpointer"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CheckpointConfig(Config):
    dir: str | None = None
    """Directory holding ``step_XXXXXXXX`` checkpoints; None writes no checkpoints."""
    interval: int = 0
    """Save every this many steps; 0 saves only at the end (if ``save_final``)."""
    keep_last: int = 2
    """Keep this many newest complete checkpoints (older ones are pruned only after a new one is
    complete); 0 keeps all."""
    save_final: bool = True
    """Save a checkpoint after the last training step."""
    init_from: str | None = None
    """Start a new run from the model weights of this checkpoint (converted from HF or upcycled):
    fresh optimizer and schedule, step 0. Ignored when resuming."""

    def validate(self) -> None:
        super().validate()
        if self.interval < 0:
            raise ConfigError(
                f"checkpoint.interval={self.interval} is negative: use 0 (only at the end) or N > 0 "
                "(every N steps)"
            )
        if self.keep_last < 0:
            raise ConfigError(
                f"checkpoint.keep_last={self.keep_last} is negative: use 0 (keep all) or N > 0"
            )
        if self.dir is not None and self.dir.strip() == "":
            raise ConfigError("checkpoint.dir is empty: set a directory, or leave it unset for no checkpoints")

    def should_save(self, step: int, final: bool = False) -> bool:
        """Whether the trainer should save after ``step`` (``final``: it was the last step)."""
        if self.dir is None:
            return False
        return (final and self.save_final) or (self.interval > 0 and step % self.interval == 0)


# ---- helpers ---------------------------------------------------------------------------------


def _flat_keys(state: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts to ``a.b.c`` keys the way DCP names them (lists stay leaves)."""
    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for k, v in state.items():
            out.update(_flat_keys(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: state}


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as plain data (tensors, numbers, tuples): the file loads with
    ``torch.load(weights_only=True)``."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    np.random.set_state(numpy_state)  # else a tuple with an ndarray: written before the RNG state was plain data
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class _Value(Stateful):
    """Wraps a plain extra value so it goes through DCP (tensors as tensors, the rest as bytes)."""

    def __init__(self, value: Any):
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict["value"]


# ---- the checkpointer ------------------------------------------------------------------------


class Checkpointer:
    """Saves, finds, verifies and loads checkpoints under ``cfg.dir``.

    Uses the default torch.distributed process group when one is initialized (every rank must call
    :meth:`save` and :meth:`load`), otherwise runs as a single process. The directory must be on a
    file system every rank sees.
    """

    def __init__(self, cfg: CheckpointConfig):
        cfg.validate()
        self.cfg = cfg

    # ---- process group ----------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if self.distributed else 1

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _hash_files(self, root: str, names: list[str]) -> dict[str, dict[str, Any]]:
        """Size and sha256 of ``names`` in ``root``; the work is split round-robin over ranks."""
        mine = {
            n: {"size": os.path.getsize(os.path.join(root, n)), "sha256": sha256_file(os.path.join(root, n))}
            for i, n in enumerate(names)
            if i % self.world_size == self.rank
        }
        merged: dict[str, dict[str, Any]] = {}
        for part in self._all_gather(mine):
            merged.update(part)
        return merged

    # ---- saving -----------------------------------------------------------------------------
    @staticmethod
    def estimate_bytes(model: nn.Module | list[nn.Module], optimizer: torch.optim.Optimizer | None) -> int:
        """About the bytes of one checkpoint of ``model`` (or its pipeline parts) and ``optimizer``:
        every parameter and buffer (DTensors at their full size), plus the optimizer state it holds, or,
        before its first step, two moments per trainable parameter in its dtype (Adam's exp_avg and
        exp_avg_sq). A pipeline rank counts only its own stages."""
        model = as_one_module(model)
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        if optimizer is not None:
            state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            if state:
                total += sum(v.numel() * v.element_size() for v in state)
            else:
                total += sum(2 * p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"]
                             if p.requires_grad)
        return total

    def check_writable(self, estimated_bytes: int) -> None:
        """Fail at the start of a run, not at its first save: ``cfg.dir`` must be creatable and writable
        by every rank, and its file system must have ``estimated_bytes`` free (see :meth:`estimate_bytes`).
        Raises CheckpointError on every rank. Directories it creates to probe are removed again (the
        first save makes them). Does nothing for a run that saves no checkpoints."""
        if self.cfg.dir is None or not (self.cfg.save_final or self.cfg.interval > 0):
            return
        root = os.path.abspath(self.cfg.dir)
        missing = []  # rank 0 looks before any rank creates anything
        if self.rank == 0:
            d = root
            while not os.path.lexists(d) and os.path.dirname(d) != d:
                missing.append(d)
                d = os.path.dirname(d)
        missing = self._broadcast(missing)
        problem = None
        try:
            os.makedirs(root, exist_ok=True)
            probe = os.path.join(root, f".write-probe-rank{self.rank}-{uuid.uuid4().hex[:12]}")
            try:
                write_durable(probe, b"0")
            finally:
                if os.path.exists(probe):
                    os.remove(probe)
        except OSError as e:
            problem = (f"checkpoint dir {root} is not writable: {os_reason(e)} ({e.filename or root}); set "
                       "--checkpoint.dir to a directory this run can write")
        if problem is None and self.rank == 0:
            free = shutil.disk_usage(root).free
            if free < estimated_bytes:
                problem = (f"checkpoint dir {root} has {gib(free)} free but one checkpoint of this run takes about "
                           f"{gib(estimated_bytes)} (parameters + optimizer state): free space there or set "
                           "--checkpoint.dir to a file system with room")
        problems = [p for p in self._all_gather(problem) if p]  # also: every rank has probed
        if self.rank == 0:
            for d in missing:  # deepest first
                try:
                    os.rmdir(d)
                except OSError:
                    break
        if problems:
            raise CheckpointError(problems[0])

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any],
        metadata: dict[str, Any],
    ) -> str:
        """Write ``<dir>/step_<step:08d>`` atomically and return its path (call on every rank).

        ``extra`` maps names to Stateful objects (LR scheduler, data loader position ...) or plain
        values; ``metadata`` is a JSON-able dict (the run config ...) stored as meta.json together
        with the step, world size and torch version.
        """
        if self.cfg.dir is None:
            raise CheckpointError("Checkpointer.save called with checkpoint.dir unset: set --checkpoint.dir=...")
        meta = dict(metadata)
        meta.update(step=step, world_size=self.world_size, torch_version=torch.__version__)
        try:
            meta_bytes = json.dumps(meta, indent=2, sort_keys=True).encode()
        except TypeError as e:
            raise CheckpointError(f"checkpoint metadata for step {step} is not JSON-able: {e}") from None

        root = os.path.abspath(self.cfg.dir)
        name = step_name(step)
        final = os.path.join(root, name)
        nonce = self._broadcast(uuid.uuid4().hex[:12])
        tmp = os.path.join(root, f".{name}.tmp-{nonce}")
        estimated = self.estimate_bytes(model, optimizer)  # for the message of a save the disk cannot hold
        # Each stage's outcome is agreed over ranks (that is also the barrier between stages): a full
        # disk on one rank fails the save on all, removes the partial save and keeps older checkpoints.
        failure = None
        try:
            os.makedirs(tmp, exist_ok=True)
        except OSError as e:
            failure = e
        self._save_stage_done(step, root, tmp, failure, estimated)

        model = as_one_module(model)
        state = self._state(model, optimizer, extra)
        failure = None
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(
                    state,
                    storage_writer=dcp.FileSystemWriter(tmp, sync_files=True, overwrite=False),
                    no_dist=not self.distributed,
                )
            write_durable(os.path.join(tmp, f"rng_rank{self.rank}.pt"), _bytes_of(_rng_state()))
            if self.rank == 0:
                write_durable(os.path.join(tmp, META), meta_bytes)
        except (Exception, dcp.api.CheckpointException) as e:  # DCP wraps the OSError of a failed write
            failure = e
        self._save_stage_done(step, root, tmp, failure, estimated)  # every rank's files exist before they are hashed

        names = sorted(n for n in os.listdir(tmp) if n != MANIFEST)
        files = self._hash_files(tmp, names)
        failure = None
        if self.rank == 0:
            try:
                write_manifest(tmp, step, self.world_size, files)
                publish_dir(tmp, final, nonce)
            except OSError as e:
                failure = e
        self._save_stage_done(step, root, tmp, failure, estimated)
        if self.rank == 0:
            self._prune(root)
        self._barrier()
        return final

    def _save_stage_done(self, step: int, root: str, tmp: str, failure: BaseException | None,
                         estimated_bytes: int) -> None:
        """Agree on a save stage over ranks; if any rank failed, remove ``tmp`` and raise on every rank.

        A failed write (an OSError, or the RuntimeError torch's zip writer raises on a short write, as
        on a full disk) raises a CheckpointError naming the failure, ``root``, its free space now, the
        checkpoint's size (``estimated_bytes``, rank 0's) and what to do, chained from this rank's
        original exception; any other failure (a bug rather than the disk) is raised as it was."""
        cause = None if failure is None else dcp_cause(failure)
        written = None if cause is None else failed_write(cause, tmp)
        mine = None
        if cause is not None:
            mine = written or f"{type(cause).__name__}: {cause}"
        problems = [p for p in self._all_gather(mine) if p]
        if not problems:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        # Measured once the partial save is gone: the room a retry has. The broadcast is also the
        # barrier that keeps other ranks from looking at ``root`` before the removal.
        free, estimated_bytes = self._broadcast((free_bytes(root) if self.rank == 0 else None, estimated_bytes))
        if cause is not None and written is None:
            raise failure  # a bug rather than the disk: as raised (the partial save is removed)
        complete = self._complete(root, warn=False) if os.path.isdir(root) else []
        kept = f"the previous checkpoint {complete[-1][1]} is kept" if complete else "no earlier checkpoint exists"
        room = "an unknown amount of space" if free is None else gib(free)
        raise CheckpointError(
            f"saving checkpoint step {step} to {root} failed: {problems[0]}; {root} now has {room} free and one "
            f"checkpoint of this run takes about {gib(estimated_bytes)} (parameters + optimizer state); the "
            f"partial save {tmp} was removed and {kept}; free space there, set --checkpoint.dir to a file "
            f"system with room{_keep_last_advice(self.cfg.keep_last)}, then resume"
        ) from cause

    def _state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any]) -> dict[str, Any]:
        """The DCP state dict: ``model``, ``optim`` (if any) and ``extra/<name>``."""
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(model)}
        for key, value in extra.items():
            state[f"extra/{key}"] = value.state_dict() if isinstance(value, Stateful) else _Value(value).state_dict()
        return state

    def _prune(self, root: str) -> None:
        """Delete complete checkpoints beyond ``keep_last`` and leftovers of crashed saves."""
        for entry in os.listdir(root):
            if STALE_DIR_RE.match(entry):
                log.warning("removing %s: left over from an interrupted checkpoint save", os.path.join(root, entry))
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
        if self.cfg.keep_last <= 0:
            return
        complete = self._complete(root, warn=False)
        for _, path in complete[: -self.cfg.keep_last]:
            # Rename first: a crash mid-delete must not leave a step_* dir with a manifest but
            # missing data (latest() would pick it and the resume would fail).
            doomed = os.path.join(root, f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:12]}")
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    # ---- finding ----------------------------------------------------------------------------
    def _complete(self, root: str, warn: bool = True) -> list[tuple[int, str]]:
        """(step, path) of complete checkpoints in ``root``, oldest first."""
        if not os.path.isdir(root):
            return []
        out = []
        for entry in os.listdir(root):
            path = os.path.join(root, entry)
            m = STEP_DIR_RE.match(entry)
            if m and os.path.isdir(path):
                if is_complete(path):
                    out.append((int(m.group(1)), path))
                elif warn and self.rank == 0:
                    log.warning("ignoring %s: it has no %s (an interrupted or damaged save)", path, MANIFEST)
            elif warn and STALE_DIR_RE.match(entry) and self.rank == 0:
                log.warning("ignoring %s: an interrupted checkpoint save", path)
        return sorted(out)

    def latest(self, root: str | None = None) -> str | None:
        """Path of the newest complete checkpoint in ``root`` (default ``cfg.dir``), or None."""
        root = root if root is not None else self.cfg.dir
        if root is None:
            return None
        complete = self._complete(os.path.abspath(root))
        return complete[-1][1] if complete else None

    def resolve(self, resume: str | bool) -> str | None:
        """The checkpoint to resume from for ``--resume``.

        ``True`` (or ``"latest"``) means the newest complete checkpoint in ``cfg.dir``; a string is a
        checkpoint dir, or a dir of checkpoints (its newest is taken); ``False`` returns None.
        Raises CheckpointError when nothing can be resumed from: never starts fresh silently.
        """
        if resume is False or resume is None:
            return None
        if resume is True or resume == "latest":
            if self.cfg.dir is None:
                raise CheckpointError(
                    "--resume was given but --checkpoint.dir is not set; set --checkpoint.dir=<dir of "
                    "checkpoints> or pass --resume=<checkpoint path>"
                )
            path = self.latest()
            if path is None:
                raise CheckpointError(
                    f"--resume was given but {self.cfg.dir} holds no complete checkpoint; run without "
                    "--resume to start fresh, or point --checkpoint.dir at the directory that holds the "
                    "run's step_XXXXXXXX checkpoints (or pass --resume=<checkpoint path>)"
                )
            return path
        path = os.path.abspath(os.fspath(resume))
        if not os.path.isdir(path):
            raise CheckpointError(f"--resume={resume}: no such directory; pass a step_XXXXXXXX checkpoint dir")
        if STEP_DIR_RE.match(os.path.basename(path)) or os.path.exists(os.path.join(path, MANIFEST)):
            return path  # load() verifies it and fails loudly if it is incomplete
        latest = self.latest(path)
        if latest is None:
            raise CheckpointError(
                f"--resume was given but {path} holds no complete checkpoint; run without --resume to "
                "start fresh, or pass a step_XXXXXXXX checkpoint dir"
            )
        return latest

    # ---- loading ----------------------------------------------------------------------------
    def verify(self, path: str) -> dict[str, Any]:
        """Check ``path``'s manifest (every file's size and sha256) and return its metadata.

        Raises CheckpointError naming the checkpoint and the bad file. Every rank calls it; the
        hashing is split over ranks and the verdict is shared.
        """
        path = os.path.abspath(path)
        problem = None
        manifest: dict[str, Any] = {}
        if self.rank == 0:
            problem, manifest = read_manifest(path)
        problem, manifest = self._broadcast((problem, manifest))
        if problem is None:
            names = sorted(manifest["files"])
            mine = []
            for i, name in enumerate(names):
                if i % self.world_size != self.rank:
                    continue
                want = manifest["files"][name]
                file = os.path.join(path, name)
                if not os.path.isfile(file):
                    mine.append(f"{name} is missing")
                elif os.path.getsize(file) != want["size"]:
                    mine.append(f"{name} has {os.path.getsize(file)} bytes, the manifest says {want['size']}")
                elif sha256_file(file) != want["sha256"]:
                    mine.append(f"{name} does not match its sha256 in the manifest (corrupted)")
            bad = sorted(p for part in self._all_gather(mine) for p in part)
            if bad:
                problem = "; ".join(bad)
        if problem is not None:
            raise _invalid(path, problem)
        return self.read_metadata(path)

    def read_metadata(self, path: str) -> dict[str, Any]:
        """The meta.json of checkpoint ``path`` (run config, step ...), without checking checksums.

        Raises CheckpointError when ``path`` is not a complete checkpoint or meta.json is unreadable.
        """
        path = os.path.abspath(path)
        problem, _ = read_manifest(path)
        if problem is None:
            try:
                with open(os.path.join(path, META), encoding="utf-8") as f:
                    meta = json.load(f)
                if not isinstance(meta, dict):
                    raise ValueError("not a JSON object")
                return meta
            except (OSError, ValueError) as e:
                problem = f"{META} cannot be read: {e}"
        raise _invalid(path, problem)

    def load(
        self,
        path: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any],
        model_only: bool = False,
    ) -> dict[str, Any]:
        """Verify ``path``, load it into ``model``, ``optimizer`` and ``extra``; return its metadata.

        ``model_only``: load just the weights (a converted or upcycled checkpoint that starts a new
        run): pass optimizer=None and extra={}; RNG states are left alone.

        Stateful extras are restored with ``load_state_dict``; plain values are replaced in the
        ``extra`` dict. This rank's RNG states are restored when the checkpoint has a file for it.
        Raises CheckpointError (never falls back to another checkpoint or a fresh start).
        """
        path = os.path.abspath(path)
        meta = self.verify(path)
        model = as_one_module(model)
        state = self._state(model, optimizer, extra)
        reader = SafeFileSystemReader(path)  # nothing in the checkpoint is unpickled unrestricted
        # Pipeline stages hold different parameters: a stored key is unexpected only if no rank wants it.
        wanted_anywhere = set().union(*self._all_gather(sorted(_flat_keys(state))))
        self._check_keys(path, reader, state, wanted_anywhere)
        try:
            load_dcp(state, reader, no_dist=not self.distributed)
        except (Exception, dcp.api.CheckpointException) as e:  # CheckpointException is a BaseException
            # DCP fails on every rank together: say which file a rank refused, if one did.
            refused = [r for r in self._all_gather(None if reader.refused is None else str(reader.refused)) if r]
            if refused:
                raise CheckpointError(refused[0]) from None
            raise CheckpointError(
                f"checkpoint {path} does not fit this model/optimizer/extras: {e}; load a checkpoint "
                "saved by the same model configuration"
            ) from e
        try:
            if optimizer is not None:
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            else:
                set_model_state_dict(model, state["model"])
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}: applying its state failed: {e}") from e
        for key, value in extra.items():
            loaded = state[f"extra/{key}"]
            if isinstance(value, Stateful):
                value.load_state_dict(loaded)
            else:
                extra[key] = loaded["value"]

        rng_file = os.path.join(path, f"rng_rank{self.rank}.pt")
        if model_only:
            return meta
        problem = None
        if os.path.isfile(rng_file):
            try:
                _set_rng_state(load_plain(rng_file))
            except CheckpointError as e:
                problem = str(e)
            except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
                problem = f"{rng_file} does not hold RNG states ({type(e).__name__}: {e})"
        else:
            log.warning(
                "%s has no RNG state for rank %d (saved with world size %s, now %d): this rank keeps "
                "fresh RNG state, so random draws will differ from an uninterrupted run",
                path, self.rank, meta.get("world_size"), self.world_size,
            )
        problems = [p for p in self._all_gather(problem) if p]  # every rank fails, or none
        if problems:
            raise _invalid(path, problems[0])
        return meta

    @staticmethod
    def _check_keys(path: str, reader: SafeFileSystemReader, state: dict[str, Any],
                    wanted_anywhere: set[str] | None = None) -> None:
        """Raise CheckpointError naming keys or shapes that differ between ``path`` and ``state``."""
        stored = reader.read_metadata().state_dict_metadata
        wanted = _flat_keys(state)
        # DCP also flattens lists holding tensors ("a.0"): a key counts as present if it or a child is.
        stored_prefixes = {k.rsplit(".", i)[0] for k in stored for i in range(k.count(".") + 1)}
        missing = sorted(k for k in wanted if k not in stored and k not in stored_prefixes)
        # A checkpoint with model weights the model lacks would load "fine" and drop them silently.
        wanted_anywhere = set(wanted) if wanted_anywhere is None else wanted_anywhere | set(wanted)
        unexpected = sorted(k for k in stored if k.startswith("model.") and k not in wanted_anywhere)
        shapes = sorted(
            f"{k} (checkpoint {tuple(stored[k].size)}, now {tuple(v.shape)})"
            for k, v in wanted.items()
            if k in stored and isinstance(v, torch.Tensor) and hasattr(stored[k], "size")
            and tuple(stored[k].size) != tuple(v.shape)
        )
        # DCP casts a stored tensor to the loading one's dtype: right between float widths (fp32 moments into
        # bf16 ones), meaningless for codes (8-bit moments' uint8 / E4M3 codes and their scales, integers)
        dtypes = sorted(
            f"{k} (checkpoint {stored[k].properties.dtype}, now {v.dtype})"
            for k, v in wanted.items()
            if k in stored and isinstance(v, torch.Tensor) and hasattr(stored[k], "properties")
            and _cast_changes_meaning(stored[k].properties.dtype, v.dtype)
        )
        problems = []
        if missing:
            problems.append(f"keys missing from the checkpoint: {_few(missing)}")
        if unexpected:
            problems.append(f"keys in the checkpoint that the model lacks: {_few(unexpected)}")
        if shapes:
            problems.append(f"shape mismatches: {_few(shapes)}")
        if dtypes:
            problems.append(f"dtype mismatches that a cast would not convert (codes saved under another "
                            f"optimizer.state_dtype?): {_few(dtypes)}")
        if problems:
            raise CheckpointError(
                f"checkpoint {path} does not match the model/optimizer/extras being loaded: "
                + "; ".join(problems)
                + "; load a checkpoint saved by the same model configuration (or convert it)"
            )


def _cast_changes_meaning(stored: torch.dtype, now: torch.dtype) -> bool:
    """Whether loading a tensor stored as ``stored`` into one of ``now`` (DCP casts) would not keep its values:
    they differ and either is not a float of 16 bits or more (integers, bools, 8-bit codes)."""
    def wide_float(d: torch.dtype) -> bool:
        return d.is_floating_point and d.itemsize >= 2

    return stored != now and not (wide_float(stored) and wide_float(now))


def _invalid(path: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is invalid: {problem}; delete or move {path} aside (it is damaged or "
        "incomplete) and resume from an older checkpoint by passing its path explicitly"
    )


def _keep_last_advice(keep_last: int) -> str:
    """The ``--checkpoint.keep_last`` part of a full disk's fix: a save needs room for one checkpoint
    more than are kept (older ones are pruned only after it is complete)."""
    if keep_last == 0:
        return ", or set --checkpoint.keep_last=N (now 0: every checkpoint is kept)"
    if keep_last == 1:
        return ""  # one kept plus the one being saved: the least there is
    return (f", or lower --checkpoint.keep_last (now {keep_last}: a save needs room for {keep_last + 1} "
            "checkpoints)")


def _few(items: list[str], n: int = 8) -> str:
    more = f" ... and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def _bytes_of(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
