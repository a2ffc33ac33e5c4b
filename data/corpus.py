"""The embedded default corpus: real text already on every machine, built on first use.

Source: the Python standard library of the running interpreter: its docs text first
(pydoc_data/topics.py, then any .txt/.rst), then its .py sources, each group in sorted order of
relative path, until ``max_bytes`` (a file bigger than the budget left is skipped, so small caps
still fill up). Test folders, site-packages and the codec tables of
``encodings/`` are skipped. Each file goes to val when a hash of its relative path says so (~2%),
otherwise to train. A sentencepiece tokenizer is trained on the train text, and both splits are
tokenized into ``<data_dir>/default_corpus_v1_<vocab>/{train,val}.bin/.json`` + ``tokenizer.model``.

Building happens in a temporary folder renamed into place under an fcntl file lock, so several
processes (torchrun ranks) may call :func:`ensure_default_corpus` at once: one builds, the others
wait and reuse. A failed build removes its temporary folder; a killed one (SIGKILL, OOM) leaves it,
and the next process to take the lock removes it: the lock is only ever held by the one live
builder, and the kernel releases it when its holder dies, so any temporary folder of this corpus
found while holding the lock belongs to a dead build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from typing import Iterator

from moetron.data.preprocess import open_token_file, tokenize_documents
from moetron.data.tokenizer import DataError, SentencePieceTokenizer

__all__ = ["CORPUS_VERSION", "DEFAULT_MAX_BYTES", "corpus_dir", "list_corpus_files", "ensure_default_corpus"]

CORPUS_VERSION = 1
DEFAULT_MAX_BYTES = 6_000_000
# The held-out split holds at least this many characters (a few evaluation batches of tokens).
MIN_VAL_BYTES = 40_000
# Every VAL_BUCKETS-th hash bucket of relative paths is validation: ~2%.
_VAL_BUCKETS = 50
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib-dynload", "encodings"}
_EXTENSIONS = (".py", ".txt", ".rst")


def corpus_dir(data_dir: str, vocab_size: int, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Where the corpus lives; a non-default size gets its own folder so caches never mix."""
    name = f"default_corpus_v{CORPUS_VERSION}_{vocab_size}"
    if max_bytes != DEFAULT_MAX_BYTES:
        name += f"_max{max_bytes}"
    return os.path.join(data_dir, name)


def _is_val(relpath: str) -> bool:
    return hashlib.sha256(relpath.encode()).digest()[0] % _VAL_BUCKETS == 0


def list_corpus_files(max_bytes: int, root: str | None = None) -> list[tuple[str, str]]:
    """``(relative_path, text)`` of the corpus files, in corpus order, at most ``max_bytes`` of UTF-8."""
    root = root or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise DataError(f"the Python standard library folder {root!r} is missing: use data.source=files")
    docs, code = [], []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("config-"))
        for name in files:
            if not name.endswith(_EXTENSIONS):
                continue
            rel = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
            is_doc = not name.endswith(".py") or rel == "pydoc_data/topics.py"
            (docs if is_doc else code).append(rel)
    selected, total = [], 0
    for rel in sorted(docs, key=lambda r: (r != "pydoc_data/topics.py", r)) + sorted(code):
        if max_bytes - total < 512:
            break
        if os.path.getsize(os.path.join(root, rel)) > max_bytes - total:
            continue  # too big for what is left: later, smaller files still fill the budget
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files are Latin-1 test fixtures: not worth a special case
        size = len(text.encode("utf-8"))
        if text.strip() and total + size <= max_bytes:
            selected.append((rel, text))
            total += size
    return selected


def _valid(folder: str) -> dict[str, str] | None:
    """The corpus paths if ``folder`` holds a complete corpus whose files validate, else None."""
    paths = dict(
        train=os.path.join(folder, "train"),
        val=os.path.join(folder, "val"),
        tokenizer=os.path.join(folder, "tokenizer.model"),
    )
    if not os.path.isfile(os.path.join(folder, "corpus.json")) or not os.path.isfile(paths["tokenizer"]):
        return None
    try:
        open_token_file(paths["train"])
        open_token_file(paths["val"])
    except DataError:
        return None
    return paths


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_dead_builds(folder: str) -> None:
    """Delete the temporary and half-deleted folders that dead builds of ``folder`` left behind.
    Call only while holding ``folder``'s lock (then no live build owns any of them)."""
    parent, name = os.path.split(folder)
    for entry in os.listdir(parent):
        if entry.startswith((f"{name}.tmp-", f"{name}.broken-")):
            _log(f"removing {os.path.join(parent, entry)} (left by an interrupted build)")
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _log(msg: str) -> None:
    print(f"[moetron.data.corpus] {msg}", file=sys.stderr, flush=True)


