#!/usr/bin/env python
"""Score a checkpoint on a token or text file: per-token log-probabilities, mean loss, perplexity.

    python tools/score.py CKPT data/val.bin --seq-len 512 --output logprobs.npy
    python tools/score.py hf/Olmo-3-7B notes.txt --tokenizer tok.model --device cuda

CKPT is a native checkpoint (a trainer's <run_dir>/checkpoints/step_N, a run's checkpoints/ folder
(its latest step), tools/upcycle.py or tools/convert_hf.py output) or an HF directory (config.json).
DATA is a moetron token file (.bin/.json pair or their prefix) or a text file, tokenized with
--tokenizer (a sentencepiece .model, an HF tokenizer.json or its directory) as one document with EOS
appended.

Windows: the first N tokens (N = --max-tokens, default all) are cut into windows of --seq-len + 1
tokens with stride --seq-len (window w covers tokens [w*S, w*S + S]), so neighbouring windows share
one token and every token but the first is predicted exactly once, from the context inside its own
window only (no overlap: the first prediction of each window sees one token). A last, shorter
window takes the remainder. The .npy holds N - 1 float32 log-probs, entry i for token i + 1.
--device auto picks CUDA when present (bf16 autocast there, fp32 on CPU). Errors print one
"error: ..." line and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os

import numpy as np
import torch

from moetron.core.checkpoint import CheckpointConfig, CheckpointError, Checkpointer
from moetron.core.config import ConfigError
from moetron.data.tokenizer import DataError
from moetron.models.config import native_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("checkpoint", help="native checkpoint dir or HF dir (config.json)")
    p.add_argument("data", help="moetron token file (.bin/.json or prefix) or a text file (needs --tokenizer)")
    p.add_argument("--tokenizer", help="for a text file: sentencepiece .model, HF tokenizer.json or its directory")
    p.add_argument("--seq-len", type=int, default=512, help="tokens predicted per window (stride)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--output", help="write the per-token log-probs here (.npy, float32)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    return p.parse_args(argv)


def resolve_checkpoint(path: str) -> str:
    """A run's checkpoints/ folder (or its run dir) resolves to its latest step; others are returned as is."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if os.path.isfile(os.path.join(path, "config.json")) or os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        latest = Checkpointer(CheckpointConfig(dir=root)).latest(root) if os.path.isdir(root) else None
        if latest:
            return latest
    raise CheckpointError(f"{path} is neither a native checkpoint (no manifest.json), an HF directory (no "
                          f"config.json) nor a folder of step_N checkpoints")


def load_model(path: str, device: torch.device):
    """(ModelConfig, Transformer in eval mode on device) from a native checkpoint or an HF dir."""
    path = resolve_checkpoint(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        from moetron.models.hf import load_hf_model

        cfg, model = load_hf_model(path, dtype=torch.float32, device="cpu")
    else:
        cfg = native_config(path)
        model = cfg.build()
        Checkpointer(CheckpointConfig()).load(path, model, None, {}, model_only=True)
    return cfg, model.to(device).eval()


def load_tokens(path: str, tokenizer: str | None, max_tokens: int | None) -> np.ndarray:
    """The first max_tokens token ids of a token file or a tokenized text file (int64)."""
    from moetron.data.preprocess import open_token_file

    is_token_file = path.endswith((".bin", ".json")) or os.path.exists(path + ".json")
    if is_token_file:
        tokens, _ = open_token_file(path)
    else:
        if not os.path.isfile(path):
            raise DataError(f"data file {path!r} does not exist")
        if tokenizer is None:
            raise DataError(f"{path!r} is not a moetron token file: pass --tokenizer (a .model, tokenizer.json "
                            f"or HF tokenizer directory) to tokenize it as text")
        from moetron.data.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer)
        with open(path, encoding="utf-8") as f:
            ids = tok.encode(f.read())
        if tok.eos_id is not None:
            ids.append(tok.eos_id)
        tokens = np.asarray(ids, dtype=np.int64)
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    return np.asarray(tokens, dtype=np.int64)


def windows(num_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """[start, end) token ranges of the windows: stride seq_len, each seq_len + 1 long (the last shorter)."""
    return [(s, min(s + seq_len + 1, num_tokens)) for s in range(0, num_tokens - 1, seq_len)]


@torch.no_grad()
def score(model, tokens: np.ndarray, seq_len: int, batch_size: int, device: torch.device) -> np.ndarray:
    """Per-token log-probs [N - 1] (float32): entry i is log p(token i+1 | its window's prefix)."""
    spans = windows(len(tokens), seq_len)
    out = np.empty(max(len(tokens) - 1, 0), dtype=np.float32)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    # Full windows in batches; the shorter last window (if any) alone.
    groups: list[list[tuple[int, int]]] = []
    full = [s for s in spans if s[1] - s[0] == seq_len + 1]
    for i in range(0, len(full), batch_size):
        groups.append(full[i:i + batch_size])
    groups += [[s] for s in spans if s[1] - s[0] != seq_len + 1]
    for group in groups:
        ids_BS1 = torch.from_numpy(np.stack([tokens[a:b] for a, b in group])).to(device)
        with autocast:
            logits_BSV = model(ids_BS1[:, :-1])
        logp_BSV = logits_BSV.float().log_softmax(dim=-1)
        lp_BS = logp_BSV.gather(-1, ids_BS1[:, 1:, None]).squeeze(-1).cpu().numpy()
        for (a, b), row in zip(group, lp_BS):
            out[a:b - 1] = row
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.seq_len <= 0 or args.batch_size <= 0 or (args.max_tokens is not None and args.max_tokens < 2):
        raise ConfigError("--seq-len and --batch-size must be positive and --max-tokens at least 2")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is available: use --device cpu")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    tokens = load_tokens(args.data, args.tokenizer, args.max_tokens)
    if len(tokens) < 2:
        raise DataError(f"{args.data!r} has {len(tokens)} token(s): need at least 2 to predict one")
    cfg, model = load_model(args.checkpoint, device)
    top = int(tokens.max())
    if top >= cfg.vocab_size or int(tokens.min()) < 0:
        raise DataError(f"{args.data!r} holds token id {top} but the model's vocab is {cfg.vocab_size}: "
                        f"this data was tokenized for another model")
    logprobs = score(model, tokens, args.seq_len, args.batch_size, device)
    loss = float(-logprobs.astype(np.float64).mean())
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        np.save(args.output, logprobs)
    print(f"model: {cfg.describe()}")
    print(f"tokens: {len(logprobs)} predicted ({len(windows(len(tokens), args.seq_len))} windows of "
          f"{args.seq_len}, stride {args.seq_len})")
    print(f"mean loss: {loss:.6f}")
    print(f"perplexity: {math.exp(loss):.4f}")
    if args.output:
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    from cli import run_cli  # tools/cli.py

    run_cli(main)
