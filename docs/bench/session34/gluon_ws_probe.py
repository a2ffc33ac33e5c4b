"""Session 34's probe for #14's grouped target (not product code): an FP8 blockwise dense GEMM
(1x128 activation scales, 128x128 weight scales, fp32 promotion a K-block) with the warp
specialization written by hand in Gluon, as DeepGEMM structures it: a 1-warp TMA producer (padded to
a warpgroup) and two 4-warp consumers on the two 64-row halves of a 128 x 128 tile, sharing B, each
waiting for its own wgmma and promoting it while the other consumer's wgmma runs; setmaxnreg gives the
consumers 232 registers. Triton's automatic specialization of the same structure is wrong under
Triton 3.6 (docs/bench/session34/ws_bisect.py); this one does not depend on it.

``ws_rows_kernel`` is the same tile in the grouped rows form (fp8_triton.fp8_grouped_mm_rows's
contract: forward and dgrad; row tiles from fp8_triton_ws's tile table), ``ws_k_kernel`` in the
wgrad form (fp8_triton.fp8_grouped_mm_k's: per-row A and per-column Bt scales, each expert's padded
rows its K range, fp32 out).

All three compiled for SM90 on the CPU under Triton 3.6 and 3.9 (12 warps, 8 wgmma and 2 TMA loads a
K-block, 115 / 148 KiB of shared memory at 3 / 4 stages, 160 / 192 KiB for the wgrad's fp32
epilogue, 16-byte stores, no spills); **never run on a GPU**. On one:

    python docs/bench/session34/gluon_ws_probe.py     (each against float64 of the dequantized
                                                       operands or the masked kernel, then TFLOP/s
                                                       beside bf16 and the pipelined kernel)

Next, if they are right and fast: persistence and BN 256 (the consumers' 232 registers allow a
64 x 256 fp32 accumulator), then into core/precision/fp8_gluon.py behind fp8_experts=gluon."""
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
STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))  # bf16 out: 8 columns a thread
K_STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0]))
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _producer(a_desc, b_desc, row0, col0, kb0, nk, a_bufs, b_bufs, ready, empty):
    """TMA loads of K-blocks kb0 .. kb0 + nk - 1 of A (rows from row0) and B (rows from col0) into the
    ring, each stage once both consumers released it."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    NUM_BUF: gl.constexpr = a_bufs.shape[0]
    for j in range(nk):
        i = j % NUM_BUF
        mbarrier.wait(empty.index(i), ((j // NUM_BUF) & 1) ^ 1)  # the first round passes
        bar = ready.index(i)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        _tma_load(a_desc, [row0, (kb0 + j) * BK], bar, a_bufs.index(i))
        _tma_load(b_desc, [col0, (kb0 + j) * BK], bar, b_bufs.index(i))


@gluon.jit
def _ring(a_desc, b_desc, NUM_BUF: gl.constexpr):
    """NUM_BUF stages of A's 128-row and B's tiles in shared memory, a "ready" barrier each (the TMA
    loads landed) and an "empty" one (both consumers done with the stage)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUF] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
    return a_bufs, b_bufs, ready, empty


