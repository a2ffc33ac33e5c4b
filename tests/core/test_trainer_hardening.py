"""The Trainer under bad conditions, in-process on a toy model: NaN/inf detection (stop or skip,
never saved), evaluation planned at start and after the save, the grad norm without clipping,
strict-JSON metrics, load logs across resumes, the step watchdog, and the set-up errors."""

import datetime
import json
import math
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetron.core.checkpoint import CheckpointConfig
from moetron.core.config import Config, ConfigError
from moetron.core.distributed import init_distributed, pick_device
from moetron.core.metrics import MetricsLog
from moetron.core.moe.metrics import LoadLog
from moetron.core.trainer import NonFiniteError, Trainer, TrainerConfig
from tests.distributed import run_distributed

V, S = 16, 8  # toy vocab and sequence length


class _Data:
    """next_batch()/val_batches()/state_dict() over random tokens; ``val_error`` makes the n-th
    val_batches call (1-based) raise, ``val_dataset=None`` means no held-out data."""

    local_batch_size = 2

    def __init__(self, has_val=True, val_error_on_call=None):
        self.val_dataset = object() if has_val else None
        self.val_error_on_call, self.val_calls, self.batches = val_error_on_call, 0, 0

    def next_batch(self):
        self.batches += 1
        return torch.randint(0, V, (2, S + 1), generator=torch.Generator().manual_seed(self.batches))

    def val_batches(self, size, max_batches=None):
        self.val_calls += 1
        if self.val_error_on_call in (self.val_calls, "always"):
            raise ValueError("held-out data is broken")
        return [torch.randint(0, V, (size, S + 1), generator=torch.Generator().manual_seed(0))]

    def state_dict(self):
        return {"batches": self.batches}


class _Saves:
    """A checkpointer that records the steps it was asked to save."""

    def __init__(self, interval=1):
        self.cfg = CheckpointConfig(dir="unused", interval=interval)
        self.steps = []

    def save(self, step, model, optimizer, extra, meta):
        self.steps.append(step)
        return f"step_{step}"


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _trainer(data=None, checkpointer=None, bad_grad_at=None, on_step_end=None, **cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, 8), nn.Linear(8, V))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = {"step": 0}

    def poison(parts):  # a NaN gradient in step ``bad_grad_at``
        state["step"] += 1
        if state["step"] == bad_grad_at:
            next(parts[0].parameters()).grad.fill_(math.nan)

    cfg = TrainerConfig(**{"steps": 5, "log_interval": 10, "eval_batches": 0, "run_dir": "", **cfg})
    return Trainer(cfg, model, _loss, optimizer, scheduler, data or _Data(), flops_per_token=1.0,
                   device=torch.device("cpu"), checkpointer=checkpointer, pre_step_hook=poison,
                   on_step_end=on_step_end)


# ---- non-finite loss / grad norm ----------------------------------------------------------


def test_nonfinite_stops_naming_the_step_and_is_never_saved():
    saves = _Saves(interval=1)
    trainer = _trainer(checkpointer=saves, bad_grad_at=3)
    with pytest.raises(NonFiniteError, match="step 3 had a non-finite"):
        trainer.fit()
    assert saves.steps == [1, 2]  # the check before each save caught it (no log step in between)


def test_nonfinite_is_caught_on_the_log_step():
    trainer = _trainer(bad_grad_at=2, log_interval=3)
    with pytest.raises(NonFiniteError, match="step 2 had a non-finite"):
        trainer.fit()
    assert trainer.step == 3 and math.isnan(trainer.history[-1]["loss"])  # the row is still logged


def test_nonfinite_skip_drops_the_update_and_keeps_training():
    saves, params = _Saves(interval=1), {}
    trainer = _trainer(checkpointer=saves, bad_grad_at=3, on_nonfinite="skip", log_interval=1,
                       on_step_end=lambda step, rec: params.__setitem__(step, [p.clone() for p in trainer.params]))
    trainer.fit()
    assert saves.steps == [1, 2, 3, 4, 5] and trainer.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(params[2], params[3]))  # step 3 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(params[3], params[4]))
    assert [r["skipped_steps"] for r in trainer.history] == [0, 0, 1, 1, 1]


def test_nonfinite_parameters_are_never_saved_even_when_skipping():
    saves = _Saves(interval=1)

    def break_weights(step, record):
        if step == 2:
            with torch.no_grad():
                trainer.params[1].fill_(math.inf)

    trainer = _trainer(checkpointer=saves, on_nonfinite="skip", on_step_end=break_weights)
    with pytest.raises(NonFiniteError, match="parameters are NaN/inf after step 3"):
        trainer.fit()
    assert saves.steps == [1, 2]


def test_grad_norm_is_logged_without_clipping():
    trainer = _trainer(grad_clip=0.0, log_interval=1)
    trainer.fit()
    norms = [r["grad_norm"] for r in trainer.history]
    assert len(norms) == 5 and all(n > 0 and math.isfinite(n) for n in norms)
    with pytest.raises(ConfigError, match="trainer.grad_clip"):
        TrainerConfig(grad_clip=-1.0).validate()


