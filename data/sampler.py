"""Deterministic, resumable global-batch sampler.

Step t of epoch e takes indices ``perm_e[t*G:(t+1)*G]`` (G = global batch size) of the permutation
``perm_e = Generator(PCG64(seed + e)).permutation(num_samples)``; the tail that does not fill a
global batch is dropped. Data-parallel rank r gets the contiguous slice ``[r*L:(r+1)*L]``, L = G/dp.
The position (epoch, step) does not depend on dp, so the union of all ranks' indices equals the
dp=1 indices in the same order and a checkpoint resumes on any dp size that divides G.

``MixtureSampler`` draws each global batch from several sources (contiguous index ranges of one
dataset) in fixed proportions; see its docstring. The same dp rules hold.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from moetron.core.config import ConfigError
from moetron.data.tokenizer import DataError

__all__ = ["GlobalBatchSampler", "MixtureSampler"]


def _divisor_hint(global_batch_size: int, dp_size: int) -> str:
    ok_global = [g for g in (global_batch_size - global_batch_size % dp_size, global_batch_size - global_batch_size % dp_size + dp_size) if g > 0]
    ok_dp = [d for d in range(1, global_batch_size + 1) if global_batch_size % d == 0]
    return (
        f"use a global batch size that is a multiple of {dp_size} (e.g. {', '.join(map(str, ok_global))}) "
        f"or a dp size dividing {global_batch_size} ({', '.join(map(str, ok_dp[:12]))})"
    )


def _check_batch(global_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if global_batch_size <= 0:
        raise ConfigError(f"global_batch_size={global_batch_size} must be positive")
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ConfigError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    if global_batch_size % dp_size:
        raise ConfigError(
            f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}: "
            + _divisor_hint(global_batch_size, dp_size)
        )


def _refuse_changed(state: dict[str, Any], key: str, ours: Any) -> None:
    raise DataError(
        f"cannot resume the data order: the checkpoint has {key}={state[key]} but this run has "
        f"{key}={ours}; the data or batch changed since the checkpoint "
        f"(restore the original data/seed/global_batch_size, or start the data order afresh)"
    )


class GlobalBatchSampler:
    """Yields this rank's sample indices for each step; see the module docstring for the order."""

    def __init__(self, num_samples: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0):
        _check_batch(global_batch_size, dp_rank, dp_size)
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
        if "source_sizes" in state:
            raise DataError(
                "cannot resume the data order: the checkpoint was written with data.mixture and this run has "
                "data.train_paths: restore the original data settings"
            )
        for key in ("seed", "global_batch_size", "num_samples"):
            if int(state[key]) != getattr(self, key):
                _refuse_changed(state, key, getattr(self, key))
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if not 0 <= step <= self.steps_per_epoch or epoch < 0:
            raise DataError(f"sampler state epoch={epoch} step_in_epoch={step} is out of range for this data")
        self.epoch, self.step_in_epoch = epoch, step

    def __repr__(self) -> str:
        return (
            f"GlobalBatchSampler(num_samples={self.num_samples}, global_batch_size={self.global_batch_size}, "
            f"dp={self.dp_rank}/{self.dp_size}, seed={self.seed}, epoch={self.epoch}, step={self.step_in_epoch})"
        )


