#!/usr/bin/env python
"""Plot a run: its training curves (metrics.jsonl) and every MoE layer's expert load (moe_load.npz).

    python tools/plot.py runs/x                       # PNGs into runs/x/plots, paths printed
    python tools/plot.py runs/x --out figs --steps 100,240 --starved-share 0.1

Writes loss.png (train and held-out), lr.png, grad_norm.png, throughput.png (tokens/s and MFU),
and for MoE runs expert_load_step<N>.png (layers x experts, each expert's share of its layer's
tokens at log step N; starved experts crossed, dead ones boxed) and expert_load_evolution.png
(per-layer max violation, routing entropy and starved-expert count over the log steps). One
averaged balance number can look fine while experts starve: the heatmap shows each of them.
Needs matplotlib (pip install matplotlib, or pip install 'moetron[track]').
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from moetron.core.config import ConfigError
from moetron.core.moe.metrics import expert_share, starved_experts
from moetron.core.trainer import TrainerConfig

from cli import read_jsonl, run_cli  # tools/cli.py


def require_matplotlib():
    """pyplot on the file-only Agg backend, or one ConfigError saying what to install."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("tools/plot.py needs matplotlib, which is not installed: pip install matplotlib "
                          "(or pip install 'moetron[track]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(run: str) -> list[dict[str, Any]]:
    """A run's metrics.jsonl rows: ``run`` its directory (the trainer's trainer.run_dir) or that file."""
    path = run if os.path.isfile(run) else os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        raise ConfigError(f"{path} does not exist: pass a run directory (the trainer's trainer.run_dir) or its "
                          "metrics.jsonl")
    return read_jsonl(path)


def read_load(run_dir: str) -> dict[str, np.ndarray] | None:
    """moe_load.npz's arrays (step [R], layers [L], tokens_per_expert [R, L, E], ...), or None (dense run)."""
    path = os.path.join(run_dir, "moe_load.npz")
    if not os.path.exists(path):
        return None
    with np.load(path) as saved:
        return {k: saved[k] for k in saved.files}


def run_starved_share(run_dir: str) -> float:
    """The run's trainer.starved_expert_share (its config.yaml), else the default."""
    path = os.path.join(run_dir, "config.yaml")
    if os.path.exists(path):
        import yaml

        with open(path, encoding="utf-8") as f:
            trainer = (yaml.safe_load(f) or {}).get("trainer") or {}
        if isinstance(trainer.get("starved_expert_share"), (int, float)) and trainer["starved_expert_share"] > 0:
            return float(trainer["starved_expert_share"])
    return TrainerConfig.starved_expert_share


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    kept = [r for r in rows if r.get(key) is not None]
    return [r["step"] for r in kept], [r[key] for r in kept]


def _save(fig, path: str) -> str:
    if not fig.get_constrained_layout():
        fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clf()
    return path


def plot_curves(rows: list[dict[str, Any]], out_dir: str, plt, title: str = "") -> list[str]:
    """loss.png, lr.png, grad_norm.png, throughput.png from metrics.jsonl rows; returns their paths."""
    paths = []
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for key, label in (("loss", "train"), ("eval_loss", "held-out")):
        steps, values = _series(rows, key)
        if steps:
            ax.plot(steps, values, marker="o" if key == "eval_loss" else None, markersize=3, label=label)
    ax.set(xlabel="step", ylabel="loss", title=f"{title} loss".strip())
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(_save(fig, os.path.join(out_dir, "loss.png")))
    for key, label, name in (("lr", "learning rate", "lr.png"), ("grad_norm", "grad norm (before clipping)", "grad_norm.png")):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.plot(*_series(rows, key))
        ax.set(xlabel="step", ylabel=label, title=f"{title} {label}".strip())
        ax.grid(alpha=0.3)
        paths.append(_save(fig, os.path.join(out_dir, name)))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(*_series(rows, "tokens_per_s"), color="C0")
    ax.set(xlabel="step", ylabel="tokens/s (all ranks)", title=f"{title} throughput".strip())
    ax.grid(alpha=0.3)
    mfu_steps, mfu_values = _series(rows, "mfu")
    if mfu_steps:
        twin = ax.twinx()
        twin.plot(mfu_steps, [100 * v for v in mfu_values], color="C1")
        twin.set_ylabel("MFU %", color="C1")
    else:
        ax.text(0.02, 0.04, "no MFU: the device's peak is unknown (the CPU)", transform=ax.transAxes, fontsize=8)
    paths.append(_save(fig, os.path.join(out_dir, "throughput.png")))
    plt.close("all")
    return paths


def pick_records(recorded_steps: np.ndarray, wanted: list[int] | None) -> list[int]:
    """Indices of the records nearest each wanted step (default: the last record)."""
    if not wanted:
        return [len(recorded_steps) - 1]
    return sorted({int(np.argmin(np.abs(recorded_steps - w))) for w in wanted})


