"""Readers of other pipelines' token files: each format written by hand from its published layout
(tests/data/token_writers.py) reads back exactly, tokens and document boundaries; detection and
its errors name the file and what was expected."""

import gzip
import os

import numpy as np
import pytest

from moetron.data.dataset import PackedDataset
from moetron.data.formats import TokenFormat, detect_format, open_tokens
from moetron.data.tokenizer import DataError
from tests.data.token_writers import random_documents, write_dolma_npy, write_megatron


def hand_offsets(documents, extra_per_doc=0):
    return np.concatenate([[0], np.cumsum([len(d) + extra_per_doc for d in documents])]).tolist()


@pytest.mark.parametrize("dtype,vocab", [("uint16", 50304), ("uint32", 100352)])
def test_dolma_npy_reads_back_with_inferred_dtype(tmp_path, dtype, vocab):
    docs = random_documents(0, 20, vocab)
    path = write_dolma_npy(tmp_path / "part-0-00000.npy", docs, dtype=dtype, eos_id=0)
    f = open_tokens(path, vocab_size=vocab, eos_id=0)  # dtype from the vocab, as OLMo-core infers it
    assert f.format == TokenFormat.dolma_npy and f.tokens_N.dtype == np.dtype(dtype) and f.dtype_inferred
    assert isinstance(f.tokens_N, np.memmap)  # zero-copy
    assert f.tokens_N.tolist() == [t for d in docs for t in (*d, 0)]
    offsets = f.document_offsets().tolist()
    assert offsets == hand_offsets(docs, extra_per_doc=1)
    assert [f.tokens_N[a:b].tolist() for a, b in zip(offsets, offsets[1:])] == [[*d, 0] for d in docs]
    # Given explicitly, the dtype wins over the vocab size.
    assert open_tokens(path, TokenFormat.dolma_npy, vocab_size=300, dtype=dtype).tokens_N.dtype == np.dtype(dtype)


def test_dolma_npy_boundaries_from_olmo_core_csv(tmp_path):
    docs = random_documents(1, 5, 300)
    path = write_dolma_npy(tmp_path / "a.npy", docs)
    with pytest.raises(DataError, match=r"a\.npy.*set --data.eos_id"):
        open_tokens(path, vocab_size=300).document_offsets()
    offsets = hand_offsets(docs, extra_per_doc=1)
    with gzip.open(tmp_path / "a.csv.gz", "wt") as f:  # OLMo-core's metadata: start,end per document
        f.writelines(f"{a},{b}\n" for a, b in zip(offsets, offsets[1:]))
    assert open_tokens(path, vocab_size=300).document_offsets().tolist() == offsets


def test_dolma_npy_errors(tmp_path):
    np.save(tmp_path / "header.npy", np.arange(10, dtype=np.uint16))  # a real numpy file, not raw tokens
    with pytest.raises(DataError, match=r"header\.npy.*numpy header"):
        open_tokens(str(tmp_path / "header.npy"), vocab_size=300)
    (tmp_path / "odd.npy").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"odd\.npy.*3 bytes, not a whole number of uint16"):
        open_tokens(str(tmp_path / "odd.npy"), vocab_size=300)
    with pytest.raises(DataError, match=r"missing\.npy.*does not exist"):
        open_tokens(str(tmp_path / "missing.npy"), vocab_size=300)
    # A uint16 file read as uint32 (the model's vocab is padded past 65536): caught by the id scan.
    write_dolma_npy(tmp_path / "small.npy", [[1, 2, 3]], dtype="uint16")  # 8 bytes: 2 uint32 "ids"
    with pytest.raises(DataError, match=r"read as uint32.*set --data.dtype"):
        PackedDataset([str(tmp_path / "small.npy")], 1, vocab_size=70000)
    write_dolma_npy(tmp_path / "small.npy", [[1, 2]], dtype="uint16")  # 6 bytes
    with pytest.raises(DataError, match=r"not a whole number of uint32 tokens \(the dtype for vocab_size=70000.*--data.dtype"):
        PackedDataset([str(tmp_path / "small.npy")], 1, vocab_size=70000)


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_megatron_reads_back_tokens_and_documents(tmp_path, dtype):
    docs = random_documents(3, 12, 50000)
    prefix = write_megatron(tmp_path / "corpus_text_document", docs, dtype=dtype, split_at=7)
    for named in (prefix, prefix + ".bin", prefix + ".idx"):
        f = open_tokens(named)
        assert f.format == TokenFormat.megatron and f.tokens_N.dtype == np.dtype(dtype)
        assert isinstance(f.tokens_N, np.memmap)
        assert f.tokens_N.tolist() == [t for d in docs for t in d]
        offsets = f.document_offsets().tolist()
        assert offsets == hand_offsets(docs)  # documents, not the (split) sequences
        assert [f.tokens_N[a:b].tolist() for a, b in zip(offsets, offsets[1:])] == docs


