#!/usr/bin/env python
"""Benchmark whole parallel training steps under torchrun, and the expert all-to-all's share of them.

Each variant builds the run exactly as tools/pretrain.py does (mesh, data, model, strategies,
optimizer, Trainer; no checkpoints, no eval), warms up, then times --steps optimizer steps on the
real token stream (routing depends on the data). Reported per variant: the layout, tokens/s and
model TFLOP/s per GPU (6 x active non-embedding params per token + attention, see docs/models.md),
MFU against the GPU's dense bf16 peak, step time, the time spent inside the expert-parallel token
all-to-alls (forward and backward) and its share of the step, and peak memory.

    torchrun --nproc-per-node 8 tools/bench_parallel.py --preset olmoe-1b-7b --tokens-per-gpu 16384 \
        --seq-len 4096 --steps 10 --warmup 3 --model.n_layers=4 --parallel.ep=8 \
        --variants "synced:parallel.ep_dispatch=synced" "sync_free:parallel.ep_dispatch=sync_free" \
        "all_gather:parallel.ep_dispatch=all_gather"

Pipeline bubbles: each pipeline row carries its schedule's theoretical bubble, the idle share of
the step, (p-1)/(m+p-1) for GPipe and 1F1B and (p-1)/(v*m+p-1) for interleaved 1F1B (p ranks, m
micro-batches, v stages per rank; Narayanan et al. 2021, as a share of the step rather than of the
ideal time). With --bubble-baseline, the measured bubble is 1 - ideal / step(row), where ideal is
a pp=1 run's step time scaled to the row's tokens per GPU: NAME is a variant of this launch,
FILE.json:NAME one of an earlier launch (its JSON). The cleanest baseline is the whole model on one
GPU with the same micro-batch size (no data-parallel collectives, no pipeline): the measured bubble
then also counts the stage send/recv and any imbalance between stages. A data-parallel baseline on
the same GPUs carries FSDP's per-micro-batch collectives, so it understates the bubble:

    torchrun --nproc-per-node 1 tools/bench_parallel.py --preset olmoe-1b-7b --model.n_layers=8 \
        --data.global_batch_size=16 --trainer.micro_batch_size=2 --seq-len 4096 --json one_gpu.json

    torchrun --nproc-per-node 2 tools/bench_parallel.py --preset olmoe-1b-7b --model.n_layers=8 \
        --data.global_batch_size=16 --seq-len 4096 --bubble-baseline one_gpu.json:base \
        --variants "1f1b:parallel.pp=2,parallel.dp_shard=1,parallel.pp_microbatches=8" \
        "interleaved:parallel.pp=2,parallel.dp_shard=1,parallel.pp_schedule=interleaved_1f1b,parallel.pp_stages_per_rank=2,parallel.pp_microbatches=8"

Any PretrainConfig override (--section.field=value) applies to every variant; a variant is
NAME:key=value[,key=value...] applied on top. data.global_batch_size defaults to
tokens-per-gpu x data-parallel ranks / seq_len (so each data-parallel rank sees --tokens-per-gpu).

All-to-all time: ``moetron.parallel.expert.all_to_all_rows`` (what the dispatcher calls for the
token rows; the small per-expert count exchange is not included) is swapped for a timed wrapper
that returns the same tensors. On GPU it records CUDA events on the current stream around each
call (the stream waits on the collective, so the span covers waiting for peers as well as the
transfer) and reads them after the timing window's synchronize; on CPU it reads perf_counter
around the blocking gloo call. --no-a2a-timing measures the same steps without the wrapper.

NVLink multicast (NVLS / symmetric-memory multicast) is kept off unless the environment says
otherwise.
"""

from __future__ import annotations

import os

# Before any process group exists: NCCL reads these when it creates communicators.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moetron.core.config import ConfigError  # noqa: E402
from moetron.core.distributed import finish_distributed, init_distributed, is_main, pick_device  # noqa: E402
from moetron.core.metrics import mfu, model_tflops_per_device, peak_tflops, run_environment  # noqa: E402
from moetron.parallel import expert as expert_module  # noqa: E402
from moetron.parallel.expert import resolve_dispatch  # noqa: E402
from moetron.parallel.config import PipelineSchedule  # noqa: E402

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # tools/pretrain.py and cli.py, also when imported
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pretrain  # noqa: E402
from cli import run_cli, split_variant, write_report  # noqa: E402



# ---------------------------------------------------------------------------------------------
# Timing the all-to-alls without changing what they compute
# ---------------------------------------------------------------------------------------------


