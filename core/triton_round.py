"""Rounding fp32 to bf16 inside Triton kernels, by the bits: round to nearest even, NaN kept (as
c10's round_to_nearest_even). Done with integer ops rather than a cast so that the CPU interpreter
(TRITON_INTERPRET=1, whose cast truncates and flushes subnormals) rounds exactly as the GPU does:
the kernels' tests compare bits. The one copy every moetron kernel that writes bf16 uses."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bf16_value", "round_to_bf16"]


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
