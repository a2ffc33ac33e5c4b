"""The fused SwiGLU quantization (blockwise_triton.quantize_1x128_swiglu) against the two kernels it
replaces (swiglu_triton's forward / backward, then quantize_1x128_fused), at the experts' shapes of
OLMoE (R 131,072 rows of F 1024, 64 experts) and olmoe3-4l-8e (R 65,536 of F 4096, 8 experts): rows
plus gathered tokens, K-block-major scales, as fp8_gemm runs them. Session 38 (precision.fp8_fused_swiglu).

    python docs/bench/session38/swiglu_quant_probe.py [--json out.json]     (one GPU; about 15 s)
"""
import argparse
import json
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

from moetron.core.precision import blockwise_triton as bt  # noqa: E402
from moetron.core.precision.blockwise_triton import quantize_1x128_fused, quantize_1x128_swiglu  # noqa: E402
from moetron.core.precision.grouping import padded_source_rows  # noqa: E402
from moetron.core.precision.swiglu_triton import swiglu_backward, swiglu_forward  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for name, R, F, E in (("olmoe", 131072, 1024, 64), ("olmoe3", 65536, 4096, 8)):
        h = torch.randn(R, 2 * F, device="cuda").bfloat16()
        ga = torch.randn(R, F, device="cuda").bfloat16()
        offsets = torch.arange(1, E + 1, device="cuda") * (R // E)
        src, _ = padded_source_rows(offsets, R, 128)
        kw = dict(src_rows_P=src, tokens_outer_major=True)
        default = bt.TILE_WARPS
        cases = {
            "forward, two kernels": (lambda: quantize_1x128_fused(swiglu_forward(h), **kw), default),
            "backward, two kernels": (lambda: quantize_1x128_fused(swiglu_backward(h, ga, False)[1], **kw), default),
        }
        for warps in (8, 16):  # the fused kernel at each warp count (TILE_WARPS: the product's)
            cases[f"forward, fused, {warps} warps"] = (lambda: quantize_1x128_swiglu(h, None, **kw), warps)
            cases[f"backward, fused, {warps} warps"] = (lambda: quantize_1x128_swiglu(h, ga, **kw), warps)
        for case, (fn, warps) in cases.items():
            bt.TILE_WARPS = warps
            ms = triton.testing.do_bench(fn, warmup=25, rep=100)
            bt.TILE_WARPS = default
            # bytes the fused kernel must move: h (+ the gradient) read, the fp8 rows and tokens written
            need = R * 2 * F * 2 + (R * F * 2 if "backward" in case else 0) + 2 * R * (2 * F if "backward" in case else F)
            rows.append(dict(shape=name, R=R, F=F, case=case, ms=ms, min_tb_s=need / ms / 1e9))
            print(f"{name:7s} {case:32s} {ms:8.3f} ms   {need / ms / 1e9:6.2f} TB/s of the fused kernel's bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
