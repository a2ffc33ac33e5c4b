"""The routed experts' SwiGLU in one Triton pass each way, for core.precision.bf16_grouped's
grouped_swiglu_down and, as the differentiable op ``swiglu_rows``, the low-precision backends'
default grouped_swiglu_down (``precision.triton_swiglu``).

The torch composition runs, per MoE layer, silu then a multiply in forward, and in backward silu
again, the product again, two multiplies, silu's backward and a concatenation: seven passes over
[rows, F] tensors (on one H200, about 20 ms of a 231 ms OLMoE-8L step: tools/profile_step.py).
Here the forward is one pass (read gate and up, write the product) and the backward one pass (read
gate, up and the product's gradient; write the product for the weight gradient and the gradient of
[gate | up] in place of the concatenation; ``swiglu_rows``' backward does not write the product,
which the low-precision GEMMs do not need: they saved their own quantized copy of it). Every intermediate is rounded to the compute dtype where
the torch ops round it (silu's output, the product, each multiply), so results match the torch path
up to the exp/sigmoid implementation (tests/core/test_swiglu_triton.py states the tolerance).

Legend: R rows, F expert hidden; h_R2F = [gate | up].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_round import bf16_value, round_to_bf16

__all__ = ["swiglu_backward", "swiglu_forward", "swiglu_grads", "swiglu_product", "swiglu_rows"]

BLOCK_F = 1024


@triton.jit
def _silu(g):
    """F.silu's output of fp32 g, rounded to bf16 (as fp32)."""
    return bf16_value(g / (1.0 + tl.exp(-g)))


@triton.jit
def swiglu_product(g, u):
    """silu(g) * u as bf16 from fp32 gate and up values: every kernel's forward (here and the fused
    quantization of core.precision.blockwise_triton), the torch ops' roundings."""
    return round_to_bf16(_silu(g) * u)


@triton.jit
def swiglu_grads(g, u, ga):
    """(the gradients of gate, of up) as bf16 from fp32 gate, up and the product's gradient ga:
    every kernel's backward, autograd's roundings of swiglu()."""
    sig = 1.0 / (1.0 + tl.exp(-g))
    grad_s = bf16_value(ga * u)  # the multiply's gradient toward silu's output
    grad_g = bf16_value(grad_s * sig * (1.0 + g * (1.0 - sig)))  # silu's backward
    return round_to_bf16(grad_g), round_to_bf16(ga * _silu(g))


@triton.jit
def _swiglu_fwd_kernel(h_ptr, act_ptr, F, h_stride, act_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(h_ptr + row * h_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * h_stride + F + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(act_ptr + row * act_stride + cols, swiglu_product(g, u), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, grad_act_ptr, act_ptr, grad_h_ptr, F, h_stride, ga_stride, act_stride,
                       gh_stride, STORE_ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(h_ptr + row * h_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * h_stride + F + cols, mask=mask, other=0.0).to(tl.float32)
    ga = tl.load(grad_act_ptr + row * ga_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_ACT:
        tl.store(act_ptr + row * act_stride + cols, swiglu_product(g, u), mask=mask)
    grad_g, grad_u = swiglu_grads(g, u, ga)
    tl.store(grad_h_ptr + row * gh_stride + cols, grad_g, mask=mask)
    tl.store(grad_h_ptr + row * gh_stride + F + cols, grad_u, mask=mask)


def _grid(R: int, F: int) -> tuple[int, int]:
    return (R, triton.cdiv(F, BLOCK_F))


def swiglu_forward(h_R2F: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of h_R2F [R, 2F] (bf16, rows contiguous) -> [R, F] bf16."""
    R, F2 = h_R2F.shape
    F = F2 // 2
    act_RF = torch.empty(R, F, dtype=h_R2F.dtype, device=h_R2F.device)
    if R and F:
        _swiglu_fwd_kernel[_grid(R, F)](h_R2F, act_RF, F, h_R2F.stride(0), act_RF.stride(0), BLOCK=BLOCK_F)
    return act_RF


def swiglu_backward(h_R2F: torch.Tensor, grad_act_RF: torch.Tensor,
                    want_act: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the product silu(gate) * up [R, F], the gradient of h [R, 2F]) from h_R2F [R, 2F] and the
    product's gradient grad_act_RF [R, F] (bf16, rows contiguous); without ``want_act`` the product
    is neither written nor returned (None)."""
    R, F2 = h_R2F.shape
    F = F2 // 2
    act_RF = torch.empty(R, F, dtype=h_R2F.dtype, device=h_R2F.device) if want_act else None
    grad_h = torch.empty_like(h_R2F)
    if R and F:
        _swiglu_bwd_kernel[_grid(R, F)](h_R2F, grad_act_RF, act_RF if want_act else grad_h, grad_h, F, h_R2F.stride(0),
                                        grad_act_RF.stride(0), act_RF.stride(0) if want_act else 0, grad_h.stride(0),
                                        STORE_ACT=want_act, BLOCK=BLOCK_F)
    return act_RF, grad_h


@torch.library.custom_op("moetron::swiglu_rows", mutates_args=())
def _swiglu_rows_op(h: torch.Tensor) -> torch.Tensor:
    return swiglu_forward(h.contiguous())


@_swiglu_rows_op.register_fake
def _(h):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@torch.library.custom_op("moetron::swiglu_rows_backward", mutates_args=())
def _swiglu_rows_backward_op(h: torch.Tensor, grad_act: torch.Tensor) -> torch.Tensor:
    return swiglu_backward(h.contiguous(), grad_act.contiguous(), want_act=False)[1]


@_swiglu_rows_backward_op.register_fake
def _(h, grad_act):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


def _swiglu_rows_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_rows_backward(ctx, grad_act):
    (h,) = ctx.saved_tensors
    return _swiglu_rows_backward_op(h, grad_act)


_swiglu_rows_op.register_autograd(_swiglu_rows_backward, setup_context=_swiglu_rows_setup)


def swiglu_rows(h_R2F: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [R, F] of h_R2F [R, 2F] (bf16; gate columns, then up), differentiable in h:
    one Triton pass forward (swiglu_forward) and one backward (the gradient of h only). Saves h, as
    autograd's composition does; the same roundings as swiglu() (the module docstring)."""
    return _swiglu_rows_op(h_R2F)
