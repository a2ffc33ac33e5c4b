#!/usr/bin/env python
"""One rank's share of a big expert- and pipeline-parallel layout, on one GPU: forward + backward.

The slice of ``--preset`` (default moe-1t) under ``--ep`` x ``--pp`` is ``--layers`` consecutive MoE
blocks of one pipeline stage at full width (attention, norms, router over all E experts, the shared
expert), the rank's E/ep experts at full width, and one micro-batch of ``--micro-batch`` sequences
of ``--seq-len``. Tokens arrive at the local experts as the all-to-all would deliver them: the
rank's T tokens x K slots, the slots of every rank being alike on average (T x K rows for the E/ep
local experts), split over the local experts ``uniform``ly or ``skewed`` (a Zipf-like 1/(rank+1)
load). The all-to-all itself is not run (its time is the planner's communication term). Weights in
bf16 as FSDP2 hands them over, bf16 autocast; no optimizer step.

    python tools/bench_slice.py --preset moe-1t --ep 8 --pp 8 --layers 2 --seq-len 8192
    python tools/bench_slice.py ... --variant none:memory.recompute=none --variant full:memory.recompute=full

Model FLOPs are the project's count (ModelConfig.block_flops_per_token: 6 x active params +
attention) for the slice's blocks and tokens; TFLOP/s per GPU and peak memory are printed as a table
and written as JSON, each row beside the planner's prediction for the same slice (tools/plan.py
plan_slice, bf16 on ``--gpu``, default this machine's GPU, else h200: step ms, TFLOP/s, peak GiB and their errors, planned /
measured - 1). ``--tiny`` shrinks every width for a CPU run (tests).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
from torch import nn

from moetron.core.config import ConfigError
from moetron.core.memory import MemoryConfig
from moetron.core.metrics import run_environment
from moetron.core.moe import MoESpec
from moetron.core.moe.dispatcher import DispatchResult, TokenDispatcher
from moetron.core.moe.experts import GroupedExperts
from moetron.core.moe.kernels.ops import combine_rows, scatter_rows
from moetron.core.precision import PrecisionConfig
from moetron.models import ModelConfig
from moetron.models.transformer import Block

from cli import run_cli, split_variant, write_report  # tools/cli.py
from plan import GPUS, gpu_of, plan_slice, slice_layers  # tools/plan.py


class ArrivingRows(TokenDispatcher):
    """The rows an all-to-all would hand this rank: every slot (t, k) of the micro-batch becomes one
    row of a local expert, rows grouped by local expert with the given counts (they sum to T*K)."""

    def __init__(self, counts_L: torch.Tensor, num_tokens: int, top_k: int, seed: int = 0):
        self.num_local_experts = counts_L.numel()
        g = torch.Generator().manual_seed(seed)
        rows_N = torch.randperm(num_tokens * top_k, generator=g)  # slot -> row, a fixed shuffle
        self.dest_row_TK = rows_N.view(num_tokens, top_k).to(torch.int32)
        self.offsets_L = counts_L.cumsum(0).to(torch.int32)
        self.num_rows = num_tokens * top_k

    def to(self, device) -> "ArrivingRows":
        self.dest_row_TK, self.offsets_L = self.dest_row_TK.to(device), self.offsets_L.to(device)
        return self

    def dispatch(self, x_TD, topk_ids_TK, num_experts, capacity):
        x_RD = scatter_rows(x_TD, self.dest_row_TK, self.num_rows)
        counts_E = torch.zeros(num_experts, dtype=torch.int32, device=x_TD.device)
        return DispatchResult(x_RD, self.offsets_L, counts_E, counts_E, None)

    def combine(self, y_RD, topk_weights_TK, result):
        return combine_rows(y_RD, self.dest_row_TK, topk_weights_TK)


def local_counts(num_rows: int, num_local: int, load: str) -> torch.Tensor:
    """Rows per local expert, summing to num_rows: equal, or proportional to 1/(rank+1)."""
    if load == "uniform":
        share = torch.ones(num_local, dtype=torch.float64)
    elif load == "skewed":
        share = 1.0 / torch.arange(1, num_local + 1, dtype=torch.float64)
    else:
        raise ConfigError(f"--load must be uniform or skewed, got {load!r}")
    counts = torch.floor(share / share.sum() * num_rows).long()
    counts[0] += num_rows - counts.sum()
    return counts


def slice_config(args) -> tuple[ModelConfig, int]:
    cfg = ModelConfig.preset(args.preset)
    if args.tiny:
        cfg.d_model, cfg.vocab_size = 64, 256
        cfg.attention.n_heads, cfg.attention.n_kv_heads, cfg.attention.head_dim = 4, 2, 16
        cfg.moe.expert_hidden, cfg.moe.shared_expert_hidden = 32, None
    _, local = slice_layers(cfg, args.ep, args.pp, args.layers, args.preset)  # the planner's checks and blocks
    return cfg, local


class Stage(nn.Module):
    def __init__(self, blocks: dict[str, nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleDict(blocks)

    def forward(self, h):
        for block in self.blocks.values():
            h = block(h)
        return h


def measure(cfg: ModelConfig, local: int, memory: MemoryConfig, recipe: PrecisionConfig, args,
            device: torch.device) -> dict:
    T = args.micro_batch * args.seq_len
    K = cfg.moe.router.top_k
    counts = local_counts(T * K, local, args.load)
    dispatcher = ArrivingRows(counts, T, K).to(device)
    spec = MoESpec.from_config(cfg.moe)
    spec = MoESpec(router=spec.router, dispatcher=lambda E: dispatcher,
                   experts=lambda E, d, F, backend, dev: GroupedExperts(local, d, F, backend, dev))
    moe_layers, _ = slice_layers(cfg, args.ep, args.pp, args.layers, args.preset)
    torch.manual_seed(0)
    blocks = {}
    for i in moe_layers:
        block = Block(cfg, i, device=device, moe_spec=spec)
        block.mlp.init_weights(cfg.init_std)
        blocks[str(i)] = block
    stage = Stage(blocks).to(torch.bfloat16)
    precision = recipe.build(device)
    precision.apply(stage)
    memory.apply(stage)
    if args.compile:
        for block in stage.blocks.values():
            block.compile()
    stage.train()
    dtype = torch.bfloat16
    x = torch.randn(args.micro_batch, args.seq_len, cfg.d_model, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        with precision.autocast():
            y = stage(x)
        y.backward(dy)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    flops = sum(cfg.block_flops_per_token(i, args.seq_len) for i in moe_layers) * T
    return {
        "layers": moe_layers, "local_experts": local, "tokens": T, "rows": T * K,
        "rows_per_local_expert": counts.tolist(),
        "step_s": dt, "tflops_per_gpu": flops / dt / 1e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }


def planned(cfg: ModelConfig, memory: MemoryConfig, recipe: PrecisionConfig, args, row: dict) -> dict:
    """The planner's figures for the slice just measured (tools/plan.py plan_slice, ``--gpu``)
    and the errors planned / measured - 1 (None where nothing was measured: peak memory off CUDA)."""
    p = plan_slice(copy.deepcopy(cfg), row["layers"], ep=args.ep, seq_len=args.seq_len, micro_batch=args.micro_batch,
                   memory=memory, compiled=args.compile, gpu=args.gpu,
                   precision=recipe if recipe.recipe not in ("auto", "fp32") else None)

    def error(planned_value, measured):
        return planned_value / measured - 1 if measured else None
    return {"planned_step_s": p["step_s"], "planned_tflops_per_gpu": p["tflops_per_gpu"],
            "planned_peak_mem_gib": p["peak_gib"], "planned_peak_at": p["peak_at"], "planned_parts_s": p["parts_s"],
            "step_error": error(p["step_s"], row["step_s"]), "tflops_error": error(p["tflops_per_gpu"], row["tflops_per_gpu"]),
            "peak_error": error(p["peak_gib"], row["peak_mem_gib"])}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", default="moe-1t")
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2, help="MoE blocks of the stage to run (memory bounds it)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--load", default="uniform", help="uniform or skewed rows over the local experts")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--tiny", action="store_true", help="small widths, for a CPU run")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:memory.key=value[,precision.key=value...] (e.g. fp8:precision.recipe=fp8_blockwise)")
    parser.add_argument("--gpu", default=None, choices=tuple(GPUS),
                        help="the GPU the planned columns are for (tools/plan.py's table; default: this machine's, "
                             "else h200)")
    parser.add_argument("--json", default="runs/bench/bench_slice.json")
    args = parser.parse_args(argv)
    cfg, local = slice_config(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.gpu is None:  # plan for the GPU that runs the slice (session 38 planned its H100 slice as an H200)
        args.gpu = (gpu_of(torch.cuda.get_device_name()) if device.type == "cuda" else None) or "h200"
    rows = []
    for name, ovr in [split_variant(v) for v in args.variant] or [("base", [])]:
        memory = MemoryConfig()
        recipe = PrecisionConfig(recipe="bf16" if device.type == "cuda" else "fp32")
        bad = [o for o in ovr if not o.startswith(("--memory.", "--precision."))]
        if bad:
            raise ConfigError(f"variant overrides are --memory.* and --precision.* fields, got {bad}")
        memory.apply_overrides([o[len("--memory."):] for o in ovr if o.startswith("--memory.")])
        recipe.apply_overrides([o[len("--precision."):] for o in ovr if o.startswith("--precision.")])
        memory.validate()
        recipe.validate()
        row = {"variant": name, "overrides": ovr, "recipe": str(recipe.resolved_recipe(device.type)),
               **measure(copy.deepcopy(cfg), local, memory, recipe, args, device)}
        rows.append({**row, **planned(cfg, memory, recipe, args, row)})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    env = {**run_environment(device, 1, "tools/bench_slice.py", argv), "preset": args.preset, "ep": args.ep,
           "pp": args.pp, "seq_len": args.seq_len, "micro_batch": args.micro_batch, "load": args.load,
           "compile": args.compile}
    print(f"{env['device']} | torch {env['torch']} | {args.preset} slice: {len(rows[0]['layers'])} MoE blocks, "
          f"{local} local experts, {rows[0]['tokens']} tokens ({rows[0]['rows']} expert rows, {args.load})")
    print(f"planned: tools/plan.py --slice for {args.gpu}, each row's recipe; err = planned / measured - 1")
    print(f"{'variant':<12} {'step ms':>9} {'TFLOP/s':>9} {'mem GiB':>8} | {'plan ms':>9} {'err':>7} {'plan TF/s':>9} "
          f"{'err':>7} {'plan GiB':>8} {'err':>7}")

    def err(x):
        return f"{100 * x:+6.1f}%" if x is not None else "-"
    for r in rows:
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        print(f"{r['variant']:<12} {1e3 * r['step_s']:>9.1f} {r['tflops_per_gpu']:>9.1f} {mem:>8} | "
              f"{1e3 * r['planned_step_s']:>9.1f} {err(r['step_error']):>7} {r['planned_tflops_per_gpu']:>9.1f} "
              f"{err(r['tflops_error']):>7} {r['planned_peak_mem_gib']:>8.1f} {err(r['peak_error']):>7}")
    write_report(args.json, env, rows)
    return 0


if __name__ == "__main__":
    run_cli(main)
