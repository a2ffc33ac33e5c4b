#!/usr/bin/env python
"""Compare runs' loss curves against a reference run: the convergence check of a switch or a
precision recipe (e.g. bf16 vs fp8_blockwise vs mxfp8 on the same data and seed).

    python tools/compare_runs.py runs/bf16 runs/fp8 runs/mxfp8 --tolerance 0.01 \
        --out docs/images/recipes_loss.png

For each run: the final train loss (mean over the last ``--last`` logged steps, so one noisy step
does not decide), the last held-out loss, and both relative to the reference (the first run unless
--reference names one); a run is within tolerance when both |relative differences| are at most
--tolerance. Prints a table, writes JSON (--json) and, with --out, a plot (matplotlib): each run's
or group's mean train and held-out curves (a group's min-max band over its runs), and below them
each one's difference to the reference in percent with the tolerance drawn. Runs must share the
logged steps they are compared at (the same trainer.log_every and steps); the comparison uses the
steps every run logged.

Seeds: ``--group NAME=DIR,DIR,...`` makes one row of several runs (e.g. the same recipe over seeds),
its losses the means over its runs, with their spread ((max - min) / mean) beside them, so a recipe
is compared with the reference by its mean over seeds, not one seed's draw:

    python tools/compare_runs.py --group bf16=runs/bf16_s0,runs/bf16_s1 --group mxfp8=runs/mx_s0,runs/mx_s1

Noise: where a group and the reference both hold two runs or more, the row also gives two standard errors
of the difference of their means (each group's sample standard deviation over its runs, relative to the
reference's mean), train and held-out. A difference inside it is not told apart from run-to-run noise
whatever the tolerance says: on the GPU the same configuration and seed run twice can end 1.4% apart
(docs/performance.md, session 51), about as far as different seeds.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

from moetron.core.config import ConfigError

from cli import run_cli, write_report  # tools/cli.py
from plot import read_metrics, require_matplotlib  # tools/plot.py


def load_series(dirs: list[str]) -> tuple[dict, dict, list[int]]:
    """Each run's train and held-out losses by step ({dir: {step: loss}} twice) and the train steps
    every run logged (sorted): what the table and the plot both compare over (one reading)."""
    metrics = {d: read_metrics(d) for d in dict.fromkeys(dirs)}
    train = {d: {r["step"]: r["loss"] for r in rows if r.get("loss") is not None} for d, rows in metrics.items()}
    held = {d: {r["step"]: r["eval_loss"] for r in rows if r.get("eval_loss") is not None} for d, rows in metrics.items()}
    common = sorted(set.intersection(*(set(t) for t in train.values())))
    if not common:
        raise ConfigError("the runs share no logged train step: run them with the same trainer.steps and "
                          "trainer.log_every")
    return train, held, common


def summarize(train: dict[int, float], held: dict[int, float], steps: list[int], last: int) -> dict:
    """A run's final train loss (mean over its last ``last`` of ``steps``, sorted) and last held-out loss."""
    tail = [train[s] for s in steps[-last:]]
    last_held = max(held) if held else None
    return {"final_step": steps[-1] if steps else None,
            "train_loss": sum(tail) / len(tail) if tail else math.nan,
            "eval_loss": held[last_held] if held else math.nan,
            "eval_step": last_held}


def compare(run_dirs: list[str], reference: str | None = None, tolerance: float = 0.01, last: int = 10) -> list[dict]:
    """One row per run: its summary, relative differences to the reference run and the verdict."""
    if len(run_dirs) < 2:
        raise ConfigError("compare_runs needs at least two run directories (the first is the reference unless "
                          "--reference names one)")
    if reference is not None and reference not in run_dirs:
        run_dirs = [reference, *run_dirs]
    return compare_groups({d: [d] for d in run_dirs}, reference, tolerance, last)


