"""FP8 blockwise GEMMs on the hardware (Hopper and newer): 1x128 activation / gradient tiles,
128x128 weight tiles, fp32 power-of-two scales, e4m3 (core.precision.blockwise).

- Dense linears: ``torch.nn.functional.scaled_mm`` with ScalingType.BlockWise1x128 (x, dy) and
  BlockWise128x128 (w) for the forward and the dgrad, BlockWise1x128 on both for the wgrad (a
  reduction over tokens); ``dense="triton"`` runs them through the grouped kernel with one group.
- Grouped experts: the Triton kernels of core.precision.fp8_triton (torch has no blockwise grouped
  GEMM for SM90), or ``experts="cublas"``: one F.scaled_mm per expert (core.precision.fp8_cublas,
  a host sync per GEMM); the wgrad's 128-token blocks never hold two experts' rows (pad_groups).

``wgrad="none"`` (precision.fp8_wgrad=none / false) runs the weight-gradient GEMMs in bf16 instead, from
the saved bf16 input and the bf16 output gradient (fp32 accumulation, as the bf16 recipe's): no
operand is quantized along the tokens (the transposed token tiles are the quantization's slow
output), the forward saves x in bf16 (2 bytes per element instead of 1 + 1/128), and the wgrad
is the bf16 GEMM's speed. Measured on the H200: faster in the eager grouped benchmark at the
64-expert olmoe shape, slower in every compiled step (docs/precision.md). ``wgrad="dense"``
(precision.fp8_wgrad=dense): the dense linears' wgrads in FP8, the grouped experts' in bf16.

Every operand is quantized along its GEMM's reduction dim; the layouts are the fast ones (the
K-contiguous operand of every GEMM: w and w^T both kept, once per optimizer step, where the weight
cache serves (eager steps, precision.quantize_weights_once); in a compiled step, w in the forward and
w^T in the backward, each made where it is used; x saved for the wgrad as fp8 along the tokens,
transposed). Quantization (``quant``): "triton" runs the fused kernels of
core.precision.blockwise_triton (one read of x or dy writes both its 1x128 rows and its transposed
token tiles; the expert padding of the wgrad operand is an index read in the load; w and w^T from
one read, or either alone from one), "torch" the reference ops, "auto" Triton on CUDA. Both give
the same bits.

Linears that read one input (q, k, v; a dense SwiGLU's gate, up) quantize it once with
precision.quantize_input_once (on by auto since session 38: _Fp8Linear takes several weights). With
precision.fp8_fused_swiglu the routed experts' whole SwiGLU MLP is one function (_Fp8GroupedSwiGLU:
the SwiGLU computed inside the quantization kernels; measured slower, off by default).

Legend: T tokens, R rows, P padded rows, E experts, I / O input / output dims, B blocks of 128.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import bf16_grouped
from .blockwise import FP8_BLOCK, quantize_128x128, quantize_1x128
from .cache import WeightCache
from .fp8_cublas import ROW_SLACK, m_fastest, tile_scales
from .gemm import Fp8Wgrad, GemmBackend, _is_swiglu, save_linears, saved_linears
from .grouping import gather_rows, pad_rows, padded_source_rows

__all__ = ["Fp8BlockwiseGemm", "has_blockwise_scaled_mm"]

QUANT = ("auto", "triton", "torch")
EXPERTS = ("triton", "cublas", "gluon")  # the grouped GEMMs: fp8_triton's kernels, fp8_cublas's loop over
# experts, or fp8_gluon's kernels (SM90; fp8_triton's elsewhere)


KBLOCK_MAJOR_TOKEN_SCALES = True
"""The grouped wgrad's operand scales laid out K-block-major ([P / 128, C] storage, read as [C, P / 128]),
the same values: the wgrad kernels read a K-block's scales of 128 columns at a time. Measured on the
H100 (session 36, docs/bench/session35/wgrad_probe.py): the pipelined Triton wgrad 1.29-1.32x faster on
them; the Gluon wgrad takes no other layout (its producer loads them by TMA)."""


def has_blockwise_scaled_mm() -> bool:
    return hasattr(F, "scaled_mm") and hasattr(getattr(F, "ScalingType", None), "BlockWise128x128")


def _weights_torch(w: torch.Tensor, data: bool = True, data_t: bool = True):
    """w [..., O, I] -> (data [..., O, I], data^T [..., I, O] contiguous, scales [..., O/128, I/128]);
    ``data`` / ``data_t`` False: that one None (quantize_128x128_triton's contract)."""
    q, scale = quantize_128x128(w)
    return q if data else None, q.transpose(-2, -1).contiguous() if data_t else None, scale


def _scaled_mm(a, sa, b, sb, recipe_b, out_dtype):
    st = F.ScalingType
    return F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, recipe_b, output_dtype=out_dtype)


