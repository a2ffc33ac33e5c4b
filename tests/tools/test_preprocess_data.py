"""tools/preprocess_data.py as a script: bad input is one "error:" line and exit 2, like every tool."""

import os

import pytest
from tests.processes import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


def run_tool(*args):
    return run_python([TOOL, *map(str, args)], timeout=120)


@pytest.mark.parametrize("case", ["missing_tokenizer", "bad_utf8", "existing_output", "existing_tokenizer"])
def test_bad_input_exits_2_with_one_error_line(tmp_path, case):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello"}\n', encoding="utf-8")
    out = tmp_path / "out"
    args = ["--input", src, "--output-prefix", out, "--tokenizer", tmp_path / "no.model"]
    expected = "no.model"
    if case == "bad_utf8":
        src.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
        args = ["--input", src, "--output-prefix", out, "--train-tokenizer", "--vocab-size", "300"]
        expected = "in.jsonl:2 is not valid UTF-8"
    elif case == "existing_output":
        (tmp_path / "out.bin").write_bytes(b"")
        expected = "already exists"
    elif case == "existing_tokenizer":
        (tmp_path / "out.tokenizer.model").write_bytes(b"")
        args = ["--input", src, "--output-prefix", out, "--train-tokenizer", "--vocab-size", "300"]
        expected = "out.tokenizer.model' already exists"
    proc = run_tool(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert expected in proc.stderr
    if case == "existing_output":
        assert (tmp_path / "out.bin").read_bytes() == b""
