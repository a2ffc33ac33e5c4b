"""A full disk or an unwritable checkpoint dir: found when the run starts (Checkpointer.check_writable),
and a save that fails anyway removes its partial dir, keeps the previous checkpoint and raises one
CheckpointError naming the OS error and the path."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
from torch import nn

import moetron.core.checkpoint.checkpointer as checkpointer_module
from moetron.core.checkpoint import STALE_DIR_RE, CheckpointConfig, CheckpointError, Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def step(model, opt):
    model(torch.randn(3, 8)).pow(2).mean().backward()
    opt.step()


def leftovers(root) -> list[str]:
    return [e for e in os.listdir(root) if STALE_DIR_RE.match(e)]


def _raise_enospc(*args, **kwargs):
    raise ENOSPC


def _dcp_write_fails(self, *args, **kwargs):  # FileSystemWriter.write_data: DCP wraps it
    raise ENOSPC


@pytest.mark.parametrize("where", ["dcp.save", "dcp write", "rng file", "manifest"])
def test_enospc_during_save_removes_tmp_and_keeps_previous(tmp_path, monkeypatch, where):
    model, opt = build()
    step(model, opt)
    cp = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    first = cp.save(1, model, opt, {}, {})
    step(model, opt)
    if where == "dcp.save":
        monkeypatch.setattr(checkpointer_module.dcp, "save", _raise_enospc)
    elif where == "dcp write":
        monkeypatch.setattr(checkpointer_module.dcp.FileSystemWriter, "write_data", _dcp_write_fails)
    elif where == "rng file":
        monkeypatch.setattr(checkpointer_module, "write_durable", _raise_enospc)
    else:
        monkeypatch.setattr(checkpointer_module, "write_manifest", _raise_enospc)
    with pytest.raises(CheckpointError) as info:
        cp.save(2, model, opt, {}, {})
    message = str(info.value)
    assert "no space left on device" in message and str(tmp_path / "ckpt") in message, message
    assert first in message  # the previous checkpoint is named as kept
    monkeypatch.undo()
    assert leftovers(tmp_path / "ckpt") == [] and cp.latest() == first
    model2, opt2 = build()
    assert cp.load(first, model2, opt2, {})["step"] == 1


def test_save_failure_that_is_not_the_disk_is_raised_as_is(tmp_path, monkeypatch):
    model, opt = build()
    cp = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")))

    def boom(*a, **k):
        raise ValueError("a bug")

    monkeypatch.setattr(checkpointer_module.dcp, "save", boom)
    with pytest.raises(ValueError, match="a bug"):
        cp.save(1, model, opt, {}, {})
    assert leftovers(tmp_path / "ckpt") == []


def test_check_writable_passes_and_leaves_nothing(tmp_path):
    cp = Checkpointer(CheckpointConfig(dir=str(tmp_path / "a" / "ckpt")))
    cp.check_writable(1000)
    assert os.listdir(tmp_path) == []  # the dirs it made to probe are gone again
    (tmp_path / "b").mkdir()
    Checkpointer(CheckpointConfig(dir=str(tmp_path / "b"))).check_writable(1000)
    assert os.listdir(tmp_path / "b") == []
    Checkpointer(CheckpointConfig(dir=None)).check_writable(1 << 60)  # no checkpoints: nothing to check
    Checkpointer(CheckpointConfig(dir=str(tmp_path / "f"), save_final=False)).check_writable(1 << 60)


def test_check_writable_path_under_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("x")
    cp = Checkpointer(CheckpointConfig(dir=str(tmp_path / "file" / "ckpt")))
    with pytest.raises(CheckpointError, match=r"is not writable: not a directory.*file"):
        cp.check_writable(0)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: chmod does not stop it")
def test_check_writable_read_only_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match="is not writable: permission denied"):
            Checkpointer(CheckpointConfig(dir=str(ro / "ckpt"))).check_writable(0)
    finally:
        ro.chmod(0o700)


def test_check_writable_not_enough_space(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpointer_module.shutil, "disk_usage", lambda p: usage(10 << 30, 9 << 30, 1 << 30))
    cp = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    cp.check_writable(1 << 29)
    with pytest.raises(CheckpointError, match=r"1\.00 GiB free but one checkpoint of this run takes about 3\.00 GiB"):
        cp.check_writable(3 << 30)


def test_estimate_bytes_is_close_to_a_checkpoint(tmp_path):
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8))  # big enough that DCP's per-entry headers are small
    opt = torch.optim.AdamW(model.parameters())
    before = Checkpointer.estimate_bytes(model, opt)  # no optimizer state yet: two moments assumed
    model(torch.randn(3, 256)).pow(2).mean().backward()
    opt.step()
    after = Checkpointer.estimate_bytes(model, opt)
    path = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt"))).save(1, model, opt, {}, {})
    data = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))
    params = sum(p.numel() * 4 for p in model.parameters())
    assert before == 3 * params and after >= before
    assert 0.9 * data <= before <= 1.1 * data, (before, data)


def test_pretrain_unwritable_checkpoint_dir_fails_before_training(tmp_path):
    (tmp_path / "file").write_text("x")
    run_dir = tmp_path / "run"
    env = dict(os.environ, MOETRON_DATA_DIR=str(tmp_path / "corpus"), OMP_NUM_THREADS="1")
    args = ["--model.d_model=32", "--model.n_layers=1", "--model.vocab_size=512", "--model.mlp_hidden=64",
            "--model.attention.n_heads=2", "--model.attention.n_kv_heads=1", "--model.sliding_window=8",
            "--data.seq_len=16", "--data.global_batch_size=2", "--data.corpus_vocab_size=512",
            "--data.corpus_max_bytes=400000", "--precision.recipe=fp32", "--scheduler.warmup_steps=1",
            "--trainer.device=cpu", "--trainer.steps=2", f"--trainer.run_dir={run_dir}",
            f"--checkpoint.dir={tmp_path / 'file' / 'ckpt'}"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "pretrain.py"), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "is not writable" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text().strip() == ""  # no step ran
