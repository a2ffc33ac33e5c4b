#!/usr/bin/env python
"""Optimizer step time and achieved HBM bandwidth, per AdamW implementation, on a parameter set
shaped like OLMoE-1B-7B cut to 8 layers (vocab 100352: 3.77B parameters, 91 tensors, ~15 GB fp32).

Shapes come from models.ModelConfig built on the meta device; real tensors of those shapes are
then allocated (fp32 parameters, fp32 gradients), one copy shared by every variant, which steps
them in turn (the values drift a little; timing does not depend on them). Variants:

    torch_fused_fp32    torch.optim.AdamW(fused=True), fp32 moments            28 B/param
    torch_foreach_fp32  torch.optim.AdamW(foreach=True), fp32 moments          28 B/param
    foreach_bf16        PrecisionAwareAdamW(kernel=foreach), bf16 moments      20 B/param
    triton_fp32         PrecisionAwareAdamW(kernel=triton), fp32 moments       28 B/param
    triton_bf16         PrecisionAwareAdamW(kernel=triton), bf16 moments       20 B/param
    triton_bf16_copy    triton_bf16 + a bf16 copy of each updated weight       22 B/param
    triton_bf16_mxpair  triton_bf16 + each matrix's MX pair (two bf16 copies,  24 B/param
                        quantized along I and O: precision.quantized_expert_copies'
                        kernel, its own [32, 128] tile, not BLOCK); 1-D weights and
                        dims not multiples of 32 get the plain copy
    triton_q8           PrecisionAwareAdamW(kernel=triton), 8-bit moments      16 B/param
                        (optimizer.state_dtype=q8; its tile is --block / 256
                        rows of one 256-element block each: 512 = Q8_ROWS 2,
                        the default; plus 1/16 B of block scales)
    triton_q8_copy      triton_q8 + a bf16 copy of each updated weight         18 B/param
    triton_fp8          triton_q8 in fp8's code (optimizer.state_dtype=fp8:   16 B/param
                        E4M3 under a power of two a block; its tile is --block
                        / 256 rows too: 1024 = FP8_ROWS 4, the default)
    triton_fp8_copy     triton_fp8 + a bf16 copy of each updated weight        18 B/param
    triton_bf16_split   triton_bf16_copy with the masters held split           20 B/param
                        (optimizer.split_master: the copy and an int16 rest
                        stepped in place of the fp32 master); runs last and at
                        the default BLOCK only, as it frees the shared
                        parameters' fp32 storage
    norm_foreach        the clipping norm's squared sums alone, torch's       4 B/param
                        _foreach_norm (core/grad.py's default path)
    norm_triton         the same through core/grad_norm_triton.py              4 B/param
                        (optimizer.triton_grad_norm)

B/param is each variant's least traffic (read p, g, m, v; write p, m, v; and the copy): GB/s and
the floor (those bytes / --hbm-gbps, 4300 by default: the H200's 4.8 TB/s spec as copies reach it)
count only that, so extra passes (foreach) show as lower GB/s. ms is CUDA-event time per step;
launch_ms is the host time to issue a step (above ms, the step is launch bound). state_gib: the
moments' bytes (with the 8-bit moments' scales).

    python tools/bench_optim.py                                 # on the GPU: the table and JSON
    python tools/bench_optim.py --block 1024,2048,4096          # Triton rows per BLOCK size
    python tools/bench_optim.py --variants triton_bf16_mxpair --mx-tiles 128x4,64x4,256x8  # MX-pair tiles
    python tools/bench_optim.py --variants triton_bf16_mxpair --mx-order rows-first,cols-first  # tile order (r / c)
    python tools/bench_optim.py --variants torch_fused_fp32,triton_bf16 --steps 20
    python tools/bench_optim.py --tiny                          # small shapes; on the CPU (Triton interpreted)

Prints a table and writes JSON (--json). A row that raises (a swept tile that does not compile) is
printed and written as failed, the others still run, and the tool exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

VARIANTS = {  # name -> (bytes per parameter moved at least, what it sweeps: --block, --mx-tiles or nothing)
    "torch_fused_fp32": (28, None),
    "torch_foreach_fp32": (28, None),
    "foreach_bf16": (20, None),
    "triton_fp32": (28, "block"),
    "triton_bf16": (20, "block"),
    "triton_bf16_copy": (22, "block"),
    "triton_bf16_mxpair": (24, "tile"),  # adamw_update_mx_pair_'s own tile, not BLOCK
    "triton_q8": (16, "block"),  # --block / 256 rows a program (Q8_ROWS)
    "triton_q8_copy": (18, "block"),
    "triton_fp8": (16, "block"),  # as triton_q8
    "triton_fp8_copy": (18, "block"),
    "triton_bf16_split": (20, None),  # last, at the default BLOCK only: it frees the shared parameters' fp32 storage
    "norm_foreach": (4, None),  # the clipping norm alone (core.grad._sum_of_squares): read every gradient
    "norm_triton": (4, None),
}
GiB = 2**30


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--block", default="", help="Triton BLOCK sizes, comma-separated (default: the kernel's)")
    parser.add_argument("--mx-tiles", default="", help="triton_bf16_mxpair's tiles, COLSxWARPS comma-separated "
                        "(e.g. 128x4,64x2; default: the kernel's)")
    parser.add_argument("--mx-order", default="", help="triton_bf16_mxpair's tile orders, rows-first and/or "
                        "cols-first comma-separated (mx_triton.GRID_COLS_FIRST; default: the kernel's)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first allocates the state)")
    parser.add_argument("--hbm-gbps", type=float, default=4300.0, help="HBM bandwidth for the floor, GB/s")
    parser.add_argument("--tiny", action="store_true", help="a small model's shapes; runs on the CPU")
    parser.add_argument("--json", default="runs/bench/bench_optim.json")
    return parser.parse_args(argv)


def param_shapes(tiny: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of OLMoE-1B-7B with 8 layers and vocab 100352 (or a small
    model of the same design), from the model built on the meta device."""
    from moetron.models import ModelConfig

    cfg = ModelConfig.preset("olmoe-1b-7b")
    if tiny:
        cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.mlp_hidden = 64, 2, 1000, 32
        cfg.attention.n_heads = 4
        cfg.moe.num_experts, cfg.moe.expert_hidden, cfg.moe.router.top_k = 4, 32, 2
    else:
        cfg.n_layers, cfg.vocab_size = 8, 100352
    model = cfg.build(torch.device("meta"))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


