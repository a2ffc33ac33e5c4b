#!/usr/bin/env python
"""Benchmark full training steps (forward, backward, clip, AdamW) of a model config.

Prints a table and writes JSON: tokens/s and its ratio to the first variant's ("x 1st"), model
TFLOP/s per device (6 x active non-embedding params per token + attention, see docs/models.md), MFU
against the device's dense bf16 peak,
peak memory, and the loss of the first warm-up step and of the last timed step. The step time is the
mean over the timed steps; each step's own time is kept too (CUDA events at the step boundaries),
with the median beside the mean, and a step over 1.2x the median is named on stderr (a one-off
stall would otherwise read as the variant's cost). MoE rows also report the routing over the timed
steps (the worst layer's max violation; the most starved experts in one layer), and a router that
collapsed (half its experts starved) is named on stderr: its timing is not that of balanced routing.
On a GPU the card's SM clock ("MHz") and power draw ("W") are sampled over the timed steps (nvidia-smi every
200 ms, tools/clocks.py; means, with the least clock and the largest draw in the JSON): an H100 runs a step at
its power limit, below its top clock, so two runs' or two cards' times compare beside their clocks.
Each --variant is a set of overrides measured in the same process, so a switch is measured on and
off side by side; every variant trains the same seeded model on the same batches, so a variant whose
last loss strays more than 2% from the first one's is named on stderr (a numerics bug must not pass
as a timing).

    python tools/bench_train.py --preset olmo3-7b --model.n_layers=8 --seq-len 8192 --batch 2 \
        --variant sdpa:model.attention.backend=sdpa --variant flex:model.attention.backend=flex
    python tools/bench_train.py --preset olmoe-1b-7b --model.n_layers=8 --batch 4 --compile \
        --variant none:memory.recompute=none --variant full:memory.recompute=full
    python tools/bench_train.py --preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 --batch 4 \
        --variant fused:model.fused_loss=true --variant plain:model.fused_loss=false

Overrides (on the command line and in variants) are --model.*, --memory.*, --optimizer.* and
--precision.* fields (and --data.* with --real-text) (e.g. --variant fp32:optimizer.state_dtype=fp32 --variant
bf16:optimizer.state_dtype=bf16, --variant fp8:precision.recipe=fp8_blockwise).

Random token ids by default (near-uniform routing); --real-text trains on the embedded corpus, so
MoE routing depends on the data. The step is built by tools/step_builder.py.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback

import torch

from moetron.core.metrics import mfu, model_tflops_per_device, peak_tflops, run_environment
from moetron.core.moe.metrics import starved_experts, summarize
from moetron.core.memory import MemoryConfig
from moetron.core.optim import OptimizerConfig
from moetron.core.precision import PrecisionConfig
from moetron.core.trainer import TrainerConfig
from moetron.models import ModelConfig

from cli import run_cli, split_variant, write_report  # tools/cli.py
from clocks import ClockSampler  # tools/clocks.py
from step_builder import add_step_arguments, build_trainer, step_configs, token_stream  # tools/step_builder.py


def measure(model_cfg: ModelConfig, memory: MemoryConfig, optim_cfg: OptimizerConfig, precision: PrecisionConfig,
            args, device: torch.device, data_overrides: list[str] = (), trainer_cfg: TrainerConfig | None = None) -> dict:
    data = token_stream(model_cfg, args.batch, args.seq_len, device, args.real_text, data_overrides)
    # The model's own loss from the labels (model.fused_loss picks fused or plain).
    trainer = build_trainer(model_cfg, memory, data, device, seq_len=args.seq_len, precision=precision,
                            compile=args.compile, micro_batch=args.micro_batch, optimizer=optim_cfg,
                            trainer=trainer_cfg)
    first = None
    for i in range(args.warmup):
        loss, _ = trainer.train_step(data.next_batch())
        if i == 0:
            first = loss.item()  # a warm-up step: the sync costs no timed step
    layers = trainer.moe_layers
    for layer in layers.values():
        layer.pop_load_stats()  # the warm-up's counts: the routing reported is the timed steps'
    if device.type == "cuda":
        torch.cuda.synchronize()
        if trainer.step_graph is None:
            torch.cuda.reset_peak_memory_stats()
        # else (trainer.cuda_graph) the replays allocate nothing: the step's memory was allocated by the
        # capture, in the warm-up, so the peak is the whole run's (the eager warm-up steps' too)
    # Each timed step's own time as well as the window's mean: on CUDA from events recorded at the step
    # boundaries (no sync inside the window, so the host still runs ahead), on the CPU from the clock.
    # The card's SM clock and power sampled over the window (tools/clocks.py): these GPUs run a step power-capped.
    with ClockSampler(device) as clocks:
        t0 = time.perf_counter()
        marks = [_mark(device)]
        for i in range(args.steps):
            loss, _ = trainer.train_step(data.next_batch())
            if i == args.steps - 1:
                trainer.wait_optimizer()  # optimizer.overlap: the last step's updates inside the window
            marks.append(_mark(device))
        last = loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
    per_step = _intervals_s(marks)
    routing = routing_state(layers)
    tokens = args.batch * args.seq_len
    tflops = model_tflops_per_device(model_cfg.flops_per_token(args.seq_len), tokens, dt, 1)
    peak = peak_tflops(device, args.peak_tflops)
    return {
        "params": model_cfg.num_params(),
        "step_s": dt,
        "step_median_s": statistics.median(per_step),
        "step_max_s": max(per_step),
        "step_times_s": per_step,
        "tokens_per_s": tokens / dt,
        "tflops_per_device": tflops,
        "mfu": None if peak is None else mfu(tflops, peak),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "loss_first": first,
        "loss_last": last,
        **routing,
        **clocks.summary(),
    }


STARVED_SHARE = TrainerConfig.starved_expert_share
"""An expert is starved when it got under this x the fair share of its layer's tokens (the trainer's alert)."""

COLLAPSED = 0.5
"""A variant whose worst layer starved at least this fraction of its experts over the timed steps is
named on stderr: its timing is that of a collapsed router (fewer, larger expert groups), not of the
routing a trained model has."""


def routing_state(layers: dict) -> dict:
    """The MoE routing over the timed steps (the layers' counts since the last pop): the worst
    layer's max violation (max load / mean - 1) and the most starved experts in one layer, of how many.
    The same summary as the trainer's logs (core/moe/metrics.py). Empty for a dense model."""
    if not layers:
        return {}
    summary = summarize({i: layer.pop_load_stats() for i, layer in layers.items()})
    starved_L = starved_experts(summary["tokens_per_expert"], STARVED_SHARE).sum(axis=1)
    return {"moe_max_violation": float(summary["max_violation"].max()),
            "moe_starved_experts": int(starved_L.max()),
            "moe_experts": int(summary["tokens_per_expert"].shape[1])}


def _mark(device: torch.device):
    """A step boundary: a CUDA event recorded on the current stream, or the host clock on the CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _intervals_s(marks: list) -> list[float]:
    """Seconds between consecutive step boundaries (events must have completed: synchronize first)."""
    if isinstance(marks[0], float):
        return [b - a for a, b in zip(marks, marks[1:])]
    return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]


SLOW_STEP = 1.2
"""A timed step slower than this multiple of the variant's median is named on stderr: the mean (the
reported step time) includes it, so a one-off stall (a late compile, an allocator growth, clocks
still rising in the first variant of a process) would read as the variant's cost."""


