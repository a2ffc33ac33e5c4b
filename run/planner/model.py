"""The planner's model: per-rank memory and step time of a run from its configs (nothing is built).

The model (docs/performance.md "planner vs measurement" checks it). Each term says where it comes
from: [code] counted from the code's definition, [measured] fitted to or read off a measurement,
[assumed] neither.
- memory per rank = fp32 master params + fp32 grads + Adam moments (fp32 8 B or bf16 4 B per param
  [code]), FSDP2-sharded over dp_shard (experts: over ep x efsdp, the same dp_shard ranks), of the
  tightest pipeline stage (all three on the host under parallel.fsdp_offload [code], reported apart);
  + compute copies of weights: bf16 copies of the dense linears on one rank (autograd keeps the cast
  copy [code, measured]; the bf16 expert GEMMs keep none [code]), two gathered blocks under FSDP2, the
  low-precision weight cache of an eager run [code]; + saved activations per token per block
  (activation_terms: eager counted from the code, compiled from the measured OLMoE-8L breakdown, by
  shape) for the micro-batches in flight; + what the loss holds; + communication buffers.
- the peak is the largest of [code]: inside the loss (fused: its forward's last chunk with
  grad_h, fp32 grad_W, the bf16 weight and one chunk's logits; plain: inside its backward, the
  saved fp32 log-softmax plus 10 B/logit of temporaries [measured: 15.37 GiB at 16384 x 100352]),
  the last block's backward (its grads, the recast bf16 expert weight, the gradient rows), and the
  end of backward (every grad, one recomputed block).
- step time = GEMM FLOPs / (peak x GEMM efficiency) + attention FLOPs / (peak x attention
  efficiency) + elementwise HBM traffic [measured fit] + quantization passes and the bf16 experts'
  backward recast [code bytes, assumed unfused rates] + optimizer (HBM, or host under offload) +
  host<->device copies under offload [assumed PCIe rate] + exposed communication, the whole
  stretched by the 1F1B bubble (p-1)/(m+p-1). FSDP all-gathers / reduce-scatters are assumed to
  overlap compute (only the excess is exposed); EP all-to-alls, pipeline sends, offload copies and
  the CPU optimizer step are not.
- precision: bf16 is the measured path; mxfp8 / fp8_blockwise emulated run bf16 GEMMs after
  dequantizing (GEMMs at the bf16 rate plus quantize-dequantize passes) and save GEMM inputs as
  fp8 + scales (1 + 1/32 B per element) [code]; fp8_blockwise native runs dense GEMMs at the H200's
  measured ~1000-1160 TFLOP/s (1080 of the fp8 peak) and grouped experts at the Triton kernels'
  measured 510 TFLOP/s, or with precision.fp8_experts=cublas at cuBLAS's 724 TFLOP/s or its 55 us
  of CPU per call, whichever is longer (its grouped wgrad writes fp32 then casts: 6 B per expert weight element at
  the slice's gate|up wgrad peak, its weight cache e4m3 w and w^T + scales [code], docs/planner.md); mxfp8 native (SM100+) is built but has never run (no Blackwell here): modelled
  at the fp8 rates [assumed].
- the fused loss vs the plain one: memory from the code; their time is not told apart (the same
  GEMM FLOPs, about the same elementwise bytes per logit) [assumed].
"""

from __future__ import annotations

__all__ = ['Plan', 'SLICE_FREED', 'SLICE_FREED_AT_GATE_UP', 'Switches', 'activation_terms', 'block_activation_bytes', 'block_backward_transient', 'gate_up_wgrad_transient', 'gemm_rate', 'stage_linear', 'loss_memory', 'plan', 'plan_slice', 'reference_activation_bytes', 'search', 'slice_layers', 'slice_params', 'stage_time', 'switches']

import dataclasses
import itertools

from moetron.core.config import ConfigError
from moetron.core.layers.loss import default_chunk_tokens
from moetron.core.memory import MemoryConfig, Recompute
from moetron.core.optim import OptimizerConfig
from moetron.core.precision import PrecisionConfig, PrecisionRecipe
from moetron.core.precision.blockwise import FP8_BLOCK
from moetron.core.precision.grouping import padded_rows
from moetron.core.trainer import GradSync
from moetron.models import ModelConfig
from moetron.parallel.config import ParallelConfig
from moetron.parallel.pipeline.runtime import n_microbatches
from moetron.run.config import PretrainConfig, check_layout
from .hardware import (
    GiB, GPU, GPUS, GPUS_PER_NODE, RESERVED_GIB, EFF_GEMM,
    EFF_EXPERT, EFF_FP8_GEMM, EFF_FP8_EXPERT, EFF_FP8_CUBLAS_EXPERT, CUBLAS_CALL_S, EFF_CUBLAS_EXPERT,
    BF16_CUBLAS_CALL_S, EFF_MX_EXPERT, EFF_ATTN, EFF_COMM,
    EFF_PCIE,
    HOST_GBPS, HBM_TRAFFIC, OPTIMIZER_BYTES, RECOMPUTE_FORWARD, HOST_OPTIMIZER_BYTES, QUANT_BYTES,
    WEIGHT_QUANT_BYTES, QUANT_ROWS_BYTES, FP8_SAVED, FP8_WEIGHT_CACHED, FP8_WGRAD_BYTES, LOW_PRECISION,
)


