"""The bf16 grouped expert GEMMs on fp32 master weights, as opaque ops that save less for backward.

Two things the plain ``torch._grouped_mm(x.to(bf16), w.to(bf16).transpose(-2, -1))`` keeps alive
from forward to backward, measured on one H200 with torch.compile (tools/bench_memory.py, OLMoE
shape): the bf16 copy of every expert weight (48 KiB per token per layer; 6 GiB on OLMoE-8L at
16k tokens: the compile partitioner saves the 2-byte copy rather than the 4-byte parameter), and
the SwiGLU product silu(gate) * up that feeds the down projection (16 KiB per token per layer).

``grouped_mm`` casts the weight inside the op and saves the fp32 parameter itself (no extra
memory: the optimizer holds it), casting again in backward (one more read of the weights per
step). ``grouped_swiglu_down`` is the down projection of the SwiGLU experts with the activation
inside: it saves the gate/up GEMM output (which the activation's backward needs anyway) and
recomputes the product in backward (it fuses only the plain SwiGLU, silu(gate) * up, whose
backward it writes out op for op as autograd runs it). Both are ``torch.library.custom_op``s with fake
implementations, so torch.compile traces them without graph breaks and its partitioner cannot
re-decide what they save; their backward ops are opaque too. Numerics: the same bf16 GEMMs and the
same elementwise ops (the activation's backward is autograd's, op for op, on the recomputed product), so
results equal the plain composition bit for bit (tests/core/test_bf16_grouped.py).

Legend: R expert-sorted rows, I / O a GEMM's input (reduction) / output dims, E groups (local
experts), F expert hidden, D model dim.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from .cache import WeightCache
from .grouping import grouped_mm_2d2d, grouped_mm_2d3d, host_ends

__all__ = ["grouped_grads", "grouped_mm", "grouped_swiglu_down", "scale_rows"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# precision.expert_weight_copies: caches of the bf16 weight copies, by id (an op argument must be a
# plain value); a cache holds a copy from its first use until invalidate() (after the optimizer step).
_CACHES: list[WeightCache] = []
NO_CACHE = -1


def register_cache() -> int:
    """A new weight cache's id, to pass to grouped_mm / grouped_swiglu_down."""
    _CACHES.append(WeightCache())
    return len(_CACHES) - 1


def cache(cache_id: int) -> WeightCache:
    return _CACHES[cache_id]


def _weight(w: Tensor, dt: torch.dtype, cache_id: int) -> Tensor:
    """w in dt: a cast, or (a cache given, w not in dt already) the step's cached cast."""
    if cache_id == NO_CACHE or w.dtype == dt:
        return w.to(dt)
    return _CACHES[cache_id].get(w, str(dt), lambda t: t.to(dt))


def scale_rows(a_RF: Tensor, row_scale_R: Tensor | None) -> Tensor:
    """a_RF [R, F] times row_scale_R [R] per row, in fp32 (or wider) rounded to a's dtype (None: a itself)."""
    if row_scale_R is None:
        return a_RF
    acc = torch.promote_types(a_RF.dtype, torch.float32)
    return (a_RF.to(acc) * row_scale_R.to(acc)[:, None]).to(a_RF.dtype)


def _gmm(x_RI: Tensor, w_EOI: Tensor, offsets_E: Tensor, per_expert: bool = False) -> Tensor:
    if per_expert:
        return grouped_mm_2d3d(x_RI, w_EOI.transpose(-2, -1), offsets_E, per_expert=True)
    return torch._grouped_mm(x_RI, w_EOI.transpose(-2, -1), offs=offsets_E)


