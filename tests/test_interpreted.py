"""tests/interpreted.py's batch: a module's listed calls run in one subprocess, each reported on its
own, so one failing call fails only its own test."""

from tests.interpreted import _run_batch


def test_batch_reports_each_call_on_its_own(tmp_path, monkeypatch):
    (tmp_path / "batch_module.py").write_text("COUNT = []\n\ndef ok():\n    COUNT.append(1)\n\n"
                                              "def bad():\n    raise ValueError('boom')\n\n"
                                              "def count(n):\n    assert len(COUNT) == n, COUNT\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    results = _run_batch("batch_module", ("ok()", "bad()", "ok()", "count(2)"), timeout=120)
    assert results["ok()"] == [True, ""] and results["count(2)"] == [True, ""]  # one process, in order
    assert results["bad()"][0] is False and "ValueError: boom" in results["bad()"][1]


def test_a_batch_that_dies_fails_every_call(tmp_path, monkeypatch):
    (tmp_path / "dying_module.py").write_text("import os\n\ndef die():\n    os._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    results = _run_batch("dying_module", ("die()", "die() "), timeout=120)
    assert all(not passed and "ended (exit 3) before reporting" in out for passed, out in results.values())