@gluon.jit
def _rows_consumer(HALF: gl.constexpr, nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_ptr, s_sbk,
                   row0, row_end, col0, c_ptr, s_cm, R, N):
    """The grouped rows form's consumer: rows row0 + HALF * 64 .. of one expert's row tile (stored
    below row_end), the tile's one B scale a K-block at sb_ptr + j * s_sbk (BN = 128)."""
    NUM_BUF: gl.constexpr = a_bufs.shape[0]
    BN: gl.constexpr = b_bufs.shape[1]
    mma_layout: gl.constexpr = MMA_LAYOUT
    layout: gl.constexpr = STORE_LAYOUT
    offs_m = row0 + HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma_layout))
    sa_ptrs = sa_ptr + gl.minimum(offs_m, R - 1).to(gl.int64) * s_sam  # rows past R: read, never stored
    acc = gl.zeros((64, BN), dtype=gl.float32, layout=mma_layout)
    zero = gl.zeros((64, BN), dtype=gl.float32, layout=mma_layout)
    for j in range(nk):
        i = j % NUM_BUF
        mbarrier.wait(ready.index(i), (j // NUM_BUF) & 1)
        a = a_bufs.index(i).slice(HALF * 64, 64, dim=0)
        d = warpgroup_mma(a, b_bufs.index(i).permute((1, 0)), zero, use_acc=False, is_async=True)
        sa = gl.load(sa_ptrs + j * s_sak)
        sb = gl.load(sb_ptr + j * s_sbk)
        d = warpgroup_mma_wait(0, deps=(d, ))
        mbarrier.arrive(empty.index(i), count=1)
        acc = acc + d * (sa * sb)[:, None]
    out = gl.convert_layout(acc.to(gl.bfloat16), layout)
    om = row0 + HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    on = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    gl.store(c_ptr + om[:, None].to(gl.int64) * s_cm + on[None, :], out,
             mask=(om < row_end)[:, None] & (on < N)[None, :])


@gluon.jit
def _rows_consumer0(nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_ptr, s_sbk, row0, row_end, col0,
                    c_ptr, s_cm, R, N):
    _rows_consumer(0, nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_ptr, s_sbk, row0, row_end, col0,
                   c_ptr, s_cm, R, N)


@gluon.jit
def _rows_consumer1(nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_ptr, s_sbk, row0, row_end, col0,
                    c_ptr, s_cm, R, N):
    _rows_consumer(1, nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_ptr, s_sbk, row0, row_end, col0,
                   c_ptr, s_cm, R, N)


@gluon.jit
def ws_gemm_kernel(a_desc, b_desc, sa_ptr, sb_ptr, c_ptr, M, N, K, s_sam, s_cm,
                   NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
    """The dense GEMM: A [M, K] with scales [M, K / 128] times B [N, K]^T with scales [N / 128,
    K / 128] (both row-major), bf16 out; the rows form's consumers on one group of M rows."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(BM == 128, "two 64-row consumers")
    gl.static_assert(BN == BK, "one B scale a K-block")
    row0 = gl.program_id(1) * BM
    col0 = gl.program_id(0) * BN
    nk = K // BK
    a_bufs, b_bufs, ready, empty = _ring(a_desc, b_desc, NUM_BUF)
    cargs = (nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, 1, sb_ptr + (col0 // BK) * nk, 1, row0, M, col0, c_ptr,
             s_cm, M, N)
    gl.warp_specialize([(_rows_consumer0, cargs), (_rows_consumer1, cargs),
                        (_producer, (a_desc, b_desc, row0, col0, 0, nk, a_bufs, b_bufs, ready, empty))],
                       [4, 1], [232, 40])


@gluon.jit
def ws_rows_kernel(a_desc, b_desc, sa_ptr, sb_ptr, tile_ptr, c_ptr, E, R, N, K, s_sam, s_sak, s_sbe, s_sbk, s_sbn,
                   s_cm, NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
    """fp8_triton.fp8_grouped_mm_rows's GEMM (forward / dgrad: out[rows of e] = A[rows of e] @ B[e]) for
    one (row tile, 128 columns) a program, B stacked [E * N, K]; the row tile's (expert, first row or
    -1 past the last tile, end row) from the table fp8_triton_ws's tile-table kernel writes (BM 128)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(BM == 128, "two 64-row consumers")
    gl.static_assert(BN == BK, "one B scale a K-block")
    col0 = gl.program_id(0) * BN
    tile = gl.program_id(1)
    group = gl.minimum(gl.load(tile_ptr + 3 * tile), E - 1)
    first = gl.load(tile_ptr + 3 * tile + 1)
    row_end = gl.where(first < 0, 0, gl.load(tile_ptr + 3 * tile + 2))
    nk = gl.where(first < 0, 0, K // BK)  # past the last tile: no K-block, nothing stored
    row0 = gl.maximum(first, 0)
    sb_tile = sb_ptr + group.to(gl.int64) * s_sbe + (col0 // BK) * s_sbn
    a_bufs, b_bufs, ready, empty = _ring(a_desc, b_desc, NUM_BUF)
    cargs = (nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_tile, s_sbk, row0, row_end, col0, c_ptr,
             s_cm, R, N)
    gl.warp_specialize([(_rows_consumer0, cargs), (_rows_consumer1, cargs),
                        (_producer, (a_desc, b_desc, row0, group * N + col0, 0, nk, a_bufs, b_bufs, ready, empty))],
                       [4, 1], [232, 40])


@gluon.jit
def _k_consumer(HALF: gl.constexpr, nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_ptr, s_sbn, s_sbk,
                kb0, row0, col0, c_ptr, s_cm, M, N):
    """The wgrad form's consumer: output rows row0 + HALF * 64 .. of one expert, K-blocks kb0 ..
    kb0 + nk - 1, a scale a row of A and a column of Bt each K-block."""
    NUM_BUF: gl.constexpr = a_bufs.shape[0]
    BN: gl.constexpr = b_bufs.shape[1]
    mma_layout: gl.constexpr = MMA_LAYOUT
    offs_m = row0 + HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma_layout))
    offs_n = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
    sa_ptrs = sa_ptr + gl.minimum(offs_m, M - 1).to(gl.int64) * s_sam
    sb_ptrs = sb_ptr + gl.minimum(offs_n, N - 1) * s_sbn
    acc = gl.zeros((64, BN), dtype=gl.float32, layout=mma_layout)
    zero = gl.zeros((64, BN), dtype=gl.float32, layout=mma_layout)
    for j in range(nk):
        i = j % NUM_BUF
        mbarrier.wait(ready.index(i), (j // NUM_BUF) & 1)
        a = a_bufs.index(i).slice(HALF * 64, 64, dim=0)
        d = warpgroup_mma(a, b_bufs.index(i).permute((1, 0)), zero, use_acc=False, is_async=True)
        sa = gl.load(sa_ptrs + (kb0 + j) * s_sak)
        sb = gl.load(sb_ptrs + (kb0 + j) * s_sbk)
        d = warpgroup_mma_wait(0, deps=(d, ))
        mbarrier.arrive(empty.index(i), count=1)
        acc = acc + d * sa[:, None] * sb[None, :]
    out = gl.convert_layout(acc, K_STORE_LAYOUT)  # fp32 out: 4 columns a thread (16 bytes)
    om = row0 + HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, K_STORE_LAYOUT))
    on = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, K_STORE_LAYOUT))
    gl.store(c_ptr + om[:, None].to(gl.int64) * s_cm + on[None, :], out, mask=(om < M)[:, None] & (on < N)[None, :])


