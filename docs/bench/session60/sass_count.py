"""The AdamW kernels' SM90 SASS, compiled on the CPU (Triton's ptxas and cuobjdump; no GPU): instructions a thread
an element (static, slow paths included), registers and spills, in the split-master form the step runs with
(bf16 gradients, the clip scale, Triton's FP fusion off as every launch sets it): bf16 moments' kernel at BLOCK
1024, q8's and fp8's 8-bit kernel at 2, 4, 8 and 16 rows a program. Prints a table and writes JSON.

    python docs/bench/session60/sass_count.py [--json runs/bench/sass_count.json]   # from the repo root
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.getcwd())

import triton  # noqa: E402

from moetron.core import adamw_triton as K  # noqa: E402
from moetron.core.moments_q8 import QBLOCK  # noqa: E402
from tests.core.test_moments_q8 import _registers  # noqa: E402
from tests.core.test_precision_fp8 import _compile_sm90  # noqa: E402

SCALARS = {n: "fp32" for n in ("decay", "lerp_weight", "beta2", "one_minus_beta2", "bc2_sqrt", "eps", "neg_step_size")}


def sass_instructions(compiled) -> int:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))


def row(name, compiled, elements_a_program, warps=4):
    n = sass_instructions(compiled)
    return {"kernel": name, "instructions": n, "per_element_a_thread": n / (elements_a_program / (32 * warps)),
            "registers": _registers(compiled)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="runs/bench/sass_count.json")
    args = parser.parse_args(argv)
    cfg = triton.Config({}, num_warps=4, num_stages=1)
    opts = dict(enable_fp_fusion=False)
    rows = []
    bf16 = _compile_sm90(K._adamw_kernel, cfg, dict(p_ptr="*i16", g_ptr="*bf16", m_ptr="*bf16", v_ptr="*bf16",
                                                    out_ptr="*i16", scale_ptr="*fp32", n=2**24, **SCALARS),
                         dict(GRAD_BF16=True, STATE_BF16=True, LERP_SMALL=True, WRITE_OUT=False, GRAD_SCALE=True,
                              BLOCK=1024, SPLIT=True), options=opts)
    rows.append(row("bf16 moments, BLOCK 1024", bf16, 1024))
    for fp8 in (False, True):
        codes, scales = ("*fp8e4nv", "*u8") if fp8 else ("*u8", "*fp32")
        for tr in (2, 4, 8, 16):
            c = _compile_sm90(K._adamw_q8_kernel, cfg,
                              dict(p_ptr="*i16", g_ptr="*bf16", m_ptr=codes, v_ptr=codes, ms_ptr=scales, vs_ptr=scales,
                                   out_ptr="*i16", scale_ptr="*fp32", tab_ptr=scales if fp8 else "*fp32", R=4096,
                                   C=2048, NB=8, sr_key="i32", **SCALARS),
                              dict(GRAD_BF16=True, LERP_SMALL=True, WRITE_OUT=False, GRAD_SCALE=True, SPLIT=True,
                                   TR=tr, QB=QBLOCK, FP8=fp8, HW=True), options=opts)
            rows.append(row(f"{'fp8' if fp8 else 'q8'} moments, {tr} rows", c, tr * QBLOCK))
    print(f"{'kernel':28s} {'SASS':>6s} {'/elem/thread':>13s} {'registers':>10s}")
    for r in rows:
        print(f"{r['kernel']:28s} {r['instructions']:>6d} {r['per_element_a_thread']:>13.0f} {str(r['registers']):>10s}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "triton": triton.__version__}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
