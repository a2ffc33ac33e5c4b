"""FP8 blockwise grouped GEMMs as one cuBLAS GEMM per expert: torch's blockwise ``scaled_mm``
(BlockWise1x128 activations and gradients, BlockWise128x128 weights; SM90, cuBLAS >= 12.9) over
each expert's rows, the group sizes read on the host. The alternative to the Triton kernels of
core/precision/fp8_triton.py, chosen by ``precision.fp8_experts=cublas``:

- It costs one host sync per GEMM (the group sizes) and one cuBLAS call per expert (about 55 us of
  CPU each on the H200 machine), so it pays where a layer has few experts with many rows each.
  Measured there (docs/performance.md, session 6; operands quantized beforehand, as
  tools/bench_fp8_variants.py's cublas column times them): 8 experts of 8192 rows x 4096 x 8192 run
  forward / dgrad / wgrad at 1.51x / 1.67x / 1.29x torch's bf16 grouped GEMM; 64 experts of 2048
  rows x 2048 x 2048 are CPU-bound at 0.43x.
- The same quantized operands and scales as the Triton kernels (e4m3, fp32 powers of two per 128
  of K applied to fp32 partial sums: cuBLAS's two-level accumulation, fast accumulation off); the
  fp32 sums run in cuBLAS's order.

Layouts (torch's checks): a GEMM's A [M, K] row-major with 1x128 scales [M, K / 128] laid out
M-fastest (stride (1, M)); B [K, N] column-major, with 128x128 scales [ceil(K / 512) x 4, N / 128]
K-blocks fastest, or 1x128 scales [N, K / 128] N-fastest. An expert's M is rounded up to a multiple
of 4 (cuBLAS refuses a blockwise GEMM with M = 61 or 10: CUBLAS_STATUS_NOT_SUPPORTED, measured on
the H200 with torch 2.11): the padding rows are the next expert's (or the
buffer's spare rows), their outputs overwritten by that expert's GEMM, which runs after it on the
same stream; ``ROW_SLACK`` spare rows past the last expert make room.

On the CPU the per-expert GEMM is a reference that checks torch's layout rules and computes in
fp32 from the dequantized operands, so the tests check the slicing and the scale layouts without a
GPU. Legend: R rows, P padded rows, E experts, K reduction, N output columns, B blocks of 128.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blockwise import FP8_BLOCK
from .library import define_op

__all__ = ["ROW_SLACK", "fp8_cublas_k", "fp8_cublas_rows", "m_fastest", "tile_scales"]

ROW_SLACK = 3  # rows past the last expert's: an expert's rows are read and written in 4s


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def m_fastest(s_MB: torch.Tensor) -> torch.Tensor:
    """A [M, B] scale tensor laid out M-fastest (stride (1, M)), as scaled_mm wants 1x128 scales;
    no copy when it already is."""
    return s_MB.t().contiguous().t()


def tile_scales(s_NB: torch.Tensor) -> torch.Tensor:
    """128x128 scales of a GEMM's [N, K] operand, [..., N / 128, K / 128], as scaled_mm wants them:
    K-blocks padded to a multiple of 4, then [..., L4, N / 128] with strides (1, L4) in the last two
    dims; with leading (expert) dims, made in one copy and indexed per expert as views."""
    pad = -s_NB.shape[-1] % 4
    return (F.pad(s_NB, (0, pad)) if pad else s_NB).contiguous().transpose(-2, -1)


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(f"fp8_cublas: {what} (the layout torch's blockwise scaled_mm checks)")


def _reference_mm(a_MK, sa_MB, b_KN, sb, b_tiles: bool, out):
    """The CPU stand-in of one blockwise scaled_mm: torch's layout checks, then fp32 on the
    dequantized operands (exact products, fp32 sums)."""
    M, K = a_MK.shape
    N = b_KN.shape[1]
    L = -(-K // FP8_BLOCK)
    _check(a_MK.stride(1) == 1 and b_KN.stride(0) == 1, "A row-major and B column-major")
    _check(tuple(sa_MB.shape) == (M, L) and sa_MB.stride(0) == 1 and (sa_MB.stride(1) == M or L == 1),
           f"A's 1x128 scales [{M}, {L}] with stride (1, {M}), got {tuple(sa_MB.shape)} {sa_MB.stride()}")
    _check(M % 4 == 0, f"A's rows ({M}) in 4s")
    a = a_MK.float() * sa_MB.repeat_interleave(FP8_BLOCK, 1)[:, :K]
    if b_tiles:
        L4 = _round4(L)
        _check(tuple(sb.shape) == (L4, -(-N // FP8_BLOCK)) and sb.stride(0) == 1 and sb.stride(1) == L4,
               f"B's 128x128 scales [{L4}, {N // FP8_BLOCK}] with stride (1, {L4}), got {tuple(sb.shape)} {sb.stride()}")
        b = b_KN.float() * sb[:L].repeat_interleave(FP8_BLOCK, 0)[:K].repeat_interleave(FP8_BLOCK, 1)[:, :N]
    else:
        _check(tuple(sb.shape) == (N, L) and sb.stride(0) == 1 and (sb.stride(1) == N or L == 1),
               f"B's 1x128 scales [{N}, {L}] with stride (1, {N}), got {tuple(sb.shape)} {sb.stride()}")
        b = b_KN.float() * sb.t().repeat_interleave(FP8_BLOCK, 0)[:K]
    out.copy_(a @ b)


def _mm(a_MK, sa_MB, b_KN, sb, b_tiles: bool, out) -> None:
    """out = blockwise scaled_mm(a, b) (1x128 A; B 128x128 tiles or 1x128), written in place."""
    if not a_MK.is_cuda:
        return _reference_mm(a_MK, sa_MB, b_KN, sb, b_tiles, out)
    st = F.ScalingType
    recipe_b = st.BlockWise128x128 if b_tiles else st.BlockWise1x128
    torch.ops.aten._scaled_mm_v2.out(a_MK, b_KN, [sa_MB], [st.BlockWise1x128.value], [], [sb], [recipe_b.value], [],
                                     None, out.dtype, [], False, out=out)


def fp8_cublas_rows(a_RK: torch.Tensor, sa_RB: torch.Tensor, b_ENK: torch.Tensor, sb_ENB: torch.Tensor,
                    offsets_E: torch.Tensor) -> torch.Tensor:
    """out[rows of e] = A[rows of e] @ B[e]^T (forward, dgrad) -> bf16 [R, N]. A [R, K] e4m3 with
    1x128 scales sa [R, K / 128] (any layout), R >= offsets_E[-1] + ROW_SLACK; B [E, N, K] e4m3,
    each B[e] K-contiguous (the [N, K] operand: a forward's w [O, I], a dgrad's w^T), its 128x128
    scales [E, N / 128, K / 128]. Rows past offsets_E[-1] are unspecified."""
    R, K = a_RK.shape
    E, N, _ = b_ENK.shape
    out = torch.empty(R, N, dtype=torch.bfloat16, device=a_RK.device)
    sb_E = tile_scales(sb_ENB)  # every expert's B scales laid out at once; views below
    start = 0
    for e, end in enumerate(offsets_E.tolist()):  # the one host sync
        if end > start:
            rows = slice(start, start + _round4(end - start))
            if rows.stop > R:
                raise ValueError(f"fp8_cublas_rows: A needs {ROW_SLACK} spare rows past the last expert's "
                                 f"({R} rows for offsets ending at {end})")
            _mm(a_RK[rows], m_fastest(sa_RB[rows]), b_ENK[e].t(), sb_E[e], True, out[rows])
        start = end
    return out


def _rows_fake(a_RK, sa_RB, b_ENK, sb_ENB, offsets_E):
    return a_RK.new_empty(a_RK.shape[0], b_ENK.shape[1], dtype=torch.bfloat16)


define_op(fp8_cublas_rows, _rows_fake)


def fp8_cublas_k(a_MP: torch.Tensor, sa_MB: torch.Tensor, bt_NP: torch.Tensor, sbt_NB: torch.Tensor,
                 padded_offsets_E: torch.Tensor) -> torch.Tensor:
    """out[e] = A[:, rows of e] @ Bt[:, rows of e]^T (wgrad: a reduction over each expert's rows,
    which start at multiples of 128, grouping.pad_groups) -> fp32 [E, M, N], zeros for an empty
    expert. A [M, P] and Bt [N, P] e4m3 row-major, 1x128 scales along P: [M, P / 128], [N, P / 128]."""
    M, P = a_MP.shape
    N = bt_NP.shape[0]
    E = padded_offsets_E.numel()
    out = torch.empty(E, M, N, dtype=torch.float32, device=a_MP.device)
    # both operands' scales transposed once ([P / 128, M], [P / 128, N] contiguous): an expert's
    # blocks of them are then a slice of rows, its M-fastest [M, blocks] a view
    sa_BM, sbt_BN = sa_MB.t().contiguous(), sbt_NB.t().contiguous()
    start = 0
    for e, end in enumerate(padded_offsets_E.tolist()):  # the one host sync
        if end > start:
            blocks = slice(start // FP8_BLOCK, end // FP8_BLOCK)
            _mm(a_MP[:, start:end], sa_BM[blocks].t(), bt_NP[:, start:end].t(), sbt_BN[blocks].t(), False, out[e])
        else:
            out[e].zero_()
        start = end
    return out


def _k_fake(a_MP, sa_MB, bt_NP, sbt_NB, padded_offsets_E):
    return a_MP.new_empty(padded_offsets_E.shape[0], a_MP.shape[0], bt_NP.shape[0], dtype=torch.float32)


define_op(fp8_cublas_k, _k_fake)
