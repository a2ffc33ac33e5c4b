"""Tokenizers: one interface (:class:`Tokenizer`), two implementations, chosen by file type in
:func:`load_tokenizer`: :class:`SentencePieceTokenizer` (a ``.model`` file; deterministic training)
and :class:`HFTokenizer` (a Hugging Face ``tokenizer.json`` or a directory holding one, read by the
optional ``tokenizers`` package: the Olmo 3 / OLMoE dolma2 tokenizers are in this format).

Also home of :class:`DataError`, the one exception type for bad data files (this module is the
bottom of ``moetron.data``'s import graph, so every other data module can import it from here).

Training is deterministic: sentencepiece's own sentence sampling (``input_sentence_size`` with
``shuffle_input_sentence``) gives a different model on every run even with a fixed seed, so we never
use it. When the input has more lines than ``max_sentences`` we keep an evenly strided subset
ourselves, and the trainer runs with a fixed thread count (the count is stored in the model file).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Iterable, Protocol, Sequence

__all__ = ["DataError", "Tokenizer", "SentencePieceTokenizer", "HFTokenizer", "load_tokenizer", "DEFAULT_TRAIN_OPTIONS"]


class DataError(ValueError):
    """A data file or tokenizer is missing, malformed or incompatible: the message names the file
    and says what to do about it."""


class Tokenizer(Protocol):
    """What moetron needs from a tokenizer. ``encode`` never adds BOS/EOS (preprocessing appends
    EOS); every id is in ``[0, vocab_size)``."""

    @property
    def path(self) -> str: ...  # the file or directory it was loaded from
    @property
    def kind(self) -> str: ...  # "sentencepiece" or "hf"
    @property
    def name(self) -> str: ...  # a short human name (the model file's stem, the HF directory's name)
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_id(self) -> int | None: ...
    @property
    def bos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


_TOKENIZER_KINDS = "a sentencepiece .model file, a Hugging Face tokenizer.json, or a directory holding one"


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at ``path``, by file type: ``*.model`` -> SentencePieceTokenizer; ``*.json``
    (``tokenizer.json``) or a directory with ``tokenizer.json`` -> HFTokenizer; a directory with
    only ``tokenizer.model`` -> SentencePieceTokenizer. Anything else is a DataError saying what
    is accepted."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"tokenizer {path!r} does not exist: pass {_TOKENIZER_KINDS}")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, HFTokenizer.FILE)):
            return HFTokenizer(path)
        if os.path.isfile(os.path.join(path, "tokenizer.model")):
            return SentencePieceTokenizer(os.path.join(path, "tokenizer.model"))
        raise DataError(f"tokenizer directory {path!r} holds neither tokenizer.json nor tokenizer.model: "
                        f"pass {_TOKENIZER_KINDS}")
    if path.endswith(".model"):
        return SentencePieceTokenizer(path)
    if path.endswith(".json"):
        return HFTokenizer(path)
    raise DataError(f"tokenizer {path!r} is of unknown type (by its name): pass {_TOKENIZER_KINDS}")


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

    kind = "sentencepiece"

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
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self._path))[0]

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


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise DataError("Hugging Face tokenizers (tokenizer.json) need the tokenizers package: "
                        "pip install tokenizers") from e
    return tokenizers


# Special tokens that mean end/begin of text in common tokenizer.json files (dolma2, GPT-2, Llama
# 3, T5-style), for a tokenizer.json that comes without tokenizer_config.json.
_KNOWN_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
_KNOWN_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` read by the ``tokenizers`` package (import-guarded).

    ``path`` is the tokenizer.json file or a directory holding it. ``encode`` is tokenizers'
    ``encode(text, add_special_tokens=False).ids`` (no BOS/EOS; text that spells an added special
    token, e.g. ``<|endoftext|>``, encodes to that token, as in tokenizers). ``vocab_size`` is the
    largest id (added tokens included) + 1. EOS/BOS come from, in order: the ``eos_token`` /
    ``bos_token`` arguments; ``tokenizer_config.json``, then ``special_tokens_map.json`` beside the
    file; the special tokens of the post-processor template in tokenizer.json; a well-known
    special token name (``<|endoftext|>``, ``</s>`` ...).
    """

    kind = "hf"
    FILE = "tokenizer.json"

    def __init__(self, path: str, eos_token: str | None = None, bos_token: str | None = None):
        path = os.fspath(path)
        file = os.path.join(path, self.FILE) if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise DataError(f"tokenizer {file!r} does not exist: pass {_TOKENIZER_KINDS}")
        tokenizers = _import_tokenizers()
        try:
            self._tok = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises bare Exception subclasses for bad files
            raise DataError(f"tokenizer {file!r} is not a valid Hugging Face tokenizer.json ({e}): "
                            f"point at the right file") from None
        self._path, self._file = path, file
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        folder = os.path.dirname(os.path.abspath(file))
        named = _special_tokens_from_configs(folder)
        template = _template_special_tokens(self._tok.to_str())
        self._eos_id = self._special_id("eos", [eos_token, named.get("eos"), template.get("eos"), *_KNOWN_EOS],
                                        explicit=eos_token or named.get("eos"))
        self._bos_id = self._special_id("bos", [bos_token, named.get("bos"), template.get("bos"), *_KNOWN_BOS],
                                        explicit=bos_token or named.get("bos"))

    def _special_id(self, what: str, candidates: list[str | None], explicit: str | None) -> int | None:
        """The id of the first candidate token in the vocabulary; a named (explicit) token that is
        not in it is a DataError, since a silently different EOS would corrupt the data."""
        if explicit is not None and self._tok.token_to_id(explicit) is None:
            raise DataError(f"tokenizer {self._file!r}: {what}_token {explicit!r} (from the arguments or "
                            f"tokenizer_config.json / special_tokens_map.json) is not in its vocabulary")
        for token in candidates:
            if token is not None and (i := self._tok.token_to_id(token)) is not None:
                return int(i)
        return None

    @property
    def path(self) -> str:
        return self._path

    @property
    def name(self) -> str:
        return os.path.basename(os.path.dirname(os.path.abspath(self._file)))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, in Rust threads (TOKENIZERS_PARALLELISM governs them)."""
        if not texts:
            return []
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer(path={self._path!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_tokens_from_configs(folder: str) -> dict[str, str]:
    """{"eos"/"bos": token} from tokenizer_config.json, else special_tokens_map.json, in ``folder``."""
    found: dict[str, str] = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = os.path.join(folder, fname)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path} is not valid JSON ({e}): fix or remove it") from None
        if not isinstance(config, dict):
            raise DataError(f"{path} is not a JSON object: fix or remove it")
        for what in ("eos", "bos"):
            token = _token_content(config.get(f"{what}_token"))
            if token is not None:
                found[what] = token
    return found


def _template_special_tokens(tokenizer_json: str) -> dict[str, str]:
    """{"eos"/"bos": token} from a TemplateProcessing post-processor: the special token its
    single-sequence template ends (EOS) or starts (BOS) with."""
    processor = json.loads(tokenizer_json).get("post_processor") or {}
    steps = processor.get("processors", [processor]) if processor.get("type") == "Sequence" else [processor]
    for step in steps:
        single = step.get("single") if step.get("type") == "TemplateProcessing" else None
        if not single:
            continue
        ends = {"eos": single[-1], "bos": single[0]}
        return {what: piece["SpecialToken"]["id"] for what, piece in ends.items() if "SpecialToken" in piece}
    return {}


def _iter_lines(path: str) -> Iterable[str]:
    """Lines of a UTF-8 text file without their newline; undecodable bytes are replaced."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            yield line.rstrip("\n")
