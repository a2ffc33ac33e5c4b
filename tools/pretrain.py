#!/usr/bin/env python
"""Pre-train a moetron model: the one entry point, single-process or under torchrun.

    python tools/pretrain.py                                  # tiny model on the embedded corpus
    python tools/pretrain.py --preset olmo3-7b --data.source=files --data.train_paths=[a,b]
    python tools/pretrain.py --recipe tiny-moe-local --trainer.steps=50   # a named run (moetron.run)
    python tools/pretrain.py --config run.yaml --trainer.steps=1000 --optimizer.lr=1e-3
    python tools/pretrain.py --config runs/x/config.yaml --resume        # continue the latest
    torchrun --nproc-per-node 2 tools/pretrain.py ...                     # data parallel

Every config field can be overridden as --section.field=value (see --print-config).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from moetron.core.checkpoint import Checkpointer, CheckpointError
from moetron.core.config import ConfigError
from moetron.core.distributed import finish_distributed, init_distributed, is_main, pick_device
from moetron.core.trainer import NonFiniteError
from moetron.models import ModelConfig
from moetron.run import RECIPES, PretrainConfig, build, recipe  # PretrainConfig, build: also pretrain.X

from cli import USER_ERRORS, run_cli  # tools/cli.py


def parse_args(argv: list[str] | None = None) -> tuple[PretrainConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--config", help="YAML file with a PretrainConfig (overrides apply on top)")
    parser.add_argument(
        "--recipe", help=f"named run recipe, a whole PretrainConfig ({', '.join(RECIPES)}; overrides apply on top)"
    )
    parser.add_argument("--preset", help="model preset (tiny, tiny-moe, olmo3-7b, olmo3-moe-64e, olmoe-1b-7b, moe-1t ...)")
    parser.add_argument(
        "--resume", nargs="?", const=True, default=False,
        help="continue from the latest complete checkpoint in --checkpoint.dir, or from the given path",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args, rest = parser.parse_known_args(argv)
    if args.config and args.recipe:
        raise ConfigError("--config and --recipe both give a whole run: choose one (overrides apply on top of it)")
    if args.config:
        cfg = PretrainConfig.from_yaml(args.config)
    else:
        cfg = recipe(args.recipe) if args.recipe else PretrainConfig()
    if args.preset:
        cfg.model = ModelConfig.preset(args.preset)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a)]
    if bad:
        raise ConfigError(f"unrecognized arguments {bad}: overrides look like --section.field=value")
    cfg.apply_overrides(rest)
    if cfg.checkpoint.dir is None and not _checkpoint_dir_given(args.config, rest):
        cfg.checkpoint.dir = os.path.join(cfg.trainer.run_dir, "checkpoints")  # unset: the default
    cfg.validate()
    return cfg, args


def _checkpoint_dir_given(config_path: str | None, overrides: list[str]) -> bool:
    """Whether checkpoint.dir was written out (in the YAML or an override), so that null there
    means "no checkpoints" while leaving it out means ``<run_dir>/checkpoints``."""
    if any(a.lstrip("-").partition("=")[0].strip() == "checkpoint.dir" for a in overrides):
        return True
    if not config_path:
        return False
    import yaml

    with open(config_path, encoding="utf-8") as f:  # from_yaml has read it already: it parses
        raw = yaml.safe_load(f) or {}
    return isinstance(raw.get("checkpoint"), dict) and "dir" in raw["checkpoint"]


def write_config(cfg: PretrainConfig) -> None:
    """<run_dir>/config.yaml, the settings in effect, replaced atomically (a crash leaves the old one)."""
    os.makedirs(cfg.trainer.run_dir, exist_ok=True)
    path = os.path.join(cfg.trainer.run_dir, "config.yaml")
    cfg.to_yaml(path + ".tmp")
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    device = pick_device(cfg.trainer.device)
    rank, world = init_distributed(device, cfg.trainer.collective_timeout_s, cpu_collectives=cfg.parallel.fsdp_offload)
    tracker = cfg.logging.build(cfg.trainer.run_dir, cfg.name, cfg.to_dict())  # a missing package fails here
    if cfg.checkpoint.dir is None and is_main():
        print("checkpoint.dir is null: this run writes no checkpoints (it cannot be resumed)", flush=True)

    checkpointer = Checkpointer(cfg.checkpoint)
    resume_path = checkpointer.resolve(args.resume) if args.resume else None
    if resume_path is None and checkpointer.latest() is not None:
        raise CheckpointError(
            f"{cfg.checkpoint.dir} already holds checkpoints (latest {checkpointer.latest()}): pass --resume "
            f"to continue that run, or choose another --checkpoint.dir / --trainer.run_dir"
        )
    if resume_path is not None:
        check_resumable(checkpointer, resume_path, cfg)
        check_resume_settings(checkpointer, resume_path, cfg)
    elif cfg.checkpoint.init_from and not os.path.exists(cfg.checkpoint.init_from):
        raise CheckpointError(
            f"checkpoint.init_from={cfg.checkpoint.init_from} does not exist: pass a checkpoint directory "
            f"(a step_XXXXXXXX dir, or the output of tools/convert_hf.py import / tools/upcycle.py)"
        )
    trainer, _ = build(cfg, device, world, checkpointer, tracker=tracker)
    # Fail now, not at the first save: the checkpoint dir is writable and has room for a checkpoint.
    checkpointer.check_writable(Checkpointer.estimate_bytes(trainer.model_parts, trainer.optimizer))
    if resume_path is not None:
        trainer.load(resume_path)
    elif cfg.checkpoint.init_from:
        # Weights only: the load itself names any missing, unexpected or mis-shaped tensor.
        trainer.init_weights(cfg.checkpoint.init_from)
        if is_main():
            print(f"initialized the model from {cfg.checkpoint.init_from}", flush=True)
    if is_main():  # only now: a rejected resume must leave the run's config.yaml as it was
        write_config(cfg)
    try:
        trainer.fit()
    finally:
        tracker.close()
    finish_distributed()  # a distributed rank exits here (status 0), skipping the interpreter's teardown
    return 0


def _leaf_diff(saved: Any, now: Any, path: str) -> list[str]:
    """``path.to.leaf: checkpoint X vs now Y`` for every leaf of two config dicts that differs."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [line for k in sorted(set(saved) | set(now), key=str)
                for line in _leaf_diff(saved.get(k), now.get(k), f"{path}.{k}")]
    return [] if saved == now else [f"{path}: checkpoint {saved!r} vs now {now!r}"]


