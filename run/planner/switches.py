"""The planner's switches: what of a run's configs the model counts (the recipe and its backend, the
fused loss, the expert GEMMs' kernels, the optimizer's state and kernel, offload), as Switches, and
switches(), which resolves them from the configs for a GPU as pretrain would."""

from __future__ import annotations

__all__ = ['Switches', 'switches']

import dataclasses

import torch

from moetron.core.config import ConfigError
from moetron.core.layers.loss import path_chunk_tokens
from moetron.core.optim import OptimizerConfig, check_split_master
from moetron.core.precision import Fp8Wgrad, PrecisionConfig, PrecisionRecipe, emulated
from moetron.core.precision.config import (check_bf16_copies, copies_auto_on, split_copies_held, check_embedding_copy, check_emulated_saves, check_expert_copies,
                                           check_quantized_copies, check_save_product, input_once_on, residual_on,
                                           takes_expert_copies)
from moetron.models import ModelConfig
from moetron.parallel.config import ParallelConfig
from .hardware import GPU, FP8_SAVED, FP8_WEIGHT_CACHED, LOW_PRECISION


@dataclasses.dataclass(frozen=True)
class Switches:
    """A step's switches as the planner models them, resolved from the run's configs (see switches())."""

    compiled: bool = True
    fused_loss: bool = True
    """model.fused_loss: the chunked LM-head loss (core/layers/loss.py), else full logits."""
    fused_loss_prescale: bool = True
    """model.fused_loss_prescale (with the fused loss; the plain loop and the pipeline schedules declare
    the micro-batch's weight): the fused loss' gradients computed at it, no scaling pass over grad_W
    and grad_h in its backward, no scaled copies of them held."""
    loss_chunk_tokens: int = 5120
    """model.loss_chunk_tokens, else the fused loss' own default on a CUDA bf16 run (path_chunk_tokens:
    5120 at V 100352)."""
    recipe: str = "bf16"
    """bf16, mxfp8, fp8_blockwise or fp8_rowwise (precision.recipe resolved for a GPU)."""
    backend: str = "native"
    """native or emulated (precision.backend resolved for the GPU; bf16 is native)."""
    low_modules: frozenset = frozenset()
    """Modules whose GEMMs run the low-precision recipe (precision.modules): experts, attention, mlp."""
    state_dtype: str = "fp32"
    expert_weight_copies: bool = False
    """precision.expert_weight_copies: the bf16 experts keep one bf16 copy of each weight through
    the step (held memory, no recast in backward); fp8_rowwise's and the emulated backend's experts
    quantize from those copies (core.precision.config.takes_expert_copies)."""
    triton_swiglu: bool = True
    """precision.triton_swiglu: the bf16 experts' SwiGLU backward in one Triton pass (silu(gate) and
    the product's gradient made in it: two [R, F] row tensors fewer at the backward's peak)."""
    expert_grads_bf16: bool = False
    """precision.expert_grads_bf16 (bf16, fp8_rowwise, the emulated backend): the experts' gradients held in bf16 on the optimizer's copies
    (2 B per local expert parameter instead of 4; no bf16 -> fp32 cast of the grouped GEMMs' weight
    gradients, read 2 + written 4 B per element; the optimizer reads 2 B less for each)."""
    dense_weight_copies: bool = False
    """precision.dense_weight_copies (bf16, one unsharded GPU): the dense linears but the LM head compute
    on the optimizer's bf16 copies (replacing autograd's casts: the same 2 B held), their gradients 2 B
    instead of 4; no fp32 -> bf16 weight casts in the forward (read 4 + write 2 B) nor bf16 -> fp32
    gradient casts in the backward (read 2 + write 4 B); the optimizer writes 2 B more per copied
    element and reads 2 B less per dense gradient."""
    save_swiglu_product: bool = False
    """precision.save_swiglu_product (bf16): the routed experts' SwiGLU product [T*K, F] bf16 kept for the
    backward (2 B x K x F a token more saved per MoE layer), which then neither recomputes nor writes it
    (2 B x K x F a token less traffic)."""
    head_weight_copy: bool = False
    """precision.head_weight_copy (bf16, one unsharded GPU): the fused loss computes on the optimizer's
    bf16 copy of the head weight, held all step (2 B x V x D) instead of cast in the loss' forward
    (read 4 + write 2 B an element); the optimizer writes 2 B more per element."""
    head_grads_bf16: bool = False
    """precision.head_grads_bf16 (with head_weight_copy and the fused loss): the head's gradient bf16 on its
    copy, 2 B x V x D less held; the loss writes it in 2 B where it runs in one chunk, and the optimizer
    reads 2 B less an element."""
    embedding_weight_copy: bool = False
    """precision.embedding_weight_copy (bf16 with the bf16 stream, one unsharded GPU): the embedding gathers
    from the optimizer's bf16 copy, held all step (2 B x V x D), its gradient bf16 on it (2 B x V x D less
    held, written and read by the optimizer; the optimizer writes the copy, 2 B), and no fp32 rows gathered
    nor their gradient widened (Switches.EMBEDDING_COPY_ROW_BYTES a token and column)."""
    EMBEDDING_COPY_ROW_BYTES = 10.0
    """Bytes an element of the embedding's rows [T, D] embedding_weight_copy saves: the gather reads 2 B
    instead of 4 (a compiled step fuses the gather and the stream's cast), and the backward neither widens
    the rows' bf16 gradient to fp32 (read 2 + write 4 B) nor reads the fp32 one (4 B for 2). An eager
    step also writes the fp32 rows and casts them (6 B more): not counted."""
    split_master: bool = False
    """optimizer.split_master (one unsharded GPU, with the optimizer's bf16 copies): the masters of the
    weights computed on through those copies (split_elements) held as the copy and a 2 B rest, their fp32
    storage freed: 2 B an element less held, and the optimizer moves 2 B an element less (reads copy and
    rest, 4 B, and writes them, 4 B, instead of reading and writing the fp32 master and writing the copy)."""
    bf16_residual: bool = False
    """precision.bf16_residual as the run resolves it (config.residual_on: auto is on with bf16): the
    residual stream between the blocks and its gradient in bf16, 2 B an element instead of 4: the norms'
    saved input, the final norm's input and the fused loss' grad_h (memory.py), and the stream's
    elementwise traffic (RESIDUAL_SAVED_BYTES)."""
    triton_rmsnorm: bool = False
    """model.triton_rmsnorm in an eager step (compiled steps trace torch's norm): autograd keeps each norm's
    input in its own dtype and one fp32 scale a row instead of 8 B an element (memory.py), and the step
    moves EAGER_NORM_SAVED_BYTES less per normed element."""
    triton_rope: bool = False
    """model.triton_rope in an eager step: EAGER_ROPE_SAVED_BYTES less per roped element (q and k)."""
    quantized_expert_copies: bool = False
    """precision.quantized_expert_copies (mxfp8 emulated on the optimizer's expert copies): the optimizer
    writes each expert weight quantized both ways in its step (2 B more written per element, a second
    bf16 copy held), and no GEMM quantizes an expert weight."""
    quantize_weights_once: bool = False
    """precision.quantize_weights_once: compiled, the experts' low-precision GEMMs run outside the
    graph and their weights are quantized once per step (the WeightCache, held through the step)."""
    bf16_experts: str = "grouped_mm"
    """precision.bf16_experts (the bf16 recipe and the emulated backends' bf16 GEMMs): torch's grouped
    kernel, or one cuBLAS GEMM per local expert (cublas: the grouped rate x the measured ratio of
    BF16_CUBLAS_MEASURED, or the CPU's per-call cost, BF16_CUBLAS_CALL_S, whichever is longer)."""
    fp8_experts: str = "triton"
    """precision.fp8_experts resolved (native fp8_blockwise; auto: gluon on an SM90 GPU, else triton,
    PrecisionConfig.resolved_fp8_experts): the experts' GEMMs in the Triton kernels, or one
    cuBLAS GEMM per local expert (cublas: the GPU's rate or the CPU's per-call cost, whichever is longer).
    gluon (core/precision/fp8_gluon.py): at its own measured rate, EFF_FP8_GLUON_EXPERT (session 40; until
    then at the Triton kernels' rate)."""
    fp8_wgrad: str = "all"
    """precision.fp8_wgrad (native fp8_blockwise and fp8_rowwise): which weight-gradient GEMMs run in FP8 (all, none,
    dense: all but the routed experts'); the others in bf16 at the bf16 rates (a third of each
    low-precision GEMM's FLOPs), their input saved in bf16 and only its rows quantized
    (QUANT_ROWS_BYTES; fp8_rowwise: ROWWISE_QUANT_BYTES' rows)."""
    fp8_fast_accum: bool = False
    """precision.fp8_fast_accum (native fp8_rowwise): the FP8 GEMMs accumulate without fp32 promotion
    (FP8_ROWWISE_MEASURED's and EFF_FP8_ROWWISE_GEMM's faster rates)."""
    fp8_fused_amax: bool = True
    """precision.fp8_fused_amax (native fp8_rowwise): a grouped operand's rows and column maxima in one
    read where the fused kernel's tile fits the row (up to 4096 columns), else a maxima pass of its own."""
    mx_fused: bool = True
    """mxfp8 emulated: each GEMM input's and output gradient's two quantizations from one read
    (core.precision.emulated.FUSED, MOETRON_MX_FUSED; False: two passes, MX_EMULATED_BYTES)."""
    emulated_save_x_bf16: bool = False
    """precision.emulated_save_x_bf16 (mxfp8 / fp8_blockwise emulated): each low-precision GEMM input's
    wgrad operand kept in bf16 (2 B per element, saved_input) instead of the fp8 payload; mxfp8: its
    forward kernel writes bf16 columns and the backward has no dequantize pass (MX_EMULATED_BYTES)."""
    quantize_input_once: bool = False
    """precision.quantize_input_once as the run resolves it (config.input_once_on: auto is on for
    fp8_rowwise and mxfp8 / fp8_blockwise emulated): attention's q, k, v and a dense SwiGLU's gate
    and up quantize their shared input once (timing._operand_widths) and save one wgrad operand of
    it, not one per linear (memory.activation_terms, eager)."""
    optimizer_kernel: str = "triton"
    """The optimizer step's kernel on GPUs: triton (optimizer.impl auto or triton) or torch (impl=torch)."""
    offload: bool = False

    def low(self, module: str) -> bool:
        return self.recipe != "bf16" and module in self.low_modules

    def saved_input(self, module: str) -> float:
        """Bytes per element of a GEMM input saved for the wgrad: fp8 + scales or bf16 (a bf16 wgrad, or
        emulated_save_x_bf16)."""
        if self.low(module) and self.backend == "emulated" and self.emulated_save_x_bf16:
            return 2.0
        return FP8_SAVED if self.low(module) and not self.bf16_wgrad(module) else 2.0

    def bf16_wgrad(self, module: str) -> bool:
        """The module's low-precision GEMMs run their wgrad in bf16 (precision.fp8_wgrad=none, or dense
        for the experts)."""
        wgrad = Fp8Wgrad(self.fp8_wgrad)
        fp8 = wgrad.experts_fp8 if module == "experts" else wgrad.dense_fp8
        return self.low(module) and self.recipe in ("fp8_blockwise", "fp8_rowwise") and self.backend == "native" \
            and not fp8

    def weight_cache(self, module: str, forward_only: bool = False) -> float:
        """Bytes per weight element the low-precision weight cache holds through a step where it
        serves the module (caches_weights; core.precision.cache: bf16 dequantized copies along I and
        O for emulated mxfp8, one for emulated blockwise; fp8 w and w^T native, rowwise: one fp32
        scale per row of each, about 2 B); 0 where a traced graph quantizes instead.
        ``forward_only``: what it holds before the weight's backward has run. fp8_rowwise native
        caches each orientation as its own entry (fp8_rowwise._weight), so only the forward's rows
        (1 B) exist then; the other recipes make both orientations in one entry."""
        if not self.caches_weights(module):
            return 0.0
        if self.backend == "emulated":
            return 4.0 if self.recipe == "mxfp8" else 2.0
        if self.rowwise_native:
            return 1.0 if forward_only else 2.0
        return FP8_WEIGHT_CACHED if self.recipe == "fp8_blockwise" else 2.0

    def cache_bytes(self, linear: dict[str, float], forward_only: bool = False) -> float:
        """What the weight cache holds through the step (or, ``forward_only``, before the weights'
        backward) for a rank's GEMM weights ``linear`` by module (stage_linear)."""
        return sum(self.weight_cache(k, forward_only) * n for k, n in linear.items())

    def caches_weights(self, module: str) -> bool:
        """The module's low-precision weights come from the WeightCache, once per step: eager runs,
        and the experts of a compiled run with quantize_weights_once."""
        return self.low(module) and (not self.compiled or (module == "experts" and self.quantize_weights_once))

    def head_grad_bytes(self, tokens: int) -> float:
        """Bytes an element of the fused loss' grad_W for a micro-batch of ``tokens``: bf16 on the head's
        copy under head_grads_bf16 where the loss runs in one chunk, else its fp32 accumulator's."""
        return 2.0 if self.head_grads_bf16 and self.loss_chunk_tokens >= tokens else 4.0

    def split_elements(self, linear: dict, head: float, embedding: float = 0.0) -> float:
        """Elements whose masters optimizer.split_master holds split, of a stage whose linear weights are
        ``linear`` (stage_linear's attention, mlp, experts), whose LM head has ``head`` elements (0
        off the last stage) and whose embedding ``embedding`` (0 off the first): those computed on through
        the optimizer's bf16 copies (core/precision/gemm.py: the dense linears', the head's with the fused
        loss, the embedding's, the experts' with their gradients on the copies, unless quantized)."""
        if not self.split_master:
            return 0.0
        embedding = embedding if self.embedding_weight_copy else 0.0
        n = (linear["attention"] + linear["mlp"]) if self.dense_weight_copies else 0.0
        if self.expert_weight_copies and self.expert_grads_bf16 and not self.quantized_expert_copies:
            n += linear["experts"]
        return n + embedding + (head if self.head_weight_copy and self.fused_loss else 0.0)

    def stream_bytes(self, bf16_params: bool = False) -> float:
        """Bytes an element of the residual stream (and its gradient): bf16 under precision.bf16_residual
        or ``bf16_params`` (tools/bench_slice.py's blocks), else fp32."""
        return 2.0 if self.bf16_residual or bf16_params else 4.0

    @property
    def cublas_bf16_experts(self) -> bool:
        """precision.bf16_experts=cublas takes effect: the experts' GEMMs are bf16 ones (the bf16 recipe,
        or an emulated backend's), one cuBLAS GEMM per local expert."""
        return self.bf16_experts == "cublas" and not (self.low("experts") and self.backend == "native")

    @property
    def fp8_blockwise_experts(self) -> bool:
        """The routed experts run fp8_blockwise's native grouped GEMMs (core/precision/fp8_gemm.py)."""
        return self.low("experts") and self.recipe == "fp8_blockwise" and self.backend == "native"

    @property
    def rowwise_native(self) -> bool:
        """fp8_rowwise on its native GEMMs (SM90): its rates (FP8_ROWWISE_MEASURED, EFF_FP8_ROWWISE_GEMM)
        and quantization passes (ROWWISE_QUANT_BYTES at EFF_ROWWISE_ROWS / EFF_ROWWISE_COLS)."""
        return self.recipe == "fp8_rowwise" and self.backend == "native"

    @property
    def mx_emulated(self) -> bool:
        """mxfp8 through the emulated backend: its quantization kernels' own bytes and measured rates
        (MX_EMULATED_BYTES, EFF_MX_QUANT, EFF_MX_FUSED)."""
        return self.recipe == "mxfp8" and self.backend == "emulated"


