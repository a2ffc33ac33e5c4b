"""Run a test function on several processes joined by a process group: CPU with gloo, or one GPU
per rank with NCCL (``backend="nccl"``: rank r uses cuda:r).

    from tests.distributed import run_distributed

    def _check(rank, world_size, tmp_path):   # module level: it is pickled into the children
        ...

    def test_something(tmp_path):
        run_distributed(_check, 2, str(tmp_path))

A failure in any child re-raises in the caller with the child's traceback in the message.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "free_port"]


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple, backend: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    if backend == "nccl":
        # NVLink multicast stays off (shared hosts); NCCL reads these when it makes communicators.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # Let every rank finish its collectives (and free DDP reducers) before the group goes:
        # tearing gloo down under a peer still in a collective aborts the process.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float | None = 120,
                    backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes (gloo, or NCCL on GPUs).

    ``fn`` and ``args`` must be picklable (define ``fn`` at module level). Raises RuntimeError
    carrying the failing child's traceback; a child that hangs longer than ``timeout_s`` makes the
    call fail instead of blocking the test session.
    """
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"run_distributed: NCCL with {world_size} ranks needs {world_size} GPUs, "
                           f"{torch.cuda.device_count()} visible")
    port = free_port()
    ctx = mp.start_processes(_child, args=(fn, world_size, port, args, backend), nprocs=world_size, join=False,
                             start_method="spawn")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"run_distributed: {fn.__name__} did not finish within {timeout_s}s")
    except mp.ProcessRaisedException as e:
        raise RuntimeError(f"{fn.__name__} failed on rank {e.error_index}:\n{e}") from None
    except mp.ProcessExitedException as e:
        raise RuntimeError(f"{fn.__name__}: rank {e.error_index} exited with code {e.exit_code}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
