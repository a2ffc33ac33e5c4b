"""Data: tokenizers, memmap token files, packed datasets, resumable samplers, the default corpus."""

from moetron.data.tokenizer import DataError, SentencePieceTokenizer
from moetron.data.preprocess import dtype_for_vocab, iter_documents, open_token_file, tokenize_documents, tokenize_files
from moetron.data.dataset import PackedDataset
from moetron.data.sampler import GlobalBatchSampler
from moetron.data.corpus import ensure_default_corpus
from moetron.data.loader import DataConfig, DataSource, TrainData

__all__ = [
    "DataError",
    "SentencePieceTokenizer",
    "dtype_for_vocab",
    "iter_documents",
    "open_token_file",
    "tokenize_documents",
    "tokenize_files",
    "PackedDataset",
    "GlobalBatchSampler",
    "ensure_default_corpus",
    "DataConfig",
    "DataSource",
    "TrainData",
]
