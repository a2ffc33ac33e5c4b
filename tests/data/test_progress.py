"""The one progress bar (data/progress.py): one redrawn line, ended even on failure, silent unless
asked or on a terminal; preprocessing, HF export and save_weights sources report through it."""

from __future__ import annotations

import io

import pytest
import torch

from moetron.data.preprocess import tokenize_documents
from moetron.data.progress import Progress


class Toy:
    eos_id, vocab_size = 0, 300

    def encode(self, text):
        return [1 + b for b in text.encode()]


def test_one_line_redrawn_and_ended():
    out = io.StringIO()
    with Progress("work", total=4_000_000, stream=out, enabled=True, interval_s=0) as bar:
        bar.update(1_000_000, note="a")
        bar.advance(3_000_000, note="b")
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "work [" in text and "100.0% 4.0MB/4.0MB" in text and " b" in text
    bar.update(5)  # closed: draws nothing more
    assert out.getvalue() == text


def test_silent_when_disabled_and_off_a_terminal():
    out = io.StringIO()  # not a tty
    with Progress("work", total=10, stream=out) as bar:
        bar.update(10, force=True)
    with Progress("work", total=10, stream=out, enabled=False) as bar:
        bar.update(10, force=True)
    assert out.getvalue() == ""


def test_line_is_ended_when_the_job_fails():
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress("work", total=10, unit="tensors", stream=out, enabled=True, interval_s=0) as bar:
            bar.update(3)
            raise RuntimeError("boom")
    assert out.getvalue().endswith("\n") and "3 tensors/10 tensors" in out.getvalue()


def test_tracking_counts_the_bytes_of_produced_tensors():
    specs = {"a": ((4, 8), torch.float32), "b": ((16,), torch.bfloat16)}
    bar = Progress("w", enabled=False)
    produce = bar.tracking(specs, lambda name: torch.zeros(specs[name][0], dtype=specs[name][1]))
    assert bar.total == 4 * 8 * 4 + 16 * 2
    produce("a")
    assert bar.done == 128
    produce("b")
    assert bar.done == bar.total


def test_preprocessing_draws_the_bar(tmp_path, capsys):
    docs = ["hello world"] * 50
    tokenize_documents(docs, str(tmp_path / "t"), Toy(), total_bytes=550, progress=True, batch_bytes=100)
    err = capsys.readouterr().err
    assert err.startswith("\r\x1b[Ktokenizing -> ") and err.endswith("\n") and "100.0%" in err and "600 tokens" in err
    tokenize_documents(docs, str(tmp_path / "u"), Toy(), total_bytes=550, progress=False)
    assert capsys.readouterr().err == ""