def _param_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the model's state dict holds (built on the meta device)."""
    return {k: tuple(v.shape) for k, v in model_cfg.build(device="meta").state_dict().items()}


def check_resumable(checkpointer: Checkpointer, path: str, cfg: PretrainConfig) -> None:
    """A checkpoint of another model shape cannot continue this run: say which fields differ.

    Only what changes the parameters' names, shapes or counts blocks (kernel choices, RoPE theta,
    norm eps ... may change); the message lists the config leaves that differ."""
    saved = checkpointer.read_metadata(path).get("config", {}).get("model")
    if saved is None:
        return
    diff = _leaf_diff(saved, cfg.model.to_dict(), "model")
    if not diff:
        return
    try:
        saved_cfg = type(cfg.model).from_dict(saved, prefix="model")
        if _param_shapes(saved_cfg) == _param_shapes(cfg.model):
            return
    except ConfigError:
        pass  # a config this version cannot build: the differing fields are all we can report
    raise CheckpointError(
        f"checkpoint {path} was saved for a different model (its parameters differ; {'; '.join(diff)}): resume "
        f"with the checkpoint's config (its run's config.yaml) or start a new run"
    )


# What a resume restores from the checkpoint (optimizer param groups, the LR schedule with its
# horizon, the RNG states) and so cannot change: (config section, fields; None = all).
RESTORED_ON_RESUME: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("optimizer", None),
    ("scheduler", None),
    ("trainer", ("steps", "seed")),
)
# Fields of those sections a resume may change: how the run holds what the checkpoint restores, not what it
# restores. optimizer.split_master holds the fp32 masters split between steps, and a checkpoint holds them as
# fp32 either way (saved split, loaded unsplit and back: tests/core/test_split_master.py); its auto resolves per run.
FREE_ON_RESUME = frozenset({("optimizer", "split_master")})


def check_resume_settings(checkpointer: Checkpointer, path: str, cfg: PretrainConfig) -> None:
    """Refuse, by name, settings that differ from the checkpoint's run but would not take effect:
    the checkpoint's values are restored, and config.yaml must not claim others."""
    saved = checkpointer.read_metadata(path).get("config", {})
    now = cfg.to_dict()
    diff = []
    for section, fields in RESTORED_ON_RESUME:
        if not isinstance(saved.get(section), dict):
            continue  # a weights-only checkpoint (converted, upcycled): nothing restored
        keys = fields if fields is not None else sorted(set(saved[section]) | set(now[section]))
        for key in keys:
            if key in saved[section] and (section, key) not in FREE_ON_RESUME:
                diff += _leaf_diff(saved[section][key], now[section].get(key), f"{section}.{key}")
    if diff:
        raise ConfigError(
            f"resuming from {path} restores these settings from the checkpoint, so they cannot change: "
            f"{'; '.join(diff)}. Resume with the checkpoint's values (drop these overrides: --config "
            f"<run_dir>/config.yaml --resume), or start a new run from its weights with "
            f"--checkpoint.init_from={path} (fresh optimizer and schedule)"
        )


if __name__ == "__main__":
    run_cli(main, USER_ERRORS + (NonFiniteError,))
