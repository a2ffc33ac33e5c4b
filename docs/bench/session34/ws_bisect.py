"""Session 34: where precision.fp8_experts=triton_ws goes wrong on the H100 (session 33's call_min:
both GEMMs off by more than their own size). Each transform of core/precision/fp8_triton_ws.py's
kernels is written beside it as a module, imported in its place, and run on the same operands with
the specialization on and off (`warp_specialize=True` / `False`, nothing else changed); the masked
kernel (right on the GPU) is the reference. A transform whose ws row is right and whose plain row is
right names the part of the kernel Triton's specialization breaks.

    python docs/bench/session34/ws_bisect.py            (on the GPU; about 90 s)
"""
from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys

import torch

from moetron.core.precision import fp8_triton as ft
from moetron.core.precision.blockwise import quantize_128x128, quantize_1x128

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
HERE = pathlib.Path(ft.__file__).parent
SOURCE = (HERE / "fp8_triton_ws.py").read_text()
NAME = "moetron.core.precision.fp8_triton_ws"

ROWS_SCALE = "            acc += tl.dot(a, b) * sab\n"
K_SCALE = "            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])\n"
TRANSFORMS = {
    "as_is": [],
    # the fp32 promotion by the scales out of the loop: a plain fp8 wgmma chain (compared with its own
    # unspecialized twin, not with the masked kernel)
    "no_scale": [(ROWS_SCALE, "            acc = tl.dot(a, b, acc)\n"), (K_SCALE, "            acc = tl.dot(a, b, acc)\n")],
    # the rows kernel's data-dependent trip count made constant (tiles past the end still store nothing)
    "const_trip": [("        for kb in range(0, n_kb):\n", "        for kb in range(0, K // BK):\n")],
    # the A scales loaded as a [BM, 1] block (the specialization splits the tile's rows between two
    # consumers: a [BM] vector broadcast afterwards may not be split with them)
    "scale2d": [("            sa = tl.load(sa_ptrs + kb * s_sak)  # both scales before the wgmma is issued\n"
                 "            if BN == BK:\n"
                 "                sab = (sa * tl.load(sb_row + pid_n * s_sbn + kb * s_sbk))[:, None]\n"
                 "            else:\n"
                 "                sab = sa[:, None] * tl.load(sb_ptrs + kb * s_sbk)[None, :]\n",
                 "            sa = tl.load(sa_ptrs[:, None] + kb * s_sak)\n"
                 "            if BN == BK:\n"
                 "                sab = sa * tl.load(sb_row + pid_n * s_sbn + kb * s_sbk)\n"
                 "            else:\n"
                 "                sab = sa * tl.load(sb_ptrs + kb * s_sbk)[None, :]\n"),
                ("            sa = tl.load(sa_ptrs + kb * s_sak)\n            sb = tl.load(sb_ptrs + kb * s_sbk)\n"
                 "            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])\n",
                 "            sa = tl.load(sa_ptrs[:, None] + kb * s_sak)\n            sb = tl.load(sb_ptrs + kb * s_sbk)\n"
                 "            acc += tl.dot(a, b) * (sa * sb[None, :])\n")],
}
assert ROWS_SCALE in SOURCE and K_SCALE in SOURCE


def variant(transform: str, ws: bool):
    text = SOURCE
    for old, new in TRANSFORMS[transform]:
        assert old in text, old
        text = text.replace(old, new)
    if not ws:
        text = text.replace("warp_specialize=True", "warp_specialize=False")
    mod = f"_ws_bisect_{transform}_{'ws' if ws else 'plain'}"
    (HERE / f"{mod}.py").write_text(text)
    return importlib.import_module(f"moetron.core.precision.{mod}")