def grouped_grads(grad_RO: Tensor, x_RI: Tensor, w_EOI: Tensor, offsets_E: Tensor | list[int], dtype: torch.dtype,
                  need_x: bool, need_w: bool, cache_id: int = NO_CACHE,
                  per_expert: bool = False) -> tuple[Tensor | None, Tensor | None]:
    """dgrad [R, I] = grad @ w[e] per group; wgrad [E, O, I] = grad^T @ x per group (in w's dtype), the
    GEMMs in ``dtype`` (offsets_E int32, inclusive cumsum); ``per_expert``: one cuBLAS GEMM per group
    (grouping.grouped_mm_2d3d / 2d2d) instead of torch._grouped_mm, its wgrad written in w's dtype
    straight from the fp32 sums (no bf16 rounding and cast pass for fp32 master weights); the group
    sizes read to the host once for both (or passed in as a host list: grouping.host_ends)."""
    grad_RO = grad_RO.to(dtype)
    if per_expert:
        offsets_E = host_ends(offsets_E)
    grad_x = grad_w = None
    if need_x:
        w = _weight(w_EOI, dtype, cache_id)
        grad_x = (grouped_mm_2d3d(grad_RO, w, offsets_E, per_expert=True) if per_expert
                  else torch._grouped_mm(grad_RO, w, offs=offsets_E))
    if need_w:
        x = x_RI.to(dtype)
        grad_w = (grouped_mm_2d2d(grad_RO.t(), x, offsets_E, per_expert=True, out_dtype=w_EOI.dtype) if per_expert
                  else torch._grouped_mm(grad_RO.t(), x, offs=offsets_E).to(w_EOI.dtype))
    return grad_x, grad_w


# ---- grouped_mm ------------------------------------------------------------------------------


@torch.library.custom_op("moetron::grouped_mm", mutates_args=())
def _grouped_mm_op(x: Tensor, w: Tensor, offsets: Tensor, dtype: str, cache_id: int, per_expert: bool) -> Tensor:
    dt = _DTYPES[dtype]
    return _gmm(x.to(dt), _weight(w, dt, cache_id), offsets, per_expert)


@_grouped_mm_op.register_fake
def _(x, w, offsets, dtype, cache_id, per_expert):
    return x.new_empty(x.shape[0], w.shape[1], dtype=_DTYPES[dtype])


@torch.library.custom_op("moetron::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward_op(grad: Tensor, x: Tensor, w: Tensor, offsets: Tensor, dtype: str,
                            cache_id: int, per_expert: bool) -> tuple[Tensor, Tensor]:
    grad_x, grad_w = grouped_grads(grad, x, w, offsets, _DTYPES[dtype], True, True, cache_id, per_expert)
    return grad_x.to(x.dtype), grad_w


@_grouped_mm_backward_op.register_fake
def _(grad, x, w, offsets, dtype, cache_id, per_expert):
    return torch.empty_like(x), torch.empty_like(w)


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offsets, dtype, cache_id, per_expert = inputs
    ctx.save_for_backward(x, w, offsets)
    ctx.dtype, ctx.cache_id, ctx.per_expert = dtype, cache_id, per_expert


def _grouped_mm_backward(ctx, grad):
    x, w, offsets = ctx.saved_tensors
    grad_x, grad_w = _grouped_mm_backward_op(grad, x, w, offsets, ctx.dtype, ctx.cache_id, ctx.per_expert)
    return grad_x, grad_w, None, None, None, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def grouped_mm(x_RI: Tensor, w_EOI: Tensor, offsets_E: Tensor, dtype: torch.dtype, cache_id: int | None = None,
               per_expert: bool = False) -> Tensor:
    """x_RI [R, I] (rows of group e in [offsets_E[e-1], offsets_E[e]), inclusive cumsum int32) times
    w_EOI[e]^T ([E, O, I], any float dtype, e.g. the fp32 master weight) -> [R, O] in ``dtype``, the
    GEMM run in ``dtype``. Differentiable in x and w (w's gradient in w's dtype); saves x and w
    themselves, never a cast copy (with ``cache_id`` from register_cache(): the cast is made once per
    step and kept in that cache until it is invalidated). ``per_expert`` (precision.bf16_experts=cublas):
    one cuBLAS GEMM per group, forward and backward, the group sizes read on the host (one sync in the forward, one shared by the backward's dgrad and wgrad),
    instead of torch._grouped_mm. Rows past offsets_E[-1] are unspecified."""
    return _grouped_mm_op(x_RI.to(dtype), w_EOI, offsets_E.to(torch.int32), _dtype_name(dtype),
                          NO_CACHE if cache_id is None else cache_id, bool(per_expert))


