#!/usr/bin/env python
"""Plan a run before launching it: memory per rank, communication, step time and TFLOP/s per GPU.

Prints a table and writes JSON. Everything is computed from the configs (nothing is built):
parameters from ModelConfig.num_params / num_block_params, FLOPs from ModelConfig.flops_per_token,
the layout from ParallelConfig.resolve (the same ConfigError as pretrain for a bad layout). The
switches are read from the same config fields pretrain takes: --model.fused_loss,
--model.loss_chunk_tokens, --optimizer.state_dtype, --parallel.fsdp_offload, --precision.recipe /
.backend / .modules (--precision NAME is short for --precision.recipe=NAME; fp8 = mxfp8), --memory.*.

    python tools/plan.py --preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 \
        --seq-len 4096 --global-batch 4 --gpu h200 --num-gpus 1 --compile
    python tools/plan.py --preset moe-1t --gpu b300 --num-gpus 512 --parallel.ep=8 --parallel.pp=8 \
        --seq-len 8192 --global-batch 8192 --micro-batch 1 --precision.recipe=mxfp8 --memory.recompute=full
    python tools/plan.py --preset moe-1t --gpu h200 --num-gpus 512 --seq-len 8192 --global-batch 8192 --search
    python tools/plan.py --validate runs/bench/bench_train.json runs/bench/bench_memory.json
    python tools/plan.py --slice --layers 2 --preset moe-1t --parallel.ep=8 --parallel.pp=8 --seq-len 8192 \
        --gpu h200 --eager --memory.recompute=full

--slice: what tools/bench_slice.py measures (one rank's --layers MoE blocks with E/ep local
experts, one micro-batch, bf16 weights and grads, forward + backward; no all-to-all, optimizer or
bubble), planned from the same model: see plan_slice.

--validate FILE.json ...: for every row of tools/bench_train.py / tools/bench_memory.py reports (the
preset, the command's base overrides and the row's overrides, on --gpu h200 --num-gpus 1), the
measured against the planned peak and step time (targets: peak within 10%, step within 20%).

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
  measured ~1000-1160 TFLOP/s (1080 of the fp8 peak) and grouped experts at the Triton kernel's
  measured 441 TFLOP/s; mxfp8 native (SM100+) is built but has never run (no Blackwell here): modelled
  at the fp8 rates [assumed].
- the fused loss vs the plain one: memory from the code; their time is not told apart (the same
  GEMM FLOPs, about the same elementwise bytes per logit) [assumed].
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import shlex
import sys

from moetron.core.config import ConfigError
from moetron.core.layers.loss import default_chunk_tokens
from moetron.core.memory import MemoryConfig, Recompute
from moetron.core.optim import OptimizerConfig, StateDtype
from moetron.core.precision import PrecisionBackend, PrecisionConfig, PrecisionRecipe
from moetron.models import ModelConfig
from moetron.parallel.config import ParallelConfig
from moetron.parallel.pipeline.runtime import n_microbatches
from moetron.run import PretrainConfig, check_layout

from cli import run_cli, write_report  # tools/cli.py

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class GPU:
    hbm_gib: float
    """Memory the device reports (about the datasheet's GB)."""
    hbm_tbps: float
    """HBM bandwidth, TB/s."""
    bf16_tflops: float
    """Dense (no sparsity) bf16 tensor-core TFLOP/s."""
    fp8_tflops: float
    """Dense fp8 tensor-core TFLOP/s."""
    nvlink_gbps: float
    """NVLink GB/s per GPU, one direction."""
    internode_gbps: float
    """Scale-out network GB/s per GPU, one direction (one NIC per GPU)."""
    sm: int = 9
    """Compute capability major (9 Hopper, 10 Blackwell): which precision recipes run natively."""
    pcie_gbps: float = 64.0
    """Host link GB/s per GPU, one direction (PCIe Gen5 x16: 64; Gen6 x16: 128)."""


# Sources: NVIDIA datasheets; the datasheets quote sparse tensor FLOP/s, halved here to dense.
GPUS: dict[str, GPU] = {
    # H100 SXM5 datasheet: 80 GB HBM3 (nvidia-smi 81,559 MiB = 79.6 GiB), 3.35 TB/s, bf16 1,979 /
    # fp8 3,958 TFLOP/s sparse, NVLink 900 GB/s (bidirectional); DGX H100: ConnectX-7 400 Gb/s per GPU;
    # PCIe Gen5 x16 host link.
    "h100": GPU(79.6, 3.35, 989.0, 1979.0, 450.0, 50.0, sm=9, pcie_gbps=64.0),
    # H200 SXM datasheet: 141 GB HBM3e (nvidia-smi 143,771 MiB = 140.4 GiB, docs/performance.md),
    # 4.8 TB/s, bf16 1,979 / fp8 3,958 sparse, NVLink 900 GB/s; ConnectX-7 400 Gb/s per GPU; PCIe Gen5 x16.
    "h200": GPU(140.4, 4.8, 989.0, 1979.0, 450.0, 50.0, sm=9, pcie_gbps=64.0),
    # HGX B200 datasheet (8 GPUs): 1,440 GB HBM3e, 64 TB/s, BF16 36 PF / FP8 72 PF sparse, NVLink 5
    # 1.8 TB/s per GPU (bidirectional); DGX B200: ConnectX-7 400 Gb/s per GPU; PCIe Gen5 x16.
    "b200": GPU(180.0, 8.0, 2250.0, 4500.0, 900.0, 50.0, sm=10, pcie_gbps=64.0),
    # HGX B300 datasheet (8 GPUs): 2.3 TB HBM3e (288 GB each), 64 TB/s, BF16 36 PF / FP8 72 PF
    # sparse, NVLink 5 1.8 TB/s per GPU; ConnectX-8 SuperNIC 800 Gb/s per GPU; PCIe Gen6 x16.
    "b300": GPU(288.0, 8.0, 2250.0, 4500.0, 900.0, 100.0, sm=10, pcie_gbps=128.0),
}
GPUS_PER_NODE = 8
RESERVED_GIB = 3.0
"""Not for tensors: CUDA context, NCCL buffers, allocator fragmentation (a rank 'fits' below HBM - this)."""

# ---- efficiency constants (docs/performance.md "planner vs measurement" says which rows fixed them) --
EFF_GEMM = 800 / 989
"""Dense linears: a plain bf16 GEMM measures about 800 TFLOP/s on the H200 (docs/performance.md)."""
EFF_EXPERT = 0.47
"""Routed-expert grouped GEMMs: 463-472 TFLOP/s of 989 (tools/bench_moe.py rows, both shapes)."""
EFF_FP8_GEMM = 1080 / 1979
"""Dense fp8 blockwise GEMMs (F.scaled_mm BlockWise1x128 / 128x128): 1000-1160 TFLOP/s measured on
the H200 (this session's fp8 GEMM measurement), 1080 of the 1979 fp8 peak. Used for every native fp8 recipe."""
EFF_FP8_EXPERT = 441 / 1979
"""Grouped fp8 expert GEMMs (core/precision/fp8_triton.py): 441 TFLOP/s fwd+bwd measured on the
H200 at bench_gemm_fp8's wider olmo3-moe-3.2b shape (322 at the olmoe shape), activation
quantization included (so the planner's separate quantization term counts it a second time)."""
EFF_ATTN = 0.70
"""Attention scores as counted (12 x width x context, no causal halving): flash kernels do half of it
at about 35% of peak. Assumed, not measured."""
EFF_COMM = 0.73
"""Achieved / link bandwidth of NCCL collectives at large sizes: 330 of 450 GB/s (2 x H200, docs)."""
EFF_PCIE = 0.8
"""Achieved / link bandwidth of pinned host<->device copies (about 51 of 64 GB/s on PCIe Gen5). Assumed."""
HOST_GBPS = 50.0
"""Host memory bandwidth the CPU optimizer step achieves (torch's AdamW on CPU tensors). Assumed."""
HBM_TRAFFIC = {"eager": 18.0, "compiled": 7.5}
"""Elementwise HBM bytes moved per step / reference saved-activation bytes (reference_activation_bytes:
the eager count of the code these were fitted on): fitted to the two OLMoE-8L recompute=none rows
(compiled and eager) before this session's memory switches; every other row is a check."""
OPTIMIZER_BYTES = {("fp32", "triton"): 32.0, ("bf16", "triton"): 24.0,
                   ("fp32", "torch"): 32.0 * 1.2, ("bf16", "torch"): 112.0}
"""HBM bytes per local parameter per optimizer step, counted from the code, by (state_dtype, kernel):
the Triton AdamW (optimizer.impl auto on GPUs, core/adamw_triton.py: reads p, g, m, v, writes p, m, v:
28 fp32, 20 bf16; measured at 1.03x that floor on one H200) + the grad-norm pass (4); torch's fused
AdamW (impl=torch, fp32: the same 28 + 4, measured at 1.24x its floor, hence x 1.2); core/adamw.py's
foreach ops (impl=torch, bf16: upcast m and v to fp32, decay, lerp, mul, addcmul, write back, sqrt,
div, add, addcdiv: 108) + 4."""
RECOMPUTE_FORWARD = {"eager": 1.0 / 3.0, "compiled": 0.65}
"""Extra step time of a fully recomputed block, as a share of its forward + backward: eager = the
one extra forward (1/3, counted); compiled = 0.65, fitted to the OLMoE-8L compiled full-recompute row
of 2026-12-01 (compiled blocks recompute slower than they first ran; not understood); the every-2nd
and olmoe3 rows check it."""
HOST_OPTIMIZER_BYTES = {"fp32": 88.0, "bf16": 112.0}
"""Host bytes per parameter of the CPU optimizer step under fsdp_offload (torch's AdamW on CPU runs
op by op: no fused kernel): counted from its ops as above."""
QUANT_BYTES = {"emulated": 32.0, "native": 24.0}
"""HBM bytes per element of a low-precision GEMM's input plus output, per training step of a token:
the forward quantizes x along its reduction dim and again along the tokens (saved), the backward dy
along O and along the tokens, and the emulated backend dequantizes each into bf16. Unfused torch
ops with fp32 intermediates (no fused quantize kernels yet): assumed, not measured."""
WEIGHT_QUANT_BYTES = {"emulated": 16.0, "native": 7.0}
"""HBM bytes per low-precision weight element per quantization (emulated mxfp8: two bf16 dequantized
orientations; native: fp8 w and w^T): once per step in eager (the weight cache), twice per
micro-batch compiled (the cache is bypassed inside a traced graph). Assumed."""
FP8_SAVED = 1 + 1 / 32
"""Bytes per element of a GEMM input saved as fp8: MXFP8 (an E8M0 per 32) and 1x128 blockwise (an
fp32 per 128) both come to 1 + 1/32."""
LOW_PRECISION = (PrecisionRecipe.mxfp8, PrecisionRecipe.fp8_blockwise)


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
    optimizer_kernel: str = "triton"
    """The optimizer step's kernel on GPUs: triton (optimizer.impl auto or triton) or torch (impl=torch)."""
    offload: bool = False

    def low(self, module: str) -> bool:
        return self.recipe != "bf16" and module in self.low_modules

    def saved_input(self, module: str) -> float:
        """Bytes per element of a GEMM input saved for the wgrad: fp8 + scales or bf16."""
        return FP8_SAVED if self.low(module) else 2.0

    def weight_cache(self, module: str) -> float:
        """Bytes per weight element the low-precision weight cache holds through an eager step
        (core.precision.cache: bf16 dequantized copies along I and O for emulated mxfp8, one for
        emulated blockwise; fp8 w and w^T native); 0 compiled (the cache is bypassed in a traced graph)."""
        if not self.low(module) or self.compiled:
            return 0.0
        if self.backend == "emulated":
            return 4.0 if self.recipe == "mxfp8" else 2.0
        return 2.0


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
    return Switches(compiled=compiled, fused_loss=model.fused_loss,
                    loss_chunk_tokens=model.loss_chunk_tokens or default_chunk_tokens(model.vocab_size),
                    recipe=str(recipe), backend=str(backend) if recipe in LOW_PRECISION else "native",
                    low_modules=frozenset(str(m) for m in precision.modules) if recipe in LOW_PRECISION else frozenset(),
                    state_dtype=str(optimizer.state_dtype),
                    expert_weight_copies=str(precision.expert_weight_copies) != "none" and recipe == PrecisionRecipe.bf16,
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
        return _swiglu_backward_rows(cfg, layer, tokens) + recast
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
        return gpu.fp8_tflops * 1e12 * (EFF_FP8_EXPERT if grouped else EFF_FP8_GEMM)
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
    t_gemm = T_mb * extra * (other_f / (bf16_flops * EFF_GEMM)
                             + by_module["attention"] / gemm_rate(gpu, sw, "attention", False)
                             + by_module["mlp"] / gemm_rate(gpu, sw, "mlp", False)
                             + by_module["experts"] / gemm_rate(gpu, sw, "experts", True))
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
                    quant += qb * el[k] * T_mb * extra
                    weights = wl[k] / (ep if k == "experts" else 1)
                    quant += wb * weights * ((2 * extra) if compiled else 1 / m)  # the cache: once per step
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
        linear = {k: sum(_linear_params(cfg, i)[k] for i in layers) for k in modules}
        linear["experts"] /= ep
        head = cfg.vocab_size * cfg.d_model if last and not sw.fused_loss else 0
        cache = sum(sw.weight_cache(k) * linear[k] for k in modules)
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
        host_b = 0.0
        if sw.offload:  # CPUOffloadPolicy: shards, their grads and the optimizer state in host memory
            host_b = params_b + grads_b + optim_b
            params_b = grads_b = optim_b = 0.0
        # Grads exist from the first micro-batch's backward on: the later micro-batches' forwards
        # run with them allocated (zero_grad(set_to_none) frees them only after the step).
        held_grads = grads_b if m > 1 and not keep_gathered else 0.0
        base = params_b + optim_b + held_grads + compute_copies + comm
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
        candidates["last block's backward"] = base + acts + head_grad + grad_block + recompute_one + \
            block_backward_transient(cfg, top, sw, T_mb, ep)
        candidates["end of backward"] = base - held_grads + grads_b + recompute_one
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
    times_ag, times_rs = (1, 1) if par.pp > 1 else (2 * m, m)
    if fsdp and par.dp_shard > 1:
        # bytes received per rank: the gathered stage less the local shard (dense over dp_shard,
        # experts over efsdp: the same share). Per micro-batch (gathered forward and again in backward,
        # grads reduce-scattered each micro-batch: trainer.grad_sync=micro_batch), or once per step under pp.
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
    exposed_fsdp = max(0.0, t_fsdp - t_compute)
    step = t_pipe + exposed_fsdp + t_ar + t_opt + t_offload
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
    and the fresh bf16 w_down gradient before it is accumulated. No weight copies (bf16 already),
    no optimizer state, no communication buffers, no loss.

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
    transient = _swiglu_backward_rows(cfg, top, T) + 2.0 * L * D * F
    peak = weights + grads + io + held + transient
    t, parts = stage_time(cfg, layers, sw=sw, memory=mem, gpu=GPUS[gpu], seq_len=seq_len, tokens=T, ep=ep,
                          compiled=compiled, all_to_all=False, fp32_master=False)
    flops = sum(cfg.block_flops_per_token(i, seq_len) for i in layers) * T
    return {"gpu": gpu, "recipe": sw.recipe, "layers": list(layers), "local_experts": L, "tokens": T,
            "rows": T * cfg.moe.router.top_k,
            "compiled": compiled, "recompute": str(mem.recompute), "recompute_every": mem.recompute_every,
            "params": n_params, "weights_gib": weights / GiB, "grads_gib": grads / GiB, "io_gib": io / GiB,
            "activations_gib": acts / GiB, "held_at_peak_gib": held / GiB, "backward_transient_gib": transient / GiB,
            "peak_gib": peak / GiB, "peak_at": f"block {top}'s experts' backward (SwiGLU-down)",
            "flops": flops, "step_s": t, "parts_s": parts, "tflops_per_gpu": flops / t / 1e12,
            "mfu_bf16": flops / t / (GPUS[gpu].bf16_tflops * 1e12)}


def print_slice(r: dict, cfg: ModelConfig) -> None:
    print(f"slice of {cfg.describe()} | {r['gpu']} | {r['recipe']} | {'compiled' if r['compiled'] else 'eager'} | "
          f"recompute {r['recompute']} | blocks {r['layers']}, {r['local_experts']} local experts, "
          f"{r['tokens']} tokens ({r['rows']} expert rows)")
    print(f"memory, GiB: weights {r['weights_gib']:.2f} (bf16, {r['params'] / 1e9:.3f}B params) + grads "
          f"{r['grads_gib']:.2f} (bf16) + x/dx/y/dy {r['io_gib']:.2f} + activations held {r['held_at_peak_gib']:.2f} "
          f"(all saved {r['activations_gib']:.2f}) + backward transient {r['backward_transient_gib']:.2f} "
          f"= peak {r['peak_gib']:.2f} (at {r['peak_at']})")
    print(f"step {1e3 * r['step_s']:.1f} ms (" + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r["parts_s"].items())
          + f") | {r['tflops_per_gpu']:.1f} TFLOP/s/GPU | MFU(bf16) {100 * r['mfu_bf16']:.1f}% | "
          "no all-to-all, no optimizer, no bubble")


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


def _row(r: dict) -> str:
    lay = r["layout"]
    return (f"ep {lay['ep']:>3} pp {lay['pp']:>3} dp_shard {lay['dp_shard']:>4} mb {r['micro_batch']:>2} "
            f"acc {r['grad_accum']:>4} {r['recompute']:<5} | peak {r['peak_gib']:7.1f} GiB | step {r['step_s']:8.3f} s | "
            f"{r['tflops_per_gpu']:6.1f} TFLOP/s/GPU | {'fits' if r['fits'] else 'DOES NOT FIT'}; "
            f"limit: {r['tightest']}")


def print_plan(r: dict) -> None:
    lay = r["layout"]
    print(f"{r['model']} | {r['num_gpus']} x {r['gpu']} | {r['precision']} ({r['precision_note']}) | "
          f"{'compiled' if r['compiled'] else 'eager'} | recompute {r['recompute']} | "
          f"{'fused' if r['fused_loss'] else 'plain'} loss | Adam state {r['state_dtype']}"
          f"{' | fsdp_offload' if r['fsdp_offload'] else ''}")
    print(f"layout dp_replicate {lay['dp_replicate']} x dp_shard {lay['dp_shard']} (ep {lay['ep']} x efsdp "
          f"{lay['efsdp']}) x pp {lay['pp']} | seq {r['seq_len']} x {r['global_batch']} | micro-batch "
          f"{r['micro_batch']} x {r['grad_accum']}")
    s = r["stages"][r["tight_stage"]]
    print(f"memory per rank (stage {s['stage']}, {s['layers']} blocks), GiB:")
    for key in ("params", "grads", "optimizer", "compute_copies", "activations", "loss", "comm_buffers", "peak"):
        print(f"  {key:<16} {s[key + '_gib']:9.2f}" + (f"   (at {s['peak_at']})" if key == "peak" else ""))
    if r["fsdp_offload"]:
        print(f"  {'host (offload)':<16} {s['host_gib']:9.2f}   params + grads + optimizer state in host memory")
    print(f"  {'usable':<16} {r['usable_gib']:9.2f}   -> {'fits' if r['fits'] else 'DOES NOT FIT'}")
    print(f"FLOPs/step {r['flops_per_step']:.4g}  ({r['flops_per_token']:.4g} per token)")
    print("bytes/step per rank: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in r["bytes_per_step"].items()))
    print(f"step {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU | "
          f"{r['tflops_per_gpu']:.1f} TFLOP/s/GPU | MFU(bf16) {100 * r['mfu_bf16']:.1f}% | bubble {100 * r['bubble']:.1f}%")
    print("time shares: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in r["time_share"].items()))
    print(f"overlap: {r['overlap']}")
    if r["assumptions"]:
        print(f"assumed: {r['assumptions']}")
    print(f"tightest resource: {r['tightest']}")




SECTIONS = ("model", "parallel", "memory", "optimizer", "precision")
"""Config sections a plan takes --<section>.field=value overrides for (pretrain's names)."""
PRECISION_FLAG = {"fp8": "mxfp8"}
"""--precision NAME is --precision.recipe=NAME; fp8 (the planner's older name) means mxfp8."""


@dataclasses.dataclass
class Configs:
    """The config sections of one plan, before overrides."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)

    def apply(self, overrides: list[str]) -> None:
        """--<section>.field=value overrides onto the sections (ConfigError for anything else)."""
        bad = [a for a in overrides if not (a.startswith(tuple(f"--{s}." for s in SECTIONS)) and "=" in a)]
        if bad:
            raise ConfigError(f"unrecognized arguments {bad}: overrides are "
                              f"{', '.join(f'--{s}.*' for s in SECTIONS)} =value")
        for name in SECTIONS:
            prefix = f"--{name}."
            getattr(self, name).apply_overrides([a[len(prefix):] for a in overrides if a.startswith(prefix)])


def parse(argv: list[str]) -> tuple[Plan, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", default=None, help="model preset (see models/config.py PRESETS)")
    parser.add_argument("--config", default=None,
                        help="a run YAML (model, parallel, memory, optimizer, precision sections are read)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch per rank")
    parser.add_argument("--precision", default=None, choices=("auto", "bf16", "mxfp8", "fp8_blockwise", "fp8"),
                        help="short for --precision.recipe (fp8 = mxfp8); default bf16")
    parser.add_argument("--eager", action="store_true", help="no torch.compile (default: compiled blocks)")
    parser.add_argument("--compile", action="store_true", help="compiled blocks (the default)")
    parser.add_argument("--gpu", default="h200", choices=tuple(GPUS))
    parser.add_argument("--num-gpus", type=int, default=1)
    parser.add_argument("--search", action="store_true", help="list the fastest layouts that fit")
    parser.add_argument("--slice", action="store_true",
                        help="plan tools/bench_slice.py's slice: --layers MoE blocks of one stage under "
                             "--parallel.ep / --parallel.pp, one micro-batch (--micro-batch, default 1) on one GPU")
    parser.add_argument("--layers", type=int, default=2, help="--slice: MoE blocks of the stage (bench_slice's --layers)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--validate", nargs="+", default=None, metavar="FILE.json",
                        help="planned vs measured for every row of bench_train / bench_memory reports")
    parser.add_argument("--json", default="runs/plan/plan.json")
    args, rest = parser.parse_known_args(argv)
    configs = Configs(precision=PrecisionConfig(recipe=PrecisionRecipe.bf16))
    seq, batch, micro = 4096, 4, None
    if args.config:
        import yaml

        with open(args.config, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        configs = Configs(**{name: type(getattr(configs, name)).from_dict(raw.get(name, {}), prefix=name)
                             for name in SECTIONS})
        if "precision" not in raw:
            configs.precision.recipe = PrecisionRecipe.bf16
        seq = raw.get("data", {}).get("seq_len", seq)
        batch = raw.get("data", {}).get("global_batch_size", batch)
        micro = raw.get("trainer", {}).get("micro_batch_size", micro)
    if args.preset:
        configs.model = ModelConfig.preset(args.preset)
    if args.precision:
        configs.precision.recipe = PrecisionRecipe(PRECISION_FLAG.get(args.precision, args.precision))
    configs.apply(rest)
    p = Plan(model=configs.model, parallel=configs.parallel, memory=configs.memory, seq_len=args.seq_len or seq,
             global_batch=args.global_batch or batch, micro_batch=args.micro_batch or micro,
             precision=configs.precision, optimizer=configs.optimizer, compiled=not args.eager, gpu=args.gpu,
             num_gpus=args.num_gpus)
    return p, args


# ---- --validate: planned against measured ---------------------------------------------------------

PEAK_TARGET, STEP_TARGET = 0.10, 0.20
"""Planned within 10% of the measured peak and 20% of the measured step time (the 1.2T recipe issue)."""


def _bench_argv(env: dict) -> list[str]:
    """The benchmark's own arguments from its report's env (``command``: 'python tools/bench_x.py ...',
    or torchrun's shape; ``argv`` where a report has it)."""
    if isinstance(env.get("argv"), list):
        return [str(a) for a in env["argv"]]
    words = shlex.split(env.get("command", ""))
    for i, w in enumerate(words):
        if w.endswith(".py"):
            return words[i + 1:]
    return []


def bench_plan(env: dict, row: dict) -> Plan:
    """The Plan of one benchmark row on one H200: the preset, the command's base overrides, the
    row's overrides, its seq_len / batch / micro-batch / precision / compile flags."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    parser.add_argument("--preset", default=env.get("preset", "tiny"))
    parser.add_argument("--seq-len", type=int, default=env.get("seq_len", 4096))
    parser.add_argument("--batch", type=int, default=env.get("batch", 2))
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--compile", action="store_true", default=bool(env.get("compile", False)))
    parser.add_argument("--variant", action="append", default=[])
    for flag in ("--steps", "--warmup", "--json", "--peak-tflops", "--top"):
        parser.add_argument(flag)
    parser.add_argument("--real-text", action="store_true")
    args, overrides = parser.parse_known_args(_bench_argv(env))
    configs = Configs(model=ModelConfig.preset(args.preset),
                      precision=PrecisionConfig(recipe=PrecisionRecipe(PRECISION_FLAG.get(args.precision, args.precision))))
    configs.apply([o for o in overrides if o.startswith("--")] + list(row.get("overrides", [])))
    return Plan(model=configs.model, parallel=configs.parallel, memory=configs.memory, seq_len=args.seq_len,
                global_batch=args.batch, micro_batch=args.micro_batch, precision=configs.precision,
                optimizer=configs.optimizer, compiled=args.compile, gpu="h200", num_gpus=1)


def _error(planned: float, measured: float | None) -> float | None:
    return None if not measured else planned / measured - 1


def validate(paths: list[str]) -> list[dict]:
    """One row per benchmark row of the reports at ``paths``: measured and planned peak GiB and step ms,
    errors (planned / measured - 1) and whether each target is met."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        env = report.get("env", {})
        for row in report.get("rows", []):
            r = plan(bench_plan(env, row))
            if row.get("peak_mem_gib") is not None:
                peak = float(row["peak_mem_gib"])
            elif row.get("peak_bytes") is not None:
                peak = row["peak_bytes"] / GiB
            else:
                peak = None
            step_ms = 1e3 * row["step_s"] if row.get("step_s") else None
            peak_err, step_err = _error(r["peak_gib"], peak), _error(1e3 * r["step_s"], step_ms)
            out.append({"file": path, "variant": row.get("variant", ""), "overrides": row.get("overrides", []),
                        "compiled": r["compiled"], "measured_peak_gib": peak, "planned_peak_gib": r["peak_gib"],
                        "peak_error": peak_err, "planned_peak_at": r["peak_at"], "measured_step_ms": step_ms,
                        "planned_step_ms": 1e3 * r["step_s"], "step_error": step_err,
                        "peak_met": None if peak_err is None else abs(peak_err) <= PEAK_TARGET,
                        "step_met": None if step_err is None else abs(step_err) <= STEP_TARGET})
    return out


def print_validation(rows: list[dict]) -> None:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    def met(x):
        return "-" if x is None else ("met" if x else "missed")

    print(f"{'row':<28} {'peak GiB':>9} {'planned':>8} {'error':>7} {'step ms':>9} {'planned':>8} {'error':>7}  "
          f"target (peak 10% / step 20%)")
    for r in rows:
        name = f"{r['variant']} ({'compiled' if r['compiled'] else 'eager'})"
        print(f"{name:<28} {num(r['measured_peak_gib'], '9.2f')} {r['planned_peak_gib']:8.2f} "
              f"{num(None if r['peak_error'] is None else 100 * r['peak_error'], '+6.1f')}% "
              f"{num(r['measured_step_ms'], '9.1f')} {r['planned_step_ms']:8.1f} "
              f"{num(None if r['step_error'] is None else 100 * r['step_error'], '+6.1f')}%  "
              f"{met(r['peak_met'])} / {met(r['step_met'])}")
    both = [r for r in rows if r["peak_met"] is not None and r["step_met"] is not None]
    print(f"{sum(r['peak_met'] and r['step_met'] for r in both)} of {len(both)} rows meet both targets")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p, args = parse(argv)
    env = {"tool": "tools/plan.py", "argv": argv}
    if args.validate:
        rows = validate(args.validate)
        print_validation(rows)
    elif args.slice:
        layers, _ = slice_layers(p.model, p.parallel.ep, p.parallel.pp, args.layers, args.preset or "the model")
        rows = [plan_slice(p.model, layers, ep=p.parallel.ep, seq_len=p.seq_len, micro_batch=p.micro_batch or 1,
                           memory=p.memory, compiled=p.compiled, gpu=p.gpu, precision=p.precision)]
        print_slice(rows[0], p.model)
    elif args.search:
        rows = search(p, args.top)
        print(f"fastest layouts that fit {p.num_gpus} x {p.gpu}, {p.model.describe()}, seq {p.seq_len} x "
              f"{p.global_batch}, {p.precision.recipe}:")
        for r in rows:
            print("  " + _row(r))
        if not rows:
            print("  none fits")
    else:
        rows = [plan(p)]
        print_plan(rows[0])
    write_report(args.json, env, rows)
    return 0


if __name__ == "__main__":
    run_cli(main)
