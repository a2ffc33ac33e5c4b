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

Tested under TRITON_INTERPRET=1 against the torch reference (dequantize, float64 GEMM) on small
shapes, and on the GPU by tools/bench_gemm_fp8.py. Legend: R rows, P padded rows, E experts.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["fp8_grouped_mm_k", "fp8_grouped_mm_rows"]

BLOCK_K = 128
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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


def fp8_grouped_mm_rows(a_RK: torch.Tensor, sa_RB: torch.Tensor, b_EKN: torch.Tensor, sb_EBC: torch.Tensor,
                        offsets_E: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Grouped by rows (see the module docstring) -> [R, N] in ``out_dtype``."""
    R, K = a_RK.shape
    E, _, N = b_EKN.shape
    if K % BLOCK_K or N % BLOCK_K:
        raise ValueError(f"the fp8 grouped GEMM needs K ({K}) and N ({N}) to be multiples of {BLOCK_K}")
    out = torch.empty(R, N, dtype=out_dtype, device=a_RK.device)
    offsets_E = offsets_E.to(torch.int32)
    grid = lambda meta: (triton.cdiv(N, BLOCK_K), triton.cdiv(R, meta["BM"]) + E)  # noqa: E731
    _fp8_grouped_gemm_rows_kernel[grid](a_RK, sa_RB, b_EKN, sb_EBC, offsets_E, out, E, N, K,
                       a_RK.stride(0), a_RK.stride(1), sa_RB.stride(0), sa_RB.stride(1),
                       b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2),
                       sb_EBC.stride(0), sb_EBC.stride(1), sb_EBC.stride(2), out.stride(0), out.stride(1),
                       BN=BLOCK_K, BK=BLOCK_K)
    return out


def fp8_grouped_mm_k(a_MP: torch.Tensor, sa_MB: torch.Tensor, bt_NP: torch.Tensor, sbt_NB: torch.Tensor,
                     padded_offsets_E: torch.Tensor) -> torch.Tensor:
    """Grouped along the reduction (see the module docstring) -> fp32 [E, M, N]."""
    M, P = a_MP.shape
    N = bt_NP.shape[0]
    E = padded_offsets_E.numel()
    if P % BLOCK_K:
        raise ValueError(f"the fp8 wgrad GEMM needs the padded rows ({P}) to be a multiple of {BLOCK_K}")
    out = torch.empty(E, M, N, dtype=torch.float32, device=a_MP.device)
    grid = lambda meta: (triton.cdiv(N, meta["BN"]), triton.cdiv(M, meta["BM"]), E)  # noqa: E731
    _fp8_grouped_gemm_k_kernel[grid](a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E.to(torch.int32), out, M, N,
                    a_MP.stride(0), a_MP.stride(1), sa_MB.stride(0), sa_MB.stride(1),
                    bt_NP.stride(0), bt_NP.stride(1), sbt_NB.stride(0), sbt_NB.stride(1),
                    out.stride(0), out.stride(1), out.stride(2), BK=BLOCK_K)
    return out
