"""A full disk or an unwritable checkpoint dir: found when the run starts (Checkpointer.check_writable),
and a save that fails anyway (an OSError, or torch's zip writer failing on a short write) removes its
partial dir, keeps the previous checkpoints loadable and raises one CheckpointError naming the failure,
the directory, its free space, the checkpoint's size and the fix. The same holds for the
single-process writers of a checkpoint dir (core.checkpoint.staged_dir): a weights-only save
(core.weights.save_weights) and a Hugging Face export (models.hf.export_hf)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import signal
import sys
from collections import namedtuple
from typing import Iterator

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch import nn

import moetron.core.checkpoint.checkpointer as checkpointer_module
from moetron.core.checkpoint import STALE_DIR_RE, CheckpointConfig, CheckpointError, Checkpointer
from tests.distributed import run_distributed
from tests.processes import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
# What torch.save's zip writer raised inside DCP when a shared disk filled up mid-save on the GPU machine.
SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def build(hidden: int = 16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))
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


def snapshot(model, opt) -> dict:
    """Copies of everything a resume restores from model and optimizer."""
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}}


def assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys() and a["optim"].keys() == b["optim"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i in a["optim"]:
        assert a["optim"][i].keys() == b["optim"][i].keys()
        for k in a["optim"][i]:
            assert torch.equal(a["optim"][i][k], b["optim"][i][k]), (i, k)


def two_checkpoints(root, hidden: int = 16):
    """Save steps 1 and 2 under ``root``; return the checkpointer, model, optimizer, the paths of both
    and the state saved in step 2 (the model has trained one step more since)."""
    model, opt = build(hidden)
    step(model, opt)
    cp = Checkpointer(CheckpointConfig(dir=str(root)))  # keep_last=2
    first = cp.save(1, model, opt, {"position": 10}, {})
    step(model, opt)
    second = cp.save(2, model, opt, {"position": 20}, {})
    saved = snapshot(model, opt)
    step(model, opt)
    return cp, model, opt, first, second, saved


def assert_resumes_from(cp, path, saved, hidden: int = 16) -> None:
    """``path`` is the newest complete checkpoint and loads back to ``saved``."""
    assert cp.latest() == path and cp.resolve(True) == path
    model, opt = build(hidden)
    extra = {"position": 0}
    assert cp.load(cp.resolve(True), model, opt, extra)["step"] == 2
    assert extra["position"] == 20
    assert_same_state(snapshot(model, opt), saved)


@pytest.mark.parametrize("error", ["enospc", "torch short write"])
def test_write_failing_partway_through_a_save(tmp_path, monkeypatch, error):
    """The disk fills while DCP writes the shard: the first entry is written, the next write fails."""
    root = tmp_path / "ckpt"
    cp, model, opt, first, second, saved = two_checkpoints(root)
    if error == "enospc":
        raised: Exception = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "shard")
    else:
        raised = RuntimeError(SHORT_WRITE)
    real_write_item = dcp_filesystem._write_item
    partial: list[tuple[str, int]] = []

    def write_item(transforms, stream, *args, **kwargs):
        if partial:
            raise raised
        result = real_write_item(transforms, stream, *args, **kwargs)
        partial.append((stream.name, stream.tell()))
        return result

    monkeypatch.setattr(dcp_filesystem, "_write_item", write_item)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpointer_module.shutil, "disk_usage", lambda p: usage(8 << 30, 7 << 30, 5 << 28))
    with pytest.raises(CheckpointError) as info:
        cp.save(3, model, opt, {"position": 30}, {})
    monkeypatch.undo()
    shard, written = partial[0]
    assert ".step_00000003.tmp-" in shard and written > 0  # the save was partway through its shard

    message = str(info.value)
    assert info.value.__cause__ is raised  # chained from the write that failed, not DCP's wrapper
    assert message.count(str(root)) >= 2 and "step 3" in message, message
    assert "no space left on device" in message if error == "enospc" else "unexpected pos 704 vs 598" in message
    size = f"takes about {Checkpointer.estimate_bytes(model, opt) / 2**30:.2f} GiB"
    assert f"{root} now has 1.25 GiB free" in message and size in message, message
    assert "free space there" in message and "--checkpoint.dir" in message, message
    assert "--checkpoint.keep_last (now 2" in message, message
    assert f"the previous checkpoint {second} is kept" in message, message
    assert "Traceback" not in message and "\n" not in message  # one line for tools/cli.py's run_cli

    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002"]  # the partial dir is gone
    assert_resumes_from(cp, second, saved)
    assert cp.verify(first)["step"] == 1  # the older kept checkpoint is untouched too


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """No fake disk: while it holds, the kernel cuts any write past ``limit`` bytes of a file short
    (then fails it with EFBIG), as a disk that fills up does."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE / SIGXFSZ as on Linux")