def _quantize(gemm: "Fp8BlockwiseGemm", x_RC: torch.Tensor, rows: bool, tokens: bool,
              src_P: torch.Tensor | None = None, rows_out: int | None = None, dense: bool = False):
    """x's 1x128 operands: (rows, tokens), each (data, scale) or None (blockwise_triton's
    quantize_1x128_fused, whose reference this is: rows = quantize_1x128(x padded to rows_out, -1);
    tokens = quantize_1x128(x_P^T) with x_P = x[src_P] or x padded to whole 128s, data [C, P]).
    ``dense``: the operands of a dense linear (cuBLAS's scale layout under dense="scaled_mm")."""
    outer = gemm.dense == "scaled_mm" and dense  # cuBLAS's scale layout, for the dense GEMMs
    # the grouped wgrad's operands with K-block-major scales where the backend reads them so
    t_outer = outer or (not dense and gemm.kblock_major_token_scales)
    if gemm.uses_triton(x_RC):
        from .blockwise_triton import quantize_1x128_fused

        return quantize_1x128_fused(x_RC, rows, tokens, src_P, rows_out, outer, t_outer)
    rq = tq = None
    if rows:
        pad = (rows_out if rows_out is not None else x_RC.shape[0]) - x_RC.shape[0]
        d, s = quantize_1x128(F.pad(x_RC, (0, 0, 0, pad)) if pad else x_RC, -1)
        rq = (d, m_fastest(s) if outer else s)
    if tokens:
        x_P = gather_rows(x_RC, src_P) if src_P is not None else pad_rows(x_RC, FP8_BLOCK)
        d, s = quantize_1x128(x_P.t().contiguous(), -1)
        tq = (d, m_fastest(s) if t_outer else s)
    return rq, tq


def _weights(gemm: "Fp8BlockwiseGemm", w: torch.Tensor, backward: bool):
    """(w_q, w^T_q, scales) of w's 128x128 tiles. Where the WeightCache serves (eager steps,
    precision.quantize_weights_once) both come from one quantization per optimizer step. A traced
    graph cannot keep the cache and quantizes at every use: then only the pass's own operand is
    made (w_q for the forward, w^T_q for the backward's dgrad; the other None), each tile read once
    and one e4m3 copy written instead of two."""
    make = _weights_torch
    if gemm.uses_triton(w):
        from .blockwise_triton import quantize_128x128_triton as make
    if torch.compiler.is_compiling():
        return make(w, data=not backward, data_t=backward)
    return gemm.cache.get(w, "fp8_128x128", make)


