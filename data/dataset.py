"""Packed fixed-length samples over one or many token files.

Shapes: S = seq_len, B = batch size. A sample is S+1 consecutive tokens (inputs = sample[:-1],
labels = sample[1:]); sample j of a file starts at token j*S, so consecutive samples share one
boundary token and no token is a label twice. Samples never cross files: a file of N tokens gives
(N - 1) // S samples, and its tail is dropped.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from moetron.data.preprocess import open_token_file, token_file_paths
from moetron.data.tokenizer import DataError

__all__ = ["PackedDataset", "scan_max_token_id"]

# Tokens per np.max call while scanning: 64 MiB of uint32, a bounded amount of memory for any size.
_SCAN_CHUNK = 16 << 20


def scan_max_token_id(tokens_N: np.ndarray, chunk: int = _SCAN_CHUNK) -> int:
    """The largest id in ``tokens_N`` (-1 if empty), read in chunks so a memmap is never loaded whole."""
    best = -1
    for start in range(0, len(tokens_N), chunk):
        best = max(best, int(np.max(tokens_N[start : start + chunk])))
    return best


class PackedDataset:
    """Fixed-length windows over token files: ``len(ds)`` samples of ``seq_len + 1`` tokens.

    Args:
        prefixes: token files (prefixes or ``.bin`` paths) written by ``tokenize_files``.
        seq_len: tokens per training sequence S.
        vocab_size: the model's vocabulary size: every id in every file must be below it.
        verify_token_ids: also scan the data itself for its largest id (catches a sidecar that
            lies; costs one sequential read of every file).
    """

    def __init__(self, prefixes: Sequence[str], seq_len: int, vocab_size: int, verify_token_ids: bool = True):
        if isinstance(prefixes, (str, os.PathLike)):
            prefixes = [prefixes]
        if not prefixes:
            raise DataError("PackedDataset needs at least one token file: pass a list of prefixes")
        if seq_len <= 0:
            raise DataError(f"seq_len={seq_len} must be positive")
        if vocab_size <= 0:
            raise DataError(f"vocab_size={vocab_size} must be positive")
        self.seq_len = int(seq_len)
        self.vocab_size = int(vocab_size)
        self.prefixes: list[str] = []
        self.metadata: list[dict] = []
        self._tokens: list[np.ndarray] = []
        samples_per_file = []
        for p in prefixes:
            prefix, bin_path, json_path = token_file_paths(p)
            if not (os.path.exists(bin_path) or os.path.exists(json_path)):
                raise DataError(
                    f"data path {os.fspath(p)!r} does not exist (looked for {bin_path!r} and {json_path!r}): "
                    f"check the path or create it with tools/preprocess_data.py"
                )
            tokens_N, meta = open_token_file(prefix)
            self._check_ids(bin_path, meta, tokens_N, verify_token_ids)
            n = (len(tokens_N) - 1) // self.seq_len
            if n < 1:
                raise DataError(
                    f"token file {bin_path!r} has {len(tokens_N)} tokens, fewer than one sample of "
                    f"seq_len+1={self.seq_len + 1}: use a shorter seq_len or more data"
                )
            self.prefixes.append(prefix)
            self.metadata.append(meta)
            self._tokens.append(tokens_N)
            samples_per_file.append(n)
        # offsets[f] = first global sample index of file f; offsets[-1] = len(self).
        self._offsets = np.concatenate([[0], np.cumsum(samples_per_file)]).astype(np.int64)

    def _check_ids(self, bin_path: str, meta: dict, tokens_N: np.ndarray, verify: bool) -> None:
        largest = max(meta["vocab_size"] - 1, meta["max_token_id"])
        if largest >= self.vocab_size:
            raise DataError(
                f"token ids up to {largest} in {bin_path} but the model's vocab_size is {self.vocab_size}: "
                f"set --model.vocab_size >= {largest + 1} or re-tokenize"
            )
        if verify:
            actual = scan_max_token_id(tokens_N)
            if actual >= self.vocab_size:
                raise DataError(
                    f"token ids up to {actual} in {bin_path} but the model's vocab_size is {self.vocab_size}: "
                    f"set --model.vocab_size >= {actual + 1} or re-tokenize "
                    f"(its sidecar wrongly says max_token_id={meta['max_token_id']})"
                )
            if actual > meta["max_token_id"]:
                raise DataError(
                    f"token file {bin_path} holds id {actual} but its sidecar says max_token_id="
                    f"{meta['max_token_id']}: the file or sidecar is corrupt, re-run preprocessing"
                )

    # ---- sizes ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def num_tokens(self) -> int:
        """Tokens in all files (including the tails that no sample covers)."""
        return int(sum(len(t) for t in self._tokens))

    # ---- access -----------------------------------------------------------------------------
    def __getitem__(self, index: int) -> torch.Tensor:
        """Sample ``index``: LongTensor [S+1]."""
        return self.get_batch([int(index)])[0]

    def get_batch(self, indices: Sequence[int] | np.ndarray, pin_memory: bool = False) -> torch.Tensor:
        """Samples ``indices`` stacked: LongTensor [B, S+1] (B = len(indices)), in page-locked
        memory with ``pin_memory`` (needs CUDA) so a ``non_blocking`` copy to the GPU is asynchronous."""
        index_B = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        bad = index_B[(index_B < -n) | (index_B >= n)]
        if bad.size:
            raise IndexError(f"sample {bad[0]} out of range for a dataset of {n} samples")
        index_B = index_B % n
        file_B = np.searchsorted(self._offsets, index_B, side="right") - 1
        start_B = (index_B - self._offsets[file_B]) * self.seq_len
        # Filled in place: torch's caching host allocator reuses the pinned block once the copy that
        # read it has finished, so there is no per-step cudaHostAlloc and no extra host copy.
        batch_BS1 = torch.empty((len(index_B), self.seq_len + 1), dtype=torch.int64, pin_memory=pin_memory)
        rows = batch_BS1.numpy()
        for row, (f, start) in enumerate(zip(file_B.tolist(), start_B.tolist())):
            rows[row] = self._tokens[f][start : start + self.seq_len + 1]
        return batch_BS1

    def __repr__(self) -> str:
        return f"PackedDataset({len(self.prefixes)} files, {len(self)} samples of seq_len={self.seq_len})"