@LINUX_ONLY
def test_real_short_write_fails_the_save_cleanly(tmp_path):
    """No fake: a file size limit makes the kernel cut the shard's write short (EFBIG), which torch's zip
    writer reports as the RuntimeError seen on the full disk ("unexpected pos ...")."""
    root = tmp_path / "ckpt"
    cp, model, opt, first, second, saved = two_checkpoints(root, hidden=256)
    sizes = {f: os.path.getsize(os.path.join(second, f)) for f in os.listdir(second)}
    shard = max(sizes, key=sizes.get)
    assert shard.endswith(".distcp")  # the tensors' file, which torch's zip writer writes
    limit = (sizes[shard] + max(v for f, v in sizes.items() if f != shard)) // 2  # only the shard is too big
    with file_size_limit(limit), pytest.raises(CheckpointError) as info:
        cp.save(3, model, opt, {"position": 30}, {})
    message = str(info.value)
    assert type(info.value.__cause__) is RuntimeError and "inline_container.cc" in message, message
    assert "saving checkpoint step 3" in message and "GiB free" in message and "--checkpoint.dir" in message
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002"]
    assert_resumes_from(cp, second, saved, hidden=256)


def test_failed_publish_keeps_the_checkpoint_it_would_replace(tmp_path, monkeypatch):
    """Saving a step that already has a checkpoint moves the old one aside first: if the final rename
    fails, the old one is put back, not left as a hidden leftover the next prune deletes."""
    root = tmp_path / "ckpt"
    cp, model, opt, first, second, saved = two_checkpoints(root)
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if ".tmp-" in os.path.basename(src):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), src)
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    kept = r"no space left on device.*the previous checkpoint .*step_00000002 is kept"
    with pytest.raises(CheckpointError, match=kept):
        cp.save(2, model, opt, {"position": 99}, {})  # the model has trained on since step 2 was saved
    monkeypatch.undo()
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002"]
    assert_resumes_from(cp, second, saved)


def _short_write_on_rank_1(rank: int, world_size: int, root: str) -> None:
    model, opt = build()
    step(model, opt)  # same seed, same data: the replicas are identical
    cp = Checkpointer(CheckpointConfig(dir=root))
    kept = cp.save(1, model, opt, {}, {})
    saved = snapshot(model, opt)
    step(model, opt)
    if rank == 1:
        def write_data(self, *args, **kwargs):
            raise RuntimeError(SHORT_WRITE)

        dcp_filesystem.FileSystemWriter.write_data = write_data
    with pytest.raises(CheckpointError) as info:
        cp.save(2, model, opt, {}, {})
    message = str(info.value)
    assert "unexpected pos 704 vs 598" in message and "GiB free" in message and kept in message, message
    assert type(info.value.__cause__) is RuntimeError  # DCP hands rank 1's failure to every rank
    assert sorted(os.listdir(root)) == ["step_00000001"]
    model2, opt2 = build()
    cp.load(cp.latest(), model2, opt2, {})
    assert_same_state(snapshot(model2, opt2), saved)