def _rows_out(gemm: "Fp8BlockwiseGemm", T: int) -> int:
    return -(-T // gemm.row_multiple) * gemm.row_multiple


class _Fp8Linear(torch.autograd.Function):
    """x [T, I] through the weights ws (w_i [O_i, I]) -> (y_i [T, O_i], ...): x quantized once for all of
    them (its 1x128 rows for the forwards, its token tiles for the wgrads, saved once), each weight's
    GEMMs as a linear's; the input gradient summed over the weights in fp32, rounded once. One weight:
    the plain linear."""

    @staticmethod
    def forward(ctx, x_TI: torch.Tensor, gemm: "Fp8BlockwiseGemm", fp8_wgrad: bool, *ws: torch.Tensor):
        T = x_TI.shape[0]
        (x_q, x_s), xt = _quantize(gemm, x_TI, True, fp8_wgrad, rows_out=_rows_out(gemm, T), dense=True)
        ys = []
        for w_OI in ws:
            w_q, _, w_s = _weights(gemm, w_OI, backward=False)
            if gemm.dense == "scaled_mm":
                y = _scaled_mm(x_q, x_s, w_q.t(), tile_scales(w_s), F.ScalingType.BlockWise128x128, torch.bfloat16)
            else:
                from .fp8_triton import fp8_grouped_mm_rows

                y = fp8_grouped_mm_rows(x_q, x_s, w_q.t()[None], w_s.t()[None], _rows(x_q))
            ys.append(y[:T])
        save_linears(ctx, xt if fp8_wgrad else (x_TI.to(torch.bfloat16),), ws)
        ctx.gemm, ctx.x_dtype, ctx.tokens, ctx.fp8_wgrad = gemm, x_TI.dtype, T, fp8_wgrad
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys_TO: torch.Tensor):
        x_saved, ws = saved_linears(ctx)
        gemm, T, fp8_wgrad = ctx.gemm, ctx.tokens, ctx.fp8_wgrad
        # several weights: each dgrad in fp32, summed in place, rounded once
        dx_dtype = torch.float32 if len(ws) > 1 else torch.bfloat16
        dx, dws = None, []
        for i, (w_OI, dy_TO) in enumerate(zip(ws, dys_TO)):
            want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[3 + i]
            if dy_TO is None:  # an output nobody used
                dws.append(None)
                continue
            dyq, dyt = _quantize(gemm, dy_TO, want_dx, want_dw and fp8_wgrad, rows_out=_rows_out(gemm, T), dense=True)
            if want_dx:
                _, wt_q, w_s = _weights(gemm, w_OI, backward=True)
                dy_q, dy_s = dyq
                if gemm.dense == "scaled_mm":
                    dx_i = _scaled_mm(dy_q, dy_s, wt_q.t(), tile_scales(w_s.t()), F.ScalingType.BlockWise128x128,
                                      dx_dtype)
                else:
                    from .fp8_triton import fp8_grouped_mm_rows

                    dx_i = fp8_grouped_mm_rows(dy_q, dy_s, wt_q.t()[None], w_s[None], _rows(dy_q), dx_dtype)
                dx = dx_i[:T] if dx is None else dx.add_(dx_i[:T])
            dw = None
            if want_dw and not fp8_wgrad:  # bf16, fp32 accumulation
                dw = (dy_TO.to(torch.bfloat16).t() @ x_saved[0]).to(w_OI.dtype)
            elif want_dw:
                (dyt_q, dyt_s), (xt_q, xt_s) = dyt, x_saved
                if gemm.dense == "scaled_mm":
                    dw = _scaled_mm(dyt_q, dyt_s, xt_q.t(), xt_s, F.ScalingType.BlockWise1x128, torch.float32)
                else:
                    from .fp8_triton import fp8_grouped_mm_k

                    dw = fp8_grouped_mm_k(dyt_q, dyt_s, xt_q, xt_s, _rows(xt_q.t()))[0]
                dw = dw.to(w_OI.dtype)
            dws.append(dw)
        return (None if dx is None else dx.to(ctx.x_dtype), None, None, *dws)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """One group holding every row of x (the dense GEMM as a grouped one)."""
    return torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, gemm: "Fp8BlockwiseGemm"):
        from .fp8_triton import fp8_grouped_mm_rows

        R = x_RI.shape[0]
        cublas = gemm.experts == "cublas"
        w_q, _, w_s = _weights(gemm, w_EOI, backward=False)
        # the FP8 wgrad's operands: each expert's rows padded to whole 128s, read through an index
        # (a bf16 wgrad reads the rows as they are: no index)
        src_P, padded_offsets_E = (padded_source_rows(offsets_E, R, FP8_BLOCK) if gemm.fp8_wgrad_experts
                                   else (None, None))
        (x_q, x_s), xt = _quantize(gemm, x_RI, True, gemm.fp8_wgrad_experts, src_P,
                                   rows_out=R + ROW_SLACK if cublas else None)
        if cublas:  # B[e] = w[e] [O, I] as the [N, K] operand; its tiles [E, O/128, I/128]
            y_RO = torch.ops.moetron.fp8_cublas_rows(x_q, x_s, w_q, w_s, offsets_E)[:R]
        else:  # B[e] = w[e]^T [I, O], K-contiguous; its tiles [E, I/128, O/128]
            y_RO = fp8_grouped_mm_rows(x_q, x_s, w_q.transpose(1, 2), w_s.transpose(1, 2), offsets_E,
                                       kernel=gemm.grouped_kernel)
        x_saved = xt if gemm.fp8_wgrad_experts else (x_RI.to(torch.bfloat16),)
        ctx.save_for_backward(*x_saved, w_EOI, offsets_E, src_P, padded_offsets_E)
        ctx.gemm, ctx.x_dtype = gemm, x_RI.dtype
        return y_RO

    @staticmethod
    def backward(ctx, dy_RO: torch.Tensor):
        from .fp8_triton import fp8_grouped_mm_k, fp8_grouped_mm_rows

        *x_saved, w_EOI, offsets_E, src_P, padded_offsets_E = ctx.saved_tensors
        gemm, R = ctx.gemm, dy_RO.shape[0]
        cublas = gemm.experts == "cublas"
        dx = dw = None
        dyq, dyt = _quantize(gemm, dy_RO, ctx.needs_input_grad[0], ctx.needs_input_grad[1] and gemm.fp8_wgrad_experts,
                             src_P, rows_out=R + ROW_SLACK if cublas else None)
        if ctx.needs_input_grad[0]:
            _, wt_q, w_s = _weights(gemm, w_EOI, backward=True)
            if cublas:  # B[e] = w[e]^T [I, O] as the [N, K] operand; its tiles [E, I/128, O/128]
                dx = torch.ops.moetron.fp8_cublas_rows(*dyq, wt_q, w_s.transpose(1, 2), offsets_E)[:R]
            else:  # B[e] = w[e] [O, I] read from w^T's storage (K = O contiguous); tiles [E, O/128, I/128]
                dx = fp8_grouped_mm_rows(*dyq, wt_q.transpose(1, 2), w_s, offsets_E, kernel=gemm.grouped_kernel)
            dx = dx.to(ctx.x_dtype)
        if ctx.needs_input_grad[1] and not gemm.fp8_wgrad_experts:  # bf16, fp32 accumulation (the bf16 recipe's wgrad)
            _, dw = bf16_grouped.grouped_grads(dy_RO, x_saved[0], w_EOI, offsets_E.to(torch.int32),
                                               torch.bfloat16, False, True, per_expert=cublas)
        elif ctx.needs_input_grad[1]:
            if cublas:  # fp32 per expert, then the weight's dtype
                dw = torch.ops.moetron.fp8_cublas_k(*dyt, *x_saved, padded_offsets_E).to(w_EOI.dtype)
            else:  # in the weight's dtype from the kernel's store (bf16 on the optimizer's expert copies)
                dw = fp8_grouped_mm_k(*dyt, *x_saved, padded_offsets_E, kernel=gemm.grouped_kernel,
                                      out_dtype=w_EOI.dtype)
        return dx, dw, None, None


