"""``python ...`` as a test runs it, without paying Python's and torch's start each time.

    from tests.processes import run_python

    proc = run_python(["tools/pretrain.py", "--trainer.steps=2"], env=env, cwd=ROOT, timeout=600)
    proc.returncode, proc.stdout, proc.stderr   # as subprocess.run(..., capture_output=True, text=True)

Starting a process that imports torch and its distributed, checkpoint and dynamo modules costs 5-8 s
of CPU on CI's machine before it does anything, and the suite starts about a hundred such
processes: that start was over a third of the suite's CPU time. ``run_python`` forks the process
instead from a server that has imported those modules once (tests/distributed.py's list, which its
gloo ranks preload), then makes the child what a new interpreter would be:

- argv, ``sys.path`` (the script's directory, or the working directory for ``-c`` / ``-m``, then the
  path a new interpreter gets with that environment's PYTHONPATH: nothing of the test process's),
  the environment, the working directory, stdin (``input`` or empty), stdout and stderr (captured);
- intra-op threads from the environment's OMP_NUM_THREADS, fresh random seeds;
- the script or code runs as ``__main__``; the exit status follows the interpreter's rules
  (``sys.exit(message)`` prints it and gives 1, an uncaught exception prints its traceback and gives
  1); non-daemon threads are joined and atexit handlers run before the child exits.

Triton reads TRITON_INTERPRET when a kernel is defined, its own library's included, and the preload
imports triton (dynamo does): so there is one server per TRITON_INTERPRET value, started with it. A
child whose environment leaves it unset comes from the TRITON_INTERPRET=1 server where there is no
GPU: there, the tools set it themselves before they import triton (tools/cli.py's kernel_device),
which a preloaded triton would not see, and a kernel that is not interpreted cannot run anyway.

What stays different from a new interpreter: the preloaded modules are already imported (their
import-time reads of the environment were the server's; moetron's own modules are not preloaded, so
MOETRON_* in ``env`` still apply), and the child's memory starts with the server's pages (a test
that measures a process's peak RSS must not use this). ``fresh=True`` runs a real subprocess, for
the tests where a new interpreter is the point (planted code in a checkpoint, peak memory);
``MOETRON_TEST_FRESH_PROCESSES=1`` makes every call one, to check that nothing in the suite depends
on the warm start.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

__all__ = ["run_python", "FRESH_ENV"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRESH_ENV = "MOETRON_TEST_FRESH_PROCESSES"


# ---- the server (its own process: ``python -c "...; _serve()"``) ------------------------------

def _serve() -> None:
    """Read one request per line on stdin; fork a child for it; answer its pid, then its exit status."""
    import importlib

    from tests.distributed import PRELOAD

    for name in PRELOAD:
        importlib.import_module(name)
    control_in, control_out = sys.stdin.buffer, sys.stdout.buffer
    for line in control_in:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)  # never returns
        control_out.write(json.dumps({"pid": pid}).encode() + b"\n")
        control_out.flush()
        _, status = os.waitpid(pid, 0)
        control_out.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        control_out.flush()


def _exit_status(code) -> int:
    """What the interpreter exits with for ``sys.exit(code)`` (printing a code that is not an int or None)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(request: dict) -> None:
    import io
    import random
    import runpy
    import traceback
    import types

    status = 1
    try:
        for target, (path, mode) in enumerate([(request["stdin"], os.O_RDONLY), (request["stdout"], os.O_WRONLY),
                                               (request["stderr"], os.O_WRONLY)]):
            fd = os.open(path, mode)
            os.dup2(fd, target)
            os.close(fd)
        # The standard streams a new interpreter has on files and pipes: stdout block-buffered,
        # stderr line-buffered with backslashreplace.
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False))
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                                       errors="backslashreplace")
        env, argv, path = request["env"], request["argv"], request["path"]
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it

        import torch

        threads = env.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else os.cpu_count() or 1)
        torch.seed()
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
            del sys.modules[name]  # the server's own helpers: a new interpreter has none of them

        status = 0
        try:
            if argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                sys.path[:] = ["", *path]
                main = types.ModuleType("__main__")
                main.__builtins__ = __builtins__
                sys.modules["__main__"] = main
                exec(compile(argv[1], "<string>", "exec"), vars(main))
            elif argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file
                sys.path[:] = [os.getcwd(), *path]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                script = os.path.abspath(argv[0])
                sys.argv = list(argv)
                sys.path[:] = [os.path.dirname(script), *path]
                runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            status = _exit_status(e.code)
        except BaseException:
            traceback.print_exc()
            status = 1
        threading._shutdown()  # a new interpreter joins the non-daemon threads, then runs atexit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)


