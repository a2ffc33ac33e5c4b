"""trainer.deterministic: torch's deterministic kernels for bit-reproducible A/B checks.

Oracles: torch's own flags (torch.are_deterministic_algorithms_enabled, the cuBLAS workspace variable) for
what the switch sets; on the GPU, a second run of the same configuration, seed and data, which must give the
same losses and weights bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from moetron.core.config import ConfigError
from moetron.core.trainer import TrainerConfig


@pytest.fixture
def restore_determinism(monkeypatch):
    """The process-wide flags as they were (off), whatever the test turns on."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.utils.deterministic.fill_uninitialized_memory = before[1]


def _run(device: str, deterministic: bool, steps: int = 3, seq_len: int = 32, compile: bool = False,
         fill: bool | None = None):
    """A tiny MoE's losses and weights (the fp32 masters) after ``steps`` steps of the benchmarks' trainer;
    ``fill`` sets torch's fill of uninitialized memory after the trainer is built (None: as the trainer left it)."""
    from step_builder import RandomTokens, build_trainer, step_configs  # tools/ (tests/conftest.py)

    from moetron.core.memory import MemoryConfig
    from moetron.models import ModelConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2"])
    dev = torch.device(device)
    data = RandomTokens(cfg.vocab_size, 4, seq_len, dev)
    trainer_cfg = step_configs("tiny-moe", "auto", [f"--trainer.deterministic={str(deterministic).lower()}"]).trainer
    trainer = build_trainer(cfg, MemoryConfig(), data, dev, seq_len=seq_len, compile=compile, trainer=trainer_cfg)
    if fill is not None:
        torch.utils.deterministic.fill_uninitialized_memory = fill
    losses = [trainer.train_step(data.next_batch())[0].item() for _ in range(steps)]
    with trainer.masters_materialized():
        weights = {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
    return losses, weights, trainer


def test_deterministic_sets_torchs_flags_per_trainer(restore_determinism):
    """--trainer.deterministic=true (a benchmarked step takes it too) turns torch's deterministic algorithms on and
    sets the cuBLAS workspace variable where unset (a value of the user's is kept), with torch's NaN fill of
    uninitialized memory off; the benchmarks' next trainer without it turns them off again, the fill back to torch's
    default (the flags are the process's, so each variant sets its own); the run trains."""
    losses, _, _ = _run("cpu", True)
    assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.utils.deterministic.fill_uninitialized_memory
    assert losses[2] < losses[0]
    _run("cpu", False, steps=1)
    assert not torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    _run("cpu", True, steps=1)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert not TrainerConfig().deterministic
    with pytest.raises(ConfigError, match="deterministic"):
        TrainerConfig().apply_overrides(["--deterministic=maybe"])


@pytest.mark.gpu
def test_deterministic_steps_repeat_bit_for_bit_on_gpu(restore_determinism):
    """On CUDA, compiled, the default precision (bf16 with the weight copies and split masters), sequences of 512
    (several key blocks a query block in attention's backward): two runs with trainer.deterministic give the same
    losses and weights bit for bit, the second with torch's NaN fill of uninitialized memory back on (which the
    switch turns off: no op of the step reads memory it did not write, or the fill would change its values)."""
    first, w_first, _ = _run("cuda", True, steps=4, seq_len=512, compile=True)
    torch._dynamo.reset()
    second, w_second, trainer = _run("cuda", True, steps=4, seq_len=512, compile=True, fill=True)
    assert trainer.optimizer.split_parameters()  # the default on one GPU
    assert first == second and first[3] != first[0]
    assert all(torch.equal(w_first[k], w_second[k]) for k in w_first)