def _quantize_swiglu(gemm: "Fp8BlockwiseGemm", h_R2F: torch.Tensor, grad_act_RF: torch.Tensor | None,
                     src_P: torch.Tensor, tokens: bool):
    """The 1x128 operands (rows, tokens along src_P) of the SwiGLU product of h = [gate | up] (without
    ``grad_act_RF``) or of h's gradient (with it): blockwise_triton.quantize_1x128_swiglu, whose
    reference this is (the product or gradient made by the ops of swiglu() and of autograd's backward
    of it, then _quantize)."""
    if gemm.uses_triton(h_R2F):
        from .blockwise_triton import quantize_1x128_swiglu

        return quantize_1x128_swiglu(h_R2F, grad_act_RF, True, tokens, src_P,
                                     tokens_outer_major=gemm.kblock_major_token_scales)
    gate_RF, up_RF = h_R2F.chunk(2, dim=-1)
    silu_RF = F.silu(gate_RF)
    if grad_act_RF is None:
        v = silu_RF * up_RF
    else:  # autograd's backward of silu(gate) * up, op for op (traceable: no autograd.grad in a backward)
        v = torch.cat([torch.ops.aten.silu_backward(grad_act_RF * up_RF, gate_RF), grad_act_RF * silu_RF], dim=-1)
    return _quantize(gemm, v, True, tokens, src_P)


