"""The data config and what it builds: this rank's training batches, held-out batches, resumable.

Shapes: S = seq_len, G = global batch size (sequences per optimizer step over all data-parallel
ranks), L = G // dp_size (this rank's share). ``TrainData.next_batch()`` returns [L, S+1] token ids;
the trainer splits it into micro-batches and takes inputs = [:, :-1], labels = [:, 1:].
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

import numpy as np
import torch

from moetron.core.config import Config, ConfigError, StrEnum
from moetron.data.corpus import DEFAULT_MAX_BYTES, ensure_default_corpus
from moetron.data.dataset import PackedDataset
from moetron.data.formats import TOKEN_DTYPES, TokenFormat, source_key
from moetron.data.sampler import GlobalBatchSampler, MixtureSampler
from moetron.data.tokenizer import DataError

__all__ = ["DataSource", "DataConfig", "MixtureSource", "TrainData"]

# The held-out order never depends on the run's seed, so val losses compare across runs.
_VAL_SEED = 1234


class DataSource(StrEnum):
    default_corpus = "default_corpus"
    """The embedded corpus (moetron.data.corpus): Python stdlib text, tokenized on first use."""
    files = "files"
    """Token files (moetron, Dolma .npy, Megatron .bin/.idx) named by train_paths or mixture, and val_paths."""


_TOKEN_EXTENSIONS = (".bin", ".json", ".idx", ".npy")


@dataclasses.dataclass
class MixtureSource(Config):
    """One source of a weighted mixture: its token files and its share of the training samples."""

    paths: list[str] = dataclasses.field(default_factory=list)
    """Token files of this source (paths, prefixes or globs, any format data.format reads)."""
    weight: float = 1.0
    """Relative share of training samples (weights are normalised over the sources)."""
    name: str | None = None
    """Name in logs and checkpoints; None: the first path's file name (its folder's for a glob)."""

    def resolved_name(self) -> str:
        if self.name:
            return self.name
        first = self.paths[0] if self.paths else ""
        base = os.path.basename(first.rstrip("/"))
        if glob.has_magic(base):
            base = os.path.basename(os.path.dirname(first)) or base
        for ext in _TOKEN_EXTENSIONS:
            base = base.removesuffix(ext)
        return base


def _default_data_dir() -> str:
    return os.environ.get("MOETRON_DATA_DIR", "data_cache")


@dataclasses.dataclass
class DataConfig(Config):
    """Where the tokens come from and how they are cut into global batches."""

    source: DataSource = DataSource.default_corpus
    """default_corpus (built and cached under data_dir on first use) or files (train_paths)."""
    train_paths: list[str] = dataclasses.field(default_factory=list)
    """Token files for training (paths, prefixes or globs); source=files only (or use mixture)."""
    mixture: list[MixtureSource] = dataclasses.field(default_factory=list)
    """Weighted training sources instead of train_paths: a list of {paths: [...], weight: w, name: n}
    (``--data.mixture='[{paths: [web/*.npy], weight: 3}, {paths: [code], weight: 1}]'``)."""
    val_paths: list[str] = dataclasses.field(default_factory=list)
    """Held-out token files (paths, prefixes or globs); source=files only; may be empty."""
    format: TokenFormat = TokenFormat.auto
    """Format of every token file: auto (detected per file), moetron, dolma_npy or megatron."""
    dtype: str | None = None
    """dtype of dolma_npy files (uint8/16/32/64); None: uint16 if the model's vocab_size <= 65536, else uint32."""
    eos_id: int | None = None
    """EOS id ending each document in dolma_npy files (only needed to find document boundaries)."""
    tokenizer_path: str | None = None
    """The sentencepiece model; None: the corpus's own, or the one named in the first train sidecar."""
    data_dir: str = dataclasses.field(default_factory=_default_data_dir)
    """Cache folder for the default corpus (default: $MOETRON_DATA_DIR, else ./data_cache)."""
    seq_len: int = 256
    """Tokens per training sequence; each sample holds seq_len + 1 tokens (inputs and shifted labels)."""
    global_batch_size: int = 16
    """Sequences per optimizer step summed over all data-parallel ranks (must divide by dp size)."""
    seed: int = 0
    """Seed of the sample order (epoch e uses a permutation seeded with seed + e)."""
    corpus_vocab_size: int = 4096
    """Vocabulary of the tokenizer trained for the default corpus; the model's vocab_size must be >= it."""
    corpus_max_bytes: int = DEFAULT_MAX_BYTES
    """Cap on the default corpus's text (UTF-8 bytes); the build takes a few seconds at 6 MB."""
    verify_token_ids: bool = True
    """Scan every token file at start for ids >= the model's vocab_size (one sequential read)."""

    def validate(self) -> None:
        super().validate()
        for name in ("seq_len", "global_batch_size", "corpus_max_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"data.{name}={getattr(self, name)} must be positive")
        if self.seed < 0:
            raise ConfigError(f"data.seed={self.seed} must be >= 0 (numpy seeds are non-negative)")
        if self.dtype is not None and self.dtype not in TOKEN_DTYPES:
            raise ConfigError(f"data.dtype={self.dtype!r} is not a token dtype: use one of {sorted(TOKEN_DTYPES)} or null")
        if self.source == DataSource.files:
            if not self.train_paths and not self.mixture:
                raise ConfigError(
                    "data.source=files needs data.train_paths: set --data.train_paths=PREFIX[,PREFIX...] "
                    "(token files from tools/preprocess_data.py), or data.mixture, or use --data.source=default_corpus"
                )
            if self.train_paths and self.mixture:
                raise ConfigError(
                    "data.train_paths and data.mixture both name training data: put every file in one "
                    "mixture source, or drop data.mixture"
                )
            self._validate_mixture()
        else:
            if self.train_paths or self.val_paths or self.mixture:
                raise ConfigError(
                    "data.train_paths/mixture/val_paths are only read with data.source=files: set "
                    "--data.source=files or drop the paths"
                )
            if self.corpus_vocab_size < 260:
                raise ConfigError(
                    f"data.corpus_vocab_size={self.corpus_vocab_size} is too small: byte fallback needs "
                    f"259 ids, use >= 260 (4096 is the default)"
                )
        if not self.data_dir:
            raise ConfigError("data.data_dir is empty: set --data.data_dir=FOLDER or $MOETRON_DATA_DIR")

    def _validate_mixture(self) -> None:
        for i, src in enumerate(self.mixture):
            if not src.paths:
                raise ConfigError(f"data.mixture[{i}] has no paths: give it paths: [FILE, ...]")
            if not (src.weight > 0 and src.weight != float("inf")):
                raise ConfigError(f"data.mixture[{i}].weight={src.weight} must be a positive number (drop the source to leave it out)")
        names = [src.resolved_name() for src in self.mixture]
        for name in names:
            if names.count(name) > 1 or not name:
                raise ConfigError(
                    f"data.mixture has {names.count(name)} sources named {name!r}: give each source its own "
                    f"name (name: web, name: code, ...)"
                )

    def build(self, vocab_size: int, dp_rank: int = 0, dp_size: int = 1, pin_memory: bool = False) -> "TrainData":
        """Open (building the default corpus first if needed) and validate the data for a model
        of ``vocab_size``; returns this data-parallel rank's :class:`TrainData`. ``pin_memory``
        (training on CUDA): training batches come in page-locked memory."""
        self.validate()
        if self.source == DataSource.default_corpus:
            paths = ensure_default_corpus(self.data_dir, self.corpus_vocab_size, self.corpus_max_bytes)
            train_paths, val_paths = [paths["train"]], [paths["val"]]
            tokenizer_path = self.tokenizer_path or paths["tokenizer"]
        else:
            source_paths = [_expand(src.paths) for src in self.mixture] or [_expand(self.train_paths)]
            train_paths, val_paths = [p for paths in source_paths for p in paths], _expand(self.val_paths)
            tokenizer_path = self.tokenizer_path
        opts = dict(verify_token_ids=self.verify_token_ids, format=self.format, dtype=self.dtype, eos_id=self.eos_id)
        train = PackedDataset(train_paths, self.seq_len, vocab_size, **opts)
        val = PackedDataset(val_paths, self.seq_len, vocab_size, **opts) if val_paths else None
        if not tokenizer_path:  # the one named in the first train file's sidecar
            tokenizer_path = train.metadata[0].get("tokenizer")
        if self.mixture:
            # The sources' files lie back to back in ``train``: source i is a contiguous index range.
            per_file, sizes = iter(train.samples_per_file), []
            for paths in source_paths:
                sizes.append(sum(next(per_file) for _ in paths))
            sampler = MixtureSampler(sizes, [src.weight for src in self.mixture], self.global_batch_size, dp_rank,
                                     dp_size, self.seed, names=[src.resolved_name() for src in self.mixture])
        else:
            sampler = GlobalBatchSampler(len(train), self.global_batch_size, dp_rank, dp_size, self.seed)
        return TrainData(train, val, sampler, tokenizer_path, pin_memory)


def _expand(paths: list[str]) -> list[str]:
    """Token files for ``paths``: paths and prefixes as given, globs expanded and sorted (a
    .bin/.json/.idx match stands for its prefix, a .npy match for itself)."""
    out: list[str] = []
    for p in paths:
        if glob.has_magic(p):
            matches = sorted({k for k in map(source_key, glob.glob(p)) if k is not None})
            if not matches:
                raise DataError(f"data path pattern {p!r} matches no .bin/.json/.idx/.npy token files: check the path")
            out.extend(matches)
        else:
            out.append(p)
    return out


class TrainData:
    """One data-parallel rank's view of the training and held-out data."""

    def __init__(
        self,
        train: PackedDataset,
        val: PackedDataset | None,
        sampler: GlobalBatchSampler | MixtureSampler,
        tokenizer_path: str | None,
        pin_memory: bool = False,
    ):
        self.train_dataset, self.val_dataset, self.sampler = train, val, sampler
        self.tokenizer_path = tokenizer_path
        self.pin_memory = pin_memory
        self.seq_len = train.seq_len

    @property
    def num_train_tokens(self) -> int:
        """Tokens in the training files."""
        return self.train_dataset.num_tokens

    @property
    def local_batch_size(self) -> int:
        return self.sampler.local_batch_size

    def next_batch(self) -> torch.Tensor:
        """This rank's share of the next step: LongTensor [G // dp_size, S+1] (pinned with pin_memory)."""
        return self.train_dataset.get_batch(self.sampler.next_indices(), self.pin_memory)

    def val_batches(self, batch_size: int, max_batches: int | None = None) -> list[torch.Tensor]:
        """The held-out set as this rank's shares of global batches of ``batch_size`` sequences:
        a list of LongTensor [batch_size // dp_size, S+1], identical on every call.

        The samples follow a fixed permutation (independent of the run's seed) so a ``max_batches``
        prefix still spreads over every val file.
        """
        if self.val_dataset is None:
            raise DataError("no held-out data: set --data.val_paths (source=files) to evaluate")
        dp_rank, dp_size = self.sampler.dp_rank, self.sampler.dp_size
        if batch_size <= 0 or batch_size % dp_size:
            raise ConfigError(f"val batch_size={batch_size} must be a positive multiple of dp_size={dp_size}")
        num_batches = len(self.val_dataset) // batch_size
        if max_batches is not None:
            num_batches = min(num_batches, max_batches)
        if num_batches == 0:
            raise DataError(
                f"the held-out data has {len(self.val_dataset)} samples of seq_len={self.seq_len}, "
                f"fewer than one val batch of {batch_size}: lower the val batch size or add val data"
            )
        order = np.random.Generator(np.random.PCG64(_VAL_SEED)).permutation(len(self.val_dataset))
        local = batch_size // dp_size
        return [
            self.val_dataset.get_batch(order[b * batch_size + dp_rank * local : b * batch_size + (dp_rank + 1) * local])
            for b in range(num_batches)
        ]

    def metrics(self) -> dict[str, float]:
        """What to log about the data so far: ``data/consumed_samples``, ``data/epoch`` (passes over
        the training set), and for a mixture each source's realised share ``data/share/<name>`` and
        passes ``data/epochs/<name>``. Host-side counters only (no device sync)."""
        out: dict[str, float] = {"data/consumed_samples": self.sampler.consumed_samples}
        if isinstance(self.sampler, MixtureSampler):
            out.update({f"data/share/{name}": share for name, share in self.sampler.shares().items()})
            out.update({f"data/epochs/{name}": epochs for name, epochs in self.sampler.epochs().items()})
        else:
            out["data/epoch"] = self.sampler.consumed_samples / (self.sampler.steps_per_epoch * self.sampler.global_batch_size)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def __repr__(self) -> str:
        return (
            f"TrainData(train={self.train_dataset}, val={self.val_dataset}, sampler={self.sampler}, "
            f"tokenizer={self.tokenizer_path!r})"
        )
