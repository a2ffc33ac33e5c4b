"""FP8 rowwise GEMMs: E4M3 operands with one fp32 power-of-two scale per row of each operand along
its GEMM's reduction dim (torchao's "rowwise" float8 recipe, with power-of-two scales), for Hopper.

Which dim each GEMM quantizes along (y = x @ w^T, w [O, I]):

- forward  y  = x @ w^T:    x one scale per token (along I), w one per output row (along I);
- dgrad    dx = dy @ w:     dy one per token (along O), w one per input column (along O): w^T's rows;
- wgrad    dw = dy^T @ x:   dy and x one per column along the tokens; the grouped GEMM's per column
  *and per expert*, along that expert's rows only (each expert's rows padded to a multiple of 16,
  core.precision.grouping, so a scale never spans two experts and every group is 16-aligned).

The scale is blockwise.pow2_scale(amax): 2^ceil(log2(amax / 448)), so nothing saturates but by
rounding and data x scale is exact in bf16. One scale per row is coarser than fp8_blockwise's
1x128 tiles (an outlier raises the scale of its whole row), and the reason for this recipe is the
GEMM: torch's CUTLASS grouped kernel for it (``torch._scaled_grouped_mm``, SM90, the offsets on the
device, no host sync) ran the three expert GEMMs at 1.3-1.6x bf16 ``_grouped_mm`` with fp32
promotion and 1.6-2.2x with ``fast_accum`` on the H200 (docs/performance.md, session 11), where
fp8_blockwise's grouped kernels reach 0.7-1.1x.

- Native (SM90): dense linears through ``torch._scaled_mm`` (rowwise scales), the routed experts
  through ``torch._scaled_grouped_mm``; ``fast_accum`` (precision.fp8_fast_accum) lets the tensor
  cores accumulate without the periodic fp32 promotion (faster, less accurate over long K).
- Emulated (any device, the CPU tests): the same quantized operands dequantized (exact in bf16)
  through the bf16 GEMMs; the native GEMMs' dot products up to fp32 summation order.

It is neither fp8_blockwise nor MXFP8 and is never reported as either. Quantization on CUDA runs
core.precision.fp8_rowwise_triton's kernels (``KERNELS``); these torch functions are their
reference and the CPU's path (fused by inductor where compiled). Weights are quantized once per optimizer step where the WeightCache serves (eager, or
precision.quantize_weights_once). ``precision.bf16_experts=cublas`` makes the emulation's grouped
GEMMs one per expert, as in the other emulated backends.

Legend: T tokens, R expert-sorted rows, P padded rows, E experts, I / O input / output dims.
"""

from __future__ import annotations

import torch

from .blockwise import pow2_scale
from .cache import WeightCache
from .gemm import Fp8Wgrad, GemmBackend, save_linears, saved_linears
from .grouping import gather_rows, pad_rows, grouped_mm_2d2d, grouped_mm_2d3d, padded_source_rows
from .mx import E4M3_MAX

__all__ = ["ALIGN", "Fp8RowwiseGemm", "dequantize_rows", "quantize_group_cols", "quantize_rows"]

ALIGN = 16
"""The FP8 GEMMs' alignment: every reduction dim (tokens of a wgrad, each expert's group of them)
a multiple of 16 elements."""
_BF16 = torch.bfloat16