@dataclasses.dataclass(frozen=True)
class Switches:
    """A step's switches as the planner models them, resolved from the run's configs (see switches())."""

    compiled: bool = True
    fused_loss: bool = True
    """model.fused_loss: the chunked LM-head loss (core/layers/loss.py), else full logits."""
    loss_chunk_tokens: int = 2560
    recipe: str = "bf16"
    """bf16, mxfp8 or fp8_blockwise (precision.recipe resolved for a GPU)."""
    backend: str = "native"
    """native or emulated (precision.backend resolved for the GPU; bf16 is native)."""
    low_modules: frozenset = frozenset()
    """Modules whose GEMMs run the low-precision recipe (precision.modules): experts, attention, mlp."""
    state_dtype: str = "fp32"
    expert_weight_copies: bool = False
    """precision.expert_weight_copies: the bf16 experts keep one bf16 copy of each weight through
    the step (held memory, no recast in backward)."""
    triton_swiglu: bool = True
    """precision.triton_swiglu: the bf16 experts' SwiGLU backward in one Triton pass (silu(gate) and
    the product's gradient made in it: two [R, F] row tensors fewer at the backward's peak)."""
    expert_grads_bf16: bool = False
    """precision.expert_grads_bf16: the experts' gradients held in bf16 on the optimizer's copies
    (2 B per local expert parameter instead of 4; no bf16 -> fp32 cast of the grouped GEMMs' weight
    gradients, read 2 + written 4 B per element; the optimizer reads 2 B less for each)."""
    quantize_weights_once: bool = False
    """precision.quantize_weights_once: compiled, the experts' low-precision GEMMs run outside the
    graph and their weights are quantized once per step (the WeightCache, held through the step)."""
    bf16_experts: str = "grouped_mm"
    """precision.bf16_experts (the bf16 recipe and the emulated backends' bf16 GEMMs): torch's grouped
    kernel, or one cuBLAS GEMM per local expert (cublas: EFF_CUBLAS_EXPERT or the CPU's per-call
    cost, BF16_CUBLAS_CALL_S, whichever is longer)."""
    fp8_experts: str = "triton"
    """precision.fp8_experts (native fp8_blockwise): the experts' GEMMs in the Triton kernels, or one
    cuBLAS GEMM per local expert (cublas: the GPU's rate or the CPU's per-call cost, whichever is longer)."""
    fp8_wgrad: bool = True
    """precision.fp8_wgrad (native fp8_blockwise): the weight-gradient GEMMs in FP8; false: in bf16 at
    the bf16 rates (a third of each low-precision GEMM's FLOPs), the input saved in bf16 and only its
    rows quantized (QUANT_ROWS_BYTES)."""
    optimizer_kernel: str = "triton"
    """The optimizer step's kernel on GPUs: triton (optimizer.impl auto or triton) or torch (impl=torch)."""
    offload: bool = False

    def low(self, module: str) -> bool:
        return self.recipe != "bf16" and module in self.low_modules

    def saved_input(self, module: str) -> float:
        """Bytes per element of a GEMM input saved for the wgrad: fp8 + scales or bf16."""
        return FP8_SAVED if self.low(module) and not self.bf16_wgrad(module) else 2.0

    def bf16_wgrad(self, module: str) -> bool:
        """The module's low-precision GEMMs run their wgrad in bf16 (precision.fp8_wgrad=false)."""
        return self.low(module) and self.recipe == "fp8_blockwise" and self.backend == "native" and not self.fp8_wgrad

    def weight_cache(self, module: str) -> float:
        """Bytes per weight element the low-precision weight cache holds through a step where it
        serves the module (caches_weights; core.precision.cache: bf16 dequantized copies along I and
        O for emulated mxfp8, one for emulated blockwise; fp8 w and w^T native); 0 where a traced
        graph quantizes instead."""
        if not self.caches_weights(module):
            return 0.0
        if self.backend == "emulated":
            return 4.0 if self.recipe == "mxfp8" else 2.0
        return FP8_WEIGHT_CACHED if self.recipe == "fp8_blockwise" else 2.0

    def cache_bytes(self, linear: dict[str, float]) -> float:
        """What the weight cache holds through the step for a rank's GEMM weights ``linear`` by
        module (stage_linear)."""
        return sum(self.weight_cache(k) * n for k, n in linear.items())

    def caches_weights(self, module: str) -> bool:
        """The module's low-precision weights come from the WeightCache, once per step: eager runs,
        and the experts of a compiled run with quantize_weights_once."""
        return self.low(module) and (not self.compiled or (module == "experts" and self.quantize_weights_once))

    @property
    def fp8_blockwise_experts(self) -> bool:
        """The routed experts run fp8_blockwise's native grouped GEMMs (core/precision/fp8_gemm.py)."""
        return self.low("experts") and self.recipe == "fp8_blockwise" and self.backend == "native"

    def expert_wgrad(self) -> float:
        """Bytes per expert weight element the grouped wgrad holds as it finishes, bf16 weights:
        native fp8_blockwise's fp32 kernel output and its bf16 cast (FP8_WGRAD_BYTES), else the
        bf16 gradient the GEMM writes."""
        return FP8_WGRAD_BYTES if self.fp8_blockwise_experts else 2.0


def switches(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, optimizer: OptimizerConfig,
             gpu: GPU, compiled: bool) -> Switches:
    """The Switches of a run on ``gpu`` (ConfigError where pretrain would refuse: a native recipe the
    GPU lacks, bf16 state with fused AdamW, ...)."""
    precision.validate()
    optimizer.validate()
    recipe = precision.resolved_recipe("cuda")
    if recipe == PrecisionRecipe.fp32:
        raise ConfigError("the planner models bf16 compute and its low-precision recipes: precision.recipe=fp32 "
                          "is for CPU tests; use bf16, mxfp8 or fp8_blockwise")
    backend = precision.resolved_backend("cuda", capability_major=gpu.sm)
    if precision.expert_grads_bf16 and (parallel.dp_shard > 1 or parallel.ep > 1 or parallel.pp > 1):
        raise ConfigError("precision.expert_grads_bf16 (with expert_weight_copies=optimizer) is for one unsharded "
                          "GPU: no FSDP2, expert or pipeline parallelism; drop it for this layout")
    return Switches(compiled=compiled, fused_loss=model.fused_loss,
                    loss_chunk_tokens=model.loss_chunk_tokens or default_chunk_tokens(model.vocab_size),
                    recipe=str(recipe), backend=str(backend) if recipe in LOW_PRECISION else "native",
                    low_modules=frozenset(str(m) for m in precision.modules) if recipe in LOW_PRECISION else frozenset(),
                    state_dtype=str(optimizer.state_dtype),
                    expert_weight_copies=str(precision.expert_weight_copies) != "none" and recipe == PrecisionRecipe.bf16,
                    expert_grads_bf16=bool(precision.expert_grads_bf16) and recipe == PrecisionRecipe.bf16,
                    # the fused backward serves the unscaled SwiGLU only (weights_before_down scales it)
                    triton_swiglu=bool(precision.triton_swiglu) and recipe == PrecisionRecipe.bf16
                    and not (model.moe is not None and model.moe.weights_before_down),
                    bf16_experts=str(precision.bf16_experts),
                    fp8_experts=str(precision.fp8_experts), fp8_wgrad=bool(precision.fp8_wgrad),
                    quantize_weights_once=bool(precision.quantize_weights_once) and recipe in LOW_PRECISION,
                    optimizer_kernel="torch" if str(optimizer.impl) == "torch" or optimizer.fused is not None else "triton",
                    offload=parallel.fsdp_offload)


def reference_activation_bytes(cfg: ModelConfig, layer: int) -> float:
    """Saved bytes per token of a block as the eager count stood when HBM_TRAFFIC was fitted (bf16,
    the SwiGLU product and silu kept, rope counted): the basis of the elementwise-traffic estimate,
    which measures work done, not what is kept."""
    D = cfg.d_model
    att = cfg.attention
    A, G = att.n_heads * att.head_width(D), att.kv_heads() * att.head_width(D)
    total = 8.0 * D + 6.0 * D + (8.0 * (A + G) if att.qk_norm else 0.0) + 4.0 * (A + G) + 2.0 * (A + 2 * G) + 4.0 * A
    total += 8.0 * D
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        K, F, E = moe.router.top_k, moe.expert_hidden, moe.num_experts
        total += 4.0 * D + 4.0 * E + 2.0 * D + 2.0 * K * D + 4.0 * K * F + 4.0 * K * F + 2.0 * K * D
        S = moe.shared_width()
        if S:
            total += 4.0 * S + 2.0 * D + 4.0 * S
    else:
        H = cfg.mlp_hidden
        total += 4.0 * D + 4.0 * H + 4.0 * H
    return total


