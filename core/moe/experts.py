"""Routed experts: SwiGLU weights stacked experts-first so one grouped GEMM runs all local experts.

Legend: R expert-sorted rows, D model dim, F expert hidden, E experts held here (the local ones
under expert parallelism), I / O a GEMM's input (reduction) and output dims.
Weights are [E, out, in] like nn.Linear: w_gate_up_E2FD holds gate (first F rows) and up (next F).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ConfigError
from ..layers.mlp import swiglu
from ..precision.gemm import DEFAULT_GEMM, GemmBackend, compute_dtype, scale_rows
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


@torch.compiler.disable
def loop_grouped_mm(gemm: GemmBackend, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor,
                    w_dgrad: torch.Tensor | None = None) -> torch.Tensor:
    """grouped_mm as a Python loop of ``gemm.expert_linear`` over the groups, reading the offsets on the
    host: the CPU path and the reference, never the GPU hot path. Rows past offsets_E[-1] are 0.
    Eager even inside a compiled block (torch.compiler.disable): traced, its host-read group sizes
    made torch.compile recompile at every step's routing."""
    if w_dgrad is not None:
        raise ConfigError("precision.quantized_expert_copies hands the grouped GEMMs weights already quantized, "
                          "which the experts' loop path would quantize again: use model.moe.experts_backend=auto "
                          "or grouped_mm, or drop precision.quantized_expert_copies")
    out_RO = x_RI.new_zeros(x_RI.shape[0], w_EOI.shape[1])
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        if end > start:
            out_RO[start:end] = gemm.expert_linear(x_RI[start:end], w_EOI[e]).to(out_RO.dtype)
        start = end
    return out_RO


def _fused_mlp(gemm: GemmBackend, x_RD, w_E2FD, w_EDF, offsets_E, act, row_scale_R=None, dgrad_gate_up=None,
               dgrad_down=None):
    return gemm.grouped_swiglu_mlp(x_RD, w_E2FD, w_EDF, offsets_E, act, row_scale_R, dgrad_gate_up, dgrad_down)


def _loop_mlp(gemm: GemmBackend, x_RD, w_E2FD, w_EDF, offsets_E, act, row_scale_R=None, dgrad_gate_up=None,
              dgrad_down=None):
    gate_RF, up_RF = loop_grouped_mm(gemm, x_RD, w_E2FD, offsets_E, dgrad_gate_up).chunk(2, dim=-1)
    return loop_grouped_mm(gemm, scale_rows(act(gate_RF, up_RF), row_scale_R), w_EDF, offsets_E, dgrad_down)


def _auto_mlp(gemm: GemmBackend, x_RD, w_E2FD, w_EDF, offsets_E, act, row_scale_R=None, dgrad_gate_up=None,
              dgrad_down=None):
    # The device is known only when the rows arrive (a model may be built on the CPU, then moved).
    # Pre-quantized weights (w_dgrad) take the grouped ops on any device (their CPU form loops inside).
    fused = x_RD.is_cuda or dgrad_gate_up is not None
    return (_fused_mlp if fused else _loop_mlp)(gemm, x_RD, w_E2FD, w_EDF, offsets_E, act, row_scale_R,
                                                dgrad_gate_up, dgrad_down)


# Per backend: the experts' SwiGLU MLP (gate/up grouped GEMM, activation, down grouped GEMM).
_MLP = {
    ExpertsBackend.grouped_mm: _fused_mlp,
    ExpertsBackend.loop: _loop_mlp,
    ExpertsBackend.auto: _auto_mlp,
}


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLUs, stacked: ``w_gate_up`` [E, 2F, D] (gate rows, then up rows) and
    ``w_down`` [E, D, F] (E experts here; a DTensor over all experts, Shard(0), under expert
    parallelism, whose local shard is used). ``backend`` (ExpertsBackend) picks how the groups
    run, ``gemm`` (core.precision, installed by the PrecisionPolicy) the GEMM itself."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, backend: ExpertsBackend, device=None):
        super().__init__()
        self.num_experts, self.d_model, self.hidden = num_experts, d_model, hidden
        self.backend = ExpertsBackend(backend)
        self._mlp = _MLP[self.backend]
        self.gemm: GemmBackend = DEFAULT_GEMM
        self.act = swiglu  # recompute may swap in a checkpointed twin (core/memory.py)
        # Under expert parallelism an expert's gradient sums the tokens of every data-parallel
        # rank (the all-to-all brings them in) while dense gradients are averaged over those ranks;
        # the expert strategy sets this to 1 / ep so the two agree (works on any backend, unlike
        # a PREMUL_SUM reduce-scatter, which gloo lacks).
        self.grad_scale = 1.0
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * hidden, d_model, device=device))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_model, hidden, device=device))
        # precision.expert_grads_bf16: the optimizer's bf16 copies of (w_gate_up, w_down), leaves that
        # the GEMMs use and differentiate in their place (their .grad is the masters' gradient;
        # core/precision/gemm.py TorchGemm.attach_optimizer sets them). None: the parameters.
        self.weight_copies: tuple[torch.Tensor, torch.Tensor] | None = None
        # precision.quantized_expert_copies: the dgrad operands of (w_gate_up, w_down), written by the
        # optimizer beside weight_copies, which then hold the forward operands (both MX-quantized and
        # dequantized: core.precision.gemm.attach_expert_copies). None: the GEMMs quantize the weights.
        self.weight_copies_dgrad: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x_RD: torch.Tensor, offsets_L: torch.Tensor, row_scale_R: torch.Tensor | None = None) -> torch.Tensor:
        """x_RD [R, D] expert-sorted rows, offsets_L int [E]: rows of expert e (the e-th held
        here) are [offsets_L[e-1], offsets_L[e]) (inclusive cumsum) -> [R, D]; ``row_scale_R``
        [R] (optional): each row's SwiGLU output scaled by it before the down projection.

        Rows past offsets_L[-1] (capacity padding) are left unspecified; nobody reads them.
        """
        x_RD = x_RD.to(compute_dtype(x_RD))
        dgrad_gate_up = dgrad_down = None
        if self.weight_copies is not None:  # one unsharded GPU only: no DTensor, grad_scale 1
            w_gate_up_E2FD, w_down_EDF = self.weight_copies
            if self.weight_copies_dgrad is not None:
                dgrad_gate_up, dgrad_down = self.weight_copies_dgrad
        else:
            w_gate_up_E2FD = _local(self.w_gate_up, self.grad_scale)
            w_down_EDF = _local(self.w_down, self.grad_scale)
        # One call for the whole MLP: a backend may fuse its parts (GemmBackend.grouped_swiglu_mlp).
        return self._mlp(self.gemm, x_RD, w_gate_up_E2FD, w_down_EDF, offsets_L, self.act, row_scale_R, dgrad_gate_up,
                         dgrad_down)
