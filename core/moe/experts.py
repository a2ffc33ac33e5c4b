"""Routed experts: SwiGLU weights stacked experts-first so one grouped GEMM runs all local experts.

Legend: R expert-sorted rows, D model dim, F expert hidden, E local experts.
Weights are [E, out, in] like nn.Linear: w_gate_up_E2FD holds gate (first F rows) and up (next F).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .config import ExpertsBackend


def _local(w: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
    """This rank's experts: a DTensor (expert parallel, Shard(0) over ep) runs on its local shard;
    a plain tensor is returned as is."""
    w = w.to_local() if isinstance(w, DTensor) else w
    return _ScaleGrad.apply(w, grad_scale) if grad_scale != 1.0 else w


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by a constant in backward."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, d_model: int, hidden: int, backend: ExpertsBackend, device=None):
        super().__init__()
        self.num_experts, self.d_model, self.hidden = num_experts, d_model, hidden
        self.backend = backend
        # Under expert parallelism an expert's gradient sums the tokens of every data-parallel
        # rank (the all-to-all brings them in) while dense gradients are averaged over those ranks;
        # the data-parallel strategy sets this to 1 / ep so the two agree (works on any backend,
        # unlike a PREMUL_SUM reduce-scatter, which gloo lacks).
        self.grad_scale = 1.0
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * hidden, d_model, device=device))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_model, hidden, device=device))

    def forward(self, x_RD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """Rows of expert e are [offsets_E[e-1], offsets_E[e]) (inclusive cumsum); returns [R, D].

        Rows past offsets_E[-1] (capacity padding) are left unspecified; nobody reads them.
        """
        backend = self.backend
        if backend == ExpertsBackend.auto:
            backend = ExpertsBackend.grouped_mm if x_RD.is_cuda else ExpertsBackend.loop
        if backend == ExpertsBackend.grouped_mm:
            return self._grouped(x_RD, offsets_E)
        return self._loop(x_RD, offsets_E)

    def _grouped(self, x_RD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x_RD.dtype
        x_RD = x_RD.to(dtype)
        offs = offsets_E.to(torch.int32)
        h_R2F = torch._grouped_mm(x_RD, _local(self.w_gate_up, self.grad_scale).to(dtype).transpose(-2, -1), offs=offs)
        gate_RF, up_RF = h_R2F.chunk(2, dim=-1)
        a_RF = F.silu(gate_RF) * up_RF
        return torch._grouped_mm(a_RF, _local(self.w_down, self.grad_scale).to(dtype).transpose(-2, -1), offs=offs)

    def _loop(self, x_RD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        # Reads the offsets on the host: the CPU path and the reference, never the GPU hot path.
        ends = offsets_E.tolist()
        w_gate_up, w_down = _local(self.w_gate_up, self.grad_scale), _local(self.w_down, self.grad_scale)
        out_RD = x_RD.new_zeros(x_RD.shape[0], self.d_model)
        start = 0
        for e, end in enumerate(ends):
            if end > start:
                x = x_RD[start:end]
                gate, up = F.linear(x, w_gate_up[e]).chunk(2, dim=-1)
                out_RD[start:end] = F.linear(F.silu(gate) * up, w_down[e]).to(out_RD.dtype)
            start = end
        return out_RD
