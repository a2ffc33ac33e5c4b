"""The FP8 blockwise grouped GEMMs of fp8_triton.py, warp-specialized by Triton for Hopper
(``precision.fp8_experts=triton_ws``; fp8_triton.GroupedKernel.warp_specialized).

Why: a blockwise GEMM scales each 128-long K-block's partial product by its scales before adding it
to the fp32 accumulator (the promotion). Triton's pipeliner waits for each wgmma before promoting its
result, so in fp8_triton's kernels the tensor cores idle during every promotion unless another
resident program fills the gap. Here ``tl.range(..., warp_specialize=True)`` (Hopper support since
Triton 3.5) splits each program into a TMA producer warpgroup and two consumer warpgroups on 64 rows
each of a 128-row tile, each consumer with its own barriers (12 warps; setmaxnreg gives the
consumers 232 registers a thread): while one consumer promotes, the other's wgmma runs. That is the
structure of DeepGEMM's FP8 kernels.

On the H100 under Triton 3.6 that split form gave wrong results (session 33; session 34's
bisection, docs/bench/session34/ws_bisect.py: the same kernels unspecialized were exact, the scales,
the trip counts and persistence ruled out, the TTGIR right: the fault is in 3.6's lowering). The
64-row tiles are exact, but 3.6 runs each of them in both consumers; so the autotune list (WS_TILES)
now holds only those, right and slower than the pipelined kernels, until a Triton version runs the
split form right (the 128-row configs are one line away).

What Triton's specialization (3.6 on the GPU machine, 3.9 here; both checked by compiling for SM90)
takes, and what the kernels do about it:

- No reductions and no early return: the rows kernel reads each row tile's (expert, first row, end
  row) from a table one small kernel writes first (``_fp8_grouped_gemm_tile_table_kernel``:
  fp8_triton._row_tile once per tile); a tile past the last runs no K-block and stores nothing.
- Splitting A's tile between the consumers needs descriptors whose block the compiler may shape:
  the kernels make their own (``tl.make_tensor_descriptor``; Triton asks its allocator for their
  global memory, which _ensure_allocator points at torch's). A host descriptor's block is fixed:
  Triton 3.9 refuses the split copy, 3.6 compiled it into a copy of the whole block into each half.
- No loop-carried values but the accumulator (a one-ahead prefetch of the scales does not compile):
  each K-block's scales are loaded before its wgmma is issued, so their latency (L1 hits for 7 of 8
  K-blocks: a row's scales are contiguous) runs behind it.
- 8-warp configs are not specialized; 128 x 256 and 256 x 128 tiles spill.

The kernels are persistent (one program per SM, at most, looping over the output tiles a grid apart):
the descriptors are made once a program, and the producer loads the next tile's K-blocks while the
consumers store the last one. Same contracts and outputs as fp8_triton's pipelined kernels (bit for
bit under the interpreter, which ignores the specialization); only where TMA can read both operands
(fp8_triton.tma_readable), else the callers run the pipelined kernels.

Compiled for SM90 and interpreted on the CPU (tests/core/test_precision_fp8.py); on the H100, the
bisection's 64-row rows (exact against the masked kernels on three operand sets, forward and
wgrad); its GPU tests and benchmarks with the 64-row list: docs/bench/session34/call6.sh.
Legend: R rows, P padded rows, E experts, T row tiles.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp8_triton import BLOCK_K, _row_tile, config_name, tma_readable

__all__ = ["WS_TILES", "last_tuning", "ws_configs", "ws_grouped_mm_k", "ws_grouped_mm_rows"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (BM, BN, num_warps, num_stages): num_warps is one consumer warpgroup's (the specialization adds
# the producer's and the second consumer's). 64-row tiles: the 128-row tiles split between the two
# consumers (64 rows each, the design above) gave wrong results on the H100 under Triton 3.6
# (session 34, docs/bench/session34/ws_bisect.py: the same kernels unspecialized were exact, and so
# were the 64-row tiles specialized; the split form's TTGIR is right, so the fault is in 3.6's
# lowering). With 64-row tiles 3.6 runs each tile in both consumers (the same loads, MMAs and
# stores twice): right, but at most half the tensor cores' rate, so kept for correctness and
# measurement, not speed. One config, the one the GPU ran exact (4 stages: 115 KiB rows, 164 KiB
# wgrad); 3 and 5 stages compile too (88-137 / 136-184 KiB) but are unchecked on a GPU; 64 x 256
# does not compile under 3.6.
WS_TILES = ((64, 128, 4, 4),)
INTERPRET_SMS = 3
"""Programs of a persistent launch under the interpreter: fewer than the tiles, so the tests walk the loop."""


def ws_configs(interpret: bool = False) -> list[triton.Config]:
    """The autotune candidates; under the interpreter one per B-scale shape (BN 128: one B scale a
    K-block, a scalar; 256: two)."""
    if interpret:
        return [triton.Config({"BM": 32, "BN": bn}, num_warps=4, num_stages=1) for bn in (128, 256)]
    return [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in WS_TILES]


@triton.jit
def _fp8_grouped_gemm_tile_table_kernel(off_ptr, table_ptr, E, BM: tl.constexpr, EP: tl.constexpr):
    """table[t] = row tile t's (expert, first row or -1 past the last tile, end row)."""
    tile = tl.program_id(0)
    group, row0, row_end = _row_tile(off_ptr, tile, E, BM, EP)
    tl.store(table_ptr + 3 * tile, group)
    tl.store(table_ptr + 3 * tile + 1, row0)
    tl.store(table_ptr + 3 * tile + 2, row_end)