def wide(*shape, seed=0):
    if DEVICE == "cuda" and torch.Size(shape).numel() > 2 ** 24:  # the timing operands: made on the GPU
        return torch.randn(*shape, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    for d, n in enumerate(shape):
        view = [1] * len(shape)
        view[d] = n
        x = x * torch.logspace(-1, 1, n, dtype=torch.float64)[torch.randperm(n, generator=g)].view(view)
    return x.float().to(DEVICE)


def operands(R, K, N, offsets, M, P, padded):
    a_q, a_s = quantize_1x128(wide(R, K, seed=1), -1)
    w_q, w_s = quantize_128x128(wide(len(offsets), N, K, seed=2))
    ka = quantize_1x128(wide(M, P, seed=3), -1)
    kb = quantize_1x128(wide(N, P, seed=4), -1)
    off = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    pad = torch.tensor(padded, dtype=torch.int32, device=DEVICE)
    return (a_q, a_s, w_q.transpose(1, 2), w_s.transpose(1, 2), off), (*ka, *kb, pad)


def rel(x, ref, valid=None):
    if valid is not None:
        x, ref = x[valid], ref[valid]
    return float((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def timings(transforms, cfg):
    """OLMoE's gate|up at 16,384 tokens (rows: 131,072 x K 2048 -> N 2048 over 64 experts; k: its
    wgrad) for each transform right under the specialization, beside the pipelined kernels and bf16
    torch._grouped_mm: ms and TFLOP/s (triton.testing.do_bench)."""
    import triton

    R, K, N, E = 131072, 2048, 2048, 64
    counts = torch.full((E,), R // E, dtype=torch.int32)
    counts[::2] += 37
    counts[1::2] -= 37
    offsets = torch.cumsum(counts, 0).to(torch.int32).tolist()
    padded = torch.cumsum((counts + 127) // 128 * 128, 0).to(torch.int32).tolist()
    r_ops, k_ops = operands(R, K, N, offsets, N, padded[-1], padded)
    xb = torch.randn(R, K, device=DEVICE, dtype=torch.bfloat16)
    wb = torch.randn(E, K, N, device=DEVICE, dtype=torch.bfloat16)
    off = r_ops[-1]
    flops = 2 * R * K * N
    found = []

    def row(what, fn_rows, fn_k):
        ms_r = triton.testing.do_bench(fn_rows, warmup=10, rep=60)
        ms_k = triton.testing.do_bench(fn_k, warmup=10, rep=60) if fn_k else float("nan")
        found.append(dict(timing=what, rows_ms=ms_r, rows_tflops=flops / ms_r / 1e9, k_ms=ms_k,
                          k_tflops=2 * N * N * padded[-1] / ms_k / 1e9))
        print(f"timing {what:28s} rows {ms_r:7.3f} ms {flops / ms_r / 1e9:6.0f} TFLOP/s   k {ms_k:7.3f} ms "
              f"{2 * N * N * padded[-1] / ms_k / 1e9:6.0f} TFLOP/s", flush=True)

    row("bf16 _grouped_mm", lambda: torch._grouped_mm(xb, wb, offs=off), None)
    row("pipelined", lambda: ft.fp8_grouped_mm_rows(*r_ops, torch.bfloat16, kernel=ft.GroupedKernel.pipelined),
        lambda: ft.fp8_grouped_mm_k(*k_ops, kernel=ft.GroupedKernel.pipelined))
    real = sys.modules[NAME]
    for transform in transforms:
        mod = variant(transform, True)
        mod._programs = mod.__dict__.get("_programs_sms", mod._programs)
        for kernel in (mod.rows_kernel, mod.k_kernel):
            kernel.configs = [cfg]
            kernel.cache.clear()
        sys.modules[NAME] = mod
        try:
            row(f"ws {transform}", lambda: ft.fp8_grouped_mm_rows(*r_ops, torch.bfloat16, kernel=ft.GroupedKernel.warp_specialized),
                lambda: ft.fp8_grouped_mm_k(*k_ops, kernel=ft.GroupedKernel.warp_specialized))
        finally:
            sys.modules[NAME] = real
    return found


SHAPES = {
    # the GPU test's (ragged, empty experts, rows past the end)
    "test": ((150, 256, 384, [40, 40, 101, 140, 140], 256, 384, [128, 128, 384])),
    # full tiles only, every expert 128-aligned
    "aligned": ((1024, 512, 512, [256, 512, 768, 1024], 512, 1024, [256, 512, 768, 1024])),
    # an olmoe-like slice: 8 experts, ragged
    "ragged8": ((4096, 1024, 1024, [300, 900, 1500, 1500, 2400, 3000, 3700, 4096], 1024, 4096 + 8 * 128,
                 [384, 1024, 1664, 1664, 2560, 3200, 3968, 4352])),
}


def main():
    rows = []
    real = sys.modules.get(NAME) or importlib.import_module(NAME)
    configs = real.ws_configs()
    if DEVICE == "cuda":  # the 128-row split tiles (the design; wrong under 3.6), then one 64-row tile
        Config = type(configs[0])
        configs = [Config({"BM": 128, "BN": 128}, num_warps=4, num_stages=st) for st in (3, 4, 5)]
        configs.append(Config({"BM": 64, "BN": 128}, num_warps=4, num_stages=4))
    shapes = dict(list(SHAPES.items())[:1]) if DEVICE == "cpu" else SHAPES
    for shape, (R, K, N, offsets, M, P, padded) in shapes.items():
        r_ops, k_ops = operands(R, K, N, offsets, M, P, padded)
        ref_rows = ft.fp8_grouped_mm_rows(*r_ops, torch.float32, kernel=ft.GroupedKernel.masked)
        ref_k = ft.fp8_grouped_mm_k(*k_ops, kernel=ft.GroupedKernel.masked)
        valid = torch.arange(R, device=DEVICE) < offsets[-1]
        for transform in TRANSFORMS:
            for cfg in (configs if transform == "as_is" else configs[:1]):
                outs = {}
                for ws in (False, True):
                    for programs in ("sms", "tiles"):
                        mod = variant(transform, ws)
                        mod.__dict__.setdefault("_programs_sms", mod._programs)
                        mod._programs = (lambda device, n_tiles: n_tiles) if programs == "tiles" else mod._programs_sms
                        for kernel in (mod.rows_kernel, mod.k_kernel):
                            kernel.configs = [cfg]
                            kernel.cache.clear()
                        sys.modules[NAME] = mod
                        try:
                            o_r = ft.fp8_grouped_mm_rows(*r_ops, torch.float32, kernel=ft.GroupedKernel.warp_specialized)
                            o_k = ft.fp8_grouped_mm_k(*k_ops, kernel=ft.GroupedKernel.warp_specialized)
                            torch.cuda.synchronize() if DEVICE == "cuda" else None
                            err = None
                        except Exception as e:  # noqa: BLE001 - a compile failure is a finding here
                            o_r = o_k = None
                            err = f"{type(e).__name__}: {str(e)[:160]}"
                        finally:
                            sys.modules[NAME] = real
                        key = ("ws" if ws else "plain", programs)
                        outs[key] = (o_r, o_k)
                        row = dict(shape=shape, transform=transform, config=ft.config_name(cfg), ws=ws,
                                   programs=programs, error=err)
                        if o_r is not None:
                            row["rows_vs_masked"] = rel(o_r, ref_rows, valid)
                            row["k_vs_masked"] = rel(o_k, ref_k)
                            plain = outs.get(("plain", programs))
                            if ws and plain and plain[0] is not None:
                                row["rows_vs_plain"] = rel(o_r, plain[0], valid)
                                row["k_vs_plain"] = rel(o_k, plain[1])
                        rows.append(row)
                        print(" ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in row.items() if v is not None), flush=True)
    right = {}
    for r in rows:
        if r["ws"]:
            ok = r.get("rows_vs_masked", 1) < 1e-2 and r.get("k_vs_masked", 1) < 1e-2 if r["transform"] != "no_scale" \
                else r.get("rows_vs_plain", 1) < 1e-3 and r.get("k_vs_plain", 1) < 1e-3
            right[r["transform"]] = right.get(r["transform"], True) and ok
    print("right under the specialization:", right, flush=True)
    if DEVICE == "cuda":
        rows += timings([t for t, ok in right.items() if ok and t != "no_scale"], configs[0])
    out = os.environ.get("OUT", ".")
    pathlib.Path(out, "ws_bisect.json").write_text(json.dumps(dict(triton=__import__("triton").__version__,
                                                                    device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", rows=rows),
                                                               indent=1))
    for p in HERE.glob("_ws_bisect_*.py"):
        p.unlink()


if __name__ == "__main__":
    main()
