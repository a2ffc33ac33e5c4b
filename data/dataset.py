"""Packed fixed-length samples over one or many token files (any format of moetron.data.formats).

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

from moetron.data.formats import TokenFile, TokenFormat, open_tokens
from moetron.data.tokenizer import DataError

__all__ = ["PackedDataset", "scan_max_token_id", "scan_token_range"]

# Tokens per np.max call while scanning: 64 MiB of uint32, a bounded amount of memory for any size.
_SCAN_CHUNK = 16 << 20


def scan_token_range(tokens_N: np.ndarray, chunk: int = _SCAN_CHUNK) -> tuple[int, int]:
    """``(smallest, largest)`` id in ``tokens_N`` (``(0, -1)`` if empty), read in chunks so a memmap
    is never loaded whole; the smallest is looked for only in signed dtypes (else 0)."""
    signed = np.issubdtype(tokens_N.dtype, np.signedinteger)
    lowest, best = 0, -1
    for start in range(0, len(tokens_N), chunk):
        part = tokens_N[start : start + chunk]
        best = max(best, int(np.max(part)))
        if signed:
            lowest = min(lowest, int(np.min(part)))
    return lowest, best


def scan_max_token_id(tokens_N: np.ndarray, chunk: int = _SCAN_CHUNK) -> int:
    """The largest id in ``tokens_N`` (-1 if empty)."""
    return scan_token_range(tokens_N, chunk)[1]


class PackedDataset:
    """Fixed-length windows over token files: ``len(ds)`` samples of ``seq_len + 1`` tokens.

    Args:
        paths: token files (moetron prefixes or ``.bin`` paths, Megatron prefixes, ``.bin`` or
            ``.idx`` paths, Dolma ``.npy`` paths; see moetron.data.formats).
        seq_len: tokens per training sequence S.
        vocab_size: the model's vocabulary size: every id in every file must be below it.
        verify_token_ids: also scan the data itself for its largest id (catches a sidecar that
            lies, or a wrong dtype; costs one sequential read of every file).
        format: the files' format (``auto``: detected per file).
        dtype: a dolma_npy file's dtype (None: from ``vocab_size``).
        eos_id: the id ending each document, for formats that do not store it (dolma_npy).
    """

    def __init__(
        self,
        paths: Sequence[str],
        seq_len: int,
        vocab_size: int,
        verify_token_ids: bool = True,
        format: TokenFormat | str = TokenFormat.auto,
        dtype: str | None = None,
        eos_id: int | None = None,
    ):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if not paths:
            raise DataError("PackedDataset needs at least one token file: pass a list of paths")
        if seq_len <= 0:
            raise DataError(f"seq_len={seq_len} must be positive")
        if vocab_size <= 0:
            raise DataError(f"vocab_size={vocab_size} must be positive")
        self.seq_len = int(seq_len)
        self.vocab_size = int(vocab_size)
        self.files: list[TokenFile] = []
        samples_per_file = []
        for p in paths:
            token_file = open_tokens(p, format, self.vocab_size, dtype, eos_id)
            self._check_ids(token_file, verify_token_ids)
            n = (len(token_file.tokens_N) - 1) // self.seq_len
            if n < 1:
                raise DataError(
                    f"token file {token_file.data_path!r} has {len(token_file.tokens_N)} tokens, fewer than one "
                    f"sample of seq_len+1={self.seq_len + 1}: use a shorter seq_len or more data"
                )
            self.files.append(token_file)
            samples_per_file.append(n)
        self.prefixes = [f.path for f in self.files]
        self.metadata = [f.metadata for f in self.files]
        self._tokens = [f.tokens_N for f in self.files]
        # offsets[f] = first global sample index of file f; offsets[-1] = len(self).
        self._offsets = np.concatenate([[0], np.cumsum(samples_per_file)]).astype(np.int64)

    def _check_ids(self, token_file: TokenFile, verify: bool) -> None:
        where = token_file.data_path
        if token_file.max_token_id is not None:  # declared by the file (moetron sidecar)
            largest = max(token_file.vocab_size - 1, token_file.max_token_id)
            if largest >= self.vocab_size:
                raise DataError(
                    f"token ids up to {largest} in {where} but the model's vocab_size is {self.vocab_size}: "
                    f"set --model.vocab_size >= {largest + 1} or re-tokenize"
                )
        if not verify:
            return
        lowest, actual = scan_token_range(token_file.tokens_N)
        if lowest < 0:
            raise DataError(f"token file {where} holds a negative id ({lowest}): the file is corrupt")
        if actual >= self.vocab_size:
            if token_file.max_token_id is not None:
                why = f" (its sidecar wrongly says max_token_id={token_file.max_token_id})"
            elif token_file.dtype_inferred:
                why = (f" (read as {token_file.tokens_N.dtype.name}, the dtype for a vocab of {self.vocab_size}: "
                       f"set --data.dtype if the file was written in another)")
            else:
                why = ""
            raise DataError(
                f"token ids up to {actual} in {where} but the model's vocab_size is {self.vocab_size}: "
                f"set --model.vocab_size >= {actual + 1} or re-tokenize{why}"
            )
        if token_file.max_token_id is not None and actual > token_file.max_token_id:
            raise DataError(
                f"token file {where} holds id {actual} but its sidecar says max_token_id="
                f"{token_file.max_token_id}: the file or sidecar is corrupt, re-run preprocessing"
            )

    # ---- sizes ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def samples_per_file(self) -> list[int]:
        """Samples of each file, in order (file f's are the indices after those of files < f)."""
        return np.diff(self._offsets).tolist()

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
        return f"PackedDataset({len(self.files)} files, {len(self)} samples of seq_len={self.seq_len})"