class MixtureSampler:
    """Global batches drawn from several sources in fixed proportions, deterministic and resumable.

    Source i is the index range ``[offsets[i], offsets[i] + sizes[i])`` of one dataset, with
    weight ``w_i`` (normalised to sum 1). Step t (global batch of G) takes ``n_i`` samples from
    source i: after the step each source's total c_i is within about one sample of ``w_i * (t+1) * G``
    (the whole deficit ``w_i * (t+1) * G - c_i`` rounded down, the rest of the batch to the largest
    remainders, ties to the lower index). Source i's samples come in the order of its own
    permutations, epoch after epoch (a small source repeats, a large one is not used up): its p-th
    sample is ``perm_{i,e}[p % sizes[i]]``, e = p // sizes[i], ``perm_{i,e}`` seeded with
    ``[seed, 0, i, e]``. The batch's G indices are then shuffled with ``[seed, 1, t]`` and rank r
    takes the r-th contiguous slice, so the order does not depend on the dp size. The state is the
    step and the per-source totals.
    """

    def __init__(
        self,
        source_sizes: Sequence[int],
        weights: Sequence[float],
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        names: Sequence[str] | None = None,
    ):
        _check_batch(global_batch_size, dp_rank, dp_size)
        if len(source_sizes) != len(weights) or not source_sizes:
            raise ConfigError(f"a mixture needs one weight per source: {len(source_sizes)} sources, {len(weights)} weights")
        weights_M = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(weights_M)) or np.any(weights_M <= 0):
            raise ConfigError(f"mixture weights {list(weights)} must be positive numbers (drop a source to leave it out)")
        if any(int(n) < 1 for n in source_sizes):
            raise DataError(f"every mixture source needs at least one sample; sizes are {list(source_sizes)}")
        self.source_sizes = [int(n) for n in source_sizes]
        self.weights = (weights_M / weights_M.sum()).tolist()
        self.names = list(names) if names is not None else [f"source{i}" for i in range(len(source_sizes))]
        self.num_samples = sum(self.source_sizes)
        self.global_batch_size = int(global_batch_size)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.local_batch_size = self.global_batch_size // self.dp_size
        self.seed = int(seed)
        self.step = 0
        self.counts_M = np.zeros(len(self.source_sizes), dtype=np.int64)
        self._offsets_M = np.concatenate([[0], np.cumsum(self.source_sizes)[:-1]]).astype(np.int64)
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, its permutation)

    def _allocation(self) -> np.ndarray:
        """Samples per source for the next global batch: int64 [M], summing to G."""
        G = self.global_batch_size
        deficit_M = np.asarray(self.weights) * float(self.counts_M.sum() + G) - self.counts_M
        take_M = np.maximum(np.floor(deficit_M), 0).astype(np.int64)
        while take_M.sum() > G:  # only when a source was served ahead: trim the most served first
            i = int(np.argmin(np.where(take_M > 0, deficit_M - take_M, np.inf)))
            take_M[i] -= 1
        while take_M.sum() < G:
            order = np.argsort(-(deficit_M - take_M), kind="stable")
            take_M[order[: G - int(take_M.sum())]] += 1
        return take_M

    def _source_indices(self, source: int, start: int, count: int) -> np.ndarray:
        """Dataset indices of source ``source``'s samples ``start .. start+count-1``: int64 [count]."""
        size, out = self.source_sizes[source], []
        while count > 0:
            epoch, pos = divmod(start, size)
            cached = self._perms.get(source)
            if cached is None or cached[0] != epoch:
                rng = np.random.Generator(np.random.PCG64([self.seed, 0, source, epoch]))
                cached = self._perms[source] = (epoch, rng.permutation(size))
            part = cached[1][pos : pos + count]
            out.append(part)
            start, count = start + len(part), count - len(part)
        return np.concatenate(out).astype(np.int64) + self._offsets_M[source]

    def next_indices(self) -> np.ndarray:
        """This rank's indices for the next step: int64 array [global_batch_size // dp_size]."""
        take_M = self._allocation()
        batch_G = np.concatenate(
            [self._source_indices(i, int(self.counts_M[i]), int(n)) for i, n in enumerate(take_M) if n]
        )
        order = np.random.Generator(np.random.PCG64([self.seed, 1, self.step])).permutation(len(batch_G))
        self.counts_M += take_M
        self.step += 1
        start = self.dp_rank * self.local_batch_size
        return batch_G[order][start : start + self.local_batch_size]

    @property
    def consumed_samples(self) -> int:
        """Samples taken by all ranks together since the start of training."""
        return self.step * self.global_batch_size

    def shares(self) -> dict[str, float]:
        """The realised fraction of all samples so far that each source gave, by name."""
        total = max(int(self.counts_M.sum()), 1)
        return {name: int(c) / total for name, c in zip(self.names, self.counts_M)}

    def epochs(self) -> dict[str, float]:
        """How many passes over each source so far (above 1: the source repeats)."""
        return {name: int(c) / n for name, c, n in zip(self.names, self.counts_M, self.source_sizes)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "counts": [int(c) for c in self.counts_M],
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "source_sizes": list(self.source_sizes),
            "weights": list(self.weights),
            "consumed_samples": self.consumed_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position; DataError if the sources, weights, seed or batch changed."""
        if "source_sizes" not in state:
            raise DataError(
                "cannot resume the data order: the checkpoint was written without a mixture (data.train_paths) "
                "and this run has data.mixture: restore the original data settings"
            )
        for key in ("seed", "global_batch_size"):
            if int(state[key]) != getattr(self, key):
                _refuse_changed(state, key, getattr(self, key))
        if [int(n) for n in state["source_sizes"]] != self.source_sizes:
            _refuse_changed(state, "source_sizes", self.source_sizes)
        if not np.allclose(state["weights"], self.weights, rtol=1e-12, atol=0):
            _refuse_changed(state, "weights", self.weights)
        step, counts_M = int(state["step"]), np.asarray(state["counts"], dtype=np.int64)
        if step < 0 or np.any(counts_M < 0) or int(counts_M.sum()) != step * self.global_batch_size:
            raise DataError(f"mixture sampler state step={step} counts={counts_M.tolist()} is inconsistent")
        self.step, self.counts_M = step, counts_M
        self._perms.clear()

    def __repr__(self) -> str:
        mix = ", ".join(f"{n}={w:.3g}" for n, w in zip(self.names, self.weights))
        return (
            f"MixtureSampler({mix}; global_batch_size={self.global_batch_size}, dp={self.dp_rank}/{self.dp_size}, "
            f"seed={self.seed}, step={self.step})"
        )
