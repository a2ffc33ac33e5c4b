"""The token embedding's weight gradient in one Triton pass over the vocabulary, deterministic.

torch's CUDA backward of a dense embedding zero-fills the [V, D] gradient, then sorts the ids and
sums each id's rows in segments through several kernels (``sum_and_scatter``, ``compute_grad_weight``
and a scan): about 2 ms a step on olmoe3-4l-8e (16,384 tokens, V 100352, D 4096) on the H100, session
31's profile, where the floor is writing the [V, D] fp32 gradient once (1.64 GB, about 0.55 ms) and
reading the tokens' gradient rows (0.27 GB). Here one program per (vocabulary row, block of D)
writes its slice of the gradient: zeros where the row's id is absent, else the sum of the rows of
the tokens with that id, in increasing token order, in fp32. No zero-fill pass, no atomics: the same
bits on every run (and the same as a sequential fp32 loop over the tokens, which the tests check).

    grad_weight_VD = embedding_grad_(order_T, ends_V, grad_TD, out_VD)

Legend: T tokens, V vocabulary, D embedding dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_round import round_to_bf16

__all__ = ["embedding_grad_"]

BLOCK_D = 1024
"""Embedding columns per program."""
UNROLL = 8
"""A row's tokens loaded together (their sum still in order)."""


@triton.jit
def _embedding_grad_kernel(grad_ptr, order_ptr, ends_ptr, out_ptr, D, stride_grad, stride_out,
                           BLOCK: tl.constexpr, UNROLL: tl.constexpr, OUT_BF16: tl.constexpr):
    v = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < D
    start = tl.where(v > 0, tl.load(ends_ptr + tl.maximum(v - 1, 0)), 0)  # the previous id's run ends here
    end = tl.load(ends_ptr + v)
    acc = tl.zeros([BLOCK], tl.float32)
    # This id's tokens in increasing position (a stable sort), UNROLL at a time: the unrolled loads do
    # not depend on the sums, so they are in flight together (a frequent token's long run of rows is
    # not one dependent load after another), while the adds keep the sequential order. A load past
    # the run adds 0.0, which leaves the sum exact (begun at +0.0, it is never -0.0).
    for base in range(start, end, UNROLL):
        for j in tl.static_range(UNROLL):
            t = tl.load(order_ptr + tl.minimum(base + j, end - 1)).to(tl.int64)  # in the run, read or not
            in_run = base + j + tl.zeros([BLOCK], tl.int64) < end  # a [BLOCK] mask (the interpreter wants one)
            acc += tl.load(grad_ptr + t * stride_grad + cols, mask=inside & in_run, other=0.0).to(tl.float32)
    if OUT_BF16:  # nearest even on the GPU and under the interpreter alike (core/triton_round.py)
        tl.store(out_ptr + v * stride_out + cols, round_to_bf16(acc), mask=inside)
    else:
        tl.store(out_ptr + v * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


def embedding_grad_(order_T: torch.Tensor, ends_V: torch.Tensor, grad_TD: torch.Tensor,
                    out_VD: torch.Tensor) -> torch.Tensor:
    """Writes every row of ``out_VD`` [V, D]: row v = the sum over i in [ends_V[v - 1], ends_V[v]) (from 0
    for v = 0) of grad_TD[order_T[i]] (fp32 accumulation, in that order; zeros where the range is
    empty), in out_VD's dtype (fp32, or bf16 rounded to nearest even). ``order_T`` [T] int: the tokens
    stably sorted by id; ``ends_V`` [V] int: how many tokens have an id <= v (where each id's run ends
    in that order). Rows of grad_TD and out_VD contiguous."""
    V, D = out_VD.shape
    if grad_TD.stride(1) != 1 or out_VD.stride(1) != 1:
        raise ValueError("embedding_grad_: the rows of grad and out must be contiguous")
    if V == 0 or D == 0:
        return out_VD
    block = min(BLOCK_D, triton.next_power_of_2(D))
    _embedding_grad_kernel[(V, triton.cdiv(D, block))](grad_TD, order_T, ends_V, out_VD, D,
                                                       grad_TD.stride(0), out_VD.stride(0), BLOCK=block,
                                                       UNROLL=UNROLL, OUT_BF16=out_VD.dtype == torch.bfloat16, num_warps=4)
    return out_VD
