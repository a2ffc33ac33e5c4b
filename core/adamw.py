"""AdamW whose moments (exp_avg, exp_avg_sq) are stored in a lower precision than the parameters.

The parameters stay the fp32 master weights and all update math is fp32 (the parameters' dtype):
each step upcasts a chunk of moments, updates them, writes them back rounded to nearest (bf16), and
updates the parameters from the unrounded fp32 moments, as Megatron's precision-aware optimizer and
Transformer Engine's FusedAdam(exp_avg_dtype=bf16) do. The math is torch.optim.AdamW's, operation for
operation (decoupled decay p *= 1 - lr * wd, bias correction, eps outside the square root), so with
the state kept in the parameters' dtype the result is torch's bit for bit.

Speed: torch._foreach_* ops over lists grouped by (device, dtype), so a chunk costs about ten kernel
launches whatever its tensor count. Memory: the fp32 copies of the moments exist for one chunk at a
time (at most ``chunk_numel`` elements, large tensors are split into flat views), so the step's peak
is not the fp32 state that the bf16 state saves.

DTensors (FSDP2 shards, expert-parallel weights): the moments are DTensors like their parameters
(DCP reshards them), the math runs on the local tensors (to_local shares storage).

Rounding: round-to-nearest cannot register a change smaller than half a bf16 ulp (2^-9 to 2^-8 of
the value), so a moment whose per-step decay 1 - beta is below 2^-8 would never decay (beta2 =
0.999 freezes exp_avg_sq when gradients shrink); OptimizerConfig refuses such betas with bf16 state.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["PrecisionAwareAdamW", "MIN_ONE_MINUS_BETA"]

# Smallest 1 - beta whose decay a bf16 moment registers under round-to-nearest (see the docstring).
MIN_ONE_MINUS_BETA = {torch.bfloat16: 2.0**-8}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW semantics with ``state_dtype`` moments (default bf16) and fp32 update math.

    ``params``: tensors or param groups (``lr``, ``betas``, ``eps``, ``weight_decay`` per group),
    floating point parameters of at least fp32 (they are the master weights); ``chunk_numel``:
    elements upcast at a time (the step's fp32 temporaries: two moment copies, 2 x 4 x chunk_numel bytes,
    256 MiB at the default)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, state_dtype: torch.dtype = torch.bfloat16,
                 chunk_numel: int = 2**25):
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype, self.chunk_numel = state_dtype, chunk_numel
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_floating_point() or torch.finfo(p.dtype).bits < 32 or p.is_complex():
                    raise ValueError(f"PrecisionAwareAdamW keeps the parameters as master weights: they must be "
                                     f"fp32 or fp64, got {p.dtype}")

    def _init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            # step on the CPU as torch's non-fused AdamW keeps it: bias corrections are host floats.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts every floating-point state to its parameter's dtype on load; the moments go
        # back to state_dtype (bf16 -> fp32 -> bf16 is exact, so a resume is bit-exact).
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != self.state_dtype:
                    state[key] = state[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        # (device, dtype) -> rows of (param, grad, exp_avg, exp_avg_sq, step), all local tensors.
        buckets: dict[tuple, list[tuple[torch.Tensor, ...]]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("PrecisionAwareAdamW does not support sparse gradients")
            state = self._init_state(p)
            state["step"] += 1
            local_p, local_g = _local(p), _local(p.grad)
            if local_g.dtype != local_p.dtype:
                raise RuntimeError(f"gradient dtype {local_g.dtype} differs from its parameter's {local_p.dtype}")
            row = (local_p, local_g, _local(state["exp_avg"]), _local(state["exp_avg_sq"]), state["step"])
            buckets.setdefault((local_p.device, local_p.dtype), []).append(row)
        for rows in buckets.values():
            for chunk in self._chunks(rows):
                self._update(chunk, lr, beta1, beta2, eps, wd)

    def _chunks(self, rows: list[tuple[torch.Tensor, ...]]) -> Iterable[list[tuple[torch.Tensor, ...]]]:
        """Rows packed into chunks of at most chunk_numel elements; a larger contiguous tensor is
        split into flat views of that size (the ops are elementwise, so results do not change)."""
        chunk, size = [], 0
        for p, g, m, v, step in rows:
            if p.numel() == 0:
                continue
            if p.numel() > self.chunk_numel and all(t.is_contiguous() for t in (p, g, m, v)):
                pieces = zip(*(t.view(-1).split(self.chunk_numel) for t in (p, g, m, v)))
            else:
                pieces = [(p, g, m, v)]
            for piece in pieces:
                n = piece[0].numel()
                if chunk and size + n > self.chunk_numel:
                    yield chunk
                    chunk, size = [], 0
                chunk.append((*piece, step))
                size += n
        if chunk:
            yield chunk

    def _update(self, chunk: list[tuple[torch.Tensor, ...]], lr: float, beta1: float, beta2: float, eps: float,
                wd: float) -> None:
        """One AdamW update of a chunk (torch's _multi_tensor_adam, non-capturable, in the same order)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = (list(col) for col in zip(*chunk))
        compute = params[0].dtype
        low = exp_avgs[0].dtype != compute
        if low:  # fp32 working copies of this chunk's moments
            stored_avgs, stored_sqs = exp_avgs, exp_avg_sqs
            exp_avgs = [torch.empty_like(t, dtype=compute) for t in stored_avgs]
            exp_avg_sqs = [torch.empty_like(t, dtype=compute) for t in stored_sqs]
            torch._foreach_copy_(exp_avgs, stored_avgs)
            torch._foreach_copy_(exp_avg_sqs, stored_sqs)
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        if low:  # round to nearest into the stored moments; the update below uses the fp32 values
            torch._foreach_copy_(stored_avgs, exp_avgs)
            torch._foreach_copy_(stored_sqs, exp_avg_sqs)
        step_values = [step.item() for step in steps]  # CPU scalars: no device sync
        step_size = [(lr / (1 - beta1**t)) * -1 for t in step_values]
        bias_correction2_sqrt = [(1 - beta2**t) ** 0.5 for t in step_values]
        if low:  # the working copy is free now: the denominator reuses it
            denom = exp_avg_sqs
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)