def slow_steps(row: dict) -> list[tuple[int, float]]:
    """(timed step index, its time / the median) for each step slower than SLOW_STEP x the median."""
    med = row["step_median_s"]
    if med <= 0:  # a clock too coarse to time the step: nothing to compare against
        return []
    return [(i, t / med) for i, t in enumerate(row["step_times_s"]) if t > SLOW_STEP * med]


def row_warnings(row: dict) -> list[str]:
    """The stderr lines a measured row earns: timed steps far over its median, a collapsed router."""
    if "error" in row:
        return []
    lines = []
    slow = slow_steps(row)
    if slow:
        listed = ", ".join(f"{i + 1} ({x:.2f}x)" for i, x in slow)
        lines.append(f"bench_train: variant {row['variant']}: timed step(s) {listed} took over {SLOW_STEP}x its "
                     f"median step ({1e3 * row['step_median_s']:.1f} ms); the mean step includes them: compare "
                     f"medians, or give more --warmup")
    if "moe_experts" in row and row["moe_starved_experts"] >= COLLAPSED * row["moe_experts"]:
        lines.append(f"bench_train: variant {row['variant']}: routing collapsed over the timed steps "
                     f"({row['moe_starved_experts']} of {row['moe_experts']} experts got under {STARVED_SHARE}x the "
                     f"fair share in one layer): its timing is that of a collapsed router; try --real-text, fewer "
                     f"steps, or a lower --optimizer.lr")
    return lines


