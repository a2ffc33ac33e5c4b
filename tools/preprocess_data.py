"""Tokenize text or JSONL files into a moetron token file (<prefix>.bin + <prefix>.json).

Examples:
    # with an existing sentencepiece model
    python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix data/train \
        --tokenizer tok.model
    # with a Hugging Face tokenizer.json (or its directory; needs pip install tokenizers)
    python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix data/train \
        --tokenizer hf/dolma2-tokenizer/tokenizer.json
    # train a tokenizer on the inputs first (written to <output-prefix>.tokenizer.model)
    python tools/preprocess_data.py --input books/*.txt --split-blank-lines \
        --output-prefix data/books --train-tokenizer --vocab-size 32000
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time

from moetron.data.preprocess import check_output_prefix, iter_documents, tokenize_files
from moetron.data.tokenizer import DataError, SentencePieceTokenizer, load_tokenizer


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files named by ``patterns`` (paths or globs), each pattern's matches sorted, in order."""
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise DataError(f"--input {pattern!r} matches no files")
        files.extend(m for m in matches if m not in files)
    return files


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="text (.txt ...) or .jsonl files or globs")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.json")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="sentencepiece .model file, HF tokenizer.json, or a directory holding one")
    tok.add_argument("--train-tokenizer", action="store_true", help="train a tokenizer on the inputs first")
    p.add_argument("--vocab-size", type=int, help="vocabulary of the trained tokenizer (with --train-tokenizer)")
    p.add_argument("--tokenizer-type", default="bpe", choices=["bpe", "unigram"], help="with --train-tokenizer")
    p.add_argument("--tokenizer-prefix", help="where the trained tokenizer goes (default <output-prefix>.tokenizer)")
    p.add_argument("--max-sentences", type=int, default=2_000_000, help="cap on tokenizer training lines")
    p.add_argument("--jsonl-key", default="text", help="field of each JSONL record holding the document")
    p.add_argument("--split-blank-lines", action="store_true", help="text files: blank lines separate documents")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing <prefix>.bin/.json (and, with --train-tokenizer, its tokenizer)")
    args = p.parse_args(argv)
    if args.train_tokenizer and not args.vocab_size:
        p.error("--train-tokenizer needs --vocab-size")
    if args.tokenizer and args.vocab_size:
        p.error("--vocab-size only applies with --train-tokenizer (the tokenizer defines the vocabulary)")
    return args


def tokenizer_prefix(args: argparse.Namespace) -> str:
    return args.tokenizer_prefix or args.output_prefix + ".tokenizer"


def check_outputs(args: argparse.Namespace) -> None:
    """DataError before any work if an output exists and --overwrite is not given."""
    check_output_prefix(args.output_prefix, args.overwrite)
    model = tokenizer_prefix(args) + ".model"
    if args.train_tokenizer and not args.overwrite and os.path.exists(model):
        raise DataError(
            f"tokenizer {model!r} already exists: choose another --tokenizer-prefix, reuse it with "
            f"--tokenizer {model}, or replace it with --overwrite"
        )


def train_tokenizer(args: argparse.Namespace, files: list[str]) -> SentencePieceTokenizer:
    prefix = tokenizer_prefix(args)
    out_dir = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(out_dir, exist_ok=True)
    # Train on the documents, not the raw files: JSONL records must be unpacked first.
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".tok-text-") as tmp:
        text_path = os.path.join(tmp, "docs.txt")
        with open(text_path, "w", encoding="utf-8") as f:
            for path in files:
                for doc in iter_documents(path, args.jsonl_key, args.split_blank_lines):
                    f.write(doc if doc.endswith("\n") else doc + "\n")
        return SentencePieceTokenizer.train(
            [text_path], prefix, args.vocab_size, max_sentences=args.max_sentences, model_type=args.tokenizer_type
        )


def main(argv: list[str] | None = None) -> int:
    """Exit status 0; bad input raises DataError (run_cli prints it as one ``error:`` line, exit 2)."""
    args = parse_args(argv)
    check_outputs(args)
    files = expand_inputs(args.input)
    t0 = time.monotonic()
    if args.train_tokenizer:
        tokenizer = train_tokenizer(args, files)
        print(f"trained {tokenizer.path} (vocab {tokenizer.vocab_size}) in {time.monotonic() - t0:.1f}s")
    else:
        tokenizer = load_tokenizer(args.tokenizer)
    t1 = time.monotonic()
    meta = tokenize_files(
        files,
        args.output_prefix,
        tokenizer,
        jsonl_key=args.jsonl_key,
        split_blank_lines=args.split_blank_lines,
        progress=None if not args.no_progress else False,
        overwrite=args.overwrite,
    )
    print(
        f"wrote {args.output_prefix}.bin: {meta['num_tokens']:,} {meta['dtype']} tokens, "
        f"{meta['num_documents']:,} documents, vocab {meta['vocab_size']}, eos {meta['eos_id']} "
        f"({tokenizer.kind} tokenizer {tokenizer.name}), in {time.monotonic() - t1:.1f}s"
    )
    return 0


if __name__ == "__main__":
    from cli import run_cli  # tools/cli.py

    run_cli(main)
