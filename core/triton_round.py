"""Rounding fp32 to bf16 inside Triton kernels, by the bits: round to nearest even, NaN kept (as
c10's round_to_nearest_even). Done with integer ops rather than a cast so that the CPU interpreter
(TRITON_INTERPRET=1, whose cast truncates and flushes subnormals) rounds exactly as the GPU does:
the kernels' tests compare bits. The one copy every moetron kernel that writes bf16 uses; load_fp32
(widen_fp32) and store_rounded are the fp32-or-bf16 load and store of every kernel that takes either
(the MX and blockwise quantizers, AdamW's state, the eager norm and RoPE)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bf16_value", "load_fp32", "round_to_bf16", "store_rounded", "widen_fp32"]


@triton.jit
def round_to_bf16(x):
    """fp32 x -> bf16, nearest even, NaN kept."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def bf16_value(x):
    """fp32 x rounded to the nearest bf16, as fp32 (an intermediate a torch op would round)."""
    return (round_to_bf16(x).to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def widen_fp32(v, IN_BF16: tl.constexpr):
    """Loaded values as fp32; IN_BF16: v holds a bf16 tensor's values or bits (its int16 view), widened by
    bits (exact, subnormals kept: the interpreter's conversion flushes them)."""
    # one return after the if/else: Triton 3.6 type-checks the code after a constexpr-taken return
    if IN_BF16:
        x = (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = v.to(tl.float32)
    return x


@triton.jit
def load_fp32(ptrs, mask, IN_BF16: tl.constexpr):
    """Load as fp32, 0 where masked (widen_fp32); IN_BF16: the pointers are a bf16 tensor's or its int16
    view's."""
    return widen_fp32(tl.load(ptrs, mask=mask, other=0), IN_BF16)


@triton.jit
def store_rounded(ptrs, v, mask, OUT_BF16: tl.constexpr):
    """Store fp32 v, as bf16 rounded to nearest even by its bits when OUT_BF16 (subnormals kept: the
    interpreter's conversion flushes them), else as the pointers' dtype."""
    if OUT_BF16:
        tl.store(ptrs, round_to_bf16(v), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)
