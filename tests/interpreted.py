"""Running a check under TRITON_INTERPRET=1: the variable must be set before triton is imported, so
the check runs in a fresh Python process (the one helper every kernel test shares)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(module: str, call: str, timeout: int = 600) -> None:
    """Import ``module`` (e.g. "tests.core.test_mx") in a subprocess with TRITON_INTERPRET=1 and
    evaluate ``call`` there (e.g. "check('cpu')"); a failure there fails the calling test with the
    subprocess's output. Skips when triton is not installed."""
    pytest.importorskip("triton")
    name = call.split("(")[0]
    code = f"import sys; sys.path.insert(0, {ROOT!r}); from {module} import {name}; {call}"
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
