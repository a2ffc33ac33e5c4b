"""One-pass AdamW update in Triton: each parameter tensor is read and written once (p, grad, both
moments, and optionally a bf16 copy of the updated weight), where torch's foreach path makes about
ten passes and its fused kernel cannot store bf16 moments.

The maths is torch.optim.AdamW's foreach (non-capturable) path on CUDA, operation for operation in
fp32 and in its order, with the FMAs nvcc forms in those kernels written out (tl.fma) and Triton's
own contraction off, IEEE division and square root (div_rn, sqrt_rn; Triton's defaults are
approximate):

    p  = p * (1 - lr * wd)                          # _foreach_mul_
    m  = fma(1 - beta1, g - m, m)                   # _foreach_lerp_ (weight < 0.5; else its other form)
    v  = fma(1 - beta2, g * g, v * beta2)           # _foreach_mul_, _foreach_addcmul_
    d  = sqrt(v) / sqrt(1 - beta2^t) + eps          # _foreach_sqrt, _foreach_div_, _foreach_add_
    p  = fma(-lr / (1 - beta1^t), m / d, p)         # _foreach_addcdiv_

Every scalar is computed on the host in double from the step count, as torch does, and rounded to
fp32 where torch's kernels take it (opmath float). bf16 moments are widened exactly and stored
rounded to nearest even (written with integer ops, so the interpreter rounds as the GPU does); the
update uses the unrounded fp32 moments, as core.adamw.PrecisionAwareAdamW's foreach path does.

Runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (set before triton is imported).
Tensors must be contiguous; p fp32; grad fp32 or bf16; moments fp32 or bf16.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .triton_round import round_to_bf16

__all__ = ["BLOCK", "adamw_update_"]

BLOCK = 1024
"""Elements per program when a call names none (read at each call; tools/bench_optim.py --block
sweeps it). 4 warps up to 2048 (8 or 16 fp32 per thread: 16-byte loads), 8 above."""


@triton.jit
def _bf16_bits_to_fp32(bits):
    """Exact widening of bf16 bit patterns (uint16) to fp32."""
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _load_fp32(ptr, offs, mask, IS_BF16: tl.constexpr):
    # if/else, not an early return: Triton type-checks the code after a constexpr-taken return too.
    if IS_BF16:
        x = _bf16_bits_to_fp32(tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True))
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def _store_state(ptr, offs, x, mask, IS_BF16: tl.constexpr):
    if IS_BF16:
        tl.store(ptr + offs, round_to_bf16(x), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, scale_ptr, n, decay, lerp_weight, beta2, one_minus_beta2,
                  bc2_sqrt, eps, neg_step_size,
                  GRAD_BF16: tl.constexpr, STATE_BF16: tl.constexpr, LERP_SMALL: tl.constexpr,
                  WRITE_OUT: tl.constexpr, GRAD_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = _load_fp32(g_ptr, offs, mask, GRAD_BF16)
    if GRAD_SCALE:  # the clip coefficient, as torch._foreach_mul_(grads, coef) would apply it
        g = g * tl.load(scale_ptr)
    m = _load_fp32(m_ptr, offs, mask, STATE_BF16)
    v = _load_fp32(v_ptr, offs, mask, STATE_BF16)
    p = p * decay
    # torch's lerp (ATen/native/Lerp.h): the form whose weight is small, for accuracy
    if LERP_SMALL:
        m = tl.fma(lerp_weight, g - m, m)
    else:
        m = tl.fma(-(g - m), 1.0 - lerp_weight, g)
    v = tl.fma(one_minus_beta2, g * g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = tl.fma(neg_step_size, tl.div_rn(m, denom), p)
    tl.store(p_ptr + offs, p, mask=mask)
    _store_state(m_ptr, offs, m, mask, STATE_BF16)
    _store_state(v_ptr, offs, v, mask, STATE_BF16)
    if WRITE_OUT:
        tl.store(out_ptr + offs, round_to_bf16(p), mask=mask)


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32 (Triton passes float arguments as fp32; this makes the
    rounding explicit and the same under the interpreter)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def adamw_update_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  out_bf16: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None,
                  block: int | None = None) -> None:
    """One AdamW step of one tensor, in place, in one kernel launch.

    ``p`` fp32 [N...]; ``grad`` fp32 or bf16, ``exp_avg`` / ``exp_avg_sq`` fp32 or bf16 (the same
    dtype), all of p's shape, contiguous, on p's device; ``step``: the step count after this step's
    increment (1 on the first); ``out_bf16``: None, or a contiguous bf16 tensor of p's shape that
    receives the updated p rounded to nearest; ``grad_scale``: None, or a 0-dim fp32 tensor on p's
    device multiplying the gradient first (the gradient-clipping coefficient, read on the device:
    the same fp32 product torch._foreach_mul_ forms, without the pass over the gradients). No host
    sync: every other scalar is a host float."""
    if p.dtype != torch.float32:
        raise TypeError(f"adamw_update_ takes fp32 parameters, got {p.dtype}")
    if exp_avg.dtype != exp_avg_sq.dtype or exp_avg.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"moments must both be fp32 or bf16, got {exp_avg.dtype} and {exp_avg_sq.dtype}")
    if grad.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"grad must be fp32 or bf16, got {grad.dtype}")
    tensors = [p, grad, exp_avg, exp_avg_sq] + ([] if out_bf16 is None else [out_bf16])
    if out_bf16 is not None and out_bf16.dtype != torch.bfloat16:
        raise TypeError(f"out_bf16 must be bf16, got {out_bf16.dtype}")
    if any(t.shape != p.shape or t.device != p.device or not t.is_contiguous() for t in tensors):
        raise ValueError("adamw_update_ needs contiguous tensors of the parameter's shape on its device")
    if grad_scale is not None and (grad_scale.dtype != torch.float32 or grad_scale.numel() != 1
                                   or grad_scale.device != p.device):
        raise ValueError("grad_scale must be a one-element fp32 tensor on the parameter's device")
    n = p.numel()
    if n == 0:
        return
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    lerp_weight = _fp32(1 - beta1)
    block = block or BLOCK
    grid = (triton.cdiv(n, block),)
    _adamw_kernel[grid](
        p, grad, exp_avg, exp_avg_sq, p if out_bf16 is None else out_bf16,
        p if grad_scale is None else grad_scale, n,
        _fp32(1 - lr * weight_decay), lerp_weight, _fp32(beta2), _fp32(1 - beta2),
        _fp32(bias_correction2**0.5), _fp32(eps), _fp32((lr / bias_correction1) * -1),
        GRAD_BF16=grad.dtype == torch.bfloat16, STATE_BF16=exp_avg.dtype == torch.bfloat16,
        LERP_SMALL=abs(lerp_weight) < 0.5, WRITE_OUT=out_bf16 is not None,
        GRAD_SCALE=grad_scale is not None, BLOCK=block,
        num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False,
    )
