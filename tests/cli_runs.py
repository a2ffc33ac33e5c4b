"""Several command lines of the tools/ scripts run in one fresh Python process, each exactly as
``python SCRIPT ARGS`` would run it (its ``__main__`` block, through runpy), with its own stdout,
stderr and exit status: one process (tests/processes.py's run_python, forked warm) for all of them,
for the command lines that fail fast (bad input), where the process's start is most of the time."""

from __future__ import annotations

import json
import os

from tests.reporting import ROOT, ended_early, report_line, run_reporting

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
{report_line("results")}
"""


def run_in_one_process(cases: list[tuple[str, list[str]]], env: dict | None = None,
                       timeout: float = 600) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each (script under tools/, e.g. "pretrain.py"; its arguments),
    run in order in one subprocess started in the repo root with ``env`` (default: this process's)."""
    payload = json.dumps([[os.path.join(ROOT, "tools", script), list(argv)] for script, argv in cases])
    results, proc = run_reporting(_CODE, payload, env=env, timeout=timeout)
    assert results is not None, ended_early(proc)
    return [tuple(r) for r in results]