@gluon.jit
def _k_consumer0(nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_ptr, s_sbn, s_sbk, kb0, row0, col0,
                 c_ptr, s_cm, M, N):
    _k_consumer(0, nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_ptr, s_sbn, s_sbk, kb0, row0, col0,
                c_ptr, s_cm, M, N)


@gluon.jit
def _k_consumer1(nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_ptr, s_sbn, s_sbk, kb0, row0, col0,
                 c_ptr, s_cm, M, N):
    _k_consumer(1, nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_ptr, s_sbn, s_sbk, kb0, row0, col0,
                c_ptr, s_cm, M, N)


@gluon.jit
def ws_k_kernel(a_desc, b_desc, sa_ptr, sb_ptr, off_ptr, c_ptr, M, N, s_sam, s_sak, s_sbn, s_sbk, s_ce, s_cm,
                NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
    """fp8_triton.fp8_grouped_mm_k's GEMM (wgrad: out[e] = A[:, rows of e] @ Bt[:, rows of e]^T over each
    expert's rows padded to 128s) for one (expert, 128 x BN output tile) a program."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(BM == 128, "two 64-row consumers")
    col0 = gl.program_id(0) * BN
    row0 = gl.program_id(1) * BM
    e = gl.program_id(2)
    start = gl.load(off_ptr + e - 1, mask=e > 0, other=0)
    kb0 = start // BK
    nk = gl.load(off_ptr + e) // BK - kb0  # an expert without rows: no K-block, zeros stored
    a_bufs, b_bufs, ready, empty = _ring(a_desc, b_desc, NUM_BUF)
    cargs = (nk, a_bufs, b_bufs, ready, empty, sa_ptr, s_sam, s_sak, sb_ptr, s_sbn, s_sbk, kb0, row0, col0,
             c_ptr + e.to(gl.int64) * s_ce, s_cm, M, N)
    gl.warp_specialize([(_k_consumer0, cargs), (_k_consumer1, cargs),
                        (_producer, (a_desc, b_desc, row0, col0, kb0, nk, a_bufs, b_bufs, ready, empty))],
                       [4, 1], [232, 40])


def ws_k(a_q, sa, bt_q, sbt, padded, bufs=4):
    """fp8_triton.fp8_grouped_mm_k's contract: a_q [M, P], sa [M, P / 128], bt_q [N, P], sbt [N, P / 128],
    padded int32 [E] (each expert's rows padded to 128s, cumulative) -> fp32 [E, M, N]."""
    M, P = a_q.shape
    N, E = bt_q.shape[0], padded.numel()
    out = torch.empty(E, M, N, dtype=torch.float32, device=a_q.device)
    ws_k_kernel[(triton.cdiv(N, 128), triton.cdiv(M, 128), E)](
        descriptor(a_q, [128, 128]), descriptor(bt_q, [128, 128]), sa, sbt, padded, out, M, N,
        sa.stride(0), sa.stride(1), sbt.stride(0), sbt.stride(1), out.stride(0), out.stride(1),
        NUM_BUF=bufs, num_warps=4)
    return out


def ws_rows(a_q, sa, b_EKN, sb_EBC, offsets, bufs=4):
    """fp8_triton.fp8_grouped_mm_rows's contract (bf16 out): a_q [R, K], sa [R, K / 128], b_EKN [E, K, N]
    with each B[e] K-contiguous and the experts back to back, sb_EBC [E, K / 128, N / 128]."""
    from moetron.core.precision import fp8_triton_ws as ws
    from moetron.core.precision.fp8_triton import stacked_b

    R, K = a_q.shape
    E, _, N = b_EKN.shape
    tiles = triton.cdiv(R, 128) + E
    table = torch.empty(tiles, 3, dtype=torch.int32, device=a_q.device)
    ws._fp8_grouped_gemm_tile_table_kernel[(tiles,)](offsets, table, E, BM=128, EP=triton.next_power_of_2(E))
    out = torch.empty(R, N, dtype=torch.bfloat16, device=a_q.device)
    ws_rows_kernel[(triton.cdiv(N, 128), tiles)](
        descriptor(a_q, [128, 128]), descriptor(stacked_b(b_EKN), [128, 128]), sa, sb_EBC, table, out, E, R, N, K,
        sa.stride(0), sa.stride(1), sb_EBC.stride(0), sb_EBC.stride(1), sb_EBC.stride(2), out.stride(0),
        NUM_BUF=bufs, num_warps=4)
    return out


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
    grouped()


def grouped():
    """The grouped rows form against fp8_triton's masked kernel (ragged experts, an empty one, rows past
    the end), then at OLMoE's gate|up (131,072 rows x K 2048 -> N 2048 over 64 experts) beside the
    pipelined kernel and bf16 torch._grouped_mm."""
    from moetron.core.precision import fp8_triton as ft
    from moetron.core.precision.blockwise import quantize_128x128, quantize_1x128

    for R, K, N, E in ((1000, 512, 256, 5), (131072, 2048, 2048, 64)):
        g = torch.Generator().manual_seed(1)
        cuts = sorted(torch.randint(0, R - 20, (E - 1,), generator=g).tolist())
        cuts[0] = cuts[1]  # an empty expert
        offsets = torch.tensor([*cuts, R - 20], dtype=torch.int32, device="cuda")  # 20 rows past the end
        x = torch.randn(R, K, device="cuda") * torch.logspace(-1, 1, K, device="cuda")[torch.randperm(K, device="cuda")]
        w = torch.randn(E, N, K, device="cuda")
        a_q, sa = quantize_1x128(x, -1)
        w_q, w_s = quantize_128x128(w)
        b, sb = w_q.transpose(1, 2), w_s.transpose(1, 2)  # [E, K, N] K-contiguous, [E, K / 128, N / 128]
        ref = ft.fp8_grouped_mm_rows(a_q, sa, b, sb, offsets, torch.float32, kernel=ft.GroupedKernel.masked)
        valid = torch.arange(R, device="cuda") < int(offsets[-1])
        for bufs in (3, 4):
            out = ws_rows(a_q, sa, b, sb, offsets, bufs)
            err = float((out.float() - ref)[valid].abs().max() / ref[valid].abs().max())
            ms = triton.testing.do_bench(lambda: ws_rows(a_q, sa, b, sb, offsets, bufs), warmup=10, rep=50)
            print(f"grouped R {R} K {K} N {N} E {E} bufs {bufs}: max error {err:.2e} "
                  f"({'right' if err < 1e-2 else 'WRONG'}), {ms:.3f} ms, {2 * R * K * N / ms / 1e9:.0f} TFLOP/s")
        ms = triton.testing.do_bench(lambda: ft.fp8_grouped_mm_rows(a_q, sa, b, sb, offsets, torch.bfloat16,
                                                                    kernel=ft.GroupedKernel.pipelined),
                                     warmup=10, rep=50)
        print(f"grouped pipelined Triton: {ms:.3f} ms, {2 * R * K * N / ms / 1e9:.0f} TFLOP/s")
        # the wgrad form at the same shape: dW[e] = dy[rows of e]^T x[rows of e], rows padded to 128s
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        padded = torch.cumsum((counts + 127) // 128 * 128, 0).to(torch.int32)
        P = int(padded[-1])
        ka_q, ka_s = quantize_1x128(torch.randn(N, P, device="cuda"), -1)
        kb_q, kb_s = quantize_1x128(torch.randn(K, P, device="cuda"), -1)
        k_ref = ft.fp8_grouped_mm_k(ka_q, ka_s, kb_q, kb_s, padded, kernel=ft.GroupedKernel.masked)
        for bufs in (3, 4):
            out = ws_k(ka_q, ka_s, kb_q, kb_s, padded, bufs)
            err = float((out - k_ref).abs().max() / k_ref.abs().max())
            ms = triton.testing.do_bench(lambda: ws_k(ka_q, ka_s, kb_q, kb_s, padded, bufs), warmup=10, rep=50)
            print(f"grouped wgrad M {N} N {K} P {P} E {E} bufs {bufs}: max error {err:.2e} "
                  f"({'right' if err < 1e-2 else 'WRONG'}), {ms:.3f} ms, {2 * N * K * P / ms / 1e9:.0f} TFLOP/s")
        ms = triton.testing.do_bench(lambda: ft.fp8_grouped_mm_k(ka_q, ka_s, kb_q, kb_s, padded,
                                                                 kernel=ft.GroupedKernel.pipelined), warmup=10, rep=50)
        print(f"grouped wgrad pipelined Triton: {ms:.3f} ms, {2 * N * K * P / ms / 1e9:.0f} TFLOP/s")
        xb, wb = x.bfloat16(), w.transpose(1, 2).bfloat16()
        try:
            ms = triton.testing.do_bench(lambda: torch._grouped_mm(xb, wb, offs=offsets), warmup=10, rep=50)
            print(f"grouped bf16 _grouped_mm: {ms:.3f} ms, {2 * R * K * N / ms / 1e9:.0f} TFLOP/s")
        except RuntimeError as e:  # its layout rules vary by version: the row is a reference only
            print(f"grouped bf16 _grouped_mm: not run ({str(e)[:120]})")


if __name__ == "__main__":
    main()
