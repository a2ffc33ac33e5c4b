#!/usr/bin/env python
"""Plan a run before launching it: memory per rank, communication, step time and TFLOP/s per GPU.

Prints a table and writes JSON. Everything is computed from the configs (nothing is built):
parameters from ModelConfig.num_params / num_block_params, FLOPs from ModelConfig.flops_per_token,
the layout from ParallelConfig.resolve (the same ConfigError as pretrain for a bad layout). The
switches are read from the same config fields pretrain takes: --model.fused_loss,
--model.loss_chunk_tokens, --optimizer.state_dtype, --parallel.fsdp_offload, --trainer.grad_sync, --trainer.deterministic,
--precision.recipe /
.backend / .modules (--precision NAME is short for --precision.recipe=NAME; fp8 = mxfp8), fp8_rowwise's
--precision.fp8_fast_accum / .fp8_wgrad / .fp8_fused_amax, --precision.expert_weight_copies /
.expert_grads_bf16 (bf16, fp8_rowwise, the emulated backend), --memory.*.

    python tools/plan.py --preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 \
        --seq-len 4096 --global-batch 4 --gpu h200 --num-gpus 1 --compile
    python tools/plan.py --preset moe-1t --gpu b300 --num-gpus 512 --parallel.ep=8 --parallel.pp=8 \
        --seq-len 8192 --global-batch 8192 --micro-batch 1 --precision.recipe=mxfp8 --memory.recompute=full
    python tools/plan.py --preset moe-1t --gpu h200 --num-gpus 512 --seq-len 8192 --global-batch 8192 --search
    python tools/plan.py --validate runs/bench/bench_train.json runs/bench/bench_memory.json
    python tools/plan.py --slice --layers 2 --preset moe-1t --parallel.ep=8 --parallel.pp=8 --seq-len 8192 \
        --gpu h200 --eager --memory.recompute=full

--slice: what tools/bench_slice.py measures (one rank's --layers MoE blocks with E/ep local
experts, one micro-batch, bf16 weights and grads, forward + backward; no all-to-all, optimizer or
bubble), planned from the same model: see plan_slice.

--validate FILE.json ...: for every row of tools/bench_train.py / tools/bench_memory.py reports (the
preset, the command's base overrides and the row's overrides, on --gpu h200 --num-gpus 1), the
measured against the planned peak and step time (targets: peak within 10%, step within 20%). A row
that recorded its precision section (every field, as it ran: reports since session 29) is replayed
with it; an older row with the precision defaults of its day (CHANGED_DEFAULTS: e.g.
precision.quantize_input_once was false before session 29, auto since). A row that recorded its optimizer
section (since session 51) is replayed with that too; an older one with the optimizer defaults of its day
(CHANGED_OPTIMIZER_DEFAULTS: optimizer.split_master off before session 52).

mxfp8 emulated is planned with the fused rows-and-columns quantization unless MOETRON_MX_FUSED=0 is
set, as for a run (or recorded in a report's env_vars): `MOETRON_MX_FUSED=0 python tools/plan.py ...`.

The model and its sources: moetron/run/planner/ (model.py says where each term comes from).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

from moetron.core.config import ConfigError
from moetron.core.memory import MemoryConfig
from moetron.core.optim import OptimizerConfig
from moetron.core.precision import PrecisionConfig, PrecisionRecipe
from moetron.core.precision.config import copies_off_overrides
from moetron.core.trainer import GradSync, TrainerConfig
from moetron.models import ModelConfig
from moetron.parallel.config import ParallelConfig
from moetron.run.planner.hardware import GPUS, GiB, gpu_of
# The model lives in moetron.run.planner; these names are re-exported for tools/bench_slice.py and the tests.
from moetron.run.planner.model import Plan, Switches, activation_terms, plan, plan_slice, search, slice_layers  # noqa: F401

from cli import run_cli, write_report  # tools/cli.py
from step_builder import STEP_TRAINER_FIELDS, step_trainer  # tools/step_builder.py


def print_slice(r: dict, cfg: ModelConfig) -> None:
    print(f"slice of {cfg.describe()} | {r['gpu']} | {r['recipe']} | {'compiled' if r['compiled'] else 'eager'} | "
          f"recompute {r['recompute']} | blocks {r['layers']}, {r['local_experts']} local experts, "
          f"{r['tokens']} tokens ({r['rows']} expert rows)")
    print(f"memory, GiB: weights {r['weights_gib']:.2f} (bf16, {r['params'] / 1e9:.3f}B params) + grads "
          f"{r['grads_gib']:.2f} (bf16) + x/dx/y/dy {r['io_gib']:.2f}"
          + (f" + weight cache {r['weight_cache_gib']:.2f}" if r["weight_cache_gib"] else "")
          + f" + activations held {r['held_at_peak_gib']:.2f} "
          f"(all saved {r['activations_gib']:.2f}) + backward transient {r['backward_transient_gib']:.2f} "
          f"= peak {r['peak_gib']:.2f} (at {r['peak_at']})")
    print(f"step {1e3 * r['step_s']:.1f} ms (" + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r["parts_s"].items())
          + f") | {r['tflops_per_gpu']:.1f} TFLOP/s/GPU | MFU(bf16) {100 * r['mfu_bf16']:.1f}% | "
          "no all-to-all, no optimizer, no bubble")


def _row(r: dict) -> str:
    lay = r["layout"]
    copies = ("copies+split" if r.get("split_master") else "copies") if r["weight_copies"] else ""
    return (f"ep {lay['ep']:>3} pp {lay['pp']:>3} dp_shard {lay['dp_shard']:>4} mb {r['micro_batch']:>2} "
            f"acc {r['grad_accum']:>4} {r['recompute']:<5} {copies:<12} | peak {r['peak_gib']:7.1f} GiB | step {r['step_s']:8.3f} s | "
            f"{r['tflops_per_gpu']:6.1f} TFLOP/s/GPU | {'fits' if r['fits'] else 'DOES NOT FIT'}; "
            f"limit: {r['tightest']}")


def print_plan(r: dict) -> None:
    lay = r["layout"]
    print(f"{r['model']} | {r['num_gpus']} x {r['gpu']} | {r['precision']} ({r['precision_note']}) | "
          f"{'compiled' if r['compiled'] else 'eager'} | recompute {r['recompute']} | "
          f"{'fused' if r['fused_loss'] else 'plain'} loss | Adam state {r['state_dtype']}"
          f"{' | fsdp_offload' if r['fsdp_offload'] else ''}{' | deterministic' if r.get('deterministic') else ''}")
    print(f"layout dp_replicate {lay['dp_replicate']} x dp_shard {lay['dp_shard']} (ep {lay['ep']} x efsdp "
          f"{lay['efsdp']}) x pp {lay['pp']} | seq {r['seq_len']} x {r['global_batch']} | micro-batch "
          f"{r['micro_batch']} x {r['grad_accum']}" + (" | grads reduced once per step" if r["grad_sync"] == "step" else ""))
    s = r["stages"][r["tight_stage"]]
    print(f"memory per rank (stage {s['stage']}, {s['layers']} blocks), GiB:")
    for key in ("params", "grads", "optimizer", "compute_copies", "activations", "loss", "comm_buffers", "peak"):
        print(f"  {key:<16} {s[key + '_gib']:9.2f}" + (f"   (at {s['peak_at']})" if key == "peak" else ""))
    if r["fsdp_offload"]:
        print(f"  {'host (offload)':<16} {s['host_gib']:9.2f}   params + grads + optimizer state in host memory")
    print(f"  {'usable':<16} {r['usable_gib']:9.2f}   -> {'fits' if r['fits'] else 'DOES NOT FIT'}")
    if r.get("peak_without_auto_copies_gib") is not None:
        off = r["peak_without_auto_copies_gib"]
        print(f"  the optimizer's weight copies (precision.*_copies auto: on for one GPU, one micro-batch) hold the "
              f"difference: without them the peak is {off:.2f} GiB ({'fits' if off <= r['usable_gib'] else 'still over'}): "
              f"{' '.join(copies_off_overrides())}")
    print(f"FLOPs/step {r['flops_per_step']:.4g}  ({r['flops_per_token']:.4g} per token)")
    print("bytes/step per rank: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in r["bytes_per_step"].items()))
    print(f"step {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU | "
          f"{r['tflops_per_gpu']:.1f} TFLOP/s/GPU | MFU(bf16) {100 * r['mfu_bf16']:.1f}% | bubble {100 * r['bubble']:.1f}%")
    print("time shares: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in r["time_share"].items()))
    print(f"overlap: {r['overlap']}")
    if r["assumptions"]:
        print(f"assumed: {r['assumptions']}")
    print(f"tightest resource: {r['tightest']}")




SECTIONS = ("model", "parallel", "memory", "optimizer", "precision")
"""Config sections a plan takes --<section>.field=value overrides for (pretrain's names)."""
PRECISION_FLAG = {"fp8": "mxfp8"}
"""--precision NAME is --precision.recipe=NAME; fp8 (the planner's older name) means mxfp8."""


@dataclasses.dataclass
class Configs:
    """The config sections of one plan, before overrides."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)

    def apply(self, overrides: list[str]) -> None:
        """--<section>.field=value overrides onto the sections (ConfigError for anything else)."""
        bad = [a for a in overrides if not (a.startswith(tuple(f"--{s}." for s in SECTIONS)) and "=" in a)]
        if bad:
            raise ConfigError(f"unrecognized arguments {bad}: overrides are "
                              f"{', '.join(f'--{s}.*' for s in SECTIONS)} =value")
        for name in SECTIONS:
            prefix = f"--{name}."
            getattr(self, name).apply_overrides([a[len(prefix):] for a in overrides if a.startswith(prefix)])


def parse(argv: list[str]) -> tuple[Plan, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", default=None, help="model preset (see models/config.py PRESETS)")
    parser.add_argument("--config", default=None,
                        help="a run YAML (model, parallel, memory, optimizer, precision sections are read)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch per rank")
    parser.add_argument("--precision", default=None, choices=("auto", "bf16", "mxfp8", "fp8_blockwise", "fp8"),
                        help="short for --precision.recipe (fp8 = mxfp8); default bf16")
    parser.add_argument("--eager", action="store_true", help="no torch.compile (default: compiled blocks)")
    parser.add_argument("--compile", action="store_true", help="compiled blocks (the default)")
    parser.add_argument("--gpu", default="h200", choices=tuple(GPUS))
    parser.add_argument("--num-gpus", type=int, default=1)
    parser.add_argument("--trainer.grad_sync", dest="grad_sync", default=str(GradSync.micro_batch),
                        choices=[str(g) for g in GradSync],
                        help="when FSDP2 reduces gradients under accumulation (pretrain's trainer.grad_sync)")
    parser.add_argument("--trainer.deterministic", dest="deterministic", default=None, choices=("true", "false"),
                        help="plan pretrain's trainer.deterministic (attention on torch's deterministic kernels)")
    parser.add_argument("--search", action="store_true", help="list the fastest layouts that fit")
    parser.add_argument("--slice", action="store_true",
                        help="plan tools/bench_slice.py's slice: --layers MoE blocks of one stage under "
                             "--parallel.ep / --parallel.pp, one micro-batch (--micro-batch, default 1) on one GPU")
    parser.add_argument("--layers", type=int, default=2, help="--slice: MoE blocks of the stage (bench_slice's --layers)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--validate", nargs="+", default=None, metavar="FILE.json",
                        help="planned vs measured for every row of bench_train / bench_memory reports")
    parser.add_argument("--json", default="runs/plan/plan.json")
    args, rest = parser.parse_known_args(argv)
    configs = Configs(precision=PrecisionConfig(recipe=PrecisionRecipe.bf16))
    seq, batch, trainer = 4096, 4, TrainerConfig()
    if args.config:
        import yaml

        with open(args.config, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        configs = Configs(**{name: type(getattr(configs, name)).from_dict(raw.get(name, {}), prefix=name)
                             for name in SECTIONS})
        if "precision" not in raw:
            configs.precision.recipe = PrecisionRecipe.bf16
        seq = raw.get("data", {}).get("seq_len", seq)
        batch = raw.get("data", {}).get("global_batch_size", batch)
        trainer = TrainerConfig.from_dict(raw.get("trainer", {}), prefix="trainer")
    if args.deterministic is not None:  # the flag over the YAML's, parsed as pretrain parses it
        trainer.apply_overrides([f"--deterministic={args.deterministic}"])
    if args.preset:
        configs.model = ModelConfig.preset(args.preset)
    if args.precision:
        configs.precision.recipe = PrecisionRecipe(PRECISION_FLAG.get(args.precision, args.precision))
    configs.apply(rest)
    p = Plan(model=configs.model, parallel=configs.parallel, memory=configs.memory, seq_len=args.seq_len or seq,
             global_batch=args.global_batch or batch, micro_batch=args.micro_batch or trainer.micro_batch_size,
             precision=configs.precision, optimizer=configs.optimizer, compiled=not args.eager, gpu=args.gpu,
             num_gpus=args.num_gpus, grad_sync=GradSync(args.grad_sync),
             deterministic=trainer.deterministic)
    return p, args


# ---- --validate: planned against measured ---------------------------------------------------------

PEAK_TARGET, STEP_TARGET = 0.10, 0.20
"""Planned within 10% of the measured peak and 20% of the measured step time (the 1.2T recipe issue)."""


def _bench_argv(env: dict) -> list[str]:
    """The benchmark's own arguments from its report's env (``command``: 'python tools/bench_x.py ...',
    or torchrun's shape; ``argv`` where a report has it)."""
    if isinstance(env.get("argv"), list):
        return [str(a) for a in env["argv"]]
    words = shlex.split(env.get("command", ""))
    for i, w in enumerate(words):
        if w.endswith(".py"):
            return words[i + 1:]
    return []


# Precision defaults changed before reports recorded their rows' precision sections: (the change's
# date, the old default as an override). A row without a recorded section, in a report dated before a
# change (env.date; a report without one counts as older), is replayed with the old default its run
# had, unless its command or the row sets the field itself. Rows that record their section need none.
CHANGED_DEFAULTS = [("2026-12-05 14:45:00", "--precision.quantize_input_once=false"),  # then auto (session 29)
                    # the optimizer's weight copies: auto (on for bf16 on one GPU, one micro-batch) since session 50
                    *[("2026-12-07 09:00:00", off) for off in copies_off_overrides()]]

# Optimizer defaults that changed: (the change's date, the old default as an override), as CHANGED_DEFAULTS for rows
# that record no optimizer section (bench_train records it since session 51). optimizer.split_master became auto, on
# with the weight copies, in session 52; before session 51 it had no auto.
CHANGED_OPTIMIZER_DEFAULTS = [("2026-12-07 11:43:58", "--optimizer.split_master=false")]  # 2b3c1fa

# Model defaults that changed (reports record no model section): (the change's date, the override that
# gives the old default). A report dated before it replays with the old default unless its row names the
# field. model.triton_rope and model.triton_rmsnorm (eager steps' Triton passes) turned on in sessions 44-45.
CHANGED_MODEL_DEFAULTS = [("2026-12-06 19:20:52", "--model.triton_rope=false"),
                          ("2026-12-06 21:51:33", "--model.triton_rmsnorm=false")]

# The tables above by the section a row may record (bench_train records precision since session 29, optimizer since
# session 51, model never): a recorded section replays as it ran, so its table does not apply.
CHANGED_BY_SECTION = (("precision", CHANGED_DEFAULTS), ("model", CHANGED_MODEL_DEFAULTS),
                      ("optimizer", CHANGED_OPTIMIZER_DEFAULTS))

# What ``auto`` resolved to changed after reports recorded their sections: (the change's date, the recipe,
# the field, what auto meant before). A row of that recipe (not on the emulated backend) whose field is
# auto, in a report dated before the change, is replayed with the old meaning, recorded section or not.
CHANGED_AUTO = [("2026-12-06 06:55:45", PrecisionRecipe.fp8_blockwise, "fp8_experts", "triton"),
                ("2026-12-06 08:00:00", PrecisionRecipe.fp8_blockwise, "quantize_input_once", "false"),
                ("2026-12-07 00:30:00", PrecisionRecipe.bf16, "bf16_residual", "false")]
# native fp8_blockwise's experts became the Gluon kernels on SM90 in session 37 (3224d53: fp8_experts=auto, the
# Triton kernels before); it took the shared quantized input in session 38 (ae28db6; call 4 was its first report);
# bf16's residual stream became bf16 in session 46 (precision.bf16_residual=auto; a bool, false, before, and
# absent from the sections recorded before session 45). The recipe compared is the one a GPU resolves (auto: bf16).


def bench_plan(env: dict, row: dict) -> Plan:
    """The Plan of one benchmark row on one GPU of the kind its report ran on (the report's ``device``; an
    H200 where none is recorded or the planner does not know it: the machine of the first sessions): the
    preset, the command's base overrides, the row's overrides, its seq_len / batch / micro-batch /
    precision / compile flags; the precision section the row recorded, or for an older row the precision
    defaults of its report's day (CHANGED_DEFAULTS)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    parser.add_argument("--preset", default=env.get("preset", "tiny"))
    parser.add_argument("--seq-len", type=int, default=env.get("seq_len", 4096))
    parser.add_argument("--batch", type=int, default=env.get("batch", 2))
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--compile", action="store_true", default=bool(env.get("compile", False)))
    parser.add_argument("--variant", action="append", default=[])
    for flag in ("--steps", "--warmup", "--json", "--peak-tflops", "--top"):
        parser.add_argument(flag)
    parser.add_argument("--real-text", action="store_true")
    args, overrides = parser.parse_known_args(_bench_argv(env))
    configs = Configs(model=ModelConfig.preset(args.preset),
                      precision=PrecisionConfig(recipe=PrecisionRecipe(PRECISION_FLAG.get(args.precision, args.precision))))
    recorded, date = row.get("precision"), str(env.get("date", ""))
    then = [old for section, changed in CHANGED_BY_SECTION if not row.get(section)
            for since, old in changed if date < since]
    given = [o for o in overrides if o.startswith("--")] + list(row.get("overrides", []))
    # The step's trainer switches (tools/step_builder.py STEP_TRAINER_FIELDS) plan as the step without
    # them, but for trainer.deterministic's attention kernels (Plan.deterministic): trainer.cuda_graph replays
    # the same kernels from memory allocated as the eager step's (measured +0.0-0.1 GiB, session 39);
    # grad_clip moves no bytes. Session 52's deterministic rows ran with torch's fill of uninitialized memory
    # (15 ms of OLMoE-8L's step, off since session 53), which is not modelled.
    step_args = [o for o in given if o.startswith(tuple(f"--trainer.{f}=" for f in STEP_TRAINER_FIELDS))]
    trainer = step_trainer([o.removeprefix("--trainer.") for o in step_args])
    configs.apply(then + [o for o in given if o not in step_args])
    if recorded:
        configs.precision = PrecisionConfig.from_dict(recorded)
    if row.get("optimizer"):
        configs.optimizer = OptimizerConfig.from_dict(row["optimizer"])
    for since, recipe, field, before in CHANGED_AUTO:
        p = configs.precision  # as the entries before this one left it
        if (str(env.get("date", "")) < since and p.resolved_recipe("cuda") == recipe and str(p.backend) != "emulated"
                and str(getattr(p, field)) == "auto"):
            configs.precision = dataclasses.replace(p, **{field: type(getattr(p, field))(before)})
    # MOETRON_MX_FUSED where the report recorded it (its env_vars), else as this process has it
    fused = env.get("env_vars", {}).get("MOETRON_MX_FUSED")
    return Plan(model=configs.model, parallel=configs.parallel, memory=configs.memory, seq_len=args.seq_len,
                global_batch=args.batch, micro_batch=args.micro_batch, precision=configs.precision,
                optimizer=configs.optimizer, compiled=args.compile, gpu=gpu_of(env.get("device")) or "h200", num_gpus=1,
                deterministic=trainer.deterministic, mx_fused=None if fused is None else fused != "0")


def _error(planned: float, measured: float | None) -> float | None:
    return None if not measured else planned / measured - 1


def validate(paths: list[str]) -> list[dict]:
    """One row per benchmark row of the reports at ``paths``: measured and planned peak GiB and step ms,
    errors (planned / measured - 1) and whether each target is met."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        if not isinstance(report, dict) or not isinstance(report.get("rows", []), list):
            # a JSON that is not a bench_train / bench_memory report (a planner's, a peer's): said, not replayed
            out.append({"file": path, "variant": "(file)", "overrides": [],
                        "not_replayed": "not a bench_train / bench_memory report (a mapping with env and rows)"})
            continue
        env = report.get("env", {})
        for row in report.get("rows", []):
            try:
                b = bench_plan(env, row)
                r = plan(b)
            except ConfigError as e:  # a switch since removed or renamed, an unknown flag: say so, go on
                out.append({"file": path, "variant": row.get("variant", ""), "overrides": row.get("overrides", []),
                            "not_replayed": str(e)})
                continue
            if row.get("peak_mem_gib") is not None:
                peak = float(row["peak_mem_gib"])
            elif row.get("peak_bytes") is not None:
                peak = row["peak_bytes"] / GiB
            else:
                peak = None
            step_ms = 1e3 * row["step_s"] if row.get("step_s") else None
            peak_err, step_err = _error(r["peak_gib"], peak), _error(1e3 * r["step_s"], step_ms)
            out.append({"file": path, "variant": row.get("variant", ""), "overrides": row.get("overrides", []), "gpu": b.gpu,
                        "compiled": r["compiled"], "measured_peak_gib": peak, "planned_peak_gib": r["peak_gib"],
                        "peak_error": peak_err, "planned_peak_at": r["peak_at"], "measured_step_ms": step_ms,
                        "planned_step_ms": 1e3 * r["step_s"], "step_error": step_err,
                        "peak_met": None if peak_err is None else abs(peak_err) <= PEAK_TARGET,
                        "step_met": None if step_err is None else abs(step_err) <= STEP_TARGET})
    return out


def print_validation(rows: list[dict]) -> None:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    def met(x):
        return "-" if x is None else ("met" if x else "missed")

    print(f"{'row':<28} {'gpu':<5} {'peak GiB':>9} {'planned':>8} {'error':>7} {'step ms':>9} {'planned':>8} {'error':>7}  "
          f"target (peak 10% / step 20%)")
    for r in rows:
        if "not_replayed" in r:
            print(f"{r['variant']:<28} not replayed ({r['file']}): {r['not_replayed']}")
            continue
        name = f"{r['variant']} ({'compiled' if r['compiled'] else 'eager'})"
        print(f"{name:<28} {r['gpu']:<5} {num(r['measured_peak_gib'], '9.2f')} {r['planned_peak_gib']:8.2f} "
              f"{num(None if r['peak_error'] is None else 100 * r['peak_error'], '+6.1f')}% "
              f"{num(r['measured_step_ms'], '9.1f')} {r['planned_step_ms']:8.1f} "
              f"{num(None if r['step_error'] is None else 100 * r['step_error'], '+6.1f')}%  "
              f"{met(r['peak_met'])} / {met(r['step_met'])}")
    both = [r for r in rows if r.get("peak_met") is not None and r.get("step_met") is not None]
    print(f"{sum(r['peak_met'] and r['step_met'] for r in both)} of {len(both)} rows meet both targets")
    steps = [abs(r["step_error"]) for r in rows if r.get("step_error") is not None]
    if steps:
        print(f"step error: mean absolute {100 * sum(steps) / len(steps):.2f}% over {len(steps)} rows, "
              f"{sum(e <= STEP_TARGET for e in steps)} within {100 * STEP_TARGET:.0f}%")
    skipped = sum("not_replayed" in r for r in rows)
    if skipped:
        print(f"{skipped} rows not replayed (their commands or overrides no longer parse)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p, args = parse(argv)
    env = {"tool": "tools/plan.py", "argv": argv}
    if args.validate:
        rows = validate(args.validate)
        print_validation(rows)
    elif args.slice:
        layers, _ = slice_layers(p.model, p.parallel.ep, p.parallel.pp, args.layers, args.preset or "the model")
        rows = [plan_slice(p.model, layers, ep=p.parallel.ep, seq_len=p.seq_len, micro_batch=p.micro_batch or 1,
                           memory=p.memory, compiled=p.compiled, gpu=p.gpu, precision=p.precision)]
        print_slice(rows[0], p.model)
    elif args.search:
        rows = search(p, args.top)
        print(f"fastest layouts that fit {p.num_gpus} x {p.gpu}, {p.model.describe()}, seq {p.seq_len} x "
              f"{p.global_batch}, {p.precision.recipe}:")
        for r in rows:
            print("  " + _row(r))
        if not rows:
            print("  none fits")
    else:
        rows = [plan(p)]
        print_plan(rows[0])
    write_report(args.json, env, rows)
    return 0


if __name__ == "__main__":
    run_cli(main)