class A2ATimer:
    """Spans of the all-to-all calls since the last reset(): CUDA event pairs or host seconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.active = False
        self.reset()

    def reset(self) -> None:
        self.event_pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_s = 0.0
        self.calls = 0

    @contextlib.contextmanager
    def span(self):
        if not self.active:
            yield
            return
        self.calls += 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.event_pairs.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.host_s += time.perf_counter() - t0

    def total_ms(self) -> float:
        """Milliseconds inside the calls; on GPU only after the device has been synchronized."""
        if self.cuda:
            return sum(s.elapsed_time(e) for s, e in self.event_pairs)
        return 1e3 * self.host_s


def _timed_all_to_all(original, timer: A2ATimer):
    """A drop-in for all_to_all_rows whose forward and backward exchanges are timed."""

    class _Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x_SD, out_splits, in_splits, group):
            ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
            with timer.span():
                return original(x_SD, out_splits, in_splits, group)

        @staticmethod
        def backward(ctx, grad_ND):
            # The original's backward: the reverse exchange with the splits swapped.
            with timer.span():
                grad_SD = original(grad_ND, ctx.in_splits, ctx.out_splits, ctx.group)
            return grad_SD, None, None, None

    def all_to_all_rows(x_SD, out_splits, in_splits, group):
        return _Timed.apply(x_SD, out_splits, in_splits, group)

    return all_to_all_rows


@contextlib.contextmanager
def patched_all_to_all(timer: A2ATimer | None):
    """Route the dispatcher's all_to_all_rows through the timer (None: leave it alone)."""
    if timer is None:
        yield
        return
    original = expert_module.all_to_all_rows
    expert_module.all_to_all_rows = _timed_all_to_all(original, timer)
    try:
        yield
    finally:
        expert_module.all_to_all_rows = original


# ---------------------------------------------------------------------------------------------
# One variant
# ---------------------------------------------------------------------------------------------


def resolve_config(args, overrides: list[str], world: int):
    """The run's PretrainConfig with the benchmark's defaults under the user's overrides."""
    defaults = [f"--data.seq_len={args.seq_len}", "--trainer.eval_batches=0", "--trainer.run_dir="]
    argv = (["--preset", args.preset] if args.preset else []) + defaults + overrides
    cfg, _ = pretrain.parse_args(argv)
    if not any(o.startswith("--data.global_batch_size=") for o in overrides):
        layout = cfg.parallel.resolve(world)
        dp = layout.dp_replicate * layout.dp_shard
        tokens = args.tokens_per_gpu * dp
        if tokens % cfg.data.seq_len:
            raise ConfigError(f"--tokens-per-gpu {args.tokens_per_gpu} x {dp} data-parallel ranks is not a "
                              f"multiple of seq_len {cfg.data.seq_len}: choose a multiple of the sequence length")
        cfg.data.global_batch_size = tokens // cfg.data.seq_len
        cfg.validate()
    return cfg


def bubble_theory(layout) -> float | None:
    """The schedule's idle share of a step (None for pp=1 and for schedules without a closed form)."""
    if layout.pp == 1:
        return None
    p, v = layout.pp, layout.pp_stages_per_rank
    m = layout.pp_microbatches if layout.pp_microbatches is not None else 2 * p * v
    if layout.pp_schedule in (PipelineSchedule.gpipe, PipelineSchedule.one_f_one_b):
        return (p - 1) / (m + p - 1)
    if layout.pp_schedule == PipelineSchedule.interleaved_1f1b:
        return (p - 1) / (v * m + p - 1)
    return None


def baseline_row(spec: str | None, rows: list[dict]) -> dict | None:
    """The --bubble-baseline row: NAME (a variant of this launch) or FILE.json:NAME (an earlier one)."""
    if spec is None:
        return None
    path, name = spec.rsplit(":", 1) if ".json:" in spec else ("", spec)
    if path:
        try:
            candidates = json.load(open(path))["rows"]
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"--bubble-baseline {spec!r}: cannot read rows from {path} ({e})") from None
    else:
        candidates = rows
    base = next((r for r in candidates if r["variant"] == name), None)
    if base is None:
        raise ConfigError(f"--bubble-baseline {spec!r} names no variant; variants: {[r['variant'] for r in candidates]}")
    if base["layout"]["pp"] != 1:
        raise ConfigError(f"--bubble-baseline {spec!r} must be a pp=1 variant, it has pp={base['layout']['pp']}")
    return base


