"""HF tokenizers (tokenizer.json through the `tokenizers` package): the token file equals tokenizers'
own encode (+ EOS) of every document; the sidecar records vocab size, EOS/BOS and the tokenizer's
kind; EOS/BOS come from tokenizer_config.json / the post-processor template / well-known names;
a vocab larger than the model's is the usual clear error; bad paths are one clear DataError."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from moetron.data.dataset import PackedDataset
from moetron.data.preprocess import open_token_file, tokenize_documents
from moetron.data.tokenizer import DataError, HFTokenizer, SentencePieceTokenizer, load_tokenizer

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DOCS = ["def f(x):\n    return x + 1\n", "héllo 🦀 日本語, never seen in training", "  leading spaces\tand tabs",
        "The quick brown fox jumps over the lazy dog. " * 20]


def load_cli():
    spec = importlib.util.spec_from_file_location("preprocess_data", os.path.join(_ROOT, "tools", "preprocess_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_bpe(sample_text: str, vocab_size: int = 400, template: bool = False) -> "tokenizers.Tokenizer":
    """A tiny byte-level BPE trained here (as GPT-2 / dolma2 tokenizers are built)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|pad|>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample_text.splitlines(), trainer)
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    return tok


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, sample_text):
    folder = tmp_path_factory.mktemp("hf_tok") / "tiny-bpe"
    folder.mkdir()
    tok = train_bpe(sample_text)
    tok.save(str(folder / "tokenizer.json"))
    return tok, folder


def test_preprocess_equals_tokenizers_own_encode(bpe, tmp_path):
    tok, folder = bpe
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    assert load_cli().main(["--input", str(src), "--output-prefix", str(tmp_path / "out"),
                            "--tokenizer", str(folder / "tokenizer.json"), "--no-progress"]) == 0
    tokens, meta = open_token_file(str(tmp_path / "out"))
    eos = tok.token_to_id("<|endoftext|>")
    expected = [i for d in DOCS for i in tok.encode(d, add_special_tokens=False).ids + [eos]]
    assert tokens.tolist() == expected
    assert meta["vocab_size"] == tok.get_vocab_size(with_added_tokens=True) == 400
    assert meta["eos_id"] == eos and meta["num_documents"] == len(DOCS) and meta["dtype"] == "uint16"
    assert meta["tokenizer_kind"] == "hf" and meta["tokenizer_name"] == "tiny-bpe"
    assert meta["bos_id"] == tok.token_to_id("<s>")  # no config, no template: the well-known names
    assert meta["tokenizer"] == str(folder / "tokenizer.json")
    assert load_tokenizer(meta["tokenizer"]).encode(DOCS[1]) == tok.encode(DOCS[1], add_special_tokens=False).ids
    # The usual vocab check against the model: the tokenizer's vocab must fit.
    PackedDataset([str(tmp_path / "out")], seq_len=8, vocab_size=512)
    with pytest.raises(DataError, match="the model's vocab_size is 399.*vocab_size >= 400"):
        PackedDataset([str(tmp_path / "out")], seq_len=8, vocab_size=399)


def test_interface_and_round_trip(bpe):
    tok, folder = bpe
    hf = load_tokenizer(str(folder))  # the directory works as the file does
    assert isinstance(hf, HFTokenizer) and hf.kind == "hf" and hf.vocab_size == 400
    assert hf.encode_batch(DOCS) == [hf.encode(d) for d in DOCS]
    for d in DOCS:
        assert hf.decode(hf.encode(d)) == d
    assert hf.eos_id not in hf.encode(DOCS[0])


def test_eos_bos_from_tokenizer_config(bpe, tmp_path):
    tok, folder = bpe
    tok.save(str(tmp_path / "tokenizer.json"))
    # AddedToken dicts and plain strings, as HF writes both; tokenizer_config.json beats the
    # special_tokens_map.json and the well-known names.
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|pad|>"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "</s>", "special": True}, "bos_token": "<s>"}))
    hf = load_tokenizer(str(tmp_path))
    assert (hf.eos_id, hf.bos_id) == (tok.token_to_id("</s>"), tok.token_to_id("<s>"))
    meta = tokenize_documents(DOCS[:2], str(tmp_path / "t"), hf, progress=False)
    assert meta["eos_id"] == tok.token_to_id("</s>") and meta["bos_id"] == tok.token_to_id("<s>")
    os.remove(tmp_path / "tokenizer_config.json")
    assert load_tokenizer(str(tmp_path)).eos_id == tok.token_to_id("<|pad|>")
    # A config naming a token the vocabulary lacks is refused, never guessed around.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(DataError, match="eos_token '<\\|im_end\\|>'.*not in its vocabulary"):
        load_tokenizer(str(tmp_path))


def test_eos_bos_from_post_processor_template(tmp_path, sample_text):
    tok = train_bpe(sample_text, template=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (hf.bos_id, hf.eos_id) == (tok.token_to_id("<s>"), tok.token_to_id("</s>"))
    # encode adds neither, though tokenizers' default encode would.
    assert hf.encode("a b") == tok.encode("a b", add_special_tokens=False).ids != tok.encode("a b").ids


def test_dolma2_sized_vocab_uses_uint32_and_fits_the_padded_model(tmp_path):
    """dolma2's shape: 100278 ids, EOS <|endoftext|> = 100257, models padded to 100352."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(100_278)}
    vocab["<|endoftext|>"] = vocab.pop("w100257")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (hf.vocab_size, hf.eos_id) == (100_278, 100_257)
    meta = tokenize_documents(["w5 w100277 w70000", "w1"], str(tmp_path / "d"), hf, progress=False)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 100_278 and meta["eos_id"] == 100_257
    assert open_token_file(str(tmp_path / "d"))[0].tolist() == [5, 100_277, 70_000, 100_257, 1, 100_257]
    PackedDataset([str(tmp_path / "d")], seq_len=2, vocab_size=100_352)
    with pytest.raises(DataError, match="set --model.vocab_size >= 100278"):
        PackedDataset([str(tmp_path / "d")], seq_len=2, vocab_size=50_304)


def test_chosen_by_file_type(tokenizer, bpe, tmp_path):
    _, folder = bpe
    assert isinstance(load_tokenizer(tokenizer.path), SentencePieceTokenizer) and tokenizer.kind == "sentencepiece"
    hf_dir = tmp_path / "spm_dir"
    hf_dir.mkdir()
    (hf_dir / "tokenizer.model").write_bytes(open(tokenizer.path, "rb").read())
    assert isinstance(load_tokenizer(str(hf_dir)), SentencePieceTokenizer)  # an HF dir with a sentencepiece model
    with pytest.raises(DataError, match="nope.json.*does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(DataError, match="unknown type.*sentencepiece .model file, a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path / "vocab.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match="bad.json.*not a valid Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"))


def test_missing_tokenizers_package_names_the_install(bpe, monkeypatch):
    _, folder = bpe
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(DataError, match="pip install tokenizers"):
        load_tokenizer(str(folder))


def test_tokenizer_without_eos_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(str(tmp_path))
    assert hf.eos_id is None
    with pytest.raises(DataError, match="no EOS id.*eos_token in a tokenizer_config.json"):
        tokenize_documents(["a b"], str(tmp_path / "t"), hf, progress=False)
