"""Session 57's check that the fused loss' row kernel, with PROGRAMS None (its default: a program a row), compiles
for SM90 to the instructions it had before the PROGRAMS change (b3c11dd, the code session 57's GPU call ran): the
two kernels at the default block, warps and direction, 1 and 3 stages, compiled on the CPU (ptxas and cuobjdump ship
with Triton), their SASS opcodes compared. Prints the counts and the opcodes that differ.

    .venv/bin/python docs/bench/session57/sass_default_path.py

Session 57 (Triton 3.9, torch 2.13 CPU build, this sandbox; the GPU machine has Triton 3.6): 944 instructions both
at 1 stage, differing only in how the parameters are loaded (ULDC.64 + MOV against two ULDC, a NOP against an
HFMA2.MMA zeroing a register: the new C argument shifts the parameter offsets); 1,152 both at 3 stages, the
address arithmetic around the staged loads done with other integer instructions (VIADD / LEA / SHF against IADD3 /
IMAD), as many. Not a timing: the default path has not run on a GPU since the change.
"""

import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from moetron.core.layers import cross_entropy_triton as K  # noqa: E402
from tests.core.test_precision_fp8 import _compile_sm90  # noqa: E402

BEFORE = "b3c11dd"


def old_module():
    source = subprocess.run(["git", "-C", ROOT, "show", f"{BEFORE}:core/layers/cross_entropy_triton.py"],
                            capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "ce_before.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("ce_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def opcodes(compiled) -> list[str]:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    words = [re.sub(r"/\*[0-9a-f]{4}\*/", "", line).split(";")[0].split()
             for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    return [w[1] if w[0].startswith("@") else w[0] for w in words]  # the opcode, past any predicate


def main() -> None:
    before = old_module()
    V = 100352
    values = dict(logits_ptr="*bf16", target_ptr="*i64", coef_ptr="*fp32", lse_ptr="*fp32", tgt_logit_ptr="*fp32",
                  V=V, stride=V, z_loss_weight=0.0)
    config = triton.Config({}, num_warps=K.NUM_WARPS, num_stages=1)
    for stages in (1, 3):
        common = dict(GRAD=True, BLOCK=K.BLOCK_V, REVERSE=K.REVERSED, STAGES=stages)
        a = opcodes(_compile_sm90(before._ce_rows_kernel, config, values, common))
        b = opcodes(_compile_sm90(K._ce_rows_kernel, config, {**values, "C": 16384}, {**common, "ONE_ROW": True}))
        ca, cb = collections.Counter(a), collections.Counter(b)
        print(f"stages {stages}: {len(a)} instructions before, {len(b)} now; only before {dict(ca - cb)}, "
              f"only now {dict(cb - ca)}")


if __name__ == "__main__":
    main()
