#!/usr/bin/env python
"""Plan a run before launching it: memory per rank, communication, step time and TFLOP/s per GPU.

Prints a table and writes JSON. Everything is computed from the configs (nothing is built):
parameters from ModelConfig.num_params / num_block_params, FLOPs from ModelConfig.flops_per_token,
the layout from ParallelConfig.resolve (the same ConfigError as pretrain for a bad layout).

    python tools/plan.py --preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 \
        --seq-len 4096 --global-batch 4 --gpu h200 --num-gpus 1 --compile
    python tools/plan.py --preset moe-1t --gpu b300 --num-gpus 512 --parallel.ep=8 --parallel.pp=8 \
        --seq-len 8192 --global-batch 8192 --micro-batch 1 --precision fp8 --memory.recompute=full
    python tools/plan.py --preset moe-1t --gpu h200 --num-gpus 512 --seq-len 8192 --global-batch 8192 --search

The model in one paragraph (docs/performance.md "planner vs measurement" checks it):
- memory per rank = fp32 master params + fp32 grads + 2 fp32 Adam moments, FSDP2-sharded over
  dp_shard (experts: over ep x efsdp, the same dp_shard ranks), of the tightest pipeline stage;
  + bf16 compute copies of weights (all of them on one rank without FSDP, where autocast caches
  them; two gathered blocks under FSDP2) + saved activations (bytes per token per layer counted
  from the layer shapes, below) for the micro-batches in flight + the loss's logits buffers +
  transient communication buffers;
- step time = GEMM FLOPs / (peak x GEMM efficiency) + attention FLOPs / (peak x attention
  efficiency) + elementwise HBM traffic + optimizer HBM traffic + exposed communication, the whole
  stretched by the 1F1B bubble (p-1)/(m+p-1). FSDP all-gathers / reduce-scatters are assumed to
  overlap compute (only the excess is exposed); EP all-to-alls and pipeline sends are not.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import math
import sys

from moetron.core.config import ConfigError
from moetron.core.memory import MemoryConfig, Recompute
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


# Sources: NVIDIA datasheets; the datasheets quote sparse tensor FLOP/s, halved here to dense.
GPUS: dict[str, GPU] = {
    # H100 SXM5 datasheet: 80 GB HBM3 (nvidia-smi 81,559 MiB = 79.6 GiB), 3.35 TB/s, bf16 1,979 /
    # fp8 3,958 TFLOP/s sparse, NVLink 900 GB/s (bidirectional); DGX H100: ConnectX-7 400 Gb/s per GPU.
    "h100": GPU(79.6, 3.35, 989.0, 1979.0, 450.0, 50.0),
    # H200 SXM datasheet: 141 GB HBM3e (nvidia-smi 143,771 MiB = 140.4 GiB, docs/performance.md),
    # 4.8 TB/s, bf16 1,979 / fp8 3,958 sparse, NVLink 900 GB/s; ConnectX-7 400 Gb/s per GPU.
    "h200": GPU(140.4, 4.8, 989.0, 1979.0, 450.0, 50.0),
    # HGX B200 datasheet (8 GPUs): 1,440 GB HBM3e, 64 TB/s, BF16 36 PF / FP8 72 PF sparse, NVLink 5
    # 1.8 TB/s per GPU (bidirectional); DGX B200: ConnectX-7 400 Gb/s per GPU.
    "b200": GPU(180.0, 8.0, 2250.0, 4500.0, 900.0, 50.0),
    # HGX B300 datasheet (8 GPUs): 2.3 TB HBM3e (288 GB each), 64 TB/s, BF16 36 PF / FP8 72 PF
    # sparse, NVLink 5 1.8 TB/s per GPU; ConnectX-8 SuperNIC 800 Gb/s per GPU.
    "b300": GPU(288.0, 8.0, 2250.0, 4500.0, 900.0, 100.0),
}
GPUS_PER_NODE = 8
RESERVED_GIB = 3.0
"""Not for tensors: CUDA context, NCCL buffers, allocator fragmentation (a rank 'fits' below HBM - this)."""

# ---- efficiency constants (docs/performance.md "planner vs measurement" says which rows fixed them) --
EFF_GEMM = 800 / 989
"""Dense linears: a plain bf16 GEMM measures about 800 TFLOP/s on the H200 (docs/performance.md)."""
EFF_EXPERT = 0.47
"""Routed-expert grouped GEMMs: 463-472 TFLOP/s of 989 (tools/bench_moe.py rows, both shapes)."""
EFF_ATTN = 0.70
"""Attention scores as counted (12 x width x context, no causal halving): flash kernels do half of it
at about 35% of peak. Assumed, not measured."""
EFF_COMM = 0.73
"""Achieved / link bandwidth of NCCL collectives at large sizes: 330 of 450 GB/s (2 x H200, docs)."""
HBM_TRAFFIC = {"eager": 18.0, "compiled": 7.5}
"""Elementwise HBM bytes moved per step / saved-activation bytes (eager count): fitted to the two
OLMoE-8L recompute=none rows (compiled and eager); every other row is a check."""
COMPILED_ACTIVATIONS = 0.74
"""Saved activations under torch.compile / the eager count: fitted to OLMoE-8L compiled none."""
OPTIMIZER_BYTES = 32
"""Per local parameter per step: fused AdamW reads p, g, m, v and writes p, m, v (28) + grad-norm clip (4)."""


def _fp8_gemm_input(precision: str) -> float:
    """Bytes per element of a saved GEMM input: bf16, or MXFP8 (1 byte + one E8M0 scale per 32)."""
    return 1 + 1 / 32 if precision == "fp8" else 2.0


def activation_terms(cfg: ModelConfig, layer: int, precision: str = "bf16") -> dict[str, tuple[str, float]]:
    """Saved-for-backward bytes per token of one block in eager bf16 autocast, by term:
    {name: (module it belongs to for selective recompute, bytes)}.

    Counted from the code: the residual stream is fp32; RMSNorm keeps its fp32 input and normalized
    output; each linear keeps its bf16-cast input (q, k, v cast separately); SDPA keeps q, k, v, out;
    SwiGLU keeps gate, up, silu(gate) and the product; the MoE layer keeps the T*K dispatched rows
    (x_RD), the experts' hidden and their outputs y_RD for the weighted combine.
    """
    D = cfg.d_model
    att = cfg.attention
    A = att.n_heads * att.head_width(D)
    G = att.kv_heads() * att.head_width(D)
    g = _fp8_gemm_input(precision)
    terms: dict[str, tuple[str, float]] = {}
    pre = str(cfg.block_type) == "pre_norm"
    # attention sublayer
    terms["attn_norm"] = ("norm", 8.0 * D if pre else 8.0 * D)  # pre: fp32 input + out; reordered: fp32 of bf16 out
    terms["qkv_inputs"] = ("attention", 3 * g * D)
    if att.qk_norm:
        terms["qk_norm"] = ("norm", 8.0 * (A + G))
    terms["rope"] = ("attention", 4.0 * (A + G))
    terms["sdpa_qkv_out"] = ("attention", 2.0 * (A + 2 * G) + 2.0 * A)
    terms["o_proj_input"] = ("attention", g * A)
    # MLP sublayer
    terms["mlp_norm"] = ("norm", 8.0 * D)
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        K, F, E = moe.router.top_k, moe.expert_hidden, moe.num_experts
        terms["router"] = ("router", 4.0 * D + 4.0 * E)  # fp32 input + softmax probs
        terms["dispatch_rows"] = ("experts", 2.0 * D + g * K * D)  # x_TD bf16 + x_RD (T*K rows)
        terms["expert_hidden"] = ("experts", K * (4.0 * F))  # gate|up output of the grouped GEMM
        terms["expert_swiglu"] = ("swiglu", K * (2.0 * F + g * F))  # silu(gate), product (w_down input)
        terms["expert_out"] = ("experts", 2.0 * K * D)  # y_RD for the combine's weight gradient
        if moe.shared_width():
            S = moe.shared_width()
            terms["shared_mlp"] = ("mlp", 4.0 * S + g * D)
            terms["shared_swiglu"] = ("swiglu", 2.0 * S + g * S)
    else:
        H = cfg.mlp_hidden
        terms["mlp"] = ("mlp", 2 * g * D + 4.0 * H)
        terms["mlp_swiglu"] = ("swiglu", 2.0 * H + g * H)
    return terms


def block_activation_bytes(cfg: ModelConfig, layer: int, memory: MemoryConfig, precision: str,
                           compiled: bool) -> float:
    """Saved bytes per token of block ``layer`` under the recompute policy: the block input (fp32
    residual) alone for a fully recomputed block; the named modules' terms dropped for selective."""
    if memory.recompute == Recompute.full and layer % memory.recompute_every == 0:
        return 4.0 * cfg.d_model
    terms = activation_terms(cfg, layer, precision)
    if memory.recompute == Recompute.selective:
        dropped = set(memory.recompute_modules)
        kept = sum(b for mod, b in terms.values() if mod not in dropped)
    else:
        kept = sum(b for _, b in terms.values())
    return kept * (COMPILED_ACTIVATIONS if compiled else 1.0)


