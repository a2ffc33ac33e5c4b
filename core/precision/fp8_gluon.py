"""The FP8 blockwise grouped GEMMs of fp8_triton.py written in Gluon for SM90 (Hopper): explicit
asynchronous wgmma, so that the fp32 promotion of one K-block's partial product (scaled by its
1x128 / 128x128 scales and added to the accumulator) runs on the CUDA cores while the tensor cores
already compute the next K-block's. Triton's own pipeliner cannot do this: a dot whose result is
scaled before it is accumulated is waited for at once (wgmma.wait_group 0), so the tensor cores idle
during every promotion (session 6 and 7: 770 TFLOP/s forward, ~500 wgrad, against ~1,050 for cuBLAS's
blockwise GEMM on the same shapes).

Each program owns one [BM, BN] output tile and runs one warpgroup per 64 rows. K-blocks go in pairs:

    wait for K-blocks j and j+1's TMA loads   (NUM_BUF-deep ring of A / B tiles in shared memory)
    issue wgmma j and wgmma j+1               (async, each into fresh registers)
    wait until only wgmma j+1 is in flight    (j done; its buffers take K-block j+NUM_BUF)
    acc += d[j] * scale[j]                    (overlaps wgmma j+1)
    wait for wgmma j+1; its buffers refilled; acc += d[j+1] * scale[j+1]

so two partial products and the accumulator live in registers at once (3 x BM x BN fp32 over the
warps). No product stays in flight across the loop's back edge: one that did (the first version,
session 10's call 3) is copied between registers at the edge, ptxas then serializes every wgmma of
the kernel (its C7514 / C7515 notes: a wait after each instruction), and the kernel measured
0.66-0.89x the Triton pipelined one. tests/core/test_fp8_gluon.py runs ptxas on each config and fails
on those notes.

- ``gluon_grouped_mm_rows``: the same contract as ``fp8_triton.fp8_grouped_mm_rows`` (forward,
  dgrad) where B[e] is K-contiguous and the experts lie back to back (TMA descriptors).
- ``gluon_grouped_mm_k``: the same contract as ``fp8_triton.fp8_grouped_mm_k`` (wgrad).

SM90 only (wgmma does not exist on SM100; Blackwell runs fp8_triton's kernels or native MX). Gluon has
no interpreter: the CPU tests compile both kernels for sm_90 (ptxas included, no GPU needed:
tests/core/test_fp8_gluon.py) and the GPU tests compare them with the Triton kernels and float64.
Legend: R rows, P padded rows, E experts.
"""

from __future__ import annotations

import torch
import triton

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # the TMA load's name: async_copy_global_to_shared up to Triton 3.6, async_load after
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after Triton 3.6
    AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton
    AVAILABLE = False

__all__ = ["AVAILABLE", "CONFIG", "K_CONFIG", "GluonConfig", "gluon_grouped_mm_k", "gluon_grouped_mm_rows",
           "k_descriptors", "rows_descriptors", "supported"]

BLOCK_K = 128


class GluonConfig(tuple):
    """(BM, BN, num_warps, NUM_BUF): one warpgroup per 64 rows of the tile."""

    def __new__(cls, bm: int, bn: int, warps: int, bufs: int):
        if bm != 16 * warps:
            raise ValueError(f"BM ({bm}) must be 16 x num_warps ({warps}): one warpgroup per 64 rows")
        return super().__new__(cls, (bm, bn, warps, bufs))

    @property
    def name(self) -> str:
        bm, bn, w, s = self
        return f"BM{bm} BN{bn} w{w} s{s} gluon"


CONFIG = GluonConfig(64, 128, 4, 4)
"""The rows kernel's tile: 64 x 128 on one warpgroup (two programs resident per SM at 224 registers;
64 x 64 leaves room for more, at a narrower wgmma)."""
K_CONFIG = GluonConfig(64, 64, 4, 4)
"""The wgrad kernel's tile: BN 64, as the per-column B scales of a 64 x 128 tile spill (255 registers
and a stack on SM90)."""


