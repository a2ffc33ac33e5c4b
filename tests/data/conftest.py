"""Shared fixtures for the data tests: a small real tokenizer and a hand-written token-file writer."""

from __future__ import annotations

import json
import os
import sysconfig

import numpy as np
import pytest

from moetron.data.tokenizer import SentencePieceTokenizer

# Real text for the tokenizer: a few stdlib modules (present wherever Python is).
_SOURCES = ("json/__init__.py", "textwrap.py", "this.py")


def _read_sample_text() -> str:
    root = sysconfig.get_paths()["stdlib"]
    parts = []
    for rel in _SOURCES:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            parts.append(f.read())
    return "\n".join(parts)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> SentencePieceTokenizer:
    folder = tmp_path_factory.mktemp("tok")
    text_path = folder / "train.txt"
    text_path.write_text(_read_sample_text(), encoding="utf-8")
    return SentencePieceTokenizer.train([str(text_path)], str(folder / "tok"), vocab_size=400)


@pytest.fixture(scope="session")
def sample_text() -> str:
    return _read_sample_text()


@pytest.fixture
def write_token_file():
    return _write_token_file


def _write_token_file(prefix, tokens, dtype="uint16", vocab_size=1000, max_token_id=None, **overrides) -> str:
    """Write <prefix>.bin/.json by hand (independent of moetron.data.preprocess); returns prefix."""
    prefix = str(prefix)
    arr = np.asarray(tokens, dtype=np.dtype(dtype).newbyteorder("<"))
    arr.tofile(prefix + ".bin")
    meta = {
        "format": "moetron-tokens",
        "version": 1,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "num_tokens": int(arr.size),
        "num_documents": 1,
        "eos_id": 0,
        "max_token_id": int(arr.max()) if max_token_id is None else max_token_id,
        "tokenizer": None,
    }
    meta.update(overrides)
    with open(prefix + ".json", "w") as f:
        json.dump(meta, f)
    return prefix
