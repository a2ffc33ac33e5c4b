"""The FP8 blockwise grouped GEMMs of fp8_triton.py written in Gluon for SM90 (Hopper) and
warp-specialized by hand, as DeepGEMM structures them: so that the fp32 promotion of one K-block's
partial product (scaled by its 1x128 / 128x128 scales and added to the accumulator) runs on the CUDA
cores while the tensor cores compute another. Triton's own pipeliner cannot do this: a dot whose
result is scaled before it is accumulated is waited for at once, so the tensor cores idle during
every promotion (fp8_triton's pipelined kernels: 540-690 TFLOP/s at OLMoE's expert GEMMs on the H100).

Each CTA runs three partitions over a ring of NUM_BUF shared-memory stages (A's 128-row tile and B's
128-row tile of one 128-deep K-block, 32 KiB a stage), each stage with a "ready" barrier (its TMA
loads landed) and an "empty" one (both consumers done with it):

- a producer (one warp, 40 registers): the TMA loads of every K-block of every tile of the CTA, as
  far ahead as the ring allows;
- two consumers (a warpgroup each, 232 registers): the two 64-row halves of the 128 x 128 output
  tile, sharing B's stage. Each issues its wgmma, loads the K-block's scales behind it, waits, frees
  the stage and promotes; the other consumer's wgmma runs meanwhile, so the tensor cores stay busy.

The kernels are persistent (one CTA an SM, tiles a grid apart, the ring's phase carried from tile to
tile): the producer loads the next tile's first K-blocks while the consumers store the last one.
``GluonConfig.persistent`` off launches one CTA a tile instead (the measurement's other side).

Written by hand because Triton 3.6's automatic warp specialization of the same structure is wrong
for 128-row tiles split between two consumers (docs/bench/session34/ws_bisect.py; with 64-row tiles
it was right but 0.68x the pipelined kernels, and was removed: docs/precision.md).

- ``gluon_grouped_mm_rows``: fp8_triton.fp8_grouped_mm_rows's contract (forward, dgrad), where B[e]
  is K-contiguous and the experts lie back to back (TMA descriptors). The row tiles (expert, first
  row, end row) come from a table one small kernel writes first; a tile past the last runs no
  K-block and stores nothing.
- ``gluon_grouped_mm_k``: fp8_triton.fp8_grouped_mm_k's contract (wgrad; fp32 out, zeros for an
  expert without rows), per-row A and per-column Bt scales each K-block, laid out K-block-major: the
  producer brings each K-block's 128 + 128 scales into the stage by TMA beside the operand tiles and
  the consumers read them from shared memory (from global memory, 32 scattered loads a thread a
  K-block, the wgrad ran at 0.5x the rows kernels: session 36).

Both store their tiles by TMA (``GluonConfig.tma_store``): each consumer's 64 x 128 tile goes through
its own shared buffer and the store runs while the consumer starts the next tile.

Measured on the H100 (sessions 35-36, docs/performance.md; ``--loop 10``, the host's time hidden): the
rows kernels 937-1,080 TFLOP/s at OLMoE's expert GEMMs, 1.48-1.66x bf16 ``torch._grouped_mm``; the
wgrad 792 at OLMoE's gate|up, 1.19x bf16 and 1.24x the pipelined kernel. torch.compile sees the
launches only through the operators at the end of this module (core.precision.library).

SM90 only (wgmma does not exist on SM100; Blackwell runs fp8_triton's kernels or native MX). Gluon has
no interpreter: the CPU tests compile every kernel for sm_90 (ptxas included, no spills, no GPU
needed: tests/core/test_fp8_gluon.py) and the GPU tests compare them with the masked / pipelined
Triton kernels and float64. Legend: R rows, P padded rows, E experts, T row tiles.

Gluon's warp_specialize passes its partitions' arguments as runtime values: a constexpr or a layout
handed through them arrives as a tensor, and a layout built inside a partition from list literals
fails (they become tuples). So the partitions read their sizes from the shared buffers' shapes and
their layouts from module-level constexprs (Triton 3.6 and 3.9 alike).
"""

from __future__ import annotations

import functools

import torch
import triton

from . import fp8_triton
from .fp8_triton import k_output, rows_output, stacked_b, tma_readable
from .library import define_op

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # the TMA load's name: async_copy_global_to_shared up to Triton 3.6, async_load after
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton
    AVAILABLE = False

__all__ = ["AVAILABLE", "CONFIG", "K_CONFIG", "GluonConfig", "gluon_grouped_mm_k", "gluon_grouped_mm_rows",
           "k_descriptors", "rows_descriptors", "set_rows_group", "supported"]

BLOCK_M = 128  # two 64-row consumer warpgroups
BLOCK_N = 128  # one B scale tile: a consumer's 64 x 128 fp32 accumulator and partial product in 232 registers
BLOCK_K = 128


