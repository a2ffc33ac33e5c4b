"""Tokenize text into memmap token files, and open them with full validation.

A token file is a pair:

- ``<prefix>.bin``: the token ids of every document, each followed by the tokenizer's EOS id, as raw
  little-endian ``uint16`` (vocab_size <= 65536) or ``uint32``;
- ``<prefix>.json``: the sidecar ``{"format": "moetron-tokens", "version": 1, "dtype", "vocab_size",
  "num_tokens", "num_documents", "eos_id", "max_token_id", "tokenizer"}``, plus what the tokenizer
  tells (``"tokenizer_kind"``: sentencepiece or hf, ``"tokenizer_name"``, ``"bos_id"``; optional
  keys, so older sidecars still read).

Both are written under temporary names and renamed, the sidecar last, so a crash never leaves a
pair that looks complete: readers treat "no sidecar" as "not there".
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Iterator, Protocol, Sequence

import numpy as np

from moetron.data.progress import Progress
from moetron.data.tokenizer import DataError

__all__ = [
    "TOKEN_FILE_FORMAT",
    "TOKEN_FILE_VERSION",
    "TokenizerLike",
    "dtype_for_vocab",
    "iter_documents",
    "tokenize_files",
    "tokenize_documents",
    "open_token_file",
    "token_file_paths",
    "check_output_prefix",
]

TOKEN_FILE_FORMAT = "moetron-tokens"
TOKEN_FILE_VERSION = 1
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_REQUIRED_KEYS = ("format", "version", "dtype", "vocab_size", "num_tokens", "num_documents", "eos_id", "max_token_id")


class TokenizerLike(Protocol):
    """What preprocessing needs from a tokenizer (a data.tokenizer.Tokenizer, or a test double;
    ``encode_batch``, ``kind``, ``name`` and ``bos_id`` are used when present)."""

    vocab_size: int
    eos_id: int | None
    path: str | None

    def encode(self, text: str) -> list[int]: ...


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size <= 0:
        raise DataError(f"vocab_size={vocab_size} must be positive")
    if vocab_size <= 2**16:
        return _DTYPES["uint16"]
    if vocab_size <= 2**32:
        return _DTYPES["uint32"]
    raise DataError(f"vocab_size={vocab_size} does not fit in uint32 token files")


def token_file_paths(prefix_or_path: str) -> tuple[str, str, str]:
    """``(prefix, bin_path, json_path)`` for a prefix or a ``.bin``/``.json`` path."""
    p = os.fspath(prefix_or_path)
    for ext in (".bin", ".json"):
        if p.endswith(ext):
            p = p[: -len(ext)]
            break
    return p, p + ".bin", p + ".json"


def check_output_prefix(output_prefix: str, overwrite: bool = False) -> None:
    """DataError unless ``<output_prefix>.bin/.json`` are free to write (or ``overwrite``): a token
    file is never replaced by accident."""
    if overwrite:
        return
    _, bin_path, json_path = token_file_paths(output_prefix)
    existing = [p for p in (bin_path, json_path) if os.path.exists(p)]
    if existing:
        raise DataError(
            f"output {' and '.join(map(repr, existing))} already exists: choose another output prefix, "
            f"or replace it with --overwrite (overwrite=True)"
        )


# ---- reading documents ------------------------------------------------------------------------
def iter_documents(path: str, jsonl_key: str = "text", split_blank_lines: bool = False) -> Iterator[str]:
    """Documents of one input file.

    ``.jsonl``/``.json`` files: one JSON object per line, its ``jsonl_key`` field is a document.
    Anything else is text: the whole file is one document, or, with ``split_blank_lines``, every
    run of lines between blank lines is one. Empty documents are skipped (they would be a bare EOS).
    """
    if not os.path.isfile(path):
        raise DataError(f"input file {path!r} does not exist: check --input")
    if path.endswith((".jsonl", ".json")):
        # Bytes decoded line by line, so a bad byte is reported at its line (a text-mode reader
        # decodes whole chunks and fails lines ahead of it).
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path}:{line_no} is not valid UTF-8 (byte {e.object[e.start]:#04x} at column "
                        f"{e.start + 1}): re-encode the file as UTF-8 or remove that line"
                    ) from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{line_no} is not valid JSON ({e}): fix or remove that line") from None
                if not isinstance(record, dict) or jsonl_key not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(
                        f"{path}:{line_no} has no key {jsonl_key!r} (found {keys}): set --jsonl-key"
                    )
                text = record[jsonl_key]
                if not isinstance(text, str):
                    raise DataError(f"{path}:{line_no}: {jsonl_key!r} is a {type(text).__name__}, expected a string")
                if text:
                    yield text
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        if not split_blank_lines:
            text = f.read()
            if text:
                yield text
            return
        lines: list[str] = []
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines = []
        if lines:
            yield "".join(lines).rstrip("\n")


# ---- writing ------------------------------------------------------------------------------------
def _encode_many(tokenizer: TokenizerLike, texts: Sequence[str]) -> list[list[int]]:
    batch = getattr(tokenizer, "encode_batch", None)
    return batch(texts) if batch is not None else [tokenizer.encode(t) for t in texts]


def tokenize_files(
    input_files: Sequence[str],
    output_prefix: str,
    tokenizer: TokenizerLike,
    jsonl_key: str = "text",
    split_blank_lines: bool = False,
    progress: bool | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize every document of ``input_files`` (in order, see :func:`iter_documents`) into
    ``<output_prefix>.bin/.json``; returns the sidecar metadata. An existing output is a DataError
    unless ``overwrite``."""
    check_output_prefix(output_prefix, overwrite)
    for f in input_files:
        if not os.path.isfile(f):
            raise DataError(f"input file {f!r} does not exist: check --input")
    if not input_files:
        raise DataError("no input files given: pass --input")
    documents = (
        doc for f in input_files for doc in iter_documents(f, jsonl_key=jsonl_key, split_blank_lines=split_blank_lines)
    )
    total_bytes = sum(os.path.getsize(f) for f in input_files)
    return tokenize_documents(
        documents, output_prefix, tokenizer, total_bytes=total_bytes, progress=progress, overwrite=overwrite
    )


