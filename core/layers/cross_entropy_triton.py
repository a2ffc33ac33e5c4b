"""One chunk of the fused LM loss in one Triton pass per row: logsumexp, the target logit and, in
place, the logits' gradient (softmax - onehot, weighted), on the compute-dtype logits.

The torch path of core.layers.loss._chunked casts each chunk's bf16 logits to fp32 and walks them
about eight times (max, subtract, exp, sum, scale, scatter, cast); on one H200, OLMoE-8L's step
lost about 12.7 ms when this kernel replaced them (docs/performance.md, 2026-12-01: an estimate
from the end-to-end step, the optimizer's share taken out). Here each row is read twice (an online max/sum pass,
then the gradient pass) and written once, in its own dtype, with fp32 arithmetic: the fp32 chunk
never exists.

    lse, target_logit = ce_rows_(logits_CV, target_C, coef_C, z_loss_weight, grad=True)

The second read is the floor's third (two reads and a write: 2.5 GB a 4096-token chunk at V 100352,
0.88 ms at the H100's 2.8-3 TB/s, about the 3.5 ms of the step's four chunks measured in session
31). It comes from L2 only where the row was read recently: the rows in flight (a few programs per
SM, each a 200 KB row at that V: about 80 MB) outrun the 50 MB L2. ``REVERSED`` walks the gradient
pass from the row's end back, so it starts on the blocks the first pass read last, the ones still in
L2; ``NUM_WARPS`` (more warps, fewer programs per SM) shrinks the rows in flight. Both change the
order of independent element-wise work only: the same bits (tests/core/test_loss_triton.py).
``tools/bench_loss.py --rows`` times each setting: on the H100 (session 34) the reversed pass was the
faster at every block and warp count (0.829 against 0.858 ms a 4096-token chunk at the defaults),
hence the default; 16 warps reversed (0.819) is within that run's noise of 8.

Tried on the H100 and dropped (docs/performance.md, sessions 57-58): pipelining each row's loads (Triton's
``num_stages`` 2 or 3 on both passes' loops: 3 within 1% of none, 2 4-6% slower) and fewer programs than rows,
each looping over rows so that fewer rows are in flight (132-2,112 programs: 5-69% slower at 4,096- and
16,384-token chunks, as fewer programs keep fewer bytes in flight). The kernel moves its three passes at about the
card's HBM rate (3.0-3.1 TB/s on the H100), so the second read comes from HBM either way.

Legend: C tokens of the chunk, V vocab.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ce_rows_"]

BLOCK_V = 4096
"""Elements of a row per loop iteration."""
NUM_WARPS = 8
"""Warps per program (one program per row)."""
REVERSED = True
"""The gradient pass from the row's end back (see the module docstring; measured in session 34)."""


@triton.jit
def _ce_rows_kernel(logits_ptr, target_ptr, coef_ptr, lse_ptr, tgt_logit_ptr, V, stride, z_loss_weight,
                    GRAD: tl.constexpr, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    # Pass 1: per-lane running max and sum of exp (rescaled as the max grows), reduced at the end.
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # exp(-inf - -inf) would be NaN on lanes that have seen nothing yet: keep them at 0.
        s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
        m = m_new
    row_max = tl.max(m, axis=0)
    sum_exp = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), axis=0)
    lse = row_max + tl.log(sum_exp)
    target = tl.load(target_ptr + row).to(tl.int64)
    tl.store(lse_ptr + row, lse)
    tl.store(tgt_logit_ptr + row, tl.load(base + target).to(tl.float32))
    if GRAD:
        # d/dlogits of coef * (lse - x_t) + coef * z * lse^2 = coef * (1 + 2 z lse) softmax - coef onehot.
        coef = tl.load(coef_ptr + row)
        scale = coef * (1.0 + 2.0 * z_loss_weight * lse)
        n_blocks = tl.cdiv(V, BLOCK)
        for k in range(0, n_blocks):
            idx = ((n_blocks - 1 - k) if REVERSE else k) * BLOCK + cols
            inside = idx < V
            x = tl.load(base + idx, mask=inside, other=0.0).to(tl.float32)
            d = tl.exp(x - lse) * scale - tl.where(idx == target, coef, 0.0)
            tl.store(base + idx, d.to(logits_ptr.dtype.element_ty), mask=inside)


def ce_rows_(logits_CV: torch.Tensor, target_C: torch.Tensor, coef_C: torch.Tensor | None,
             z_loss_weight: float, grad: bool, *, block: int | None = None, num_warps: int | None = None,
             reversed_grad: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of logits_CV [C, V] (bf16/fp16/fp32, rows contiguous): (logsumexp [C] fp32,
    the logit at target_C [C] (int, in [0, V)) fp32). With ``grad``, also overwrites the logits
    with their gradient coef_C[c] * ((1 + 2 z lse) softmax - onehot(target)) (coef_C fp32 [C]: the
    row's weight in the mean, 0 for ignored tokens; z = z_loss_weight), in the logits' dtype.
    ``block``, ``num_warps``, ``reversed_grad``: the kernel's settings (None: BLOCK_V, NUM_WARPS,
    REVERSED; tools/bench_loss.py --rows sweeps them)."""
    C, V = logits_CV.shape
    if logits_CV.stride(1) != 1:
        raise ValueError("ce_rows_: the logits' rows must be contiguous")
    lse_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    tgt_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if C == 0:
        return lse_C, tgt_C
    coef = coef_C.to(torch.float32).contiguous() if grad else lse_C  # unread without grad
    _ce_rows_kernel[(C,)](logits_CV, target_C.contiguous(), coef, lse_C, tgt_C, V, logits_CV.stride(0),
                          float(z_loss_weight), GRAD=grad,
                          BLOCK=min(block or BLOCK_V, triton.next_power_of_2(V)),
                          REVERSE=REVERSED if reversed_grad is None else bool(reversed_grad),
                          num_warps=num_warps or NUM_WARPS)
    return lse_C, tgt_C