def compare_groups(groups: dict[str, list[str]], reference: str | None = None, tolerance: float = 0.01,
                   last: int = 10, series: tuple | None = None) -> list[dict]:
    """One row per group of runs (a group of one run: that run, named by its directory): the means
    of its runs' summaries, their spread, relative differences to the reference group (the first
    unless named) and the verdict. ``series``: load_series() of these runs, if already read."""
    if len(groups) < 2:
        raise ConfigError("compare_runs needs at least two runs or groups to compare (the first is the reference "
                          "unless --reference names one)")
    if last < 1:
        raise ConfigError(f"--last must be >= 1, got {last}")
    empty = [name for name, dirs in groups.items() if not dirs]
    if empty:
        raise ConfigError(f"group {empty[0]!r} names no run directory: give --group NAME=DIR[,DIR...]")
    reference = reference or next(iter(groups))
    if reference not in groups:
        raise ConfigError(f"--reference {reference!r} is none of the runs or groups: {list(groups)}")
    train, held, common = series or load_series([d for group in groups.values() for d in group])
    summaries = {d: summarize(train[d], held[d], common, last) for d in train}

    def mean(values):
        return sum(values) / len(values)

    def spread(values):
        return (max(values) - min(values)) / abs(mean(values)) if len(values) > 1 else 0.0

    merged, losses = {}, {}
    for name, group in groups.items():
        train = [summaries[d]["train_loss"] for d in group]
        held = [summaries[d]["eval_loss"] for d in group]
        losses[name] = {"train": train, "eval": held}
        merged[name] = {"runs": list(group), "final_step": summaries[group[0]]["final_step"],
                        "train_loss": mean(train), "eval_loss": mean(held),
                        "eval_step": summaries[group[0]]["eval_step"],
                        "train_spread": spread(train), "eval_spread": spread(held)}
    ref = merged[reference]

    def noise(name, key):
        """Two standard errors of group ``name``'s mean minus the reference's, relative to the reference's
        mean (nan unless both hold two runs or more and the losses are finite)."""
        a, b = losses[name][key], losses[reference][key]
        if len(a) < 2 or len(b) < 2 or any(math.isnan(v) for v in a + b):
            return math.nan
        return 2 * math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) / abs(mean(b))

    out = []
    for name, s in merged.items():
        rel_train = s["train_loss"] / ref["train_loss"] - 1
        rel_eval = (s["eval_loss"] / ref["eval_loss"] - 1) if not math.isnan(ref["eval_loss"]) else math.nan
        within = abs(rel_train) <= tolerance and (math.isnan(rel_eval) or abs(rel_eval) <= tolerance)
        train_noise, eval_noise = (math.nan, math.nan) if name == reference else (noise(name, "train"), noise(name, "eval"))
        out.append({"run": name, "reference": name == reference, **s, "train_vs_reference": rel_train,
                    "eval_vs_reference": rel_eval, "within_tolerance": within, "tolerance": tolerance,
                    "train_noise": train_noise, "eval_noise": eval_noise,
                    "beyond_noise": None if math.isnan(train_noise) else (
                        abs(rel_train) > train_noise or (not math.isnan(eval_noise) and abs(rel_eval) > eval_noise)),
                    "compared_steps": len(common)})
    return out


def parse_groups(specs: list[str]) -> dict[str, list[str]]:
    """--group NAME=DIR[,DIR...] specs -> {name: dirs} (ConfigError naming a malformed or repeated one)."""
    groups: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, dirs = spec.partition("=")
        if not sep or not name:
            raise ConfigError(f"--group {spec!r}: write NAME=DIR[,DIR...]")
        if name in groups:
            raise ConfigError(f"--group {name!r} is given twice")
        groups[name] = [d for d in dirs.split(",") if d]
    return groups


def group_curves(groups: dict[str, list[str]], reference: str | None = None,
                 series: tuple | None = None) -> dict[str, dict]:
    """Per group, over the train steps every run logged: the mean train loss of its runs, their
    min and max, and the mean's difference to the reference group's mean (relative, at each step);
    the held-out steps every run of the group logged, with their mean and its relative difference
    where the reference logged that step too (runs of a group that logged held-out at different
    steps share none: the group then has no held-out curve, while the table still compares each
    run's last held-out loss). What plot() draws, kept apart so tests can check it. ``series``:
    load_series() of these runs, if already read."""
    reference = reference or next(iter(groups))
    train, held, steps = series or load_series([d for dirs in groups.values() for d in dirs])
    out = {}
    for name, dirs in groups.items():
        per_step = [[train[d][s] for d in dirs] for s in steps]
        hsteps = sorted(set.intersection(*(set(held[d]) for d in dirs)))
        out[name] = {"steps": steps, "mean": [sum(v) / len(v) for v in per_step],
                     "lo": [min(v) for v in per_step], "hi": [max(v) for v in per_step],
                     "held_steps": hsteps, "held_mean": [sum(held[d][s] for d in dirs) / len(dirs) for s in hsteps]}
    ref = out[reference]
    ref_held = dict(zip(ref["held_steps"], ref["held_mean"]))
    for c in out.values():
        c["rel"] = [m / r - 1 for m, r in zip(c["mean"], ref["mean"])]
        c["held_rel"] = {s: m / ref_held[s] - 1 for s, m in zip(c["held_steps"], c["held_mean"]) if s in ref_held}
    return out