def test_megatron_errors(tmp_path):
    prefix = write_megatron(tmp_path / "m", random_documents(4, 4, 300))
    idx = open(prefix + ".idx", "rb").read()
    (tmp_path / "bad.bin").write_bytes(open(prefix + ".bin", "rb").read())
    (tmp_path / "bad.idx").write_bytes(b"NOTMMIDX\x00" + idx[9:])
    with pytest.raises(DataError, match=r"bad\.idx.*not a Megatron index.*MMIDIDX"):
        open_tokens(str(tmp_path / "bad"))
    (tmp_path / "bad.idx").write_bytes(idx[:-8])
    with pytest.raises(DataError, match=r"bad\.idx.*truncated or corrupt"):
        open_tokens(str(tmp_path / "bad"))
    (tmp_path / "bad.idx").write_bytes(idx)
    (tmp_path / "bad.bin").write_bytes(open(prefix + ".bin", "rb").read()[:-2])
    with pytest.raises(DataError, match=r"bad\.idx.*lists \d+ tokens.*bad\.bin.*does not match"):
        open_tokens(str(tmp_path / "bad"))
    (tmp_path / "float.idx").write_bytes(idx[:17] + bytes([7]) + idx[18:])  # code 7: float32
    (tmp_path / "float.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"float\.idx.*dtype code 7"):
        open_tokens(str(tmp_path / "float.idx"))
    os.remove(tmp_path / "float.bin")
    with pytest.raises(DataError, match=r"float.*lacks.*float\.bin"):
        open_tokens(str(tmp_path / "float.idx"))


def test_detection_and_its_errors(tmp_path, write_token_file):
    moetron = write_token_file(tmp_path / "ours", [1, 2, 3, 0])
    megatron = write_megatron(tmp_path / "theirs", [[1, 2, 3]])
    dolma = write_dolma_npy(tmp_path / "olmo.npy", [[1, 2, 3]])
    assert [detect_format(p) for p in (moetron, moetron + ".bin", moetron + ".json")] == [TokenFormat.moetron] * 3
    assert [detect_format(p) for p in (megatron, megatron + ".bin", megatron + ".idx")] == [TokenFormat.megatron] * 3
    assert detect_format(dolma) == TokenFormat.dolma_npy
    (tmp_path / "raw.bin").write_bytes(b"\x01\x00")
    with pytest.raises(DataError, match=r"raw\.bin.*moetron.*Megatron.*\.npy.*neither sidecar nor index"):
        detect_format(str(tmp_path / "raw.bin"))
    with pytest.raises(DataError, match=r"nothing.*does not exist"):
        detect_format(str(tmp_path / "nothing"))
    write_megatron(tmp_path / "ours", [[1, 2, 3, 0]])  # now both a sidecar and an index
    with pytest.raises(DataError, match=r"ours.*ambiguous.*--data.format"):
        detect_format(moetron)
    # An explicit format skips detection: the raw .bin read as a Dolma array.
    assert open_tokens(str(tmp_path / "raw.bin"), "dolma_npy", vocab_size=300).tokens_N.tolist() == [1]


def test_moetron_documents_from_sidecar_eos(tmp_path, write_token_file):
    prefix = write_token_file(tmp_path / "t", [5, 6, 0, 7, 0, 8, 9], eos_id=0)
    f = open_tokens(prefix)
    assert f.format == TokenFormat.moetron and f.document_offsets().tolist() == [0, 3, 5, 7]


def test_packed_samples_identical_across_formats(tmp_path, write_token_file):
    """One token stream in three formats gives the same packed samples, sliced as today's dataset does."""
    docs = random_documents(5, 30, 300)
    stream = [t for d in docs for t in (*d, 0)]
    paths = [
        write_token_file(tmp_path / "m", stream, vocab_size=300),
        write_dolma_npy(tmp_path / "d.npy", docs),
        write_megatron(tmp_path / "g", [[*d, 0] for d in docs]),
    ]
    seq_len = 16
    expected = [stream[j * seq_len : j * seq_len + seq_len + 1] for j in range((len(stream) - 1) // seq_len)]
    for path in paths:
        ds = PackedDataset([path], seq_len, vocab_size=300)
        assert ds.get_batch(range(len(ds))).tolist() == expected, path


def test_negative_ids_in_signed_megatron_files(tmp_path):
    prefix = write_megatron(tmp_path / "neg", [[1, -3, 2, 5, 6]], dtype="int32")
    with pytest.raises(DataError, match=r"neg\.bin.*negative id \(-3\)"):
        PackedDataset([prefix], 2, vocab_size=300)
