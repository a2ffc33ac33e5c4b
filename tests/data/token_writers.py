"""Token files of other pipelines, written by hand from their published layouts (numpy + struct),
independently of moetron.data.formats: the oracle for the readers."""

from __future__ import annotations

import struct

import numpy as np

# Megatron-LM megatron/core/datasets/indexed_dataset.py: DType codes and the .idx header.
MEGATRON_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}


def write_dolma_npy(path, documents, dtype="uint16", eos_id=0) -> str:
    """OLMo-core / Dolma: every document followed by EOS, raw little-endian ids, no header."""
    stream = [t for doc in documents for t in (*doc, eos_id)]
    np.asarray(stream, dtype=np.dtype(dtype).newbyteorder("<")).tofile(str(path))
    return str(path)


def write_megatron(prefix, documents, dtype="uint16", split_at=None) -> str:
    """Megatron indexed dataset <prefix>.bin/.idx. Each document is one sequence, or two when
    ``split_at`` (tokens) falls inside it (as sentence-split preprocessing writes)."""
    prefix = str(prefix)
    np_dtype = np.dtype(dtype).newbyteorder("<")
    lengths, doc_index = [], [0]
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            parts = [doc[:split_at], doc[split_at:]] if split_at and 0 < split_at < len(doc) else [doc]
            for part in parts:
                f.write(np.asarray(part, dtype=np_dtype).tobytes())
                lengths.append(len(part))
            doc_index.append(len(lengths))
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * np_dtype.itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", MEGATRON_CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(np.asarray(lengths, dtype="<i4").tobytes())
        f.write(np.asarray(pointers, dtype="<i8").tobytes())
        f.write(np.asarray(doc_index, dtype="<i8").tobytes())
    return prefix


def random_documents(seed, count, vocab, low=5, high=40):
    """``count`` documents of random ids in [1, vocab) (never the EOS id 0), lengths in [low, high)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(rng.integers(low, high))).tolist() for _ in range(count)]