class _Fp8GroupedSwiGLU(torch.autograd.Function):
    """The routed experts' SwiGLU MLP in one function (precision.fp8_fused_swiglu): x -> h = x w_gate_up^T
    -> swiglu(h) -> w_down, the SwiGLU product quantized by the kernel that computes it (the forward) and
    h's gradient likewise from the product's gradient (the backward): neither the bf16 product nor the
    bf16 gradient of h is written and read back. The same bits as _Fp8GroupedMM twice around
    swiglu_triton's SwiGLU; the same tensors saved (x's and the product's token tiles, h), and one
    padded_source_rows for both GEMMs."""

    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, w_E2FD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor,
                gemm: "Fp8BlockwiseGemm"):
        from .fp8_triton import fp8_grouped_mm_rows

        kernel = gemm.grouped_kernel
        src_P, padded_offsets_E = padded_source_rows(offsets_E, x_RD.shape[0], FP8_BLOCK)
        wgu_q, _, wgu_s = _weights(gemm, w_E2FD, backward=False)
        (x_q, x_s), xt = _quantize(gemm, x_RD, True, True, src_P)
        h_R2F = fp8_grouped_mm_rows(x_q, x_s, wgu_q.transpose(1, 2), wgu_s.transpose(1, 2), offsets_E, kernel=kernel)
        del x_q, x_s
        (a_q, a_s), at = _quantize_swiglu(gemm, h_R2F, None, src_P, tokens=True)
        wd_q, _, wd_s = _weights(gemm, w_EDF, backward=False)
        y_RD = fp8_grouped_mm_rows(a_q, a_s, wd_q.transpose(1, 2), wd_s.transpose(1, 2), offsets_E, kernel=kernel)
        ctx.save_for_backward(*xt, *at, h_R2F, w_E2FD, w_EDF, offsets_E, src_P, padded_offsets_E)
        ctx.gemm, ctx.x_dtype = gemm, x_RD.dtype
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD: torch.Tensor):
        from .fp8_triton import fp8_grouped_mm_k, fp8_grouped_mm_rows

        xt_q, xt_s, at_q, at_s, h_R2F, w_E2FD, w_EDF, offsets_E, src_P, padded_offsets_E = ctx.saved_tensors
        gemm, kernel = ctx.gemm, ctx.gemm.grouped_kernel
        dyq, dyt = _quantize(gemm, dy_RD, True, ctx.needs_input_grad[2], src_P)
        _, wdt_q, wd_s = _weights(gemm, w_EDF, backward=True)
        grad_act_RF = fp8_grouped_mm_rows(*dyq, wdt_q.transpose(1, 2), wd_s, offsets_E, kernel=kernel)
        del dyq, wdt_q
        dw_down = (fp8_grouped_mm_k(*dyt, at_q, at_s, padded_offsets_E, kernel=kernel, out_dtype=w_EDF.dtype)
                   if ctx.needs_input_grad[2] else None)
        del dyt
        dhq, dht = _quantize_swiglu(gemm, h_R2F, grad_act_RF, src_P, tokens=ctx.needs_input_grad[1])
        del grad_act_RF
        dx = dw_gate_up = None
        if ctx.needs_input_grad[0]:
            _, wgut_q, wgu_s = _weights(gemm, w_E2FD, backward=True)
            dx = fp8_grouped_mm_rows(*dhq, wgut_q.transpose(1, 2), wgu_s, offsets_E, kernel=kernel).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw_gate_up = fp8_grouped_mm_k(*dht, xt_q, xt_s, padded_offsets_E, kernel=kernel, out_dtype=w_E2FD.dtype)
        return dx, dw_gate_up, dw_down, None, None


