"""Triton FP8 blockwise grouped GEMMs (e4m3 operands, fp32 power-of-two scales per 128 of K applied
to the fp32 accumulator each K-block): the experts' forward, dgrad and wgrad on Hopper, where
torch has no blockwise grouped GEMM. No host sync: each program finds its expert from the offsets.

- ``fp8_grouped_mm_rows``: out[rows of e] = A[rows of e] @ B[e] (forward, dgrad). A [R, K] e4m3 with
  1x128 scales sa [R, K / 128]; B[e] [K, N] e4m3 (any strides; K-contiguous is the fast layout) with
  128x128 scales sb [E, K / 128, N / 128]. Rows past offsets_E[-1] are left unwritten.
- ``fp8_grouped_mm_k``: out[e] = A[:, rows of e] @ B[rows of e] (wgrad, a reduction over each
  expert's rows, which start at multiples of 128: core.precision.grouping.pad_groups). A [M, P]
  e4m3 with scales sa [M, P / 128]; B given as Bt [N, P] (K-contiguous) with scales sbt [N, P / 128].
  -> fp32 [E, M, N] (zeros for an empty expert).

Three implementations of each (two here, one in fp8_gluon.py), chosen by ``KERNEL`` (or the
``kernel`` argument), with the same outputs up to the fp32 summation order (GroupedKernel's members
say how they differ); tools/bench_fp8_variants.py measures them against each other.

Tested under TRITON_INTERPRET=1 against the torch reference (dequantize, float64 GEMM) on small
shapes, and on the GPU by tools/bench_gemm_fp8.py. Legend: R rows, P padded rows, E experts.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..config import StrEnum
from .library import define_op

__all__ = ["GroupedKernel", "KERNEL", "config_name", "fp8_grouped_mm_k", "fp8_grouped_mm_rows", "last_tuning",
           "pipelined_configs", "use_pipelined_configs"]

BLOCK_K = 128
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class GroupedKernel(StrEnum):
    masked = "masked"
    """The first kernels: masked loads each K-block, BN 128, a loop over the experts per program."""
    pipelined = "pipelined"
    """Unmasked loads (rows and columns clamped inside the tensor, masked only at the store) or TMA
    descriptors (zero-filled past the end), BN 128 or 256 (per-128-column B scales), the expert
    found with one vector pass over the offsets, and a wider autotune list."""
    gluon = "gluon"
    """core/precision/fp8_gluon.py: warp-specialized by hand (a TMA producer, two wgmma consumers, one's
    promotion overlapping the other's MMA), persistent, behind operators; the wgrad's scales
    K-block-major (staged in shared memory), and the pipelined kernel where fp8_gluon.K_CONFIG is None.
    SM90 only and TMA-able operands only; elsewhere (CPU, interpreter, SM100, other strides) the
    pipelined kernel runs."""


KERNEL = GroupedKernel.pipelined  # the default (1.05-1.34x the masked kernels on the H200, session 6)


def _configs(interpret: bool):
    """BN is one scale tile (128), so a program's B scale per K-block is one scalar. H100 / H200:
    128 x 128 x 128 tiles, 8 warps (two consumer warpgroups), 3-4 stages of e4m3 (32 KiB each)."""
    if interpret:
        return [triton.Config({"BM": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BM": bm}, num_warps=w, num_stages=st)
            for bm, w, st in ((128, 8, 3), (128, 8, 4), (128, 4, 3), (64, 4, 4))]


def _k_configs(interpret: bool):
    if interpret:
        return [triton.Config({"BM": 32, "BN": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st)
            for bm, bn, w, st in ((128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (64, 128, 4, 4))]


def _set_block_shapes(nargs):
    """TMA configs: the host descriptors' block shapes follow the config (A [BM, BK], B [BN, BK])."""
    if nargs["TMA"] and nargs["TMA_OK"]:
        nargs["a_desc"].block_shape = [nargs["BM"], nargs["BK"]]
        nargs["b_desc"].block_shape = [nargs["BN"], nargs["BK"]]


# (BM, BN, num_warps, num_stages): 64 x 128 on one warpgroup leaves room for 2-3 programs per SM
# (one's scaling overlaps another's wgmma); 128 x 128 and 64 x 256 on two consumer warpgroups
# (DeepGEMM's shapes; 128 x 256 would hold 256 fp32 registers per thread and spill)
PIPELINED_TILES = ((64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5), (128, 128, 8, 3), (128, 128, 8, 4),
                   (64, 256, 8, 3), (64, 256, 8, 4))


def pipelined_configs(interpret: bool = False, wgrad: bool = False) -> list[triton.Config]:
    """The pipelined kernels' autotune candidates on the GPU, both load paths of each tile; under the
    interpreter, the configs the tests run one at a time (both load paths, both B-scale shapes).
    ``wgrad``: the k kernel's, without the pointer-load 128 x 128 tiles (they spill on SM90: 255
    registers and a stack, the per-column B scales on top of the rows kernel's state)."""
    if interpret:
        return [triton.Config({"BM": 32, "BN": bn, "TMA": tma}, num_warps=4, num_stages=1, pre_hook=_set_block_shapes)
                for bn in (128, 256) for tma in (False, True)]
    return [triton.Config({"BM": bm, "BN": bn, "TMA": tma}, num_warps=w, num_stages=st, pre_hook=_set_block_shapes)
            for tma in (False, True) for bm, bn, w, st in PIPELINED_TILES
            if not (wgrad and not tma and (bm, bn) == (128, 128))]


def _prune_pipelined(configs, named_args, **kwargs):
    """TMA configs only where the operands allow descriptors (TMA_OK)."""
    return [c for c in configs if named_args["TMA_OK"] or not c.kwargs["TMA"]] or configs[:1]


def config_name(config: triton.Config) -> str:
    """'BM64 BN128 w4 s3 tma': a pipelined config as the benchmark reports it."""
    kw = config.kwargs
    return (f"BM{kw['BM']} BN{kw['BN']} w{config.num_warps} s{config.num_stages}"
            + (" tma" if kw.get("TMA") else ""))


@triton.autotune(configs=_configs(_INTERPRET), key=["N", "K"])
@triton.jit
def _fp8_grouped_gemm_rows_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, off_ptr, c_ptr, E, N, K,
                                  s_am, s_ak, s_sam, s_sak, s_be, s_bk, s_bn, s_sbe, s_sbk, s_sbn, s_cm, s_cn,
                                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # N tiles vary fastest: the programs resident together share A's row tiles (read once from HBM)
    # and one expert's B (which stays in L2)
    pid_n, tile = tl.program_id(0), tl.program_id(1)
    # which expert's rows this tile covers: tiles are laid out expert after expert
    group, row0, row_end = 0, -1, 0
    seen, prev_end = 0, 0
    for e in range(E):
        end = tl.load(off_ptr + e)
        n_tiles = (end - prev_end + BM - 1) // BM
        inside = (tile >= seen) & (tile < seen + n_tiles)
        group = tl.where(inside, e, group)
        row0 = tl.where(inside, prev_end + (tile - seen) * BM, row0)
        row_end = tl.where(inside, end, row_end)
        seen += n_tiles
        prev_end = end
    if row0 < 0:
        return
    offs_m = row0 + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mask_m, mask_n = offs_m < row_end, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + group.to(tl.int64) * s_be + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn
    sa_ptrs = sa_ptr + offs_m.to(tl.int64) * s_sam
    sb_ptr = sb_ptr + group.to(tl.int64) * s_sbe + pid_n * s_sbn  # BN == BK: one B scale per K-block
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, K // BK):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        scale = tl.load(sa_ptrs + kb * s_sak, mask=mask_m, other=0.0) * tl.load(sb_ptr + kb * s_sbk)
        acc += tl.dot(a, b) * scale[:, None]  # the partial dot of this K-block, scaled once
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * s_cm + offs_n[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _row_tile(off_ptr, tile, E, BM: tl.constexpr, EP: tl.constexpr):
    """(expert, first row, end row) of row tile ``tile`` (tiles laid out expert after expert); first
    row -1 past the last tile. One vector pass over the offsets (EP: E rounded up to a power of 2)."""
    e = tl.arange(0, EP)
    ends = tl.load(off_ptr + e, mask=e < E, other=0)
    starts = tl.load(off_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    n_tiles = (ends - starts + BM - 1) // BM
    last_tile = tl.cumsum(n_tiles, 0)  # one past each expert's last tile
    group = tl.sum((last_tile <= tile).to(tl.int32), 0)  # empty experts are passed over with their neighbours
    this = e == group
    first_tile = tl.sum(tl.where(this, last_tile - n_tiles, 0), 0)
    row0 = tl.sum(tl.where(this, starts, 0), 0) + (tile - first_tile) * BM
    return group, tl.where(group < E, row0, -1), tl.sum(tl.where(this, ends, 0), 0)


@triton.jit
def _load_kblock(a_desc, b_desc, a_ptrs, b_ptrs, a_row, b_row, k, s_ak, s_bk, BK: tl.constexpr, USE_TMA: tl.constexpr):
    """One K-block of A [BM, BK] and B [BK, BN]: through the TMA descriptors (A's rows from a_row,
    B stored transposed, its rows from b_row, K from k), or through the pointers, returned stepped
    to the next K-block. The one load of both pipelined kernels."""
    if USE_TMA:
        a = a_desc.load([a_row, k])
        b = b_desc.load([b_row, k]).T
    else:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    return a, b, a_ptrs, b_ptrs


@triton.autotune(configs=pipelined_configs(_INTERPRET)[:1 if _INTERPRET else None], key=["N", "K", "TMA_OK"],
                 prune_configs_by={"early_config_prune": _prune_pipelined})
@triton.jit
def _fp8_grouped_gemm_rows_pipelined_kernel(a_ptr, a_desc, sa_ptr, b_ptr, b_desc, sb_ptr, off_ptr, c_ptr,
                                            E, R, N, K, TMA_OK: tl.constexpr,
                                            s_am, s_ak, s_sam, s_sak, s_be, s_bk, s_bn, s_sbe, s_sbk, s_sbn,
                                            s_cm, s_cn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                            EP: tl.constexpr, TMA: tl.constexpr):
    # a_desc: A [R, K]; b_desc: B stored as [E * N, K] (each B[e] K-contiguous); both None unless TMA_OK
    pid_n, tile = tl.program_id(0), tl.program_id(1)
    group, row0, row_end = _row_tile(off_ptr, tile, E, BM, EP)
    if row0 < 0:
        return
    offs_m = row0 + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    # rows past the expert's end (the next expert's) and columns past N are read and never stored;
    # clamped inside the tensor, the loads need no mask (which keeps them off the pipelined path)
    rows, cols = tl.minimum(offs_m, R - 1), tl.minimum(offs_n, N - 1)
    sa_ptrs = sa_ptr + rows.to(tl.int64) * s_sam
    sb_ptr = sb_ptr + group.to(tl.int64) * s_sbe
    sb_ptrs = sb_ptr + (cols // BK) * s_sbn  # BN 256: two B scales per K-block
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + group.to(tl.int64) * s_be + offs_k[:, None] * s_bk + cols[None, :] * s_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, K // BK):
        # a TMA config where descriptors cannot be made reads through pointers
        a, b, a_ptrs, b_ptrs = _load_kblock(a_desc, b_desc, a_ptrs, b_ptrs, row0, group * N + pid_n * BN, kb * BK,
                                            s_ak, s_bk, BK, TMA and TMA_OK)
        sa = tl.load(sa_ptrs + kb * s_sak)
        if BN == BK:
            acc += tl.dot(a, b) * (sa * tl.load(sb_ptr + pid_n * s_sbn + kb * s_sbk))[:, None]
        else:
            acc += tl.dot(a, b) * (sa[:, None] * tl.load(sb_ptrs + kb * s_sbk)[None, :])
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * s_cm + offs_n[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < row_end)[:, None] & (offs_n < N)[None, :])


@triton.autotune(configs=_k_configs(_INTERPRET), key=["M", "N"])
@triton.jit
def _fp8_grouped_gemm_k_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, off_ptr, c_ptr, M, N,
                               s_am, s_ak, s_sam, s_sak, s_bn, s_bk, s_sbn, s_sbk, s_ce, s_cm, s_cn,
                               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_m, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.where(e > 0, tl.load(off_ptr + e - 1, mask=e > 0, other=0), 0)
    end = tl.load(off_ptr + e)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(start // BK, end // BK):
        k = kb * BK + offs_k
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * s_am + k[None, :].to(tl.int64) * s_ak,
                    mask=mask_m[:, None], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :].to(tl.int64) * s_bn + k[:, None].to(tl.int64) * s_bk,
                    mask=mask_n[None, :], other=0.0)
        sa = tl.load(sa_ptr + offs_m.to(tl.int64) * s_sam + kb * s_sak, mask=mask_m, other=0.0)
        sb = tl.load(sb_ptr + offs_n.to(tl.int64) * s_sbn + kb * s_sbk, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    c_ptrs = c_ptr + e.to(tl.int64) * s_ce + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.autotune(configs=pipelined_configs(_INTERPRET, wgrad=True)[:1 if _INTERPRET else None], key=["M", "N", "TMA_OK"],
                 prune_configs_by={"early_config_prune": _prune_pipelined})
@triton.jit
def _fp8_grouped_gemm_k_pipelined_kernel(a_ptr, a_desc, sa_ptr, b_ptr, b_desc, sb_ptr, off_ptr, c_ptr, M, N,
                                         TMA_OK: tl.constexpr, s_am, s_ak, s_sam, s_sak, s_bn, s_bk, s_sbn, s_sbk, s_ce, s_cm, s_cn,
                                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):
    # a_desc: A [M, P]; b_desc: Bt [N, P]; both None unless TMA_OK
    pid_n, pid_m, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.where(e > 0, tl.load(off_ptr + e - 1, mask=e > 0, other=0), 0)
    end = tl.load(off_ptr + e)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    rows, cols = tl.minimum(offs_m, M - 1), tl.minimum(offs_n, N - 1)  # read, never stored past M / N
    # pointers stepped each K-block (recomputing [BM, BK] int64 offsets every step spills at 128 x 128)
    k0 = (start // BK * BK).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * s_am + (k0 + offs_k[None, :]) * s_ak
    b_ptrs = b_ptr + cols[None, :].to(tl.int64) * s_bn + (k0 + offs_k[:, None]) * s_bk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(start // BK, end // BK):
        a, b, a_ptrs, b_ptrs = _load_kblock(a_desc, b_desc, a_ptrs, b_ptrs, pid_m * BM, pid_n * BN, kb * BK,
                                            s_ak, s_bk, BK, TMA and TMA_OK)
        sa = tl.load(sa_ptr + rows.to(tl.int64) * s_sam + kb * s_sak)
        sb = tl.load(sb_ptr + cols.to(tl.int64) * s_sbn + kb * s_sbk)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    c_ptrs = c_ptr + e.to(tl.int64) * s_ce + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def use_pipelined_configs(configs: list[triton.Config], wgrad_configs: list[triton.Config] | None = None) -> None:
    """Autotune the pipelined rows kernel over ``configs`` and the k kernel over ``wgrad_configs``
    (default the same) from now on: the tests' one config at a time; what was tuned is forgotten."""
    for kernel, candidates in ((_fp8_grouped_gemm_rows_pipelined_kernel, configs),
                               (_fp8_grouped_gemm_k_pipelined_kernel, wgrad_configs or configs)):
        kernel.configs = list(candidates)
        kernel.cache.clear()


def last_tuning(wgrad: bool = False) -> tuple[str, dict[str, float]]:
    """The config the rows (or, ``wgrad``, the k) pipelined kernel ran last, and the median ms of each
    candidate at its latest tuning ({} when only one was left to run)."""
    kernel = _fp8_grouped_gemm_k_pipelined_kernel if wgrad else _fp8_grouped_gemm_rows_pipelined_kernel
    timings = getattr(kernel, "configs_timings", None) or {}
    return config_name(kernel.best_config), {config_name(c): t[0] if isinstance(t, (list, tuple)) else t
                                             for c, t in timings.items()}


def tma_readable(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can read the 2-D ``t``: last dim contiguous, base and row stride
    16-byte aligned (this module's descriptors and fp8_gluon's)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def stacked_b(b_EKN: torch.Tensor) -> torch.Tensor | None:
    """The rows kernels' B [E, K, N] as one [E * N, K] matrix (each B[e] K-contiguous, the experts
    back to back), the view TMA reads; None for other layouts."""
    E, K, N = b_EKN.shape
    s_be, s_bk, s_bn = b_EKN.stride()
    return b_EKN.as_strided((E * N, K), (s_bn, 1)) if s_bk == 1 and s_be == N * s_bn else None


def rows_output(a_RK: torch.Tensor, sa_RB: torch.Tensor, b_EKN: torch.Tensor, sb_EBC: torch.Tensor,
                offsets_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The rows GEMMs' output, uninitialized: [R, N] in ``out_dtype`` (every implementation's, and the
    fake one of the rows ops here and in fp8_gluon: their arguments)."""
    return a_RK.new_empty(a_RK.shape[0], b_EKN.shape[2], dtype=out_dtype)


def k_output(a_MP: torch.Tensor, sa_MB: torch.Tensor, bt_NP: torch.Tensor, sbt_NB: torch.Tensor,
             padded_offsets_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The wgrad GEMMs' output, uninitialized: [E, M, N] in ``out_dtype`` (as rows_output)."""
    return a_MP.new_empty(padded_offsets_E.numel(), a_MP.shape[0], bt_NP.shape[0], dtype=out_dtype)


def _descriptor(t: torch.Tensor | None):
    """A host TMA descriptor of the 2-D ``t`` (block shape set per config), or None where TMA cannot
    read it (see tma_readable)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if t is None or not tma_readable(t):
        return None
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [BLOCK_K, BLOCK_K])


def _rows_pipelined(a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out):
    R, K = a_RK.shape
    E, _, N = b_EKN.shape
    s_be, s_bk, s_bn = b_EKN.stride()
    a_desc, b_desc = _descriptor(a_RK), _descriptor(stacked_b(b_EKN))
    tma_ok = int(a_desc is not None and b_desc is not None)
    if not tma_ok:
        a_desc = b_desc = None
    grid = lambda meta: (triton.cdiv(N, meta["BN"]), triton.cdiv(R, meta["BM"]) + E)  # noqa: E731
    _fp8_grouped_gemm_rows_pipelined_kernel[grid](
        a_RK, a_desc, sa_RB, b_EKN, b_desc, sb_EBC, offsets_E, out, E, R, N, K, tma_ok,
        a_RK.stride(0), a_RK.stride(1), sa_RB.stride(0), sa_RB.stride(1), s_be, s_bk, s_bn,
        sb_EBC.stride(0), sb_EBC.stride(1), sb_EBC.stride(2), out.stride(0), out.stride(1),
        BK=BLOCK_K, EP=triton.next_power_of_2(E))


def fp8_grouped_mm_rows(a_RK: torch.Tensor, sa_RB: torch.Tensor, b_EKN: torch.Tensor, sb_EBC: torch.Tensor,
                        offsets_E: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                        kernel: GroupedKernel | None = None) -> torch.Tensor:
    """Grouped by rows (see the module docstring) -> [R, N] in ``out_dtype``; ``kernel`` (default
    KERNEL) picks the implementation."""
    R, K = a_RK.shape
    E, _, N = b_EKN.shape
    if K % BLOCK_K or N % BLOCK_K:
        raise ValueError(f"the fp8 grouped GEMM needs K ({K}) and N ({N}) to be multiples of {BLOCK_K}")
    offsets_E = offsets_E.to(torch.int32)
    kernel = GroupedKernel(kernel or KERNEL)
    if kernel == GroupedKernel.gluon:
        from . import fp8_gluon

        if fp8_gluon.supported(a_RK.device):  # an operator: torch.compile cannot trace Gluon launches
            return torch.ops.moetron.fp8_gluon_rows(a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out_dtype)
        kernel = GroupedKernel.pipelined
    if kernel == GroupedKernel.pipelined:  # an operator: torch.compile cannot trace its descriptors' checks
        return torch.ops.moetron.fp8_pipelined_rows(a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out_dtype)
    out = rows_output(a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out_dtype)
    grid = lambda meta: (triton.cdiv(N, BLOCK_K), triton.cdiv(R, meta["BM"]) + E)  # noqa: E731
    _fp8_grouped_gemm_rows_kernel[grid](a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out, E, N, K,
                       a_RK.stride(0), a_RK.stride(1), sa_RB.stride(0), sa_RB.stride(1),
                       b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2),
                       sb_EBC.stride(0), sb_EBC.stride(1), sb_EBC.stride(2), out.stride(0), out.stride(1),
                       BN=BLOCK_K, BK=BLOCK_K)
    return out


def fp8_grouped_mm_k(a_MP: torch.Tensor, sa_MB: torch.Tensor, bt_NP: torch.Tensor, sbt_NB: torch.Tensor,
                     padded_offsets_E: torch.Tensor, kernel: GroupedKernel | None = None,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Grouped along the reduction (see the module docstring) -> [E, M, N] in ``out_dtype`` (the fp32
    sums rounded once, by the kernel's store: bf16 for the optimizer's bf16 expert copies); ``kernel``
    (default KERNEL) picks the implementation."""
    M, P = a_MP.shape
    N = bt_NP.shape[0]
    E = padded_offsets_E.numel()
    if P % BLOCK_K:
        raise ValueError(f"the fp8 wgrad GEMM needs the padded rows ({P}) to be a multiple of {BLOCK_K}")
    kernel = GroupedKernel(kernel or KERNEL)
    padded_offsets_E = padded_offsets_E.to(torch.int32)
    if kernel == GroupedKernel.gluon:
        from . import fp8_gluon

        # fp8_gluon.K_CONFIG None: the pipelined kernel (as the wgrad ran before session 36)
        if fp8_gluon.K_CONFIG is not None and fp8_gluon.supported(a_MP.device):
            return torch.ops.moetron.fp8_gluon_k(a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E, out_dtype)
        kernel = GroupedKernel.pipelined
    if kernel == GroupedKernel.pipelined:  # an operator: torch.compile cannot trace its descriptors' checks
        return torch.ops.moetron.fp8_pipelined_k(a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E, out_dtype)
    out = k_output(a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E, out_dtype)
    grid = lambda meta: (triton.cdiv(N, meta["BN"]), triton.cdiv(M, meta["BM"]), E)  # noqa: E731
    _fp8_grouped_gemm_k_kernel[grid](a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E, out, M, N,
                    a_MP.stride(0), a_MP.stride(1), sa_MB.stride(0), sa_MB.stride(1),
                    bt_NP.stride(0), bt_NP.stride(1), sbt_NB.stride(0), sbt_NB.stride(1),
                    out.stride(0), out.stride(1), out.stride(2), BK=BLOCK_K)
    return out


# The pipelined kernels behind operators (core.precision.library: registered with torch.library.Library,
# their dispatch ~90 us of host time a call less than custom_op's): their TMA descriptors are built only where TMA can read the
# operands (tma_readable reads data_ptr(), which Dynamo cannot trace: under torch.compile the grouped
# GEMM's autograd.Function fell back to eager, forward and backward; session 36 call 2b's test).

def fp8_pipelined_rows(a_RK: torch.Tensor, sa_RB: torch.Tensor, b_EKN: torch.Tensor, sb_EBC: torch.Tensor,
                       offsets_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_grouped_mm_rows(kernel="pipelined") -> [R, N] in ``out_dtype``."""
    out = rows_output(a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out_dtype)
    _rows_pipelined(a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out)
    return out


def fp8_pipelined_k(a_MP: torch.Tensor, sa_MB: torch.Tensor, bt_NP: torch.Tensor, sbt_NB: torch.Tensor,
                    padded_offsets_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_grouped_mm_k(kernel="pipelined") -> [E, M, N] in ``out_dtype``."""
    M, N, E = a_MP.shape[0], bt_NP.shape[0], padded_offsets_E.numel()
    out = k_output(a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E, out_dtype)
    a_desc, b_desc = _descriptor(a_MP), _descriptor(bt_NP)
    tma_ok = int(a_desc is not None and b_desc is not None)
    if not tma_ok:
        a_desc = b_desc = None
    grid = lambda meta: (triton.cdiv(N, meta["BN"]), triton.cdiv(M, meta["BM"]), E)  # noqa: E731
    _fp8_grouped_gemm_k_pipelined_kernel[grid](
        a_MP, a_desc, sa_MB, bt_NP, b_desc, sbt_NB, padded_offsets_E, out, M, N, tma_ok,
        a_MP.stride(0), a_MP.stride(1), sa_MB.stride(0), sa_MB.stride(1), bt_NP.stride(0), bt_NP.stride(1),
        sbt_NB.stride(0), sbt_NB.stride(1), out.stride(0), out.stride(1), out.stride(2), BK=BLOCK_K)
    return out


define_op(fp8_pipelined_rows, rows_output)
define_op(fp8_pipelined_k, k_output)
