"""tests/processes.py's run_python: a child forked from the warm server behaves as a new interpreter
(``fresh=True``, a real subprocess, is the reference) in what the suite's tests read."""

import os
import subprocess
import textwrap

import pytest

from tests.processes import run_python

PROBE = textwrap.dedent("""
    import json, os, sys, threading, atexit
    import torch
    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=lambda: (__import__("time").sleep(0.2), print("thread joined"))).start()
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "var": os.environ.get("PROBE_VAR"),
                      "threads": torch.get_num_threads(), "stdin": sys.stdin.read(), "main": __name__,
                      "tests_importable": __import__("importlib.util").util.find_spec("tests") is not None,
                      "extra_on_path": [p for p in sys.path if p.endswith("probe_path")]}))
    print("to stderr", file=sys.stderr)
""")


def test_a_child_is_what_a_new_interpreter_is(tmp_path):
    """A script (``-c`` is the interpreted batches' and the exit-status test's way in)."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    argv = [str(script), "a", "b"]
    env = dict(os.environ, PROBE_VAR="x", OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path / "probe_path"))
    warm = run_python(argv, env=env, cwd=str(tmp_path), input="hello", timeout=120)
    fresh = run_python(argv, env=env, cwd=str(tmp_path), input="hello", timeout=120, fresh=True)
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert '"var": "x"' in warm.stdout and '"stdin": "hello"' in warm.stdout and '"threads": 1' in warm.stdout
    assert warm.stdout.endswith("thread joined\natexit ran\n") and warm.stderr == "to stderr\n"


@pytest.mark.parametrize("code,status", [("import sys; sys.exit('bad input')", 1), ("import sys; sys.exit(3)", 3),
                                         ("import sys; sys.exit()", 0), ("raise ValueError('boom')", 1),
                                         ("import os; os._exit(5)", 5)])
def test_exit_status_and_message_as_the_interpreter_gives_them(code, status):
    warm, fresh = run_python(["-c", code], timeout=120), run_python(["-c", code], timeout=120, fresh=True)
    assert warm.returncode == fresh.returncode == status
    assert warm.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]  # the traceback's frames differ


def test_a_timeout_kills_the_child_and_raises():
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; time.sleep(60)"], timeout=1)
    assert run_python(["-c", "print('next')"], timeout=60).stdout == "next\n"  # the server goes on


KERNEL = textwrap.dedent("""
    import os, sys
    if len(sys.argv) > 1:
        os.environ["TRITON_INTERPRET"] = "1"  # as tools/cli.py's kernel_device does, before importing triton
    import torch, triton
    import triton.language as tl

    @triton.jit
    def fill(x):  # tl.zeros is itself a @triton.jit function of triton's library
        tl.store(x + tl.arange(0, 4), tl.zeros([4], tl.int32) + 7)

    print(type(fill).__name__)
    if os.environ.get("TRITON_INTERPRET") == "1":
        x = torch.zeros(4, dtype=torch.int32)
        fill[(1,)](x)
        print(x.tolist())
""")


def test_triton_interpret_is_the_childs_own(tmp_path):
    """Triton reads TRITON_INTERPRET when a kernel is defined, its library's too: a child gets interpreted
    kernels, and can launch them, exactly when its environment (or the tool itself, before it imports
    triton) asks for them, as a new interpreter does."""
    pytest.importorskip("triton")
    from tests.interpreted import skip_unless_interpreter_works

    skip_unless_interpreter_works()
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for args, extra in [([], {"TRITON_INTERPRET": "1"}), (["set-by-the-tool"], {}), ([], {})]:
        got = run_python([script, *args], env={**env, **extra}, timeout=120)
        want = run_python([script, *args], env={**env, **extra}, timeout=120, fresh=True)
        assert got.returncode == want.returncode == 0 and got.stdout == want.stdout, (args, extra, got.stderr)
        assert ("[7, 7, 7, 7]" in got.stdout) == (args != [] or extra != {}), got.stdout


def test_interpreter_options_are_refused():
    with pytest.raises(ValueError, match="fresh=True"):
        run_python(["-X", "importtime", "-c", "pass"])
    assert run_python(["-X", "importtime", "-c", "pass"], fresh=True).returncode == 0
