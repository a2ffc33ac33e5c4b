"""Emulated low-precision GEMMs: every GEMM's operands quantized exactly (MXFP8, or FP8 blockwise),
dequantized to bf16 (lossless: an E4M3 value times a power of two is a bf16 value), and run through
the bf16 GEMM (F.linear / torch._grouped_mm, or one cuBLAS GEMM per expert with
precision.bf16_experts=cublas; loops on the CPU). The dot products are those of the
hardware's scaled GEMMs up to fp32 summation order; the speed is not (on Hopper there is no MX
GEMM): results of these backends are labelled "emulated".

Which dim each GEMM quantizes along (y = x @ w^T, w [O, I]):

- forward  y  = x @ w^T:    x along I (its last dim), w along I;
- dgrad    dx = dy @ w:     dy along O (its last dim), w along O;
- wgrad    dw = dy^T @ x:   dy and x along the tokens.

MXFP8 (``MXFormat``): blocks of 32, E8M0 scales, w quantized twice (along I and along O).
FP8 blockwise (``BlockwiseFormat``): 1 x 128 tiles for x and dy, one 128 x 128 tiling of w for both.

The forward saves x for backward as the wgrad operand in its quantized form (fp8 data + scales
along the tokens: 1 + 1/32 bytes per element for MX, the memory Blackwell's recipe keeps), not as
bf16; precision.emulated_save_x_bf16 keeps that operand's bf16 quantize-dequantize instead (the same
values, 2 bytes per element, no dequantize pass in the backward: _quantize_x). Weights are quantized once per optimizer step (core.precision.cache.WeightCache); the cache
holds the dequantized bf16 copies the GEMMs consume.

Token blocks: a dense linear pads its tokens with zero rows to a whole block; the grouped GEMM pads
each expert's rows to a whole block (core.precision.grouping.padded_source_rows: pad_groups as an
index, on the device), so no block of its wgrad operands holds two experts' rows.

Kernels: on CUDA, MXFormat runs mx_triton's fused kernels (quantize-dequantize in one read and one
write; the padded wgrad operands gathered inside the load; an operand's rows and its wgrad columns
from one read, ``rows_and_cols``, and, where the weight cache serves, a weight's two orientations
from one read, ``weight_pair``); the torch ops elsewhere; same bits.

Legend: T tokens, R expert-sorted rows, P padded rows, E experts, I / O input / output dims.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .blockwise import FP8_BLOCK, dequantize_128x128, dequantize_1x128, quantize_128x128, quantize_1x128
from .cache import WeightCache
from .gemm import GemmBackend, save_linears, saved_linears
from .grouping import gather_rows, pad_rows, grouped_mm_2d2d, grouped_mm_2d3d, host_ends, padded_host_ends, padded_source_rows
from .mx import MX_BLOCK, dequantize_mx, quantize_mx

__all__ = ["BlockwiseFormat", "EmulatedGemm", "MXFormat", "mx_qdq"]

_BF16 = torch.bfloat16
KERNELS = ("auto", "triton", "torch")


def mx_qdq(x: torch.Tensor, axis: int, scale_mode: str, dtype: torch.dtype = _BF16) -> torch.Tensor:
    """x quantized to MX along ``axis`` and dequantized, in ``dtype`` (exact for bf16 and fp32)."""
    data, scale = quantize_mx(x, MX_BLOCK, axis, scale_mode)
    return dequantize_mx(data, scale, MX_BLOCK, axis).to(dtype)


FUSED = os.environ.get("MOETRON_MX_FUSED", "1") != "0"
"""mxfp8 on the GPU: an operand's two quantizations (its rows for one GEMM, its columns for the
wgrad) from one read (``MOETRON_MX_FUSED=0`` at import: two passes; the same bits)."""


def rows_and_cols(fmt: "MXFormat | BlockwiseFormat", x: torch.Tensor, src_rows: torch.Tensor | None,
                  cols_payload: bool) -> tuple[torch.Tensor, ...]:
    """Both quantizations of a 2-D GEMM operand x [R, C]: ``(rows, *cols)``, rows = fmt.qdq(x, -1)
    (bf16, for the GEMM that reduces over C) and cols along axis 0 of x[src_rows] (the padded wgrad
    operand; without src_rows, x with zero rows to a multiple of fmt.block): its payload
    (``cols_payload``, saved for the backward) or its bf16 qdq. Two passes (the formats' own
    ``rows_and_cols`` fuse them where a kernel does)."""
    rows = fmt.qdq(x, -1)
    xv = pad_rows(x, fmt.block) if src_rows is None else x
    if cols_payload:
        return (rows, *fmt.quantize(xv, 0, src_rows))
    return rows, fmt.qdq(xv, 0, src_rows)


def _gathered(x: torch.Tensor, src_rows: torch.Tensor | None) -> torch.Tensor:
    return x if src_rows is None else gather_rows(x, src_rows)


class MXFormat:
    """MXFP8: E4M3 + one E8M0 scale per 32 along the reduction dim, for every operand.

    ``kernels``: "triton" runs the fused kernels of mx_triton (quantize-dequantize in one pass, the
    padded wgrad operand gathered in the load), "torch" the reference ops, "auto" Triton on CUDA.
    Both give the same bits."""

    name = "mxfp8"
    block = MX_BLOCK

    def __init__(self, scale_mode: str = "rceil", kernels: str = "auto") -> None:
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        self.scale_mode = scale_mode
        self.kernels = kernels

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether x's two quantizations come from one read (mx_rows_and_cols_triton: the Triton path,
        the lean arithmetic, FUSED)."""
        from . import mx_triton

        return self._triton(x) and mx_triton.LEAN and FUSED

    def _triton(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and (self.kernels == "triton" or (self.kernels == "auto" and x.is_cuda))

    def quantize(self, x: torch.Tensor, axis: int, src_rows: torch.Tensor | None = None):
        """x (2-D) -> (e4m3 data, E8M0 codes) along ``axis``; of x[src_rows] (zero rows where < 0) if given."""
        if self._triton(x):
            from .mx_triton import quantize_mx_triton

            return quantize_mx_triton(x, MX_BLOCK, axis, self.scale_mode, src_rows=src_rows)
        return quantize_mx(_gathered(x, src_rows), MX_BLOCK, axis, self.scale_mode)

    def qdq(self, x: torch.Tensor, axis: int, src_rows: torch.Tensor | None = None) -> torch.Tensor:
        """quantize then dequantize, as bf16 (one pass on the GPU)."""
        if self._triton(x):
            from .mx_triton import mx_qdq_triton

            return mx_qdq_triton(x, axis, self.scale_mode, _BF16, src_rows=src_rows)
        return mx_qdq(_gathered(x, src_rows), axis, self.scale_mode)

    def rows_and_cols(self, x: torch.Tensor, src_rows: torch.Tensor | None, ends: torch.Tensor | None,
                      cols_payload: bool):
        """rows_and_cols (below), from one read of x on the GPU (mx_triton.mx_rows_and_cols_triton:
        the lean arithmetic; ``MOETRON_MX_FUSED=0`` or ``MOETRON_MX_LEAN=0`` runs the two passes)."""
        if self._fused(x):
            from .mx_triton import mx_rows_and_cols_triton

            return mx_rows_and_cols_triton(x, src_rows, ends, self.scale_mode, cols_payload)
        return rows_and_cols(self, x, src_rows, cols_payload)

    def dequantize(self, payload: tuple[torch.Tensor, ...], axis: int, dtype: torch.dtype = torch.float32):
        if self._triton(payload[0]):
            from .mx_triton import dequantize_mx_triton

            return dequantize_mx_triton(*payload, MX_BLOCK, axis, out_dtype=dtype)
        return dequantize_mx(*payload, MX_BLOCK, axis).to(dtype)

    def weight(self, w: torch.Tensor, axis: int) -> torch.Tensor:
        """w [..., O, I] quantized along ``axis`` (-1: I, forward; -2: O, dgrad), as bf16."""
        if w.dim() >= 2 and self._triton(w.reshape(-1, w.shape[-1])):
            # blocks of 32 along O never cross the leading dims (O % 32 == 0): one 2-D view
            w2 = w.reshape(-1, w.shape[-1])
            return self.qdq(w2, -1 if axis % w.dim() == w.dim() - 1 else 0).reshape(w.shape)
        # contiguous, as the kernels' output: a CPU bf16 GEMM's last bit can follow its operand's layout
        return mx_qdq(w, axis, self.scale_mode).contiguous()

    def pairs_weights(self, w: torch.Tensor) -> bool:
        """Whether weight_pair makes both of w's quantizations from one read (the fused kernel, on
        the GPU; O a whole number of blocks)."""
        return w.dim() >= 2 and w.shape[-2] % MX_BLOCK == 0 and self._fused(w.reshape(-1, w.shape[-1]))

    def weight_pair(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight(w, -1), weight(w, -2)) from one read of w (mx_rows_and_cols_triton on the 2-D view
        [..., O] x I: its rows are blocks along I, its columns blocks along O, which never cross the
        leading dims as O % 32 == 0)."""
        from .mx_triton import mx_rows_and_cols_triton

        rows, cols = mx_rows_and_cols_triton(w.reshape(-1, w.shape[-1]), None, None, self.scale_mode, cols_payload=False)
        return rows.reshape(w.shape), cols.reshape(w.shape)

    def weight_tag(self, axis: int | str) -> str:
        return f"mx_{self.scale_mode}_{axis}"

    def __repr__(self) -> str:
        return f"MXFormat(scale_mode={self.scale_mode!r})"


class BlockwiseFormat:
    """FP8 blockwise: 1 x 128 tiles (fp32 power-of-two scales) for activations and gradients,
    128 x 128 tiles for weights (one tiling serves the forward and the dgrad). Torch ops (the
    fused kernels serve the native backend, fp8_gemm)."""

    name = "fp8_blockwise"
    block = FP8_BLOCK

    def quantize(self, x: torch.Tensor, axis: int, src_rows: torch.Tensor | None = None):
        return quantize_1x128(_gathered(x, src_rows), axis)

    def qdq(self, x: torch.Tensor, axis: int, src_rows: torch.Tensor | None = None) -> torch.Tensor:
        return dequantize_1x128(*self.quantize(x, axis, src_rows), axis).to(_BF16)

    def rows_and_cols(self, x: torch.Tensor, src_rows: torch.Tensor | None, ends: torch.Tensor | None,
                      cols_payload: bool):
        return rows_and_cols(self, x, src_rows, cols_payload)

    def dequantize(self, payload: tuple[torch.Tensor, ...], axis: int, dtype: torch.dtype = torch.float32):
        return dequantize_1x128(*payload, axis).to(dtype)

    def weight(self, w: torch.Tensor, axis: int) -> torch.Tensor:
        return dequantize_128x128(*quantize_128x128(w)).to(_BF16)

    def pairs_weights(self, w: torch.Tensor) -> bool:
        return False  # one 128 x 128 tiling serves both GEMMs already

    def weight_tag(self, axis: int | str) -> str:
        return "fp8_128x128"

    def __repr__(self) -> str:
        return "BlockwiseFormat()"


def _weight(gemm: "EmulatedGemm", w: torch.Tensor, axis: int) -> torch.Tensor:
    """w quantized for the forward (axis -1) or the dgrad (-2), through the cache. Where the cache
    serves (eager, or quantize_weights_once) and a kernel makes both from one read, one entry holds
    both: the cache keeps both through the step either way, so it costs no memory."""
    fmt = gemm.format
    if not torch.compiler.is_compiling() and fmt.pairs_weights(w):
        forward, dgrad = gemm.cache.get(w, fmt.weight_tag("pair"), fmt.weight_pair)
        return forward if axis == -1 else dgrad
    return gemm.cache.get(w, fmt.weight_tag(axis), lambda t: fmt.weight(t, axis))


def _quantize_x(gemm: "EmulatedGemm", x: torch.Tensor, src_rows, ends) -> tuple[torch.Tensor, tuple]:
    """(x's rows quantized for the forward GEMM, what the backward keeps of its wgrad operand, the
    columns along the tokens): the e4m3 + scales payload (Blackwell's memory), or with
    ``gemm.save_x_bf16`` their bf16 quantize-dequantize (the same values; 2 B per element instead of
    1 + 1/32, and no dequantize pass in the backward)."""
    x_hat, *saved = gemm.format.rows_and_cols(x, src_rows, ends, not gemm.save_x_bf16)
    return x_hat, tuple(saved)


def _saved_x(fmt, x_saved: list[torch.Tensor]) -> torch.Tensor:
    """The wgrad operand in bf16 from what _quantize_x kept (one bf16 tensor, or the payload's two)."""
    return x_saved[0] if len(x_saved) == 1 else fmt.dequantize(tuple(x_saved), 0, _BF16)


class _EmulatedLinear(torch.autograd.Function):
    """x [T, I] through n weights w_i [O_i, I] -> (y_i [T, O_i], ...): x quantized once for all of them
    (its rows for the forward GEMMs, its wgrad operand saved once); n = 1 is a plain linear. The
    backward's dx is the sum of the n dgrads, accumulated in the GEMMs (addmm: one rounding each)."""

    @staticmethod
    def forward(ctx, x_TI: torch.Tensor, gemm: "EmulatedGemm", *w_OI: torch.Tensor):
        # the GEMMs' operand and the wgrads', saved quantized (tokens padded to whole blocks)
        x_hat_TI, x_saved = _quantize_x(gemm, x_TI, None, None)
        ys_TO = tuple(F.linear(x_hat_TI, _weight(gemm, w, -1)) for w in w_OI)
        save_linears(ctx, x_saved, w_OI)
        ctx.gemm, ctx.x_dtype = gemm, x_TI.dtype
        return ys_TO

    @staticmethod
    def backward(ctx, *dy_TO: torch.Tensor):
        x_saved, w_OI = saved_linears(ctx)
        gemm = ctx.gemm
        fmt = gemm.format
        dx_TI, dw_OI, x_hat_PI = None, [], None
        for i, (w, dy) in enumerate(zip(w_OI, dy_TO)):
            need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2 + i]
            dy_hat_TO = dy_hat_PO = None
            if need_x and need_w:
                dy_hat_TO, dy_hat_PO = fmt.rows_and_cols(dy, None, None, False)
            if need_x:
                dy_hat_TO = fmt.qdq(dy, -1) if dy_hat_TO is None else dy_hat_TO
                w_dgrad = _weight(gemm, w, -2)
                dx_TI = dy_hat_TO @ w_dgrad if dx_TI is None else torch.addmm(dx_TI, dy_hat_TO, w_dgrad)
                del dy_hat_TO
            if need_w:
                dy_hat_PO = fmt.qdq(pad_rows(dy, fmt.block), 0) if dy_hat_PO is None else dy_hat_PO
                x_hat_PI = _saved_x(fmt, x_saved) if x_hat_PI is None else x_hat_PI
                dw_OI.append((dy_hat_PO.t() @ x_hat_PI).to(w.dtype))
            else:
                dw_OI.append(None)
        return None if dx_TI is None else dx_TI.to(ctx.x_dtype), None, *dw_OI


class _EmulatedGroupedMM(torch.autograd.Function):
    """x_RI through w_EOI, every operand quantized (the module docstring); with ``w_dgrad`` the
    weights come quantized already (precision.quantized_expert_copies): w_EOI is the forward's
    operand, w_dgrad the dgrad's, and w_EOI still receives the weight gradient."""

    @staticmethod
    def forward(ctx, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, gemm: "EmulatedGemm",
                w_dgrad: torch.Tensor | None = None):
        fmt = gemm.format
        # the wgrad operand: each expert's rows padded to whole blocks (pad_groups, read through an index)
        src_P, padded_offsets_E = padded_source_rows(offsets_E, x_RI.shape[0], fmt.block)
        x_hat_RI, x_saved = _quantize_x(gemm, x_RI, src_P, offsets_E)
        w_fwd = w_EOI if w_dgrad is not None else _weight(gemm, w_EOI, -1)
        y_RO = grouped_mm_2d3d(x_hat_RI, w_fwd.transpose(-2, -1), offsets_E, gemm.per_expert)
        # the weight the dgrad reads: w_dgrad itself where given, else w to quantize there
        ctx.save_for_backward(*x_saved, w_EOI if w_dgrad is None else w_dgrad, offsets_E, src_P, padded_offsets_E)
        ctx.gemm, ctx.x_dtype, ctx.w_dtype, ctx.prequantized = gemm, x_RI.dtype, w_EOI.dtype, w_dgrad is not None
        return y_RO

    @staticmethod
    def backward(ctx, dy_RO: torch.Tensor):
        *x_saved, w_saved, offsets_E, src_P, padded_offsets_E = ctx.saved_tensors
        gemm = ctx.gemm
        fmt = gemm.format
        dx_RI = dw_EOI = None
        dy_hat_RO = dy_hat_PO = None
        # per_expert: the GEMM loops' group sizes read to the host once for the dgrad and the wgrad
        loops_E = host_ends(offsets_E) if gemm.per_expert else offsets_E
        padded_loops_E = padded_host_ends(loops_E, fmt.block) if gemm.per_expert else padded_offsets_E
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            dy_hat_RO, dy_hat_PO = fmt.rows_and_cols(dy_RO, src_P, offsets_E, False)
        if ctx.needs_input_grad[0]:
            dy_hat_RO = fmt.qdq(dy_RO, -1) if dy_hat_RO is None else dy_hat_RO
            w_dgrad = w_saved if ctx.prequantized else _weight(gemm, w_saved, -2)
            dx_RI = grouped_mm_2d3d(dy_hat_RO, w_dgrad, loops_E, gemm.per_expert).to(ctx.x_dtype)
            del dy_hat_RO
        if ctx.needs_input_grad[1]:
            x_hat_PI = _saved_x(fmt, x_saved)
            dy_hat_PO = fmt.qdq(dy_RO, 0, src_P) if dy_hat_PO is None else dy_hat_PO
            dw_EOI = grouped_mm_2d2d(dy_hat_PO.t(), x_hat_PI, padded_loops_E, gemm.per_expert,
                                     ctx.w_dtype if gemm.per_expert else None).to(ctx.w_dtype)
        return dx_RI, dw_EOI, None, None, None


class EmulatedGemm(GemmBackend):
    """A block format's numerics through bf16 GEMMs (see the module docstring); any device.

    ``expert_copies`` (precision.expert_weight_copies=optimizer with expert_grads_bf16): the routed
    experts compute with the optimizer's bf16 copies of their weights (gemm.attach_expert_copies):
    the weights are quantized from bf16 (half the bytes read of fp32; the quantization of bf16(w),
    which can differ from w's in a few elements' last bit), and the weight gradients stay bf16 on the
    copies (no cast pass to fp32 over every expert weight): the grouped GEMM's bf16 output, the same
    values as the fp32 weights' run; with precision.bf16_experts=cublas, whose per-expert GEMMs write
    an fp32 weight's gradient straight from the fp32 sums, the copies' gradient is those sums rounded
    to bf16 instead."""

    name = "emulated"

    def __init__(self, fmt: MXFormat | BlockwiseFormat | None = None, expert_copies: bool = False,
                 save_x_bf16: bool = False, quantized_copies: bool = False) -> None:
        self.format = fmt if fmt is not None else MXFormat()
        self.cache = WeightCache()
        self.expert_copies = bool(expert_copies)
        if quantized_copies and not (self.expert_copies and isinstance(self.format, MXFormat)):
            raise ValueError("quantized_copies is for mxfp8 (MXFormat) with expert_copies")
        # precision.quantized_expert_copies: the optimizer writes the expert copies MX-quantized both ways
        self.expert_copies_mx = self.format.scale_mode if quantized_copies else None
        self.save_x_bf16 = bool(save_x_bf16)
        """precision.emulated_save_x_bf16: each GEMM input's wgrad operand kept in bf16 (_quantize_x)."""

    @property
    def label(self) -> str:
        return f"{self.format.name} (emulated: exact quantized operands, bf16 GEMMs)"

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._linears(_EmulatedLinear, x, (w,))[0]

    def linears(self, x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if not self.quantize_input_once:
            return super().linears(x, ws)
        return self._linears(_EmulatedLinear, x, ws)

    def grouped_mm(self, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor,
                   w_dgrad: torch.Tensor | None = None) -> torch.Tensor:
        return self._grouped(_EmulatedGroupedMM, x_RI, w_EOI, offsets_E, self, w_dgrad)

    def after_optimizer_step(self) -> None:
        self.cache.invalidate()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.format!r}, expert_copies={self.expert_copies}, "
                f"save_x_bf16={self.save_x_bf16}, quantized_copies={self.quantized_copies})")

    @property
    def quantized_copies(self) -> bool:
        """precision.quantized_expert_copies (``expert_copies_mx`` set)."""
        return self.expert_copies_mx is not None
