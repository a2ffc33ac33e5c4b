"""What the tools' command lines share: the clean exit on bad input, the benchmark JSON report, reading
JSON lines.

tools/ is a folder of scripts, not a package: a script imports this as ``cli`` (its own folder is
first on sys.path; tests/conftest.py puts tools/ there for the tests).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Callable

from moetron.core.checkpoint import CheckpointError
from moetron.core.config import ConfigError
from moetron.data.tokenizer import DataError

# Bad input: the message says what to change, so it is printed without a traceback.
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CheckpointError, DataError)


def run_cli(main: Callable[[], int], errors: tuple[type[Exception], ...] = USER_ERRORS) -> None:
    """``sys.exit(main())``; one of ``errors`` prints ``error: <message>`` on stderr and exits 2."""
    try:
        sys.exit(main())
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def kernel_device(tiny: bool, tool: str):
    """The device a kernel benchmark runs on: the GPU, or with ``--tiny`` and no GPU the CPU with
    the Triton kernels interpreted (TRITON_INTERPRET=1 is set here, before anything imports triton:
    this module does not). None, after saying so, when there is neither."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if tiny:
        os.environ["TRITON_INTERPRET"] = "1"
        return torch.device("cpu")
    print(f"{tool}: needs a GPU (or --tiny, which runs on the CPU)", file=sys.stderr)
    return None


def split_variant(spec: str) -> tuple[str, list[str]]:
    """'name:a.b=1,c.d=[x,y]' -> ('name', ['--a.b=1', '--c.d=[x,y]']): commas split only before a key."""
    name, sep, body = spec.partition(":")
    if not sep or not name:
        raise ConfigError(f"variant {spec!r} should read NAME:key=value[,key=value...]")
    parts = [p for p in re.split(r",(?=-*[A-Za-z_][\w.]*=)", body) if p]
    return name, ["--" + p.lstrip("-") for p in parts]


def read_jsonl(path: str) -> list[dict]:
    """The JSON objects of a JSON-lines file (a run's metrics.jsonl, a peer benchmark's events), in order;
    a line that is not one (a torn last line of a killed run, a stray print) is skipped. OSError as open's."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def write_report(path: str, env: dict, rows: list[dict]) -> None:
    """Write a benchmark's ``{"env": env, "rows": rows}`` to ``path`` (folders made as needed); '' writes nothing."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


def timed_ms(fn: Callable[[], object], device, calls: int = 1) -> float:
    """Milliseconds for ``calls`` back-to-back fn() calls, waited for at their end: CUDA events on a GPU (the
    queued kernels' time, the host's hidden behind them), the wall clock elsewhere. One sample of ``median_ms``;
    tools/bench_gemm_clock.py times its windows with it."""
    import time

    import torch

    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn: Callable[[], object], device, warmup: int = 5, iters: int = 20, loop: int = 1) -> float:
    """Median milliseconds of one fn() call over ``iters`` samples after ``warmup`` calls: CUDA events
    on a GPU, the wall clock elsewhere. The benchmarks' one per-call timer.

    A sample is ``loop`` back-to-back calls, waited for at its end, divided by ``loop``. With
    ``loop=1`` each call is waited for, so its host time (a launch, a compiled function's guards)
    counts as well: a few to tens of microseconds, which matters for kernels under a millisecond or
    two and between callables whose host paths differ. A larger ``loop`` queues the kernels behind
    each other and leaves the GPU time (as long as a call's host time is below its kernels')."""
    import torch

    if loop < 1:
        raise ValueError(f"median_ms: loop must be at least 1, got {loop}")
    for _ in range(warmup):
        fn()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    times = sorted(timed_ms(fn, device, loop) / loop for _ in range(iters))
    return times[len(times) // 2] if len(times) % 2 else 0.5 * (times[len(times) // 2 - 1] + times[len(times) // 2])
