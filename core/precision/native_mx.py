"""MXFP8 GEMMs on Blackwell (SM100+): torch.nn.functional.scaled_mm with BlockWise1x32 E8M0 scales
in the swizzled 128x4 layout (mx.swizzle_mx_scales, SwizzleType.SWIZZLE_32_4_4), each GEMM's
operands quantized along its own reduction dim (forward along I, dgrad along O, wgrad along the
tokens, padded with zero rows to a multiple of 32), weights quantized once per optimizer step.

NOT RUN: written against torch's documented API, never executed on Blackwell (there is none here);
the swizzle is tested on the CPU against torchao's to_blocked, bit for bit. The grouped expert GEMM
(torch._scaled_grouped_mm with per-group swizzled scales) is not built: PrecisionConfig refuses
native mxfp8 for the experts and names the emulated backend.

Legend: T tokens, I / O input / output dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import WeightCache
from .gemm import GemmBackend
from .mx import MX_BLOCK, quantize_mx, swizzle_mx_scales

__all__ = ["NativeMXGemm"]


def _mx_rows(x_MK: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized along K -> (e4m3 data [M, K], swizzled e8m0 scales)."""
    data, scale = quantize_mx(x_MK, MX_BLOCK, -1, mode)
    return data, swizzle_mx_scales(scale).view(torch.float8_e8m0fnu)


def _mx_mm(a, sa, bt, sbt) -> torch.Tensor:
    """a [M, K] @ bt[N, K]^T, both quantized along K."""
    st, sw = F.ScalingType, F.SwizzleType
    return F.scaled_mm(a, bt.t(), sa, st.BlockWise1x32, sbt, st.BlockWise1x32,
                       swizzle_a=sw.SWIZZLE_32_4_4, swizzle_b=sw.SWIZZLE_32_4_4, output_dtype=torch.bfloat16)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[0] % MX_BLOCK
    return F.pad(x, (0, 0, 0, pad)) if pad else x


class _NativeMXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TI, w_OI, gemm: "NativeMXGemm"):
        mode = gemm.scale_mode
        w_q, w_s = gemm.cache.get(w_OI, "mx_native_fwd", lambda w: _mx_rows(w, mode))
        y = _mx_mm(*_mx_rows(x_TI, mode), w_q, w_s)
        ctx.save_for_backward(*_mx_rows(_pad_rows(x_TI).t().contiguous(), mode), w_OI)  # x^T along tokens
        ctx.gemm, ctx.x_dtype = gemm, x_TI.dtype
        return y

    @staticmethod
    def backward(ctx, dy_TO):
        xt_q, xt_s, w_OI = ctx.saved_tensors
        gemm, mode = ctx.gemm, ctx.gemm.scale_mode
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wt_q, wt_s = gemm.cache.get(w_OI, "mx_native_dgrad", lambda w: _mx_rows(w.t().contiguous(), mode))
            dx = _mx_mm(*_mx_rows(dy_TO, mode), wt_q, wt_s).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyt_q, dyt_s = _mx_rows(_pad_rows(dy_TO).t().contiguous(), mode)
            dw = _mx_mm(dyt_q, dyt_s, xt_q, xt_s).to(w_OI.dtype)
        return dx, dw, None


class NativeMXGemm(GemmBackend):
    """MXFP8 through Blackwell's MX GEMMs (dense linears only; see the module docstring)."""

    name = "mxfp8_native"
    label = "mxfp8 (native MX GEMMs)"

    def __init__(self, scale_mode: str = "rceil") -> None:
        if not hasattr(F, "scaled_mm") or not hasattr(getattr(F, "SwizzleType", None), "SWIZZLE_32_4_4"):
            raise RuntimeError(f"native mxfp8 needs torch.nn.functional.scaled_mm with MX scales (torch "
                               f"{torch.__version__} has none): upgrade torch or use --precision.backend=emulated")
        self.scale_mode = scale_mode
        self.cache = WeightCache()

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x_TI = x.reshape(-1, x.shape[-1])
        return _NativeMXLinear.apply(x_TI, w, self).reshape(*x.shape[:-1], w.shape[0])

    def grouped_mm(self, x_RI, w_EOI, offsets_E):
        raise NotImplementedError("native mxfp8 grouped GEMM is not built: use --precision.backend=emulated "
                                  "or leave experts out of --precision.modules")

    def after_optimizer_step(self) -> None:
        self.cache.invalidate()
