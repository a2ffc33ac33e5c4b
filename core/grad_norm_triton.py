"""The squared L2 norm of many gradients in Triton (trainer.triton_grad_norm): each tensor read once at
the streaming rate, per-program fp32 partial sums summed in a fixed order.

torch's ``_foreach_norm``, core/grad.py's default, ran at about 60-70% of the H100's HBM rate on
olmoe3-4l-8e's gradients (session 31's profile: 2.12 ms for the fp32 group of about 5.1 GB, 1.19 ms
for the bf16 expert gradients of about 2.4 GB, 125 launches, and 0.25 ms of GPU idle between them);
the floor, one read of each gradient, is about 2.5 ms at 3 TB/s. Here each tensor is cut into
programs of ``BLOCK * ITERS`` elements, each program writes the fp32 sum of its elements' squares
(bf16 widened exactly first) to its own slot of one partials buffer, in the order of the tensors,
and one sum over the partials gives the total: deterministic, and the same bits whether a gradient
is held in bf16 or fp32 (the same values give the same squares in the same programs).

    total = sum_of_squares_(tensors)      # a 0-dim fp32 tensor on their device

One launch per tensor (no pointer table, nothing copied from the host). CUDA tensors, or CPU tensors
under TRITON_INTERPRET=1 (the tests). Legend: N elements, P programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "ITERS", "supported", "sum_of_squares_"]

BLOCK = 4096
"""Elements a program reads per step (8 warps: 16 fp32 a thread, four 16-byte loads)."""
ITERS = 16
"""Steps a program: 64 Ki elements (256 KiB of fp32) a program."""


@triton.jit
def _sum_of_squares_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * (BLOCK * ITERS) + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(ITERS):
        x = tl.load(x_ptr + offs + i * BLOCK, mask=offs + i * BLOCK < N, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def supported(tensors: list[torch.Tensor]) -> bool:
    """Whether the kernel takes these tensors: contiguous fp32 / bf16, all on one CUDA device (or the
    CPU under the interpreter)."""
    import os

    if not tensors:
        return False
    device = tensors[0].device
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return ((device.type == "cuda" or (interpret and device.type == "cpu"))
            and all(t.device == device and t.dtype in (torch.float32, torch.bfloat16) and t.is_contiguous()
                    for t in tensors))


def sum_of_squares_(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum over ``tensors`` of sum(t ** 2), in fp32 (see the module docstring; ``supported`` first)."""
    per = BLOCK * ITERS
    programs = [triton.cdiv(t.numel(), per) for t in tensors]
    partials = torch.empty(sum(programs), dtype=torch.float32, device=tensors[0].device)
    start = 0
    for t, n in zip(tensors, programs):
        if n:
            _sum_of_squares_kernel[(n,)](t, partials[start:], t.numel(), BLOCK=BLOCK, ITERS=ITERS, num_warps=8)
        start += n
    return partials.sum()
