#!/usr/bin/env python
"""Where a training step's memory goes: a breakdown per variant, measured in one process.

For each --variant (a set of --model.* / --memory.* / --optimizer.* / --precision.* overrides, as in
tools/bench_train.py) it builds the same step as the benchmarks (tools/step_builder.py), trains a
few warm-up steps, then measures one more step with saved-tensor hooks and the CUDA allocator:

- parameters, gradients and optimizer state (bytes of the tensors themselves);
- activations saved for backward: every tensor autograd packs (torch.autograd.graph
  saved_tensors_hooks), counted once per storage, parameters excluded, attributed to the innermost
  module whose forward was running (its kind: Attention, RMSNorm, GroupedExperts, ...; under
  torch.compile, to the compiled block: the largest saved (shape, dtype) groups say what they are);
- on CUDA: memory allocated when the forward (and loss) ends, the step's peak
  (torch.cuda.max_memory_allocated), and what the named parts do not explain at the peak
  (temporaries, allocator rounding, the loss's buffers);
- tokens/s over --steps timed steps, so each switch reads as memory saved and speed lost.

    python tools/bench_memory.py --preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 \
        --seq-len 4096 --batch 4 --compile --variant base: --variant full:memory.recompute=full

Prints tables (GiB = 2^30 bytes; per-token figures in KiB) and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import time

import torch
from torch import nn

from moetron.core.memory import MemoryConfig
from moetron.core.optim import OptimizerConfig
from moetron.core.precision import PrecisionConfig
from moetron.core.trainer import TrainerConfig
from moetron.models import ModelConfig

from cli import run_cli, split_variant, write_report  # tools/cli.py
from step_builder import add_step_arguments, build_trainer, step_configs, token_stream  # tools/step_builder.py

GIB = 2**30


class SavedTensorLedger:
    """Bytes autograd saves for backward, by module (innermost module whose forward runs), counted
    once per storage; parameters (and views of them) are not activations and are skipped."""

    def __init__(self, model: nn.Module):
        self.names = {id(m): name or "<root>" for name, m in model.named_modules()}
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.by_module: dict[str, int] = collections.defaultdict(int)
        self.by_kind: dict[str, int] = collections.defaultdict(int)
        self.by_shape: dict[tuple, int] = collections.defaultdict(int)

    def _owner(self) -> nn.Module | None:
        # The nearest frame running a module's method (forward, or the compiled code that replaced
        # it); walking frames is slow but this runs only on the one measured step.
        frame = sys._getframe(2)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in self.names:
                return owner
            frame = frame.f_back
        return None

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self.param_storages and ptr not in self.seen:
            self.seen.add(ptr)
            nbytes = storage.nbytes()
            owner = self._owner()
            name = self.names[id(owner)] if owner is not None else "<outside modules>"
            self.by_module[name] += nbytes
            self.by_kind[type(owner).__name__ if owner is not None else "<outside modules>"] += nbytes
            self.by_shape[(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))] += nbytes
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def total(self) -> int:
        return sum(self.by_module.values())

    def by_layer(self) -> dict[str, int]:
        """Saved bytes per block ('blocks.3'), the rest under their top-level module."""
        out: dict[str, int] = collections.defaultdict(int)
        for name, nbytes in self.by_module.items():
            parts = name.split(".")
            out[".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 1 else parts[0]] += nbytes
        return dict(out)


def _nbytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _nbytes(v for state in optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.numel() > 1)


def measure(model_cfg: ModelConfig, memory: MemoryConfig, optimizer: OptimizerConfig, precision: PrecisionConfig,
            args, device: torch.device, data_overrides: list[str] = (), trainer_cfg: TrainerConfig | None = None) -> dict:
    cuda = device.type == "cuda"
    gc.collect()  # the previous variant's step (reference cycles) must be gone before the baseline
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
    data = token_stream(model_cfg, args.batch, args.seq_len, device, args.real_text, data_overrides)
    trainer = build_trainer(model_cfg, memory, data, device, seq_len=args.seq_len, precision=precision,
                            compile=args.compile, micro_batch=args.micro_batch, optimizer=optimizer,
                            trainer=trainer_cfg)
    model = trainer.model
    params = list(model.parameters())
    param_bytes = _nbytes(params)
    # As many as the params, in their dtype, or in their holder's (precision.expert_grads_bf16: bf16 copies).
    holder = getattr(trainer.optimizer, "gradient_holder", lambda p: None)
    grad_bytes = _nbytes(h if (h := holder(p)) is not None else p for p in params if p.requires_grad)
    for _ in range(args.warmup):
        trainer.train_step(data.next_batch())
    state_bytes = optimizer_state_bytes(trainer.optimizer)

    # The measured step: saved tensors recorded; allocated memory when the loss is computed.
    ledger = SavedTensorLedger(model)
    at_loss: list[int] = []

    def mark(*_):
        # The model's forward returns the loss (its own, fused or not): what is held when backward starts.
        if cuda:
            at_loss.append(torch.cuda.memory_allocated() - base)

    handle = model.register_forward_hook(mark)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with ledger.hooks():
        trainer.train_step(data.next_batch())
    handle.remove()
    peak = torch.cuda.max_memory_allocated() - base if cuda else None

    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss, _ = trainer.train_step(data.next_batch())
    loss.item()
    if cuda:
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / max(args.steps, 1)
    tokens = args.batch * args.seq_len
    saved = ledger.total()
    row = {
        "tokens": tokens,
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_state_bytes": state_bytes,
        "saved_activation_bytes": saved,
        "saved_per_token_per_layer_kib": saved / tokens / model_cfg.n_layers / 1024,
        "allocated_at_loss_bytes": max(at_loss) if at_loss else None,
        "peak_bytes": peak,
        "unexplained_at_peak_bytes": None if peak is None else peak - param_bytes - state_bytes - saved,
        "saved_by_kind": dict(ledger.by_kind),
        "saved_by_layer": ledger.by_layer(),
        "saved_top": [{"module": m, "shape": list(s), "dtype": d, "bytes": b}
                      for (m, s, d), b in sorted(ledger.by_shape.items(), key=lambda kv: -kv[1])[:args.top]],
        "step_s": step_s,
        "tokens_per_s": tokens / step_s if args.steps else None,
    }
    del trainer, model, params, ledger, data
    torch._dynamo.reset()  # compiled graphs (and what they hold) of this variant
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def _gib(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def print_report(rows: list[dict], n_layers: int) -> None:
    print(f"{'variant':<14} {'params':>7} {'grads':>7} {'optim':>7} {'saved':>7} {'KiB/tok/L':>9} "
          f"{'at loss':>8} {'peak':>7} {'other':>7} {'tok/s':>9}   (GiB)")
    for r in rows:
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
        print(f"{r['variant']:<14} {_gib(r['param_bytes']):>7} {_gib(r['grad_bytes']):>7} "
              f"{_gib(r['optimizer_state_bytes']):>7} {_gib(r['saved_activation_bytes']):>7} "
              f"{r['saved_per_token_per_layer_kib']:>9.1f} {_gib(r['allocated_at_loss_bytes']):>8} "
              f"{_gib(r['peak_bytes']):>7} {_gib(r['unexplained_at_peak_bytes']):>7} {tps:>9}")
    base = rows[0]
    if len(rows) > 1 and base["peak_bytes"] is not None:
        print(f"\nagainst {base['variant']}: peak saved (GiB) and speed lost")
        for r in rows[1:]:
            lost = 1 - r["tokens_per_s"] / base["tokens_per_s"] if r["tokens_per_s"] and base["tokens_per_s"] else None
            print(f"  {r['variant']:<14} {(base['peak_bytes'] - r['peak_bytes']) / GIB:>7.2f} GiB  "
                  f"{'-' if lost is None else f'{100 * lost:+.1f}%'} tok/s lost")
    for r in rows:
        tokens = r["tokens"]
        print(f"\n[{r['variant']}] saved for backward, KiB per token (per layer where a layer's):")
        kinds = sorted(r["saved_by_kind"].items(), key=lambda kv: -kv[1])
        print("  by module kind: " + ", ".join(f"{k} {v / tokens / 1024:.1f}" for k, v in kinds))
        layers = r["saved_by_layer"]
        print("  by layer:       " + ", ".join(f"{k} {v / tokens / 1024:.1f}" for k, v in layers.items()))
        print("  largest (module, shape, dtype):")
        for e in r["saved_top"]:
            print(f"    {e['module']:<36} {str(tuple(e['shape'])):<24} {e['dtype']:<9} {e['bytes'] / tokens / 1024:8.1f}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    add_step_arguments(parser)
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the measured one")
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring (compile, optimizer state)")
    parser.add_argument("--top", type=int, default=12, help="largest saved (module, shape, dtype) groups listed")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:key=value[,key=value...] overrides measured as one row")
    parser.add_argument("--json", default="runs/bench/bench_memory.json")
    args, overrides = parser.parse_known_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: the optimizer state exists only after a first step")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_cfg = step_configs(args.preset, args.precision, overrides, args.real_text).model  # bad input fails here
    # every variant's configs before the first is measured: bad input fails here too
    variants = [(name, variant, step_configs(args.preset, args.precision, overrides + variant, args.real_text))
                for name, variant in [split_variant(v) for v in args.variant] or [("base", [])]]
    for name, _, cfgs in variants:
        if cfgs.trainer.cuda_graph:
            parser.error(f"variant {name}: trainer.cuda_graph replays the step as a CUDA graph, which runs no autograd "
                         f"hook and allocates nothing, so this breakdown would read empty: take its peak from "
                         f"tools/bench_train.py")
    rows = []
    for name, variant, (model_cfg, memory, optimizer, precision, data_ovr, tcfg) in variants:
        rows.append({"variant": name, "overrides": variant, "precision": precision.to_dict(),  # as bench_train's
                     **measure(model_cfg, memory, optimizer, precision, args, device, data_ovr, tcfg)})
    from moetron.core.metrics import run_environment

    env = {**run_environment(device, 1, "tools/bench_memory.py", argv), "preset": args.preset,
           "seq_len": args.seq_len, "batch": args.batch, "compile": args.compile, "base_overrides": overrides}
    print(f"{env['device']} | torch {env['torch']} | {args.preset} {model_cfg.describe()} | "
          f"seq {args.seq_len} x {args.batch}{' | compiled' if args.compile else ''}")
    print_report(rows, model_cfg.n_layers)
    write_report(args.json, env, rows)
    return 0


if __name__ == "__main__":
    run_cli(main)
