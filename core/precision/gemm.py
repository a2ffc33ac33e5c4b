"""GEMM backends: how dense linears and the grouped expert GEMM run, chosen at build time.

A backend is a small class with two methods; modules that run GEMMs (core.layers.Linear, the MoE
experts) hold one in ``.gemm`` and call it, so changing precision swaps an object, never adds an
``if`` to a forward pass. ``PrecisionPolicy.apply(model)`` installs the run's backend.

    class MyGemm(GemmBackend):
        name = "my_gemm"
        def linear(self, x_TI, w_OI): ...
        def grouped_mm(self, x_RI, w_EOI, offsets_E): ...

    register_gemm_backend(MyGemm)

Legend: T tokens (any leading dims), I input (reduction) dim, O output dim, R expert-sorted rows,
E groups (local experts).
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from ..config import StrEnum
from ..registry import Registry
from . import bf16_grouped
from .cache import outside_graph
from .bf16_grouped import scale_rows

__all__ = ["GEMM_BACKENDS", "GemmBackend", "TorchGemm", "attach_dense_copies", "attach_embedding_copy", "attach_expert_copies", "attach_head_copy", "compute_dtype", "gemm_backend", "register_gemm_backend", "with_w_dgrad",
           "scale_rows"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype GEMMs on ``x`` run in: autocast's dtype where autocast is on, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Fp8Wgrad(StrEnum):
    """Which of an FP8 recipe's GEMMs run their weight gradients in FP8 (the rest in bf16 from the saved
    bf16 input and the bf16 output gradient, fp32 accumulation): precision.fp8_wgrad, and the FP8
    backends' ``wgrad``. ``true`` and ``false`` are read as ``all`` and ``none``."""

    all = "all"
    """Every FP8 GEMM's wgrad in FP8, along the tokens (true)."""
    none = "none"
    """Every wgrad in bf16 (false): no columns to quantize, x saved in bf16."""
    dense = "dense"
    """The dense linears' (attention, dense MLPs, the shared expert) wgrads in FP8, the routed experts'
    grouped wgrads in bf16: for layers of many small experts, whose per-expert token groups are short
    reductions that FP8 speeds up least and whose per-expert column quantization costs most."""

    @classmethod
    def _missing_(cls, value):
        return cls._bool_member(value, cls.all, cls.none)

    @property
    def dense_fp8(self) -> bool:
        """The dense linears' wgrads in FP8."""
        return self != Fp8Wgrad.none

    @property
    def experts_fp8(self) -> bool:
        """The routed experts' grouped wgrads in FP8."""
        return self == Fp8Wgrad.all