def test_write_failing_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    run_distributed(_short_write_on_rank_1, 2, str(tmp_path / "ckpt"))


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
    proc = run_python([os.path.join(ROOT, "tools", "pretrain.py"), *args],
                      env=env, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "is not writable" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text().strip() == ""  # no step ran


# ---- weights-only saves and HF exports (core.checkpoint.staged_dir) -------------------------


def fake_free_space(monkeypatch) -> str:
    """Every file system reports 1.25 GiB free; returns how the messages put it."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(8 << 30, 7 << 30, 5 << 28))
    return "now has 1.25 GiB free"


def file_hashes(path) -> dict[str, str]:
    """{name: sha256} of the files in dir ``path``."""
    return {n: hashlib.sha256((path / n).read_bytes()).hexdigest() for n in sorted(os.listdir(path))}


def assert_one_clear_line(message: str, what: str, out, size_bytes: int) -> None:
    """The message of a failed write to ``out``: what, where, the room there, the size and the fix."""
    assert f"writing the {what} {out} failed: " in message, message
    assert f"{out.parent} now has " in message and f"takes about {size_bytes / 2**30:.2f} GiB" in message, message
    assert "partial output" in message and "was removed" in message, message
    assert "free space there or write to a file system with room" in message, message
    assert "Traceback" not in message and "\n" not in message  # one line for the tools' "error: ..."


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"a.weight": torch.randn(64, 32), "b.weight": torch.randn(256, 64)}


def save_weights_of(path, state, model_config: dict | None = None, **kwargs) -> str:
    """``state`` as a weights-only checkpoint at ``path`` (save_weights' other arguments in ``kwargs``)."""
    from moetron.core.weights import save_weights

    specs = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    metadata = {"config": {} if model_config is None else {"model": model_config}}
    return save_weights(str(path), specs, lambda n: state[n], metadata, **kwargs)


def assert_holds(path, state) -> None:
    from moetron.core.weights import iter_weights

    read = dict(iter_weights(str(path)))
    assert read.keys() == state.keys() and all(torch.equal(read[n], state[n]) for n in state)


WEIGHTS_BYTES = (64 * 32 + 256 * 64) * 4


@pytest.mark.parametrize("error", ["enospc", "torch short write", "enospc on meta.json"])
def test_weights_only_save_failing_partway_keeps_the_earlier_checkpoint(tmp_path, monkeypatch, error):
    """Replacing a weights-only checkpoint (--overwrite) on a disk that fills: one CheckpointError, the
    partial output gone, the earlier checkpoint as it was."""
    import moetron.core.weights as weights_module

    out = tmp_path / "w"
    save_weights_of(out, weights(0))
    before = file_hashes(out)
    real_write_item = dcp_filesystem._write_item
    written: list[str] = []
    raised: Exception = (RuntimeError(SHORT_WRITE) if error == "torch short write"
                         else OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))  # a write names no file

    def write_item(transforms, stream, *args, **kwargs):
        if written:
            raise raised
        written.append(stream.name)
        return real_write_item(transforms, stream, *args, **kwargs)

    def write_durable(*args, **kwargs):
        raise raised

    if error == "enospc on meta.json":
        monkeypatch.setattr(weights_module, "write_durable", write_durable)  # after DCP, outside its wrapper
    else:
        monkeypatch.setattr(dcp_filesystem, "_write_item", write_item)
    free = fake_free_space(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        save_weights_of(out, weights(1), overwrite=True)
    monkeypatch.undo()

    message = str(info.value)
    assert info.value.__cause__ is raised  # chained from the write that failed, not DCP's wrapper
    assert_one_clear_line(message, "weights-only checkpoint", out, WEIGHTS_BYTES)
    assert free in message, message
    assert "unexpected pos 704 vs 598" in message if error == "torch short write" else "no space left on device" in message
    assert f"the weights-only checkpoint already at {out} is unchanged" in message, message
    assert os.listdir(tmp_path) == ["w"]  # no partial .w.tmp-* dir
    assert file_hashes(out) == before
    assert_holds(out, weights(0))


@LINUX_ONLY
def test_real_short_write_fails_a_weights_only_save_cleanly(tmp_path):
    """No fake: the larger tensor's file is cut short by the kernel; torch's zip writer inside DCP raises."""
    out = tmp_path / "w"
    save_weights_of(out, weights(0))
    before = file_hashes(out)
    sizes = sorted(os.path.getsize(out / n) for n in os.listdir(out))
    with file_size_limit((sizes[-1] + sizes[-2]) // 2), pytest.raises(CheckpointError) as info:  # only the largest
        save_weights_of(out, weights(1), overwrite=True)
    message = str(info.value)
    assert type(info.value.__cause__) is RuntimeError and "inline_container.cc" in message, message
    assert_one_clear_line(message, "weights-only checkpoint", out, WEIGHTS_BYTES)
    assert os.listdir(tmp_path) == ["w"] and file_hashes(out) == before
    assert_holds(out, weights(0))


def test_weights_only_save_to_a_new_output_says_nothing_was_written(tmp_path, monkeypatch):
    import moetron.core.weights as weights_module

    monkeypatch.setattr(weights_module, "write_manifest", _raise_enospc)
    with pytest.raises(CheckpointError, match=f"nothing was written to {tmp_path / 'w'};"):
        save_weights_of(tmp_path / "w", weights(0))
    assert os.listdir(tmp_path) == []


def native_checkpoint(path) -> str:
    """A small native checkpoint to export: Olmo3-shaped, fp32."""
    from moetron.models import ModelConfig

    cfg = ModelConfig.tiny()
    cfg.d_model, cfg.vocab_size, cfg.mlp_hidden, cfg.sliding_window = 64, 128, 96, 8
    torch.manual_seed(0)
    return save_weights_of(path, cfg.build().state_dict(), cfg.to_dict())


def export_bytes(hf_dir) -> int:
    """The tensor bytes of an fp32 export (what export_hf names as its size)."""
    from moetron.models.hf import iter_hf_tensors

    return sum(t.numel() * 4 for _, t in iter_hf_tensors(str(hf_dir)))


@pytest.mark.parametrize("error", ["enospc", "torch short write"])
def test_hf_export_failing_partway_keeps_the_earlier_export(tmp_path, monkeypatch, error):
    """Re-exporting over an earlier export (--overwrite) on a disk that fills while the shard is written."""
    import moetron.models.hf.export as export_module
    from moetron.models.hf import export_hf

    native = native_checkpoint(tmp_path / "native")
    out = tmp_path / "hf"
    export_hf(native, str(out), dtype=torch.bfloat16)
    before = file_hashes(out)
    real_write = export_module._ShardWriter.write
    calls = []
    raised: Exception = (RuntimeError(SHORT_WRITE) if error == "torch short write"
                         else OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))

    def write(self, hf_name, tensor):
        if calls:
            raise raised
        calls.append(hf_name)
        return real_write(self, hf_name, tensor)

    monkeypatch.setattr(export_module._ShardWriter, "write", write)
    free = fake_free_space(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        export_hf(native, str(out), overwrite=True)  # fp32 this time
    monkeypatch.undo()

    message = str(info.value)
    assert info.value.__cause__ is raised
    assert_one_clear_line(message, "Hugging Face checkpoint", out, 2 * export_bytes(out))  # bf16 there, fp32 asked
    assert free in message, message
    assert "unexpected pos 704 vs 598" in message if error == "torch short write" else "no space left on device" in message
    assert f"the Hugging Face checkpoint already at {out} is unchanged" in message, message
    assert sorted(os.listdir(tmp_path)) == ["hf", "native"]
    assert file_hashes(out) == before


@LINUX_ONLY
def test_real_short_write_fails_an_hf_export_cleanly(tmp_path):
    """No fake: the kernel cuts model.safetensors short (EFBIG); the earlier export is kept."""
    from moetron.models.hf import export_hf

    native = native_checkpoint(tmp_path / "native")
    out = tmp_path / "hf"
    export_hf(native, str(out), dtype=torch.bfloat16)
    before = file_hashes(out)
    size = 2 * export_bytes(out)
    with file_size_limit(size // 2), pytest.raises(CheckpointError) as info:
        export_hf(native, str(out), overwrite=True)
    message = str(info.value)
    assert isinstance(info.value.__cause__, OSError) and "file too large" in message, message
    assert_one_clear_line(message, "Hugging Face checkpoint", out, size)
    assert f"the Hugging Face checkpoint already at {out} is unchanged" in message, message
    assert sorted(os.listdir(tmp_path)) == ["hf", "native"] and file_hashes(out) == before


def test_hf_export_failing_to_read_its_source_is_not_called_a_full_disk(tmp_path):
    """An OSError naming a file of the checkpoint being read is not the output's disk: raised as it was."""
    from moetron.models.hf import export_hf

    native = native_checkpoint(tmp_path / "native")
    victim = max(os.listdir(native), key=lambda n: os.path.getsize(os.path.join(native, n)))
    os.remove(os.path.join(native, victim))
    with pytest.raises(BaseException) as info:
        export_hf(native, str(tmp_path / "hf"))
    assert "free" not in str(info.value) and "write to a file system" not in str(info.value), info.value
    assert sorted(os.listdir(tmp_path)) == ["native"]
