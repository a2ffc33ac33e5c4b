"""Code run in a new Python process (tests/processes.py's run_python) that reports its result as
JSON on one marked line of stdout: how tests/interpreted.py runs a module's interpreted kernel
checks in one process, each reported on its own."""

from __future__ import annotations

import json
import os
import subprocess

from tests.processes import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "@@report@@"


def report_line(value_expr: str) -> str:
    """The statement the code ends with to report ``value_expr`` (a JSON-able expression)."""
    return f"print({MARK!r} + __import__('json').dumps({value_expr}), flush=True)"


def run_reporting(code: str, *args: str, env: dict | None = None,
                  timeout: float = 600) -> tuple[object | None, subprocess.CompletedProcess]:
    """Run ``python -c code args`` in the repo root; (what it reported, or None where it ended
    before reporting, and the completed process). TimeoutExpired propagates."""
    proc = run_python(["-c", code, *args], cwd=ROOT, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):]), proc
    return None, proc


def ended_early(proc: subprocess.CompletedProcess) -> str:
    """What to say of a process that ended before reporting: its exit status and the tails of its output."""
    return f"the process ended (exit {proc.returncode}) before reporting:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
