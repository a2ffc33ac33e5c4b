"""Token files written by other pipelines, opened zero-copy: moetron, OLMo-core/Dolma .npy, Megatron.

Shapes: N = tokens in a file, D = documents in it. Every reader returns a :class:`TokenFile`: the
file's tokens as one flat read-only ``np.memmap`` [N] (whatever its on-disk integer dtype; batches
are copied out as int64) and, on request, the document start offsets [D+1] (0 first, N last).

The layouts, as their writers publish them:

- ``moetron``: ``<prefix>.bin`` raw ids + ``<prefix>.json`` sidecar (see moetron.data.preprocess);
  documents end with the sidecar's ``eos_id``.
- ``dolma_npy``: OLMo-core / Dolma toolkit token arrays. Despite the suffix there is no numpy
  header: the file is the raw little-endian ids (OLMo-core maps it with ``np.memmap``). The dtype
  is not stored: it is given, or inferred from the vocabulary size as OLMo-core does (the smallest
  unsigned type holding ``vocab_size - 1``; moetron infers uint16 or uint32 only, as the Dolma
  toolkit writes no uint8). Documents end with the EOS id; OLMo-core may also write
  ``<stem>.csv.gz`` with one ``start,end`` line per document.
- ``megatron``: Megatron-LM's indexed dataset, ``<prefix>.bin`` raw ids + ``<prefix>.idx``: magic
  ``b"MMIDIDX\\x00\\x00"``, version ``<Q`` 1, dtype code ``<B``, sequence count S ``<Q``, document
  count ``<Q`` (= D + 1), then int32 sequence lengths [S], int64 sequence byte offsets into the
  .bin [S], int64 document indices [D+1] (sequence index where each document starts, S last),
  optionally int8 sequence modes [S] (multimodal). Sequences are stored back to back.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import struct
from typing import Any, Callable

import numpy as np

from moetron.core.config import StrEnum
from moetron.data.preprocess import dtype_for_vocab, open_token_file, token_file_paths
from moetron.data.tokenizer import DataError

__all__ = ["TokenFormat", "TokenFile", "detect_format", "open_tokens", "source_key", "TOKEN_DTYPES", "MEGATRON_MAGIC"]

TOKEN_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in ("uint8", "uint16", "uint32", "uint64")}
"""Dtypes a dolma_npy file may be given in (``--data.dtype``)."""

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
# Megatron's DType codes (megatron/core/datasets/indexed_dataset.py); 6 and 7 are floats, not ids.
_MEGATRON_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}
_NUMPY_MAGIC = b"\x93NUMPY"
# Tokens per comparison while finding EOS positions: bounded memory for any file size.
_EOS_CHUNK = 16 << 20


class TokenFormat(StrEnum):
    auto = "auto"
    """Detect per path: ``.npy`` is dolma_npy; ``.idx``, or a prefix/``.bin`` with a ``.idx``, is
    megatron; ``.json``, or a prefix/``.bin`` with a ``.json`` sidecar, is moetron."""
    moetron = "moetron"
    """``<prefix>.bin`` + ``<prefix>.json`` sidecar, written by tools/preprocess_data.py."""
    dolma_npy = "dolma_npy"
    """OLMo-core / Dolma raw token arrays (no numpy header), dtype given or from the vocab size."""
    megatron = "megatron"
    """Megatron-LM indexed dataset: ``<prefix>.bin`` + ``<prefix>.idx`` (MMIDIDX)."""


@dataclasses.dataclass
class TokenFile:
    """One opened token file: its flat token stream and what its format says about it."""

    path: str
    """The path as the user named it."""
    format: TokenFormat
    data_path: str
    """The file the tokens are mapped from (for messages)."""
    tokens_N: np.ndarray
    """All N ids, a read-only memmap in the file's own dtype."""
    metadata: dict[str, Any]
    """The moetron sidecar; for other formats a few facts (dtype, and how it was chosen)."""
    eos_id: int | None = None
    """The id ending each document, where known (moetron sidecar, --data.eos_id)."""
    vocab_size: int | None = None
    """The tokenizer vocabulary the file declares (moetron only)."""
    max_token_id: int | None = None
    """The largest id the file declares (moetron only)."""
    dtype_inferred: bool = False
    """The dtype came from the vocabulary size, not from the file."""
    doc_offsets: np.ndarray | None = None
    """Document starts [D+1] where the format stores them (megatron); else found from ``eos_id``."""
    doc_offsets_path: str | None = None
    """OLMo-core's ``.csv.gz`` document metadata, read when there is no ``eos_id``."""

    def document_offsets(self) -> np.ndarray:
        """int64 [D+1]: document d is ``tokens_N[offsets[d]:offsets[d+1]]``; 0 first, N last."""
        if self.doc_offsets is None:
            if self.eos_id is not None:
                self.doc_offsets = _offsets_from_eos(self.tokens_N, self.eos_id)
            elif self.doc_offsets_path is not None:
                self.doc_offsets = _offsets_from_csv(self.doc_offsets_path, len(self.tokens_N))
            else:
                raise DataError(
                    f"{self.data_path}: document boundaries need the EOS id (the file stores none): "
                    f"set --data.eos_id=ID (eos_id=ID)"
                )
        return self.doc_offsets


