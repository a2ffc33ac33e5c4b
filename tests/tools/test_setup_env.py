"""tools/setup_env.sh, the set-up the README's commands and examples/ run first: MOETRON_PYTHON is used as given
(nothing installed), and where no package index answers, one error naming the cause and the way around it
(MOETRON_PYTHON), exit status 1, instead of pip's retries alone."""

import os
import subprocess
import sys

from tests.reporting import ROOT

SETUP = os.path.join(ROOT, "tools", "setup_env.sh")


def test_given_python_is_used_as_is(tmp_path):
    env = dict(os.environ, MOETRON_PYTHON=sys.executable, MOETRON_VENV=str(tmp_path / "venv"))
    out = subprocess.run(["bash", SETUP], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == sys.executable
    assert not (tmp_path / "venv").exists()


def test_no_package_index_names_the_way_around(tmp_path):
    """A fresh venv, pip with no index and no config (so no local wheel directory either): torch cannot be
    installed, and the error says so and what to set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "MOETRON_"))}
    env.update(MOETRON_VENV=str(tmp_path / "venv"), PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",
               PYTHON=sys.executable)
    out = subprocess.run(["bash", SETUP], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stdout == ""  # no interpreter printed for the caller to run
    assert "could not install torch" in out.stderr and "MOETRON_PYTHON" in out.stderr, out.stderr[-2000:]
