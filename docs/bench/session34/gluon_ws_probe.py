"""Session 34's probe for #14's grouped target (not product code): an FP8 blockwise dense GEMM
(1x128 activation scales, 128x128 weight scales, fp32 promotion a K-block) with the warp
specialization written by hand in Gluon, as DeepGEMM structures it: a 1-warp TMA producer (padded to
a warpgroup) and two 4-warp consumers on the two 64-row halves of a 128 x 128 tile, sharing B, each
waiting for its own wgmma and promoting it while the other consumer's wgmma runs; setmaxnreg gives the
consumers 232 registers. Triton's automatic specialization of the same structure is wrong under
Triton 3.6 (docs/bench/session34/ws_bisect.py); this one does not depend on it.

Compiled for SM90 on the CPU under Triton 3.6 and 3.9 (12 warps, 8 wgmma, 2 TMA loads a K-block,
115 / 148 KiB of shared memory at 3 / 4 stages, no spills); **never run on a GPU**. On one:

    python docs/bench/session34/gluon_ws_probe.py     (its output against float64 of the dequantized
                                                       operands, then TFLOP/s beside bf16 torch.mm)

Next, if it is right and fast: the grouped forms (rows and wgrad) in core/precision/fp8_gluon.py's
contracts, persistent, and BN 256 (the consumers' 232 registers allow a 64 x 256 fp32 accumulator)."""
import os
import sys

import torch
import triton

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# gl.warp_specialize passes its partitions' arguments as runtime values: a constexpr (BN, NUM_BUF) or a
# layout handed through them arrives as a tensor, and a layout built inside a partition from list
# literals fails (they become tuples). So the partitions read their sizes from the shared buffers'
# shapes and their layouts from these module-level constexprs (Triton 3.6 and 3.9 alike).
MMA_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32]))
STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _producer(a_desc, b_desc, row0, col0, nk, a_bufs, b_bufs, ready, empty):
    BK: gl.constexpr = a_desc.block_type.shape[1]
    NUM_BUF: gl.constexpr = a_bufs.shape[0]
    for j in range(nk):
        i = j % NUM_BUF
        mbarrier.wait(empty.index(i), ((j // NUM_BUF) & 1) ^ 1)  # the first round passes
        bar = ready.index(i)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        _tma_load(a_desc, [row0, j * BK], bar, a_bufs.index(i))
        _tma_load(b_desc, [col0, j * BK], bar, b_bufs.index(i))


@gluon.jit
def _consumer(HALF: gl.constexpr, nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, sb_ptr, row0, col0, c_ptr, s_cm,
              M, N):
    NUM_BUF: gl.constexpr = a_bufs.shape[0]
    BN: gl.constexpr = b_bufs.shape[1]
    mma_layout: gl.constexpr = MMA_LAYOUT
    layout: gl.constexpr = STORE_LAYOUT
    offs_m = row0 + HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma_layout))
    sa_ptrs = sa_ptr + gl.minimum(offs_m, M - 1).to(gl.int64) * s_sam
    acc = gl.zeros((64, BN), dtype=gl.float32, layout=mma_layout)
    zero = gl.zeros((64, BN), dtype=gl.float32, layout=mma_layout)
    for j in range(nk):
        i = j % NUM_BUF
        mbarrier.wait(ready.index(i), (j // NUM_BUF) & 1)
        a = a_bufs.index(i).slice(HALF * 64, 64, dim=0)
        d = warpgroup_mma(a, b_bufs.index(i).permute((1, 0)), zero, use_acc=False, is_async=True)
        sa = gl.load(sa_ptrs + j)
        sb = gl.load(sb_ptr + (col0 // 128) * nk + j)
        d = warpgroup_mma_wait(0, deps=(d, ))
        mbarrier.arrive(empty.index(i), count=1)
        acc = acc + d * (sa * sb)[:, None]
    out = gl.convert_layout(acc.to(gl.bfloat16), layout)
    om = row0 + HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    on = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    gl.store(c_ptr + om[:, None].to(gl.int64) * s_cm + on[None, :], out, mask=(om < M)[:, None] & (on < N)[None, :])


@gluon.jit
def _consumer0(nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, sb_ptr, row0, col0, c_ptr, s_cm, M, N):
    _consumer(0, nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, sb_ptr, row0, col0, c_ptr, s_cm, M, N)


@gluon.jit
def _consumer1(nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, sb_ptr, row0, col0, c_ptr, s_cm, M, N):
    _consumer(1, nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, sb_ptr, row0, col0, c_ptr, s_cm, M, N)


@gluon.jit
def ws_gemm_kernel(a_desc, b_desc, sa_ptr, sb_ptr, c_ptr, M, N, K, s_sam, s_cm,
                   NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(BM == 128, "two 64-row consumers")
    row0 = gl.program_id(1) * BM
    col0 = gl.program_id(0) * BN
    nk = K // BK
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUF] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
    cargs = (nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, sb_ptr, row0, col0, c_ptr, s_cm, M, N)
    gl.warp_specialize([(_consumer0, cargs), (_consumer1, cargs),
                        (_producer, (a_desc, b_desc, row0, col0, nk, a_bufs, b_bufs, ready, empty))],
                       [4, 1], [232, 40])


def descriptor(t, block):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block, layout)


def ws_gemm(a_q, sa, b_q, sb, bufs=4):
    """a_q [M, K] e4m3 with sa [M, K / 128]; b_q [N, K] e4m3 with sb [N / 128, K / 128] -> bf16 [M, N]."""
    M, K = a_q.shape
    N = b_q.shape[0]
    c = torch.empty(M, N, dtype=torch.bfloat16, device=a_q.device)
    grid = (triton.cdiv(N, 128), triton.cdiv(M, 128))
    ws_gemm_kernel[grid](descriptor(a_q, [128, 128]), descriptor(b_q, [128, 128]), sa, sb, c, M, N, K,
                         sa.stride(0), c.stride(0), NUM_BUF=bufs, num_warps=4)
    return c


def main():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    from moetron.core.precision.blockwise import (dequantize_1x128, dequantize_128x128, quantize_1x128,
                                                  quantize_128x128)

    torch.manual_seed(0)
    for M, N, K in ((256, 256, 512), (8192, 8192, 4096)):
        a = torch.randn(M, K, device="cuda") * torch.logspace(-1, 1, K, device="cuda")[torch.randperm(K, device="cuda")]
        b = torch.randn(N, K, device="cuda")
        a_q, sa = quantize_1x128(a, -1)
        b_q, sb = quantize_128x128(b)
        ref = (dequantize_1x128(a_q, sa, -1).double() @ dequantize_128x128(b_q, sb).double().T)
        sa, sb = sa.contiguous(), sb.contiguous()  # the kernel reads them row-major
        for bufs in (3, 4):
            out = ws_gemm(a_q, sa, b_q, sb, bufs)
            err = float((out.double() - ref).abs().max() / ref.abs().max())
            ms = triton.testing.do_bench(lambda: ws_gemm(a_q, sa, b_q, sb, bufs), warmup=10, rep=50)
            print(f"M {M} N {N} K {K} bufs {bufs}: max error {err:.2e} of the largest output "
                  f"({'right' if err < 1e-2 else 'WRONG'}), {ms:.3f} ms, {2 * M * N * K / ms / 1e9:.0f} TFLOP/s")
        ab, bb = a.bfloat16(), b.bfloat16()
        ms = triton.testing.do_bench(lambda: ab @ bb.T, warmup=10, rep=50)
        print(f"M {M} N {N} K {K} bf16 torch.mm: {ms:.3f} ms, {2 * M * N * K / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
