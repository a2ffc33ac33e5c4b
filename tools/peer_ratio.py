#!/usr/bin/env python
"""moetron's training rows against the best peer's, measured in the same run: #13's ratio, from the files
the two benchmarks wrote (CPU; nothing runs).

    python tools/peer_ratio.py docs/bench/session49/call1/olmoe3_switches.json \\
        --peer docs/bench/session49/call1/torchtitan_olmoe3-4l-8e_after.jsonl --target 1.2

MOETRON: tools/bench_train.py --json reports (one or more variants each). --peer (repeatable): the JSON lines
../shared/peers/torchtitan_moe_bench.py printed (its "config" and "result" events). Every moetron row is
set against every peer run: tokens/s as each tool reports it (moetron's over its mean step, the peer's over
its median step: the basis of docs/performance.md's ratios since session 30) and median step against median
step; each as its range over the peer runs. Peak memory in GiB beside the peer's (its report says GB, 1e9
bytes: converted). --target R: a row's verdict, met where even its lowest ratio reaches R, missed where even
its highest does not, else mixed.

A ratio only means something for the same work on the same machine, so each of these is refused with one
error: a peer file without a result (its "error" event, e.g. an OOM, named), tokens per step that differ,
total parameters that differ by more than 0.1% (another shape: the two count the same model to within a
few norms), GPUs of different names.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from moetron.core.config import ConfigError

from cli import read_jsonl, run_cli, write_report  # tools/cli.py

PARAMS_TOLERANCE = 1e-3  # relative: moetron and torchtitan count the same shapes to within a few norm weights
GIB = 2 ** 30


def read_moetron(path: str) -> tuple[dict, list[dict]]:
    """A tools/bench_train.py report: its env and its rows (ConfigError where the file is not one)."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable tools/bench_train.py --json report ({e})") from None
    rows = report.get("rows") if isinstance(report, dict) else None
    if not rows or not all(isinstance(r, dict) and {"variant", "tokens_per_s", "step_s"} <= r.keys() for r in rows):
        raise ConfigError(f"{path}: not a tools/bench_train.py --json report (no rows with variant, tokens_per_s "
                          "and step_s)")
    return report.get("env", {}), rows


def read_peer(path: str) -> dict:
    """The peer's run from its JSON lines: the result event, with the device its config event named."""
    try:
        events = read_jsonl(path)
    except OSError as e:
        raise ConfigError(f"--peer {path}: cannot read it ({e})") from None
    errors = [e for e in events if e.get("event") == "error"]
    results = [e for e in events if e.get("event") == "result"]
    if errors and not results:
        err = errors[-1]
        raise ConfigError(f"--peer {path}: the peer's run failed ({err.get('error')}: {str(err.get('detail', ''))[:200]}); "
                          "there is no result to compare with: run it again at a shape that fits")
    if not results:
        raise ConfigError(f"--peer {path}: no \"result\" event (the run did not finish): give the JSON lines "
                          "torchtitan_moe_bench.py printed to the end")
    config = next((e for e in events if e.get("event") == "config"), {})
    return {"file": path, "device": config.get("device"), **results[-1]}


def check_same_work(row: dict, tokens: int, env: dict, source: str, peer: dict) -> None:
    """ConfigError unless a moetron row (``tokens`` a step) and a peer run did the same work on the same GPU."""
    if tokens != peer["tokens_per_step"]:
        raise ConfigError(f"{source} row {row['variant']!r} trained {tokens:,} tokens a step and "
                          f"{peer['file']} {peer['tokens_per_step']:,}: compare runs of the same --seq-len x --batch")
    params, theirs = row.get("params"), peer.get("total_params")
    if params and theirs and abs(params / theirs - 1) > PARAMS_TOLERANCE:
        raise ConfigError(f"{source} row {row['variant']!r} has {params:,} parameters and {peer['file']} {theirs:,}: "
                          "another shape; give the peer the --config of the same model (../shared/peers/README.md)")
    mine, other = env.get("device"), peer.get("device")
    if mine and other and mine != other:
        raise ConfigError(f"{source} ran on {mine} and {peer['file']} on {other}: a ratio compares runs on one "
                          "machine; run both in the same device call")