def switches(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, optimizer: OptimizerConfig,
             gpu: GPU, compiled: bool, mx_fused: bool | None = None, ranks: int = 1, micro_batches: int = 1) -> Switches:
    """The Switches of a run on ``gpu`` (ConfigError where pretrain would refuse: a native recipe the
    GPU lacks, bf16 state with fused AdamW, ...). ``mx_fused`` None: MOETRON_MX_FUSED as this
    process read it (core.precision.emulated.FUSED), the setting a run started from it would get.
    ``ranks`` and ``micro_batches`` (a rank's micro-batches a step) resolve the weight copies' ``auto``
    as the run would (copies_auto_on)."""
    precision.validate()
    optimizer.validate()
    recipe = precision.resolved_recipe("cuda")
    auto_on = copies_auto_on(recipe, "cuda", one_rank=parallel.one_rank(ranks), micro_batches=micro_batches,
                             optimizer_writes_copies=optimizer.writes_copies(on_gpu=True), overlap=optimizer.overlap)
    precision = precision.with_auto_copies(auto_on)
    if recipe == PrecisionRecipe.fp32:
        raise ConfigError("the planner models bf16 compute and its low-precision recipes: precision.recipe=fp32 "
                          "is for CPU tests; use bf16, mxfp8, fp8_blockwise or fp8_rowwise")
    backend = precision.resolved_backend("cuda", capability_major=gpu.sm)
    copies = str(precision.expert_weight_copies) != "none" and takes_expert_copies(recipe, backend)
    check_expert_copies(recipe, backend, str(precision.expert_weight_copies) == "optimizer")
    check_emulated_saves(recipe, backend, precision.emulated_save_x_bf16)
    input_once = input_once_on(recipe, backend, precision.quantize_input_once)
    check_quantized_copies(recipe, backend, precision.quantized_expert_copies,
                           str(precision.expert_weight_copies) == "optimizer" and precision.expert_grads_bf16,
                           precision.modules)
    sharded = parallel.dp_shard > 1 or parallel.ep > 1 or parallel.pp > 1  # the weights are not one GPU's fp32 parameters
    if precision.expert_grads_bf16 and sharded:
        raise ConfigError("precision.expert_grads_bf16 (with expert_weight_copies=optimizer) is for one unsharded "
                          "GPU: no FSDP2, expert or pipeline parallelism; drop it for this layout")
    dense_copies = bool(precision.dense_weight_copies)
    check_bf16_copies(recipe, dense_copies, sharded=sharded)
    head_copy = bool(precision.head_weight_copy)
    check_save_product(recipe, precision.save_swiglu_product)
    check_bf16_copies(recipe, head_copy, sharded=sharded, switch="head_weight_copy")
    embedding_copy = bool(precision.embedding_weight_copy)
    check_embedding_copy(recipe, embedding_copy, precision.bf16_residual, sharded=sharded)
    held = split_copies_held(precision, recipe, backend, model.fused_loss)
    optimizer = optimizer.with_auto_split(auto_on and held)
    check_split_master(bool(optimizer.split_master), held)
    return Switches(compiled=compiled, fused_loss=model.fused_loss,
                    fused_loss_prescale=bool(model.fused_loss and model.fused_loss_prescale),
                    loss_chunk_tokens=model.loss_chunk_tokens or path_chunk_tokens(model.vocab_size, torch.device("cuda"), torch.bfloat16),
                    recipe=str(recipe), backend=str(backend) if recipe in LOW_PRECISION else "native",
                    low_modules=frozenset(str(m) for m in precision.modules) if recipe in LOW_PRECISION else frozenset(),
                    state_dtype=str(optimizer.state_dtype),
                    expert_weight_copies=copies, expert_grads_bf16=bool(precision.expert_grads_bf16) and copies,
                    # the fused backward serves the unscaled SwiGLU only (weights_before_down scales it)
                    triton_swiglu=bool(precision.triton_swiglu) and recipe == PrecisionRecipe.bf16
                    and not (model.moe is not None and model.moe.weights_before_down),
                    bf16_experts=str(precision.bf16_experts),
                    fp8_experts=str(precision.resolved_fp8_experts("cuda", backend, capability_major=gpu.sm)),
                    fp8_wgrad=str(Fp8Wgrad(precision.fp8_wgrad)),
                    fp8_fast_accum=bool(precision.fp8_fast_accum), fp8_fused_amax=bool(precision.fp8_fused_amax),
                    quantize_weights_once=bool(precision.quantize_weights_once) and recipe in LOW_PRECISION,
                    mx_fused=emulated.FUSED if mx_fused is None else bool(mx_fused),
                    emulated_save_x_bf16=bool(precision.emulated_save_x_bf16),
                    quantize_input_once=input_once,
                    quantized_expert_copies=bool(precision.quantized_expert_copies),
                    dense_weight_copies=dense_copies, head_weight_copy=head_copy, embedding_weight_copy=embedding_copy,
                    bf16_residual=residual_on(recipe, precision.bf16_residual),
                    split_master=bool(optimizer.split_master),
                    head_grads_bf16=bool(precision.head_grads_bf16) and head_copy and model.fused_loss,
                    triton_rmsnorm=bool(model.triton_rmsnorm) and not compiled,
                    triton_rope=bool(model.triton_rope) and not compiled,
                    save_swiglu_product=bool(precision.save_swiglu_product),  # bf16 only (check_save_product)
                    optimizer_kernel="torch" if str(optimizer.impl) == "torch" or optimizer.fused is not None else "triton",
                    offload=parallel.fsdp_offload)
