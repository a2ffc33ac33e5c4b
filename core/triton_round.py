"""Rounding fp32 to bf16 inside Triton kernels, by the bits: round to nearest even, NaN kept (as
c10's round_to_nearest_even). Done with integer ops rather than a cast so that the CPU interpreter
(TRITON_INTERPRET=1, whose cast truncates and flushes subnormals) rounds exactly as the GPU does:
the kernels' tests compare bits. The one copy every moetron kernel that writes bf16 uses; load_fp32 and
store_fp32_as are the fp32-or-bf16 load and store of the kernels that take either (AdamW's state, the
eager norm and RoPE)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bf16_value", "load_fp32", "round_to_bf16", "store_fp32_as"]


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
def load_fp32(ptr, offs, mask, IS_BF16: tl.constexpr):
    """fp32 values of fp32 (IS_BF16 false) or bf16 elements at ``offs``, 0 where masked; bf16 widened by
    its bits (exact, and the same under the interpreter, whose numpy has no bf16)."""
    # if/else, not an early return: Triton type-checks the code after a constexpr-taken return too.
    if IS_BF16:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True)
        x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def store_fp32_as(ptr, offs, x, mask, IS_BF16: tl.constexpr):
    """fp32 ``x`` stored as fp32 (IS_BF16 false) or rounded to the nearest even bf16 (round_to_bf16)."""
    if IS_BF16:
        tl.store(ptr + offs, round_to_bf16(x), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)
