#!/usr/bin/env python
"""Collective bandwidth under torchrun, measured the way nccl-tests measures it.

For each collective and message size: allocate the buffers, check the collective's result once on
deterministic rank-dependent data (a wrong result stops the run), run --warmup iterations, then
time --iters back-to-back iterations (on GPU: CUDA events around the loop, one synchronize at the
end; on CPU/gloo: perf_counter around the blocking calls). Reported per row:

    time   microseconds per call, the slowest rank's (all_reduce MAX; nccl-tests' ``-a 3``)
    algbw  size / time, in GB/s (1 GB = 1e9 bytes)
    busbw  algbw x the collective's bus factor, comparable with the link's peak bandwidth:
           all_reduce 2(n-1)/n; all_to_all, reduce_scatter, all_gather (n-1)/n (n = world size).
           With one rank the factor is 0, so busbw is 0: nothing crosses a link.

    torchrun --nproc-per-node 8 tools/bench_comm.py --sizes 1Mi 16Mi 64Mi 256Mi 1Gi --iters 20 --warmup 5

Size convention (nccl-tests'): --sizes is the per-rank buffer in bytes (core.config.parse_size:
K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti powers of 1024, B optional; the default sizes are binary,
1MiB to 1GiB), and for every collective it is the *full* buffer, the largest one a rank holds:
    all_to_all_single       input and output each `size` (n even chunks of size/n, one per peer);
    all_reduce              the buffer, reduced in place;
    reduce_scatter_tensor   the input (`size`); each rank's output is size/n;
    all_gather_into_tensor  the output (`size`); each rank's input is size/n.
So all_to_all, reduce_scatter and all_gather need a size divisible by n x element size.

Expert parallelism's token exchange is all_to_all_single (with uneven splits in training; even
here). --device picks cuda (NCCL, one GPU per LOCAL_RANK) or cpu (gloo); auto takes CUDA when
present. Run without torchrun it joins a one-rank group and still runs every collective.

NVLink multicast (NVLS / symmetric-memory multicast) is kept off unless the environment says
otherwise.
"""

from __future__ import annotations

import os

# Before any process group exists: NCCL reads these when it creates communicators.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moetron.core.config import SIZE_UNITS, ConfigError, StrEnum, parse_size  # noqa: E402
from moetron.core.distributed import env_world, finish_distributed, init_distributed, is_main, pick_device  # noqa: E402
from moetron.core.metrics import run_environment  # noqa: E402

from cli import write_report  # noqa: E402  (tools/cli.py)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single (same arguments, the
# old names warn); setup.py allows torch 2.11, which has only the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveMismatch(RuntimeError):
    """A collective returned the wrong values: the interconnect or the library is broken."""


class Op(StrEnum):
    all_to_all = "all_to_all"
    """dist.all_to_all_single with even splits (expert parallelism's token exchange)."""
    all_reduce = "all_reduce"
    """dist.all_reduce, SUM, in place."""
    reduce_scatter = "reduce_scatter"
    """dist.reduce_scatter_tensor (reduce_scatter_single from torch 2.13), SUM."""
    all_gather = "all_gather"
    """dist.all_gather_into_tensor (all_gather_single from torch 2.13)."""


# ---------------------------------------------------------------------------------------------
# The collectives: buffers with a checkable pattern, the call, the expected result, the bus factor
# ---------------------------------------------------------------------------------------------
# Patterns are small integers (below 256), exact in bf16. Data movement (all_to_all, all_gather)
# marks each element with its source rank, chunk and position; reductions add values in 0..3, so
# the sums stay exact in bf16 up to about 160 ranks (a looser check above that, see verify()).


@dataclasses.dataclass
class Buffers:
    input: torch.Tensor
    output: torch.Tensor
    expected: torch.Tensor | None  # what `output` must hold after one call on the pattern in `input`
    run: Callable[[], None]


def _ramp(numel: int, device: torch.device) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.int32, device=device)


