"""Running a check under TRITON_INTERPRET=1: the variable must be set before triton is imported, so
the check runs in a fresh Python process (the one helper every kernel test shares)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def run_interpreted(module: str, call: str, timeout: int = 600) -> None:
    """Import ``module`` (e.g. "tests.core.test_mx") in a subprocess with TRITON_INTERPRET=1 and
    evaluate ``call`` there (e.g. "check('cpu')"); a failure there fails the calling test with the
    subprocess's output. Skips where the interpreter cannot run (skip_unless_interpreter_works)."""
    skip_unless_interpreter_works()
    name = call.split("(")[0]
    code = f"import sys; sys.path.insert(0, {ROOT!r}); from {module} import {name}; {call}"
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
