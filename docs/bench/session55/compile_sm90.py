"""Session 55: the routing kernels changed this session (core/moe/kernels/routing.py) compiled for SM90 by
Triton on the CPU (no GPU needed), with ptxas's register use: they compile, no local memory (spills), no stack.
Run from the repo root: python docs/bench/session55/compile_sm90.py (this machine: Triton 3.9; the GPU machine has 3.6)."""
import os, subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetron.core.moe.kernels import routing

def compile_(fn, signature, constexprs, warps, attrs=None):
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs or {}),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
def usage(c):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"]); f.flush()
        return subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout.strip().splitlines()[-1]

for dt, D in (("bf16", 2048), ("fp32", 2048), ("bf16", 4096)):
    bt, bd, nw = routing._row_blocks(D, 2 if dt == "bf16" else 4)
    br = min(routing._HOLE_SCAN_ROWS, max(1, 16384 // bd))
    sig = {"out_ptr": f"*{dt}", "written_ptr": "*u8", "R": "i32", "D": "i32", "ROWS": "constexpr", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"}
    c = compile_(routing._zero_unwritten_rows_kernel, sig, {"ROWS": routing._HOLE_SCAN_ROWS, "BLOCK_R": br, "BLOCK_D": bd}, nw)
    print("zero", dt, D, "BLOCK_R", br, "BLOCK_D", bd, "warps", nw, usage(c))
E = 64; bn, ch, ep = routing._route_blocks(131072, E)
sig = {"ids_ptr": "*i64", "counts_EB_ptr": "*i32", "N": "i32", "E": "i32", "B": "i32", "BLOCK_N": "constexpr", "CHUNK": "constexpr", "E_PAD": "constexpr"}
c = compile_(routing._route_count_kernel, sig, {"BLOCK_N": bn, "CHUNK": ch, "E_PAD": ep}, 4)
print("count", usage(c))
sig = {"ids_ptr": "*i64", "first_rank_EB_ptr": "*i32", "first_row_E_ptr": "*i32", "dest_ptr": "*i32", "N": "i32", "E": "i32", "B": "i32", "capacity": "i32", "HAS_CAPACITY": "constexpr", "BLOCK_N": "constexpr", "CHUNK": "constexpr", "E_PAD": "constexpr"}
c = compile_(routing._route_rank_kernel, sig, {"HAS_CAPACITY": False, "BLOCK_N": bn, "CHUNK": ch, "E_PAD": ep}, 4)
print("rank", usage(c))
