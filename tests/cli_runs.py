"""Several command lines of the tools/ scripts run in one fresh Python process, each exactly as
``python SCRIPT ARGS`` would run it (its ``__main__`` block, through runpy), with its own stdout,
stderr and exit status: one start of Python and torch (about 7 s on CI's machine) for all of them,
for the command lines that fail fast (bad input), where that start is most of the time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MARK = "@@cli-runs@@"
_CODE = f"""
import contextlib, io, json, os, runpy, sys, traceback
results = []
for script, argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as e:  # sys.exit(None | int | message), as the interpreter maps them
            status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
    results.append([status, out.getvalue(), err.getvalue()])
print({_MARK!r} + json.dumps(results))
"""


def run_in_one_process(cases: list[tuple[str, list[str]]], env: dict | None = None,
                       timeout: float = 600) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each (script under tools/, e.g. "pretrain.py"; its arguments),
    run in order in one subprocess started in the repo root with ``env`` (default: this process's)."""
    payload = json.dumps([[os.path.join(ROOT, "tools", script), list(argv)] for script, argv in cases])
    proc = subprocess.run([sys.executable, "-c", _CODE, payload], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    assert lines, f"the process ended ({proc.returncode}) before reporting:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [tuple(r) for r in json.loads(lines[0][len(_MARK):])]
