"""Probe (session 39, queued): is there headroom over torch._grouped_mm for the bf16 experts' GEMMs?

#13 on olmoe3-4l-8e is about 1% short of 1.2x torchtitan, and 77% of its step is GEMMs. In today's
profile (docs/performance.md, session 39) `torch._grouped_mm` runs the experts at 687-737 TFLOP/s while
cuBLAS's dense GEMMs of the same step reach 786. The FP8 Gluon kernels (core/precision/fp8_gluon.py:
persistent, a TMA producer warp and two wgmma consumer warpgroups over a ring of shared-memory stages)
beat the pipelined Triton kernels by 16-44%. This probe runs the same structure in bf16, without the
FP8 promotion: each consumer chains its wgmmas on one accumulator, keeps one in flight and releases a
stage as the wgmma after it is issued. It reuses fp8_gluon's ring, producer (the forward's), tile
table, raster and masked store. Two forms: the forward (x [R, K] @ w[e]^T, w [E, N, K] read K-major, as the FP8 kernels read B)
and the dgrad (dy [R, K] @ w[e], w [E, K, N] read N-major: bf16 wgmma takes B either way, so the weights
need no transposed copy). If it does not clearly beat `_grouped_mm`, a bf16 Gluon experts path (and
GEMM-epilogue fusions on it) is not worth building.

    python docs/bench/session39/gluon_bf16_probe.py [--json out.json]     (one SM90 GPU; about 40 s)

On the CPU, `--compile-only` compiles the kernel for SM90 (ptxas included) at every config and says
whether it is warp-specialized and spill-free.
"""
import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

from moetron.core.precision.fp8_gluon import (_gluon_tile_table_kernel, _ring, _rows_producer,  # noqa: E402
                                              _rows_store, _tile_of, _tma_load, STORE_LAYOUT)
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

BLOCK_M, BLOCK_K = 128, 64  # two 64-row consumers; 64 bf16 = 128 bytes a row (the 128-byte swizzle)
MMA128 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
MMA256 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
CONFIGS = [(128, 4, 1), (128, 4, 8), (128, 5, 8), (128, 6, 8), (256, 3, 8), (256, 4, 8), (256, 4, 1)]
"""(BN, stages, GM): 32 / 48 KiB a stage; GM row tiles a raster group (1: fp8_gluon's order, row tile by
row tile; 8: each B tile read from HBM once per 8 row tiles, their A tiles kept in L2)."""