# ---- the client (the test process) -------------------------------------------------------------

class _Server:
    def __init__(self, interpret: str | None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if interpret is not None:
            env["TRITON_INTERPRET"] = interpret
        code = f"import sys; sys.path.insert(0, {ROOT!r}); from tests.processes import _serve; _serve()"
        # Unbuffered (bufsize=0): a buffered reader could take the exit-status line in with the pid
        # line, and select() on the pipe would then wait for data already read
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, cwd=ROOT, bufsize=0)
        self.lock = threading.Lock()

    def _answer(self, deadline: float | None) -> dict | None:
        """The server's next answer line, or None when ``deadline`` (time.monotonic()) passes first."""
        out = self.proc.stdout
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([out], [], [], wait)
            if ready:
                line = out.readline()
                if not line:
                    raise RuntimeError(f"tests/processes.py: the fork server ended (exit {self.proc.wait()})")
                return json.loads(line)
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def run(self, request: dict, timeout: float | None) -> tuple[int, bool]:
        """(exit status, whether it ran past ``timeout`` and was killed)."""
        with self.lock:
            data = memoryview(json.dumps(request).encode() + b"\n")
            while data:  # a raw pipe may take part of a long request at a time
                data = data[self.proc.stdin.write(data):]
            pid = self._answer(None)["pid"]
            deadline = None if timeout is None else time.monotonic() + timeout
            answer = self._answer(deadline)
            if answer is not None:
                return answer["status"], False
            try:
                os.kill(pid, signal.SIGKILL)
                killed = True
            except ProcessLookupError:  # it ended just now, on its own: the server has its status
                killed = False
            return self._answer(None)["status"], killed


_SERVERS: dict[str | None, _Server] = {}


@atexit.register
def _stop_servers() -> None:
    for server in _SERVERS.values():
        server.proc.stdin.close()  # the server's loop ends at end of input
        server.proc.wait()


def _server(interpret: str | None) -> _Server:
    server = _SERVERS.get(interpret)
    if server is None or server.proc.poll() is not None:
        server = _SERVERS[interpret] = _Server(interpret)
    return server


@functools.lru_cache(maxsize=None)
def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _fresh_path(pythonpath: str | None) -> tuple[str, ...]:
    """sys.path of a new interpreter run with this PYTHONPATH, less its first entry (the script's
    directory or the working directory, which the child sets itself)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         capture_output=True, text=True, env=env, check=True, cwd=tempfile.gettempdir())
    return tuple(json.loads(out.stdout))


def run_python(argv: Sequence[str], *, env: dict | None = None, cwd: str | None = None,
               timeout: float | None = None, input: str | None = None,
               fresh: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=cwd,
    timeout=timeout, input=input)``, forked from a warm server (module docstring) unless ``fresh``
    or MOETRON_TEST_FRESH_PROCESSES=1. ``argv``: a script and its arguments, ``-c CODE ...`` or
    ``-m MODULE ...``; no interpreter options. A timeout kills the child and raises
    subprocess.TimeoutExpired, as subprocess.run does."""
    argv = [os.fspath(a) for a in argv]
    command = [sys.executable, *argv]
    if fresh or os.environ.get(FRESH_ENV) == "1" or not hasattr(os, "fork"):
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, input=input)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-c", "-m")):
        raise ValueError(f"run_python: {argv[:1]} is not a script, -c or -m; use fresh=True for interpreter options")
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="moetron-run-") as tmp:
        files = {name: os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")}
        with open(files["stdin"], "w") as f:
            f.write(input or "")
        for name in ("stdout", "stderr"):
            open(files[name], "w").close()
        request = {"argv": argv, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()),
                   "path": list(_fresh_path(env.get("PYTHONPATH"))), **files}
        interpret = env.get("TRITON_INTERPRET", None if _has_gpu() else "1")  # see the module docstring
        status, timed_out = _server(interpret).run(request, timeout)
        stdout, stderr = (open(files[name], encoding="utf-8", errors="replace").read() for name in ("stdout", "stderr"))
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, status, stdout, stderr)