# ---- grouped_swiglu_down -----------------------------------------------------------------------


def _swiglu(h_R2F: Tensor) -> Tensor:
    from ..layers.mlp import swiglu

    gate_RF, up_RF = h_R2F.chunk(2, dim=-1)
    return swiglu(gate_RF, up_RF)


# Read once: TRITON_INTERPRET must be set before triton is imported anyway (not per GEMM call).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton_swiglu(h: Tensor, wanted: bool) -> bool:
    """precision.triton_swiglu: the one-pass Triton SwiGLU on CUDA (and on the CPU under TRITON_INTERPRET=1)."""
    return wanted and h.dtype == torch.bfloat16 and (h.is_cuda or _INTERPRETED)


@torch.library.custom_op("moetron::grouped_swiglu_down", mutates_args=())
def _swiglu_down_op(h: Tensor, w: Tensor, offsets: Tensor, scale: Tensor | None, dtype: str, cache_id: int,
                    triton_swiglu: bool, per_expert: bool, save_product: bool) -> tuple[Tensor, Tensor]:
    """(the output [R, D], the unscaled product [R, F] where ``save_product``, else an empty tensor)."""
    dt = _DTYPES[dtype]
    h = h.to(dt)
    if use_triton_swiglu(h, triton_swiglu):
        from .swiglu_triton import swiglu_forward

        act = swiglu_forward(h.contiguous())
    else:
        act = _swiglu(h)
    y = _gmm(scale_rows(act, scale), _weight(w, dt, cache_id), offsets, per_expert)
    return y, (act if save_product else act.new_empty(0))


