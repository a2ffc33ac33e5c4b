"""What the tools' command lines share: the clean exit on bad input, the benchmark JSON report.

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


def split_variant(spec: str) -> tuple[str, list[str]]:
    """'name:a.b=1,c.d=[x,y]' -> ('name', ['--a.b=1', '--c.d=[x,y]']): commas split only before a key."""
    name, sep, body = spec.partition(":")
    if not sep or not name:
        raise ConfigError(f"variant {spec!r} should read NAME:key=value[,key=value...]")
    parts = [p for p in re.split(r",(?=-*[A-Za-z_][\w.]*=)", body) if p]
    return name, ["--" + p.lstrip("-") for p in parts]


def write_report(path: str, env: dict, rows: list[dict]) -> None:
    """Write a benchmark's ``{"env": env, "rows": rows}`` to ``path`` (folders made as needed); '' writes nothing."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