@triton.jit
def _fp8_grouped_gemm_rows_ws_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, tile_ptr, c_ptr, E, R, N, K, T,
             s_am, s_sam, s_sak, s_bn, s_sbe, s_sbk, s_sbn, s_cm, s_cn,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # A [R, K]; B stored as [E * N, K] (each B[e] K-contiguous, the experts back to back)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[R, K], strides=[s_am, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * N, K], strides=[s_bn, 1], block_shape=[BN, BK])
    n_n = tl.cdiv(N, BN)
    for t in tl.range(tl.program_id(0), T * n_n, tl.num_programs(0), warp_specialize=True):
        tile, pid_n = t // n_n, t % n_n  # the N tiles of one row tile run side by side (A from L2)
        group = tl.minimum(tl.load(tile_ptr + 3 * tile), E - 1)  # past the last tile: no K-block runs
        row0 = tl.load(tile_ptr + 3 * tile + 1)
        row_end = tl.where(row0 < 0, 0, tl.load(tile_ptr + 3 * tile + 2))
        n_kb = tl.where(row0 < 0, 0, K // BK)
        row0 = tl.maximum(row0, 0)
        offs_m = row0 + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        sa_ptrs = sa_ptr + tl.minimum(offs_m, R - 1).to(tl.int64) * s_sam  # rows past R: read, never stored
        sb_row = sb_ptr + group.to(tl.int64) * s_sbe
        sb_ptrs = sb_row + (tl.minimum(offs_n, N - 1) // BK) * s_sbn  # BN 256: two B scales a K-block
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, n_kb):
            a = a_desc.load([row0, kb * BK])
            b = b_desc.load([group * N + pid_n * BN, kb * BK]).T
            sa = tl.load(sa_ptrs + kb * s_sak)  # both scales before the wgmma is issued
            if BN == BK:
                sab = (sa * tl.load(sb_row + pid_n * s_sbn + kb * s_sbk))[:, None]
            else:
                sab = sa[:, None] * tl.load(sb_ptrs + kb * s_sbk)[None, :]
            acc += tl.dot(a, b) * sab
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * s_cm + offs_n[None, :] * s_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < row_end)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _fp8_grouped_gemm_k_ws_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, off_ptr, c_ptr, M, N, E,
          s_am, s_sam, s_sak, s_bn, s_sbn, s_sbk, s_ce, s_cm, s_cn,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # A [M, P]; Bt [N, P]; P the padded rows the experts use (offsets' last)
    P = tl.load(off_ptr + E - 1)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, P], strides=[s_am, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, P], strides=[s_bn, 1], block_shape=[BN, BK])
    n_n, n_m = tl.cdiv(N, BN), tl.cdiv(M, BM)
    for t in tl.range(tl.program_id(0), E * n_m * n_n, tl.num_programs(0), warp_specialize=True):
        e, rest = t // (n_m * n_n), t % (n_m * n_n)  # one expert's tiles side by side (its rows from L2)
        pid_m, pid_n = rest // n_n, rest % n_n
        start = tl.where(e > 0, tl.load(off_ptr + e - 1, mask=e > 0, other=0), 0)
        end = tl.load(off_ptr + e)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        sa_ptrs = sa_ptr + tl.minimum(offs_m, M - 1).to(tl.int64) * s_sam  # read, never stored past M / N
        sb_ptrs = sb_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * s_sbn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(start // BK, end // BK):
            a = a_desc.load([pid_m * BM, kb * BK])
            b = b_desc.load([pid_n * BN, kb * BK]).T
            sa = tl.load(sa_ptrs + kb * s_sak)
            sb = tl.load(sb_ptrs + kb * s_sbk)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        c_ptrs = c_ptr + e.to(tl.int64) * s_ce + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


_ONE = 1 if _INTERPRET else None  # the interpreter runs the first candidate (tests set theirs)
rows_kernel = triton.autotune(configs=ws_configs(_INTERPRET)[:_ONE], key=["N", "K"])(_fp8_grouped_gemm_rows_ws_kernel)
k_kernel = triton.autotune(configs=ws_configs(_INTERPRET)[:_ONE], key=["M", "N"])(_fp8_grouped_gemm_k_ws_kernel)


def last_tuning(wgrad: bool = False) -> tuple[str, dict[str, float]]:
    """The config the rows (or, ``wgrad``, the k) kernel ran last, and the median ms of each
    candidate at its latest tuning ({} when only one was left to run)."""
    kernel = k_kernel if wgrad else rows_kernel
    timings = getattr(kernel, "configs_timings", None) or {}
    return name(kernel.best_config), {name(c): t[0] if isinstance(t, (list, tuple)) else t
                                      for c, t in timings.items()}


def name(config: triton.Config) -> str:
    """'BM128 BN128 w4 s4 ws': a config as the benchmarks report it."""
    return config_name(config) + " ws"


def _torch_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")  # the caching allocator aligns to 512 bytes


def _ensure_allocator() -> None:
    """Descriptors made inside a kernel live in global memory Triton asks its allocator for; unless
    the caller's thread has one, torch's caching allocator serves it. Triton keeps the allocator in a
    context variable, which the autograd engine's threads (the backward's launches) do not inherit:
    hence a check at every launch, not one set-up."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_torch_allocator)


def _launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, with one error naming the fix where this Triton cannot build
    the warp-specialized kernels (its automatic specialization is young: 3.6 and 3.9 are the versions
    checked, tests/core/test_precision_fp8.py)."""
    from triton.compiler.errors import CompilationError

    try:
        kernel[grid](*args, **kwargs)
    except (CompilationError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "PassManager" not in str(e):
            raise
        raise RuntimeError(f"precision.fp8_experts=triton_ws: Triton {triton.__version__} could not compile the "
                           f"warp-specialized FP8 grouped GEMMs ({type(e).__name__}: {str(e).strip()[:200]}); use "
                           f"--precision.fp8_experts=triton (the same GEMMs, not specialized)") from e


def _programs(device: torch.device, n_tiles: int) -> int:
    sms = INTERPRET_SMS if _INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(sms, n_tiles))


def _one_bm() -> int:
    """The one BM of the rows kernel's candidates (its tile table is written for it)."""
    bms = {c.kwargs["BM"] for c in rows_kernel.configs}
    if len(bms) != 1:
        raise ValueError(f"the warp-specialized rows kernel's candidates need one BM (its tile table's), "
                         f"got {sorted(bms)}")
    return bms.pop()


def ws_grouped_mm_rows(a_RK: torch.Tensor, sa_RB: torch.Tensor, b_EKN: torch.Tensor, sb_EBC: torch.Tensor,
                       offsets_E: torch.Tensor, out: torch.Tensor) -> bool:
    """fp8_triton.fp8_grouped_mm_rows's GEMM into ``out`` (offsets int32); False (nothing run) where
    TMA cannot read A or the stacked B (fp8_triton.stacked_b)."""
    from .fp8_triton import stacked_b

    b_stacked = stacked_b(b_EKN)
    if not (tma_readable(a_RK) and b_stacked is not None and tma_readable(b_stacked)):
        return False
    R, K = a_RK.shape
    E, _, N = b_EKN.shape
    _ensure_allocator()
    bm = _one_bm()
    tiles = triton.cdiv(R, bm) + E
    table = torch.empty(tiles, 3, dtype=torch.int32, device=a_RK.device)
    _fp8_grouped_gemm_tile_table_kernel[(tiles,)](offsets_E, table, E, BM=bm, EP=triton.next_power_of_2(E))
    grid = lambda meta: (_programs(a_RK.device, tiles * triton.cdiv(N, meta["BN"])),)  # noqa: E731
    _launch(rows_kernel, grid, a_RK, sa_RB, b_stacked, sb_EBC, table, out, E, R, N, K, tiles,
            a_RK.stride(0), sa_RB.stride(0), sa_RB.stride(1), b_stacked.stride(0),
            sb_EBC.stride(0), sb_EBC.stride(1), sb_EBC.stride(2), out.stride(0), out.stride(1), BK=BLOCK_K)
    return True


def ws_grouped_mm_k(a_MP: torch.Tensor, sa_MB: torch.Tensor, bt_NP: torch.Tensor, sbt_NB: torch.Tensor,
                    padded_offsets_E: torch.Tensor, out: torch.Tensor) -> bool:
    """fp8_triton.fp8_grouped_mm_k's GEMM into ``out`` (offsets int32); False (nothing run) where TMA
    cannot read A or Bt."""
    if not (tma_readable(a_MP) and tma_readable(bt_NP)):
        return False
    M, N, E = a_MP.shape[0], bt_NP.shape[0], padded_offsets_E.numel()
    _ensure_allocator()
    tiles = lambda meta: E * triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"])  # noqa: E731
    _launch(k_kernel, lambda meta: (_programs(a_MP.device, tiles(meta)),),
            a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E, out, M, N, E, a_MP.stride(0), sa_MB.stride(0),
            sa_MB.stride(1), bt_NP.stride(0), sbt_NB.stride(0), sbt_NB.stride(1), out.stride(0), out.stride(1),
            out.stride(2), BK=BLOCK_K)
    return True