def activation_terms(cfg: ModelConfig, layer: int, sw: Switches = Switches(),
                     bf16_params: bool = False) -> dict[str, tuple[str, float]]:
    """Saved-for-backward bytes per token of one block, by term: {name: (module it belongs to for
    selective recompute, bytes)}.

    Eager, counted from the code: the residual stream is fp32; RMSNorm keeps its fp32 input and
    normalized output; each linear keeps its input as its GEMM saves it (bf16, or fp8 + scales under a
    low-precision recipe; q, k, v separately); rope multiplies by constant tables (nothing per token);
    SDPA keeps q, k, v, out; the MoE layer keeps x_TD, the T*K dispatched rows x_RD, the gate|up
    output h and the expert outputs y_RD (the combine's weight gradient); the bf16 experts' fused
    SwiGLU-down op recomputes the product (core/precision/bf16_grouped.py), a low-precision backend
    composes it (silu(gate) and the product, fp8, kept); a dense SwiGLU keeps gate, up, silu, product.

    Compiled, from the measured OLMoE-8L breakdown (tools/bench_memory.py, 143 KiB/token/block once
    the expert weight copies and the product were gone), generalized by shape: [T, *] bf16 x5 (the
    qkv input, q and k before their norms, the o-proj input, one more [T, D]), q, k, v, out for SDPA,
    x_RD, h, y_RD, one fp32 [T, D] for the norms and 0.5 D + 4 E bytes of router state; a dense
    SwiGLU (not measured) keeps its input, gate|up and the product.

    ``bf16_params`` (tools/bench_slice.py's blocks: bf16 weights and a bf16 stream, no autocast
    casts): eager, q, k and v save the one bf16 norm output (autocast casts an fp32 input once per
    linear); the rest is the same count.
    """
    D = cfg.d_model
    att = cfg.attention
    A = att.n_heads * att.head_width(D)
    G = att.kv_heads() * att.head_width(D)
    g_att, g_mlp, g_exp = sw.saved_input("attention"), sw.saved_input("mlp"), sw.saved_input("experts")
    terms: dict[str, tuple[str, float]] = {}
    moe = cfg.moe if cfg.is_moe_layer(layer) else None
    if not sw.compiled:
        terms["attn_norm"] = ("norm", 8.0 * D)
        terms["qkv_inputs"] = ("attention", (1 if bf16_params and not sw.low("attention") else 3) * g_att * D)
        if att.qk_norm:
            terms["qk_norm"] = ("norm", 8.0 * (A + G))
        terms["sdpa_qkv_out"] = ("attention", 2.0 * (A + 2 * G) + 2.0 * A)
        terms["o_proj_input"] = ("attention", g_att * A)
        terms["mlp_norm"] = ("norm", 8.0 * D)
        if moe is not None:
            K, F, E = moe.router.top_k, moe.expert_hidden, moe.num_experts
            terms["router"] = ("router", 4.0 * D + 4.0 * E)  # fp32 input + softmax probs
            terms["dispatch_rows"] = ("experts", 2.0 * D + g_exp * K * D)  # x_TD bf16 + x_RD (T*K rows)
            terms["expert_hidden"] = ("experts", K * 4.0 * F)  # gate|up output of the grouped GEMM
            if sw.low("experts"):  # composed SwiGLU: silu(gate) and the product (w_down's input)
                terms["expert_swiglu"] = ("swiglu", K * (2.0 * F + g_exp * F))
            if not moe.weights_before_down:  # the weights applied before the down projection: no y_RD kept
                terms["expert_out"] = ("experts", 2.0 * K * D)  # y_RD for the combine's weight gradient
            if moe.shared_width():
                S = moe.shared_width()
                terms["shared_mlp"] = ("mlp", 4.0 * S + g_mlp * D)
                terms["shared_swiglu"] = ("swiglu", 2.0 * S + g_mlp * S)
        else:
            H = cfg.mlp_hidden
            terms["mlp"] = ("mlp", 2 * g_mlp * D + 4.0 * H)
            terms["mlp_swiglu"] = ("swiglu", 2.0 * H + g_mlp * H)
        return terms
    terms["norms"] = ("norm", 4.0 * D)
    terms["qkv_input"] = ("attention", g_att * D)
    if att.qk_norm:
        terms["qk_norm"] = ("norm", 2.0 * (A + G))
    terms["attn_other"] = ("attention", 2.0 * D)
    terms["sdpa_qkv_out"] = ("attention", 2.0 * (2 * A + 2 * G))
    terms["o_proj_input"] = ("attention", g_att * A)
    if moe is not None:
        K, F, E = moe.router.top_k, moe.expert_hidden, moe.num_experts
        terms["router"] = ("router", 0.5 * D + 4.0 * E)
        terms["dispatch_rows"] = ("experts", g_exp * K * D)
        terms["expert_hidden"] = ("experts", K * 4.0 * F)
        if sw.low("experts"):
            terms["expert_swiglu"] = ("swiglu", K * g_exp * F)
        if not moe.weights_before_down:
            terms["expert_out"] = ("experts", 2.0 * K * D)
        if moe.shared_width():
            S = moe.shared_width()
            terms["shared_mlp"] = ("mlp", g_mlp * D + 4.0 * S)
            terms["shared_swiglu"] = ("swiglu", g_mlp * S)
    else:
        H = cfg.mlp_hidden
        terms["mlp"] = ("mlp", g_mlp * D + 4.0 * H)
        terms["mlp_swiglu"] = ("swiglu", g_mlp * H)
    return terms


def block_activation_bytes(cfg: ModelConfig, layer: int, memory: MemoryConfig, sw: Switches = Switches(),
                           bf16_params: bool = False) -> float:
    """Saved bytes per token of block ``layer`` under the recompute policy: the block input (fp32
    residual; bf16 under ``bf16_params``) alone for a fully recomputed block; the named modules'
    terms dropped for selective."""
    if memory.recompute == Recompute.full and layer % memory.recompute_every == 0:
        return (2.0 if bf16_params else 4.0) * cfg.d_model
    terms = activation_terms(cfg, layer, sw, bf16_params)
    if memory.recompute == Recompute.selective:
        dropped = set(memory.recompute_modules)
        return sum(b for mod, b in terms.values() if mod not in dropped)
    return sum(b for _, b in terms.values())


def stage_linear(cfg: ModelConfig, layers: list[int], ep: int) -> dict[str, float]:
    """One rank's GEMM weights of blocks ``layers`` by precision module (_linear_params), the
    routed experts' being its E/ep local ones."""
    linear = {k: float(sum(_linear_params(cfg, i)[k] for i in layers)) for k in ("attention", "mlp", "experts")}
    linear["experts"] /= ep
    return linear


def _linear_params(cfg: ModelConfig, layer: int) -> dict[str, int]:
    """A block's GEMM weights by precision module: attention (q, k, v, o), mlp (dense or shared
    SwiGLU), experts (routed)."""
    D = cfg.d_model
    att = cfg.attention
    A, G = att.n_heads * att.head_width(D), att.kv_heads() * att.head_width(D)
    out = {"attention": D * (2 * A + 2 * G), "mlp": 0, "experts": 0}
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        out["experts"] = moe.num_experts * 3 * D * moe.expert_hidden
        out["mlp"] = 3 * D * moe.shared_width()
    else:
        out["mlp"] = 3 * D * cfg.mlp_hidden
    return out


def _gemm_elements(cfg: ModelConfig, layer: int) -> dict[str, float]:
    """Per token, by precision module: elements of every GEMM's input plus output (the quantized operands)."""
    D = cfg.d_model
    att = cfg.attention
    A, G = att.n_heads * att.head_width(D), att.kv_heads() * att.head_width(D)
    out = {"attention": 3 * D + A + 2 * G + A + D, "mlp": 0.0, "experts": 0.0}
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        K, F, S = moe.router.top_k, moe.expert_hidden, moe.shared_width()
        out["experts"] = K * (D + 2 * F + F + D)
        out["mlp"] = (2 * D + 2 * S + S + D) if S else 0.0
    else:
        H = cfg.mlp_hidden
        out["mlp"] = 2 * D + 2 * H + H + D
    return out


@dataclasses.dataclass
class Plan:
    """Inputs of one plan (a model, a layout, a batch, switches, a GPU)."""

    model: ModelConfig
    parallel: ParallelConfig
    memory: MemoryConfig
    seq_len: int = 4096
    global_batch: int = 4
    micro_batch: int | None = None
    precision: PrecisionConfig = dataclasses.field(default_factory=lambda: PrecisionConfig(recipe=PrecisionRecipe.bf16))
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    compiled: bool = True
    gpu: str = "h200"
    num_gpus: int = 1
    grad_sync: GradSync | str = GradSync.micro_batch
    """trainer.grad_sync: FSDP2 reduce-scatters every micro-batch's gradients (micro_batch), or only
    the last one's (step: each rank accumulates its units' unsharded fp32 gradients meanwhile)."""