@gluon.jit
def _nmajor_producer(a_desc, b_desc, tile_ptr, N, K, T, GM, total, a_bufs, b_bufs, ready, empty):
    """The dgrad form's TMA loads: fp8_gluon._rows_producer's (which the forward runs as it is), B's
    tiles [BK, BN] from the weights stacked [E * K, N] (N contiguous) instead of [BN, BK] from [E * N, K]."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    NUM_BUF: gl.constexpr = a_bufs.shape[0]
    n_n = (N + BN - 1) // BN
    c = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        rt, ct = _tile_of(t, T, n_n, GM)
        first = gl.load(tile_ptr + 3 * rt + 1)
        group = gl.load(tile_ptr + 3 * rt)
        nk = gl.where(first < 0, 0, K // BK)  # past the last row tile: no K-block
        for j in range(nk):
            i = c % NUM_BUF
            mbarrier.wait(empty.index(i), ((c // NUM_BUF) & 1) ^ 1)  # the ring's first round passes
            bar = ready.index(i)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [gl.maximum(first, 0), j * BK], bar, a_bufs.index(i))
            _tma_load(b_desc, [group * K + j * BK, ct * BN], bar, b_bufs.index(i))
            c += 1


@gluon.jit
def _consume(HALF: gl.constexpr, NMAJOR: gl.constexpr, acc, a_bufs, b_bufs, ready, empty, nk, c):
    """This consumer's wgmmas over a tile's nk K-blocks (the ring's c-th stage onwards) into acc, one in
    flight: a stage is released once the wgmma after it is issued (and the last after the final wait).
    B's stage is [BN, BK] (K-major, viewed [BK, BN]) or, NMAJOR, [BK, BN] as it is."""
    NUM_BUF: gl.constexpr = a_bufs.shape[0]
    for j in range(nk):
        i = c % NUM_BUF
        mbarrier.wait(ready.index(i), (c // NUM_BUF) & 1)
        if NMAJOR:
            b = b_bufs.index(i)
        else:
            b = b_bufs.index(i).permute((1, 0))
        acc = warpgroup_mma(a_bufs.index(i).slice(HALF * 64, 64, dim=0), b, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        if j > 0:
            mbarrier.arrive(empty.index((c + NUM_BUF - 1) % NUM_BUF), count=1)
        c += 1
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    if nk > 0:
        mbarrier.arrive(empty.index((c + NUM_BUF - 1) % NUM_BUF), count=1)
    return acc, c


@gluon.jit
def _consumer(HALF: gl.constexpr, NMAJOR: gl.constexpr, a_bufs, b_bufs, ready, empty, tile_ptr, c_ptr, s_cm, N, K,
              T, GM, total):
    BN: gl.constexpr = b_bufs.shape[2] if NMAJOR else b_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    n_n = (N + BN - 1) // BN
    c = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        rt, ct = _tile_of(t, T, n_n, GM)
        col0 = ct * BN
        first = gl.load(tile_ptr + 3 * rt + 1)
        row_end = gl.where(first < 0, 0, gl.load(tile_ptr + 3 * rt + 2))  # past the last tile: nothing stored
        nk = gl.where(first < 0, 0, K // BK)
        row = gl.maximum(first, 0) + HALF * 64
        if BN == 256:
            acc, c = _consume(HALF, NMAJOR, gl.zeros((64, 256), dtype=gl.float32, layout=MMA256), a_bufs, b_bufs,
                              ready, empty, nk, c)
        else:
            acc, c = _consume(HALF, NMAJOR, gl.zeros((64, 128), dtype=gl.float32, layout=MMA128), a_bufs, b_bufs,
                              ready, empty, nk, c)
        _rows_store(gl.convert_layout(acc.to(c_ptr.dtype.element_ty), STORE_LAYOUT), c_ptr, s_cm, row, col0, row_end, N)


# a consumer pair for each form: a constexpr cannot come through warp_specialize

@gluon.jit
def _consumer0(a_bufs, b_bufs, ready, empty, tile_ptr, c_ptr, s_cm, N, K, T, GM, total):
    _consumer(0, False, a_bufs, b_bufs, ready, empty, tile_ptr, c_ptr, s_cm, N, K, T, GM, total)


@gluon.jit
def _consumer1(a_bufs, b_bufs, ready, empty, tile_ptr, c_ptr, s_cm, N, K, T, GM, total):
    _consumer(1, False, a_bufs, b_bufs, ready, empty, tile_ptr, c_ptr, s_cm, N, K, T, GM, total)


@gluon.jit
def _consumer0_n(a_bufs, b_bufs, ready, empty, tile_ptr, c_ptr, s_cm, N, K, T, GM, total):
    _consumer(0, True, a_bufs, b_bufs, ready, empty, tile_ptr, c_ptr, s_cm, N, K, T, GM, total)


@gluon.jit
def _consumer1_n(a_bufs, b_bufs, ready, empty, tile_ptr, c_ptr, s_cm, N, K, T, GM, total):
    _consumer(1, True, a_bufs, b_bufs, ready, empty, tile_ptr, c_ptr, s_cm, N, K, T, GM, total)


@gluon.jit
def _bf16_rows_kernel(a_desc, b_desc, tile_ptr, c_ptr, N, K, T, GM, s_cm, NMAJOR: gl.constexpr, NUM_BUF: gl.constexpr,
                      num_warps: gl.constexpr):
    """out[rows of e] = A[rows of e] @ B[e]^T with B stacked [E * N, K] (the forward), or (NMAJOR)
    A[rows of e] @ B[e] with B stacked [E * K, N] (the dgrad); tiles t = row tile * ceil(N / BN) +
    column tile (in groups of GM row tiles: _tile_of), a grid apart."""
    BN: gl.constexpr = b_desc.block_type.shape[1] if NMAJOR else b_desc.block_type.shape[0]
    total = T * ((N + BN - 1) // BN)
    a_bufs, b_bufs, ready, empty = _ring(a_desc, b_desc, NUM_BUF)
    pargs = (a_desc, b_desc, tile_ptr, N, K, T, GM, total, a_bufs, b_bufs, ready, empty)
    cargs = (a_bufs, b_bufs, ready, empty, tile_ptr, c_ptr, s_cm, N, K, T, GM, total)
    if NMAJOR:
        gl.warp_specialize([(_consumer0_n, cargs), (_consumer1_n, cargs), (_nmajor_producer, pargs)], [4, 1],
                           [232, 40])
    else:
        gl.warp_specialize([(_consumer0, cargs), (_consumer1, cargs), (_rows_producer, pargs)], [4, 1], [232, 40])


def _layout(block):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


def gluon_bf16_rows(x_RK, w, offsets_E, BN=128, bufs=4, GM=8, persistent=True, nmajor=False):
    """x_RK [R, K] bf16 expert-sorted rows, offsets_E int32 inclusive ends; w [E, N, K] (K contiguous: x @
    w[e]^T, the forward) or, ``nmajor``, [E, K, N] (N contiguous: x @ w[e], the dgrad) -> [R, N] bf16 (rows
    past offsets_E[-1] unspecified)."""
    R, K = x_RK.shape
    E = w.shape[0]
    N = w.shape[2] if nmajor else w.shape[1]
    assert K % BLOCK_K == 0 and N % BN == 0
    out = torch.empty(R, N, dtype=torch.bfloat16, device=x_RK.device)
    a_desc = TensorDescriptor(x_RK, [R, K], [K, 1], [BLOCK_M, BLOCK_K], _layout((BLOCK_M, BLOCK_K)))
    if nmajor:
        b = w.reshape(E * K, N)
        b_desc = TensorDescriptor(b, [E * K, N], [N, 1], [BLOCK_K, BN], _layout((BLOCK_K, BN)))
    else:
        b = w.reshape(E * N, K)
        b_desc = TensorDescriptor(b, [E * N, K], [K, 1], [BN, BLOCK_K], _layout((BN, BLOCK_K)))
    T = triton.cdiv(R, BLOCK_M) + E
    table = torch.empty(T, 3, dtype=torch.int32, device=x_RK.device)
    _gluon_tile_table_kernel[(T, )](offsets_E, table, E, BM=BLOCK_M, EP=triton.next_power_of_2(E), num_warps=1)
    total = T * (N // BN)
    sms = torch.cuda.get_device_properties(x_RK.device).multi_processor_count
    _bf16_rows_kernel[(min(total, sms) if persistent else total, )](a_desc, b_desc, table, out, N, K, T, GM,
                                                                   out.stride(0), NMAJOR=nmajor, NUM_BUF=bufs,
                                                                   num_warps=4)
    return out


def compile_only():
    """Every config compiled for SM90 on this machine (no GPU): warp-specialized, wgmma, spills."""
    import subprocess
    import tempfile
    import types

    from triton.backends.nvidia.compiler import get_ptxas

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    from tests.core.test_precision_fp8 import _compile_sm90, _ptxas_spills

    def desc(block):
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{_layout(block)!r}>"

    for (BN, bufs, _), nmajor in [(c, n) for n in (False, True) for c in CONFIGS if c[2] == 8]:
        b_block = (BLOCK_K, BN) if nmajor else (BN, BLOCK_K)
        values = dict(a_desc=desc((BLOCK_M, BLOCK_K)), b_desc=desc(b_block), tile_ptr="*i32", c_ptr="*bf16", N=8192,
                      K=4096, T=520, GM=8, s_cm=8192)
        options = types.SimpleNamespace(kwargs={}, num_warps=4, num_stages=1)
        k = _compile_sm90(_bf16_rows_kernel, options, values, dict(NMAJOR=nmajor, NUM_BUF=bufs, num_warps=4),
                          gluon=True)
        ptx = k.asm["ptx"]
        notes = ""
        ptxas = get_ptxas(90).path
        if os.path.exists(ptxas):  # ptxas's verdict on the wgmmas: serialized or not (C7514 / C7515 ...)
            with tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(tmp, "k.ptx"), "w") as f:
                    f.write(ptx)
                notes = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.path.join(tmp, "k.cubin")],
                                       capture_output=True, text=True).stderr
        serialized = "serialized" in notes or "warpgroup.wait is injected" in notes
        print(f"{'dgrad' if nmajor else 'forward'} BN {BN} stages {bufs}: wgmma {'wgmma.mma_async' in ptx}, setmaxnreg {'setmaxnreg.inc' in ptx}, "
              f"shared {k.metadata.shared // 1024} KiB, spills {_ptxas_spills(ptx)}, wgmma serialized {serialized}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only or not torch.cuda.is_available():
        compile_only()
        return
    rows = []
    shapes = (  # (name, R, K, N, E, dgrad): the forward's x @ w^T and the dgrad's dy @ w
        ("olmoe3 gate_up fwd", 65536, 4096, 8192, 8, False), ("olmoe3 down fwd", 65536, 4096, 4096, 8, False),
        ("olmoe3 gate_up dgrad", 65536, 8192, 4096, 8, True), ("olmoe3 down dgrad", 65536, 4096, 4096, 8, True),
        ("olmoe gate_up fwd", 131072, 2048, 2048, 64, False), ("olmoe down fwd", 131072, 1024, 2048, 64, False),
        ("olmoe gate_up dgrad", 131072, 2048, 2048, 64, True), ("olmoe down dgrad", 131072, 2048, 1024, 64, True))
    for name, R, K, N, E, nmajor in shapes:
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(R, K, generator=g) / 4).bfloat16().cuda()
        w = (torch.randn(E, K, N, generator=g) / K ** 0.5).bfloat16().cuda()  # the weights as the GEMM reads them
        if not nmajor:
            w = w.transpose(-2, -1).contiguous()  # [E, N, K], K contiguous (w_gate_up / w_down as stored)
        wb = w if nmajor else w.transpose(-2, -1)  # _grouped_mm's [E, K, N] view
        sizes = torch.full((E,), R // E)
        sizes[0] += R // (4 * E)
        sizes[1] -= R // (4 * E)  # ragged, none empty
        offsets = sizes.cumsum(0).to(torch.int32).cuda()
        flops = 2 * R * K * N
        ref = torch._grouped_mm(x, wb, offs=offsets)
        t_ref = triton.testing.do_bench(lambda: torch._grouped_mm(x, wb, offs=offsets))
        row = {"shape": name, "R": R, "K": K, "N": N, "E": E, "grouped_mm_ms": t_ref,
               "grouped_mm_tflops": flops / t_ref / 1e9, "configs": []}
        print(f"{name} (R {R}, K {K}, N {N}, E {E}): _grouped_mm {t_ref:.3f} ms, {flops / t_ref / 1e9:.0f} TFLOP/s")
        for BN, bufs, GM in CONFIGS:
            try:
                out = gluon_bf16_rows(x, w, offsets, BN, bufs, GM, nmajor=nmajor)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                t = triton.testing.do_bench(lambda: gluon_bf16_rows(x, w, offsets, BN, bufs, GM, nmajor=nmajor))
            except Exception as e:  # noqa: BLE001 - a config that fails (or does not divide N) is a row saying why
                row["configs"].append({"BN": BN, "stages": bufs, "GM": GM, "error": f"{type(e).__name__}: {e}"[:200]})
                print(f"  BN {BN} s{bufs} GM {GM}: {type(e).__name__}: {str(e)[:150]}")
                continue
            row["configs"].append({"BN": BN, "stages": bufs, "GM": GM, "ms": t, "tflops": flops / t / 1e9,
                                   "rel_err": err})
            print(f"  BN {BN} s{bufs} GM {GM}: {t:.3f} ms, {flops / t / 1e9:.0f} TFLOP/s ({t_ref / t:.3f}x _grouped_mm), "
                  f"max error {err:.1e} of the largest output")
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