class ClipNorm:
    """The clipping norm's squared sums over every gradient (core.grad._sum_of_squares, torch's
    foreach path or, ``triton``, core/grad_norm_triton.py), with an optimizer's step() and state."""

    def __init__(self, groups: list[dict], triton: bool) -> None:
        self.grads = [p.grad for g in groups for p in g["params"]]
        self.triton, self.state = triton, {}

    def step(self) -> None:
        from moetron.core.grad import _sum_of_squares

        _sum_of_squares(self.grads, self.triton)


def _code(variant: str) -> str | None:
    """The 8-bit optimizer.state_dtype a triton_q8 / triton_fp8 (_copy) row steps with, else None."""
    from moetron.core.optim import EIGHT_BIT_STATES

    code = variant.removeprefix("triton_").removesuffix("_copy")
    return code if variant.startswith("triton_") and code in EIGHT_BIT_STATES else None


def build(variant: str, groups: list[dict]):
    from moetron.core.adamw import PrecisionAwareAdamW

    if variant.startswith("norm_"):
        return ClipNorm(groups, triton=variant == "norm_triton")
    kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    if variant == "torch_fused_fp32":
        return torch.optim.AdamW(groups, fused=True, **kw)
    if variant == "torch_foreach_fp32":
        return torch.optim.AdamW(groups, foreach=True, **kw)
    from moetron.core.optim import EIGHT_BIT_STATES

    state_dtype = torch.float32 if variant == "triton_fp32" else EIGHT_BIT_STATES.get(_code(variant), torch.bfloat16)
    copies = None
    if variant.endswith("_copy") or variant in ("triton_bf16_mxpair", "triton_bf16_split"):
        copies = {p: torch.empty_like(p, dtype=torch.bfloat16) for g in groups for p in g["params"]}
    kernel = "foreach" if variant == "foreach_bf16" else "triton"
    split = variant == "triton_bf16_split"
    opt = PrecisionAwareAdamW(groups, state_dtype=state_dtype, kernel=kernel, split_master=split, **kw)
    if copies:
        pairs = variant == "triton_bf16_mxpair"  # every matrix whose last two dims hold whole MX blocks
        opt.add_compute_copies(copies, mx_cols={p: torch.empty_like(c) for p, c in copies.items()
                                                if pairs and p.ndim >= 2 and not (p.shape[-1] % 32 or p.shape[-2] % 32)},
                               replaces=split)
    return opt


