#!/usr/bin/env python
"""Upcycle a dense checkpoint into an MoE that starts where the dense model was (docs/upcycling.md).

    python tools/upcycle.py DENSE --output runs/moe8 --num-experts 8 --top-k 2
    python tools/upcycle.py hf/Olmo-3-7B --output ckpt/olmo3-moe --num-experts 64 --top-k 8 \\
        --granularity 4 --shared-expert --layers every_other

DENSE is a native checkpoint (a trainer's <run_dir>/checkpoints/step_N, or tools/convert_hf.py's
output) or a Hugging Face directory (config.json + safetensors). The output is a weights-only
native checkpoint (DCP + meta.json with the MoE model config), written one tensor at a time (peak
memory: one layer's experts), plus <output>/pretrain.yaml for
``tools/pretrain.py --config <output>/pretrain.yaml`` (model + checkpoint.init_from). DCP reshards
on load, so the output loads under any expert-parallel layout; --ep N only checks that N divides the
expert count. A progress bar shows on a terminal (--no-progress: none). Errors print one
"error: ..." line, exit 2 and write nothing.
"""

from __future__ import annotations

import argparse
import os

from moetron.core.checkpoint import CheckpointError
from moetron.core.config import ConfigError
from moetron.core.weights import checkpoint_exists, save_weights
from moetron.data.progress import Progress
from moetron.models.upcycle import UpcycleConfig, native_source, pretrain_yaml, upcycle_config, upcycle_specs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    d = UpcycleConfig()
    p.add_argument("dense", help="dense native checkpoint dir or HF dir (with config.json)")
    p.add_argument("--output", required=True, help="where to write the MoE checkpoint (a new directory)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --output")
    p.add_argument("--seed", type=int, default=0, help="seed of the router rows and the copy noise")
    p.add_argument("--num-experts", type=int, default=d.num_experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--score", default=str(d.score), choices=["softmax", "sigmoid"])
    p.add_argument("--no-renormalize", dest="renormalize", action="store_false",
                   help="keep the raw top-k scores (the start is then approximate)")
    p.add_argument("--granularity", type=int, default=d.granularity,
                   help="split each dense MLP into this many finer experts along its hidden dim")
    p.add_argument("--router-init", default=str(d.router_init), choices=["virtual_groups", "random"])
    p.add_argument("--router-std", type=float, default=d.router_std)
    p.add_argument("--noise-std", type=float, default=d.noise_std, help="noise on each expert copy (0: exact copies)")
    p.add_argument("--shared-expert", action="store_true", help="keep the dense MLP as a shared expert")
    p.add_argument("--routed-fraction", type=float, default=d.routed_fraction,
                   help="with --shared-expert: share of the dense output the routed experts carry at start")
    p.add_argument("--layers", default="all", help='"all", "every_other" or a comma list of layer indices')
    p.add_argument("--ep", type=int, default=None, help="check that this expert-parallel size divides the experts")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: on a terminal)")
    return p.parse_args(argv)


def load_dense(path: str):
    """(dense ModelConfig, (specs, produce)) from an HF dir or a native checkpoint."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory: pass a native checkpoint or an HF model directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        from moetron.models.hf import hf_native_specs, read_hf_config

        cfg = read_hf_config(path)
        return cfg, hf_native_specs(path, cfg)
    return native_source(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layers = args.layers
    if layers not in ("all", "every_other"):
        try:
            layers = [int(x) for x in layers.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--layers={args.layers!r}: use all, every_other or a comma list like 1,3") from None
    up = UpcycleConfig.from_dict(dict(
        num_experts=args.num_experts, top_k=args.top_k, score=args.score, renormalize=args.renormalize,
        granularity=args.granularity, router_init=args.router_init, router_std=args.router_std,
        noise_std=args.noise_std, shared_expert=args.shared_expert, routed_fraction=args.routed_fraction,
        layers=layers,
    ))
    up.validate()
    if args.ep is not None and (args.ep <= 0 or up.num_experts % args.ep):
        raise ConfigError(f"--ep={args.ep} does not divide --num-experts={up.num_experts}")
    out = os.path.abspath(args.output)
    # Fail before reading anything: save_weights checks again at write time.
    if checkpoint_exists(out) and not args.overwrite:
        raise CheckpointError(f"{out} already holds a checkpoint: pass --overwrite or choose another output")
    if os.path.exists(out) and (not os.path.isdir(out) or (os.listdir(out) and not checkpoint_exists(out))):
        raise CheckpointError(f"{out} exists and is not an empty directory or a checkpoint: choose another output")

    dense_cfg, source = load_dense(args.dense)
    moe_cfg = upcycle_config(dense_cfg, up)
    specs, produce = upcycle_specs(source, dense_cfg, moe_cfg, up, args.seed)
    meta = {"config": {"model": moe_cfg.to_dict()}, "step": 0, "upcycled_from": os.path.abspath(args.dense),
            "upcycle": up.to_dict(), "seed": args.seed}
    with Progress(f"upcycling -> {out}", enabled=False if args.no_progress else None) as bar:
        save_weights(out, specs, bar.tracking(specs, produce), meta, overwrite=args.overwrite)
    with open(os.path.join(out, "pretrain.yaml"), "w", encoding="utf-8") as f:
        f.write(pretrain_yaml(moe_cfg, out, name=f"upcycled-{up.num_experts}e-top{up.top_k}"))
    exact, why = up.exact_start()
    print(f"dense:    {dense_cfg.describe()}")
    print(f"upcycled: {moe_cfg.describe()} (MoE layers {up.moe_layers(dense_cfg.n_layers)})")
    print(f"params: active {moe_cfg.num_active_params()} / total {moe_cfg.num_params()}")
    print(f"start: {'equals the dense model' if exact else 'approximates the dense model'} ({why})")
    if args.ep:
        print(f"loads under EP={args.ep} ({up.num_experts // args.ep} experts per rank): DCP reshards on load")
    print(f"wrote {out}; continue training with: python tools/pretrain.py --config {out}/pretrain.yaml")
    return 0


if __name__ == "__main__":
    from cli import run_cli  # tools/cli.py

    run_cli(main, errors=(ConfigError, CheckpointError, FileNotFoundError))
