"""FP8 blockwise GEMMs on the hardware (Hopper and newer): 1x128 activation / gradient tiles,
128x128 weight tiles, fp32 power-of-two scales, e4m3 (core.precision.blockwise).

- Dense linears: ``torch.nn.functional.scaled_mm`` with ScalingType.BlockWise1x128 (x, dy) and
  BlockWise128x128 (w) for the forward and the dgrad, BlockWise1x128 on both for the wgrad (a
  reduction over tokens); ``dense="triton"`` runs them through the grouped kernel with one group.
- Grouped experts: the Triton kernels of core.precision.fp8_triton (torch has no blockwise grouped
  GEMM for SM90); the wgrad's 128-token blocks never hold two experts' rows (pad_groups).

Every operand is quantized along its GEMM's reduction dim; the layouts are the fast ones (the
K-contiguous operand of every GEMM: w and w^T both kept, once per optimizer step; x saved for the
wgrad as fp8 along the tokens, transposed). Quantization runs as torch ops (no fused kernels yet).

Legend: T tokens, R rows, P padded rows, E experts, I / O input / output dims, B blocks of 128.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blockwise import FP8_BLOCK, quantize_128x128, quantize_1x128
from .cache import WeightCache
from .gemm import GemmBackend
from .grouping import pad_groups

__all__ = ["Fp8BlockwiseGemm", "has_blockwise_scaled_mm"]


def has_blockwise_scaled_mm() -> bool:
    return hasattr(F, "scaled_mm") and hasattr(getattr(F, "ScalingType", None), "BlockWise128x128")


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -x.shape[0] % multiple
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def _weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., O, I] -> (data [..., O, I], data^T [..., I, O] contiguous, scales [..., O/128, I/128])."""
    data, scale = quantize_128x128(w)
    return data, data.transpose(-2, -1).contiguous(), scale


def _tokens_major(x_TC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] (T a multiple of 128) quantized along the tokens, stored transposed: (data [C, T]
    contiguous, scales [C, T/128]): the K-contiguous operand of a wgrad GEMM."""
    return quantize_1x128(x_TC.t().contiguous(), -1)


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """A [M, B] scale tensor laid out M-fastest (stride (1, M)), as cuBLAS's 1x128 scales want."""
    return s.t().contiguous().t()


def _tile_scales(s_NB: torch.Tensor) -> torch.Tensor:
    """128x128 scales of a GEMM's [N, K] operand, [N/128, K/128], as F.scaled_mm wants them for
    BlockWise128x128: K blocks padded to a multiple of 4, then [L4, N/128] with stride (1, L4)."""
    pad = -s_NB.shape[1] % 4
    s = F.pad(s_NB, (0, pad)) if pad else s_NB
    return s.contiguous().t()


