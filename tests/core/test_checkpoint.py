"""Checkpointer: bit-exact round trips and resumption, crash safety, corruption, pruning, 2 ranks."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.distributed
from tests.distributed import run_distributed  # noqa: E402

from moetron.core.checkpoint import CheckpointConfig, CheckpointError, Checkpointer  # noqa: E402
from moetron.core.config import ConfigError  # noqa: E402


class Counter:
    """A tiny Stateful, like a data loader's position."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self):
        return {"n": self.n, "history": [self.n - 1, self.n]}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched, Counter()


def train(model, opt, sched, counter, steps: int):
    for _ in range(steps):
        x = torch.randn(5, 8)  # drawn from the global RNG: resumption must restore it
        y = torch.randn(5, 4)
        loss = ((model(x) - y) ** 2).mean() + 0.01 * np.random.rand() + 0.01 * random.random()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        counter.n += 1


def assert_same_state(a: nn.Module, b: nn.Module, oa, ob):
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for k in sa["state"]:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["state"][k][field], sb["state"][k][field]), (k, field)


def ckpt(tmp_path, **kw) -> Checkpointer:
    return Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt"), **kw))


# ---- config ----------------------------------------------------------------------------------


def test_config_validation():
    CheckpointConfig(dir="x", interval=10).validate()
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointConfig(keep_last=-1).validate()
    with pytest.raises(ConfigError, match="interval"):
        CheckpointConfig(interval=-5).validate()
    cfg = CheckpointConfig(dir="x", interval=10)
    assert cfg.should_save(20) and not cfg.should_save(25) and cfg.should_save(25, final=True)
    assert not CheckpointConfig(dir=None, interval=1).should_save(1)
    assert not CheckpointConfig(dir=None, interval=1).should_save(1, final=True)
    # The last step saves if it is final (save_final) or on the interval.
    no_final = CheckpointConfig(dir="x", interval=10, save_final=False)
    assert no_final.should_save(20, final=True) and not no_final.should_save(25, final=True)
    assert CheckpointConfig(dir="x").should_save(7, final=True) and not CheckpointConfig(dir="x").should_save(7)


# ---- round trip and resumption ---------------------------------------------------------------


def test_round_trip_bit_exact(tmp_path):
    model, opt, sched, counter = build(0)
    train(model, opt, sched, counter, 3)
    cp = ckpt(tmp_path)
    extra = {"sched": sched, "counter": counter, "tokens_seen": 12345, "tag": "run-a",
             "ema": torch.arange(3.0)}
    path = cp.save(3, model, opt, extra, {"config": {"lr": 1e-2}})
    assert os.path.basename(path) == "step_00000003" and cp.latest() == path
    after_save = (torch.rand(4), np.random.rand(3), random.random())

    model2, opt2, sched2, counter2 = build(1)
    extra2 = {"sched": sched2, "counter": counter2, "tokens_seen": 0, "tag": "", "ema": torch.zeros(3)}
    meta = cp.load(path, model2, opt2, extra2)
    after_load = (torch.rand(4), np.random.rand(3), random.random())

    assert_same_state(model, model2, opt, opt2)
    assert sched2.state_dict() == sched.state_dict() and sched2.get_last_lr() == sched.get_last_lr()
    assert counter2.n == 3
    assert extra2["tokens_seen"] == 12345 and extra2["tag"] == "run-a"
    assert torch.equal(extra2["ema"], torch.arange(3.0))
    assert torch.equal(after_save[0], after_load[0])
    assert np.array_equal(after_save[1], after_load[1]) and after_save[2] == after_load[2]
    assert meta["config"] == {"lr": 1e-2} and meta["step"] == 3 and meta["world_size"] == 1
    assert meta["torch_version"] == torch.__version__
    assert cp.read_metadata(path) == meta
    manifest = json.loads(Path(path, "manifest.json").read_text())
    assert {"meta.json", ".metadata", "rng_rank0.pt"} <= set(manifest["files"])
    assert set(manifest["files"]) == set(os.listdir(path)) - {"manifest.json"}


def test_resume_equals_uninterrupted(tmp_path):
    model_a, opt_a, sched_a, counter_a = build(0)
    torch.manual_seed(123)
    train(model_a, opt_a, sched_a, counter_a, 6)

    model_b, opt_b, sched_b, counter_b = build(0)
    torch.manual_seed(123)
    train(model_b, opt_b, sched_b, counter_b, 3)
    cp = ckpt(tmp_path)
    cp.save(3, model_b, opt_b, {"sched": sched_b, "counter": counter_b}, {})
    torch.manual_seed(999)  # the resumed process starts with other RNG state and fresh objects
    model_c, opt_c, sched_c, counter_c = build(7)
    cp.load(cp.resolve(True), model_c, opt_c, {"sched": sched_c, "counter": counter_c})
    train(model_c, opt_c, sched_c, counter_c, 3)

    assert_same_state(model_a, model_c, opt_a, opt_c)
    assert counter_c.n == 6


