"""Process-group set-up from torchrun / SLURM environment variables, rank helpers, and the
watchdog that ends a rank whose training step hangs."""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from .config import ConfigError


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's or SLURM's variables; (0, 1, 0) if neither."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ.get("RANK", 0)), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if "SLURM_NTASKS" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), int(os.environ.get("SLURM_LOCALID", 0))
    return 0, 1, 0


def pick_device(requested: str = "auto") -> torch.device:
    """'auto' takes this rank's GPU when CUDA is present, else the CPU."""
    _, _, local_rank = env_world()
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ConfigError(f"trainer.device={requested!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"trainer.device={requested!r}: moetron trains on auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.device={requested!r} was asked for but CUDA is not available here "
                              f"(no GPU visible to torch): use --trainer.device=cpu or auto")
        device = torch.device("cuda", local_rank if device.index is None else device.index)
        torch.cuda.set_device(device)
    return device


def init_distributed(device: torch.device, timeout_s: float = 1800.0, cpu_collectives: bool = False) -> tuple[int, int]:
    """Join the process group when launched with several ranks; returns (rank, world_size).
    ``timeout_s``: how long a collective waits for the other ranks (trainer.collective_timeout_s);
    ``cpu_collectives``: on GPUs also give the group gloo for CPU tensors (parallel.fsdp_offload keeps
    gradients on the CPU, and the grad norm is all-reduced there)."""
    rank, world, _ = env_world()
    # Under a launcher (torchrun / SLURM) join a group even with one rank, so that strategies that
    # need a mesh (FSDP2, the EP dispatcher) run their real single-GPU path.
    launched = "WORLD_SIZE" in os.environ or "SLURM_NTASKS" in os.environ
    if (world > 1 or launched) and not dist.is_initialized():
        backend = ("cuda:nccl,cpu:gloo" if cpu_collectives else "nccl") if device.type == "cuda" else "gloo"
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        # device_id binds the rank's GPU to the group (NCCL creates its communicator eagerly, and
        # barriers need not guess the device).
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return rank, world


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def finish_distributed() -> None:
    """End a distributed run's process once its work is done: a barrier, destroy_process_group, then
    the process exits with status 0 **without the interpreter's finalization** (os._exit, after
    flushing stdio and logging). Objects that still hold the destroyed process groups (device meshes,
    DTensors) would otherwise be torn down there, and gloo's C++ worker threads can then end a run
    that succeeded with std::terminate (SIGABRT, "terminate called without an active exception",
    no Python frame: seen in about one of four full CPU suite runs, tests/tools/test_launch.py;
    pytorch/pytorch#179291 describes the teardown). Call it only when everything the run writes is
    closed. A process that never initialized torch.distributed returns normally."""
    if not dist.is_initialized():
        return
    barrier()
    dist.destroy_process_group()
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class StepWatchdog:
    """A daemon thread that ends the process when no training step completes for ``timeout_s``.

    A rank that hangs (or waits on a peer that hung or died) would otherwise block until the
    collective timeout, or for ever in a kernel; the watchdog writes ``rank R stuck at step S``
    to stderr and exits with status 1, so the launcher (torchrun, srun) stops the job.
    The trainer calls :meth:`beat` after every step (its evaluation and save included).
    """

    EXIT_CODE = 1

    def __init__(self, timeout_s: float, step: int = 0):
        self.timeout_s = timeout_s
        self.step = step
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="moetron-step-watchdog", daemon=True)

    def start(self) -> None:
        self._last = time.monotonic()
        self._thread.start()

    def beat(self, step: int) -> None:
        """Step ``step`` is done (a plain store each: no lock, no sync)."""
        self.step, self._last = step, time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        period = min(5.0, self.timeout_s / 4)
        while not self._done.wait(period):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                rank = dist.get_rank() if dist.is_initialized() else 0
                sys.stderr.write(
                    f"rank {rank} stuck at step {self.step + 1}: no training step completed for {idle:.0f}s "
                    f"(trainer.collective_timeout_s={self.timeout_s:g}); a rank hung or died: exiting\n"
                )
                sys.stderr.flush()
                os._exit(self.EXIT_CODE)  # the main thread may be blocked in a collective for good