LOSS_SPREAD = 0.02
"""Variants train the same seeded model on the same batches: a last-step loss further than this
(relative) from the first variant's is flagged, a numerics check the timings alone do not make."""


def loss_outliers(rows: list[dict]) -> tuple[str | None, list[str]]:
    """(the first measured variant, the variants whose last loss strays more than LOSS_SPREAD from its)."""
    done = [r for r in rows if r.get("loss_last") is not None]
    if not done:
        return None, []
    ref = done[0]
    return ref["variant"], [r["variant"] for r in done[1:]
                            if abs(r["loss_last"] - ref["loss_last"]) > LOSS_SPREAD * abs(ref["loss_last"])]


def add_ratios(rows: list[dict]) -> None:
    """Each measured row's tokens/s over the first measured row's (``tokens_per_s_vs_first``): the
    issues' targets are such ratios (a switch against the row before it, a recipe against bf16)."""
    first = next((r for r in rows if "error" not in r), None)
    for r in rows:
        if "error" not in r:
            r["tokens_per_s_vs_first"] = r["tokens_per_s"] / first["tokens_per_s"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    add_step_arguments(parser)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:key=value[,key=value...] overrides measured as one row")
    parser.add_argument("--json", default="runs/bench/bench_train.json")
    args, overrides = parser.parse_known_args(argv)
    base = step_configs(args.preset, args.precision, overrides, args.real_text)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    variants = [split_variant(v) for v in args.variant] or [("base", [])]
    env = {**run_environment(device, 1, "tools/bench_train.py", argv),
           "preset": args.preset, "seq_len": args.seq_len, "batch": args.batch, "compile": args.compile,
           "real_text": args.real_text, "model": base.model.to_dict()}
    rows = []
    for name, ovr in variants:
        cfg, memory, optim, precision, data_ovr, tcfg = step_configs(args.preset, args.precision, overrides + ovr,
                                                                       args.real_text)
        try:
            # the precision and optimizer sections as given, every field: tools/plan.py --validate replays them whatever
            # the defaults then
            row = {"variant": name, "overrides": ovr, "precision": precision.to_dict(), "optimizer": optim.to_dict(),
                   **measure(cfg, memory, optim, precision, args, device, data_ovr, tcfg)}
        except Exception as e:  # noqa: BLE001 - a variant that fails is a row saying why; the others still run
            traceback.print_exc()
            row = {"variant": name, "overrides": ovr, "error": f"{type(e).__name__}: {e}"[:500]}
        rows.append(row)
        write_report(args.json, env, rows)  # after every variant: a later failure loses nothing
        torch._dynamo.reset()  # this variant's compiled graphs
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    add_ratios(rows)
    write_report(args.json, env, rows)
    print(f"{env['device']} | torch {env['torch']} | {args.preset} {base.model.describe()} | seq {args.seq_len} x {args.batch}")
    print(f"{'variant':<12} {'step ms':>9} {'median':>8} {'tok/s':>10} {'x 1st':>6} {'TFLOP/s':>9} {'MFU':>7} "
          f"{'mem GiB':>8} {'loss first -> last':>20} {'maxvio':>7} {'starved':>8} {'MHz':>6} {'W':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<12} {r['error'][:90]}")
            continue
        mfu_s = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        losses = f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}" if r["loss_first"] is not None else f"{r['loss_last']:.4f}"
        maxvio = f"{r['moe_max_violation']:.2f}" if "moe_max_violation" in r else "-"
        starved = f"{r['moe_starved_experts']}/{r['moe_experts']}" if "moe_experts" in r else "-"
        mhz, watts = ((f"{r['sm_clock_mhz']:.0f}", f"{r['power_w']:.0f}") if r.get("sm_clock_mhz") is not None
                      else ("-", "-"))
        print(f"{r['variant']:<12} {1e3 * r['step_s']:>9.1f} {1e3 * r['step_median_s']:>8.1f} {r['tokens_per_s']:>10,.0f} "
              f"{r['tokens_per_s_vs_first']:>6.3f} {r['tflops_per_device']:>9.1f} {mfu_s:>7} {mem:>8} {losses:>20} "
              f"{maxvio:>7} {starved:>8} {mhz:>6} {watts:>5}")
    for r in rows:
        for line in row_warnings(r):
            print(line, file=sys.stderr)
    ref, outliers = loss_outliers(rows)
    for name in outliers:
        print(f"bench_train: variant {name}'s last loss is more than {100 * LOSS_SPREAD:.0f}% from {ref}'s "
              f"(same model, same batches): check its numerics before trusting its timing", file=sys.stderr)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    run_cli(main)
