"""RoPE's rotation in one Triton pass, forward and backward (model.triton_rope; core/layers/rope.py).

The eager step runs apply_rotary as torch's separate kernels over q and k widened to fp32: a cast, a
slice and a negation, a concatenation, two products, a sum and the cast back, each a pass over the
[B, H, S, Dh] tensor, about as many again backward, and autograd keeps the fp32 copy. Here one pass
reads x (and the [S, Dh] fp32 tables) and writes the rotated x in its dtype; the backward is the same
pass rotating the other way. Under torch.compile the torch path is left to inductor.

Half-split layout, dims [0, Dh/2) paired with [Dh/2, Dh), in fp32 and in torch's order, products and
sums rounded one at a time (no FMA: enable_fp_fusion=False), so the results are torch's eager path's
bit for bit, both ways (the tests check equal tensors):

    forward   y1 = x1 * cos1 - x2 * sin1      y2 = x2 * cos2 + x1 * sin2
    backward  dx1 = g1 * cos1 + g2 * sin2     dx2 = g2 * cos2 - g1 * sin1

Legend: B batch, H heads, S sequence, Dh head dim (cos and sin [S, Dh]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_round import load_fp32, store_rounded

__all__ = ["rotate"]

BLOCK_H = 16
"""Heads per program (one program per (batch, position, block of heads))."""


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, S, H, HALF, sxb, sxh, sxs, syb, syh, sys,
                 IS_BF16: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // S).to(tl.int64)
    s = (pid % S).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < H) & (c[None, :] < HALF)
    xo = b * sxb + s * sxs + h[:, None].to(tl.int64) * sxh + c[None, :]
    yo = b * syb + s * sys + h[:, None].to(tl.int64) * syh + c[None, :]
    x1 = load_fp32(x_ptr + xo, mask, IS_BF16)
    x2 = load_fp32(x_ptr + xo + HALF, mask, IS_BF16)
    t = s * 2 * HALF + c
    inside = c < HALF
    cos1 = tl.load(cos_ptr + t, mask=inside, other=0.0)[None, :]
    cos2 = tl.load(cos_ptr + t + HALF, mask=inside, other=0.0)[None, :]
    sin1 = tl.load(sin_ptr + t, mask=inside, other=0.0)[None, :]
    sin2 = tl.load(sin_ptr + t + HALF, mask=inside, other=0.0)[None, :]
    if BACKWARD:
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    store_rounded(y_ptr + yo, y1, mask, IS_BF16)
    store_rounded(y_ptr + yo + HALF, y2, mask, IS_BF16)


def rotate(x_BHSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """x [B, H, S, Dh] (fp32 or bf16, any strides with the last dim contiguous) rotated by the fp32
    tables cos / sin [S, Dh] (the module docstring's forward; ``backward``: its transpose, the gradient
    of the forward for an incoming gradient x); a new tensor in x's dtype and memory layout."""
    if x_BHSD.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the Triton RoPE takes fp32 or bf16 tensors, got {x_BHSD.dtype}")
    B, H, S, D = x_BHSD.shape
    if (D % 2 or cos_SD.shape != (S, D) or sin_SD.shape != (S, D) or cos_SD.dtype != torch.float32
            or sin_SD.dtype != torch.float32 or not cos_SD.is_contiguous() or not sin_SD.is_contiguous()):
        raise ValueError(f"the Triton RoPE needs an even Dh and contiguous fp32 tables [S, Dh] = [{S}, {D}], "
                         f"got {tuple(cos_SD.shape)} {cos_SD.dtype} and {tuple(sin_SD.shape)} {sin_SD.dtype}")
    x = x_BHSD if x_BHSD.stride(-1) == 1 else x_BHSD.contiguous()
    y = torch.empty_like(x)  # x's layout where x is dense (its last dim contiguous), else contiguous
    if x.numel():
        half = D // 2
        _rope_kernel[(B * S, triton.cdiv(H, BLOCK_H))](
            x, cos_SD, sin_SD, y, S, H, half, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1),
            y.stride(2), IS_BF16=x.dtype == torch.bfloat16, BACKWARD=backward, BLOCK_H=BLOCK_H,
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4, enable_fp_fusion=False)
    return y
