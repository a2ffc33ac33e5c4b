"""The LM head's loss: next-token cross entropy over the vocabulary, either from full logits
(``cross_entropy``, the reference) or fused with the head's GEMM and chunked over tokens
(``linear_cross_entropy``), so that no [T, V] tensor larger than one chunk of tokens ever exists.

The fused loss computes, per chunk of C tokens, the logits in the compute dtype (bf16 under
autocast), logsumexp and softmax in fp32 (or wider), and, when gradients are wanted, the gradients
right there in the forward: dlogits = (softmax - onehot) / N, grad_h = dlogits @ W,
grad_W += dlogits^T @ h (accumulated in fp32). Only grad_h [T, D] and grad_W [V, D] are kept for
the backward, which scales them by the incoming gradient; or, where the caller has declared the
gradient its backward will receive (``loss_weight``: the micro-batch's weight in the step), they
are computed already scaled and the backward hands them on as they are (no pass over the [V, D]
fp32 grad_W, no second copy of it). The plain path instead holds, at the start of the backward, the
logits, their fp32 copy and the fp32 log-softmax: 10 bytes x T x V.

Legend: T tokens (leading dims flattened), D model dim, V vocab, C tokens of one chunk.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..precision.gemm import compute_dtype
from .linear import Linear

__all__ = ["CHUNK_ALIGN", "DEFAULT_CHUNK_BYTES", "LMHead", "chunk_bounds", "cross_entropy", "current_loss_weight",
           "declared_loss_weight", "default_chunk_tokens", "linear_cross_entropy", "logit_bytes", "loss_weight",
           "path_chunk_tokens"]

DEFAULT_CHUNK_BYTES = 1 << 30
"""Default size of one chunk's transient logits (1 GiB): on the Triton path (CUDA) a chunk holds one
[C, V] tensor in the compute dtype, its gradient written in place (2 B a logit in bf16: 5120 tokens
at V = 100352); the torch path also holds an fp32 copy (6 B a logit: 1536 tokens). Larger chunks make
fewer, larger GEMMs and fewer read-modify-writes of the fp32 grad_W accumulator."""

CHUNK_ALIGN = 128
"""Chunk sizes are rounded up to a multiple of this (GEMM tiles), within chunk_tokens."""


def logit_bytes(dtype: torch.dtype, triton: bool) -> int:
    """Bytes a chunk holds per logit at its peak: the compute-dtype logits, turned into their
    gradient in place (Triton); the torch path adds their fp32 copy (fp32 compute: one tensor)."""
    size = dtype.itemsize
    return size if triton or size >= 4 else size + 4


def default_chunk_tokens(vocab_size: int, bytes_per_logit: int = 2) -> int:
    """Tokens per chunk whose logits take about DEFAULT_CHUNK_BYTES at ``bytes_per_logit``
    (logit_bytes; 2: bf16 on the Triton path, what CUDA runs), rounded down to a multiple of 256
    (GEMM-friendly), at least 256."""
    tokens = DEFAULT_CHUNK_BYTES // (bytes_per_logit * vocab_size)
    return max(256, tokens // 256 * 256)


def path_chunk_tokens(vocab_size: int, device: torch.device, dtype: torch.dtype) -> int:
    """The default chunk of the fused loss run on ``device`` in compute ``dtype`` (its path's
    logit_bytes): what chunk_tokens=None means."""
    return default_chunk_tokens(vocab_size, logit_bytes(dtype, _use_triton(torch.device(device), dtype)))


def chunk_bounds(tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk: the fewest chunks of at most ``chunk_tokens``, of equal size
    rounded up to CHUNK_ALIGN (still at most chunk_tokens), the last one taking the rest: 16384
    tokens at 5120 make four of 4096, not three of 5120 and one of 1024 (a small, slow GEMM)."""
    if tokens <= 0:
        return []
    n = -(-tokens // chunk_tokens)
    size = -(-tokens // n)
    size = min(chunk_tokens, -(-size // CHUNK_ALIGN) * CHUNK_ALIGN)
    return [(start, min(start + size, tokens)) for start in range(0, tokens, size)]


_weight: float = 1.0
"""The weight the training loop gives the LM loss of the micro-batch now running (1 / micro-batches
for equal ones; loss_weight). A module global: torch.compile traces its reads (the MoE layers' aux
losses, core.moe.aux_loss) and guards on its value, so a new value recompiles and never goes stale."""
_declared: bool = False
"""Whether the loop vouches that the LM loss' backward receives exactly ``_weight`` (loss_weight)."""


@contextlib.contextmanager
def loss_weight(weight: float, declared: bool = True) -> Iterator[None]:
    """In this block the LM loss of the micro-batch now running is trained at ``weight``: the MoE
    layers' aux losses get that gradient (core.moe.aux_loss), and, ``declared``, the loop vouches
    that it multiplies the LM loss by exactly ``weight`` and runs its backward once, so the fused loss
    computes its gradients already at that weight and its backward hands them on unscaled
    (model.fused_loss_prescale). That backward checks on the device, without a host sync, that the
    gradient it receives is ``weight`` (a mismatch raises there: on CUDA a device-side assert).
    The plain loop (``loss * share``) and the pipeline schedules (``loss / micro-batches``) declare;
    ``declared=False`` (aux_loss_scale) sets the aux losses' weight alone."""
    global _weight, _declared
    previous, (_weight, _declared) = (_weight, _declared), (float(weight), bool(declared))
    try:
        yield
    finally:
        _weight, _declared = previous


def current_loss_weight() -> float:
    """The weight the LM loss of the micro-batch now running is trained at (loss_weight; 1.0 outside one)."""
    return _weight


def declared_loss_weight() -> float | None:
    """The gradient the LM loss' backward will receive, where the loop declared it (loss_weight), else None."""
    return _weight if _declared else None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross entropy of logits [..., V] against labels [...], in fp32 (or wider),
    over the tokens whose label is not ignore_index. The reference for linear_cross_entropy."""
    logits_TV = logits.flatten(0, -2)
    return F.cross_entropy(logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32)), labels.flatten(),
                           ignore_index=ignore_index)


def linear_cross_entropy(h: torch.Tensor, weight_VD: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                         z_loss_weight: float = 0.0, chunk_tokens: int | None = None,
                         return_z_loss: bool = False, prescale: bool = True,
                         weight_bf16: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mean cross entropy of the logits h @ weight^T without materialising them.

    ``h`` [..., D] (the final-normed hidden), ``weight_VD`` [V, D] (the LM head's; an fp32 master
    weight under bf16 autocast is cast once per call), ``labels`` [...] (h's leading shape).
    Returns the mean over the tokens whose label is not ``ignore_index`` (counted over the whole
    call, as F.cross_entropy does; NaN if every token is ignored, with zero gradients), plus
    ``z_loss_weight`` x mean(logsumexp^2) when positive. With ``return_z_loss`` also returns the
    unweighted mean(logsumexp^2) over those tokens (detached, for logging). ``prescale``: where the
    caller declared the backward's incoming gradient (loss_weight), compute the gradients
    already at it (false: scale them in the backward regardless). ``weight_bf16``: a copy of
    ``weight_VD`` in the compute dtype (the optimizer's, precision.head_weight_copy) that the GEMMs
    use instead of casting it; the gradient still goes to ``weight_VD``.
    ``chunk_tokens``: at most this many tokens per chunk, the chunks balanced (chunk_bounds; default:
    default_chunk_tokens(V, logit_bytes(...)), about 1 GiB of transient logits on the path taken).
    The GEMMs run in the compute dtype (autocast's, else h's) whatever the GEMM backend; softmax
    and the loss in fp32 (or wider). Differentiable in h and weight.
    """
    dtype = compute_dtype(h)
    if chunk_tokens is None:
        chunk_tokens = path_chunk_tokens(weight_VD.shape[0], h.device, dtype)
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ConfigError(f"linear_cross_entropy: chunk_tokens must be a positive int (tokens per chunk), got "
                          f"{chunk_tokens!r}: pass e.g. 2048, or None for the default (model.loss_chunk_tokens)")
    if labels.shape != h.shape[:-1] or weight_VD.dim() != 2 or weight_VD.shape[1] != h.shape[-1]:
        raise ValueError(f"linear_cross_entropy: labels {tuple(labels.shape)} must be h's leading shape "
                         f"{tuple(h.shape[:-1])} (h {tuple(h.shape)}), and weight [V, D={h.shape[-1]}], got "
                         f"{tuple(weight_VD.shape)}: pass the labels of the same [B, S] tokens as h")
    if weight_bf16 is not None and (weight_bf16.shape != weight_VD.shape or weight_bf16.requires_grad):
        raise ValueError(f"linear_cross_entropy: weight_bf16 must be a copy of weight {tuple(weight_VD.shape)} that "
                         f"takes no gradient, got {tuple(weight_bf16.shape)}, requires_grad={weight_bf16.requires_grad}")
    h_TD, labels_T = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    w_cast = weight_bf16 if weight_bf16 is not None and weight_bf16.dtype == dtype else None
    args = (h_TD, weight_VD, labels_T, ignore_index, float(z_loss_weight), chunk_tokens, dtype, w_cast)
    if torch.is_grad_enabled() and (h.requires_grad or weight_VD.requires_grad):
        loss, z = _LinearCrossEntropy.apply(*args, declared_loss_weight() if prescale else None)
    else:
        with torch.no_grad():
            loss, z, _, _ = _chunked(*args, grad_h=False, grad_w=False, grad_scale=1.0)
    return (loss, z) if return_z_loss else loss


class _LinearCrossEntropy(torch.autograd.Function):
    """forward(h_TD, w_VD, labels_T, ..., declared) -> (loss, z); the gradients are computed in the
    forward (see _chunked), then scaled in the backward by the gradient it receives; or, with a
    ``declared`` gradient (loss_weight), computed already scaled by it and handed on as
    they are: the engine frees this node's saved tensors before the gradient reaches the weight's
    accumulator, which then keeps the tensor itself as ``.grad`` (no copy)."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, labels_T, ignore_index, z_loss_weight, chunk_tokens, dtype, w_cast, declared):
        loss, z, grad_h_TD, grad_w_VD = _chunked(h_TD, w_VD, labels_T, ignore_index, z_loss_weight, chunk_tokens,
                                                 dtype, w_cast, grad_h=ctx.needs_input_grad[0],
                                                 grad_w=ctx.needs_input_grad[1],
                                                 grad_scale=1.0 if declared is None else declared)
        ctx.save_for_backward(grad_h_TD, grad_w_VD)
        ctx.mark_non_differentiable(z)
        ctx.declared = declared
        return loss, z

    @staticmethod
    def backward(ctx, grad_loss, grad_z):
        grad_h_TD, grad_w_VD = ctx.saved_tensors
        if ctx.declared is not None:
            torch._assert_async(grad_loss == ctx.declared,
                                f"linear_cross_entropy: the loss' backward received a gradient other than the "
                                f"{ctx.declared!r} declared (loss_weight): scale the loss by exactly "
                                f"the declared weight, or declare nothing")
            return (grad_h_TD if ctx.needs_input_grad[0] else None, grad_w_VD if ctx.needs_input_grad[1] else None,
                    None, None, None, None, None, None, None)
        grad_h = _scaled(grad_h_TD, grad_loss) if ctx.needs_input_grad[0] else None
        grad_w = _scaled(grad_w_VD, grad_loss) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None, None, None, None


def _scaled(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t x the 0-dim ``scale`` (in t's dtype), out of place. Through the foreach kernel: a plain
    ``t * scale`` broadcasts the 0-dim CUDA tensor with stride 0, which takes TensorIterator's
    unvectorized kernel (about half the HBM rate on the [V, D] fp32 head gradient: 1.5 ms a step at
    V 100352 x D 4096 on an H200, session 11's profile)."""
    return torch._foreach_mul([t], scale.to(t.dtype))[0]


def _chunked(h_TD: torch.Tensor, w_VD: torch.Tensor, labels_T: torch.Tensor, ignore_index: int,
             z_loss_weight: float, chunk_tokens: int, dtype: torch.dtype, w_cast: torch.Tensor | None,
             grad_h: bool, grad_w: bool, grad_scale: float):
    """(loss, z, grad_h_TD or None, grad_w_VD or None) of the mean loss, chunk by chunk, the
    gradients multiplied by ``grad_scale`` (folded into the per-row coefficient: at 1.0 the same bits
    as unscaled); ``w_cast``: w_VD already in ``dtype`` (else cast here); no host sync."""
    with torch.autocast(h_TD.device.type, enabled=False):  # explicit dtypes below
        acc = torch.promote_types(dtype, torch.float32)
        if w_cast is None:
            w_cast = w_VD.detach().to(dtype)  # once per call (an fp32 master weight -> bf16)
        h_cast = h_TD.detach().to(dtype)
        valid_T = labels_T != ignore_index
        n_valid = valid_T.sum().to(acc)
        inv_n = 1.0 / n_valid.clamp(min=1)  # all ignored: NaN loss (0 / 0), zero gradients
        grad_inv_n = inv_n if grad_scale == 1.0 else inv_n * grad_scale
        loss_sum = torch.zeros((), dtype=acc, device=h_TD.device)
        z_sum = torch.zeros((), dtype=acc, device=h_TD.device)
        out_h = torch.empty_like(h_TD, memory_format=torch.contiguous_format) if grad_h else None
        bounds = chunk_bounds(h_TD.shape[0], chunk_tokens)
        # grad_W in the accumulator's dtype across chunks; in one chunk a compute-dtype weight's (the
        # optimizer's bf16 copy taking the gradient, precision.head_grads_bf16) is the GEMM's own output,
        # rounded once, as the fp32 sum rounded to it would be
        w_out = w_VD.dtype if w_VD.dtype == dtype and len(bounds) == 1 else acc
        out_w = torch.empty(w_VD.shape, dtype=w_out, device=w_VD.device) if grad_w else None
        if grad_w and h_TD.shape[0] == 0:
            out_w.zero_()
        for i, (start, end) in enumerate(bounds):
            h_CD, valid_C = h_cast[start:end], valid_T[start:end]
            target_C = torch.where(valid_C, labels_T[start:end], 0)[:, None]
            mask_C = valid_C.to(acc)
            if _use_triton(h_CD.device, h_CD.dtype):
                # One Triton pass per row on the compute-dtype logits, the gradient in place.
                from .cross_entropy_triton import ce_rows_

                dlogits_CV = h_CD @ w_cast.t()
                lse_C, target_logit_C = ce_rows_(dlogits_CV, target_C[:, 0], mask_C * grad_inv_n, z_loss_weight,
                                                 grad=grad_h or grad_w)
                loss_sum += ((lse_C - target_logit_C) * mask_C).sum()
                z_sum += (lse_C.square() * mask_C).sum()
                if grad_h:
                    _mm_into(out_h[start:end], dlogits_CV, w_cast)
                if grad_w:
                    _mm_into(out_w, dlogits_CV.t(), h_CD, accumulate=i > 0)
                continue
            logits_CV = (h_CD @ w_cast.t()).to(acc)  # the compute-dtype logits die here
            target_logit_C = logits_CV.gather(1, target_C)[:, 0]
            # In place from here: logits -> exp(logits - max) -> dlogits (no second [C, V] fp32 buffer).
            max_C = logits_CV.amax(dim=1)
            logits_CV.sub_(max_C[:, None]).exp_()
            sum_exp_C = logits_CV.sum(dim=1)
            lse_C = max_C + sum_exp_C.log()
            loss_sum += ((lse_C - target_logit_C) * mask_C).sum()
            z_sum += (lse_C.square() * mask_C).sum()
            if not (grad_h or grad_w):
                continue
            # d(mean CE)/dlogits = (softmax - onehot) / N; z-loss adds 2 w lse softmax / N.
            coef_C = mask_C * grad_inv_n
            row_C = coef_C * (1.0 + 2.0 * z_loss_weight * lse_C) if z_loss_weight > 0 else coef_C
            logits_CV.mul_((row_C / sum_exp_C)[:, None])
            logits_CV.scatter_add_(1, target_C, -coef_C[:, None])
            dlogits_CV = logits_CV.to(dtype)
            del logits_CV
            if grad_h:
                _mm_into(out_h[start:end], dlogits_CV, w_cast)
            if grad_w:
                _mm_into(out_w, dlogits_CV.t(), h_CD, accumulate=i > 0)
        loss = loss_sum / n_valid
        z = (z_sum / n_valid).detach()
        if z_loss_weight > 0:
            loss = loss + z_loss_weight * z
        return loss, z, out_h, (out_w.to(w_VD.dtype) if grad_w else None)


CE_KERNEL = "auto"
"""How a chunk's softmax and gradient run: "auto" (Triton on CUDA for bf16/fp16/fp32 logits, torch
elsewhere), "triton" (also on the CPU under TRITON_INTERPRET=1: the tests), "torch" (the reference)."""


def _use_triton(device: torch.device, dtype: torch.dtype) -> bool:
    if CE_KERNEL == "torch" or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return CE_KERNEL == "triton" or device.type == "cuda"


# Per device type: whether mm / addmm with a wider output than their operands (fp32 from bf16 or
# fp16) exist (CUDA: yes; the CPU has no kernel for them). Learned on first use from the
# dispatcher's error, which is raised before anything is written.
_WIDE_OUT_MM: dict[str, bool] = {}


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
    """out = a @ b, or out += a @ b with ``accumulate``; ``out`` (contiguous) may be wider than the
    operands (fp32 from bf16), and then the GEMM's epilogue writes (and adds in) that dtype where
    the device has such a kernel, one pass over ``out``; elsewhere the product is made in the
    operands' dtype and copied or added in. The fused loss' first chunk writes grad_W, the others
    add to it: no zero-filled accumulator, no separate add."""
    kind = out.device.type
    if out.dtype == a.dtype:
        if accumulate:
            torch.addmm(out, a, b, out=out)
        else:
            torch.mm(a, b, out=out)
        return
    if _WIDE_OUT_MM.get(kind, True):
        try:
            if accumulate:
                torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            else:
                torch.mm(a, b, out_dtype=out.dtype, out=out)
            _WIDE_OUT_MM[kind] = True
            return
        except (RuntimeError, NotImplementedError, TypeError):
            _WIDE_OUT_MM[kind] = False
    if accumulate:
        out.add_(a @ b)
    else:
        out.copy_(a @ b)


class LMHead(Linear):
    """The untied LM head: a Linear [V, D] (same ``weight`` name and init) whose forward gives the
    logits, or, given labels, the mean next-token loss.

    forward(h [..., D]) -> logits [..., V] through the GEMM backend;
    forward(h [..., D], labels [...]) -> mean cross entropy over labels != -100: fused and chunked
    (linear_cross_entropy, never materialising the logits) when ``fused``, else the logits then
    cross_entropy (the reference). ``chunk_tokens``: the fused loss' most tokens per chunk (None:
    ~1 GiB of transient logits, default_chunk_tokens). ``prescale``: linear_cross_entropy's.
    """

    def __init__(self, in_features: int, out_features: int, device: torch.device | None = None, fused: bool = True,
                 chunk_tokens: int | None = None, prescale: bool = True):
        super().__init__(in_features, out_features, device)
        self.fused, self.chunk_tokens, self.prescale = fused, chunk_tokens, prescale
        # The optimizer's bf16 copy of ``weight`` that the fused loss computes on (precision.head_weight_copy,
        # core.precision.gemm.attach_head_copy). None: the loss casts the weight.
        self.weight_bf16: torch.Tensor | None = None

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            if self.weight_bf16 is not None and self.weight.numel() and not self.weight.untyped_storage().nbytes():
                raise RuntimeError("the LM head's logits read its fp32 weight, which optimizer.split_master holds "
                                   "split between steps: compute them inside the optimizer's masters_materialized() "
                                   "block (or train without optimizer.split_master)")
            return super().forward(h)
        if self.fused:
            # precision.head_grads_bf16: the copy is itself the weight the loss differentiates (its bf16
            # .grad is the master's gradient: core.precision.gemm.attach_head_copy); else the loss computes
            # on the copy, if any, and the gradient goes to the fp32 weight
            copy = self.weight_bf16
            weight, copy = (copy, None) if copy is not None and copy.requires_grad else (self.weight, copy)
            return linear_cross_entropy(h, weight, labels, chunk_tokens=self.chunk_tokens, prescale=self.prescale,
                                        weight_bf16=copy)
        return cross_entropy(super().forward(h), labels)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, fused_loss={self.fused}, chunk_tokens={self.chunk_tokens}, "
                f"prescale={self.prescale}")