def _stage_layers(n_layers: int, pp: int) -> list[list[int]]:
    """Blocks per stage as parallel.pp_split=layers cuts them (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def _group_bw(gpu: GPU, size: int, stride: int) -> float:
    """Bytes/s of a collective over a mesh group of ``size`` ranks ``stride`` apart (ranks fill
    nodes of 8 in mesh order: ep innermost, then efsdp, dp_replicate, pp outermost)."""
    inside = size * stride <= GPUS_PER_NODE
    return (gpu.nvlink_gbps if inside else gpu.internode_gbps) * 1e9 * EFF_COMM


def loss_memory(cfg: ModelConfig, sw: Switches, tokens: int) -> dict[str, float]:
    """Bytes the LM head's loss holds for a micro-batch of ``tokens`` [code]:
    ``saved`` (kept from its forward until its backward), ``peak`` (all it holds at its own peak,
    saved included) and ``where`` that peak is.

    fused (core/layers/loss.py): grad_h [T, D] (h's dtype: the fp32 residual) and the fp32 grad_W
    [V, D] are kept; its forward's last chunk also holds the bf16 weight and hidden casts and one
    chunk's logits (bf16, then fp32 turned into dlogits in place, then bf16: 6 B x C x V at once);
    its backward holds both kept gradients and their scaled copies. plain: the fp32 log-softmax
    [T, V] and the head's bf16 input are kept; inside its backward the nll gradient, the log-softmax
    gradient (fp32) and the bf16 logits' gradient join them: 10 B per logit, which is what the
    OLMoE-8L measurement holds at its peak (15.37 GiB at 16384 x 100352) [measured]."""
    T, D, V = tokens, cfg.d_model, cfg.vocab_size
    norm = 4.0 * T * D  # the final RMSNorm's fp32 input
    if sw.fused_loss:
        saved = norm + 4.0 * T * D + 4.0 * V * D
        C = min(sw.loss_chunk_tokens, T)
        in_forward = saved + 2.0 * V * D + 2.0 * T * D + 6.0 * C * V
        in_backward = saved + 4.0 * T * D + 4.0 * V * D
        where = "loss forward (last chunk)" if in_forward >= in_backward else "loss backward"
        return {"saved": saved, "peak": max(in_forward, in_backward), "where": where}
    saved = norm + 2.0 * T * D + 4.0 * T * V
    return {"saved": saved, "peak": saved + 10.0 * T * V, "where": "loss backward (plain: [T, V] gradients)"}


def block_backward_transient(cfg: ModelConfig, layer: int, sw: Switches, tokens: int, ep: int) -> float:
    """Bytes a block's backward allocates beyond its gradients while its activations are still
    held [code]: the gradient rows of the largest SwiGLU GEMM (grad [R, D], silu / product / their
    grads [R, F] x4, the [R, 2F] cat) and, for the bf16 experts, the gate|up weight recast to bf16."""
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        fresh = not (sw.low("experts") or sw.expert_weight_copies)  # a copy made now, not one held
        recast = 2.0 * (moe.num_experts / ep) * 2 * moe.expert_hidden * cfg.d_model if fresh else 0.0
        rows = _swiglu_backward_rows(cfg, layer, tokens)
        if sw.triton_swiglu and not sw.low("experts"):  # [code] no separate silu / grad_gate rows
            rows -= 2.0 * 2 * tokens * moe.router.top_k * moe.expert_hidden
        return rows + recast
    return _swiglu_backward_rows(cfg, layer, tokens)


def _swiglu_backward_rows(cfg: ModelConfig, layer: int, tokens: int) -> float:
    """The row tensors of a SwiGLU down projection's backward (bf16): the incoming grad [R, D] and
    silu, grad_act, grad_gate, grad_act * silu [R, F] and their [R, 2F] cat (R = T*K expert rows)."""
    if cfg.is_moe_layer(layer):
        R, F = tokens * cfg.moe.router.top_k, cfg.moe.expert_hidden
    else:
        R, F = tokens, cfg.mlp_hidden
    return 2.0 * R * (cfg.d_model + 6 * F)


def _expert_params(cfg: ModelConfig, layer: int) -> int:
    """The routed experts' parameters of block ``layer`` (all E of them; 0 for a dense block)."""
    if not cfg.is_moe_layer(layer):
        return 0
    return cfg.moe.num_params(cfg.d_model) - cfg.moe.num_experts * cfg.d_model - 3 * cfg.d_model * cfg.moe.shared_width()


def gemm_rate(gpu: GPU, sw: Switches, module: str, grouped: bool) -> float:
    """FLOP/s of a module's GEMMs: fp8 peak x fp8 efficiency for a native low-precision recipe,
    else the bf16 rate (emulated backends run bf16 GEMMs)."""
    if sw.recipe != "bf16" and sw.backend == "native" and sw.low(module):
        grouped_eff = EFF_MX_EXPERT if sw.recipe == "mxfp8" else EFF_FP8_EXPERT
        return gpu.fp8_tflops * 1e12 * (grouped_eff if grouped else EFF_FP8_GEMM)
    return gpu.bf16_tflops * 1e12 * (EFF_EXPERT if grouped else EFF_GEMM)


def stage_time(cfg: ModelConfig, layers: list[int], *, sw: Switches, memory: MemoryConfig, gpu: GPU, seq_len: int,
               tokens: int, ep: int, compiled: bool, microbatches: int = 1, last: bool = False,
               all_to_all: bool = True, fp32_master: bool = True) -> tuple[float, dict]:
    """Seconds for one micro-batch of ``tokens`` forward + backward through blocks ``layers`` (with
    E/ep local experts fed T*K rows), and its parts. ``last``: the stage holds the LM head and loss.
    ``all_to_all``: the EP dispatch / combine is run (exposed); ``fp32_master``: the bf16 experts recast
    fp32 master weights in backward (False where the weights are bf16 already, as tools/bench_slice.py
    holds them). ``microbatches`` spreads an eager run's weight-cache quantization over the step."""
    mem, T_mb, m = memory, tokens, microbatches
    bf16_flops = gpu.bf16_tflops * 1e12
    width = cfg.attention.n_heads * cfg.attention.head_width(cfg.d_model)
    modules = ("attention", "mlp", "experts")
    attn_f = sum(12.0 * width * min(seq_len, cfg.window_of(i) or seq_len) for i in layers)
    block_f = sum(cfg.block_flops_per_token(i, seq_len) for i in layers)  # one path for FLOPs
    by_module = {k: 6.0 * sum(_linear_params(cfg, i)[k] for i in layers) for k in modules}
    by_module["experts"] = sum(6.0 * cfg.moe.router.top_k * 3 * cfg.d_model * cfg.moe.expert_hidden
                               for i in layers if cfg.is_moe_layer(i))
    other_f = block_f - attn_f - sum(by_module.values())  # router and anything else: bf16
    if last:
        other_f += cfg.flops_per_token(seq_len) - sum(cfg.block_flops_per_token(i, seq_len) for i in range(cfg.n_layers))
    recomputed = [i for i in layers if mem.recompute == Recompute.full and i % mem.recompute_every == 0]
    share = len(recomputed) / max(1, len(layers))
    extra = 1 + share * RECOMPUTE_FORWARD["compiled" if compiled else "eager"]

    def module_time(k: str, grouped: bool, rate: float) -> float:
        """A module's GEMMs at ``rate``, their wgrad third at the bf16 rate under fp8_wgrad=false."""
        flops = T_mb * extra * by_module[k]
        if not sw.bf16_wgrad(k):
            return flops / rate
        return flops * 2 / 3 / rate + flops / 3 / (bf16_flops * (EFF_EXPERT if grouped else EFF_GEMM))

    passes = 4 if sw.bf16_wgrad("experts") else 6  # the cuBLAS loop's passes per layer (gate|up, down)
    t_experts = module_time("experts", True, gemm_rate(gpu, sw, "experts", True))
    if sw.fp8_blockwise_experts and sw.fp8_experts == "cublas":
        # [measured] one cuBLAS call per local expert for each of a layer's fp8 GEMM passes (gate|up and
        # down: forward, dgrad, wgrad), each ~55 us of CPU: the GPU waits where those add up to more
        calls = sum(passes * cfg.moe.num_experts // ep for i in layers if cfg.is_moe_layer(i)) * extra
        t_experts = max(module_time("experts", True, gpu.fp8_tflops * 1e12 * EFF_FP8_CUBLAS_EXPERT),
                        calls * CUBLAS_CALL_S)
    elif sw.bf16_experts == "cublas" and not (sw.low("experts") and sw.backend == "native"):
        # [assumed] one torch.mm per local expert for each of the 6 bf16 GEMM passes of a layer
        calls = sum(6 * cfg.moe.num_experts // ep for i in layers if cfg.is_moe_layer(i)) * extra
        t_experts = max(module_time("experts", True, bf16_flops * EFF_CUBLAS_EXPERT), calls * BF16_CUBLAS_CALL_S)
    t_gemm = T_mb * extra * other_f / (bf16_flops * EFF_GEMM) + t_experts + sum(
        module_time(k, False, gemm_rate(gpu, sw, k, False)) for k in ("attention", "mlp"))
    t_attn = T_mb * attn_f / (bf16_flops * EFF_ATTN) * extra
    ref_bytes = sum(reference_activation_bytes(cfg, i) for i in layers)
    traffic = HBM_TRAFFIC["compiled" if compiled else "eager"] * ref_bytes * T_mb * extra
    # [code] the bf16 experts recast their fp32 weights in backward (read 4 + write 2 B per
    # element) and recompute the SwiGLU product (read gate|up, write silu and product: ~10 B x F per row).
    recast = 0.0
    if cfg.moe is not None and not sw.low("experts"):
        for i in layers:
            if cfg.is_moe_layer(i):
                recast += (6.0 * _expert_params(cfg, i) / ep if fp32_master and not sw.expert_weight_copies else 0.0) + \
                    10.0 * cfg.moe.expert_hidden * cfg.moe.router.top_k * T_mb
    # [code bytes, assumed rates] quantization passes over every low-precision GEMM's operands.
    quant = 0.0
    if sw.recipe != "bf16":
        qb, wb = QUANT_BYTES[sw.backend], WEIGHT_QUANT_BYTES[sw.backend]
        for i in layers:
            el, wl = _gemm_elements(cfg, i), _linear_params(cfg, i)
            for k in modules:
                if sw.low(k):
                    quant += (QUANT_ROWS_BYTES if sw.bf16_wgrad(k) else qb) * el[k] * T_mb * extra
                    weights = wl[k] / (ep if k == "experts" else 1)
                    # the cache: once per step; a traced graph: forward and backward of every micro-batch
                    quant += wb * weights * (1 / m if sw.caches_weights(k) else 2 * extra)
    t_hbm = traffic / (gpu.hbm_tbps * 1e12)
    t_extra = (recast + quant) / (gpu.hbm_tbps * 1e12)
    t_a2a = 0.0
    if all_to_all and cfg.moe is not None and ep > 1:
        K = cfg.moe.router.top_k
        rows_out = T_mb * (ep - 1) if K >= ep else T_mb * K * (ep - 1) / ep  # all_gather vs synced
        n_moe = sum(1 for i in layers if cfg.is_moe_layer(i))
        passes = 4 + (2 * share if share else 0)  # dispatch + combine, fwd and bwd (+ recompute)
        t_a2a = n_moe * passes * rows_out * cfg.d_model * 2.0 / _group_bw(gpu, ep, 1)
    return t_gemm + t_attn + t_hbm + t_extra + t_a2a, {"gemm": t_gemm, "attention": t_attn, "hbm": t_hbm,
                                                     "recast_quant": t_extra, "ep_a2a": t_a2a}


def plan(p: Plan) -> dict:
    """The plan's figures per rank (the tightest pipeline stage); ConfigError for a bad layout."""
    cfg, mem = p.model, p.memory
    cfg.validate()
    mem.validate()
    if p.gpu not in GPUS:
        raise ConfigError(f"--gpu {p.gpu!r} is not in the table: choose one of {', '.join(GPUS)}")
    gpu = GPUS[p.gpu]
    # The layout checks pretrain's runs get (moetron.run.check_layout), on the plan's sizes.
    run = PretrainConfig(model=cfg, parallel=p.parallel)
    run.data.global_batch_size = p.global_batch
    if p.parallel.pp == 1:
        run.trainer.micro_batch_size = p.micro_batch
    par = check_layout(run, p.num_gpus)
    sw = switches(cfg, par, p.precision, p.optimizer, gpu, p.compiled)
    dp = par.dp_replicate * par.dp_shard
    local_batch = p.global_batch // dp
    if par.pp > 1:
        m = n_microbatches(par, par.pp * par.pp_stages_per_rank)
        micro = local_batch // m
        if p.micro_batch is not None and p.micro_batch != micro:
            raise ConfigError(f"--micro-batch {p.micro_batch} disagrees with the pipeline's {local_batch} / {m} = "
                              f"{micro} sequences per micro-batch: drop it or change pp_microbatches")
    else:
        micro = p.micro_batch or local_batch
        m = local_batch // micro
    ep, efsdp = par.ep, par.dp_shard // par.ep
    T_mb = micro * p.seq_len  # tokens per micro-batch per rank
    fsdp = p.num_gpus > 1 or "data" in par.strategies  # FSDP2 on every multi-rank layout, or asked for
    try:
        grad_sync = GradSync(p.grad_sync)
    except ValueError:
        raise ConfigError(f"--trainer.grad_sync={p.grad_sync!r} is not one of "
                          f"{', '.join(str(g) for g in GradSync)}") from None
    # [code] trainer.grad_sync=step acts under FSDP2 with accumulation and no pipeline (core/trainer.py)
    step_sync = grad_sync == GradSync.step and fsdp and par.dp_shard > 1 and par.pp == 1 and m > 1 and not sw.offload
    stages = _stage_layers(cfg.n_layers, par.pp)
    modules = ("attention", "mlp", "experts")

    def expert_params(layer: int) -> int:
        return _expert_params(cfg, layer)

    state_b = 8.0 if sw.state_dtype == "fp32" else 4.0
    rows = []
    for s, layers in enumerate(stages):
        dense = sum(cfg.num_block_params(i) - expert_params(i) for i in layers)
        experts = sum(expert_params(i) for i in layers)
        last = s == par.pp - 1
        if s == 0:
            dense += cfg.num_embedding_params()
        if last:
            dense += cfg.num_embedding_params() + cfg.d_model
        local = dense / par.dp_shard + experts / par.dp_shard  # experts: / ep, then / efsdp
        block_max = max((cfg.num_block_params(i) - expert_params(i) + expert_params(i) / ep) for i in layers)
        in_flight = min(par.pp - s, m) if par.pp > 1 else 1
        act_tok = sum(block_activation_bytes(cfg, i, mem, sw) for i in layers)
        acts = act_tok * T_mb * in_flight
        recompute_one = 0.0
        if mem.recompute != Recompute.none:  # one block's activations rebuilt during its backward
            recompute_one = max(sum(b for _, b in activation_terms(cfg, i, sw).values()) for i in layers) * T_mb
        loss = loss_memory(cfg, sw, T_mb) if last else {"saved": 0.0, "peak": 0.0, "where": ""}
        gathered = dense + experts / ep  # what this rank's FSDP groups all-gather for the stage
        # Weight copies the step holds [code]: bf16 casts of the dense linears (autograd keeps them;
        # the plain loss' head too), none of the bf16 experts (bf16_grouped saves the fp32 parameter),
        # and an eager run's low-precision weight cache (kept for the whole step).
        linear = stage_linear(cfg, layers, ep)
        head = cfg.vocab_size * cfg.d_model if last and not sw.fused_loss else 0
        cache = sw.cache_bytes(linear)
        if sw.expert_weight_copies and not fsdp:  # [code] 2 B per local expert parameter, held through the step
            cache += 2.0 * linear["experts"]
        # FSDP2: two gathered blocks in bf16 (reshard after forward); under pp the stage stays gathered
        # for the step and its unsharded fp32 grads accumulate over the micro-batches (torchtitan's
        # choice for pipelines: no per-micro-batch all-gather / reduce-scatter).
        keep_gathered = fsdp and par.pp > 1
        if keep_gathered:
            compute_copies = 2.0 * gathered + 4.0 * gathered + cache
        elif fsdp:
            compute_copies = 2.0 * 2 * block_max + cache
        else:
            bf16_linear = sum(linear[k] for k in ("attention", "mlp") if not sw.low(k)) + head
            compute_copies = 2.0 * bf16_linear + cache
        ep_buf = 0.0
        if cfg.moe is not None and ep > 1:
            ep_buf = 2 * 2.0 * T_mb * cfg.moe.router.top_k * cfg.d_model  # send + receive rows, one layer
        rs_buf = 4.0 * block_max if fsdp and not keep_gathered else 0.0  # one block's fp32 unsharded grads for the reduce-scatter
        pp_buf = 2 * 4.0 * T_mb * cfg.d_model if par.pp > 1 else 0.0
        comm = ep_buf + rs_buf + pp_buf
        params_b, grads_b, optim_b = 4.0 * local, 4.0 * local, state_b * local
        if sw.expert_grads_bf16 and not fsdp:  # [code] 2 B per local expert gradient (one GPU, unsharded)
            grads_b -= 2.0 * linear["experts"]
        host_b = 0.0
        if sw.offload:  # CPUOffloadPolicy: shards, their grads and the optimizer state in host memory
            host_b = params_b + grads_b + optim_b
            params_b = grads_b = optim_b = 0.0
        # Grads exist from the first micro-batch's backward on: the later micro-batches' forwards
        # run with them allocated (zero_grad(set_to_none) frees them only after the step).
        held_grads = grads_b if m > 1 and not keep_gathered and not step_sync else 0.0
        # grad_sync=step [code]: no reduce-scatter before the last micro-batch's backward, so every
        # unit's unsharded fp32 gradient is held through the accumulation (the sharded ones come last)
        unsharded = 4.0 * gathered if step_sync else 0.0
        base = params_b + optim_b + held_grads + unsharded + compute_copies + comm
        # Peak candidates [code]: inside the loss (all activations saved), the last block's backward
        # (its grads being written, its transients, the loss' grad_W kept as the head's grad), the
        # end of backward (every grad, one recomputed block alive).
        candidates = {}
        if last:
            candidates[loss["where"]] = base + acts + loss["peak"]
        # the block's gradients as its backward writes them (kept_gathered: already in compute_copies)
        grad_block = 0.0 if sw.offload or keep_gathered else 4.0 * (block_max / par.dp_shard if fsdp else block_max)
        head_grad = 4.0 * cfg.vocab_size * cfg.d_model if last and not fsdp and not sw.offload else 0.0
        top = layers[-1]
        if sw.expert_grads_bf16 and grad_block:
            grad_block -= 2.0 * _expert_params(cfg, top) / ep  # that block's expert gradients in bf16
        candidates["last block's backward"] = base + acts + head_grad + grad_block + recompute_one + \
            block_backward_transient(cfg, top, sw, T_mb, ep)
        candidates["end of backward"] = base - held_grads - unsharded + grads_b + recompute_one
        where = max(candidates, key=candidates.get)
        peak = candidates[where]
        rows.append({"stage": s, "layers": len(layers), "params_local": local, "params_gathered": gathered,
                     "params_gib": params_b / GiB, "grads_gib": grads_b / GiB, "optimizer_gib": optim_b / GiB,
                     "compute_copies_gib": compute_copies / GiB, "activations_gib": acts / GiB,
                     "loss_gib": (loss["peak"] if where == loss["where"] else loss["saved"]) / GiB,
                     "loss_saved_gib": loss["saved"] / GiB,
                     "comm_buffers_gib": comm / GiB, "peak_gib": peak / GiB, "peak_at": where,
                     "peak_candidates_gib": {k: v / GiB for k, v in candidates.items()},
                     "host_gib": host_b / GiB, "in_flight_microbatches": in_flight, "act_bytes_per_token": act_tok})
    tight = max(rows, key=lambda r: r["peak_gib"])

    # ---- FLOPs and time --------------------------------------------------------------------------
    fpt = cfg.flops_per_token(p.seq_len)
    tokens_step = p.global_batch * p.seq_len
    flops_step = fpt * tokens_step
    bf16_flops = gpu.bf16_tflops * 1e12
    times = [stage_time(cfg, layers, sw=sw, memory=mem, gpu=gpu, seq_len=p.seq_len, tokens=T_mb, ep=ep,
                        compiled=p.compiled, microbatches=m, last=s == par.pp - 1) for s, layers in enumerate(stages)]
    t_mb, parts = max(times, key=lambda t: t[0])
    t_compute = m * t_mb
    t_pp_send = 0.0
    if par.pp > 1:
        stride = p.num_gpus // par.pp  # pp is the outermost mesh dim
        t_pp_send = m * 2 * 4.0 * T_mb * cfg.d_model / _group_bw(gpu, 2, stride)
    bubble = (par.pp - 1) / (m + par.pp - 1) if par.pp > 1 else 0.0
    t_pipe = (t_compute + t_pp_send) / (1 - bubble)
    # FSDP: all-gather bf16 params forward and backward, reduce-scatter fp32 grads, per micro-batch.
    tl = tight["params_local"]
    ag_bytes = rs_bytes = ar_bytes = 0.0
    t_fsdp = 0.0
    times_ag, times_rs = (1, 1) if par.pp > 1 else (2 * m, 1 if step_sync else m)
    if fsdp and par.dp_shard > 1:
        # bytes received per rank: the gathered stage less the local shard (dense over dp_shard,
        # experts over efsdp: the same share). Per micro-batch (gathered forward and again in backward,
        # grads reduce-scattered each micro-batch: trainer.grad_sync=micro_batch, or once with
        # grad_sync=step), or once per step under pp.
        moved = tight["params_gathered"] - tl
        ag_bytes = times_ag * 2.0 * moved
        rs_bytes = times_rs * 4.0 * moved
        t_fsdp = (ag_bytes + rs_bytes) / _group_bw(gpu, par.dp_shard, 1)
    if par.dp_replicate > 1:
        ar_bytes = 2 * 4.0 * tl * (par.dp_replicate - 1) / par.dp_replicate
    t_ar = ar_bytes / _group_bw(gpu, par.dp_replicate, par.dp_shard)
    # Offload [code bytes, assumed rates]: each unit's fp32 shard copied to the GPU for every
    # all-gather, its reduce-scattered fp32 gradient back after every reduce-scatter; AdamW on the host.
    offload_bytes = 0.0
    t_offload = 0.0
    if sw.offload:
        offload_bytes = 4.0 * tl * (times_ag + times_rs)
        t_offload = offload_bytes / (gpu.pcie_gbps * 1e9 * EFF_PCIE)
        t_opt = HOST_OPTIMIZER_BYTES[sw.state_dtype] * tl / (HOST_GBPS * 1e9)
    else:
        t_opt = OPTIMIZER_BYTES[(sw.state_dtype, sw.optimizer_kernel)] * tl / (gpu.hbm_tbps * 1e12)
    t_grad_cast = 0.0  # [code] saved by expert_grads_bf16: a negative time
    if sw.expert_grads_bf16 and cfg.moe is not None and not sw.offload:
        # each expert gradient: 2 B less read by the optimizer, and no cast pass after the wgrad GEMM
        # (read 2 + write 4 B per element; inside the fitted elementwise traffic otherwise).
        expert_local = sum(_expert_params(cfg, i) for i in range(cfg.n_layers) if cfg.is_moe_layer(i)) / par.ep / par.pp
        t_opt -= 2.0 * expert_local / (gpu.hbm_tbps * 1e12)
        t_grad_cast = -6.0 * expert_local / (gpu.hbm_tbps * 1e12)
    elif sw.bf16_experts == "cublas" and cfg.moe is not None and not sw.low("experts"):
        # [code] cuBLAS writes the fp32 weight gradients straight from its sums: no cast pass
        expert_local = sum(_expert_params(cfg, i) for i in range(cfg.n_layers) if cfg.is_moe_layer(i)) / par.ep / par.pp
        t_grad_cast = -6.0 * expert_local / (gpu.hbm_tbps * 1e12)
    exposed_fsdp = max(0.0, t_fsdp - t_compute)
    step = t_pipe + exposed_fsdp + t_ar + t_opt + t_offload + t_grad_cast
    a2a_bytes = 0.0
    if cfg.moe is not None and ep > 1:
        K = cfg.moe.router.top_k
        rows_out = T_mb * (ep - 1) if K >= ep else T_mb * K * (ep - 1) / ep
        n_moe = max(sum(1 for i in layers if cfg.is_moe_layer(i)) for layers in stages)
        a2a_bytes = m * n_moe * 4 * rows_out * cfg.d_model * 2.0
    tflops = flops_step / p.num_gpus / step / 1e12
    usable = gpu.hbm_gib - RESERVED_GIB
    time_share = {"compute": (parts["gemm"] + parts["attention"]) * m / step,
                  "hbm": (parts["hbm"] * m + (0.0 if sw.offload else t_opt)) / step,
                  "recast_quant": parts["recast_quant"] * m / step,
                  "ep_all_to_all": parts["ep_a2a"] * m / step, "pipeline_bubble": (t_pipe - t_compute - t_pp_send) / step,
                  "fsdp_exposed": exposed_fsdp / step, "dp_all_reduce": t_ar / step, "pp_send": t_pp_send / step,
                  "offload_copies": t_offload / step, "host_optimizer": (t_opt if sw.offload else 0.0) / step}
    fits = tight["peak_gib"] <= usable
    tightest = "HBM capacity" if not fits else max(time_share, key=time_share.get)
    if sw.recipe == "bf16":
        note = "measured path"
    elif sw.backend == "emulated":
        note = "emulated: bf16 GEMMs, quantization passes assumed"
    elif sw.recipe == "fp8_blockwise":
        note = "native: dense and grouped fp8 GEMMs at measured rates, quantization assumed"
    else:
        note = "native mxfp8: built, never run (no Blackwell): modelled at assumed rates"
    return {
        "model": cfg.describe(), "gpu": p.gpu, "num_gpus": p.num_gpus, "precision": sw.recipe,
        "precision_backend": sw.backend, "precision_modules": sorted(sw.low_modules), "precision_note": note,
        "compiled": p.compiled, "recompute": str(mem.recompute), "recompute_every": mem.recompute_every,
        "fused_loss": sw.fused_loss, "state_dtype": sw.state_dtype, "fsdp_offload": sw.offload,
        "layout": {"dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard, "ep": ep, "efsdp": efsdp,
                   "pp": par.pp, "pp_microbatches": m if par.pp > 1 else None},
        "seq_len": p.seq_len, "global_batch": p.global_batch, "micro_batch": micro, "grad_accum": m,
        "grad_sync": str(GradSync.step if step_sync else GradSync.micro_batch),
        "stages": rows, "tight_stage": tight["stage"], "peak_gib": tight["peak_gib"], "peak_at": tight["peak_at"],
        "usable_gib": usable, "host_gib": tight["host_gib"],
        "flops_per_token": fpt, "flops_per_step": flops_step,
        "bytes_per_step": {"ep_all_to_all": a2a_bytes, "fsdp_all_gather": ag_bytes, "fsdp_reduce_scatter": rs_bytes,
                           "dp_all_reduce": ar_bytes,
                           "pp_send": m * 2 * 4.0 * T_mb * cfg.d_model if par.pp > 1 else 0.0,
                           "offload_host_device": offload_bytes},
        "step_s": step, "microbatch_s": t_mb, "microbatch_parts_s": parts, "optimizer_s": t_opt,
        "offload_s": t_offload, "fsdp_s": t_fsdp, "bubble": bubble, "time_share": time_share,
        "tokens_per_s_per_gpu": tokens_step / step / p.num_gpus, "tflops_per_gpu": tflops,
        "mfu_bf16": tflops * 1e12 / bf16_flops,
        "overlap": "FSDP all-gather/reduce-scatter overlap compute (excess exposed); EP all-to-all, pipeline "
                   "sends, the DP all-reduce, the optimizer and fsdp_offload's host copies are not overlapped",
        "assumptions": (f"fsdp_offload: PCIe {gpu.pcie_gbps:.0f} GB/s x {EFF_PCIE}, host optimizer at "
                        f"{HOST_GBPS:.0f} GB/s" if sw.offload else ""),
        "fits": fits, "tightest": tightest,
    }


# ---- one rank's slice (tools/bench_slice.py) ------------------------------------------------------

SLICE_FREED = ("shared_mlp", "shared_swiglu", "expert_out")
"""The top block's terms already freed when its experts' backward runs: the shared expert and the
combine (which keeps y_RD) ran after the experts in forward, so their backward nodes ran first."""


SLICE_FREED_AT_GATE_UP = SLICE_FREED + ("expert_hidden", "expert_swiglu")
"""The top block's terms freed when its experts' gate|up wgrad runs: SLICE_FREED, h (the SwiGLU
backward's input) and the product (the down projection's saved input)."""


def gate_up_wgrad_transient(cfg: ModelConfig, layer: int, sw: Switches, tokens: int, local: int) -> dict[str, float]:
    """What the experts' gate|up backward of block ``layer`` holds beyond the saved activations as
    its wgrad finishes, bf16 weights (tools/bench_slice.py), by term [code, fp8_blockwise native:
    _Fp8GroupedMM.backward]: the incoming gradient dh [R, 2F] quantized along the tokens (the wgrad
    operand, FP8_SAVED), the dgrad's output dx [R, D] bf16 (computed first), the wgrad's output
    (sw.expert_wgrad per element of the ``local`` experts' [2F, D]); compiled, the gradients the
    block's backward made before (the down projection's and the shared expert's: a compiled backward
    returns all its gradients at its end; the weights quantized again for the dgrad are freed after
    it); eager, dh itself and its 1x128 rows instead (the backward's arguments and locals, alive to
    its return; the weights come from the cache). R = T*K rows; the token operand has P =
    padded_rows(R, local, 128) (the static bound of each expert's rows padded to 128s)."""
    moe = cfg.moe
    R, D, F, S = tokens * moe.router.top_k, cfg.d_model, moe.expert_hidden, moe.shared_width()
    P = padded_rows(R, local, FP8_BLOCK)
    out = {"dh_tokens": FP8_SAVED * P * 2 * F, "dx": 2.0 * R * D, "wgrad": sw.expert_wgrad() * local * 2 * F * D}
    if sw.compiled:
        out["block_grads"] = 2.0 * (local * D * F + 3 * D * S)
    else:
        out["dh_and_rows"] = (2.0 + FP8_SAVED) * R * 2 * F
    return out


def slice_layers(cfg: ModelConfig, ep: int, pp: int, layers: int, name: str = "the model") -> tuple[list[int], int]:
    """The blocks and local experts of one rank's slice as tools/bench_slice.py runs it: the first
    ``layers`` MoE blocks (one pipeline stage holds ceil(n_layers / pp)) and E/ep local experts.
    ConfigError for a dense model, an ep that does not divide E, more blocks than a stage holds."""
    if cfg.moe is None:
        raise ConfigError(f"--preset {name} is dense: the slice benchmark needs an MoE model")
    E = cfg.moe.num_experts
    if ep < 1 or E % ep:
        raise ConfigError(f"--ep {ep} must divide the {E} experts of {name}")
    if pp < 1:
        raise ConfigError(f"--pp must be positive, got {pp}")
    per_stage = -(-cfg.n_layers // pp)
    if layers < 1 or layers > per_stage:
        raise ConfigError(f"--layers {layers} exceeds one stage's {per_stage} blocks ({cfg.n_layers} layers / pp {pp})"
                          if layers > per_stage else f"--layers must be positive, got {layers}")
    moe_layers = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)][:layers]
    return moe_layers, E // ep


def slice_params(cfg: ModelConfig, layers: list[int], ep: int) -> int:
    """Parameters the slice's blocks hold: each block's attention, norms, router and shared expert,
    and E/ep of its routed experts."""
    return sum(cfg.num_block_params(i) - _expert_params(cfg, i) + _expert_params(cfg, i) // ep for i in layers)


def plan_slice(cfg: ModelConfig, layers: list[int], *, ep: int, seq_len: int, micro_batch: int = 1,
               memory: MemoryConfig | None = None, compiled: bool = True, gpu: str = "h200",
               precision: PrecisionConfig | None = None) -> dict:
    """What tools/bench_slice.py measures, planned: one micro-batch of ``micro_batch`` x ``seq_len``
    tokens forward + backward through blocks ``layers`` with E/ep local experts fed T*K rows, bf16
    (or ``precision``'s recipe: its saved GEMM inputs and quantization passes, as for a training step).

    Memory [code], as bench_slice holds it: the blocks' parameters in bf16 (as FSDP2 hands them
    over) and their bf16 gradients (every parameter requires grad; bench_slice never zeroes them, so
    they are held through each measured step and a new gradient is accumulated into them); the input
    x, its gradient, the output y and dy [T, D] bf16; the saved activations (activation_terms with
    bf16 parameters, under the recompute policy); the peak is inside the experts' backward of the
    stage's last block (the first backward): every other block's activations, that block's less
    SLICE_FREED (a fully recomputed block rebuilt, likewise), the SwiGLU-down backward's row tensors
    and the fresh bf16 w_down gradient before it is accumulated; under native fp8_blockwise experts
    the larger of that and the gate|up wgrad (gate_up_wgrad_transient: its fp32 output and bf16 cast).
    No weight copies (bf16 already) but an eager low-precision run's weight cache (Switches.weight_cache,
    never invalidated: bench_slice steps no optimizer), no optimizer state, no communication buffers, no loss.

    Time: stage_time for these blocks (no all-to-all: bench_slice does not run it; no weight recast:
    bf16 weights), no optimizer, no pipeline bubble. FLOPs: ModelConfig.block_flops_per_token, the
    count bench_slice uses."""
    mem = memory or MemoryConfig()
    cfg.validate()
    mem.validate()
    if gpu not in GPUS:
        raise ConfigError(f"--gpu {gpu!r} is not in the table: choose one of {', '.join(GPUS)}")
    if cfg.moe is None or not layers or not all(cfg.is_moe_layer(i) for i in layers):
        raise ConfigError(f"a slice is MoE blocks: {layers} are not all MoE layers of {cfg.describe()}")
    # bf16 by default, as bench_slice runs; a low-precision recipe resolved for the GPU as pretrain would
    sw = (Switches(compiled=compiled) if precision is None else
          switches(cfg, ParallelConfig(), precision, OptimizerConfig(), GPUS[gpu], compiled))
    T = micro_batch * seq_len
    D, F, L = cfg.d_model, cfg.moe.expert_hidden, cfg.moe.num_experts // ep
    n_params = slice_params(cfg, layers, ep)
    weights, grads = 2.0 * n_params, 2.0 * n_params
    io = 4 * 2.0 * T * D  # x, x.grad, y, dy
    acts = sum(block_activation_bytes(cfg, i, mem, sw, bf16_params=True) for i in layers) * T
    top = layers[-1]
    terms = activation_terms(cfg, top, sw, bf16_params=True)
    top_held = sum(b for k, (_, b) in terms.items() if k not in SLICE_FREED) * T
    top_saved = block_activation_bytes(cfg, top, mem, sw, bf16_params=True) * T
    recomputed = mem.recompute == Recompute.full and top % mem.recompute_every == 0
    # the top block's saved activations as its experts' backward runs: rebuilt when recomputed (its
    # kept input stays), else what the shared expert's and the combine's backward left
    held = acts - top_saved + top_held + (top_saved if recomputed else 0.0)
    # an eager low-precision run's weight cache: bench_slice never steps an optimizer, so it holds
    # every quantized weight of the slice from the first forward on
    cache = sw.cache_bytes(stage_linear(cfg, layers, ep))
    candidates = {f"block {top}'s experts' backward (SwiGLU-down)":
                  (held, _swiglu_backward_rows(cfg, top, T) + 2.0 * L * D * F)}
    if sw.fp8_blockwise_experts:  # its wgrad's fp32 output: the gate|up one is the larger
        top_at_gate_up = sum(b for k, (_, b) in terms.items() if k not in SLICE_FREED_AT_GATE_UP) * T
        held_gate_up = acts - top_saved + (top_saved if recomputed else top_at_gate_up)
        candidates[f"block {top}'s experts' gate|up wgrad (fp32 output)"] = \
            (held_gate_up, sum(gate_up_wgrad_transient(cfg, top, sw, T, L).values()))
    where = max(candidates, key=lambda k: sum(candidates[k]))
    held, transient = candidates[where]
    peak = weights + grads + io + cache + held + transient
    t, parts = stage_time(cfg, layers, sw=sw, memory=mem, gpu=GPUS[gpu], seq_len=seq_len, tokens=T, ep=ep,
                          compiled=compiled, all_to_all=False, fp32_master=False)
    flops = sum(cfg.block_flops_per_token(i, seq_len) for i in layers) * T
    return {"gpu": gpu, "recipe": sw.recipe, "layers": list(layers), "local_experts": L, "tokens": T,
            "rows": T * cfg.moe.router.top_k,
            "compiled": compiled, "recompute": str(mem.recompute), "recompute_every": mem.recompute_every,
            "params": n_params, "weights_gib": weights / GiB, "grads_gib": grads / GiB, "io_gib": io / GiB,
            "weight_cache_gib": cache / GiB, "activations_gib": acts / GiB, "held_at_peak_gib": held / GiB,
            "backward_transient_gib": transient / GiB, "peak_gib": peak / GiB, "peak_at": where,
            "peak_candidates_gib": {k: (weights + grads + io + cache + sum(v)) / GiB for k, v in candidates.items()},
            "flops": flops, "step_s": t, "parts_s": parts, "tflops_per_gpu": flops / t / 1e12,
            "mfu_bf16": flops / t / (GPUS[gpu].bf16_tflops * 1e12)}


def search(base: Plan, top: int = 10) -> list[dict]:
    """The fastest layouts that fit: ep, pp, dp_shard, micro-batch and recompute varied, sorted by step time."""
    out = []
    n_exp = base.model.moe.num_experts if base.model.moe else 1
    divisors = [d for d in range(1, base.num_gpus + 1) if base.num_gpus % d == 0]
    for pp, ep in itertools.product(divisors, divisors):
        if pp > base.model.n_layers or n_exp % ep or (base.model.moe is None and ep > 1):
            continue
        for recompute in (Recompute.none, Recompute.full):
            for micro in (1, 2, 4, 8):
                par = dataclasses.replace(base.parallel, dp_replicate=1, dp_shard=-1, ep=ep, pp=pp,
                                          pp_microbatches=None)
                candidate = dataclasses.replace(base, parallel=par, micro_batch=None if pp > 1 else micro,
                                                memory=MemoryConfig(recompute=recompute))
                if pp > 1:
                    dp = base.num_gpus // pp
                    if base.global_batch % (dp * micro):
                        continue
                    par.pp_microbatches = base.global_batch // dp // micro
                try:
                    r = plan(candidate)
                except ConfigError:
                    continue
                if r["fits"]:
                    out.append(r)
    out.sort(key=lambda r: r["step_s"])
    return out[:top]