def plot(groups: dict[str, list[str]], path: str, reference: str | None = None, tolerance: float = 0.01,
         smooth: int = 5, series: tuple | None = None) -> str:
    """Two panels: each group's mean train loss (a band from its runs' min to max) and held-out loss;
    below, each group's difference to the reference group in percent (train: a moving mean over
    ``smooth`` logged steps; held-out: markers), with the tolerance drawn. A group of one run is
    that run."""
    plt = require_matplotlib()
    reference = reference or next(iter(groups))
    curves = group_curves(groups, reference, series)
    fig, (ax, rel) = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})

    def short(name):  # a run given by its directory: its base name
        return os.path.basename(os.path.normpath(name)) if groups[name] == [name] else name

    for i, (name, c) in enumerate(curves.items()):
        label = f"{short(name)} ({len(groups[name])} run{'s' if len(groups[name]) > 1 else ''})"
        ax.plot(c["steps"], c["mean"], color=f"C{i}", linewidth=1, label=label)
        if len(groups[name]) > 1:
            ax.fill_between(c["steps"], c["lo"], c["hi"], color=f"C{i}", alpha=0.15, linewidth=0)
        if c["held_steps"]:
            ax.plot(c["held_steps"], c["held_mean"], color=f"C{i}", marker="o", markersize=3, linestyle="--")
        pct = [100 * v for v in c["rel"]]
        k = max(1, smooth)
        smoothed = [sum(pct[max(0, j - k + 1): j + 1]) / len(pct[max(0, j - k + 1): j + 1]) for j in range(len(pct))]
        rel.plot(c["steps"], smoothed, color=f"C{i}", linewidth=1)
        if c["held_rel"]:
            rel.plot(list(c["held_rel"]), [100 * v for v in c["held_rel"].values()], color=f"C{i}", marker="o",
                     markersize=4, linestyle="none")
    # The first quarter's high train losses would flatten the rest; held-out points are always shown.
    tail = [v for c in curves.values() for v in c["hi"][len(c["hi"]) // 4:] + c["held_mean"]]
    low = [v for c in curves.values() for v in c["lo"][len(c["lo"]) // 4:] + c["held_mean"]]
    if tail and low:
        pad = 0.05 * (max(tail) - min(low) or 1.0)
        ax.set_ylim(min(low) - pad, max(tail) + pad)
    ax.set(ylabel="loss", title="train (lines, band: min-max over seeds) and held-out (dashed, markers)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for y in (-100 * tolerance, 100 * tolerance):
        rel.axhline(y, color="0.5", linewidth=0.8, linestyle=":")
    rel.axhline(0, color="0.3", linewidth=0.8)
    rel.set(xlabel="step", ylabel=f"vs {short(reference)} (%)",
            title=f"difference to {short(reference)}: train (moving mean of {smooth} logs), held-out (markers); dotted: +-{100 * tolerance:g}%")
    rel.title.set_fontsize(8)
    ax.title.set_fontsize(9)
    rel.grid(alpha=0.3)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close("all")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("runs", nargs="*", help="run directories (each holds metrics.jsonl)")
    parser.add_argument("--group", action="append", default=[], metavar="NAME=DIR[,DIR...]",
                        help="one row of several runs (e.g. seeds): their mean losses and spread")
    parser.add_argument("--reference", help="the run or group the others are measured against (default: the first)")
    parser.add_argument("--tolerance", type=float, default=0.01, help="relative loss difference allowed (0.01 = 1%%)")
    parser.add_argument("--last", type=int, default=10, help="logged steps averaged for the final train loss")
    parser.add_argument("--out", help="a PNG of each run's or group's curves and its difference to the reference "
                                      "(needs matplotlib)")
    parser.add_argument("--json", default="runs/bench/compare_runs.json")
    args = parser.parse_args(argv)
    groups = {d: [d] for d in args.runs}
    for name, dirs in parse_groups(args.group).items():
        if name in groups:
            raise ConfigError(f"--group {name!r} has the name of a run directory given too")
        groups[name] = dirs
    # Every run's metrics read once, for the table and the plot (an empty group: compare_groups says so).
    series = load_series([d for dirs in groups.values() for d in dirs]) if groups and all(groups.values()) else None
    rows = compare_groups(groups, args.reference, args.tolerance, args.last, series)

    def pct(x):
        return "-" if math.isnan(x) else f"{100 * x:+.2f}%"

    width = min(72, max([3] + [len(r["run"]) for r in rows]))  # long run directories keep their tail

    def cut(name):
        return name if len(name) <= width else "..." + name[-(width - 3):]

    def noise(r):
        if r["beyond_noise"] is None:
            return "-"
        held = "-" if math.isnan(r["eval_noise"]) else f"{100 * r['eval_noise']:.2f}%"
        return f"+-{100 * r['train_noise']:.2f}% / {held}  {'beyond' if r['beyond_noise'] else 'inside'}"

    print(f"{'run':<{width}} {'runs':>4} {'step':>6} {'train':>8} {'spread':>7} {'vs ref':>8} {'held-out':>9} {'spread':>7} "
          f"{'vs ref':>8}  {f'within {100 * args.tolerance:g}%':<11}  noise (2 s.e., train / held-out)")
    for r in rows:
        verdict = "(reference)" if r["reference"] else ("yes" if r["within_tolerance"] else "NO")
        print(f"{cut(r['run']):<{width}} {len(r['runs']):>4} {r['final_step']:>6} {r['train_loss']:>8.4f} "
              f"{100 * r['train_spread']:>6.2f}% {pct(r['train_vs_reference']):>8} {r['eval_loss']:>9.4f} "
              f"{100 * r['eval_spread']:>6.2f}% {pct(r['eval_vs_reference']):>8}  {verdict:<11}  {noise(r)}")
    if args.out:
        reference = next(r["run"] for r in rows if r["reference"])
        print(f"wrote {plot(groups, args.out, reference, args.tolerance, series=series)}")
    write_report(args.json, {"tool": "tools/compare_runs.py", "argv": argv}, rows)
    return 0


if __name__ == "__main__":
    run_cli(main)