class GluonConfig(tuple):
    """(NUM_BUF, persistent, tma_store, group): the ring's stages (32 KiB each, 33 with the wgrad's scales; with
    its epilogue the rows kernel takes 144 / 160 KiB of shared memory at 4 stages with bf16 out, masked /
    TMA store, the wgrad's fp32 one 196 / 196), one CTA an SM looping over the tiles (else one CTA a
    tile), and the epilogue:
    ``tma_store`` writes each consumer's 64 x 128 tile into its own shared-memory buffer and stores it
    with TMA, asynchronously (the consumer goes on to the next tile's K-blocks and waits for the store
    only before it writes the buffer again; a partial tile, past an expert's last row, is stored
    masked from the same buffer), else the tile is stored from registers, masked, and the consumer
    waits for it.
    ``group`` (the rows kernel; the wgrad ignores it): the tiles' raster, row tile by row tile (1) or in
    groups of that many row tiles, column-major within a group (_tile_of), so the CTAs running at once
    share each B tile across the group's row tiles instead of re-reading an expert's whole B from HBM
    for every row tile where it exceeds L2 (olmoe3-4l-8e's gate|up: 32 MiB of e4m3 an expert). Measured
    (H100, session 40 calls 1 and 5, groups of 8 against 1): forward 1.01-1.05x, dgrad 0.95-1.05x in
    isolation, steps within noise; precision.fp8_gluon_group sets it (default 1)."""

    def __new__(cls, bufs: int = 4, persistent: bool = True, tma_store: bool = False, group: int = 1):
        if not 2 <= bufs <= 6:
            raise ValueError(f"the Gluon kernels' ring takes 2 to 6 stages of 32 KiB, got {bufs}")
        if not 1 <= group <= 64:
            raise ValueError(f"the rows kernel's raster groups take 1 to 64 row tiles, got {group}")
        return super().__new__(cls, (int(bufs), bool(persistent), bool(tma_store), int(group)))

    @property
    def name(self) -> str:
        bufs, persistent, tma_store, group = self
        return (f"BM128 BN128 s{bufs} ws{' persistent' if persistent else ''}{' tma-store' if tma_store else ''}"
                f"{f' g{group}' if group > 1 else ''} gluon")


MAX_K_BUFS = 4
"""The wgrad kernel's deepest ring: its stages are 33 KiB (the two operands' K-blocks and their scales)
and its fp32 epilogue takes 64 KiB (the TMA store's buffers, or the layout conversion): 5 stages would
need 229 KiB of the SM's 227; the rows kernel takes 6 (224 KiB with the TMA store's bf16 buffers)."""

CONFIG = GluonConfig(4, True, True)
"""The rows kernel's ring, launch and epilogue (the H100, session 36 call 1b, ``--loop 10``: the TMA store
1.01-1.13x the masked stores at 4 stages; 5 and 6 stages within 3% of 4)."""
K_CONFIG: GluonConfig | None = GluonConfig(4, True, True)
"""The wgrad kernel's ring, launch and epilogue; None: ``fp8_experts=gluon``'s wgrad runs fp8_triton's
pipelined kernel (which measured faster than session 35's Gluon wgrad, whose scales came from global
memory). tools/bench_fp8_variants.py sets it to time each."""


def set_rows_group(group: int) -> None:
    """The rows kernel's raster groups (GluonConfig.group; precision.fp8_gluon_group) from now on: CONFIG
    with ``group`` row tiles a group, its other fields kept. One module-level CONFIG: the backend built
    last sets it for every Gluon rows GEMM in the process."""
    global CONFIG
    CONFIG = GluonConfig(*CONFIG[:3], group)


