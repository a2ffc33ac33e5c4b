#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and moetron's native (DCP) format (docs/checkpoints.md).

    python tools/convert_hf.py import HF_DIR OUT_NATIVE_DIR [--overwrite] [--dtype fp32|bf16]
    python tools/convert_hf.py export NATIVE_DIR OUT_HF_DIR [--overwrite] [--dtype fp32|bf16] [--shard-size 5GB]

import reads Olmo3ForCausalLM or OlmoeForCausalLM (config.json + model.safetensors or shards with
model.safetensors.index.json) and writes a weights-only native checkpoint that
``--checkpoint.init_from`` and tools/upcycle.py read. export writes Olmo3ForCausalLM (dense),
OlmoeForCausalLM (OLMoE-shaped MoE) or MoetronForCausalLM (any other MoE). Both stream one tensor
at a time (peak memory: a few tensors, never the checkpoint), with a progress bar on a terminal
(--no-progress: none). Errors print one "error: ..." line, exit 2 and write nothing.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moetron.core.checkpoint import CheckpointError
from moetron.core.config import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory -> native checkpoint")
    imp.add_argument("src", metavar="HF_DIR")
    imp.add_argument("out", metavar="OUT_NATIVE_DIR")
    exp = sub.add_parser("export", help="native checkpoint -> Hugging Face directory")
    exp.add_argument("src", metavar="NATIVE_DIR")
    exp.add_argument("out", metavar="OUT_HF_DIR")
    exp.add_argument("--shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    for p in (imp, exp):
        p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at the output")
        p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="cast the weights (default: keep the source dtype)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar (default: on a terminal)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> str:
    from moetron.core.weights import save_weights
    from moetron.data.progress import Progress
    from moetron.models.config import native_config
    from moetron.models.hf import export_architecture, export_hf, hf_architecture, hf_native_specs, read_hf_config

    dtype = DTYPES[args.dtype] if args.dtype else None
    enabled = False if args.no_progress else None
    if args.command == "import":
        arch = hf_architecture(args.src)
        cfg = read_hf_config(args.src)
        print(f"{arch}: {cfg.describe()}")
        specs, produce = hf_native_specs(args.src, cfg, dtype=dtype)
        meta = {"config": {"model": cfg.to_dict()}, "source": {"hf_dir": args.src, "architecture": arch}}
        with Progress(f"importing -> {args.out}", enabled=enabled) as bar:
            path = save_weights(args.out, specs, bar.tracking(specs, produce), meta, overwrite=args.overwrite)
        print(f"wrote native checkpoint {path} ({len(specs)} tensors)")
        return path
    cfg = native_config(args.src)
    arch, why = export_architecture(cfg)
    print(f"{arch} ({why}): {cfg.describe()}")
    with Progress(f"exporting -> {args.out}", enabled=enabled) as bar:
        path = export_hf(args.src, args.out, overwrite=args.overwrite, dtype=dtype, max_shard_size=args.shard_size,
                         progress=bar.update)
    print(f"wrote Hugging Face checkpoint {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (CheckpointError, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