def _offsets_from_eos(tokens_N: np.ndarray, eos_id: int, chunk: int = _EOS_CHUNK) -> np.ndarray:
    n = len(tokens_N)
    ends = [np.flatnonzero(tokens_N[s : s + chunk] == eos_id) + (s + 1) for s in range(0, n, chunk)]
    ends_D = np.concatenate([np.zeros(1, np.int64), *ends]).astype(np.int64)
    return ends_D if ends_D[-1] == n else np.append(ends_D, n)  # a last document without EOS


def _offsets_from_csv(path: str, num_tokens: int) -> np.ndarray:
    with gzip.open(path, "rt") as f:
        rows = [line.split(",")[:2] for line in f if line.strip()]
    spans = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
    starts, ends = spans[:, 0], spans[:, 1]
    if len(spans) and (starts[0] != 0 or ends[-1] != num_tokens or np.any(starts[1:] != ends[:-1])):
        raise DataError(f"{path}: document spans do not tile the {num_tokens} tokens of its .npy file back to back")
    return np.concatenate([[0], ends]).astype(np.int64)


# ---- detection ----------------------------------------------------------------------------------
def _strip(path: str, *exts: str) -> str:
    for ext in exts:
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def detect_format(path: str) -> TokenFormat:
    """The format of ``path`` (a file or a prefix), from its suffix and the files beside it."""
    p = os.fspath(path)
    if p.endswith(".npy"):
        return TokenFormat.dolma_npy
    if p.endswith(".idx"):
        return TokenFormat.megatron
    if p.endswith(".json"):
        return TokenFormat.moetron
    prefix = _strip(p, ".bin")
    has_idx, has_json = os.path.exists(prefix + ".idx"), os.path.exists(prefix + ".json")
    if has_idx and has_json:
        raise DataError(
            f"data path {p!r} is ambiguous: both a Megatron index {prefix + '.idx'!r} and a moetron sidecar "
            f"{prefix + '.json'!r} exist: set --data.format=megatron or --data.format=moetron"
        )
    if has_idx:
        return TokenFormat.megatron
    if has_json:
        return TokenFormat.moetron
    if not os.path.exists(p) and not os.path.exists(prefix + ".bin"):
        raise DataError(
            f"data path {p!r} does not exist (looked for {prefix + '.bin'!r} with a .json sidecar or a .idx "
            f"index, and for a .npy file): check the path or create it with tools/preprocess_data.py"
        )
    raise DataError(
        f"cannot tell the format of {p!r}: expected a moetron token file (<prefix>.bin + <prefix>.json), "
        f"a Megatron indexed dataset (<prefix>.bin + <prefix>.idx) or an OLMo-core/Dolma .npy token array; "
        f"found {prefix + '.bin' if os.path.exists(prefix + '.bin') else p!r} with neither sidecar nor index: "
        f"set --data.format=dolma_npy if it is a raw token array"
    )