def _scaled_mm(a, sa, b, sb, recipe_b, out_dtype):
    st = F.ScalingType
    return F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, recipe_b, output_dtype=out_dtype)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TI: torch.Tensor, w_OI: torch.Tensor, gemm: "Fp8BlockwiseGemm"):
        T = x_TI.shape[0]
        w_q, wt_q, w_s = gemm.cache.get(w_OI, "fp8_128x128", _weights)
        x_p = _pad_rows(x_TI, gemm.row_multiple)
        x_q, x_s = quantize_1x128(x_p, -1)
        if gemm.dense == "scaled_mm":
            y = _scaled_mm(x_q, _outer_major(x_s), w_q.t(), _tile_scales(w_s), F.ScalingType.BlockWise128x128,
                           torch.bfloat16)
        else:
            from .fp8_triton import fp8_grouped_mm_rows

            y = fp8_grouped_mm_rows(x_q, x_s, w_q.t()[None], w_s.t()[None], _rows(x_p))
        ctx.save_for_backward(*_tokens_major(_pad_rows(x_TI, FP8_BLOCK)), w_OI)
        ctx.gemm, ctx.x_dtype, ctx.tokens = gemm, x_TI.dtype, T
        return y[:T]

    @staticmethod
    def backward(ctx, dy_TO: torch.Tensor):
        xt_q, xt_s, w_OI = ctx.saved_tensors
        gemm, T = ctx.gemm, ctx.tokens
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_q, wt_q, w_s = gemm.cache.get(w_OI, "fp8_128x128", _weights)
            dy_p = _pad_rows(dy_TO, gemm.row_multiple)
            dy_q, dy_s = quantize_1x128(dy_p, -1)
            if gemm.dense == "scaled_mm":
                dx = _scaled_mm(dy_q, _outer_major(dy_s), wt_q.t(), _tile_scales(w_s.t()),
                                F.ScalingType.BlockWise128x128, torch.bfloat16)
            else:
                from .fp8_triton import fp8_grouped_mm_rows

                dx = fp8_grouped_mm_rows(dy_q, dy_s, wt_q.t()[None], w_s[None], _rows(dy_p))
            dx = dx[:T].to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyt_q, dyt_s = _tokens_major(_pad_rows(dy_TO, FP8_BLOCK))
            if gemm.dense == "scaled_mm":
                dw = _scaled_mm(dyt_q, _outer_major(dyt_s), xt_q.t(), _outer_major(xt_s), F.ScalingType.BlockWise1x128,
                                torch.float32)
            else:
                from .fp8_triton import fp8_grouped_mm_k

                dw = fp8_grouped_mm_k(dyt_q, dyt_s, xt_q, xt_s, _rows(xt_q.t()))[0]
            dw = dw.to(w_OI.dtype)
        return dx, dw, None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """One group holding every row of x (the dense GEMM as a grouped one)."""
    return torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, gemm: "Fp8BlockwiseGemm"):
        from .fp8_triton import fp8_grouped_mm_rows

        w_q, wt_q, w_s = gemm.cache.get(w_EOI, "fp8_128x128", _weights)
        x_q, x_s = quantize_1x128(x_RI, -1)
        # B[e] = w[e]^T [I, O], K-contiguous; its tiles [E, I/128, O/128]
        y_RO = fp8_grouped_mm_rows(x_q, x_s, w_q.transpose(1, 2), w_s.transpose(1, 2), offsets_E)
        x_PI, padded_offsets_E = pad_groups(x_RI, offsets_E, FP8_BLOCK)
        ctx.save_for_backward(*_tokens_major(x_PI), w_EOI, offsets_E, padded_offsets_E)
        ctx.gemm, ctx.x_dtype = gemm, x_RI.dtype
        return y_RO

    @staticmethod
    def backward(ctx, dy_RO: torch.Tensor):
        from .fp8_triton import fp8_grouped_mm_k, fp8_grouped_mm_rows

        xt_q, xt_s, w_EOI, offsets_E, padded_offsets_E = ctx.saved_tensors
        gemm = ctx.gemm
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_q, wt_q, w_s = gemm.cache.get(w_EOI, "fp8_128x128", _weights)
            dy_q, dy_s = quantize_1x128(dy_RO, -1)
            # B[e] = w[e] [O, I] read from w^T's storage (K = O contiguous); tiles [E, O/128, I/128]
            dx = fp8_grouped_mm_rows(dy_q, dy_s, wt_q.transpose(1, 2), w_s, offsets_E).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dy_PO, _ = pad_groups(dy_RO, offsets_E, FP8_BLOCK)
            dyt_q, dyt_s = _tokens_major(dy_PO)
            dw = fp8_grouped_mm_k(dyt_q, dyt_s, xt_q, xt_s, padded_offsets_E).to(w_EOI.dtype)
        return dx, dw, None, None


class Fp8BlockwiseGemm(GemmBackend):
    """FP8 blockwise on the GPU (see the module docstring). ``dense``: "scaled_mm" (cuBLAS through
    F.scaled_mm) or "triton" (the grouped kernel, one group)."""

    name = "fp8_blockwise"
    label = "fp8_blockwise (1x128 / 128x128 FP8 GEMMs)"

    def __init__(self, dense: str = "scaled_mm") -> None:
        if dense not in ("scaled_mm", "triton"):
            raise ValueError(f"dense must be 'scaled_mm' or 'triton', got {dense!r}")
        self.dense = dense
        self.row_multiple = 4 if dense == "scaled_mm" else 1  # cuBLAS: the 1x128 scales' rows in 4s
        self.cache = WeightCache()

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x_TI = x.reshape(-1, x.shape[-1])
        return _Fp8Linear.apply(x_TI, w, self).reshape(*x.shape[:-1], w.shape[0])

    def grouped_mm(self, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        return _Fp8GroupedMM.apply(x_RI, w_EOI, offsets_E, self)

    def after_optimizer_step(self) -> None:
        self.cache.invalidate()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dense={self.dense!r})"