def supported(device: torch.device | None = None) -> bool:
    """Gluon importable and the GPU an SM90 (the one architecture with wgmma). Asked twice per grouped
    GEMM on the training step's path: the device's answer is cached."""
    if not AVAILABLE or not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return False
    index = torch.device(device).index if device is not None else None
    return _is_sm90(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


if AVAILABLE:
    MMA_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 32]))
    STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))  # bf16: 16 bytes a thread
    K_STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0]))  # fp32: 16 bytes a thread
    SCALE_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    FLAT_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # a scale stage as a vector
    REINTERPRET_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # 3.6: _reinterpret

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
    def _gluon_tile_table_kernel(off_ptr, table_ptr, E, BM: gl.constexpr, EP: gl.constexpr, num_warps: gl.constexpr):
        """table[t] = row tile t's (expert, first row or -1 past the last tile, end row)."""
        tile = gl.program_id(0)
        group, row0, row_end = _row_tile(off_ptr, tile, E, BM, EP, num_warps)
        gl.store(table_ptr + 3 * tile, group)
        gl.store(table_ptr + 3 * tile + 1, row0)
        gl.store(table_ptr + 3 * tile + 2, row_end)

    @gluon.jit
    def _ring(a_desc, b_desc, NUM_BUF: gl.constexpr):
        """NUM_BUF stages of A's and B's tiles in shared memory, a "ready" barrier each (the TMA loads
        landed) and an "empty" one (both consumers done with the stage)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUF] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
        return a_bufs, b_bufs, ready, empty

    @gluon.jit
    def _load_tile(a_desc, b_desc, a_row, b_row, kb0, nk, c, a_bufs, b_bufs, ready, empty):
        """TMA loads of K-blocks kb0 .. kb0 + nk - 1 of A (rows from a_row) and B (rows from b_row), the
        ring's c-th stage onwards, each stage once both consumers released it; -> the next stage."""
        BK: gl.constexpr = a_desc.block_type.shape[1]
        NUM_BUF: gl.constexpr = a_bufs.shape[0]
        for j in range(nk):
            i = c % NUM_BUF
            mbarrier.wait(empty.index(i), ((c // NUM_BUF) & 1) ^ 1)  # the ring's first round passes
            bar = ready.index(i)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [a_row, (kb0 + j) * BK], bar, a_bufs.index(i))
            _tma_load(b_desc, [b_row, (kb0 + j) * BK], bar, b_bufs.index(i))
            c += 1
        return c

    @gluon.jit
    def _mma(HALF: gl.constexpr, c, a_bufs, b_bufs, ready):
        """The c-th stage's wgmma for this consumer's 64 rows, issued once its loads landed, into a fresh
        partial product (asynchronous)."""
        NUM_BUF: gl.constexpr = a_bufs.shape[0]
        BN: gl.constexpr = b_bufs.shape[1]
        i = c % NUM_BUF
        mbarrier.wait(ready.index(i), (c // NUM_BUF) & 1)
        zero = gl.zeros((64, BN), dtype=gl.float32, layout=MMA_LAYOUT)
        return warpgroup_mma(a_bufs.index(i).slice(HALF * 64, 64, dim=0), b_bufs.index(i).permute((1, 0)), zero,
                             use_acc=False, is_async=True)

    @gluon.jit
    def _accumulate(HALF: gl.constexpr, nk, c, a_bufs, b_bufs, ready, empty, sa_ptrs, s_sak, sb_ptrs, s_sbk):
        """This consumer's sum over a tile's nk K-blocks (the ring's c-th stage onwards) of its wgmma
        product times the K-block's scales, sa one a row and sb one scalar (the rows form). Each wgmma is
        waited for, its stage freed and its product promoted while the other consumer's wgmma runs.
        -> (the fp32 sum, the next stage)."""
        NUM_BUF: gl.constexpr = a_bufs.shape[0]
        BN: gl.constexpr = b_bufs.shape[1]
        acc = gl.zeros((64, BN), dtype=gl.float32, layout=MMA_LAYOUT)
        for j in range(nk):
            d = _mma(HALF, c, a_bufs, b_bufs, ready)
            sa = gl.load(sa_ptrs + j * s_sak)  # loaded while the wgmma runs
            sb = gl.load(sb_ptrs + j * s_sbk)
            d = warpgroup_mma_wait(0, deps=(d, ))
            mbarrier.arrive(empty.index(c % NUM_BUF), count=1)
            acc = acc + d * (sa * sb)[:, None]
            c += 1
        return acc, c

    # ----------------------------------------------------------------------------------------------
    # forward / dgrad: out[rows of e] = A[rows of e] @ B[e]
    # ----------------------------------------------------------------------------------------------

    @gluon.jit
    def _tile_of(t, T, n_n, GM):
        """Tile t's (row tile, column tile) of T row tiles by n_n column tiles: in groups of GM row tiles
        (fewer in the last), column-major within a group (GluonConfig.group; GM 1: row tile by row tile)."""
        per_group = GM * n_n
        first = (t // per_group) * GM
        gm = gl.minimum(T - first, GM)
        r = t % per_group
        return first + r % gm, r // gm

    @gluon.jit
    def _rows_producer(a_desc, b_desc, tile_ptr, N, K, T, GM, total, a_bufs, b_bufs, ready, empty):
        BN: gl.constexpr = b_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        n_n = (N + BN - 1) // BN
        c = 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            rt, ct = _tile_of(t, T, n_n, GM)
            first = gl.load(tile_ptr + 3 * rt + 1)
            group = gl.load(tile_ptr + 3 * rt)
            nk = gl.where(first < 0, 0, K // BK)  # past the last row tile: no K-block
            c = _load_tile(a_desc, b_desc, gl.maximum(first, 0), group * N + ct * BN, 0, nk, c, a_bufs,
                           b_bufs, ready, empty)

    @gluon.jit
    def _tma_epilogue(acc, c_desc, c_smem, row, col0, full):
        """TMA_STORE's epilogue: acc into this consumer's buffer (once the buffer's last TMA store has
        read it) and, for a ``full`` tile, its TMA store at (row, col0), left running (a partial one
        the caller stores masked, from the buffer)."""
        tma.store_wait(0)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        if full:
            _tma_store(c_desc, [row, col0], c_smem)

    @gluon.jit
    def _rows_store(out, c_ptr, s_cm, row, col0, row_end, N):
        """out (STORE_LAYOUT) at rows row .. row + 63 below row_end, columns col0 .. below N."""
        om = row + gl.arange(0, out.shape[0], layout=gl.SliceLayout(1, STORE_LAYOUT))
        on = col0 + gl.arange(0, out.shape[1], layout=gl.SliceLayout(0, STORE_LAYOUT))
        gl.store(c_ptr + om[:, None].to(gl.int64) * s_cm + on[None, :], out,
                 mask=(om < row_end)[:, None] & (on < N)[None, :])

    @gluon.jit
    def _rows_consumer(HALF: gl.constexpr, TMA_STORE: gl.constexpr, a_bufs, b_bufs, ready, empty, tile_ptr, sa_ptr,
                       s_sam, s_sak, sb_ptr, s_sbe, s_sbk, s_sbn, c_ptr, c_desc, c_smem, s_cm, E, R, N, K, T, GM,
                       total):
        """Rows HALF * 64 .. of each tile: the K-blocks' promotions, then the store in c's dtype (rows below
        the tile's end row; bf16 in 16-byte stores through shared memory, or by TMA: GluonConfig)."""
        BN: gl.constexpr = b_bufs.shape[1]
        BK: gl.constexpr = b_bufs.shape[2]
        n_n = (N + BN - 1) // BN
        c = 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            rt, ct = _tile_of(t, T, n_n, GM)
            col0 = ct * BN
            group = gl.minimum(gl.load(tile_ptr + 3 * rt), E - 1)
            first = gl.load(tile_ptr + 3 * rt + 1)
            row_end = gl.where(first < 0, 0, gl.load(tile_ptr + 3 * rt + 2))  # past the last tile: nothing stored
            nk = gl.where(first < 0, 0, K // BK)
            row = gl.maximum(first, 0) + HALF * 64
            offs_m = row + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA_LAYOUT))
            sa_ptrs = sa_ptr + gl.minimum(offs_m, R - 1).to(gl.int64) * s_sam  # rows past R: read, never stored
            sb_tile = sb_ptr + group.to(gl.int64) * s_sbe + (col0 // BK) * s_sbn
            acc, c = _accumulate(HALF, nk, c, a_bufs, b_bufs, ready, empty, sa_ptrs, s_sak, sb_tile, s_sbk)
            if TMA_STORE:  # a tile past its expert's last row: stored masked, from the buffer
                _tma_epilogue(acc, c_desc, c_smem, row, col0, row + 64 <= row_end)
                if row + 64 > row_end:
                    _rows_store(c_smem.load(STORE_LAYOUT), c_ptr, s_cm, row, col0, row_end, N)
            else:  # bf16 (fp32: the tests)
                _rows_store(gl.convert_layout(acc.to(c_ptr.dtype.element_ty), STORE_LAYOUT), c_ptr, s_cm, row, col0,
                            row_end, N)
        if TMA_STORE:
            tma.store_wait(0)

    # a pair of consumer partitions for each epilogue: a constexpr cannot come through warp_specialize

    @gluon.jit
    def _rows_consumer0(a_bufs, b_bufs, ready, empty, tile_ptr, sa_ptr, s_sam, s_sak, sb_ptr, s_sbe, s_sbk, s_sbn,
                        c_ptr, s_cm, E, R, N, K, T, GM, total):
        _rows_consumer(0, False, a_bufs, b_bufs, ready, empty, tile_ptr, sa_ptr, s_sam, s_sak, sb_ptr, s_sbe, s_sbk,
                       s_sbn, c_ptr, c_ptr, c_ptr, s_cm, E, R, N, K, T, GM, total)

    @gluon.jit
    def _rows_consumer1(a_bufs, b_bufs, ready, empty, tile_ptr, sa_ptr, s_sam, s_sak, sb_ptr, s_sbe, s_sbk, s_sbn,
                        c_ptr, s_cm, E, R, N, K, T, GM, total):
        _rows_consumer(1, False, a_bufs, b_bufs, ready, empty, tile_ptr, sa_ptr, s_sam, s_sak, sb_ptr, s_sbe, s_sbk,
                       s_sbn, c_ptr, c_ptr, c_ptr, s_cm, E, R, N, K, T, GM, total)

    @gluon.jit
    def _rows_consumer0_tma(a_bufs, b_bufs, ready, empty, tile_ptr, sa_ptr, s_sam, s_sak, sb_ptr, s_sbe, s_sbk, s_sbn,
                            c_ptr, c_desc, c_smem, s_cm, E, R, N, K, T, GM, total):
        _rows_consumer(0, True, a_bufs, b_bufs, ready, empty, tile_ptr, sa_ptr, s_sam, s_sak, sb_ptr, s_sbe, s_sbk,
                       s_sbn, c_ptr, c_desc, c_smem.index(0), s_cm, E, R, N, K, T, GM, total)

    @gluon.jit
    def _rows_consumer1_tma(a_bufs, b_bufs, ready, empty, tile_ptr, sa_ptr, s_sam, s_sak, sb_ptr, s_sbe, s_sbk, s_sbn,
                            c_ptr, c_desc, c_smem, s_cm, E, R, N, K, T, GM, total):
        _rows_consumer(1, True, a_bufs, b_bufs, ready, empty, tile_ptr, sa_ptr, s_sam, s_sak, sb_ptr, s_sbe, s_sbk,
                       s_sbn, c_ptr, c_desc, c_smem.index(1), s_cm, E, R, N, K, T, GM, total)

    @gluon.jit
    def _gluon_rows_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, tile_ptr, c_ptr, E, R, N, K, T, GM,
                           s_sam, s_sak, s_sbe, s_sbk, s_sbn, s_cm, NUM_BUF: gl.constexpr, TMA_STORE: gl.constexpr,
                           num_warps: gl.constexpr):
        """B stacked [E * N, K]; T row tiles x ceil(N / 128) column tiles, tile t's pair from _tile_of (GM row
        tiles a raster group), t a grid apart. ``c_desc``: the output's descriptor ([64, 128] blocks) under
        TMA_STORE, else unused."""
        gl.static_assert(a_desc.block_type.shape[0] == 128, "two 64-row consumers")
        gl.static_assert(b_desc.block_type.shape[0] == a_desc.block_type.shape[1], "one B scale a K-block")
        total = T * ((N + 127) // 128)
        a_bufs, b_bufs, ready, empty = _ring(a_desc, b_desc, NUM_BUF)
        pargs = (a_desc, b_desc, tile_ptr, N, K, T, GM, total, a_bufs, b_bufs, ready, empty)
        if TMA_STORE:
            c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
            cargs = (a_bufs, b_bufs, ready, empty, tile_ptr, sa_ptr, s_sam, s_sak, sb_ptr, s_sbe, s_sbk, s_sbn, c_ptr,
                     c_desc, c_smem, s_cm, E, R, N, K, T, GM, total)
            gl.warp_specialize([(_rows_consumer0_tma, cargs), (_rows_consumer1_tma, cargs), (_rows_producer, pargs)],
                               [4, 1], [232, 40])  # setmaxnreg: 2 x 128 x 232 + 128 x 40 <= 65,536
        else:
            cargs = (a_bufs, b_bufs, ready, empty, tile_ptr, sa_ptr, s_sam, s_sak, sb_ptr, s_sbe, s_sbk, s_sbn, c_ptr,
                     s_cm, E, R, N, K, T, GM, total)
            gl.warp_specialize([(_rows_consumer0, cargs), (_rows_consumer1, cargs), (_rows_producer, pargs)],
                               [4, 1], [232, 40])

    # ----------------------------------------------------------------------------------------------
    # wgrad: out[e] = A[:, rows of e] @ Bt[:, rows of e]^T, each expert's rows padded to 128s
    # ----------------------------------------------------------------------------------------------

    @gluon.jit
    def _k_tile(t, off_ptr, M, N):
        """Tile t's (expert, first output row, first output column, first K-block, K-blocks)."""
        n_n = (N + 127) // 128
        per_expert = ((M + 127) // 128) * n_n
        e = t // per_expert
        r = t % per_expert
        kb0 = gl.load(off_ptr + e - 1, mask=e > 0, other=0) // 128
        return e, (r // n_n) * 128, (r % n_n) * 128, kb0, gl.load(off_ptr + e) // 128 - kb0

    @gluon.jit
    def _k_producer(a_desc, b_desc, sa_desc, sb_desc, off_ptr, M, N, total, a_bufs, b_bufs, sa_bufs, sb_bufs, ready,
                    empty):
        """Each stage: A's and Bt's 128 x 128 K-block and their 128 scales of the K-block (one a row of
        A, one a column of Bt: [1, 128] boxes of the K-block-major scales), all by TMA."""
        NUM_BUF: gl.constexpr = a_bufs.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes + sa_desc.block_type.nbytes
                                + sb_desc.block_type.nbytes)
        c = 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            e, row0, col0, kb0, nk = _k_tile(t, off_ptr, M, N)
            for j in range(nk):
                i = c % NUM_BUF
                mbarrier.wait(empty.index(i), ((c // NUM_BUF) & 1) ^ 1)  # the ring's first round passes
                bar = ready.index(i)
                mbarrier.expect(bar, nbytes)
                _tma_load(a_desc, [row0, (kb0 + j) * BK], bar, a_bufs.index(i))
                _tma_load(b_desc, [col0, (kb0 + j) * BK], bar, b_bufs.index(i))
                _tma_load(sa_desc, [kb0 + j, row0], bar, sa_bufs.index(i))
                _tma_load(sb_desc, [kb0 + j, col0], bar, sb_bufs.index(i))
                c += 1

    @gluon.jit
    def _flat(stage):
        """A [1, 128] fp32 scale stage (unswizzled) as a plain [128] vector (``_reinterpret`` in 3.6)."""
        if REINTERPRET_PUBLIC:
            out = stage.reinterpret(gl.float32, [stage.shape[1]], FLAT_LAYOUT)
        else:
            out = stage._reinterpret(gl.float32, [stage.shape[1]], FLAT_LAYOUT)
        return out

    @gluon.jit
    def _accumulate_k(HALF: gl.constexpr, nk, c, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty):
        """The wgrad form of _accumulate: each K-block's product times the outer product of A's row scales
        and Bt's column scales, both read from the stage (the producer brought them with the tiles)."""
        NUM_BUF: gl.constexpr = a_bufs.shape[0]
        BN: gl.constexpr = b_bufs.shape[1]
        acc = gl.zeros((64, BN), dtype=gl.float32, layout=MMA_LAYOUT)
        for j in range(nk):
            i = c % NUM_BUF
            d = _mma(HALF, c, a_bufs, b_bufs, ready)
            sa = _flat(sa_bufs.index(i)).slice(HALF * 64, 64).load(gl.SliceLayout(1, MMA_LAYOUT))
            sb = _flat(sb_bufs.index(i)).load(gl.SliceLayout(0, MMA_LAYOUT))
            d = warpgroup_mma_wait(0, deps=(d, ))
            mbarrier.arrive(empty.index(i), count=1)  # the scales are in registers: the stage may refill
            acc = acc + d * sa[:, None] * sb[None, :]
            c += 1
        return acc, c

    @gluon.jit
    def _k_store(out, c_ptr, e, s_ce, s_cm, row, col0, M, N):
        """out (K_STORE_LAYOUT) at expert e's rows row .. row + 63 below M, columns col0 .. below N."""
        om = row + gl.arange(0, out.shape[0], layout=gl.SliceLayout(1, K_STORE_LAYOUT))
        on = col0 + gl.arange(0, out.shape[1], layout=gl.SliceLayout(0, K_STORE_LAYOUT))
        gl.store(c_ptr + e.to(gl.int64) * s_ce + om[:, None].to(gl.int64) * s_cm + on[None, :], out,
                 mask=(om < M)[:, None] & (on < N)[None, :])

    @gluon.jit
    def _k_consumer(HALF: gl.constexpr, TMA_STORE: gl.constexpr, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
                    off_ptr, c_ptr, c_desc, c_smem, s_ce, s_cm, M, N, total):
        """Output rows HALF * 64 .. of each tile; fp32 out (zeros for an expert without rows; by TMA where
        the tile lies inside M: GluonConfig)."""
        c = 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            e, row0, col0, kb0, nk = _k_tile(t, off_ptr, M, N)
            row = row0 + HALF * 64
            acc, c = _accumulate_k(HALF, nk, c, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty)
            if TMA_STORE:  # the output as [E * M, N]: a tile past M would write the next expert's rows
                _tma_epilogue(acc, c_desc, c_smem, e * M + row, col0, row + 64 <= M)
                if row + 64 > M:
                    _k_store(c_smem.load(K_STORE_LAYOUT), c_ptr, e, s_ce, s_cm, row, col0, M, N)
            else:
                _k_store(gl.convert_layout(acc, K_STORE_LAYOUT), c_ptr, e, s_ce, s_cm, row, col0, M, N)
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def _k_consumer0(a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, off_ptr, c_ptr, s_ce, s_cm, M, N, total):
        _k_consumer(0, False, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, off_ptr, c_ptr, c_ptr, c_ptr, s_ce, s_cm,
                    M, N, total)

    @gluon.jit
    def _k_consumer1(a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, off_ptr, c_ptr, s_ce, s_cm, M, N, total):
        _k_consumer(1, False, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, off_ptr, c_ptr, c_ptr, c_ptr, s_ce, s_cm,
                    M, N, total)

    @gluon.jit
    def _k_consumer0_tma(a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, off_ptr, c_ptr, c_desc, c_smem, s_ce, s_cm, M,
                         N, total):
        _k_consumer(0, True, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, off_ptr, c_ptr, c_desc, c_smem.index(0),
                    s_ce, s_cm, M, N, total)

    @gluon.jit
    def _k_consumer1_tma(a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, off_ptr, c_ptr, c_desc, c_smem, s_ce, s_cm, M,
                         N, total):
        _k_consumer(1, True, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, off_ptr, c_ptr, c_desc, c_smem.index(1),
                    s_ce, s_cm, M, N, total)

    @gluon.jit
    def _gluon_k_kernel(a_desc, b_desc, sa_desc, sb_desc, c_desc, off_ptr, c_ptr, M, N, E, s_ce, s_cm,
                        NUM_BUF: gl.constexpr, TMA_STORE: gl.constexpr, num_warps: gl.constexpr):
        """Tiles t = (expert, 128-row block of M, 128-column block of N), a grid apart. ``sa_desc`` /
        ``sb_desc``: the K-block-major scales [P / 128, M] / [P / 128, N] in [1, 128] boxes; ``c_desc``: the
        output's as [E * M, N] ([64, 128] blocks) under TMA_STORE, else unused."""
        gl.static_assert(a_desc.block_type.shape[0] == 128, "two 64-row consumers")
        gl.static_assert(b_desc.block_type.shape[0] == 128, "the module's MMA layout is 128 columns wide")
        total = E * ((M + 127) // 128) * ((N + 127) // 128)
        a_bufs, b_bufs, ready, empty = _ring(a_desc, b_desc, NUM_BUF)
        sa_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUF] + sa_desc.block_type.shape, sa_desc.layout)
        sb_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUF] + sb_desc.block_type.shape, sb_desc.layout)
        pargs = (a_desc, b_desc, sa_desc, sb_desc, off_ptr, M, N, total, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty)
        if TMA_STORE:
            c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
            cargs = (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, off_ptr, c_ptr, c_desc, c_smem, s_ce, s_cm, M, N,
                     total)
            gl.warp_specialize([(_k_consumer0_tma, cargs), (_k_consumer1_tma, cargs), (_k_producer, pargs)],
                               [4, 1], [232, 40])  # setmaxnreg: 2 x 128 x 232 + 128 x 40 <= 65,536
        else:
            cargs = (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, off_ptr, c_ptr, s_ce, s_cm, M, N, total)
            gl.warp_specialize([(_k_consumer0, cargs), (_k_consumer1, cargs), (_k_producer, pargs)],
                               [4, 1], [232, 40])


def _tma(t: torch.Tensor | None, block: list[int], layout):
    """A Gluon TMA descriptor of the 2-D ``t`` with ``block`` boxes in ``layout``, or None where TMA
    cannot read it (fp8_triton.tma_readable): every descriptor of this module."""
    if t is None or not tma_readable(t):
        return None
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block, layout)


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, ...], dtype: str):
    """The NVMMA shared layout of a ``block`` of ``dtype`` (a gl dtype's name) that TMA and wgmma read,
    made once: building one took 13 us of host time (Triton 3.6 on the 2-core CPU machine, session 37;
    three per rows GEMM, two per wgrad)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, dtype))


def _descriptor(t: torch.Tensor | None, rows: int):
    """An e4m3 operand's descriptor, [rows, 128] blocks."""
    return _tma(t, [rows, BLOCK_K], _shared_layout((rows, BLOCK_K), "float8e4nv"))


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def out_descriptor(out_2d: torch.Tensor):
    """The TMA_STORE epilogue's descriptor of the 2-D output: [64, 128] blocks (one consumer's half of
    a tile), or None where TMA cannot write it (then the kernels store it themselves)."""
    if not AVAILABLE or out_2d.dtype not in _GL_DTYPES:
        return None
    block = [BLOCK_M // 2, BLOCK_N]
    return _tma(out_2d, block, _shared_layout(tuple(block), _GL_DTYPES[out_2d.dtype]))


def _pair(a_desc, b_desc):
    return None if a_desc is None or b_desc is None else (a_desc, b_desc)


def rows_descriptors(a_RK: torch.Tensor, b_EKN: torch.Tensor):
    """(A, B) descriptors of the rows kernel, or None where its operands do not allow them (B[e] not
    K-contiguous, experts not back to back, N not a multiple of 128, misaligned): the caller then runs
    fp8_triton's kernel."""
    if not AVAILABLE or b_EKN.shape[2] % BLOCK_N:
        return None
    return _pair(_descriptor(a_RK, BLOCK_M), _descriptor(stacked_b(b_EKN), BLOCK_N))


def _scale_descriptor(s_XB: torch.Tensor):
    """A [1, 128]-box TMA descriptor of K-block-major scales: s_XB [X, P / 128] stored [P / 128, X]
    (stride (1, X)), or None for other layouts."""
    return _tma(s_XB.t(), [1, BLOCK_N], SCALE_LAYOUT.value) if s_XB.dtype == torch.float32 else None


def k_descriptors(a_MP: torch.Tensor, sa_MB: torch.Tensor, bt_NP: torch.Tensor, sbt_NB: torch.Tensor):
    """(A, Bt, A's scales, Bt's scales) descriptors of the wgrad kernel, or None where TMA cannot read
    them (operands not K-contiguous, misaligned; scales not K-block-major: fp8_gemm's
    KBLOCK_MAJOR_TOKEN_SCALES lays them out so): the caller then runs fp8_triton's kernel."""
    if not AVAILABLE:
        return None
    descriptors = (_descriptor(a_MP, BLOCK_M), _descriptor(bt_NP, BLOCK_N), _scale_descriptor(sa_MB),
                   _scale_descriptor(sbt_NB))
    return None if any(d is None for d in descriptors) else descriptors


def _grid(total: int, persistent: bool, device: torch.device) -> tuple[int]:
    if not persistent:
        return (max(total, 1), )
    return (max(1, min(total, _sm_count(torch.device(device).index or 0))), )


def gluon_grouped_mm_rows(a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out, descriptors=None,
                          config: GluonConfig | None = None):
    """out[rows of e] = A[rows of e] @ B[e] (fp8_triton.fp8_grouped_mm_rows's contract; ``out``
    given, [R, N]); ``descriptors`` from rows_descriptors (made here when None). ``config`` default:
    CONFIG as it is at this call (tools/bench_fp8_variants.py sets it to time each)."""
    bufs, persistent, tma_store, group = config or CONFIG
    R, K = a_RK.shape
    E, _, N = b_EKN.shape
    descriptors = descriptors or rows_descriptors(a_RK, b_EKN)
    if descriptors is None:
        raise ValueError("the Gluon rows kernel needs B[e] K-contiguous, the experts back to back, N a multiple "
                         f"of {BLOCK_N} and 16-byte aligned operands (fp8_triton's pipelined kernel takes any strides)")
    a_desc, b_desc = descriptors
    T = triton.cdiv(R, BLOCK_M) + E  # at most one partial tile an expert
    table = torch.empty(T, 3, dtype=torch.int32, device=a_RK.device)
    _gluon_tile_table_kernel[(T, )](offsets_E, table, E, BM=BLOCK_M, EP=triton.next_power_of_2(E), num_warps=1)
    c_desc = out_descriptor(out) if tma_store else None  # None: the masked stores
    _gluon_rows_kernel[_grid(T * (N // BLOCK_N), persistent, a_RK.device)](
        a_desc, b_desc, c_desc or out, sa_RB, sb_EBC, table, out, E, R, N, K, T, group, sa_RB.stride(0),
        sa_RB.stride(1), sb_EBC.stride(0), sb_EBC.stride(1), sb_EBC.stride(2), out.stride(0), NUM_BUF=bufs,
        TMA_STORE=c_desc is not None, num_warps=4)
    return out


def gluon_grouped_mm_k(a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E, out, descriptors=None,
                       config: GluonConfig | None = None):
    """out[e] = A[:, rows of e] @ Bt[:, rows of e]^T (fp8_triton.fp8_grouped_mm_k's contract, the scales
    K-block-major; ``out`` given, [E, M, N], its last dim contiguous); ``descriptors`` from k_descriptors
    (made here when None). ``config`` default: K_CONFIG as it is at this call, else 4 stages,
    persistent, the TMA store."""
    bufs, persistent, tma_store, _ = config or K_CONFIG or GluonConfig(4, True, True)  # (no raster groups)
    if bufs > MAX_K_BUFS:
        raise ValueError(f"the Gluon wgrad kernel fits {MAX_K_BUFS} stages in shared memory with its fp32 "
                         f"epilogue (64 KiB), got {bufs}")
    M, P = a_MP.shape
    N = bt_NP.shape[0]
    E = padded_offsets_E.numel()
    descriptors = descriptors or k_descriptors(a_MP, sa_MB, bt_NP, sbt_NB)
    if descriptors is None or out.stride(2) != 1:
        raise ValueError("the Gluon wgrad kernel needs K-contiguous, 16-byte aligned A and Bt, their scales "
                         "K-block-major (stride (1, rows)) and a row-major output (fp8_triton's pipelined kernel "
                         "takes any strides)")
    total = E * triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    # TMA_STORE writes the experts' outputs as one [E * M, N] matrix: out contiguous
    c_desc = out_descriptor(out.view(E * M, N)) if tma_store and out.is_contiguous() else None
    _gluon_k_kernel[_grid(total, persistent, a_MP.device)](
        *descriptors, c_desc or out, padded_offsets_E, out, M, N, E, out.stride(0), out.stride(1), NUM_BUF=bufs,
        TMA_STORE=c_desc is not None, num_warps=4)
    return out


# torch.compile sees the Gluon launches only through these ops: Dynamo traces a Triton kernel launched
# in a compiled region into the graph and Inductor recompiles it in a worker, which fails for Gluon
# kernels (session 35 call 4: "InductorError ... Name=_gluon_tile_table_kernel"). Where the Gluon kernels
# cannot run (not SM90, operands TMA cannot read) the ops run fp8_triton's pipelined kernels.

def fp8_gluon_rows(a_RK: torch.Tensor, sa_RB: torch.Tensor, b_EKN: torch.Tensor, sb_EBC: torch.Tensor,
                   offsets_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_triton.fp8_grouped_mm_rows's contract -> [R, N] in ``out_dtype``."""
    descriptors = rows_descriptors(a_RK, b_EKN) if supported(a_RK.device) else None
    if descriptors is None:
        return fp8_triton.fp8_grouped_mm_rows(a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out_dtype, kernel="pipelined")
    out = rows_output(a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out_dtype)
    return gluon_grouped_mm_rows(a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out, descriptors)


def fp8_gluon_k(a_MP: torch.Tensor, sa_MB: torch.Tensor, bt_NP: torch.Tensor, sbt_NB: torch.Tensor,
                padded_offsets_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_triton.fp8_grouped_mm_k's contract -> [E, M, N] in ``out_dtype``."""
    descriptors = k_descriptors(a_MP, sa_MB, bt_NP, sbt_NB) if supported(a_MP.device) else None
    if descriptors is None:
        return fp8_triton.fp8_grouped_mm_k(a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E, kernel="pipelined",
                                           out_dtype=out_dtype)
    out = k_output(a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E, out_dtype)
    return gluon_grouped_mm_k(a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E, out, descriptors)


define_op(fp8_gluon_rows, rows_output)  # the pipelined ops' fakes too: one output rule
define_op(fp8_gluon_k, k_output)