def test_resave_same_step_replaces(tmp_path):
    model, opt, sched, counter = build(0)
    cp = ckpt(tmp_path)
    cp.save(5, model, opt, {}, {"v": 1})
    with torch.no_grad():
        model[0].weight.add_(1.0)
    path = cp.save(5, model, opt, {}, {"v": 2})
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000005"]
    model2, opt2, _, _ = build(3)
    assert cp.load(path, model2, opt2, {})["v"] == 2
    assert torch.equal(model2[0].weight, model[0].weight)


# ---- crash safety ----------------------------------------------------------------------------

_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from moetron.core.checkpoint import CheckpointConfig, Checkpointer
    torch.manual_seed(0)
    model = nn.Linear(8192, 8192, bias=False)  # 256 MiB: saving takes long enough to be killed
    cp = Checkpointer(CheckpointConfig(dir=sys.argv[1], keep_last=1))
    cp.save(1, model, None, {"note": "one"}, {"step": 1})
    print("saved 1", flush=True)
    with torch.no_grad():
        model.weight.add_(1.0)
    cp.save(2, model, None, {"note": "two"}, {"step": 2})
    print("saved 2", flush=True)
    """
)


def test_sigkill_during_save_keeps_previous(tmp_path):
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 40
        tmp_dirs = []
        while not tmp_dirs:
            assert proc.poll() is None, f"saver exited early: {proc.communicate()}"
            assert time.monotonic() < deadline, "the step-2 save never started"
            tmp_dirs = list(root.glob(".step_00000002.tmp-*")) if root.exists() else []
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read()
    assert "saved 1" in out and "saved 2" not in out
    assert not (root / "step_00000002").exists()  # killed before the rename, as intended

    cp = Checkpointer(CheckpointConfig(dir=str(root), keep_last=1))
    assert cp.latest() == str(root / "step_00000001")
    target = nn.Linear(8192, 8192, bias=False, device="meta").to_empty(device="cpu")
    extra = {"note": None}
    meta = cp.load(cp.resolve(True), target, None, extra)
    assert meta["step"] == 1 and extra["note"] == "one"
    torch.manual_seed(0)
    expected = nn.Linear(8192, 8192, bias=False)
    assert torch.equal(target.weight, expected.weight)
    del target, expected

    # The next successful save clears the crashed tmp dir and prunes step 1 only once it is done.
    small = nn.Linear(2, 2)
    Checkpointer(CheckpointConfig(dir=str(root), keep_last=1)).save(3, small, None, {}, {})
    assert sorted(os.listdir(root)) == ["step_00000003"]


# ---- corruption ------------------------------------------------------------------------------


def _saved(tmp_path, steps=(1,)):
    model, opt, sched, counter = build(0)
    cp = ckpt(tmp_path, keep_last=0)
    paths = [cp.save(s, model, opt, {"sched": sched}, {}) for s in steps]
    return cp, paths


def _load_fresh(cp, path):
    model, opt, sched, _ = build(1)
    return cp.load(path, model, opt, {"sched": sched})


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupted_data_file_raises(tmp_path, damage):
    cp, (path,) = _saved(tmp_path)
    distcp = sorted(Path(path).glob("*.distcp"))[0]
    data = bytearray(distcp.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        distcp.write_bytes(bytes(data))
    elif damage == "truncate":
        distcp.write_bytes(bytes(data[:-7]))
    else:
        distcp.unlink()
    with pytest.raises(CheckpointError) as e:
        _load_fresh(cp, path)
    msg = str(e.value)
    assert path in msg and distcp.name in msg and "older checkpoint" in msg


def test_garbled_meta_and_manifest_raise(tmp_path):
    cp, (path,) = _saved(tmp_path)
    meta = Path(path, "meta.json")
    meta.write_text(meta.read_text()[:-3])
    with pytest.raises(CheckpointError, match="meta.json"):
        _load_fresh(cp, path)
    with pytest.raises(CheckpointError, match="meta.json cannot be read"):
        cp.read_metadata(path)
    Path(path, "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json"):
        _load_fresh(cp, path)


def test_missing_manifest_is_incomplete(tmp_path, caplog):
    cp, (p1, p2) = _saved(tmp_path, steps=(1, 2))
    os.remove(os.path.join(p2, "manifest.json"))
    with caplog.at_level("WARNING"):
        assert cp.latest() == p1
    assert "step_00000002" in caplog.text
    assert cp.resolve(True) == p1
    with pytest.raises(CheckpointError, match="manifest.json is missing") as e:
        _load_fresh(cp, p2)
    assert p2 in str(e.value)
    _load_fresh(cp, p1)


def test_resolve_empty_dir_raises(tmp_path):
    cp = ckpt(tmp_path)
    os.makedirs(cp.cfg.dir)
    os.makedirs(os.path.join(cp.cfg.dir, ".step_00000004.tmp-abc"))  # a crashed save does not count
    with pytest.raises(CheckpointError, match="--resume was given but .* holds no complete checkpoint; "
                                              "run without --resume to start fresh"):
        cp.resolve(True)
    assert cp.resolve(False) is None
    with pytest.raises(CheckpointError, match="checkpoint.dir is not set"):
        Checkpointer(CheckpointConfig()).resolve(True)


def test_model_mismatch_names_keys(tmp_path):
    cp, (path,) = _saved(tmp_path)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))  # head changed 4 -> 5
    with pytest.raises(CheckpointError, match=r"shape mismatches: model\.2\.bias \(checkpoint \(4,\), now \(5,\)\), model\.2\.weight"):
        cp.load(path, other, None, {})
    bigger = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4))
    with pytest.raises(CheckpointError, match=r"keys missing from the checkpoint: model\.3\.bias"):
        cp.load(path, bigger, None, {})
    smaller = nn.Sequential(nn.Linear(8, 16))
    with pytest.raises(CheckpointError, match=r"the model lacks: model\.2\.bias"):
        cp.load(path, smaller, None, {})


# ---- pruning ---------------------------------------------------------------------------------


def test_keep_last_prunes_oldest(tmp_path):
    model, opt, _, _ = build(0)
    cp = ckpt(tmp_path, keep_last=2)
    stale = tmp_path / "ckpt" / ".step_00000009.tmp-deadbeef"
    stale.mkdir(parents=True)
    for step in (10, 20, 30, 40):
        cp.save(step, model, opt, {}, {})
    assert sorted(os.listdir(cp.cfg.dir)) == ["step_00000030", "step_00000040"]
    with pytest.raises(CheckpointError, match="not JSON-able"):
        cp.save(50, model, opt, {}, {"bad": object()})
    assert sorted(os.listdir(cp.cfg.dir)) == ["step_00000030", "step_00000040"]
    keep_all = Checkpointer(CheckpointConfig(dir=str(tmp_path / "all"), keep_last=0))
    for step in (1, 2, 3):
        keep_all.save(step, model, opt, {}, {})
    assert len(os.listdir(keep_all.cfg.dir)) == 3


# ---- two ranks -------------------------------------------------------------------------------


def _two_rank_save(rank: int, world_size: int, root: str, single_rank_ckpt: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, opt, sched, counter = build(0)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    torch.manual_seed(0)  # same data on both ranks: replicas stay identical
    train(ddp, opt, sched, counter, 2)
    cp = Checkpointer(CheckpointConfig(dir=root))
    torch.manual_seed(100 + rank)
    cp.save(2, ddp, opt, {"sched": sched, "counter": counter}, {"ranks": world_size})

    # Loading a 1-rank checkpoint on 2 ranks: rank 1 has no RNG file and keeps its own state.
    model2, opt2, sched2, counter2 = build(5)
    torch.manual_seed(200 + rank)
    expected_after = torch.rand(3)
    torch.manual_seed(200 + rank)
    cp.load(single_rank_ckpt, DDP(model2), opt2, {"sched": sched2, "counter": counter2})
    draw = torch.rand(3)
    if rank == 1:
        assert torch.equal(draw, expected_after)
    else:
        assert not torch.equal(draw, expected_after)
    assert counter2.n == 2


def test_two_rank_save_loads_in_one_process(tmp_path):
    # A single-process checkpoint for the ranks to load (same training as the ranks do).
    model, opt, sched, counter = build(0)
    torch.manual_seed(0)
    train(model, opt, sched, counter, 2)
    single = ckpt(tmp_path / "single").save(2, model, opt, {"sched": sched, "counter": counter}, {})

    root = str(tmp_path / "ddp")
    run_distributed(_two_rank_save, 2, root, single)

    cp = Checkpointer(CheckpointConfig(dir=root))
    path = cp.latest()
    assert sorted(f for f in os.listdir(path) if f.startswith("rng_")) == ["rng_rank0.pt", "rng_rank1.pt"]
    model2, opt2, sched2, counter2 = build(9)
    meta = cp.load(path, model2, opt2, {"sched": sched2, "counter": counter2})
    assert meta["world_size"] == 2 and meta["ranks"] == 2
    assert_same_state(model, model2, opt, opt2)
    assert sched2.state_dict() == sched.state_dict() and counter2.n == 2
    # This process took rank 0's RNG; rank 1's file holds its own.
    torch.manual_seed(100)
    rank0_draw = torch.rand(3)
    cp.load(path, model2, opt2, {})
    assert torch.equal(torch.rand(3), rank0_draw)
    rng1 = torch.load(os.path.join(path, "rng_rank1.pt"), weights_only=False)
    torch.manual_seed(101)
    assert torch.equal(rng1["torch"], torch.get_rng_state())
