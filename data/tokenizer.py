"""SentencePiece tokenizer: deterministic training, loading, encode/decode.

Also home of :class:`DataError`, the one exception type for bad data files (this module is the
bottom of ``moetron.data``'s import graph, so every other data module can import it from here).

Training is deterministic: sentencepiece's own sentence sampling (``input_sentence_size`` with
``shuffle_input_sentence``) gives a different model on every run even with a fixed seed, so we never
use it. When the input has more lines than ``max_sentences`` we keep an evenly strided subset
ourselves, and the trainer runs with a fixed thread count (the count is stored in the model file).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Iterable, Sequence

__all__ = ["DataError", "SentencePieceTokenizer", "DEFAULT_TRAIN_OPTIONS"]


class DataError(ValueError):
    """A data file or tokenizer is missing, malformed or incompatible: the message names the file
    and says what to do about it."""


# Defaults suited to code and prose alike: no normalization (so indentation and unicode survive a
# round trip), whitespace-only pieces (indentation runs become single tokens), byte fallback (any
# text encodes, nothing maps to <unk>). Every key can be overridden through ``train(**opts)``.
DEFAULT_TRAIN_OPTIONS: dict[str, Any] = dict(
    model_type="bpe",
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    character_coverage=0.9995,
    max_sentence_length=16384,
    # The requested size is a maximum: a tiny corpus may not support that many pieces.
    hard_vocab_limit=False,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    # Fixed, not os.cpu_count(): the thread count is stored in the model file.
    num_threads=1,
    # Sampling is ours (see module docstring): sentencepiece must read every line we give it.
    input_sentence_size=0,
    shuffle_input_sentence=False,
    minloglevel=1,
)


def _import_sentencepiece():
    try:
        import sentencepiece
    except ImportError as e:  # pragma: no cover - sentencepiece is a declared dependency
        raise DataError("sentencepiece is not installed: pip install sentencepiece") from e
    return sentencepiece


def _strided_keep(num_lines: int, max_lines: int) -> Iterable[bool]:
    """Yield, for each of ``num_lines`` lines, whether it is kept so that ``max_lines`` evenly
    spaced lines survive (deterministic, covers the whole input rather than its head)."""
    for i in range(num_lines):
        yield (i + 1) * max_lines // num_lines > i * max_lines // num_lines


class SentencePieceTokenizer:
    """A trained sentencepiece model. ``encode`` never adds BOS/EOS; preprocessing appends EOS."""

    def __init__(self, path: str):
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise DataError(
                f"tokenizer model {path!r} does not exist: pass the path of a sentencepiece .model "
                f"file, or train one (tools/preprocess_data.py --train-tokenizer --vocab-size N)"
            )
        spm = _import_sentencepiece()
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise DataError(
                f"tokenizer model {path!r} is not a valid sentencepiece model ({e}): "
                f"re-train it or point at the right file"
            ) from None
        self._path = path

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str) -> "SentencePieceTokenizer":
        """Load ``path`` (a sentencepiece ``.model`` file); DataError if missing or invalid."""
        return cls(path)

    @classmethod
    def train(
        cls,
        input_files: Sequence[str],
        model_prefix: str,
        vocab_size: int,
        max_sentences: int | None = 2_000_000,
        **opts: Any,
    ) -> "SentencePieceTokenizer":
        """Train on the lines of ``input_files`` and write ``<model_prefix>.model`` / ``.vocab``.

        ``max_sentences`` caps the training lines (an evenly strided subset, deterministic);
        ``opts`` override :data:`DEFAULT_TRAIN_OPTIONS` (e.g. ``model_type="unigram"``). The same
        inputs and options give a byte-identical model. The files are written under a temporary
        name and renamed, so a crash never leaves a model that looks complete.
        """
        if vocab_size < 8:
            raise DataError(f"tokenizer vocab_size={vocab_size} is too small: use at least 8")
        for f in input_files:
            if not os.path.isfile(f):
                raise DataError(f"tokenizer training input {f!r} does not exist: check the path")
        options = dict(DEFAULT_TRAIN_OPTIONS)
        options.update(opts)
        if options.get("eos_id", -1) < 0:
            raise DataError("the tokenizer needs an EOS id (documents are separated by EOS): eos_id >= 0")
        spm = _import_sentencepiece()
        model_prefix = os.fspath(model_prefix)
        out_dir = os.path.dirname(os.path.abspath(model_prefix))
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".spm-train-") as tmp:
            # Collect the training lines into one file: sentencepiece then reads all of it.
            num_lines = sum(1 for f in input_files for line in _iter_lines(f) if line)
            if num_lines == 0:
                raise DataError(f"tokenizer training inputs {list(input_files)!r} contain no text")
            limit = num_lines if not max_sentences else min(num_lines, max_sentences)
            keep = _strided_keep(num_lines, limit)
            train_txt = os.path.join(tmp, "train.txt")
            with open(train_txt, "w", encoding="utf-8") as out:
                for f in input_files:
                    for line in _iter_lines(f):
                        if line and next(keep):
                            out.write(line + "\n")
            tmp_prefix = os.path.join(tmp, "model")
            try:
                spm.SentencePieceTrainer.Train(
                    input=train_txt, model_prefix=tmp_prefix, vocab_size=vocab_size, **options
                )
            except RuntimeError as e:
                raise DataError(f"sentencepiece training for {model_prefix!r} failed: {e}") from None
            for ext in (".vocab", ".model"):  # .model last: its presence means "complete"
                os.replace(tmp_prefix + ext, model_prefix + ext)
        return cls(model_prefix + ".model")

    # ---- properties -------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._path

    @property
    def vocab_size(self) -> int:
        return int(self._sp.GetPieceSize())

    @property
    def eos_id(self) -> int | None:
        i = int(self._sp.eos_id())
        return None if i < 0 else i

    @property
    def bos_id(self) -> int | None:
        i = int(self._sp.bos_id())
        return None if i < 0 else i

    # ---- encode / decode --------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return list(self._sp.EncodeAsIds(text))

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
        """``[encode(t) for t in texts]``, in C++ over ``num_threads`` threads (0 = all cores)."""
        if not texts:
            return []
        return self._sp.Encode(list(texts), out_type=int, num_threads=num_threads or os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(path={self._path!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _iter_lines(path: str) -> Iterable[str]:
    """Lines of a UTF-8 text file without their newline; undecodable bytes are replaced."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            yield line.rstrip("\n")