def source_key(path: str) -> str | None:
    """What a glob match stands for: the prefix of a .bin/.json/.idx file, a .npy path; None otherwise."""
    if path.endswith(".npy"):
        return path
    if path.endswith((".bin", ".json", ".idx")):
        return _strip(path, ".bin", ".json", ".idx")
    return None


# ---- readers ------------------------------------------------------------------------------------
def _open_moetron(path: str, **_: Any) -> TokenFile:
    prefix, bin_path, json_path = token_file_paths(path)
    if not (os.path.exists(bin_path) or os.path.exists(json_path)):
        raise DataError(
            f"data path {path!r} does not exist (looked for {bin_path!r} and {json_path!r}): "
            f"check the path or create it with tools/preprocess_data.py"
        )
    tokens_N, meta = open_token_file(prefix)
    return TokenFile(path, TokenFormat.moetron, bin_path, tokens_N, meta, eos_id=meta["eos_id"],
                     vocab_size=meta["vocab_size"], max_token_id=meta["max_token_id"])


def _raw_memmap(data_path: str, dtype: np.dtype, what: str, hint: str = "") -> np.ndarray:
    size = os.path.getsize(data_path)
    if size % dtype.itemsize:
        raise DataError(f"{what} {data_path!r} is {size} bytes, not a whole number of {dtype.name} tokens{hint}")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(data_path, dtype=dtype, mode="r", shape=(size // dtype.itemsize,))


def _open_dolma_npy(path: str, vocab_size: int, dtype: str | None = None, eos_id: int | None = None) -> TokenFile:
    if not os.path.isfile(path):
        raise DataError(f"data path {path!r} does not exist: check the path (dolma_npy files are named directly)")
    with open(path, "rb") as f:
        head = f.read(len(_NUMPY_MAGIC))
    if head == _NUMPY_MAGIC:
        raise DataError(
            f"{path!r} is a numpy-format .npy (it has a numpy header), not a raw OLMo-core/Dolma token array: "
            f"write the ids raw (array.tofile) or preprocess the text with tools/preprocess_data.py"
        )
    if dtype is None:
        np_dtype, inferred = dtype_for_vocab(vocab_size), True
    elif dtype in TOKEN_DTYPES:
        np_dtype, inferred = TOKEN_DTYPES[dtype], False
    else:
        raise DataError(f"data.dtype={dtype!r} is not a dolma_npy token dtype: use one of {sorted(TOKEN_DTYPES)}")
    hint = f" (the dtype for vocab_size={vocab_size}: set --data.dtype to the one it was written in)" if inferred else ""
    tokens_N = _raw_memmap(path, np_dtype, "token array", hint)
    csv_path = _strip(path, ".npy") + ".csv.gz"
    return TokenFile(path, TokenFormat.dolma_npy, path, tokens_N, {"dtype": np_dtype.name},
                     eos_id=eos_id, dtype_inferred=inferred,
                     doc_offsets_path=csv_path if os.path.exists(csv_path) else None)


def _open_megatron(path: str, **_: Any) -> TokenFile:
    prefix = _strip(path, ".bin", ".idx")
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for needed in (idx_path, bin_path):
        if not os.path.exists(needed):
            raise DataError(
                f"Megatron dataset {prefix!r} lacks {needed!r} (an indexed dataset is <prefix>.bin + <prefix>.idx): "
                f"check the path"
            )
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_MEGATRON_HEADER.size)
    if len(head) < _MEGATRON_HEADER.size or not head.startswith(MEGATRON_MAGIC):
        raise DataError(f"{idx_path!r} is not a Megatron index: expected it to start with {MEGATRON_MAGIC!r}")
    _, version, code, num_seqs, num_doc_idx = _MEGATRON_HEADER.unpack(head)
    if version != 1:
        raise DataError(f"{idx_path!r} is a Megatron index of version {version}; moetron reads version 1")
    if code not in _MEGATRON_DTYPES:
        raise DataError(f"{idx_path!r} has dtype code {code}, not an integer token dtype (codes {sorted(_MEGATRON_DTYPES)})")
    dtype = np.dtype(_MEGATRON_DTYPES[code])
    base = _MEGATRON_HEADER.size + 12 * num_seqs + 8 * num_doc_idx
    if idx_size not in (base, base + num_seqs):  # + int8 modes when multimodal
        raise DataError(
            f"{idx_path!r} is {idx_size} bytes, but its header ({num_seqs} sequences, {num_doc_idx} document "
            f"indices) needs {base} (or {base + num_seqs} with sequence modes): the index is truncated or corrupt"
        )
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    at = _MEGATRON_HEADER.size
    lengths_S = np.frombuffer(raw, dtype="<i4", count=num_seqs, offset=at).astype(np.int64)
    pointers_S = np.frombuffer(raw, dtype="<i8", count=num_seqs, offset=at + 4 * num_seqs)
    doc_index = np.frombuffer(raw, dtype="<i8", count=num_doc_idx, offset=at + 12 * num_seqs).astype(np.int64)
    tokens_N = _raw_memmap(bin_path, dtype, "Megatron data file")
    seq_starts = np.concatenate([[0], np.cumsum(lengths_S)]).astype(np.int64)  # [S+1], in tokens
    if np.any(lengths_S < 0) or seq_starts[-1] != len(tokens_N):
        raise DataError(
            f"{idx_path!r} lists {int(seq_starts[-1])} tokens in {num_seqs} sequences but {bin_path!r} holds "
            f"{len(tokens_N)} {dtype.name} tokens: the pair does not match"
        )
    if not np.array_equal(pointers_S, seq_starts[:-1] * dtype.itemsize):
        raise DataError(f"{idx_path!r}: sequences are not stored back to back in {bin_path!r}; moetron reads only that layout")
    if (num_doc_idx == 0 or doc_index[0] != 0 or doc_index[-1] != num_seqs
            or np.any(np.diff(doc_index) < 0)):
        raise DataError(
            f"{idx_path!r}: document indices must rise from 0 to the sequence count {num_seqs}: the index is corrupt"
        )
    return TokenFile(path, TokenFormat.megatron, bin_path, tokens_N, {"dtype": dtype.name},
                     doc_offsets=seq_starts[doc_index])


_READERS: dict[TokenFormat, Callable[..., TokenFile]] = {
    TokenFormat.moetron: _open_moetron,
    TokenFormat.dolma_npy: _open_dolma_npy,
    TokenFormat.megatron: _open_megatron,
}


def open_tokens(
    path: str,
    format: TokenFormat | str = TokenFormat.auto,
    vocab_size: int = 2**16,
    dtype: str | None = None,
    eos_id: int | None = None,
) -> TokenFile:
    """Open one token file of ``format`` (``auto``: :func:`detect_format`) read-only.

    ``vocab_size`` (the model's) picks a dolma_npy file's dtype unless ``dtype`` is given (the
    other formats store theirs, and ``dtype`` does not apply to them); ``eos_id`` marks document ends where the file does not say (dolma_npy). DataError naming the
    file when it is missing or does not fit the format's layout.
    """
    path = os.fspath(path)
    fmt = TokenFormat(format)
    if fmt == TokenFormat.auto:
        fmt = detect_format(path)
    return _READERS[fmt](path, vocab_size=vocab_size, dtype=dtype, eos_id=eos_id)