def quantize_rows(x: torch.Tensor, axis: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (e4m3 data of x's shape, fp32 scale of x's shape without ``axis``): one power-of-two scale
    per line along ``axis`` (amax / scale <= 448)."""
    xf = x.to(torch.float32)
    scale = pow2_scale(xf.abs().amax(axis))
    data = (xf / scale.unsqueeze(axis)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, scale


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """quantize_rows' inverse: float32 of data's shape."""
    return data.to(torch.float32) * scale.unsqueeze(axis)


def _use_triton(x: torch.Tensor, kernel: str) -> bool:
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel must be 'auto', 'triton' or 'torch', got {kernel!r}")
    return kernel == "triton" or (kernel == "auto" and x.is_cuda)


def group_cols_amax(x_RC: torch.Tensor, src_P: torch.Tensor, padded_offsets_E: torch.Tensor,
                    kernel: str = "auto", chunks: torch.Tensor | None = None) -> torch.Tensor:
    """amax over each group's rows of x[src_P], per column -> fp32 [E, C] (0 for an empty group).
    ``kernel``: "triton" (fp8_rowwise_triton: a max per 16 rows, then per group over those; no
    atomics; also on the CPU under TRITON_INTERPRET=1), "torch" (scatter_reduce, the reference; its
    float atomics contend on a GPU), "auto" (Triton on CUDA)."""
    E, C = padded_offsets_E.numel(), x_RC.shape[1]
    if _use_triton(x_RC, kernel):
        from . import fp8_rowwise_triton as kernels

        if chunks is None:  # else made already by fp8_rowwise_triton.quantize_rows_chunks
            chunks = kernels.chunk_amax(x_RC, src_P)
        return kernels.group_amax(chunks, padded_offsets_E // kernels.CHUNK)
    x_PC = gather_rows(x_RC, src_P).to(torch.float32)
    group_P = _groups_of_rows(padded_offsets_E, x_PC.shape[0])
    return x_PC.new_zeros(E, C).scatter_reduce_(0, group_P[:, None].expand_as(x_PC), x_PC.abs(), "amax")


def _groups_of_rows(padded_offsets_E: torch.Tensor, P: int) -> torch.Tensor:
    """Each padded row's group (rows past the last group, zero rows, in the last)."""
    return torch.searchsorted(padded_offsets_E.to(torch.int64), torch.arange(P, device=padded_offsets_E.device),
                              right=True).clamp_max(padded_offsets_E.numel() - 1)


def quantize_group_cols(x_RC: torch.Tensor, src_P: torch.Tensor, padded_offsets_E: torch.Tensor,
                        kernel: str = "auto", chunks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped wgrad's operand: x[src_P] (padded_source_rows' layout, zero rows where src_P < 0)
    quantized along the rows of each group separately -> (data^T e4m3 [C, P] contiguous, the
    transposed layout the GEMM reads, scale fp32 [E, C]: group e's column c). No host sync.
    ``kernel``: as group_cols_amax (Triton: fp8_rowwise_triton.quantize_cols, one read of each tile).
    ``chunks`` (Triton): x's per-16-row column maxima already made (fp8_rowwise_triton.quantize_rows_chunks)."""
    scale_EC = pow2_scale(group_cols_amax(x_RC, src_P, padded_offsets_E, kernel, chunks))
    group_P = _groups_of_rows(padded_offsets_E, src_P.numel())
    if _use_triton(x_RC, kernel):
        from .fp8_rowwise_triton import quantize_cols

        return quantize_cols(x_RC, src_P, group_P, 1.0 / scale_EC), scale_EC  # 1 / 2^k: exact
    x_PC = gather_rows(x_RC, src_P).to(torch.float32)
    data_PC = (x_PC / scale_EC[group_P]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data_PC.t().contiguous(), scale_EC


def dequantize_group_cols(data_CP: torch.Tensor, scale_EC: torch.Tensor, padded_offsets_E: torch.Tensor) -> torch.Tensor:
    """quantize_group_cols' inverse: float32 [P, C] (the padded rows, zero where padding)."""
    group_P = _groups_of_rows(padded_offsets_E, data_CP.shape[1])
    return data_CP.t().to(torch.float32) * scale_EC[group_P]


KERNELS = "auto"
"""The GEMMs' quantization (rows, stacked columns, the wgrad's per-expert columns): "auto"
(fp8_rowwise_triton's kernels on CUDA; the torch ops elsewhere, fused by inductor where compiled),
"triton" (also on the CPU under TRITON_INTERPRET=1) or "torch". The same bits."""


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(x, -1): one scale per line along x's last dim."""
    if _use_triton(x, KERNELS):
        from .fp8_rowwise_triton import quantize_rows as rows_triton

        data, scale = rows_triton(x.reshape(-1, x.shape[-1]))
        return data.view(x.shape), scale.view(x.shape[:-1])
    return quantize_rows(x, -1)


def _cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(x^T, -1) of x [..., M, C] (one scale per column along M): data [..., C, M]
    contiguous, scale [..., C]; on CUDA without the transposed copy (M a multiple of 16)."""
    if _use_triton(x, KERNELS) and x.shape[-2] % ALIGN == 0:  # ALIGN: fp8_rowwise_triton.CHUNK
        from .fp8_rowwise_triton import quantize_stacked_cols

        data, scale = quantize_stacked_cols(x.reshape(-1, *x.shape[-2:]))
        return data.view(*x.shape[:-2], x.shape[-1], x.shape[-2]), scale.view(*x.shape[:-2], x.shape[-1])
    return quantize_rows(x.transpose(-2, -1).contiguous(), -1)


def _rows_and_group_cols(gemm: "Fp8RowwiseGemm", x_RC: torch.Tensor, src_P: torch.Tensor,
                         padded_offsets_E: torch.Tensor):
    """(_rows(x), quantize_group_cols(x, src_P, padded_offsets_E)): a grouped GEMM operand quantized
    for both of its GEMMs. On CUDA with ``gemm.fused_amax`` one kernel makes the rows and the
    columns' per-16-row maxima (x read once for both, not twice), where its tile fits the row
    (fp8_rowwise_triton.rows_chunks_fits: up to 4096 columns); the same bits."""
    if gemm.fused_amax and _use_triton(x_RC, KERNELS):
        from .fp8_rowwise_triton import quantize_rows_chunks, rows_chunks_fits

        if rows_chunks_fits(x_RC.shape[1]):
            data, scale, chunks = quantize_rows_chunks(x_RC, src_P)
            return (data, scale), quantize_group_cols(x_RC, src_P, padded_offsets_E, KERNELS, chunks=chunks)
    return _rows(x_RC), quantize_group_cols(x_RC, src_P, padded_offsets_E, KERNELS)


def _weight(gemm: "Fp8RowwiseGemm", w: torch.Tensor, orientation: str):
    """w [..., O, I] quantized for the forward ("rows": along I, data [..., O, I], scale [..., O]) or
    the dgrad ("cols": w^T along O, data [..., I, O], scale [..., I]), through the WeightCache. One
    entry per orientation: a compiled graph asks only for the one it uses (a Triton kernel's
    output is not dead code to inductor)."""
    return gemm.cache.get(w, f"fp8_rowwise_{orientation}", _rows if orientation == "rows" else _cols)


def _mm(gemm: "Fp8RowwiseGemm", a, sa, b, sb):
    """a [M, K] (scale [M]) @ b [K, N] (b's columns scaled, scale [N]), b given as the [N, K] data
    (K-contiguous) -> bf16 [M, N]."""
    if gemm.native:
        return torch._scaled_mm(a, b.t(), sa[:, None], sb[None, :], out_dtype=_BF16, use_fast_accum=gemm.fast_accum)
    return (dequantize_rows(a, sa).to(_BF16) @ dequantize_rows(b, sb).to(_BF16).t())


class _RowwiseLinear(torch.autograd.Function):
    """x [T, I] through n weights w_i [O_i, I] -> (y_i [T, O_i], ...): x's rows quantized once for
    the n forward GEMMs and its wgrad operand saved once; n = 1 is a plain linear. The backward's dx
    is the sum of the n dgrads (bf16 adds)."""

    @staticmethod
    def forward(ctx, x_TI: torch.Tensor, gemm: "Fp8RowwiseGemm", fp8_wgrad: bool, *w_OI: torch.Tensor):
        T = x_TI.shape[0]
        x_p = pad_rows(x_TI, ALIGN)  # the wgrad's reduction (tokens) 16-aligned; zero rows add nothing
        x_q, x_s = _rows(x_p)
        ys = tuple(_mm(gemm, x_q, x_s, *_weight(gemm, w, "rows"))[:T] for w in w_OI)
        # the wgrad's operand: along the tokens [I, T16] (FP8), or x in bf16 (fp8_wgrad=false)
        x_saved = _cols(x_p) if fp8_wgrad else (x_TI.to(_BF16),)
        save_linears(ctx, x_saved, w_OI)
        ctx.gemm, ctx.x_dtype, ctx.tokens, ctx.fp8_wgrad = gemm, x_TI.dtype, T, fp8_wgrad
        return ys

    @staticmethod
    def backward(ctx, *dy_TO: torch.Tensor):
        x_saved, w_OI = saved_linears(ctx)
        gemm, T, fp8_wgrad = ctx.gemm, ctx.tokens, ctx.fp8_wgrad
        dx, dws = None, []
        for i, (w, dy) in enumerate(zip(w_OI, dy_TO)):
            dw = None
            dy_p = pad_rows(dy, ALIGN)
            if ctx.needs_input_grad[0]:
                wt_q, wt_s = _weight(gemm, w, "cols")
                dy_q, dy_s = _rows(dy_p)
                dx_i = _mm(gemm, dy_q, dy_s, wt_q, wt_s)[:T]
                dx = dx_i if dx is None else dx + dx_i
            if ctx.needs_input_grad[3 + i] and not fp8_wgrad:  # bf16, fp32 accumulation
                dw = (dy.to(_BF16).t() @ x_saved[0]).to(w.dtype)
            elif ctx.needs_input_grad[3 + i]:
                dyt_q, dyt_s = _cols(dy_p)  # [O, T16] along the tokens
                dw = _mm(gemm, dyt_q, dyt_s, *x_saved).to(w.dtype)
            dws.append(dw)
        return None if dx is None else dx.to(ctx.x_dtype), None, None, *dws


def _grouped_rows(gemm: "Fp8RowwiseGemm", a_RK, sa_R, b_ENK, sb_EN, offsets_E):
    """out[rows of e] = a[rows of e] @ b[e]^T, b[e] [N, K] K-contiguous with a scale per row n ->
    bf16 [R, N]."""
    if gemm.native:
        return torch._scaled_grouped_mm(a_RK, b_ENK.transpose(-2, -1), sa_R, sb_EN, offs=offsets_E.to(torch.int32),
                                        out_dtype=_BF16, use_fast_accum=gemm.fast_accum)
    b_EKN = dequantize_rows(b_ENK, sb_EN).to(_BF16).transpose(-2, -1)
    return grouped_mm_2d3d(dequantize_rows(a_RK, sa_R).to(_BF16), b_EKN, offsets_E, gemm.per_expert)


class _RowwiseGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, gemm: "Fp8RowwiseGemm"):
        w_q, w_s = _weight(gemm, w_EOI, "rows")
        # the wgrad's operand: each expert's rows padded to 16, quantized along them per expert (or, with
        # fp8_wgrad=false, x in bf16 for a bf16 wgrad)
        src_P, padded_offsets_E = padded_source_rows(offsets_E, x_RI.shape[0], ALIGN)
        if gemm.fp8_wgrad_experts:
            (x_q, x_s), x_saved = _rows_and_group_cols(gemm, x_RI, src_P, padded_offsets_E)
        else:
            (x_q, x_s), x_saved = _rows(x_RI), (x_RI.to(_BF16),)
        y_RO = _grouped_rows(gemm, x_q, x_s, w_q, w_s, offsets_E)
        ctx.save_for_backward(*x_saved, w_EOI, offsets_E, src_P, padded_offsets_E)
        ctx.gemm, ctx.x_dtype = gemm, x_RI.dtype
        return y_RO

    @staticmethod
    def backward(ctx, dy_RO: torch.Tensor):
        *x_saved, w_EOI, offsets_E, src_P, padded_offsets_E = ctx.saved_tensors
        gemm = ctx.gemm
        dx = dw = None
        fp8_wgrad = ctx.needs_input_grad[1] and gemm.fp8_wgrad_experts
        if ctx.needs_input_grad[0] and fp8_wgrad:  # dy's rows and its columns per expert ([O, P], [E, O])
            (dy_q, dy_s), (dyt_q, dyt_s) = _rows_and_group_cols(gemm, dy_RO, src_P, padded_offsets_E)
        elif ctx.needs_input_grad[0]:
            dy_q, dy_s = _rows(dy_RO)
        elif fp8_wgrad:
            dyt_q, dyt_s = quantize_group_cols(dy_RO, src_P, padded_offsets_E, KERNELS)
        if ctx.needs_input_grad[0]:
            wt_q, wt_s = _weight(gemm, w_EOI, "cols")  # w[e]^T [I, O]: the dgrad's [N, K] operand
            dx = _grouped_rows(gemm, dy_q, dy_s, wt_q, wt_s, offsets_E).to(ctx.x_dtype)
        if ctx.needs_input_grad[1] and not gemm.fp8_wgrad_experts:  # bf16 operands, fp32 accumulation, bf16 output
            dw = grouped_mm_2d2d(dy_RO.to(_BF16).t(), x_saved[0], offsets_E, gemm.per_expert).to(w_EOI.dtype)
        elif fp8_wgrad:
            xt_q, xt_s = x_saved
            if gemm.native:
                dw = torch._scaled_grouped_mm(dyt_q, xt_q.t(), dyt_s.reshape(-1), xt_s.reshape(-1),
                                              offs=padded_offsets_E, out_dtype=_BF16, use_fast_accum=gemm.fast_accum)
            else:
                dw = grouped_mm_2d2d(dequantize_group_cols(dyt_q, dyt_s, padded_offsets_E).to(_BF16).t(),
                                     dequantize_group_cols(xt_q, xt_s, padded_offsets_E).to(_BF16), padded_offsets_E,
                                     gemm.per_expert)
            dw = dw.to(w_EOI.dtype)
        return dx, dw, None, None


class Fp8RowwiseGemm(GemmBackend):
    """FP8 rowwise (see the module docstring). ``native``: torch's scaled GEMMs (SM90), else the
    emulation (dequantized operands, bf16 GEMMs; any device). ``fast_accum``: the native GEMMs'
    accumulation without fp32 promotion. ``wgrad`` (gemm.Fp8Wgrad, precision.fp8_wgrad): the weight
    gradients in FP8 ("all", per column along the tokens) or in bf16 from the saved bf16 input
    ("none": no column quantization, x saved in 2 bytes per element instead of 1), or the dense
    linears' in FP8 and the routed experts' grouped ones in bf16 ("dense"). ``expert_copies``
    (precision.expert_weight_copies=optimizer with expert_grads_bf16): the routed experts compute
    with the optimizer's bf16 copies of their weights (gemm.attach_expert_copies), so the expert
    weights are quantized from bf16 (half the bytes read of fp32; E4M3 of the bf16-rounded weight,
    which can differ from the fp32 weight's in the last bit) and their gradients, the GEMMs' bf16
    outputs, stay bf16 on the copies (no cast to fp32). ``fused_amax`` (precision.fp8_fused_amax, on
    CUDA): a grouped operand's rows and its per-expert columns' partial maxima in one read of it
    (fp8_rowwise_triton.quantize_rows_chunks) instead of two kernels; the same bits."""

    name = "fp8_rowwise"

    def __init__(self, native: bool = True, fast_accum: bool = False, wgrad: Fp8Wgrad | str | bool = Fp8Wgrad.all,
                 expert_copies: bool = False, fused_amax: bool = True) -> None:
        self.native, self.fast_accum, self.wgrad = bool(native), bool(fast_accum), Fp8Wgrad(wgrad)
        self.fp8_wgrad, self.fp8_wgrad_experts = self.wgrad.dense_fp8, self.wgrad.experts_fp8
        self.expert_copies, self.fused_amax = bool(expert_copies), bool(fused_amax)
        self.cache = WeightCache()

    @property
    def label(self) -> str:
        if not self.native:
            return "fp8_rowwise (emulated: exact quantized operands, bf16 GEMMs)"
        return f"fp8_rowwise (per-row scaled FP8 GEMMs{', fast accumulation' if self.fast_accum else ''})"

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._linears(_RowwiseLinear, x, (w,), self.fp8_wgrad)[0]

    def linears(self, x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if not self.quantize_input_once:
            return super().linears(x, ws)
        return self._linears(_RowwiseLinear, x, ws, self.fp8_wgrad)

    def expert_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._linears(_RowwiseLinear, x, (w,), self.fp8_wgrad_experts)[0]

    def grouped_mm(self, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        return self._grouped(_RowwiseGroupedMM, x_RI, w_EOI, offsets_E, self)

    def after_optimizer_step(self) -> None:
        self.cache.invalidate()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(native={self.native}, fast_accum={self.fast_accum}, "
                f"wgrad={str(self.wgrad)!r}, expert_copies={self.expert_copies}, "
                f"fused_amax={self.fused_amax})")
