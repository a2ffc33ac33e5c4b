"""Loading a checkpoint never runs code from it.

A pickle whose ``__reduce__`` creates a marker file is planted in each file of a checkpoint in turn
(.metadata, the RNG file, a byte entry and a tensor entry of the DCP data file, meta.json,
manifest.json), the manifest re-hashed so the sha256 check passes (whoever ships a checkpoint ships
its manifest), and every loading entry point is run: Checkpointer.load (resume), the weights-only
load (init_from), core.weights.iter_weights, tools/score.py, tools/convert_hf.py export,
tools/upcycle.py and tools/pretrain.py (--resume, --checkpoint.init_from). No marker may appear; an
entry point that reads the planted file fails with one clear error naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import random
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import cli
import convert_hf
import score as score_tool
import upcycle as upcycle_tool
from moetron.core.checkpoint import CheckpointConfig, CheckpointError, Checkpointer, SafeFileSystemReader
from moetron.core.config import ConfigError
from moetron.core.optim import SchedulerConfig
from moetron.core.weights import iter_weights
from moetron.data.preprocess import tokenize_documents
from moetron.models import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Plant:
    """Unpickling this runs ``os.system("touch MARKER")`` (or, with ``via_open``, ``open(MARKER, "w")``)."""

    def __init__(self, marker: str, via_open: bool = False):
        self.marker, self.via_open = marker, via_open

    def __reduce__(self):
        if self.via_open:
            return (open, (self.marker, "w"))
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def payload(marker: str, torch_format: bool, via_open: bool = False) -> bytes:
    buf = io.BytesIO()
    if torch_format:
        torch.save(Plant(marker, via_open), buf)
    else:
        pickle.dump(Plant(marker, via_open), buf)
    return buf.getvalue()


class Position:
    """A Stateful like the data loader's position."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self):
        return {"n": self.n, "seen": [self.n]}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def model_cfg() -> ModelConfig:
    cfg = ModelConfig(d_model=64, n_layers=2, vocab_size=320, mlp_hidden=128, sliding_window=16)
    cfg.attention.n_heads, cfg.attention.n_kv_heads = 4, 2
    return cfg


def build():
    torch.manual_seed(0)
    cfg = model_cfg()
    model = cfg.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = SchedulerConfig(warmup_steps=1).build(opt, 10)  # its state holds a ScheduleKind enum
    return cfg, model, opt, sched


