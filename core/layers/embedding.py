"""The token embedding: an ``nn.Embedding`` (the same ``weight``, init and checkpoint names, and still
what code looking for embeddings finds) whose weight gradient can come from one deterministic Triton
pass (``triton_grad``: model.triton_embedding_grad; core/layers/embedding_triton.py) instead of
torch's zero-fill and sort-and-segment kernels.

Legend: T tokens (leading dims flattened), V vocabulary, D embedding dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Embedding", "embedding_grad"]

KERNEL = "auto"
"""Where the Triton gradient runs when asked for: "auto" (CUDA tensors), "triton" (also CPU ones,
under TRITON_INTERPRET=1: the tests)."""


def _use_triton(device: torch.device) -> bool:
    return KERNEL == "triton" or device.type == "cuda"


def embedding_grad(ids: torch.Tensor, grad: torch.Tensor, num_embeddings: int, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of F.embedding(ids, weight) with respect to weight [V = num_embeddings, D], in
    ``dtype``, for the incoming ``grad`` [*ids.shape, D]: row v is the sum, in fp32 and in increasing
    token order, of the rows of the tokens whose id is v; zeros for ids absent. Deterministic, no
    host sync (a stable sort of the ids, one searchsorted over the vocabulary, one Triton pass)."""
    from .embedding_triton import embedding_grad_

    ids_T = ids.reshape(-1)
    grad_TD = grad.reshape(ids_T.numel(), grad.shape[-1]).contiguous()
    sorted_T, order_T = torch.sort(ids_T, stable=True)
    vocab_V = torch.arange(num_embeddings, device=ids.device, dtype=sorted_T.dtype)
    ends_V = torch.searchsorted(sorted_T, vocab_V, right=True)  # each id's run ends here (and the next begins)
    out_VD = torch.empty(num_embeddings, grad_TD.shape[1], device=grad.device, dtype=dtype)
    return embedding_grad_(order_T, ends_V, grad_TD, out_VD)


class _GatherEmbedding(torch.autograd.Function):
    """forward(ids, table) = F.embedding(ids, table); backward: the table's gradient in its own dtype, each
    row summed in fp32 in increasing token order and rounded once: embedding_grad where Triton runs, else
    torch's fp32 embedding backward rounded. The table is the fp32 weight (model.triton_embedding_grad,
    where Triton runs) or the optimizer's bf16 copy of it (precision.embedding_weight_copy, anywhere)."""

    @staticmethod
    def forward(ctx, ids, table):
        ctx.save_for_backward(ids)
        ctx.vocab, ctx.dtype, ctx.triton = table.shape[0], table.dtype, _use_triton(table.device)
        return F.embedding(ids, table)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        if ctx.triton:
            return None, embedding_grad(ids, grad, ctx.vocab, ctx.dtype)
        wide = torch.ops.aten.embedding_dense_backward(grad.float(), ids, ctx.vocab, -1, False)
        return None, wide.to(ctx.dtype)


class Embedding(nn.Embedding):
    """nn.Embedding(V, D) (no padding index, max norm or sparse gradient); ``triton_grad``: its
    weight gradient from embedding_grad where Triton runs (CUDA), torch's backward elsewhere.
    ``out_dtype``: the rows handed on in this dtype where not the weight's (the residual stream's dtype,
    precision.bf16_residual; PrecisionPolicy.apply sets it), one cast whose backward widens the gradient.
    ``weight_copy``: the optimizer's bf16 copy of ``weight``, a leaf the rows are gathered from in its
    place, whose bf16 gradient the optimizer reads as the weight's (precision.embedding_weight_copy;
    core.precision.gemm.attach_embedding_copy). With ``out_dtype`` bf16 the rows are the same bits as
    the weight's rows cast."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device: torch.device | None = None,
                 triton_grad: bool = False):
        super().__init__(num_embeddings, embedding_dim, device=device)
        self.triton_grad = bool(triton_grad)
        self.out_dtype: torch.dtype | None = None
        self.weight_copy: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight_copy is not None:  # also without grad: split_master may have freed the weight's storage
            rows = _GatherEmbedding.apply(ids, self.weight_copy)
        elif (self.triton_grad and torch.is_grad_enabled() and self.weight.requires_grad
                and _use_triton(self.weight.device)):
            rows = _GatherEmbedding.apply(ids, self.weight)
        else:
            rows = super().forward(ids)
        return rows if self.out_dtype is None else rows.to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, triton_grad={self.triton_grad}"