def _sum_mod4(x: torch.Tensor, world: int) -> torch.Tensor:
    """sum over r < world of (x + r) % 4, elementwise: 0+1+2+3 per full cycle of four ranks, then the rest."""
    total = torch.full_like(x, 6 * (world // 4))
    for t in range(world % 4):
        total += (x + t) % 4
    return total


def _tag(src: int, chunk: int, world: int, position: torch.Tensor) -> torch.Tensor:
    """The value element `position` of chunk `chunk` sent by rank `src` carries (37 is odd: unique
    mod 256 for up to 256 (src, chunk) pairs)."""
    return (37 * (src * world + chunk) + position) % 256


def make_buffers(op: Op, numel: int, world: int, rank: int, dtype: torch.dtype,
                 device: torch.device) -> Buffers:
    """Buffers for one call of `op` on a full buffer of `numel` elements (see the module docstring)."""
    chunk = numel // world
    if op is Op.all_to_all:
        pos_NC = _ramp(chunk, device).expand(world, chunk)
        dst_N1 = torch.arange(world, dtype=torch.int32, device=device).view(world, 1)
        inp = _tag(rank, dst_N1, world, pos_NC).reshape(-1)           # chunk d goes to rank d
        expected = _tag(dst_N1, rank, world, pos_NC).reshape(-1)      # chunk s came from rank s
        inp, out = inp.to(dtype), torch.empty(numel, dtype=dtype, device=device)
        return Buffers(inp, out, expected.to(dtype), lambda: dist.all_to_all_single(out, inp))
    if op is Op.all_reduce:
        pos = _ramp(numel, device)
        buf = ((pos + rank) % 4).to(dtype)
        return Buffers(buf, buf, _sum_mod4(pos, world).to(dtype), lambda: dist.all_reduce(buf))
    if op is Op.reduce_scatter:
        pos = _ramp(numel, device)
        inp = ((pos + rank + pos // chunk) % 4).to(dtype)             # the chunk index shifts each chunk
        mine = _ramp(chunk, device) + rank * chunk
        expected = _sum_mod4(mine + rank, world)
        out = torch.empty(chunk, dtype=dtype, device=device)
        return Buffers(inp, out, expected.to(dtype), lambda: reduce_scatter_single(out, inp))
    if op is Op.all_gather:
        pos = _ramp(chunk, device)
        inp = _tag(rank, 0, world, pos).to(dtype)
        src_N1 = torch.arange(world, dtype=torch.int32, device=device).view(world, 1)
        expected = _tag(src_N1, 0, world, pos.expand(world, chunk)).reshape(-1)
        out = torch.empty(numel, dtype=dtype, device=device)
        return Buffers(inp, out, expected.to(dtype), lambda: all_gather_single(out, inp))
    raise ConfigError(f"unknown op {op!r}")


def bus_factor(op: Op, world: int) -> float:
    """nccl-tests' factor from algbw to busbw: what each rank's busiest link carries per byte of size."""
    if op is Op.all_reduce:
        return 2 * (world - 1) / world
    return (world - 1) / world


def verify(op: Op, size: int, bufs: Buffers, world: int) -> None:
    """Run the collective once and check every element on every rank; raise on all ranks if any is wrong."""
    bufs.run()
    if world <= 128:
        wrong = bufs.output != bufs.expected
    else:  # sums above 256 round in bf16 in an order only the library knows
        wrong = (bufs.output.float() - bufs.expected.float()).abs() > 2**-7 * bufs.expected.float().abs()
    bad_here = int(wrong.sum().item())
    bad_ranks = torch.tensor([int(bad_here > 0)], device=bufs.output.device)
    dist.all_reduce(bad_ranks)
    if bad_here:
        i = int(wrong.nonzero()[0, 0])
        print(f"rank {dist.get_rank()}: {op} {format_size(size)}: {bad_here} wrong elements, the first at {i}: "
              f"{bufs.output[i].item()} where {bufs.expected[i].item()} was expected", file=sys.stderr, flush=True)
    if bad_ranks.item():
        raise CollectiveMismatch(f"{op} {format_size(size)} returned wrong values on {int(bad_ranks.item())} "
                                 f"of {world} ranks")


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def time_per_call_s(run: Callable[[], None], iters: int, warmup: int, device: torch.device) -> float:
    """Seconds per call on this rank, over `iters` back-to-back calls after `warmup` ones."""
    for _ in range(warmup):
        run()
    # Start together: otherwise a rank's first call also times its wait for the last rank to arrive.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        run()  # gloo calls block until done
    return (time.perf_counter() - t0) / iters


def measure(op: Op, size: int, args, dtype: torch.dtype, device: torch.device, world: int) -> dict:
    numel = size // dtype.itemsize
    bufs = make_buffers(op, numel, world, dist.get_rank(), dtype, device)
    verify(op, size, bufs, world)
    bufs.expected = None  # free it before timing
    # Values do not change the speed; zeros keep the in-place all_reduce from growing to inf.
    bufs.input.zero_()
    mine = time_per_call_s(bufs.run, args.iters, args.warmup, device)
    slowest = torch.tensor([mine], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds = slowest.item()
    del bufs
    algbw = size / seconds / 1e9
    factor = bus_factor(op, world)
    return {"op": str(op), "bytes": size, "size": format_size(size), "count": numel, "dtype": args.dtype,
            "iters": args.iters, "warmup": args.warmup, "time_us": 1e6 * seconds, "algbw_gbps": algbw,
            "bus_factor": factor, "busbw_gbps": algbw * factor, "verified": True}


# ---------------------------------------------------------------------------------------------
# Arguments, environment, table, main
# ---------------------------------------------------------------------------------------------


def format_size(size: int) -> str:
    """The size in the largest unit that divides it exactly, spelled as parse_size reads it:
    1048576 -> '1MiB', 4000 -> '4KB', 4097 -> '4097'."""
    for unit, scale in sorted(SIZE_UNITS.items(), key=lambda item: -item[1]):
        if unit and size % scale == 0:
            return f"{size // scale}{unit}B"
    return str(size)


def parse_ops(values: list[str]) -> list[Op]:
    names = [name for v in values for name in v.split(",") if name]
    valid = ", ".join(op.value for op in Op)
    unknown = [n for n in names if n not in Op._value2member_map_]
    if unknown or not names:
        raise ConfigError(f"--ops {' '.join(unknown) or '(empty)'}: unknown collective; valid ops: {valid}")
    return [Op(n) for n in dict.fromkeys(names)]


def check_sizes(ops: list[Op], sizes: list[int], dtype_name: str, world: int) -> None:
    """Every (op, size) pair must split into whole elements, and into world even chunks where it is chunked."""
    itemsize = DTYPES[dtype_name].itemsize
    for size in sizes:
        for op in ops:
            unit = itemsize if op is Op.all_reduce else itemsize * world
            if size % unit:
                what = f"{itemsize}-byte {dtype_name} elements" if op is Op.all_reduce else \
                    f"world size {world} x {itemsize}-byte {dtype_name} elements = {unit} bytes"
                raise ConfigError(f"--sizes {format_size(size)} ({size} bytes) does not divide for {op}: "
                                  f"it needs a multiple of {what}")


def environment(device: torch.device, world: int, argv: list[str]) -> dict:
    return run_environment(device, world, "tools/bench_comm.py", argv)


def print_table(env: dict, rows: list[dict]) -> None:
    print(f"{env['device']} x {env['world_size']} | {env['backend']}{' ' + env['nccl'] if env['nccl'] else ''} | torch {env['torch']} | "
          f"cuda {env['cuda']} | {rows[0]['dtype']}, {rows[0]['iters']} iters")
    print(f"{'op':<15} {'size':>6} {'time us':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for r in rows:
        print(f"{r['op']:<15} {r['size']:>6} {r['time_us']:>11.1f} {r['algbw_gbps']:>11.2f} {r['busbw_gbps']:>11.2f}")


def join_group(device: torch.device) -> int:
    """Join torchrun's group, or a one-rank group of our own when run without a launcher; returns world size."""
    _, world = init_distributed(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=600))
    return world


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--ops", nargs="+", default=[op.value for op in Op],
                        help=f"collectives to measure, space- or comma-separated: {', '.join(op.value for op in Op)}")
    parser.add_argument("--sizes", nargs="+", default=["1Mi", "16Mi", "64Mi", "256Mi", "1Gi"],
                        help="full per-rank buffer sizes in bytes: K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti "
                             "powers of 1024, B optional (default: 1Mi 16Mi 64Mi 256Mi 1Gi)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per op and size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before the timed ones")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="cuda: NCCL, one GPU per LOCAL_RANK; cpu: gloo; auto: cuda when present")
    parser.add_argument("--json", default="runs/bench/bench_comm.json", help="where to write the rows ('' for nowhere)")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        raise ConfigError("--iters must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but CUDA is not available: use --device cpu")
    ops = parse_ops(args.ops)
    sizes = [parse_size(s, "--sizes") for s in args.sizes]
    dtype = DTYPES[args.dtype]
    # Checked on every rank before any rank joins the group, so bad input fails everywhere alike.
    check_sizes(ops, sizes, args.dtype, env_world()[1])

    device = pick_device(args.device)
    world = join_group(device)
    try:
        env = environment(device, world, argv) if is_main() else None
        if is_main():
            print("topology (nvidia-smi topo -m):")
            print(env["topology"].rstrip() if env["topology"] else "  not available (no nvidia-smi)", flush=True)
        rows = [measure(op, size, args, dtype, device, world) for op in ops for size in sizes]
        if is_main():
            print_table(env, rows)
            write_report(args.json, env, rows)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish_distributed()  # barrier, destroy, exit without the interpreter's teardown (gloo's threads)
    return 0


if __name__ == "__main__":
    # Every rank fails alike (bad input is checked before the group, a mismatch is agreed on): rank 0 says why.
    try:
        sys.exit(main())
    except (ConfigError, CollectiveMismatch) as e:
        if env_world()[0] == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ConfigError) else 1)
