"""Weights-only checkpoints stream in and out and load into a model like a training checkpoint."""

import os

import pytest
import torch

from moetron.core.checkpoint import CheckpointConfig, Checkpointer, CheckpointError
from moetron.core.weights import iter_weights, read_weight_specs, save_weights


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def test_stream_round_trip_and_model_load(tmp_path):
    src = _model()
    sd = src.state_dict()
    calls = []

    def produce(name):
        calls.append(name)
        return sd[name].clone()

    path = save_weights(str(tmp_path / "w"), {n: (tuple(t.shape), t.dtype) for n, t in sd.items()}, produce,
                        {"config": {"model": {"kind": "toy"}}})
    assert sorted(calls) == sorted(sd)  # each tensor produced exactly once
    assert read_weight_specs(path) == {n: (tuple(t.shape), t.dtype) for n, t in sd.items()}
    read = dict(iter_weights(path))
    assert read.keys() == sd.keys()
    for name, t in read.items():
        assert torch.equal(t, sd[name])
    dst = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    Checkpointer(CheckpointConfig()).load(path, dst, None, {}, model_only=True)
    for a, b in zip(src.parameters(), dst.parameters()):
        assert torch.equal(a, b)


def test_refuses_existing_and_leaves_nothing_on_failure(tmp_path):
    sd = _model().state_dict()
    specs = {n: (tuple(t.shape), t.dtype) for n, t in sd.items()}
    path = save_weights(str(tmp_path / "w"), specs, lambda n: sd[n], {})
    before = sorted(os.listdir(path))
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        save_weights(path, specs, lambda n: sd[n], {})
    with pytest.raises(CheckpointError, match="declared"):
        save_weights(path, specs, lambda n: torch.zeros(3), {}, overwrite=True)
    assert sorted(os.listdir(path)) == before  # the old checkpoint is intact
    assert [e for e in os.listdir(tmp_path) if e.startswith(".")] == []  # no temp dirs left
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        save_weights(str(tmp_path / "file"), specs, lambda n: sd[n], {}, overwrite=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="non-empty directory that is not a checkpoint"):
        save_weights(str(tmp_path / "other"), specs, lambda n: sd[n], {}, overwrite=True)
    assert os.listdir(tmp_path / "other") == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    assert read_weight_specs(save_weights(str(tmp_path / "empty"), specs, lambda n: sd[n], {})) == specs


def test_streaming_peak_memory_is_a_few_tensors(tmp_path):
    """1.2 GB written through 64 MB tensors: the writer's RSS grows by far less than the total."""
    import subprocess
    import sys

    code = f"""
import resource, torch
from moetron.core.weights import save_weights
specs = {{f"w{{i}}": ((4096, 4096), torch.float32) for i in range(18)}}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
save_weights({str(tmp_path / 'big')!r}, specs, lambda n: torch.full((4096, 4096), float(n[1:])), {{}})
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown_mb = int(out.stdout.strip().splitlines()[-1])
    assert grown_mb < 400, grown_mb  # total written: 18 x 64 MB = 1152 MB