def _build(folder: str, final: str, vocab_size: int, max_bytes: int, root: str | None) -> None:
    """Build the corpus into ``folder`` (a temporary folder later renamed to ``final``)."""
    t0 = time.monotonic()
    files = list_corpus_files(max_bytes, root)
    val = [(r, t) for r, t in files if _is_val(r)]
    train = [(r, t) for r, t in files if not _is_val(r)]
    # Small corpora (or an unlucky hash) can leave the held-out split too small to evaluate on:
    # move training files, last first, until it holds at least 2% of the bytes and MIN_VAL_BYTES.
    total = sum(len(t) for _, t in files)
    want = max(MIN_VAL_BYTES, total // 50)
    while train and len(train) > 1 and sum(len(t) for _, t in val) < want:
        val.append(train.pop())
    if not train:
        raise DataError(f"corpus_max_bytes={max_bytes} leaves no training text: raise it (e.g. 6000000)")
    with open(os.path.join(folder, "train.txt"), "w", encoding="utf-8") as f:
        for _, text in train:
            f.write(text if text.endswith("\n") else text + "\n")
    nbytes = {s: sum(len(t.encode("utf-8")) for _, t in items) for s, items in (("train", train), ("val", val))}
    _log(
        f"building {final}: {len(files)} stdlib files, train {len(train)} files {nbytes['train'] / 1e6:.2f} MB, "
        f"val {len(val)} files {nbytes['val'] / 1e6:.2f} MB"
    )
    t1 = time.monotonic()
    tokenizer = SentencePieceTokenizer.train(
        [os.path.join(folder, "train.txt")], os.path.join(folder, "tokenizer"), vocab_size, max_sentences=300_000
    )
    t2 = time.monotonic()
    _log(f"trained tokenizer: vocab {tokenizer.vocab_size} in {t2 - t1:.1f}s")
    # One document per source file, so EOS marks file boundaries.
    meta = {
        split: tokenize_documents(
            (text for _, text in items),
            os.path.join(folder, split),
            tokenizer,
            total_bytes=nbytes[split],
            progress=None,
        )
        for split, items in (("train", train), ("val", val))
    }
    os.remove(os.path.join(folder, "train.txt"))
    os.remove(os.path.join(folder, "tokenizer.vocab"))
    t3 = time.monotonic()
    manifest = {
        "version": CORPUS_VERSION,
        "python": sys.version.split()[0],
        "max_bytes": max_bytes,
        "vocab_size": tokenizer.vocab_size,
        "train_files": [r for r, _ in train],
        "val_files": [r for r, _ in val],
        "train_tokens": meta["train"]["num_tokens"],
        "val_tokens": meta["val"]["num_tokens"],
        "build_seconds": round(t3 - t0, 2),
    }
    with open(os.path.join(folder, "corpus.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    _log(
        f"tokenized: train {meta['train']['num_tokens']:,} tokens, val {meta['val']['num_tokens']:,} tokens "
        f"in {t3 - t2:.1f}s; total build {t3 - t0:.1f}s"
    )


def ensure_default_corpus(
    data_dir: str, vocab_size: int = 4096, max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None
) -> dict[str, str]:
    """Build the default corpus unless a valid cached copy exists; safe from many processes at once.

    Returns ``dict(train=prefix, val=prefix, tokenizer=model_path)``. ``root`` overrides the
    source folder (default: this interpreter's standard library).
    """
    if vocab_size < 260:
        raise DataError(f"corpus vocab_size={vocab_size} is too small: byte fallback alone needs 259 ids, use >= 260")
    if max_bytes <= 0:
        raise DataError(f"corpus_max_bytes={max_bytes} must be positive")
    folder = corpus_dir(data_dir, vocab_size, max_bytes)
    paths = _valid(folder)
    if paths is not None:
        return paths
    os.makedirs(data_dir, exist_ok=True)
    with _file_lock(folder + ".lock"):
        _remove_dead_builds(folder)
        paths = _valid(folder)  # another process may have built it while we waited
        if paths is not None:
            _log(f"reusing {folder} (built by another process)")
            return paths
        if os.path.exists(folder):  # a broken leftover: move it aside atomically, then delete
            broken = f"{folder}.broken-{os.getpid()}"
            os.rename(folder, broken)
            shutil.rmtree(broken, ignore_errors=True)
        tmp = tempfile.mkdtemp(dir=data_dir, prefix=os.path.basename(folder) + ".tmp-")
        try:
            _build(tmp, folder, vocab_size, max_bytes, root)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the corpus is meant to be shared
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    paths = _valid(folder)
    if paths is None:  # pragma: no cover - would be a bug in _build
        raise DataError(f"built the default corpus in {folder!r} but it does not validate")
    return paths