def measure(opt, device: torch.device, steps: int, warmup: int) -> dict:
    cuda = device.type == "cuda"
    for _ in range(warmup):
        opt.step()
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    launch = time.perf_counter() - t0
    if cuda:
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3
    else:
        seconds = time.perf_counter() - t0
    state = sum(t.numel() * t.element_size() for s in opt.state.values()
                for k, t in s.items() if k in ("exp_avg", "exp_avg_sq", "exp_avg_scales", "exp_avg_sq_scales"))
    return {"ms": 1e3 * seconds / steps, "launch_ms": 1e3 * launch / steps, "state_gib": state / GiB}


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cli import kernel_device  # tools/cli.py (imports no triton)

    device = kernel_device(args.tiny, "bench_optim")
    if device is None:
        return 2
    from cli import write_report  # tools/cli.py

    from moetron.core.config import ConfigError
    from moetron.core.metrics import run_environment

    variants = [v for v in args.variants.split(",") if v]
    variants.sort(key=lambda v: v == "triton_bf16_split")  # last: it frees the shared parameters' storage
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ConfigError(f"--variants: unknown {unknown}, choose from {', '.join(VARIANTS)}")
    try:
        blocks = [int(b) for b in args.block.split(",") if b] or [None]
    except ValueError:
        blocks = [0]
    if any(b is not None and (b <= 0 or b & (b - 1)) for b in blocks):
        raise ConfigError(f"--block takes powers of two separated by commas, got {args.block!r}")
    try:
        tiles = [tuple(int(v) for v in t.split("x")) for t in args.mx_tiles.split(",") if t] or [None]
    except ValueError:
        tiles = [(0, 0)]
    if any(t is not None and (len(t) != 2 or t[0] < 32 or t[0] & (t[0] - 1) or t[1] <= 0 or t[1] & (t[1] - 1))
           for t in tiles):
        raise ConfigError(f"--mx-tiles takes COLSxWARPS pairs of powers of two (COLS >= 32) separated by commas, "
                          f"got {args.mx_tiles!r}")
    orders = [o for o in args.mx_order.split(",") if o] or [None]
    if any(o not in (None, "rows-first", "cols-first") for o in orders):
        raise ConfigError(f"--mx-order takes rows-first and/or cols-first separated by commas, got {args.mx_order!r}")
    if args.steps <= 0 or args.warmup < 0:
        raise ConfigError("--steps must be positive and --warmup >= 0")

    shapes = param_shapes(args.tiny)
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for _, shape in shapes:
        params.append(torch.nn.Parameter(torch.randn(shape, device=device, generator=gen) * 0.02))
        params[-1].grad = torch.randn(shape, device=device, generator=gen) * 1e-3
    decay = [p for (name, _), p in zip(shapes, params) if p.ndim >= 2 and "embed" not in name]
    no_decay = [p for (name, _), p in zip(shapes, params) if not (p.ndim >= 2 and "embed" not in name)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]

    import moetron.core.adamw_triton as kernel_module
    from moetron.core.moments_q8 import QBLOCK
    from moetron.core.precision import mx_triton

    default_block = kernel_module.BLOCK
    default_rows = {"q8": kernel_module.Q8_ROWS, "fp8": kernel_module.FP8_ROWS}  # 8-bit moments' tiles by code
    default_tile = (kernel_module.MX_PAIR_TILE_COLS, kernel_module.MX_PAIR_WARPS)
    default_order = mx_triton.GRID_COLS_FIRST
    rows = []
    for variant in variants:
        bytes_per_param, sweeps = VARIANTS[variant]
        settings = {"block": [(b, None) for b in blocks], "tile": [(t, o) for o in orders for t in tiles]}
        for setting, order in settings.get(sweeps, [(None, None)]):
            block = (setting or default_block) if sweeps == "block" else None
            code = _code(variant)
            q8 = code is not None  # 8-bit moments: the tile is rows of blocks (Q8_ROWS / FP8_ROWS)
            q8_rows = max(1, setting // QBLOCK) if q8 and setting else default_rows.get(code)
            if q8:
                block = q8_rows * QBLOCK
            tile = (setting or default_tile) if sweeps == "tile" else None
            cols_first = default_order if order is None else order == "cols-first"
            row = {"variant": variant, "block": block, "mx_tile": None if tile is None else f"{tile[0]}x{tile[1]}",
                   "mx_order": None if tile is None else ("cols-first" if cols_first else "rows-first"),
                   "params": numel, "tensors": len(params), "bytes_per_param": bytes_per_param}
            opt = None
            kernel_module.BLOCK = (None if q8 else block) or default_block  # read by every launch
            kernel_module.Q8_ROWS = q8_rows if code == "q8" else default_rows["q8"]
            kernel_module.FP8_ROWS = q8_rows if code == "fp8" else default_rows["fp8"]
            kernel_module.MX_PAIR_TILE_COLS, kernel_module.MX_PAIR_WARPS = tile or default_tile
            mx_triton.GRID_COLS_FIRST = cols_first
            try:
                opt = build(variant, groups)
                row.update(measure(opt, device, args.steps, args.warmup))
                row["gbps"] = bytes_per_param * numel / (row["ms"] / 1e3) / 1e9
                row["floor_ms"] = 1e3 * bytes_per_param * numel / (args.hbm_gbps * 1e9)
                row["x_floor"] = row["ms"] / row["floor_ms"]
            except torch.cuda.OutOfMemoryError:
                row["oom"] = True
            except Exception as e:  # e.g. a swept tile that does not compile: the other rows still run
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            finally:
                kernel_module.BLOCK = default_block
                kernel_module.Q8_ROWS, kernel_module.FP8_ROWS = default_rows["q8"], default_rows["fp8"]
                kernel_module.MX_PAIR_TILE_COLS, kernel_module.MX_PAIR_WARPS = default_tile
                mx_triton.GRID_COLS_FIRST = default_order
            rows.append(row)
            del opt
            if device.type == "cuda":
                torch.cuda.empty_cache()

    env = {**run_environment(device, 1, "tools/bench_optim.py", list(sys.argv[1:] if argv is None else argv)),
           "hbm_gbps": args.hbm_gbps, "tiny": args.tiny}
    where = env["device"] if device.type == "cuda" else "cpu (Triton interpreted: timings meaningless)"
    print(f"{where} | torch {torch.__version__} | {numel / 1e6:,.1f}M params in {len(params)} tensors | "
          f"floor at {args.hbm_gbps:.0f} GB/s")
    print(f"{'variant':<20} {'block':>9} {'B/param':>7} {'ms':>9} {'launch ms':>9} {'GB/s':>7} {'floor ms':>9} "
          f"{'x floor':>7} {'state GiB':>9}")
    for r in rows:
        block = (f"{r['mx_tile']} {r['mx_order'][0]}" if r["mx_tile"] else
                 ("-" if r["block"] is None else str(r["block"])))
        if r.get("oom") or r.get("error"):
            print(f"{r['variant']:<20} {block:>9} {'out of memory' if r.get('oom') else 'failed: ' + r['error']}")
            continue
        print(f"{r['variant']:<20} {block:>9} {r['bytes_per_param']:>7} {r['ms']:>9.2f} {r['launch_ms']:>9.2f} "
              f"{r['gbps']:>7.0f} {r['floor_ms']:>9.2f} {r['x_floor']:>7.2f} {r['state_gib']:>9.2f}")
    write_report(args.json, env, rows)
    failed = [r for r in rows if r.get("error")]
    if failed:
        print(f"bench_optim: {len(failed)} row(s) failed (above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cli import run_cli  # tools/cli.py

    run_cli(lambda: main())