def plot_expert_load(load: dict[str, np.ndarray], record: int, share_of_fair: float, path: str, plt,
                     title: str = "") -> np.ndarray:
    """Heatmap of each layer's expert shares at one record [L, E], starved experts (under
    ``share_of_fair`` x 1/E) crossed and dead ones (no tokens) boxed. Returns the starved mask [L, E]."""
    from matplotlib.colors import TwoSlopeNorm

    tokens_LE = load["tokens_per_expert"][record]
    share_LE = expert_share(tokens_LE)
    starved_LE = starved_experts(tokens_LE, share_of_fair)
    dead_LE = starved_LE & (tokens_LE == 0)
    L, E = share_LE.shape
    fair = 1.0 / E
    fig, ax = plt.subplots(figsize=(min(4.5 + 0.14 * E, 20), min(2.4 + 0.32 * L, 14)), layout="constrained")
    # Fair share in the middle of the colour scale: starved experts blue, overloaded ones red.
    norm = TwoSlopeNorm(vmin=0.0, vcenter=fair, vmax=max(float(share_LE.max()), 2 * fair))
    image = ax.imshow(share_LE, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"share of the layer's tokens\n(fair: 1/{E} = {fair:.3f})")
    rows_s, cols_s = np.nonzero(starved_LE & ~dead_LE)
    # Gold marks stand out on the dark blue of a starved cell and on every other colour of the scale.
    ax.scatter(cols_s, rows_s, marker="x", color="gold", s=40, linewidths=2, label=f"starved (< {share_of_fair:g} x fair)")
    rows_d, cols_d = np.nonzero(dead_LE)
    ax.scatter(cols_d, rows_d, marker="s", facecolors="none", edgecolors="gold", s=90, linewidths=2,
               label="dead (no tokens)")
    layers = load["layers"].tolist()
    ax.set_yticks(range(L), [str(i) for i in layers])
    if E <= 32:
        ax.set_xticks(range(E))
    ax.set(xlabel="expert", ylabel="layer",
           title=f"{title} expert load at step {int(load['step'][record])}: {int(starved_LE.sum())} starved".strip())
    if starved_LE.any():
        fig.legend(loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    _save(fig, path)
    plt.close(fig)
    return starved_LE


def plot_load_evolution(load: dict[str, np.ndarray], share_of_fair: float, path: str, plt, title: str = "") -> str:
    """Per-layer max violation, routing entropy and number of starved experts over the log steps."""
    from matplotlib.ticker import MaxNLocator

    steps, layers = load["step"], load["layers"].tolist()
    starved_RL = np.stack([starved_experts(t, share_of_fair).sum(axis=-1) for t in load["tokens_per_expert"]])
    panels = (("max_violation", load["max_violation"], "max violation (max/mean - 1)"),
              ("entropy", load["entropy"], "routing entropy (nats/token)"),
              ("starved", starved_RL, f"starved experts (< {share_of_fair:g} x fair)"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 7.5), sharex=True)
    colors = plt.get_cmap("viridis")(np.linspace(0, 1, max(len(layers), 2)))
    for ax, (_, values_RL, label) in zip(axes, panels):
        for j, layer in enumerate(layers):
            ax.plot(steps, values_RL[:, j], color=colors[j], label=f"layer {layer}", linewidth=1)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{title} expert load per layer".strip())
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(layers) <= 12:
        axes[0].legend(fontsize=7, ncol=min(len(layers), 4))
    else:
        axes[0].text(0.01, 0.9, f"{len(layers)} layers: dark = first, light = last", transform=axes[0].transAxes,
                     fontsize=8)
    _save(fig, path)
    plt.close(fig)
    return path


def plot_run(run_dir: str, out_dir: str | None = None, steps: list[int] | None = None,
             starved_share: float | None = None) -> list[str]:
    """Every plot of a run; returns the PNG paths written."""
    plt = require_matplotlib()
    rows = read_metrics(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    title = os.path.basename(os.path.normpath(run_dir))
    paths = plot_curves(rows, out_dir, plt, title)
    load = read_load(run_dir)
    if load is not None and len(load["step"]):
        share = starved_share if starved_share is not None else run_starved_share(run_dir)
        for record in pick_records(load["step"], steps):
            path = os.path.join(out_dir, f"expert_load_step{int(load['step'][record])}.png")
            plot_expert_load(load, record, share, path, plt, title)
            paths.append(path)
        paths.append(plot_load_evolution(load, share, os.path.join(out_dir, "expert_load_evolution.png"), plt, title))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory (holds metrics.jsonl, and moe_load.npz for MoE runs)")
    parser.add_argument("--out", help="where the PNGs go (default: RUN_DIR/plots)")
    parser.add_argument("--steps", help="log steps of the expert-load heatmaps, comma-separated (nearest "
                                        "recorded step; default: the last)")
    parser.add_argument("--starved-share", type=float, help="starved = under this x the fair share "
                                                            "(default: the run's trainer.starved_expert_share)")
    args = parser.parse_args(argv)
    try:
        steps = [int(s) for s in args.steps.split(",") if s.strip()] if args.steps else None
    except ValueError:
        raise ConfigError(f"--steps={args.steps}: expected comma-separated step numbers, e.g. 100,240") from None
    if args.starved_share is not None and not 0 < args.starved_share <= 1:
        raise ConfigError(f"--starved-share must be in (0, 1], got {args.starved_share}")
    for path in plot_run(args.run_dir, args.out, steps, args.starved_share):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run_cli(main)