@dataclasses.dataclass
class Plan:
    """Inputs of one plan (a model, a layout, a batch, switches, a GPU)."""

    model: ModelConfig
    parallel: ParallelConfig
    memory: MemoryConfig
    seq_len: int = 4096
    global_batch: int = 4
    micro_batch: int | None = None
    precision: str = "bf16"
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


def plan(p: Plan) -> dict:
    """The plan's figures per rank (the tightest pipeline stage); ConfigError for a bad layout."""
    cfg, mem = p.model, p.memory
    cfg.validate()
    mem.validate()
    if p.precision not in ("bf16", "fp8"):
        raise ConfigError(f"--precision must be bf16 or fp8, got {p.precision!r}")
    if p.gpu not in GPUS:
        raise ConfigError(f"--gpu {p.gpu!r} is not in the table: choose one of {', '.join(GPUS)}")
    gpu = GPUS[p.gpu]
    # The layout checks pretrain's runs get (moetron.run.check_layout), on the plan's sizes.
    run = PretrainConfig(model=cfg, parallel=p.parallel)
    run.data.global_batch_size = p.global_batch
    if p.parallel.pp == 1:
        run.trainer.micro_batch_size = p.micro_batch
    par = check_layout(run, p.num_gpus)
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
    fsdp = p.num_gpus > 1  # FSDP2 is applied whenever there is more than one rank
    stages = _stage_layers(cfg.n_layers, par.pp)

    def expert_params(layer: int) -> int:
        return cfg.moe.num_params(cfg.d_model) - cfg.moe.num_experts * cfg.d_model - \
            3 * cfg.d_model * cfg.moe.shared_width() if cfg.is_moe_layer(layer) else 0

    rows = []
    for s, layers in enumerate(stages):
        dense = sum(cfg.num_block_params(i) - expert_params(i) for i in layers)
        experts = sum(expert_params(i) for i in layers)
        if s == 0:
            dense += cfg.num_embedding_params()
        if s == par.pp - 1:
            dense += cfg.num_embedding_params() + cfg.d_model
        local = dense / par.dp_shard + experts / par.dp_shard  # experts: / ep, then / efsdp
        block_max = max((cfg.num_block_params(i) - expert_params(i) + expert_params(i) / ep) for i in layers)
        last = s == par.pp - 1
        in_flight = min(par.pp - s, m) if par.pp > 1 else 1
        act_tok = sum(block_activation_bytes(cfg, i, mem, p.precision, p.compiled) for i in layers)
        acts = act_tok * T_mb * in_flight
        recompute_one = 0.0
        if mem.recompute != Recompute.none:  # one block's activations rebuilt during its backward
            recompute_one = max(sum(b for _, b in activation_terms(cfg, i, p.precision).values()) for i in layers) \
                * T_mb * (COMPILED_ACTIVATIONS if p.compiled else 1.0)
        logits = 10.0 * T_mb * cfg.vocab_size if last else 0.0  # bf16 logits + fp32 copy + fp32 log-softmax
        wcopy = 1 + 1 / 32 if p.precision == "fp8" else 2.0
        gathered = dense + experts / ep  # what this rank's FSDP groups all-gather for the stage
        # FSDP2: two gathered blocks (reshard after forward); under pp the stage stays gathered for
        # the step and its unsharded fp32 grads accumulate over the micro-batches (torchtitan's choice
        # for pipelines: no per-micro-batch all-gather / reduce-scatter).
        keep_gathered = fsdp and par.pp > 1
        if keep_gathered:
            compute_copies = wcopy * gathered + 4.0 * gathered
        else:
            compute_copies = wcopy * (2 * block_max if fsdp else dense + experts)
        ep_buf = 0.0
        if cfg.moe is not None and ep > 1:
            ep_buf = 2 * 2.0 * T_mb * cfg.moe.router.top_k * cfg.d_model  # send + receive rows, one layer
        rs_buf = 4.0 * block_max if fsdp and not keep_gathered else 0.0  # one block's fp32 unsharded grads for the reduce-scatter
        pp_buf = 2 * 4.0 * T_mb * cfg.d_model if par.pp > 1 else 0.0
        comm = ep_buf + rs_buf + pp_buf
        params_b, grads_b, optim_b = 4.0 * local, 4.0 * local, 8.0 * local
        # Peak: at the loss (grads not yet allocated: zero_grad(set_to_none)) or late in backward
        # (grads allocated, activations mostly freed, one recomputed block alive).
        at_loss = params_b + optim_b + compute_copies + acts + logits + comm
        in_bwd = params_b + grads_b + optim_b + compute_copies + recompute_one + comm
        peak = max(at_loss, in_bwd)
        rows.append({"stage": s, "layers": len(layers), "params_local": local, "params_gathered": gathered, "params_gib": params_b / GiB,
                     "grads_gib": grads_b / GiB, "optimizer_gib": optim_b / GiB,
                     "compute_copies_gib": compute_copies / GiB, "activations_gib": acts / GiB,
                     "logits_gib": logits / GiB, "comm_buffers_gib": comm / GiB, "peak_gib": peak / GiB,
                     "in_flight_microbatches": in_flight, "act_bytes_per_token": act_tok})
    tight = max(rows, key=lambda r: r["peak_gib"])

    # ---- FLOPs and time --------------------------------------------------------------------------
    fpt = cfg.flops_per_token(p.seq_len)
    tokens_step = p.global_batch * p.seq_len
    flops_step = fpt * tokens_step
    peak_flops = (gpu.fp8_tflops if p.precision == "fp8" else gpu.bf16_tflops) * 1e12
    bf16_flops = gpu.bf16_tflops * 1e12
    width = cfg.attention.n_heads * cfg.attention.head_width(cfg.d_model)

    def stage_time(layers: list[int], last: bool) -> tuple[float, dict]:
        """Seconds for one micro-batch's forward + backward on a stage, and its parts."""
        attn_f = sum(12.0 * width * min(p.seq_len, cfg.window_of(i) or p.seq_len) for i in layers)
        block_f = sum(cfg.block_flops_per_token(i, p.seq_len) for i in layers)  # one path for FLOPs
        expert_f = sum(6.0 * cfg.moe.router.top_k * 3 * cfg.d_model * cfg.moe.expert_hidden
                       for i in layers if cfg.is_moe_layer(i))
        dense_f = block_f - attn_f - expert_f
        if last:
            dense_f += fpt - sum(cfg.block_flops_per_token(i, p.seq_len) for i in range(cfg.n_layers))
        recomputed = [i for i in layers if mem.recompute == Recompute.full and i % mem.recompute_every == 0]
        share = len(recomputed) / max(1, len(layers))  # an extra forward (1/3 of fwd + bwd) for those
        extra = 1 + share / 3
        t_gemm = T_mb * (dense_f / (peak_flops * EFF_GEMM) + expert_f / (peak_flops * EFF_EXPERT)) * extra
        t_attn = T_mb * attn_f / (bf16_flops * EFF_ATTN) * extra
        eager_bytes = sum(sum(b for _, b in activation_terms(cfg, i, p.precision).values()) for i in layers)
        traffic = HBM_TRAFFIC["compiled" if p.compiled else "eager"] * eager_bytes * T_mb * extra
        t_hbm = traffic / (gpu.hbm_tbps * 1e12)
        t_a2a = 0.0
        if cfg.moe is not None and ep > 1:
            K = cfg.moe.router.top_k
            rows_out = T_mb * (ep - 1) if K >= ep else T_mb * K * (ep - 1) / ep  # all_gather vs synced
            n_moe = sum(1 for i in layers if cfg.is_moe_layer(i))
            passes = 4 + (2 * share if share else 0)  # dispatch + combine, fwd and bwd (+ recompute)
            t_a2a = n_moe * passes * rows_out * cfg.d_model * 2.0 / _group_bw(gpu, ep, 1)
        return t_gemm + t_attn + t_hbm + t_a2a, {"gemm": t_gemm, "attention": t_attn, "hbm": t_hbm, "ep_a2a": t_a2a}

    times = [stage_time(layers, s == par.pp - 1) for s, layers in enumerate(stages)]
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
    if fsdp and par.dp_shard > 1:
        # bytes received per rank: the gathered stage less the local shard (dense over dp_shard,
        # experts over efsdp: the same share). Per micro-batch (gathered forward and again in backward,
        # grads reduce-scattered each micro-batch: trainer.grad_sync=micro_batch), or once per step under pp.
        moved = tight["params_gathered"] - tl
        times_ag, times_rs = (1, 1) if par.pp > 1 else (2 * m, m)
        ag_bytes = times_ag * 2.0 * moved
        rs_bytes = times_rs * 4.0 * moved
        t_fsdp = (ag_bytes + rs_bytes) / _group_bw(gpu, par.dp_shard, 1)
    if par.dp_replicate > 1:
        ar_bytes = 2 * 4.0 * tl * (par.dp_replicate - 1) / par.dp_replicate
    t_ar = ar_bytes / _group_bw(gpu, par.dp_replicate, par.dp_shard)
    t_opt = OPTIMIZER_BYTES * tl / (gpu.hbm_tbps * 1e12)
    exposed_fsdp = max(0.0, t_fsdp - t_compute)
    step = t_pipe + exposed_fsdp + t_ar + t_opt
    a2a_bytes = 0.0
    if cfg.moe is not None and ep > 1:
        K = cfg.moe.router.top_k
        rows_out = T_mb * (ep - 1) if K >= ep else T_mb * K * (ep - 1) / ep
        n_moe = max(sum(1 for i in layers if cfg.is_moe_layer(i)) for layers in stages)
        a2a_bytes = m * n_moe * 4 * rows_out * cfg.d_model * 2.0
    tflops = flops_step / p.num_gpus / step / 1e12
    usable = gpu.hbm_gib - RESERVED_GIB
    time_share = {"compute": (parts["gemm"] + parts["attention"]) * m / step, "hbm": (parts["hbm"] * m + t_opt) / step,
                  "ep_all_to_all": parts["ep_a2a"] * m / step, "pipeline_bubble": (t_pipe - t_compute - t_pp_send) / step,
                  "fsdp_exposed": exposed_fsdp / step, "dp_all_reduce": t_ar / step, "pp_send": t_pp_send / step}
    fits = tight["peak_gib"] <= usable
    tightest = "HBM capacity" if not fits else max(time_share, key=time_share.get)
    return {
        "model": cfg.describe(), "gpu": p.gpu, "num_gpus": p.num_gpus, "precision": p.precision,
        "precision_note": "modelled, not built" if p.precision == "fp8" else "measured path",
        "compiled": p.compiled, "recompute": str(mem.recompute), "recompute_every": mem.recompute_every,
        "layout": {"dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard, "ep": ep, "efsdp": efsdp,
                   "pp": par.pp, "pp_microbatches": m if par.pp > 1 else None},
        "seq_len": p.seq_len, "global_batch": p.global_batch, "micro_batch": micro, "grad_accum": m,
        "stages": rows, "tight_stage": tight["stage"], "peak_gib": tight["peak_gib"], "usable_gib": usable,
        "flops_per_token": fpt, "flops_per_step": flops_step,
        "bytes_per_step": {"ep_all_to_all": a2a_bytes, "fsdp_all_gather": ag_bytes, "fsdp_reduce_scatter": rs_bytes,
                           "dp_all_reduce": ar_bytes,
                           "pp_send": m * 2 * 4.0 * T_mb * cfg.d_model if par.pp > 1 else 0.0},
        "step_s": step, "microbatch_s": t_mb, "microbatch_parts_s": parts, "optimizer_s": t_opt,
        "fsdp_s": t_fsdp, "bubble": bubble, "time_share": time_share,
        "tokens_per_s_per_gpu": tokens_step / step / p.num_gpus, "tflops_per_gpu": tflops,
        "mfu_bf16": tflops * 1e12 / bf16_flops,
        "overlap": "FSDP all-gather/reduce-scatter overlap compute (excess exposed); EP all-to-all, pipeline "
                   "sends, the DP all-reduce and the optimizer are not overlapped",
        "fits": fits, "tightest": tightest,
    }


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
          f"{'compiled' if r['compiled'] else 'eager'} | recompute {r['recompute']}")
    print(f"layout dp_replicate {lay['dp_replicate']} x dp_shard {lay['dp_shard']} (ep {lay['ep']} x efsdp "
          f"{lay['efsdp']}) x pp {lay['pp']} | seq {r['seq_len']} x {r['global_batch']} | micro-batch "
          f"{r['micro_batch']} x {r['grad_accum']}")
    s = r["stages"][r["tight_stage"]]
    print(f"memory per rank (stage {s['stage']}, {s['layers']} blocks), GiB:")
    for key in ("params", "grads", "optimizer", "compute_copies", "activations", "logits", "comm_buffers", "peak"):
        print(f"  {key:<16} {s[key + '_gib']:9.2f}")
    print(f"  {'usable':<16} {r['usable_gib']:9.2f}   -> {'fits' if r['fits'] else 'DOES NOT FIT'}")
    print(f"FLOPs/step {r['flops_per_step']:.4g}  ({r['flops_per_token']:.4g} per token)")
    print("bytes/step per rank: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in r["bytes_per_step"].items()))
    print(f"step {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU | "
          f"{r['tflops_per_gpu']:.1f} TFLOP/s/GPU | MFU(bf16) {100 * r['mfu_bf16']:.1f}% | bubble {100 * r['bubble']:.1f}%")
    print("time shares: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in r["time_share"].items()))
    print(f"overlap: {r['overlap']}")
    print(f"tightest resource: {r['tightest']}")


def parse(argv: list[str]) -> tuple[Plan, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", default=None, help="model preset (see models/config.py PRESETS)")
    parser.add_argument("--config", default=None, help="a run YAML (model, parallel, memory sections are read)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch per rank")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp8"))
    parser.add_argument("--eager", action="store_true", help="no torch.compile (default: compiled blocks)")
    parser.add_argument("--compile", action="store_true", help="compiled blocks (the default)")
    parser.add_argument("--gpu", default="h200", choices=tuple(GPUS))
    parser.add_argument("--num-gpus", type=int, default=1)
    parser.add_argument("--search", action="store_true", help="list the fastest layouts that fit")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", default="runs/plan/plan.json")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith(("--model.", "--parallel.", "--memory.")) and "=" in a)]
    if bad:
        raise ConfigError(f"unrecognized arguments {bad}: overrides are --model.*, --parallel.*, --memory.* =value")
    model, parallel, memory = ModelConfig(), ParallelConfig(), MemoryConfig()
    seq, batch, micro = 4096, 4, None
    if args.config:
        import yaml

        with open(args.config, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        model = ModelConfig.from_dict(raw.get("model", {}), prefix="model")
        parallel = ParallelConfig.from_dict(raw.get("parallel", {}), prefix="parallel")
        memory = MemoryConfig.from_dict(raw.get("memory", {}), prefix="memory")
        seq = raw.get("data", {}).get("seq_len", seq)
        batch = raw.get("data", {}).get("global_batch_size", batch)
        micro = raw.get("trainer", {}).get("micro_batch_size", micro)
    if args.preset:
        model = ModelConfig.preset(args.preset)
    for prefix, target in (("--model.", model), ("--parallel.", parallel), ("--memory.", memory)):
        target.apply_overrides([a[len(prefix):] for a in rest if a.startswith(prefix)])
    p = Plan(model=model, parallel=parallel, memory=memory, seq_len=args.seq_len or seq,
             global_batch=args.global_batch or batch, micro_batch=args.micro_batch or micro,
             precision=args.precision, compiled=not args.eager, gpu=args.gpu, num_gpus=args.num_gpus)
    return p, args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p, args = parse(argv)
    env = {"tool": "tools/plan.py", "argv": argv}
    if args.search:
        rows = search(p, args.top)
        print(f"fastest layouts that fit {p.num_gpus} x {p.gpu}, {p.model.describe()}, seq {p.seq_len} x "
              f"{p.global_batch}, {p.precision}:")
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