# ---- evaluation ---------------------------------------------------------------------------


def test_no_held_out_data_skips_evaluation_and_still_saves(capsys):
    saves = _Saves(interval=0)
    trainer = _trainer(data=_Data(has_val=False), checkpointer=saves, eval_batches=2)
    trainer.fit()
    assert saves.steps == [5] and all("eval_loss" not in r for r in trainer.history)
    assert "held-out evaluation is off" in capsys.readouterr().out


def test_final_evaluation_runs_after_the_final_save():
    saves = _Saves(interval=0)
    data = _Data(val_error_on_call=2)  # the start check passes; the final evaluation fails
    trainer = _trainer(data=data, checkpointer=saves, eval_batches=2)
    with pytest.raises(ValueError, match="held-out data is broken"):
        trainer.fit()
    assert saves.steps == [5]


def test_bad_held_out_data_fails_before_the_first_step():
    data = _Data(val_error_on_call="always")
    with pytest.raises(ValueError, match="held-out data is broken"):
        _trainer(data=data, eval_batches=2).fit()
    assert data.batches == 0
    with pytest.raises(ConfigError, match="trainer.eval_batch_size"):
        TrainerConfig(eval_batch_size=0).validate()


# ---- logs ---------------------------------------------------------------------------------


def _strict(line):
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))


def test_metrics_log_is_strict_json_and_truncates_after_a_step(tmp_path):
    log = MetricsLog(str(tmp_path / "metrics.jsonl"))
    log.write({"step": 1, "loss": math.nan, "grad_norm": math.inf, "x": -math.inf, "a": [np.float32("nan"), 1.5]})
    for step in (2, 3, 4):
        log.write({"step": step, "loss": 1.0})
    rows = [_strict(line) for line in open(log.path)]
    assert rows[0] == {"step": 1, "loss": None, "grad_norm": None, "x": None, "a": [None, 1.5]}
    assert log.truncate_after(2) == 2
    assert [_strict(line)["step"] for line in open(log.path)] == [1, 2]


def _summary(step):
    tokens = np.array([[step, 1.0], [2.0, 2.0]])
    return {"layers": np.array([1, 3]), "tokens_per_expert": tokens, "dropped": np.zeros(2), "entropy": np.ones(2),
            "max_violation": tokens.max(1) / tokens.mean(1) - 1}


def test_load_log_appends_across_a_resume(tmp_path):
    path = str(tmp_path / "moe_load.npz")
    first = LoadLog(path)
    for step in (10, 20, 30):
        first.add(step, _summary(step))
    resumed = LoadLog(path)
    resumed.resume(20)  # the checkpoint was at step 20: step 30 is trained again
    resumed.add(30, _summary(31))
    resumed.add(40, _summary(40))
    saved = np.load(path)
    np.testing.assert_array_equal(saved["step"], [10, 20, 30, 40])
    np.testing.assert_array_equal(saved["tokens_per_expert"][:, 0, 0], [10, 20, 31, 40])
    np.testing.assert_array_equal(saved["layers"], [1, 3])


# ---- the watchdog and the collective timeout ----------------------------------------------


def _hang_on_rank_1(rank, world):
    def stall(step, record):
        if rank == 1 and step == 2:
            time.sleep(60)  # rank 0 waits in step 3's log all-reduce meanwhile

    # 8 s: far above a tiny step even on a loaded 2-core machine, far below the 60 s sleep
    _trainer(log_interval=1, collective_timeout_s=8.0, on_step_end=stall).fit()


def test_watchdog_names_the_stuck_rank_and_step(capfd):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 1"):
        run_distributed(_hang_on_rank_1, 2, timeout_s=50)
    assert time.monotonic() - t0 < 45  # not the collective's 30 minutes, nor the 60 s sleep
    err = capfd.readouterr().err
    # The hung rank's watchdog, or its peer's (waiting in step 3's all-reduce), may fire first: either
    # names the rank and the step it is stuck in.
    assert "rank 1 stuck at step 2" in err or "rank 0 stuck at step 3" in err, err


def test_collective_timeout_reaches_the_process_group(monkeypatch):
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    assert init_distributed(torch.device("cpu"), timeout_s=7.5) == (0, 2)
    assert seen["backend"] == "gloo" and seen["timeout"] == datetime.timedelta(seconds=7.5)
    with pytest.raises(ConfigError, match="collective_timeout_s"):
        TrainerConfig(collective_timeout_s=0).validate()


# ---- set-up errors ------------------------------------------------------------------------


def test_device_errors_are_config_errors():
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            pick_device("cuda")
    for bad in ("tpu", "not-a-device"):
        with pytest.raises(ConfigError, match="trainer.device"):
            pick_device(bad)


def test_config_path_errors(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        Config.from_yaml(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match="is not UTF-8"):
        Config.from_yaml(tmp_path / "latin1.yaml")
