import os

import pytest

from moetron.data.tokenizer import DataError, SentencePieceTokenizer


def test_roundtrip_and_properties(tokenizer):
    assert tokenizer.vocab_size == 400
    assert tokenizer.eos_id is not None and 0 <= tokenizer.eos_id < 400
    assert tokenizer.bos_id is None or tokenizer.bos_id != tokenizer.eos_id
    assert os.path.isfile(tokenizer.path)
    # Indentation, tabs, blank lines and characters never seen in training (byte fallback).
    for text in ["def f(x):\n    return x\n\n\tpass  ", "héllo 🦀 日本語 \x00", "  leading"]:
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.eos_id not in ids  # encode adds no EOS
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode_batch(["a b", "cd"]) == [tokenizer.encode("a b"), tokenizer.encode("cd")]


def test_training_is_deterministic(tmp_path, sample_text):
    text = tmp_path / "t.txt"
    text.write_text(sample_text, encoding="utf-8")
    # max_sentences below the line count exercises our own (deterministic) sampling.
    a = SentencePieceTokenizer.train([str(text)], str(tmp_path / "a"), 400, max_sentences=200)
    b = SentencePieceTokenizer.train([str(text)], str(tmp_path / "b"), 400, max_sentences=200)
    # The model file also records the (temporary) input path, so compare the vocabularies.
    assert pieces(a) == pieces(b)
    c = SentencePieceTokenizer.train([str(text)], str(tmp_path / "c"), 400, max_sentences=100)
    assert pieces(a) != pieces(c)  # the cap really changes what is trained on


def pieces(tok):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=tok.path)
    return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]


def test_unigram_option(tmp_path, sample_text):
    text = tmp_path / "t.txt"
    text.write_text(sample_text, encoding="utf-8")
    tok = SentencePieceTokenizer.train([str(text)], str(tmp_path / "u"), 400, model_type="unigram")
    assert tok.decode(tok.encode("import json")) == "import json"


def test_missing_model_file(tmp_path):
    missing = str(tmp_path / "nope.model")
    with pytest.raises(DataError, match="nope.model.*does not exist"):
        SentencePieceTokenizer.from_file(missing)
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a valid sentencepiece model"):
        SentencePieceTokenizer.from_file(str(bad))
    with pytest.raises(DataError, match="does not exist"):
        SentencePieceTokenizer.train([missing], str(tmp_path / "x"), 300)


def test_training_requires_eos(tmp_path, sample_text):
    text = tmp_path / "t.txt"
    text.write_text(sample_text, encoding="utf-8")
    with pytest.raises(DataError, match="needs an EOS id"):
        SentencePieceTokenizer.train([str(text)], str(tmp_path / "n"), 400, eos_id=-1)
    assert not os.path.exists(tmp_path / "n.model")
