"""Process-group set-up from torchrun / SLURM environment variables, and rank helpers."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


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
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was asked for but CUDA is not available: use --trainer.device=cpu")
        device = torch.device("cuda", local_rank if device.index is None else device.index)
        torch.cuda.set_device(device)
    return device


def init_distributed(device: torch.device, timeout_s: int = 1800) -> tuple[int, int]:
    """Join the process group when launched with several ranks; returns (rank, world_size)."""
    rank, world, _ = env_world()
    # Under a launcher (torchrun / SLURM) join a group even with one rank, so that strategies that
    # need a mesh (FSDP2, the EP dispatcher) run their real single-GPU path.
    launched = "WORLD_SIZE" in os.environ or "SLURM_NTASKS" in os.environ
    if (world > 1 or launched) and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
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
