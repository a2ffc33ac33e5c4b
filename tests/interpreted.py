"""Running a check under TRITON_INTERPRET=1: triton reads it when a kernel is defined, so the check
runs in a new Python process (tests/processes.py's run_python, served by its TRITON_INTERPRET=1
server; the one helper every kernel test shares)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.processes import run_python
from tests.reporting import ROOT, ended_early, report_line, run_reporting


def skip_unless_interpreter_works() -> None:
    """Skip when triton is missing, or when its interpreter cannot run here: triton 3.6's (the one
    torch 2.11 brings) converts a kernel's scalar arguments with int() on 1-element numpy arrays,
    which numpy >= 2.3 refuses ("only 0-dimensional arrays can be converted to Python scalars").
    Compiled kernels on a GPU are not affected."""
    triton = pytest.importorskip("triton")
    import numpy

    def version(v: str) -> tuple[int, int]:
        major, minor = v.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)

    if version(triton.__version__) < (3, 7) and version(numpy.__version__) >= (2, 3):
        pytest.skip(f"triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__}: "
                    f"install numpy<2.3 or a newer triton to run the interpreted kernel tests")


_BATCHES: dict[str, dict[str, list]] = {}  # module -> call -> [passed, output], in this pytest process


def run_interpreted(module: str, call: str, timeout: int = 600) -> None:
    """Import ``module`` (e.g. "tests.core.test_mx") in a subprocess with TRITON_INTERPRET=1 and
    evaluate ``call`` there (e.g. "check('cpu')"); a failure there fails the calling test with the
    subprocess's output. Skips where the interpreter cannot run (skip_unless_interpreter_works).

    A module that lists its calls in ``INTERPRETED`` (a tuple of the exact strings) has them all run
    in one subprocess, the first time one of them is asked for, each in its own try (a failure is
    the failing call's alone): one process, and one import of the module and its kernels, instead of
    one a call. Each test still checks its own call's result."""
    skip_unless_interpreter_works()
    batch = tuple(getattr(sys.modules.get(module), "INTERPRETED", ()))
    if call not in batch:
        name = call.split("(")[0]
        code = f"import sys; sys.path.insert(0, {ROOT!r}); from {module} import {name}; {call}"
        proc = run_python(["-c", code], env=dict(os.environ, TRITON_INTERPRET="1"), timeout=timeout, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return
    if module not in _BATCHES:
        _BATCHES[module] = _run_batch(module, batch, timeout * len(batch))
    passed, output = _BATCHES[module][call]
    assert passed, output


def _run_batch(module: str, calls: tuple[str, ...], timeout: int) -> dict[str, list]:
    """Every call of ``calls`` evaluated in ``module``'s namespace in one interpreted subprocess:
    call -> [passed, its traceback or the subprocess's output]."""
    code = "\n".join([
        "import importlib, sys, traceback",
        f"sys.path.insert(0, {ROOT!r})",
        f"namespace = vars(importlib.import_module({module!r}))",
        "results = {}",
        f"for call in {list(calls)!r}:",
        "    try:",
        "        eval(call, namespace)",
        "        results[call] = [True, '']",
        "    except Exception:",
        "        results[call] = [False, traceback.format_exc()[-3000:]]",
        report_line("results"),
    ])
    try:
        results, proc = run_reporting(code, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {c: [False, f"the interpreted batch of {module} ran past {timeout} s"] for c in calls}
    if results is None:
        return {c: [False, f"the interpreted batch of {module}: {ended_early(proc)}"] for c in calls}
    return results


def tiny_model_step(device: str, override: str):
    """One forward and backward of the tiny-moe preset at 2 layers with ``override`` (e.g.
    "triton_rope=true"), from seed 0 and a fixed batch: (model, loss, {name: gradient}), what a kernel's
    whole-model check compares with the switch on and off."""
    from moetron.models import ModelConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", override])
    torch.manual_seed(0)
    model = cfg.build(device=device)
    batch = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1)).to(device)
    loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}