class ToyTokenizer:
    eos_id = 2
    vocab_size = 300

    def encode(self, text):
        return [3 + b for b in text.encode()]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A trainer-style checkpoint (model, optimizer, scheduler, a position, RNG) and a token file."""
    tmp = tmp_path_factory.mktemp("safety")
    cfg, model, opt, sched = build()
    model(torch.randint(0, 320, (2, 8))).float().mean().backward()
    opt.step()
    sched.step()
    cp = Checkpointer(CheckpointConfig(dir=str(tmp / "ckpt")))
    path = cp.save(1, model, opt, {"scheduler": sched, "data": Position(3)}, {"config": {"model": cfg.to_dict()}})
    tokens = str(tmp / "val")
    tokenize_documents(["The quick brown fox jumps over the lazy dog. " * 3], tokens, ToyTokenizer(), progress=False)
    return path, tokens + ".bin"


# ---- planting ----------------------------------------------------------------------------------


def rehash(path: str) -> None:
    """Rewrite the manifest so every file matches it again (what a malicious publisher does)."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    for name in manifest["files"]:
        data = open(os.path.join(path, name), "rb").read()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def plant_entry(path: str, fqn: str, data: bytes) -> str:
    """Point DCP entry ``fqn`` at ``data`` appended to its data file; returns that file's name."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # our own, untampered metadata
    keys = [k for k in md.storage_data if k.fqn == fqn]
    assert keys, sorted({k.fqn for k in md.storage_data})
    for key in keys:
        info = md.storage_data[key]
        file = os.path.join(path, info.relative_path)
        offset = os.path.getsize(file)
        with open(file, "ab") as f:
            f.write(data)
        md.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(data))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return md.storage_data[keys[0]].relative_path


TARGETS = [".metadata", "rng", "bytes", "tensor", "meta.json", "manifest.json"]
TENSOR = "model.embed.weight"
BYTES = "extra/data.n"


def plant(base_path: str, tmp_path, target: str, via_open: bool = False,
          bytes_fqn: str = BYTES) -> tuple[str, str, str]:
    """A copy of the base checkpoint with a payload in ``target``: (path, the bad file's name, marker)."""
    path = str(tmp_path / "step_00000001")
    shutil.copytree(base_path, path)
    marker = str(tmp_path / "MARKER")
    if target == ".metadata":
        bad = ".metadata"
        open(os.path.join(path, bad), "wb").write(payload(marker, False, via_open))
    elif target == "rng":
        bad = "rng_rank0.pt"
        open(os.path.join(path, bad), "wb").write(payload(marker, True, via_open))
    elif target in ("bytes", "tensor"):
        bad = plant_entry(path, bytes_fqn if target == "bytes" else TENSOR, payload(marker, True, via_open))
    else:
        bad = target
        open(os.path.join(path, bad), "wb").write(payload(marker, False, via_open))
    if target != "manifest.json":
        rehash(path)
    return path, bad, marker


# ---- the entry points ----------------------------------------------------------------------------
# Each runs one way of loading and returns None on success or the error text.


def _resume(path, tmp_path, capsys):
    _, model, opt, sched = build()
    try:
        Checkpointer(CheckpointConfig()).load(path, model, opt, {"scheduler": sched, "data": Position()})
    except CheckpointError as e:
        return str(e)


def _init_from(path, tmp_path, capsys):
    _, model, _, _ = build()
    try:
        Checkpointer(CheckpointConfig()).load(path, model, None, {}, model_only=True)
    except CheckpointError as e:
        return str(e)


def _iter_weights(path, tmp_path, capsys):
    try:
        for _ in iter_weights(path):
            pass
    except CheckpointError as e:
        return str(e)


def _cli(main, errors=cli.USER_ERRORS) -> int:
    """Run a tool's main as its ``__main__`` does (run_cli); its exit code."""
    try:
        cli.run_cli(main, errors=errors)
    except SystemExit as e:
        return e.code
    raise AssertionError("run_cli returned without exiting")


def _tool_result(code, capsys):
    err = capsys.readouterr().err.strip().splitlines()
    if code == 0:
        return None
    assert code == 2, (code, err)
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _score(path, tmp_path, capsys):
    code = _cli(lambda: score_tool.main([path, _TOKENS[0], "--seq-len", "16", "--device", "cpu"]))
    return _tool_result(code, capsys)


def _export(path, tmp_path, capsys):
    return _tool_result(convert_hf.main(["export", path, str(tmp_path / "hf")]), capsys)


def _upcycle(path, tmp_path, capsys):
    # tools/upcycle.py's __main__ runs run_cli(main, errors=(ConfigError, CheckpointError, FileNotFoundError)).
    argv = [path, "--output", str(tmp_path / "moe"), "--num-experts", "4", "--top-k", "2"]
    code = _cli(lambda: upcycle_tool.main(argv), errors=(ConfigError, CheckpointError, FileNotFoundError))
    return _tool_result(code, capsys)


_TOKENS: list[str] = []
ALL = set(TARGETS)
WEIGHTS = {".metadata", "tensor", "meta.json", "manifest.json"}
ENTRY_POINTS = {  # name: (run, the targets it reads)
    "resume": (_resume, ALL),
    "init_from": (_init_from, WEIGHTS),
    "iter_weights": (_iter_weights, {".metadata", "tensor"}),
    "score": (_score, WEIGHTS),
    "convert_hf_export": (_export, {".metadata", "tensor", "meta.json"}),
    "upcycle": (_upcycle, WEIGHTS),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_planted_payload_never_runs(base, tmp_path, capsys, entry, target):
    _TOKENS[:] = [base[1]]
    path, bad, marker = plant(base[0], tmp_path, target)
    run, reads = ENTRY_POINTS[entry]
    capsys.readouterr()
    error = run(path, tmp_path, capsys)
    assert not os.path.exists(marker), f"{entry} ran the code planted in {bad}"
    if target in reads:
        assert error is not None, f"{entry} loaded a checkpoint with a payload in {bad}"
        assert bad in error, error
    else:
        assert error is None, error  # a file this entry point does not read is left alone


@pytest.mark.parametrize("target", [".metadata", "rng", "bytes"])
def test_payload_via_open_is_refused(base, tmp_path, target):
    """A payload that calls builtins.open (a builtin, like the containers .metadata may use)."""
    path, bad, marker = plant(base[0], tmp_path, target, via_open=True)
    error = _resume(path, tmp_path, None)
    assert not os.path.exists(marker)
    assert error is not None and bad in error


def test_clean_checkpoint_loads_everywhere(base, tmp_path, capsys):
    """The same entry points load the untampered checkpoint (scheduler enum, RNG, extras included)."""
    _TOKENS[:] = [base[1]]
    path = str(tmp_path / "step_00000001")
    shutil.copytree(base[0], path)
    for name, (run, _) in sorted(ENTRY_POINTS.items()):
        out = tmp_path / name
        out.mkdir()
        assert run(path, out, capsys) is None, name
    _, model, opt, sched = build()
    position = Position()
    Checkpointer(CheckpointConfig()).load(path, model, opt, {"scheduler": sched, "data": position})
    assert position.n == 3 and sched.last_epoch == 1 and sched.lr_lambdas[0].kind == "cosine"


def test_metadata_entry_outside_the_checkpoint_is_refused(base, tmp_path):
    """A well-formed .metadata whose entry points at a file outside the checkpoint dir."""
    path = str(tmp_path / "step_00000001")
    shutil.copytree(base[0], path)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    key = next(iter(md.storage_data))
    md.storage_data[key] = dataclasses.replace(md.storage_data[key], relative_path="../../etc/passwd")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    rehash(path)
    with pytest.raises(CheckpointError, match=r"\.metadata.*outside the checkpoint"):
        SafeFileSystemReader(path).read_metadata()


def test_metadata_build_on_a_class_is_refused(tmp_path):
    """BUILD (set state) on an allowed class object itself would patch the class for the process."""
    from torch.distributed.checkpoint.metadata import Metadata

    os.makedirs(tmp_path / "c")
    # GLOBAL Metadata; EMPTY_DICT (no dict state); slot state {"__init__": "x"}; TUPLE2; BUILD; STOP
    data = b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\nN}\x8c\x08__init__\x8c\x01xs\x86b."
    (tmp_path / "c" / ".metadata").write_bytes(data)
    before = Metadata.__init__
    with pytest.raises(CheckpointError, match="not of DCP metadata"):
        SafeFileSystemReader(str(tmp_path / "c")).read_metadata()
    assert Metadata.__init__ is before


def test_rng_file_of_an_older_version_still_loads(base, tmp_path):
    """Checkpoints written before the RNG state was plain data hold numpy's state as an ndarray."""
    path = str(tmp_path / "step_00000001")
    shutil.copytree(base[0], path)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(old, os.path.join(path, "rng_rank0.pt"))
    rehash(path)
    draws = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    assert _resume(path, tmp_path, None) is None
    assert (random.random(), np.random.rand(), torch.rand(1)) == draws


def test_rng_file_is_plain_data(base):
    """New RNG files load with weights_only=True and nothing allowlisted."""
    state = torch.load(os.path.join(base[0], "rng_rank0.pt"), weights_only=True)
    assert set(state) >= {"python", "numpy", "torch"} and state["numpy"]["keys"].dtype == torch.int64


# ---- tools/pretrain.py, end to end ---------------------------------------------------------------

SMALL = [
    "--model.d_model=64", "--model.n_layers=2", "--model.vocab_size=512", "--model.mlp_hidden=128",
    "--model.attention.n_heads=4", "--model.attention.n_kv_heads=2", "--model.sliding_window=16",
    "--data.seq_len=32", "--data.global_batch_size=4", "--data.corpus_vocab_size=512",
    "--data.corpus_max_bytes=400000", "--trainer.log_interval=1", "--trainer.eval_interval=0",
    "--precision.recipe=fp32", "--scheduler.warmup_steps=1", "--trainer.device=cpu",
]


def pretrain(args, data_dir):
    env = dict(os.environ, MOETRON_DATA_DIR=data_dir, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "pretrain.py"), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrain")
    data_dir, run_dir = str(tmp / "corpus"), str(tmp / "run")
    proc = pretrain([*SMALL, "--trainer.steps=2", f"--trainer.run_dir={run_dir}"], data_dir)
    assert proc.returncode == 0, proc.stderr
    ckpt = os.path.join(run_dir, "checkpoints")
    return data_dir, run_dir, os.path.join(ckpt, sorted(os.listdir(ckpt))[-1])


@pytest.mark.parametrize("target", [".metadata", "rng", "bytes", "init_from"])
def test_pretrain_never_runs_planted_code(trained, tmp_path, target):
    data_dir, run_dir, step_dir = trained
    path, bad, marker = plant(step_dir, tmp_path, ".metadata" if target == "init_from" else target,
                              bytes_fqn="extra/data.sampler.epoch")
    if target == "init_from":
        args = [*SMALL, "--trainer.steps=2", f"--trainer.run_dir={tmp_path / 'new'}", f"--checkpoint.init_from={path}"]
    else:
        args = ["--config", os.path.join(run_dir, "config.yaml"), f"--resume={path}"]
    proc = pretrain(args, data_dir)
    assert not os.path.exists(marker), f"pretrain ran the code planted in {bad}"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and bad in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
