"""Several command lines of the tools/ scripts, each exactly as ``python SCRIPT ARGS`` would run it,
with its own exit status, stdout and stderr (tests/processes.py's run_python: forked warm, so a
command line that fails fast, on bad input, costs a fraction of a second, not a start of torch)."""

from __future__ import annotations

import os

from tests.processes import run_python
from tests.reporting import ROOT


def run_command_lines(cases: list[tuple[str, list[str]]], env: dict | None = None,
                       timeout: float = 600) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each (script under tools/, e.g. "pretrain.py"; its arguments),
    each forked warm, in order, in the repo root with ``env`` (default: this process's)."""
    runs = [run_python([os.path.join(ROOT, "tools", script), *argv], env=env, cwd=ROOT, timeout=timeout)
            for script, argv in cases]
    return [(r.returncode, r.stdout, r.stderr) for r in runs]
