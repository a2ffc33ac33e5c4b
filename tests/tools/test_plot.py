"""tools/plot.py: every PNG of a planted run dir, its starved experts marked, the clear errors
(the plots of a real tiny run: tests/tools/test_pretrain_tracking.py)."""

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib")

import plot  # tools/plot.py

from moetron.core.config import ConfigError
from moetron.core.moe.metrics import LoadLog

PNG = b"\x89PNG\r\n\x1a\n"


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG and os.path.getsize(path) > 1000


def planted_run(run_dir, steps=(10, 20, 30)):
    """A run dir of 3 MoE layers x 8 experts: in layer 5 expert 6 is dead and expert 2 starved."""
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for i, step in enumerate(steps):
            f.write(json.dumps({"step": step, "loss": 6.0 - i, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e4,
                                "mfu": None, **({"eval_loss": 5.5} if step == steps[-1] else {})}) + "\n")
    log = LoadLog(os.path.join(run_dir, "moe_load.npz"))
    for step in steps:
        tokens_LE = np.full((3, 8), 100.0, dtype=np.float32)
        tokens_LE[2, 6], tokens_LE[2, 2] = 0.0, 1.0
        log.add(step, {"layers": np.array([1, 3, 5]), "tokens_per_expert": tokens_LE, "dropped": np.zeros(3),
                       "entropy": np.full(3, 1.9), "max_violation": tokens_LE.max(1) / tokens_LE.mean(1) - 1})
    return run_dir


def test_planted_starved_expert_is_marked(tmp_path):
    d = planted_run(str(tmp_path / "run"))
    plt = plot.require_matplotlib()
    load = plot.read_load(d)
    starved_LE = plot.plot_expert_load(load, 2, 0.1, str(tmp_path / "heat.png"), plt)
    assert [tuple(ix) for ix in np.argwhere(starved_LE)] == [(2, 2), (2, 6)]  # row 2 = layer 5
    assert is_png(tmp_path / "heat.png")
    paths = plot.plot_run(d, str(tmp_path / "out"), steps=[11, 30])
    names = sorted(os.path.basename(p) for p in paths)
    assert names == sorted(["loss.png", "lr.png", "grad_norm.png", "throughput.png", "expert_load_step10.png",
                            "expert_load_step30.png", "expert_load_evolution.png"])
    assert all(is_png(p) for p in paths)


def test_missing_matplotlib_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match="needs matplotlib, which is not installed: pip install matplotlib"):
        plot.plot_run(planted_run(str(tmp_path / "run")))


def test_not_a_run_dir_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="metrics.jsonl does not exist"):
        plot.plot_run(str(tmp_path))
