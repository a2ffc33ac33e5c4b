"""Deterministic, resumable global-batch sampler.

Step t of epoch e takes indices ``perm_e[t*G:(t+1)*G]`` (G = global batch size) of the permutation
``perm_e = Generator(PCG64(seed + e)).permutation(num_samples)``; the tail that does not fill a
global batch is dropped. Data-parallel rank r gets the contiguous slice ``[r*L:(r+1)*L]``, L = G/dp.
The position (epoch, step) does not depend on dp, so the union of all ranks' indices equals the
dp=1 indices in the same order and a checkpoint resumes on any dp size that divides G.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moetron.core.config import ConfigError
from moetron.data.tokenizer import DataError

__all__ = ["GlobalBatchSampler"]


def _divisor_hint(global_batch_size: int, dp_size: int) -> str:
    ok_global = [g for g in (global_batch_size - global_batch_size % dp_size, global_batch_size - global_batch_size % dp_size + dp_size) if g > 0]
    ok_dp = [d for d in range(1, global_batch_size + 1) if global_batch_size % d == 0]
    return (
        f"use a global batch size that is a multiple of {dp_size} (e.g. {', '.join(map(str, ok_global))}) "
        f"or a dp size dividing {global_batch_size} ({', '.join(map(str, ok_dp[:12]))})"
    )


class GlobalBatchSampler:
    """Yields this rank's sample indices for each step; see the module docstring for the order."""

    def __init__(self, num_samples: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0):
        if global_batch_size <= 0:
            raise ConfigError(f"global_batch_size={global_batch_size} must be positive")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if global_batch_size % dp_size:
            raise ConfigError(
                f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}: "
                + _divisor_hint(global_batch_size, dp_size)
            )
        if num_samples < global_batch_size:
            raise DataError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch_size}: "
                f"add data, shorten seq_len or lower global_batch_size"
            )
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.local_batch_size = self.global_batch_size // self.dp_size
        self.seed = int(seed)
        self.steps_per_epoch = self.num_samples // self.global_batch_size
        self.epoch = 0
        self.step_in_epoch = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            rng = np.random.Generator(np.random.PCG64(self.seed + epoch))
            self._perm = rng.permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def next_indices(self) -> np.ndarray:
        """This rank's indices for the next step: int64 array [global_batch_size // dp_size]."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
        perm = self._permutation(self.epoch)
        start = self.step_in_epoch * self.global_batch_size + self.dp_rank * self.local_batch_size
        self.step_in_epoch += 1
        return perm[start : start + self.local_batch_size].astype(np.int64)

    @property
    def consumed_samples(self) -> int:
        """Samples taken by all ranks together since the start of training."""
        return (self.epoch * self.steps_per_epoch + self.step_in_epoch) * self.global_batch_size

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.num_samples,
            "consumed_samples": self.consumed_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position; DataError if the data, seed or batch size changed."""
        for key in ("seed", "global_batch_size", "num_samples"):
            if int(state[key]) != getattr(self, key):
                raise DataError(
                    f"cannot resume the data order: the checkpoint has {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}; the data or batch changed since the checkpoint "
                    f"(restore the original data/seed/global_batch_size, or start the data order afresh)"
                )
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if not 0 <= step <= self.steps_per_epoch or epoch < 0:
            raise DataError(f"sampler state epoch={epoch} step_in_epoch={step} is out of range for this data")
        self.epoch, self.step_in_epoch = epoch, step

    def __repr__(self) -> str:
        return (
            f"GlobalBatchSampler(num_samples={self.num_samples}, global_batch_size={self.global_batch_size}, "
            f"dp={self.dp_rank}/{self.dp_size}, seed={self.seed}, epoch={self.epoch}, step={self.step_in_epoch})"
        )