def supported(device: torch.device | None = None) -> bool:
    """Gluon importable and the GPU an SM90 (the one architecture with wgmma)."""
    if not AVAILABLE or not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


if AVAILABLE:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _row_tile(off_ptr, tile, E, BM: gl.constexpr, EP: gl.constexpr, num_warps: gl.constexpr):
        """(expert, first row, end row) of row tile ``tile`` (tiles laid out expert after expert),
        first row -1 past the last tile: fp8_triton._row_tile in Gluon."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        e = gl.arange(0, EP, layout=layout)
        ends = gl.load(off_ptr + e, mask=e < E, other=0)
        starts = gl.load(off_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
        n_tiles = (ends - starts + BM - 1) // BM
        last_tile = gl.associative_scan(n_tiles, 0, _add)  # one past each expert's last tile
        group = gl.sum((last_tile <= tile).to(gl.int32), 0)
        this = e == group
        first_tile = gl.sum(gl.where(this, last_tile - n_tiles, 0), 0)
        row0 = gl.sum(gl.where(this, starts, 0), 0) + (tile - first_tile) * BM
        return group, gl.where(group < E, row0, -1), gl.sum(gl.where(this, ends, 0), 0)

    @gluon.jit
    def _issue_loads(a_desc, b_desc, a_row, b_row, kb, j, bars, a_bufs, b_bufs, NUM_BUF: gl.constexpr, pred):
        """TMA loads of K-block ``kb`` (the loop's j-th; A rows from a_row, B rows from b_row) into
        buffer j % NUM_BUF."""
        BK: gl.constexpr = a_desc.block_type.shape[1]
        i = j % NUM_BUF
        bar = bars.index(i)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
        _tma_load(a_desc, [a_row, kb * BK], bar, a_bufs.index(i), pred)
        _tma_load(b_desc, [b_row, kb * BK], bar, b_bufs.index(i), pred)

    @gluon.jit
    def _issue_mma(j, bars, a_bufs, b_bufs, regs, NUM_BUF: gl.constexpr):
        """Once the loop's j-th K-block has landed, its wgmma, asynchronous, into a fresh product
        (``regs`` not read: use_acc=False)."""
        slot = j % NUM_BUF
        mbarrier.wait(bars.index(slot), (j // NUM_BUF) & 1)
        return warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), regs, use_acc=False,
                             is_async=True)

    @gluon.jit
    def _scales(sa_ptrs, s_sak, sb_ptrs, s_sbk, kb):
        return gl.load(sa_ptrs + kb * s_sak), gl.load(sb_ptrs + kb * s_sbk)

    @gluon.jit
    def _promote(done, acc, sa, sb, PER_COL_SB: gl.constexpr):
        """acc + one K-block's partial product times its scales (fp32)."""
        if PER_COL_SB:
            out = acc + done * sa[:, None] * sb[None, :]
        else:
            out = acc + done * (sa * sb)[:, None]
        return out

    @gluon.jit
    def _retire(done, acc, sa, sb, a_desc, b_desc, a_row, b_row, kb0, j, nk, bars, a_bufs, b_bufs,
                PER_COL_SB: gl.constexpr, NUM_BUF: gl.constexpr):
        """The loop's j-th K-block is done: its buffers take K-block j + NUM_BUF (once every warpgroup is
        past it), and its product is promoted into acc."""
        _cta_barrier()
        _issue_loads(a_desc, b_desc, a_row, b_row, kb0 + j + NUM_BUF, j + NUM_BUF, bars, a_bufs, b_bufs, NUM_BUF,
                     j + NUM_BUF < nk)
        return _promote(done, acc, sa, sb, PER_COL_SB)

    @gluon.jit
    def _mainloop(a_desc, b_desc, a_row, b_row, kb0, nk, sa_ptrs, s_sak, sb_ptrs, s_sbk,
                  mma_layout: gl.constexpr, PER_COL_SB: gl.constexpr, NUM_BUF: gl.constexpr):
        """sum over K-blocks kb0 .. kb0+nk-1 of (A_kb @ B_kb^T) * sa[:, kb] * sb[kb] in fp32
        (``PER_COL_SB``: sb a vector over the tile's columns, else one scalar), A [BM, BK] tiles of
        a_desc from row a_row, B [BN, BK] tiles of b_desc from row b_row. nk >= 1."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUF] + b_desc.block_type.shape, b_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(NUM_BUF):  # every buffer filled: K-block j lands in buffer j % NUM_BUF
            _issue_loads(a_desc, b_desc, a_row, b_row, kb0 + i, i, bars, a_bufs, b_bufs, NUM_BUF, i < nk)

        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        zero = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        # K-blocks in pairs: both wgmmas issued, the first's promotion overlapping the second's MMA.
        # No product stays in flight across the loop's back edge: a loop-carried one is copied between
        # registers at the edge, and ptxas then serializes every wgmma of the kernel (C7514).
        for p in range(0, nk // 2):
            j = 2 * p
            d0 = _issue_mma(j, bars, a_bufs, b_bufs, zero, NUM_BUF)
            d1 = _issue_mma(j + 1, bars, a_bufs, b_bufs, zero, NUM_BUF)
            sa0, sb0 = _scales(sa_ptrs, s_sak, sb_ptrs, s_sbk, kb0 + j)
            sa1, sb1 = _scales(sa_ptrs, s_sak, sb_ptrs, s_sbk, kb0 + j + 1)
            done0 = warpgroup_mma_wait(1, deps=(d0, ))  # K-block j done, j + 1 in flight
            acc = _retire(done0, acc, sa0, sb0, a_desc, b_desc, a_row, b_row, kb0, j, nk, bars, a_bufs, b_bufs,
                          PER_COL_SB, NUM_BUF)
            done1 = warpgroup_mma_wait(0, deps=(d1, ))
            acc = _retire(done1, acc, sa1, sb1, a_desc, b_desc, a_row, b_row, kb0, j + 1, nk, bars, a_bufs, b_bufs,
                          PER_COL_SB, NUM_BUF)
        if nk % 2 == 1:  # the last K-block alone
            d0 = _issue_mma(nk - 1, bars, a_bufs, b_bufs, zero, NUM_BUF)
            sa0, sb0 = _scales(sa_ptrs, s_sak, sb_ptrs, s_sbk, kb0 + nk - 1)
            done0 = warpgroup_mma_wait(0, deps=(d0, ))
            acc = _promote(done0, acc, sa0, sb0, PER_COL_SB)
        for i in gl.static_range(NUM_BUF):
            mbarrier.invalidate(bars.index(i))
        return acc

    @gluon.jit
    def _store_tile(c_ptr, acc, row0, col0, s_cm, row_end, N, BM: gl.constexpr, BN: gl.constexpr,
                    num_warps: gl.constexpr):
        """acc [BM, BN] (the wgmma layout, two adjacent columns a thread) stored at c[row0:, col0:] for
        rows < row_end and columns < N, in 16-byte vectors: converted through shared memory to a
        layout where each thread holds 16 contiguous bytes of a row."""
        VEC: gl.constexpr = 128 // c_ptr.dtype.element_ty.primitive_bitwidth
        TPW_N: gl.constexpr = BN // VEC if BN // VEC < 32 else 32
        layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPW_N, TPW_N], [num_warps, 1], [1, 0])
        out = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), layout)
        offs_m = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        offs_n = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        c_ptrs = c_ptr + offs_m[:, None].to(gl.int64) * s_cm + offs_n[None, :]
        gl.store(c_ptrs, out, mask=(offs_m < row_end)[:, None] & (offs_n < N)[None, :])

    @gluon.jit
    def _gluon_rows_kernel(a_desc, sa_ptr, b_desc, sb_ptr, off_ptr, c_ptr, E, R, N, K,
                           s_sam, s_sak, s_sbe, s_sbk, s_sbn, s_cm,
                           EP: gl.constexpr, NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        gl.static_assert(BK % BN == 0, "one B scale per K-block: BN is a 128-column scale tile or a part of one")
        pid_n = gl.program_id(0)
        tile = gl.program_id(1)
        group, row0, row_end = _row_tile(off_ptr, tile, E, BM, EP, num_warps)
        if row0 >= 0:
            mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                 instr_shape=[16, BN, 32])
            row_l: gl.constexpr = gl.SliceLayout(1, mma_layout)
            offs_m = row0 + gl.arange(0, BM, layout=row_l)
            # rows past R read the last row's scales (TMA zero-fills their data); never stored
            sa_ptrs = sa_ptr + gl.minimum(offs_m, R - 1).to(gl.int64) * s_sam
            sb_ptrs = sb_ptr + group.to(gl.int64) * s_sbe + (pid_n * BN // BK) * s_sbn
            acc = _mainloop(a_desc, b_desc, row0, group * N + pid_n * BN, 0, K // BK, sa_ptrs, s_sak, sb_ptrs, s_sbk,
                            mma_layout, False, NUM_BUF)
            _store_tile(c_ptr, acc, row0, pid_n * BN, s_cm, row_end, N, BM, BN, num_warps)

    @gluon.jit
    def _gluon_k_kernel(a_desc, sa_ptr, b_desc, sb_ptr, off_ptr, c_ptr, M, N,
                        s_sam, s_sak, s_sbn, s_sbk, s_ce, s_cm,
                        NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        e = gl.program_id(2)
        start = gl.load(off_ptr + e - 1, mask=e > 0, other=0)
        end = gl.load(off_ptr + e)
        kb0 = start // BK
        nk = end // BK - kb0
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BN, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_l: gl.constexpr = gl.SliceLayout(0, mma_layout)
        offs_m = pid_m * BM + gl.arange(0, BM, layout=row_l)
        offs_n = pid_n * BN + gl.arange(0, BN, layout=col_l)
        if nk > 0:
            sa_ptrs = sa_ptr + gl.minimum(offs_m, M - 1).to(gl.int64) * s_sam
            sb_ptrs = sb_ptr + gl.minimum(offs_n, N - 1) * s_sbn  # int32 offsets: 32 registers fewer than int64 pointers
            acc = _mainloop(a_desc, b_desc, pid_m * BM, pid_n * BN, kb0, nk, sa_ptrs, s_sak, sb_ptrs, s_sbk,
                            mma_layout, True, NUM_BUF)
        else:  # an expert without rows: zero gradient
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        _store_tile(c_ptr + e.to(gl.int64) * s_ce, acc, pid_m * BM, pid_n * BN, s_cm, M, N, BM, BN, num_warps)


def _descriptor(t: torch.Tensor | None, block: list[int]):
    """A Gluon TMA descriptor of the 2-D e4m3 ``t`` with ``block``, or None where TMA cannot read it
    (fp8_triton.tma_readable)."""
    from .fp8_triton import tma_readable

    if t is None or not tma_readable(t):
        return None
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block, layout)


def _pair(a_desc, b_desc):
    return None if a_desc is None or b_desc is None else (a_desc, b_desc)


def rows_descriptors(a_RK: torch.Tensor, b_EKN: torch.Tensor, config: GluonConfig | None = None):
    """(A, B) descriptors of the rows kernel, or None where its operands do not allow them (B[e] not
    K-contiguous, experts not back to back, misaligned): the caller then runs fp8_triton's kernel."""
    from .fp8_triton import stacked_b

    if not AVAILABLE:
        return None
    bm, bn, _, _ = config or CONFIG  # the module's CONFIG read at each call: the benchmark sets it
    if b_EKN.shape[2] % bn:
        return None
    return _pair(_descriptor(a_RK, [bm, BLOCK_K]), _descriptor(stacked_b(b_EKN), [bn, BLOCK_K]))


def k_descriptors(a_MP: torch.Tensor, bt_NP: torch.Tensor, config: GluonConfig | None = None):
    """(A, Bt) descriptors of the wgrad kernel, or None where TMA cannot read them (not K-contiguous,
    misaligned): the caller then runs fp8_triton's kernel."""
    if not AVAILABLE:
        return None
    bm, bn, _, _ = config or K_CONFIG  # read at each call, as CONFIG
    return _pair(_descriptor(a_MP, [bm, BLOCK_K]), _descriptor(bt_NP, [bn, BLOCK_K]))


def gluon_grouped_mm_rows(a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out, descriptors=None,
                          config: GluonConfig | None = None, warmup: bool = False):
    """out[rows of e] = A[rows of e] @ B[e] (fp8_triton.fp8_grouped_mm_rows's contract; ``out``
    given, [R, N]); ``descriptors`` from rows_descriptors (made here when None). ``warmup``: compile
    only (no launch; the CPU tests). ``config`` default: CONFIG as it is at this call."""
    config = config or CONFIG
    bm, bn, warps, bufs = config
    R, K = a_RK.shape
    E, _, N = b_EKN.shape
    if BLOCK_K % bn:
        raise ValueError(f"the Gluon rows kernel's BN must divide {BLOCK_K} (one B scale per K-block), got {bn}")
    descriptors = descriptors or rows_descriptors(a_RK, b_EKN, config)
    if descriptors is None:
        raise ValueError("the Gluon rows kernel needs B[e] K-contiguous, the experts back to back and "
                         "16-byte aligned operands (fp8_triton's pipelined kernel takes any strides)")
    a_desc, b_desc = descriptors
    grid = (triton.cdiv(N, bn), triton.cdiv(R, bm) + E)
    args = (a_desc, sa_RB, b_desc, sb_EBC, offsets_E, out, E, R, N, K,
            sa_RB.stride(0), sa_RB.stride(1), sb_EBC.stride(0), sb_EBC.stride(1), sb_EBC.stride(2), out.stride(0))
    kw = dict(EP=triton.next_power_of_2(E), NUM_BUF=bufs, num_warps=warps)
    if warmup:
        return _gluon_rows_kernel.warmup(*args, grid=grid, **kw)
    _gluon_rows_kernel[grid](*args, **kw)
    return out


def gluon_grouped_mm_k(a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E, out, descriptors=None,
                       config: GluonConfig | None = None, warmup: bool = False):
    """out[e] = A[:, rows of e] @ Bt[:, rows of e]^T (fp8_triton.fp8_grouped_mm_k's contract; ``out``
    given, [E, M, N], its last dim contiguous); ``descriptors`` from k_descriptors (made here when
    None). ``config`` default: K_CONFIG as it is at this call."""
    config = config or K_CONFIG
    bm, bn, warps, bufs = config
    M, P = a_MP.shape
    N = bt_NP.shape[0]
    E = padded_offsets_E.numel()
    descriptors = descriptors or k_descriptors(a_MP, bt_NP, config)
    if descriptors is None or out.stride(2) != 1:
        raise ValueError("the Gluon wgrad kernel needs K-contiguous, 16-byte aligned A and Bt and a "
                         "row-major output (fp8_triton's pipelined kernel takes any strides)")
    a_desc, b_desc = descriptors
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), E)
    args = (a_desc, sa_MB, b_desc, sbt_NB, padded_offsets_E, out, M, N,
            sa_MB.stride(0), sa_MB.stride(1), sbt_NB.stride(0), sbt_NB.stride(1), out.stride(0), out.stride(1))
    kw = dict(NUM_BUF=bufs, num_warps=warps)
    if warmup:
        return _gluon_k_kernel.warmup(*args, grid=grid, **kw)
    _gluon_k_kernel[grid](*args, **kw)
    return out