def compare(reports: list[tuple[str, dict, list[dict]]], peers: list[dict], target: float | None = None) -> list[dict]:
    """One row per moetron row: its figures and its ratios to the peer runs (each a min / max over them)."""
    if not peers:
        raise ConfigError("give at least one --peer file (the JSON lines of torchtitan_moe_bench.py)")
    out = []
    for source, env, rows in reports:
        for row in rows:
            tokens = round(row["tokens_per_s"] * row["step_s"])  # bench_train's tok/s is over its mean step
            for peer in peers:
                check_same_work(row, tokens, env, source, peer)
            median_s = row.get("step_median_s") or row["step_s"]
            reported = [row["tokens_per_s"] / p["tokens_per_s"] for p in peers]
            medians = [p["median_step_s"] / median_s for p in peers]
            verdict = None
            if target is not None:
                verdict = "met" if min(reported) >= target else ("missed" if max(reported) < target else "mixed")
            out.append({"source": source, "variant": row["variant"], "tokens_per_step": tokens,
                        "tokens_per_s": row["tokens_per_s"], "step_ms": 1e3 * row["step_s"],
                        "median_step_ms": 1e3 * median_s, "peak_mem_gib": row.get("peak_mem_gib"),
                        "ratio_min": min(reported), "ratio_max": max(reported),
                        "median_ratio_min": min(medians), "median_ratio_max": max(medians),
                        "target": target, "verdict": verdict})
    return out


def _span(lo: float, hi: float) -> str:
    return f"{lo:.3f}x" if math.isclose(lo, hi, rel_tol=0, abs_tol=5e-4) else f"{lo:.3f}-{hi:.3f}x"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("moetron", nargs="+", help="tools/bench_train.py --json reports")
    parser.add_argument("--peer", action="append", default=[], metavar="JSONL",
                        help="the peer benchmark's JSON lines (repeat for several runs: before, after)")
    parser.add_argument("--target", type=float, help="the ratio a row must reach (e.g. 1.2): met / missed / mixed")
    parser.add_argument("--json", default="runs/bench/peer_ratio.json")
    args = parser.parse_args(argv)
    reports = [(path, *read_moetron(path)) for path in args.moetron]
    peers = [read_peer(path) for path in args.peer]
    rows = compare(reports, peers, args.target)
    for p in peers:
        gb = p.get("peak_mem_gb")
        mem = f"{gb:.2f} GB ({gb * 1e9 / GIB:.1f} GiB)" if gb is not None else "-"
        print(f"peer {p['file']}: {p.get('framework', 'peer')} {p.get('config', '')}, {p['tokens_per_s']:,.0f} tok/s, "
              f"median step {1e3 * p['median_step_s']:.1f} ms, peak {mem}, {p.get('device') or 'device not named'}")
    width = max([7] + [len(r["variant"]) for r in rows])
    print(f"{'variant':<{width}} {'tok/s':>8} {'step ms':>8} {'median':>7} {'GiB':>6}  {'/ peer (tok/s)':>15}  "
          f"{'/ peer (medians)':>16}" + ("  target" if args.target is not None else ""))
    for r in rows:
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        print(f"{r['variant']:<{width}} {r['tokens_per_s']:>8,.0f} {r['step_ms']:>8.1f} {r['median_step_ms']:>7.1f} "
              f"{mem:>6}  {_span(r['ratio_min'], r['ratio_max']):>15}  "
              f"{_span(r['median_ratio_min'], r['median_ratio_max']):>16}"
              + (f"  {r['verdict']} ({args.target:g}x)" if args.target is not None else ""))
    write_report(args.json, {"tool": "tools/peer_ratio.py", "argv": argv,
                             "peers": peers}, rows)
    return 0


if __name__ == "__main__":
    run_cli(main)
