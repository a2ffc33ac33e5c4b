"""Run a test function on several processes joined by a process group: CPU with gloo, or one GPU
per rank with NCCL (``backend="nccl"``: rank r uses cuda:r).

    from tests.distributed import run_distributed

    def _check(rank, world_size, tmp_path):   # module level: it is pickled into the children
        ...

    def test_something(tmp_path):
        run_distributed(_check, 2, str(tmp_path))

A failure in any child re-raises in the caller with the child's traceback in the message.

gloo ranks fork from a server that has imported torch's distributed, DTensor, checkpoint and dynamo
modules once (spawn made every rank import them again: seconds of CPU per rank, most of a tiny
test's time); each rank still gets what a spawned one had: the caller's environment, working
directory, sys.path, stdout and stderr (so capfd and pytest's report see the ranks' output), intra-op
thread count, and fresh random seeds. NCCL ranks are spawned (no CUDA state can cross a fork).
The ranks meet through a FileStore in a fresh directory, not a TCP port: the test suite runs in
several pytest-xdist processes, and a port picked free a moment ago can be taken by then.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import time
from multiprocessing import reduction
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "free_port", "full_gradients", "train_losses", "PRELOAD"]

# What the fork server imports once for every gloo rank (the bulk of a rank's start-up); moetron's own
# modules are left to each rank, so they read the environment the caller set.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
            "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch._dynamo"]


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stdio_fds(out: Any, err: Any) -> tuple[int, int]:
    return out.detach(), err.detach()


class _CallerStdio:
    """Pickles into the caller's fds 1 and 2, passed to the new process (as it starts, under any start method)."""

    def __reduce__(self):
        return _stdio_fds, (reduction.DupFd(1), reduction.DupFd(2))


def _child(rank: int, fn: Callable[..., Any], world_size: int, store_path: str, args: tuple, backend: str,
           caller: tuple[dict, str, list, tuple[int, int], int]) -> None:
    env, cwd, path, (out_fd, err_fd), threads = caller  # what a spawned child has (a forked one has the server's)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in {out_fd, err_fd} - {1, 2}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    torch.seed()  # a forked child would share the server's seeds
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    # The caller's intra-op threads: tests compare fp32 results of the ranks with the caller's own,
    # and the thread count changes the order of a reduction.
    torch.set_num_threads(threads)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    if backend == "nccl":
        # NVLink multicast stays off (shared hosts); NCCL reads these when it makes communicators.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size)
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
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes (gloo, or NCCL on GPUs).

    ``fn`` and ``args`` must be picklable (define ``fn`` at module level). Raises RuntimeError
    carrying the failing child's traceback; a child that hangs longer than ``timeout_s`` makes the
    call fail instead of blocking the test session.
    """
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"run_distributed: NCCL with {world_size} ranks needs {world_size} GPUs, "
                           f"{torch.cuda.device_count()} visible")
    store_dir = tempfile.mkdtemp(prefix="moetron-dist-")
    store_path = os.path.join(store_dir, "store")  # created by the first rank
    start_method = "spawn" if backend == "nccl" else "forkserver"
    if start_method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when it starts
    caller = (dict(os.environ), os.getcwd(), list(sys.path), _CallerStdio(), torch.get_num_threads())
    try:
        ctx = mp.start_processes(_child, args=(fn, world_size, store_path, args, backend, caller), nprocs=world_size,
                                 join=False, start_method=start_method)
    except BaseException:
        shutil.rmtree(store_dir, ignore_errors=True)
        raise
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
        shutil.rmtree(store_dir, ignore_errors=True)


def full_gradients(parts, world: int) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full CPU tensor by name (``_orig_mod.`` dropped), gathered
    from every rank (each pipeline stage holds only its own parameters)."""
    from moetron.core.grad import DTensor

    got = {}
    for part in parts:
        for name, p in part.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                got[name.replace("_orig_mod.", "")] = g.detach().cpu().clone()
    if dist.is_initialized() and world > 1:
        everything = [None] * world
        dist.all_gather_object(everything, got)
        for d in everything:
            got.update(d)
    return got


def train_losses(trainer, steps: int, world: int) -> tuple[list[float], list[float]]:
    """``steps`` optimizer steps; each step's loss averaged over the ranks, and its gradient norm."""
    losses, norms = [], []
    for _ in range(steps):
        loss, norm = trainer.train_step(trainer.data.next_batch())
        norms.append(float(norm))
        if dist.is_initialized() and world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses, norms