@_swiglu_down_op.register_fake
def _(h, w, offsets, scale, dtype, cache_id, triton_swiglu, per_expert, save_product):
    dt = _DTYPES[dtype]
    return (h.new_empty(h.shape[0], w.shape[1], dtype=dt),
            h.new_empty(h.shape[0], h.shape[1] // 2, dtype=dt) if save_product else h.new_empty(0, dtype=dt))


@torch.library.custom_op("moetron::grouped_swiglu_down_backward", mutates_args=())
def _swiglu_down_backward_op(grad: Tensor, h: Tensor, w: Tensor, offsets: Tensor, scale: Tensor | None, act: Tensor,
                             dtype: str, cache_id: int, triton_swiglu: bool,
                             per_expert: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``act``: the forward's product where it was saved (precision.save_swiglu_product), else empty
    (recomputed here)."""
    dt = _DTYPES[dtype]
    no_scale = h.new_empty(0, dtype=torch.float32)
    saved = act.dim() == 2  # the product [R, F]; not saved: a 1-D empty placeholder
    if per_expert:  # one host sync for the dgrad and the wgrad
        offsets = host_ends(offsets)
    grad_act, _ = grouped_grads(grad, None, w, offsets, dt, True, False, cache_id, per_expert)  # dgrad [R, F] (of the scaled product)
    if scale is None and use_triton_swiglu(h, triton_swiglu):
        from .swiglu_triton import swiglu_backward

        recomputed, grad_h = swiglu_backward(h.to(dt).contiguous(), grad_act.contiguous(), want_act=not saved)
        _, grad_w = grouped_grads(grad, act if saved else recomputed, w, offsets, dt, False, True, cache_id, per_expert)
        return grad_h.to(h.dtype), grad_w, no_scale
    gate_RF, up_RF = h.to(dt).chunk(2, dim=-1)
    silu_RF = F.silu(gate_RF)  # the product again, op for op as swiglu() computes it (silu_RF: its backward's too)
    act_RF = act if saved else silu_RF * up_RF
    grad_scale = no_scale
    if scale is not None:  # d/dscale_r = <grad of the scaled row, the unscaled row>, in fp32
        acc = torch.promote_types(grad_act.dtype, torch.float32)
        grad_scale = (grad_act.to(acc) * act_RF.to(acc)).sum(dim=-1)
        act_RF, grad_act = scale_rows(act_RF, scale), scale_rows(grad_act, scale)
    _, grad_w = grouped_grads(grad, act_RF, w, offsets, dt, False, True, cache_id, per_expert)
    # swiglu's backward as autograd runs it (mul, then silu's own backward kernel): same bits.
    grad_gate = torch.ops.aten.silu_backward(grad_act * up_RF, gate_RF)
    return torch.cat([grad_gate, grad_act * silu_RF], dim=-1).to(h.dtype), grad_w, grad_scale


@_swiglu_down_backward_op.register_fake
def _(grad, h, w, offsets, scale, act, dtype, cache_id, triton_swiglu, per_expert):
    grad_scale = (scale.new_empty(scale.shape, dtype=torch.promote_types(_DTYPES[dtype], torch.float32))
                  if scale is not None else h.new_empty(0, dtype=torch.float32))
    return torch.empty_like(h), torch.empty_like(w), grad_scale


def _swiglu_down_setup(ctx, inputs, output):
    h, w, offsets, scale, dtype, cache_id, triton_swiglu, per_expert, save_product = inputs
    _, act = output  # the saved product (or empty): no gradient flows into it
    ctx.mark_non_differentiable(act)
    ctx.set_materialize_grads(False)  # so its (absent) gradient is None, not a zero-filled [R, F]
    ctx.save_for_backward(h, w, offsets, scale, act)
    ctx.dtype, ctx.cache_id, ctx.triton_swiglu, ctx.per_expert = dtype, cache_id, triton_swiglu, per_expert


def _swiglu_down_backward(ctx, grad, _grad_act):
    h, w, offsets, scale, act = ctx.saved_tensors
    if grad is None:  # the output unused (materialize_grads is off)
        grad = h.new_zeros(h.shape[0], w.shape[1], dtype=_DTYPES[ctx.dtype])
    grad_h, grad_w, grad_scale = _swiglu_down_backward_op(grad, h, w, offsets, scale, act, ctx.dtype, ctx.cache_id,
                                                          ctx.triton_swiglu, ctx.per_expert)
    grad_scale = grad_scale.to(scale.dtype) if scale is not None else None
    return grad_h, grad_w, None, grad_scale, None, None, None, None, None


_swiglu_down_op.register_autograd(_swiglu_down_backward, setup_context=_swiglu_down_setup)


def grouped_swiglu_down(h_R2F: Tensor, w_EDF: Tensor, offsets_E: Tensor, dtype: torch.dtype,
                        cache_id: int | None = None, triton_swiglu: bool = False,
                        row_scale_R: Tensor | None = None, per_expert: bool = False,
                        save_product: bool = False) -> Tensor:
    """The SwiGLU experts' down projection with the activation inside: h_R2F [R, 2F] (gate columns,
    then up) -> silu(gate) * up [R, F] -> times w_EDF[e]^T per group -> [R, D] in ``dtype``.
    Differentiable in h and w; saves h and w, not the [R, F] product (recomputed in backward), unless
    ``save_product`` (precision.save_swiglu_product: the product kept too, 2 B x R x F more held, and
    the backward neither recomputes nor writes it; the same values either way);
    ``cache_id`` as in grouped_mm; ``triton_swiglu``: the activation and its backward in one Triton
    pass each (core/precision/swiglu_triton.py) on CUDA tensors; ``row_scale_R`` [R]: each row's
    product scaled by it (in fp32, rounded to ``dtype``) before the GEMM, differentiable in it too
    (model.moe.weights_before_down); ``per_expert`` as in grouped_mm."""
    y, _ = _swiglu_down_op(h_R2F.to(dtype), w_EDF, offsets_E.to(torch.int32), row_scale_R, _dtype_name(dtype),
                           NO_CACHE if cache_id is None else cache_id, bool(triton_swiglu), bool(per_expert),
                           bool(save_product))
    return y