def tokenize_documents(
    documents: Iterable[str],
    output_prefix: str,
    tokenizer: TokenizerLike,
    total_bytes: int | None = None,
    progress: bool | None = None,
    batch_bytes: int = 4 << 20,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``tokenizer.encode(doc) + [tokenizer.eos_id]`` for every document into
    ``<output_prefix>.bin`` and its sidecar; returns the sidecar metadata.

    ``progress`` (default: when stderr is a terminal) draws a bar against ``total_bytes``.
    Documents are encoded in batches of ``batch_bytes`` characters (in C++ threads when the
    tokenizer has ``encode_batch``). An existing ``<output_prefix>.bin`` or ``.json`` is a
    DataError unless ``overwrite``.
    """
    check_output_prefix(output_prefix, overwrite)
    eos_id = tokenizer.eos_id
    if eos_id is None:
        raise DataError(f"tokenizer {getattr(tokenizer, 'path', None)!r} has no EOS id: train it with eos_id >= 0 "
                        f"(sentencepiece), or name eos_token in a tokenizer_config.json beside tokenizer.json (HF)")
    vocab_size = int(tokenizer.vocab_size)
    dtype = dtype_for_vocab(vocab_size)
    prefix, bin_path, json_path = token_file_paths(output_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    bar = Progress(f"tokenizing -> {bin_path}", total_bytes, "B", enabled=progress if total_bytes else False)

    tmp_bin = f"{bin_path}.tmp-{os.getpid()}"
    tmp_json = f"{json_path}.tmp-{os.getpid()}"
    num_tokens = num_documents = 0
    max_token_id = -1
    done_bytes = 0
    try:
        with bar, open(tmp_bin, "wb") as out:

            def flush(texts: list[str]) -> None:
                nonlocal num_tokens, num_documents, max_token_id
                for ids in _encode_many(tokenizer, texts):
                    ids_N = np.asarray(list(ids) + [eos_id], dtype=np.int64)
                    lo, hi = int(ids_N.min()), int(ids_N.max())
                    if lo < 0 or hi >= vocab_size:
                        raise DataError(
                            f"tokenizer {getattr(tokenizer, 'path', None)!r} produced id {hi if hi >= vocab_size else lo} "
                            f"outside [0, {vocab_size}): the tokenizer is inconsistent"
                        )
                    out.write(ids_N.astype(dtype).tobytes())
                    num_tokens += len(ids_N)
                    num_documents += 1
                    max_token_id = max(max_token_id, hi)

            pending: list[str] = []
            pending_bytes = 0
            for doc in documents:
                if not doc:
                    continue  # an empty document would be a bare EOS
                pending.append(doc)
                pending_bytes += len(doc)
                if pending_bytes >= batch_bytes:
                    flush(pending)
                    done_bytes += pending_bytes
                    bar.update(done_bytes, note=f"{num_tokens:,} tokens")
                    pending, pending_bytes = [], 0
            flush(pending)
            bar.update(total_bytes or 0, note=f"{num_tokens:,} tokens")
        if num_documents == 0:
            raise DataError(f"no documents to tokenize for {bin_path!r}: the inputs are empty")
        meta = {
            "format": TOKEN_FILE_FORMAT,
            "version": TOKEN_FILE_VERSION,
            "dtype": "uint16" if dtype == _DTYPES["uint16"] else "uint32",
            "vocab_size": vocab_size,
            "num_tokens": num_tokens,
            "num_documents": num_documents,
            "eos_id": int(eos_id),
            "max_token_id": max_token_id,
            "tokenizer": _tokenizer_ref(getattr(tokenizer, "path", None), json_path),
            "tokenizer_kind": getattr(tokenizer, "kind", None),
            "tokenizer_name": getattr(tokenizer, "name", None),
            "bos_id": getattr(tokenizer, "bos_id", None),
        }
        with open(tmp_json, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        # Old sidecar first: between the two renames there must be no pair that looks complete.
        if os.path.exists(json_path):
            os.remove(json_path)
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_json, json_path)
    finally:
        for leftover in (tmp_bin, tmp_json):
            if os.path.exists(leftover):
                os.remove(leftover)
    return meta


def _tokenizer_ref(tokenizer_path: str | None, json_path: str) -> str | None:
    """The tokenizer path to store: relative to the sidecar's folder when it lies inside it (so a
    folder of data + tokenizer can be moved or renamed whole), else absolute."""
    if not tokenizer_path:
        return None
    tok, here = os.path.abspath(tokenizer_path), os.path.dirname(os.path.abspath(json_path))
    return os.path.relpath(tok, here) if os.path.commonpath([tok, here]) == here else tok


# ---- reading ------------------------------------------------------------------------------------
def open_token_file(prefix_or_bin_path: str) -> tuple[np.ndarray, dict[str, Any]]:
    """Open a token file read-only: ``(tokens_N, metadata)``, tokens_N a ``np.memmap`` of N ids.

    Raises DataError naming the file when the .bin or sidecar is missing, the sidecar is not JSON,
    not a moetron token file, has an unknown dtype, or the .bin size disagrees with num_tokens.
    """
    prefix, bin_path, json_path = token_file_paths(prefix_or_bin_path)
    if not os.path.exists(json_path):
        if os.path.exists(bin_path):
            raise DataError(
                f"token file {bin_path!r} has no sidecar {json_path!r} (an interrupted preprocessing run?): "
                f"re-run tools/preprocess_data.py for it"
            )
        raise DataError(
            f"token file {prefix!r} not found (neither {bin_path!r} nor {json_path!r} exists): "
            f"check the path, or create it with tools/preprocess_data.py"
        )
    try:
        with open(json_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"sidecar {json_path!r} is not valid JSON ({e}): re-run preprocessing") from None
    if not isinstance(meta, dict) or meta.get("format") != TOKEN_FILE_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataError(
            f"sidecar {json_path!r} is not a moetron token file (format {got!r}, expected "
            f"{TOKEN_FILE_FORMAT!r}): re-run preprocessing"
        )
    if meta.get("version") != TOKEN_FILE_VERSION:
        raise DataError(
            f"sidecar {json_path!r} has version {meta.get('version')!r}; this moetron reads version "
            f"{TOKEN_FILE_VERSION}: re-run preprocessing"
        )
    missing = [k for k in _REQUIRED_KEYS if k not in meta]
    if missing:
        raise DataError(f"sidecar {json_path!r} lacks {missing}: re-run preprocessing")
    if meta["dtype"] not in _DTYPES:
        raise DataError(
            f"sidecar {json_path!r} has dtype {meta['dtype']!r}; token files are 'uint16' or 'uint32': "
            f"re-run preprocessing"
        )
    for k in ("vocab_size", "num_tokens", "num_documents", "max_token_id"):
        if not isinstance(meta[k], int) or isinstance(meta[k], bool):
            raise DataError(f"sidecar {json_path!r}: {k}={meta[k]!r} is not an integer: re-run preprocessing")
    if meta.get("tokenizer"):
        # Stored relative to the sidecar's folder (see _tokenizer_ref): hand callers a usable path.
        meta["tokenizer"] = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(json_path)), meta["tokenizer"]))
    dtype = _DTYPES[meta["dtype"]]
    if not os.path.exists(bin_path):
        raise DataError(f"token file {bin_path!r} is missing (its sidecar {json_path!r} exists): re-run preprocessing")
    size = os.path.getsize(bin_path)
    expected = meta["num_tokens"] * dtype.itemsize
    if size != expected:
        what = "truncated" if size < expected else "longer than its sidecar says"
        raise DataError(
            f"token file {bin_path!r} is {what}: {size} bytes, but the sidecar says {meta['num_tokens']} "
            f"{meta['dtype']} tokens = {expected} bytes: re-run preprocessing"
        )
    if meta["num_tokens"] == 0:
        return np.zeros(0, dtype=dtype), meta
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(meta["num_tokens"],)), meta