def add_measured_bubbles(rows: list[dict], base: dict | None) -> None:
    """bubble_measured = 1 - ideal / step(row) for pipeline rows, where ideal is the baseline's step
    time scaled to the row's tokens per GPU (see the module docstring)."""
    if base is None:
        return
    base_per_gpu = base["tokens_per_step"] / base["gpus"]
    for r in rows:
        if r["layout"]["pp"] > 1:
            ideal = base["step_ms"] * (r["tokens_per_step"] / r["gpus"]) / base_per_gpu
            r["bubble_measured"] = 1 - ideal / r["step_ms"]
            r["bubble_baseline"] = {"variant": base["variant"], "step_ms": base["step_ms"], "gpus": base["gpus"],
                                    "tokens_per_step": base["tokens_per_step"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _reduce(values: list[float], op, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t.tolist()


def measure(name: str, overrides: list[str], args, device: torch.device, world: int) -> dict:
    cfg = resolve_config(args, overrides, world)
    layout = cfg.parallel.resolve(world)
    trainer, state = pretrain.build(cfg, device, world)
    timer = A2ATimer(device) if args.a2a_timing else None
    try:
        with patched_all_to_all(timer):
            for _ in range(args.warmup):
                loss, _ = trainer.train_step(trainer.data.next_batch())
            for layer in trainer.moe_layers.values():  # forget warm-up overflow counts
                if hasattr(layer.dispatcher, "pop_overflow"):
                    layer.dispatcher.pop_overflow()
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if timer is not None:
                timer.reset()
                timer.active = True
            # One timing window, no sync inside it: step boundaries are events (GPU) or host times.
            if device.type == "cuda":
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
                marks[0].record()
            host = [time.perf_counter()]
            for i in range(args.steps):
                loss, _ = trainer.train_step(trainer.data.next_batch())
                if device.type == "cuda":
                    marks[i + 1].record()
                host.append(time.perf_counter())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                step_ms = [marks[i].elapsed_time(marks[i + 1]) for i in range(args.steps)]
            else:
                step_ms = [1e3 * (host[i + 1] - host[i]) for i in range(args.steps)]
            if timer is not None:
                timer.active = False
        loss_value = loss.float().item()
        overflow = sum(int(layer.dispatcher.pop_overflow().item()) for layer in trainer.moe_layers.values()
                       if hasattr(layer.dispatcher, "pop_overflow"))
        mine_step = sum(step_ms) / args.steps
        mine_a2a = timer.total_ms() / args.steps if timer is not None else math.nan
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
        step_max, a2a_max, mem_max, calls_max = _reduce(
            [mine_step, mine_a2a, mem, timer.calls / args.steps if timer else 0], dist.ReduceOp.MAX, device)
        step_mean, a2a_mean, share_mean, overflow_sum = _reduce(
            [mine_step / world, mine_a2a / world, mine_a2a / mine_step / world, float(overflow)],
            dist.ReduceOp.SUM, device)
    finally:
        del trainer, state
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    seq_len = cfg.data.seq_len
    tokens = cfg.data.global_batch_size * seq_len  # per optimizer step, all ranks
    step_s = step_max / 1e3  # the step ends when its slowest rank does
    tflops = model_tflops_per_device(cfg.model.flops_per_token(seq_len), tokens, step_s, world)
    peak = peak_tflops(device, cfg.trainer.peak_tflops)
    timed = timer is not None
    return {
        "variant": name,
        "overrides": overrides,
        "layout": {"pp": layout.pp, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard,
                   "ep": layout.ep, "ep_dispatch": str(resolve_dispatch(layout.ep_dispatch, layout.ep,
                                                                        cfg.model.moe.router.top_k if cfg.model.moe else None)),
                   "pp_schedule": str(layout.pp_schedule) if layout.pp > 1 else None,
                   "pp_microbatches": layout.pp_microbatches if layout.pp > 1 else None,
                   "pp_stages_per_rank": layout.pp_stages_per_rank if layout.pp > 1 else None},
        "bubble_theory": bubble_theory(layout),
        "bubble_measured": None,
        "gpus": world,
        "model": cfg.model.describe(),
        "seq_len": seq_len,
        "global_batch_size": cfg.data.global_batch_size,
        "tokens_per_step": tokens,
        "step_ms": step_max,
        "step_ms_mean_over_ranks": step_mean,
        "step_ms_per_step_rank0": step_ms,
        "tokens_per_s_per_gpu": tokens / step_s / world,
        "tflops_per_gpu": tflops,
        "mfu": None if peak is None else mfu(tflops, peak),
        "a2a_ms": a2a_mean if timed else None,
        "a2a_ms_max_rank": a2a_max if timed else None,
        "a2a_share": share_mean if timed else None,
        "a2a_calls_per_step": calls_max if timed else None,
        "overflow_rows": overflow_sum,  # rows sync_free or all_gather dropped for lack of room
        "peak_mem_gib": None if device.type != "cuda" else mem_max,
        "loss": loss_value,
    }


# ---------------------------------------------------------------------------------------------
# Environment, table, main
# ---------------------------------------------------------------------------------------------


def environment(device: torch.device, world: int, argv: list[str]) -> dict:
    return run_environment(device, world, "tools/bench_parallel.py", argv)


def print_table(env: dict, rows: list[dict]) -> None:
    print(f"{env['device']} x {env['world_size']} | torch {env['torch']} | cuda {env['cuda']} | {rows[0]['model']}")
    print(f"{'variant':<14} {'pp x dpr x dps':>14} {'ep':>3} {'GPUs':>4} {'tok/s/GPU':>10} {'TFLOP/s':>8} "
          f"{'MFU':>6} {'step ms':>9} {'a2a ms':>8} {'a2a %':>6} {'mem GiB':>8} {'bubble %':>8} {'theory %':>8}")
    for r in rows:
        lay = r["layout"]
        shape = f"{lay['pp']}x{lay['dp_replicate']}x{lay['dp_shard']}"
        mfu_s = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        a2a = f"{r['a2a_ms']:.1f}" if r["a2a_ms"] is not None else "-"
        share = f"{100 * r['a2a_share']:.1f}" if r["a2a_share"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        bub = f"{100 * r['bubble_measured']:.1f}" if r.get("bubble_measured") is not None else "-"
        theory = f"{100 * r['bubble_theory']:.1f}" if r.get("bubble_theory") is not None else "-"
        print(f"{r['variant']:<14} {shape:>14} {lay['ep']:>3} {r['gpus']:>4} {r['tokens_per_s_per_gpu']:>10,.0f} "
              f"{r['tflops_per_gpu']:>8.1f} {mfu_s:>6} {r['step_ms']:>9.1f} {a2a:>8} {share:>6} {mem:>8} {bub:>8} {theory:>8}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", default=None, help="model preset (olmoe-1b-7b, olmo3-moe-64e, tiny-moe ...)")
    parser.add_argument("--tokens-per-gpu", type=int, default=16384,
                        help="tokens per data-parallel rank per step (sets data.global_batch_size)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=[],
                        help="NAME:key=value[,key=value...]: overrides measured as one row each")
    parser.add_argument("--a2a-timing", action=argparse.BooleanOptionalAction, default=True,
                        help="time the expert all-to-alls (--no-a2a-timing: plain steps)")
    parser.add_argument("--bubble-baseline", default=None,
                        help="a pp=1 variant doing the same work per GPU: pipeline rows get a measured bubble")
    parser.add_argument("--json", default="runs/bench/bench_parallel.json")
    args, overrides = parser.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.tokens_per_gpu < 1:
        raise ConfigError("--steps must be >= 1, --warmup >= 0 and --tokens-per-gpu >= 1")
    variants = [split_variant(v) for v in args.variants] or [("base", [])]
    if args.bubble_baseline is not None:  # fail before measuring anything
        baseline_row(args.bubble_baseline, [{"variant": n, "layout": {"pp": 1}} for n, _ in variants])

    # The device and process group come from the base config (variants may not move the device).
    base = resolve_config(args, overrides, int(os.environ.get("WORLD_SIZE", 1)))
    device = pick_device(base.trainer.device)
    _, world = init_distributed(device)
    try:
        rows = []
        for name, extra in variants:
            rows.append(measure(name, overrides + extra, args, device, world))
            if is_main():
                print(f"  {name}: {rows[-1]['step_ms']:.1f} ms/step, loss {rows[-1]['loss']:.3f}", flush=True)
        add_measured_bubbles(rows, baseline_row(args.bubble_baseline, rows))
        if is_main():
            env = environment(device, world, argv)
            print_table(env, rows)
            write_report(args.json, env, rows)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    # Barrier, destroy, exit without the interpreter's teardown, where gloo's threads aborted finished
    # runs (SIGABRT, "terminate called without an active exception": session 17, and session 31's
    # two-node pretrain).
    finish_distributed()
    return 0


if __name__ == "__main__":
    run_cli(main)