class Fp8BlockwiseGemm(GemmBackend):
    """FP8 blockwise on the GPU (see the module docstring). ``dense``: "scaled_mm" (cuBLAS through
    F.scaled_mm) or "triton" (the grouped kernel, one group). ``quant``: "auto" (the fused Triton
    quantization kernels on CUDA, torch ops elsewhere), "triton" or "torch". ``experts``: the
    grouped GEMMs through the Triton kernels ("triton", no host sync) or one cuBLAS GEMM per expert
    ("cublas": core/precision/fp8_cublas.py, one host sync per GEMM; faster with few experts) or the
    Gluon kernels ("gluon": core/precision/fp8_gluon.py, SM90; the Triton ones elsewhere).
    ``wgrad`` (gemm.Fp8Wgrad): the weight gradients in FP8 ("all"), in bf16 ("none", see the module
    docstring), or the dense linears' in FP8 and the grouped experts' in bf16 ("dense"). ``expert_copies``
    (precision.expert_weight_copies=optimizer with expert_grads_bf16): the routed experts compute on the
    optimizer's bf16 copies of their weights (gemm.attach_expert_copies): their 128x128 quantization
    reads 2 bytes an element instead of 4, and their FP8 wgrad kernels store bf16 gradients onto the
    copies (2 bytes written instead of 4; the optimizer reads those)."""

    name = "fp8_blockwise"
    label = "fp8_blockwise (1x128 / 128x128 FP8 GEMMs)"

    def __init__(self, dense: str = "scaled_mm", quant: str = "auto", experts: str = "triton",
                 wgrad: Fp8Wgrad | str | bool = Fp8Wgrad.all, expert_copies: bool = False,
                 fused_swiglu: bool = False, quantize_warps: int = 4, gluon_group: int = 1) -> None:
        if dense not in ("scaled_mm", "triton"):
            raise ValueError(f"dense must be 'scaled_mm' or 'triton', got {dense!r}")
        if quant not in QUANT:
            raise ValueError(f"quant must be one of {QUANT}, got {quant!r}")
        if experts not in EXPERTS:
            raise ValueError(f"experts must be one of {EXPERTS}, got {experts!r}")
        self.dense, self.quant, self.experts = dense, quant, experts
        self.wgrad = Fp8Wgrad(wgrad)
        self.fp8_wgrad, self.fp8_wgrad_experts = self.wgrad.dense_fp8, self.wgrad.experts_fp8
        self.row_multiple = 4 if dense == "scaled_mm" else 1  # cuBLAS: the 1x128 scales' rows in 4s
        self.expert_copies = bool(expert_copies)
        self.fused_swiglu = bool(fused_swiglu)
        self.quantize_warps = int(quantize_warps)  # precision.fp8_quantize_warps
        if self.quant != "torch":
            from .blockwise_triton import set_quantize_warps

            set_quantize_warps(self.quantize_warps)  # one kernel object: the backend built last sets it
        self.gluon_group = int(gluon_group)  # precision.fp8_gluon_group
        if experts == "gluon":
            from . import fp8_gluon

            fp8_gluon.set_rows_group(self.gluon_group)  # one module-level CONFIG: the backend built last sets it
        self.cache = WeightCache()

    @property
    def kblock_major_token_scales(self) -> bool:
        """Whether the grouped wgrad's operands (the tokens' 1x128 tiles) get K-block-major scales
        (KBLOCK_MAJOR_TOKEN_SCALES, for the Triton and Gluon experts; the cuBLAS loop reads its own)."""
        return KBLOCK_MAJOR_TOKEN_SCALES and self.experts in ("triton", "gluon")

    @property
    def grouped_kernel(self) -> str | None:
        """The fp8_triton.GroupedKernel of the grouped GEMMs: "gluon" for experts="gluon", else None
        (fp8_triton's default)."""
        return "gluon" if self.experts == "gluon" else None

    def uses_triton(self, x: torch.Tensor) -> bool:
        """Whether x's quantization runs the fused Triton kernels."""
        return self.quant == "triton" or (self.quant == "auto" and x.is_cuda)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._linears(_Fp8Linear, x, (w,), self.fp8_wgrad)[0]

    def linears(self, x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """precision.quantize_input_once: x quantized once for all of ws (_Fp8Linear); else one linear each."""
        if not self.quantize_input_once:
            return super().linears(x, ws)
        return self._linears(_Fp8Linear, x, ws, self.fp8_wgrad)

    def expert_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._linears(_Fp8Linear, x, (w,), self.fp8_wgrad_experts)[0]

    def grouped_mm(self, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        return self._grouped(_Fp8GroupedMM, x_RI, w_EOI, offsets_E, self)

    def grouped_swiglu_mlp(self, x_RD, w_E2FD, w_EDF, offsets_E, act, row_scale_R=None, w_dgrad_gate_up=None,
                           w_dgrad_down=None):
        """With ``fused_swiglu`` (precision.fp8_fused_swiglu), the Triton or Gluon experts, FP8 expert
        wgrads and the plain SwiGLU (or its recompute twin) with no row scale: the whole MLP as one
        function (_Fp8GroupedSwiGLU: the SwiGLU computed inside the quantization kernels); else the
        default composition."""
        if (self.fused_swiglu and self.experts in ("triton", "gluon") and self.fp8_wgrad_experts and _is_swiglu(act)
                and row_scale_R is None and w_dgrad_gate_up is None and w_dgrad_down is None):
            return self._grouped(_Fp8GroupedSwiGLU, x_RD, w_E2FD, w_EDF, offsets_E, self)
        return super().grouped_swiglu_mlp(x_RD, w_E2FD, w_EDF, offsets_E, act, row_scale_R, w_dgrad_gate_up,
                                          w_dgrad_down)

    def after_optimizer_step(self) -> None:
        self.cache.invalidate()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(dense={self.dense!r}, quant={self.quant!r}, experts={self.experts!r}, "
                f"wgrad={str(self.wgrad)!r}, expert_copies={self.expert_copies}, fused_swiglu={self.fused_swiglu})")