class GemmBackend:
    """Interface. ``linear(x [..., I], w [O, I]) -> [..., O]``;
    ``grouped_mm(x [R, I], w [E, O, I], offsets_E int [E]) -> [R, O]``: rows
    [offsets_E[e-1], offsets_E[e]) times w[e]^T (inclusive cumsum; rows past offsets_E[-1] are
    left unspecified). Both differentiable."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    """How results of this backend are reported (e.g. "mxfp8 (emulated ...)"); "" for plain torch."""
    quantize_weights_once: bool = False
    """precision.quantize_weights_once (the low-precision backends): run the grouped GEMM outside
    any compiled graph (cache.outside_graph), so the backend's WeightCache serves it there too."""
    triton_swiglu: bool = False
    """precision.triton_swiglu: the default grouped_swiglu_down's SwiGLU in one Triton pass each way
    (bf16 CUDA rows; the low-precision backends, set by PrecisionConfig.build)."""
    per_expert: bool = False
    """precision.bf16_experts=cublas (the bf16 recipe, the emulated backends): the grouped bf16 GEMMs
    as one cuBLAS GEMM per expert, the group sizes read on the host (core/precision/grouping.py)."""

    def _grouped(self, function: type[torch.autograd.Function], *args):
        """``function.apply(*args)``: a low-precision backend's grouped GEMM, outside any compiled
        graph when ``quantize_weights_once`` or ``per_expert`` (its host sync is no graph op; the
        one place those switches leave the graph)."""
        if self.quantize_weights_once or self.per_expert:
            return outside_graph(function.apply, *args)
        return function.apply(*args)

    def _linear(self, function: type[torch.autograd.Function], x: torch.Tensor, w: torch.Tensor,
                *extra) -> torch.Tensor:
        """``function.apply(x_TI, w, self, *extra)`` on x's tokens flattened to [T, I], reshaped back:
        a low-precision backend's linear (x [..., I], w [O, I] -> [..., O])."""
        return function.apply(x.reshape(-1, x.shape[-1]), w, self, *extra).reshape(*x.shape[:-1], w.shape[0])

    def _linears(self, function: type[torch.autograd.Function], x: torch.Tensor, ws: tuple[torch.Tensor, ...],
                 *extra) -> tuple[torch.Tensor, ...]:
        """``function.apply(x_TI, self, *extra, *ws)`` on x's tokens flattened to [T, I], each output
        reshaped back: a low-precision backend's linear through several weights that quantizes x
        once (x [..., I], w_i [O_i, I] -> (y_i [..., O_i], ...); one weight is a plain linear)."""
        ys = function.apply(x.reshape(-1, x.shape[-1]), self, *extra, *ws)
        return tuple(y.reshape(*x.shape[:-1], w.shape[0]) for y, w in zip(ys, ws))

    expert_copies = False
    """precision.expert_weight_copies=optimizer with expert_grads_bf16 on a low-precision backend that
    takes them (config.takes_expert_copies): the routed experts compute on the optimizer's bf16 weight
    copies, which attach_optimizer registers."""
    expert_copies_mx: str | None = None
    """precision.quantized_expert_copies (EmulatedGemm, mxfp8): the MX scale mode in which the optimizer
    writes the expert copies quantized both ways (attach_expert_copies' ``mx_scale_mode``); None: plain."""

    def attach_optimizer(self, optimizer, parts) -> None:
        """Called once by the trainer with its optimizer and model parts (a backend that wants the
        optimizer to keep something current registers it here). By default: the optimizer's bf16
        expert copies where ``expert_copies`` (the GEMMs differentiate the copies; quantized where
        ``expert_copies_mx``), else nothing."""
        if self.expert_copies:
            attach_expert_copies(optimizer, parts, grads=True, mx_scale_mode=self.expert_copies_mx)

    def after_optimizer_step(self) -> None:
        """Called once the weights changed (PrecisionPolicy.after_optimizer_step): a backend that
        keeps quantized weights drops them here. Nothing to do by default."""

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    quantize_input_once: bool = False
    """precision.quantize_input_once (the low-precision backends that take it: config.takes_input_once):
    ``linears`` quantizes the one input of several linears once for all of them (attention's q, k, v;
    a dense SwiGLU's gate and up: core.layers.linear.shared_input)."""

    fused_shared_input: bool = False
    """precision.fused_shared_input (bf16: TorchGemm): ``linears`` runs the linears of one input as
    one GEMM on their weights concatenated (core.layers.linear.shared_input)."""

    def linears(self, x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """x [..., I] through several weights w_i [O_i, I] -> (y_i [..., O_i], ...): by default
        ``linear`` for each; a backend with ``quantize_input_once`` quantizes x once for all, one
        with ``fused_shared_input`` runs one GEMM."""
        return tuple(self.linear(x, w) for w in ws)

    def expert_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """One routed expert's GEMM as a linear (the experts' loop path, core.moe.experts): ``linear``
        unless the backend treats the experts apart (the FP8 backends' wgrad="dense")."""
        return self.linear(x, w)

    def grouped_mm(self, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """x_RI [R, I] expert-sorted rows through w_EOI [E, O, I] -> [R, O]. A backend that takes
        pre-quantized weights (EmulatedGemm with precision.quantized_expert_copies) also takes
        ``w_dgrad``: w_EOI is then the forward's quantized operand and w_dgrad the dgrad's."""
        raise NotImplementedError

    def grouped_swiglu_down(self, h_R2F: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor,
                            act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                            row_scale_R: torch.Tensor | None = None, w_dgrad: torch.Tensor | None = None) -> torch.Tensor:
        """The SwiGLU experts' down projection: ``act(gate, up)`` on h_R2F [R, 2F] (gate columns,
        then up), each row scaled by ``row_scale_R`` [R] if given, then ``grouped_mm`` with w_EDF
        [E, D, F] -> [R, D] (and ``w_dgrad``, passed on where given). A backend may fuse these
        (saving less for backward); this default composes them, the SwiGLU itself in one Triton pass
        each way where ``triton_swiglu`` (the plain swiglu or its recompute twin on bf16 CUDA rows,
        _is_swiglu: swiglu_triton.swiglu_rows)."""
        if _is_swiglu(act) and bf16_grouped.use_triton_swiglu(h_R2F, self.triton_swiglu):
            from .swiglu_triton import swiglu_rows

            act_RF = swiglu_rows(h_R2F)
        else:
            gate_RF, up_RF = h_R2F.chunk(2, dim=-1)
            act_RF = act(gate_RF, up_RF)
        return with_w_dgrad(self.grouped_mm, scale_rows(act_RF, row_scale_R), w_EDF, offsets_E, w_dgrad=w_dgrad)

    def grouped_swiglu_mlp(self, x_RD: torch.Tensor, w_E2FD: torch.Tensor, w_EDF: torch.Tensor,
                           offsets_E: torch.Tensor, act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                           row_scale_R: torch.Tensor | None = None, w_dgrad_gate_up: torch.Tensor | None = None,
                           w_dgrad_down: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' whole SwiGLU MLP on expert-sorted rows x_RD [R, D]: ``grouped_mm`` with
        w_E2FD [E, 2F, D] (gate rows, then up) to h [R, 2F], then ``grouped_swiglu_down`` with w_EDF
        [E, D, F] -> [R, D] (each with its ``w_dgrad`` where given). A backend may fuse the whole (the
        native fp8_blockwise GEMMs with precision.fp8_fused_swiglu); this default composes the two."""
        h_R2F = with_w_dgrad(self.grouped_mm, x_RD, w_E2FD, offsets_E, w_dgrad=w_dgrad_gate_up)
        return with_w_dgrad(self.grouped_swiglu_down, h_R2F, w_EDF, offsets_E, act, row_scale_R, w_dgrad=w_dgrad_down)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def save_linears(ctx, x_saved: tuple[torch.Tensor, ...], ws: tuple[torch.Tensor, ...]) -> None:
    """A low-precision linear's autograd Function (GemmBackend._linears: one input, several weights)
    saves x's operands for the backward, then the weights; saved_linears splits them again."""
    ctx.save_for_backward(*x_saved, *ws)
    ctx.n_weights = len(ws)


def saved_linears(ctx) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(x's saved operands, the weights) of save_linears."""
    saved = ctx.saved_tensors
    return saved[:len(saved) - ctx.n_weights], saved[len(saved) - ctx.n_weights:]


def with_w_dgrad(fn: Callable, *args, w_dgrad: torch.Tensor | None = None):
    """``fn(*args)``, with ``w_dgrad=`` only where given: the grouped GEMMs of a backend that takes
    pre-quantized weights (EmulatedGemm.grouped_mm) receive it, and backends that do not (a user's
    registered one included) keep their signature."""
    return fn(*args) if w_dgrad is None else fn(*args, w_dgrad=w_dgrad)


def _is_swiglu(act: Callable) -> bool:
    """``act`` is the plain swiglu, or memory.recompute's checkpointed twin of it (core.memory.recomputed:
    the same function, its activations rebuilt in backward). The fused SwiGLU ops serve both: they save
    only their input and recompute the product in backward, what the checkpoint would do."""
    from ..layers.mlp import swiglu  # (layers import this module)

    return getattr(act, "__wrapped__", act) is swiglu


def _check_copyable(optimizer, weights, switch: str, fix: str) -> None:
    """ConfigError unless ``optimizer`` writes compute copies in its step (core.adamw.PrecisionAwareAdamW)
    and every one of ``weights`` is an unsharded fp32 parameter: FSDP2 and expert parallelism hand the
    GEMMs other tensors (bf16 gathers, local shards), so copies of the parameters would never be read.
    ``switch`` names the setting asking for copies, ``fix`` what to do instead. The one check behind
    the expert and the dense copies."""
    from ..config import ConfigError

    if not hasattr(optimizer, "add_compute_copies"):
        raise ConfigError(f"{switch} needs an optimizer that writes bf16 copies in its step "
                          f"(core.adamw.PrecisionAwareAdamW), but this run's is {type(optimizer).__name__}: use "
                          f"optimizer.impl=triton (or auto on a GPU), or {fix}")
    if any(type(w) is not torch.nn.Parameter or w.dtype != torch.float32 for w in weights):
        raise ConfigError(f"{switch} is for unsharded fp32 weights (one GPU, no FSDP2, expert or pipeline "
                          f"parallelism): {fix} for this layout")


def attach_expert_copies(optimizer, parts, grads: bool, on_written=None,
                         mx_scale_mode: str | None = None) -> dict[torch.Tensor, torch.Tensor]:
    """precision.expert_weight_copies=optimizer: bf16 copies of every routed expert weight in
    ``parts``, registered with ``optimizer`` (core.adamw.PrecisionAwareAdamW), which rewrites them in
    its step -> {parameter: copy}. ``grads`` (precision.expert_grads_bf16): the copies become leaves
    the experts compute with in their parameters' place (GroupedExperts.weight_copies), so their
    gradients are bf16 on the copies; else ``on_written`` is called with the pairs after each step.
    ConfigError where the optimizer writes no copies or the weights are not unsharded fp32
    parameters. The bf16 recipe (TorchGemm), fp8_rowwise and the emulated backend (their weights
    quantized from the copies) attach through here. ``mx_scale_mode`` (precision.quantized_expert_copies,
    with ``grads``): the optimizer writes each copy already MX-quantized along I and dequantized (the
    forward's operand) and a second tensor along O (the dgrad's, GroupedExperts.weight_copies_dgrad),
    in its step's pass (PrecisionAwareAdamW.add_compute_copies' mx_cols)."""
    from ..moe.experts import GroupedExperts

    if mx_scale_mode is not None and not grads:
        raise ValueError("attach_expert_copies: quantized copies (mx_scale_mode) are the GEMMs' operands, which "
                         "needs grads=True (the copies in the parameters' place)")
    experts = [m for part in parts for m in part.modules() if isinstance(m, GroupedExperts)]
    weights = [w for m in experts for w in (m.w_gate_up, m.w_down)]
    _check_copyable(optimizer, weights, "precision.expert_weight_copies=optimizer", "use expert_weight_copies=step")
    copies = {w: w.detach().to(torch.bfloat16) for w in weights}
    cols = {w: torch.empty_like(c) for w, c in copies.items()} if mx_scale_mode is not None else {}
    if grads:
        # The copies are leaves the GEMMs differentiate: their .grad (bf16) is the masters' gradient.
        for m in experts:
            m.weight_copies = (copies[m.w_gate_up].requires_grad_(True), copies[m.w_down].requires_grad_(True))
            if cols:
                m.weight_copies_dgrad = (cols[m.w_gate_up], cols[m.w_down])
    optimizer.add_compute_copies(copies, on_written=on_written, grads=grads, mx_cols=cols,
                                 mx_scale_mode=mx_scale_mode or "rceil", replaces=grads)
    if cols:  # quantized before the first forward, as every step leaves them
        optimizer.write_mx_pairs(list(copies.items()))
    return copies


def attach_dense_copies(optimizer, parts) -> dict[torch.Tensor, torch.Tensor]:
    """precision.dense_weight_copies: bf16 copies of every dense Linear's weight in ``parts`` but the
    LM head's, written by ``optimizer`` (core.adamw.PrecisionAwareAdamW) in its step -> {parameter:
    copy}. Each Linear (attention, the dense and shared SwiGLUs) computes on its copy in the
    parameter's place (Linear.weight_copy: a leaf whose bf16 .grad the optimizer reads as the
    parameter's gradient). The LM head has its own switch (head_weight_copy, attach_head_copy: its
    copy is held all step, 2 B x V x D, and its gradient stays fp32). ConfigError where
    the optimizer writes no copies or a weight is not an unsharded fp32 parameter (FSDP2 gathers its
    own bf16 weights)."""
    from ..layers.linear import Linear
    from ..layers.loss import LMHead

    linears = [m for part in parts for m in part.modules() if isinstance(m, Linear) and not isinstance(m, LMHead)]
    return _attach_leaf_copies(optimizer, linears, "dense_weight_copies")


def _attach_leaf_copies(optimizer, modules, switch: str) -> dict[torch.Tensor, torch.Tensor]:
    """The bf16 copies of ``modules``' weights that precision.``switch`` asks for, each a leaf the module
    computes on in its weight's place (``module.weight_copy``) and whose bf16 .grad ``optimizer`` reads
    as the weight's gradient (add_compute_copies' grads and replaces) -> {parameter: copy}. The one
    path behind dense_weight_copies and embedding_weight_copy."""
    _check_copyable(optimizer, [m.weight for m in modules], f"precision.{switch}=true", f"drop {switch}")
    copies = {m.weight: m.weight.detach().to(torch.bfloat16).requires_grad_(True) for m in modules}
    for m in modules:
        m.weight_copy = copies[m.weight]
    optimizer.add_compute_copies(copies, grads=True, replaces=True)
    return copies


def attach_head_copy(optimizer, parts, grads: bool = False) -> dict[torch.Tensor, torch.Tensor]:
    """precision.head_weight_copy: a bf16 copy of each LM head's weight in ``parts``, written by
    ``optimizer`` in its step (LMHead.weight_bf16) -> {parameter: copy}. The fused loss computes on
    it instead of casting the fp32 weight; the gradient stays fp32 on the weight, or with ``grads``
    (precision.head_grads_bf16) the copy is a leaf the loss differentiates in its place and its bf16
    .grad is the master's gradient. ConfigError without the fused loss, and as for the other copies
    (_check_copyable)."""
    from ..config import ConfigError
    from ..layers.loss import LMHead

    heads = [m for part in parts for m in part.modules() if isinstance(m, LMHead)]
    if any(not m.fused for m in heads):
        raise ConfigError("precision.head_weight_copy=true serves the fused LM loss, and this model has "
                          "model.fused_loss=false: set model.fused_loss=true, or drop head_weight_copy")
    _check_copyable(optimizer, [m.weight for m in heads], "precision.head_weight_copy=true", "drop head_weight_copy")
    copies = {m.weight: m.weight.detach().to(torch.bfloat16).requires_grad_(grads) for m in heads}
    for m in heads:
        m.weight_bf16 = copies[m.weight]
    # The fused loss reads only the copy (the weight gives its shape and takes the gradient, or with
    # ``grads``, precision.head_grads_bf16, the copy takes it in bf16): the logits path (LMHead
    # without labels) reads the weight, outside the training step.
    optimizer.add_compute_copies(copies, grads=grads, replaces=True)
    return copies


def attach_embedding_copy(optimizer, parts) -> dict[torch.Tensor, torch.Tensor]:
    """precision.embedding_weight_copy: a bf16 copy of each token embedding's weight in ``parts``, written
    by ``optimizer`` in its step -> {parameter: copy}. The embedding gathers its rows from the copy
    (Embedding.weight_copy: a leaf whose bf16 .grad the optimizer reads as the weight's gradient). The
    bf16 residual stream makes that the same rows (config.check_embedding_copy). ConfigError as for the
    other copies (_attach_leaf_copies)."""
    from ..layers.embedding import Embedding

    embeddings = [m for part in parts for m in part.modules() if isinstance(m, Embedding)]
    return _attach_leaf_copies(optimizer, embeddings, "embedding_weight_copy")


class TorchGemm(GemmBackend):
    """PyTorch's own GEMMs in the compute dtype: bf16 under autocast with fp32 master weights, or
    fp32 without it. Dense: F.linear (autocast casts). Grouped: torch._grouped_mm in the compute
    dtype (it takes no autocast itself) through core.precision.bf16_grouped's ops, which cast the
    master weight inside and save it rather than a copy, and fuse the SwiGLU into the down
    projection; ``per_expert``: one cuBLAS GEMM per expert instead (precision.bf16_experts=cublas)."""

    name = "torch"

    def __init__(self, weight_copies: str = "none", triton_swiglu: bool = False, grads_on_copies: bool = False,
                 per_expert: bool = False, dense_copies: bool = False, head_copy: bool = False,
                 save_swiglu_product: bool = False, fused_shared_input: bool = False, head_grads: bool = False,
                 embedding_copy: bool = False):
        # precision.expert_weight_copies: the grouped GEMMs' bf16 weight copies, none, made once per
        # step ("step") or written by the optimizer and pinned in the cache ("optimizer").
        self.optimizer_copies = str(weight_copies) == "optimizer"
        # precision.expert_grads_bf16: the optimizer's copies are handed to the GEMMs themselves (no
        # cache) and receive the gradients.
        self.grads_on_copies = grads_on_copies and self.optimizer_copies
        self.weight_cache = (None if str(weight_copies) == "none" or self.grads_on_copies
                             else bf16_grouped.register_cache())
        self.triton_swiglu = triton_swiglu  # precision.triton_swiglu
        self.per_expert = bool(per_expert)  # precision.bf16_experts=cublas: one cuBLAS GEMM per expert
        self.dense_copies = bool(dense_copies)  # precision.dense_weight_copies
        self.head_copy = bool(head_copy)  # precision.head_weight_copy
        self.head_grads = bool(head_grads) and self.head_copy  # precision.head_grads_bf16
        self.embedding_copy = bool(embedding_copy)  # precision.embedding_weight_copy
        self.save_swiglu_product = bool(save_swiglu_product)  # precision.save_swiglu_product
        self.fused_shared_input = bool(fused_shared_input)  # precision.fused_shared_input

    def attach_optimizer(self, optimizer, parts) -> None:
        if self.dense_copies:
            attach_dense_copies(optimizer, parts)
        if self.head_copy:
            attach_head_copy(optimizer, parts, grads=self.head_grads)
        if self.embedding_copy:
            attach_embedding_copy(optimizer, parts)
        if not self.optimizer_copies:
            return
        copies = attach_expert_copies(optimizer, parts, grads=self.grads_on_copies,
                                      on_written=None if self.grads_on_copies else self._pin)
        if not self.grads_on_copies:
            self._pin(list(copies.items()))

    def _pin(self, pairs) -> None:
        """(parameter, its bf16 copy) pairs the optimizer just wrote: serve the copies until the
        parameters are written again."""
        cache = bf16_grouped.cache(self.weight_cache)
        for w, copy in pairs:
            cache.pin(w, str(torch.bfloat16), copy)

    def after_optimizer_step(self) -> None:
        if self.weight_cache is not None:
            bf16_grouped.cache(self.weight_cache).invalidate()

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def linears(self, x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """precision.fused_shared_input: one GEMM x [..., I] @ cat(w_i) [sum O_i, I]^T, its output
        split along the last dim (views); autograd takes the weights' gradients from one GEMM too
        (cat's backward hands each weight its rows) and x's in one K = sum O_i GEMM instead of one
        per weight and their sum. Under autocast the concatenation and the bf16 cast are one pass
        when compiled. Otherwise a linear each."""
        if not self.fused_shared_input or len(ws) < 2:
            return super().linears(x, ws)
        return F.linear(x, torch.cat(ws)).split([w.shape[0] for w in ws], dim=-1)

    def grouped_mm(self, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        return bf16_grouped.grouped_mm(x_RI, w_EOI, offsets_E, compute_dtype(x_RI), self.weight_cache,
                                       self.per_expert)

    def grouped_swiglu_down(self, h_R2F, w_EDF, offsets_E, act, row_scale_R=None):
        # The fused op recomputes the product in backward (or keeps it: save_swiglu_product); it knows
        # only the plain SwiGLU.
        if not _is_swiglu(act):
            return super().grouped_swiglu_down(h_R2F, w_EDF, offsets_E, act, row_scale_R)
        return bf16_grouped.grouped_swiglu_down(h_R2F, w_EDF, offsets_E, compute_dtype(h_R2F), self.weight_cache,
                                                self.triton_swiglu, row_scale_R, self.per_expert,
                                                self.save_swiglu_product)


GEMM_BACKENDS: Registry[type[GemmBackend]] = Registry("GEMM backend")


def register_gemm_backend(cls: type[GemmBackend]) -> type[GemmBackend]:
    """Add a backend class (usable as a decorator); its name must be new."""
    return GEMM_BACKENDS.add(cls.name, cls)


def gemm_backend(name: str) -> GemmBackend:
    """A new instance of the registered backend ``name`` (ConfigError naming the registered ones)."""
    return GEMM_BACKENDS.lookup(name, "GEMM backend")()


register_gemm_backend(TorchGemm)
DEFAULT_GEMM = TorchGemm()
"""What GEMM modules hold until a policy installs another (stateless, so one instance is shared)."""
