import importlib.util
import json
import os

import numpy as np
import pytest

from moetron.data.preprocess import dtype_for_vocab, open_token_file, tokenize_documents, tokenize_files
from moetron.data.tokenizer import DataError

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_cli():
    spec = importlib.util.spec_from_file_location("preprocess_data", os.path.join(_ROOT, "tools", "preprocess_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_tokens(tokenizer, docs):
    out = []
    for d in docs:
        out += tokenizer.encode(d) + [tokenizer.eos_id]
    return out


def read_raw(prefix, dtype):
    return np.fromfile(prefix + ".bin", dtype=dtype).tolist()


DOCS = ["def add(a, b):\n    return a + b\n", "Hello, world.\nSecond line.", "naïve café 🦀"]


def test_text_files_one_document_each(tmp_path, tokenizer):
    paths = []
    for i, d in enumerate(DOCS):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(d, encoding="utf-8")
        paths.append(str(p))
    meta = tokenize_files(paths, str(tmp_path / "out"), tokenizer, progress=False)
    expected = expected_tokens(tokenizer, DOCS)
    assert read_raw(str(tmp_path / "out"), "<u2") == expected
    with open(tmp_path / "out.json") as f:
        sidecar = json.load(f)
    assert sidecar["format"] == "moetron-tokens" and sidecar["version"] == 1
    assert sidecar["dtype"] == "uint16"
    assert sidecar["num_tokens"] == len(expected) == meta["num_tokens"]
    assert sidecar["num_documents"] == 3
    assert sidecar["eos_id"] == tokenizer.eos_id
    assert sidecar["vocab_size"] == tokenizer.vocab_size
    assert sidecar["max_token_id"] == max(expected)
    tokens, opened = open_token_file(str(tmp_path / "out.bin"))
    assert tokens.tolist() == expected
    assert opened["tokenizer"] == os.path.abspath(tokenizer.path)
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]


def test_text_split_on_blank_lines(tmp_path, tokenizer):
    p = tmp_path / "many.txt"
    p.write_text("first doc\nstill first\n\n\n  second doc\n\nthird\n", encoding="utf-8")
    tokenize_files([str(p)], str(tmp_path / "out"), tokenizer, split_blank_lines=True, progress=False)
    docs = ["first doc\nstill first", "  second doc", "third"]
    assert read_raw(str(tmp_path / "out"), "<u2") == expected_tokens(tokenizer, docs)
    tokenize_files([str(p)], str(tmp_path / "whole"), tokenizer, progress=False)
    whole = "first doc\nstill first\n\n\n  second doc\n\nthird\n"
    assert read_raw(str(tmp_path / "whole"), "<u2") == expected_tokens(tokenizer, [whole])


def test_jsonl_key(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    with open(p, "w", encoding="utf-8") as f:
        for d in DOCS:
            f.write(json.dumps({"id": 1, "content": d}) + "\n")
    tokenize_files([str(p)], str(tmp_path / "out"), tokenizer, jsonl_key="content", progress=False)
    assert read_raw(str(tmp_path / "out"), "<u2") == expected_tokens(tokenizer, DOCS)
    with pytest.raises(DataError, match="no key 'text'.*--jsonl-key"):
        tokenize_files([str(p)], str(tmp_path / "bad"), tokenizer, progress=False)
    assert not os.path.exists(tmp_path / "bad.json") and not os.path.exists(tmp_path / "bad.bin")


def test_existing_output_is_refused_unless_overwrite(tmp_path, tokenizer):
    p = tmp_path / "a.txt"
    p.write_text("first version", encoding="utf-8")
    out = str(tmp_path / "out")
    tokenize_files([str(p)], out, tokenizer, progress=False)
    before = read_raw(out, "<u2")
    p.write_text("a second, longer version of the text", encoding="utf-8")
    with pytest.raises(DataError, match=r"out\.bin.*already exists.*--overwrite"):
        tokenize_files([str(p)], out, tokenizer, progress=False)
    with pytest.raises(DataError, match="already exists"):
        tokenize_documents(["x"], out, tokenizer, progress=False)
    assert read_raw(out, "<u2") == before
    # a lone sidecar (or .bin) counts too
    os.remove(out + ".bin")
    with pytest.raises(DataError, match=r"out\.json.*already exists"):
        tokenize_files([str(p)], out, tokenizer, progress=False)
    tokenize_files([str(p)], out, tokenizer, progress=False, overwrite=True)
    assert read_raw(out, "<u2") == expected_tokens(tokenizer, ["a second, longer version of the text"])


def test_invalid_utf8_in_jsonl_names_file_and_line(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    # enough valid lines first that a chunked text-mode decoder would fail before reaching line 3000
    lines = [json.dumps({"text": f"doc {i}"}).encode() for i in range(2999)] + [b'{"text": "caf\xe9"}']
    p.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=r"d\.jsonl:3000 is not valid UTF-8 \(byte 0xe9 at column 14\)"):
        tokenize_files([str(p)], str(tmp_path / "out"), tokenizer, progress=False)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out")]


class CharTokenizer:
    """A test double with a huge vocabulary: id = code point + 70000 (so ids need uint32)."""

    def __init__(self, vocab_size, offset):
        self.vocab_size, self.offset, self.eos_id, self.path = vocab_size, offset, 1, None

    def encode(self, text):
        return [ord(c) + self.offset for c in text]


@pytest.mark.parametrize("vocab_size,offset,dtype", [(70_000 + 0x20000, 70_000, "uint32"), (65_536, 60_000, "uint16")])
def test_dtype_follows_vocab_size(tmp_path, vocab_size, offset, dtype):
    tok = CharTokenizer(vocab_size, offset)
    docs = ["ab", "xyz"]
    meta = tokenize_documents(docs, str(tmp_path / "big"), tok, progress=False)
    assert meta["dtype"] == dtype
    expected = [ord(c) + offset for c in "ab"] + [1] + [ord(c) + offset for c in "xyz"] + [1]
    itemsize = 4 if dtype == "uint32" else 2
    assert os.path.getsize(tmp_path / "big.bin") == len(expected) * itemsize
    assert read_raw(str(tmp_path / "big"), "<u4" if dtype == "uint32" else "<u2") == expected
    tokens, _ = open_token_file(str(tmp_path / "big"))
    assert tokens.tolist() == expected
    assert dtype_for_vocab(65_536).itemsize == 2 and dtype_for_vocab(65_537).itemsize == 4


def test_cli_trains_tokenizer_and_tokenizes(tmp_path, sample_text):
    cli = load_cli()
    src = tmp_path / "in.txt"
    src.write_text(sample_text, encoding="utf-8")
    rc = cli.main(["--input", str(tmp_path / "*.txt"), "--output-prefix", str(tmp_path / "tok/out"),
                   "--train-tokenizer", "--vocab-size", "400", "--split-blank-lines", "--no-progress"])
    assert rc == 0
    tokens, meta = open_token_file(str(tmp_path / "tok/out"))
    from moetron.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer.from_file(meta["tokenizer"])
    assert meta["tokenizer"] == str(tmp_path / "tok/out.tokenizer.model")
    # Documents are the runs of non-blank lines: recompute them by hand.
    by_hand, cur = [], []
    for line in sample_text.splitlines(keepends=True):
        if line.strip():
            cur.append(line)
        elif cur:
            by_hand.append("".join(cur).rstrip("\n"))
            cur = []
    if cur:
        by_hand.append("".join(cur).rstrip("\n"))
    assert meta["num_documents"] == len(by_hand) > 10
    assert tokens.tolist() == expected_tokens(tok, by_hand)
    # With an existing tokenizer; a missing one is a clean error, not a traceback.
    assert cli.main(["--input", str(src), "--output-prefix", str(tmp_path / "b"), "--tokenizer", tok.path]) == 0
    # (main raises the DataError; run_cli turns it into one "error:" line and exit 2: tests/tools/test_preprocess_data.py)
    with pytest.raises(DataError, match="no.model"):
        cli.main(["--input", str(src), "--output-prefix", str(tmp_path / "c"), "--tokenizer", str(tmp_path / "no.model")])


# ---- open_token_file errors -------------------------------------------------------------------
def test_missing_sidecar_and_files(tmp_path, write_token_file):
    prefix = write_token_file(tmp_path / "a", [1, 2, 3])
    os.remove(prefix + ".json")
    with pytest.raises(DataError, match=r"a\.bin.*has no sidecar"):
        open_token_file(prefix)
    with pytest.raises(DataError, match=r"nothere.*not found"):
        open_token_file(str(tmp_path / "nothere"))


def test_garbage_sidecar(tmp_path, write_token_file):
    prefix = write_token_file(tmp_path / "a", [1, 2, 3])
    with open(prefix + ".json", "w") as f:
        f.write("{not json")
    with pytest.raises(DataError, match=r"a\.json.*not valid JSON"):
        open_token_file(prefix)
    with open(prefix + ".json", "w") as f:
        json.dump({"format": "something-else"}, f)
    with pytest.raises(DataError, match=r"a\.json.*not a moetron token file"):
        open_token_file(prefix)


def test_bad_dtype_and_truncation(tmp_path, write_token_file):
    prefix = write_token_file(tmp_path / "a", [1, 2, 3], dtype="uint16")
    meta = json.load(open(prefix + ".json"))
    meta["dtype"] = "int8"
    json.dump(meta, open(prefix + ".json", "w"))
    with pytest.raises(DataError, match=r"a\.json.*dtype 'int8'"):
        open_token_file(prefix)
    # A uint16 file whose sidecar says uint32: the size no longer matches.
    meta["dtype"] = "uint32"
    json.dump(meta, open(prefix + ".json", "w"))
    with pytest.raises(DataError, match=r"a\.bin.*truncated.*6 bytes.*12 bytes"):
        open_token_file(prefix)
    prefix = write_token_file(tmp_path / "b", list(range(10)))
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(15)
    with pytest.raises(DataError, match=r"b\.bin.*truncated"):
        open_token_file(prefix)
