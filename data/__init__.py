"""Data: tokenizers, memmap token files (moetron, Dolma .npy, Megatron), packed datasets, weighted
mixtures, resumable samplers, the default corpus."""

from moetron.data.tokenizer import DataError, SentencePieceTokenizer
from moetron.data.preprocess import dtype_for_vocab, iter_documents, open_token_file, tokenize_documents, tokenize_files
from moetron.data.formats import TokenFile, TokenFormat, detect_format, open_tokens
from moetron.data.dataset import PackedDataset
from moetron.data.sampler import GlobalBatchSampler, MixtureSampler
from moetron.data.corpus import ensure_default_corpus
from moetron.data.loader import DataConfig, DataSource, MixtureSource, TrainData

__all__ = [
    "DataError",
    "SentencePieceTokenizer",
    "dtype_for_vocab",
    "iter_documents",
    "open_token_file",
    "tokenize_documents",
    "tokenize_files",
    "TokenFile",
    "TokenFormat",
    "detect_format",
    "open_tokens",
    "PackedDataset",
    "GlobalBatchSampler",
    "MixtureSampler",
    "ensure_default_corpus",
    "DataConfig",
    "DataSource",
    "MixtureSource",
    "TrainData",
]
