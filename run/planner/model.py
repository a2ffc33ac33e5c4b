"""The planner's model: per-rank memory and step time of a run from its configs (nothing is built).

Its pieces: switches.py (what of a run's configs the model counts), memory.py (the memory terms),
timing.py (a stage's micro-batch time and the GEMM and collective rates); this module adds them up
per stage and per step (plan), for one rank's slice (plan_slice) and over layouts (search).

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
- step time = GEMM FLOPs / (peak x the GPU's in-step GEMM efficiency, the routed experts at a share of it
  by their shape) [measured: tools/profile_step.py's GEMM tables] + attention FLOPs / (peak x attention
  efficiency) [measured fit] + elementwise HBM traffic [measured fit] at the GPU's streaming rate
  (GPU.stream_bps) + quantization passes and the bf16 experts' backward recast [code bytes, assumed
  unfused rates; mxfp8 emulated's at its kernels' measured rates] + optimizer (its counted bytes at the
  streaming rate, or host under offload) +
  host<->device copies under offload [assumed PCIe rate] + exposed communication, the whole
  stretched by the 1F1B bubble (p-1)/(m+p-1). FSDP all-gathers / reduce-scatters are assumed to
  overlap compute (only the excess is exposed); EP all-to-alls, pipeline sends, offload copies and
  the CPU optimizer step are not.
- precision: bf16 is the measured path; mxfp8 / fp8_blockwise emulated run bf16 GEMMs after
  dequantizing (GEMMs at the bf16 rate plus quantize-dequantize passes) and save GEMM inputs as
  fp8 + scales (1 + 1/32 B per element) [code]; mxfp8 emulated's passes are its kernels' bytes
  [code] at their rates measured on the H200 (EFF_MX_QUANT, EFF_MX_FUSED; Switches.mx_fused,
  MOETRON_MX_FUSED) [measured], fp8_blockwise emulated's assumed; fp8_blockwise native runs dense
  GEMMs at the H200's measured ~1000-1160 TFLOP/s (1080 of the fp8 peak) and grouped experts at the Triton kernels'
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
import math

from moetron.core.config import ConfigError
from moetron.core.memory import MemoryConfig, Recompute
from moetron.core.optim import OptimizerConfig
from moetron.core.precision import PrecisionConfig, PrecisionRecipe
from moetron.core.trainer import GradSync
from moetron.models import ModelConfig
from moetron.parallel.config import ParallelConfig
from moetron.parallel.pipeline.runtime import n_microbatches
from moetron.run.config import PretrainConfig, check_layout
from .hardware import GiB, GPUS, RESERVED_GIB, EFF_PCIE, HOST_GBPS, OPTIMIZER_BYTES, HOST_OPTIMIZER_BYTES, STATE_BYTES
from .memory import (
    SLICE_FREED, SLICE_FREED_AT_GATE_UP, _expert_params, _swiglu_backward_rows, activation_terms,
    block_activation_bytes, block_backward_transient, gate_up_wgrad_transient, loss_memory, stage_linear,
)
from .switches import Switches, switches
from .timing import _group_bw, gemm_rate, reference_activation_bytes, stage_time


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
    deterministic: bool = False
    """trainer.deterministic: attention on torch's deterministic kernels (timing.stage_time); no bytes move."""
    mx_fused: bool | None = None
    """mxfp8 emulated: the fused rows-and-columns quantization (MOETRON_MX_FUSED, read by
    core/precision/emulated.py at import); None: as this process has it (on unless set to 0)."""


def _stage_layers(n_layers: int, pp: int) -> list[list[int]]:
    """Blocks per stage as parallel.pp_split=layers cuts them (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


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
    sw = switches(cfg, par, p.precision, p.optimizer, gpu, p.compiled, mx_fused=p.mx_fused, ranks=p.num_gpus,
                  micro_batches=m)
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

    def expert_params(layer: int) -> int:
        return _expert_params(cfg, layer)

    state_b = STATE_BYTES[sw.state_dtype]
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
        cache = sw.cache_bytes(linear, forward_only=True)  # the backward's entries: in its candidates below
        cache_backward = sw.cache_bytes(linear) - cache
        if sw.expert_weight_copies and not fsdp:  # [code] 2 B per local expert parameter, held through the step
            cache += 2.0 * linear["experts"] * (2 if sw.quantized_expert_copies else 1)  # (+ the dgrad's copy)
        if last and sw.fused_loss and sw.head_weight_copy:  # [code] the head's bf16 copy, held through the step
            cache += 2.0 * cfg.vocab_size * cfg.d_model
        embedding = cfg.vocab_size * cfg.d_model if s == 0 else 0
        if sw.embedding_weight_copy:  # [code] the embedding's bf16 copy, held through the step
            cache += 2.0 * embedding
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
        if sw.dense_weight_copies:  # [code] 2 B per dense linear gradient (the copies: autograd's casts' place)
            grads_b -= 2.0 * (linear["attention"] + linear["mlp"])
        if last:  # [code] the head's gradient: 2 B an element on its copy under head_grads_bf16 in one chunk
            grads_b -= (4.0 - sw.head_grad_bytes(T_mb)) * cfg.vocab_size * cfg.d_model
        if sw.embedding_weight_copy:  # [code] the embedding's gradient: 2 B an element on its copy
            grads_b -= 2.0 * embedding
        # [code] optimizer.split_master: a split weight's fp32 storage (4 B) freed, its int16 rest (2 B) kept
        params_b -= 2.0 * sw.split_elements(linear, cfg.vocab_size * cfg.d_model if last else 0, embedding)
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
        head_grad = sw.head_grad_bytes(T_mb) * cfg.vocab_size * cfg.d_model if last and not fsdp and not sw.offload else 0.0
        top = layers[-1]
        if sw.expert_grads_bf16 and grad_block:
            grad_block -= 2.0 * _expert_params(cfg, top) / ep  # that block's expert gradients in bf16
        top_linear = stage_linear(cfg, [top], ep)
        top_cache = sw.cache_bytes(top_linear) - sw.cache_bytes(top_linear, forward_only=True)
        candidates["last block's backward"] = base + acts + head_grad + grad_block + recompute_one + \
            block_backward_transient(cfg, top, sw, T_mb, ep) + top_cache
        candidates["end of backward"] = base - held_grads - unsharded + grads_b + recompute_one + cache_backward
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
                        compiled=p.compiled, microbatches=m, last=s == par.pp - 1, deterministic=p.deterministic)
             for s, layers in enumerate(stages)]
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
        t_opt = OPTIMIZER_BYTES[(sw.state_dtype, sw.optimizer_kernel)] * tl / gpu.stream_bps
    # [code] bytes the switches add to the optimizer's pass (opt_bytes) and passes they remove from the step
    # (cast_bytes, negative: inside the fitted elementwise traffic otherwise), both at the streaming rate
    opt_bytes = cast_bytes = 0.0
    grads_bf16 = sw.expert_grads_bf16 and not sw.offload
    if cfg.moe is not None and (grads_bf16 or sw.cublas_bf16_experts):
        # no cast pass after the wgrad GEMM (read 2 + write 4 B per element): the gradients stay bf16
        # (expert_grads_bf16), or cuBLAS writes them in fp32 from its sums (bf16_experts=cublas); bf16
        # ones are also 2 B less for the optimizer
        expert_local = sum(_expert_params(cfg, i) for i in range(cfg.n_layers) if cfg.is_moe_layer(i)) / par.ep / par.pp
        cast_bytes -= 6.0 * expert_local
        if grads_bf16:
            opt_bytes -= 2.0 * expert_local
        if sw.quantized_expert_copies:  # the step writes a second bf16 copy (the dgrad's orientation)
            opt_bytes += 2.0 * expert_local
    every_linear = stage_linear(cfg, list(range(cfg.n_layers)), 1)  # the copies' switches: one unsharded GPU
    if sw.dense_weight_copies and not sw.offload:
        # no forward cast of the dense weights (read 4 + write 2 B) nor backward cast of their gradients
        # (read 2 + write 4 B); the optimizer writes each copy (2 B) and reads 2 B less per gradient:
        # -12 B a dense element
        cast_bytes -= 12.0 * (every_linear["attention"] + every_linear["mlp"])
    if sw.fused_loss and sw.head_weight_copy:
        # no cast of the head weight in each micro-batch's loss forward (read 4 + write 2 B an element);
        # the optimizer writes the copy (2 B) once a step
        cast_bytes -= (6.0 * m - 2.0) * cfg.vocab_size * cfg.d_model
    if sw.head_grads_bf16:
        # [code] the optimizer reads the head's gradient in 2 B; the loss writes it in head_grad_bytes (2 B
        # in one chunk; one micro-batch: accumulation is refused)
        opt_bytes -= 2.0 * cfg.vocab_size * cfg.d_model
        cast_bytes -= (4.0 - sw.head_grad_bytes(T_mb)) * cfg.vocab_size * cfg.d_model
    if sw.embedding_weight_copy:
        # [code] the embedding's gradient written in 2 B (the kernel's, not 4) and read by the optimizer in 2
        # (its copy written, 2 B: even); its rows [T, D] gathered from the copy (EMBEDDING_COPY_ROW_BYTES)
        cast_bytes -= 2.0 * cfg.vocab_size * cfg.d_model + m * sw.EMBEDDING_COPY_ROW_BYTES * T_mb * cfg.d_model
    # [code] optimizer.split_master: the step reads and writes copy and rest (8 B) where it read and wrote
    # the fp32 master and wrote the copy (10 B)
    opt_bytes -= 2.0 * sw.split_elements(every_linear, cfg.vocab_size * cfg.d_model, cfg.vocab_size * cfg.d_model)
    if sw.fused_loss_prescale:
        # no scaling pass in the loss' backward, each micro-batch: the fp32 grad_W [V, D] and grad_h [T, D]
        # (the fp32 residual's dtype) read and written
        cast_bytes -= m * 8.0 * cfg.d_model * (cfg.vocab_size + T_mb)
    t_opt += opt_bytes / gpu.stream_bps
    t_grad_cast = cast_bytes / gpu.stream_bps
    exposed_fsdp = max(0.0, t_fsdp - t_compute)
    step = t_pipe + exposed_fsdp + t_ar + t_opt + t_offload + t_grad_cast
    # optimizer.overlap (one unsharded GPU): the next forward waits for the embedding's and the first
    # block's updates; the rest can hide behind the forward. A bound only (not measured): the step
    # stays planned unoverlapped.
    overlap_best = None
    if p.optimizer.overlap and not sw.offload:
        first = cfg.vocab_size * cfg.d_model + cfg.num_block_params(0)
        overlap_best = step - t_opt * (1 - min(1.0, first / tl))
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
    elif sw.mx_emulated:
        note = ("emulated: bf16 GEMMs, MX quantization at measured rates ("
                + ("fused rows and columns" if sw.mx_fused else "two passes, MOETRON_MX_FUSED=0") + ")")
    elif sw.backend == "emulated":
        note = "emulated: bf16 GEMMs, quantization passes assumed"
    elif sw.recipe == "fp8_blockwise":
        note = "native: dense and grouped fp8 GEMMs at measured rates, quantization assumed"
    elif sw.rowwise_native:
        note = ("native fp8_rowwise: grouped GEMMs at the measured ratio over bf16, dense at a step's measured rate"
                + ("" if sw.fp8_fast_accum else " (fp32 promotion: fp8_blockwise's rate assumed)")
                + ", quantization kernels at measured rates")
    else:
        note = "native mxfp8: built, never run (no Blackwell): modelled at assumed rates"
    copies_held = bool(sw.expert_weight_copies or sw.dense_weight_copies or sw.head_weight_copy)
    without_copies = None  # where auto's weight copies push a one-GPU plan over: the peak without them
    if not fits and copies_held and p.precision.auto_copies:
        off = plan(dataclasses.replace(p, precision=p.precision.with_auto_copies(False)))
        if off["peak_gib"] < tight["peak_gib"]:
            without_copies = off["peak_gib"]
    return {
        "model": cfg.describe(), "gpu": p.gpu, "num_gpus": p.num_gpus, "precision": sw.recipe,
        "precision_backend": sw.backend, "precision_modules": sorted(sw.low_modules), "precision_note": note,
        "compiled": p.compiled, "recompute": str(mem.recompute), "recompute_every": mem.recompute_every,
        "fused_loss": sw.fused_loss, "state_dtype": sw.state_dtype, "fsdp_offload": sw.offload,
        "layout": {"dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard, "ep": ep, "efsdp": efsdp,
                   "pp": par.pp, "pp_microbatches": m if par.pp > 1 else None},
        "seq_len": p.seq_len, "global_batch": p.global_batch, "micro_batch": micro, "grad_accum": m,
        "grad_sync": str(GradSync.step if step_sync else GradSync.micro_batch), "deterministic": p.deterministic,
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
                   "sends, the DP all-reduce, the optimizer and fsdp_offload's host copies are not overlapped"
                   + (f" (optimizer.overlap=true is not modelled yet: its step is planned as not overlapped; at "
                      f"best, every update but the embedding's and the first block's hidden, "
                      f"{1e3 * overlap_best:.1f} ms)" if overlap_best is not None else ""),
        "step_overlap_best_s": overlap_best,
        "assumptions": (f"fsdp_offload: PCIe {gpu.pcie_gbps:.0f} GB/s x {EFF_PCIE}, host optimizer at "
                        f"{HOST_GBPS:.0f} GB/s" if sw.offload else ""),
        "fits": fits, "tightest": tightest, "peak_without_auto_copies_gib": without_copies,
        "weight_copies": copies_held, "split_master": sw.split_master,
    }


# ---- one rank's slice (tools/bench_slice.py) ------------------------------------------------------

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
    the larger of that and the gate|up wgrad (gate_up_wgrad_transient: dh along the tokens and its bf16 output).
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
    # bench_slice builds its slice's bf16 weights itself: no optimizer, so no weight copies (auto resolved off)
    sw = switches(cfg, ParallelConfig(), (precision or PrecisionConfig(recipe="bf16")).with_auto_copies(False),
                  OptimizerConfig(), GPUS[gpu], compiled)
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
    if sw.fp8_blockwise_experts:  # its wgrad's operands and output: the gate|up one is the larger
        top_at_gate_up = sum(b for k, (_, b) in terms.items() if k not in SLICE_FREED_AT_GATE_UP) * T
        held_gate_up = acts - top_saved + (top_saved if recomputed else top_at_gate_up)
        candidates[f"block {top}'s experts' gate|up wgrad"] = \
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
    """The fastest layouts that fit: ep, pp, dp_shard, micro-batch and recompute varied, sorted by step time; a
    one-GPU layout that fits only without the weight copies auto turned on is planned with them off."""
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
                    if not r["fits"] and (r["peak_without_auto_copies_gib"] or math.inf) <= r["usable_gib"]:
                        # auto's weight copies push this one over: the same layout with them off
                        r = plan(dataclasses.replace(candidate, precision=candidate.precision.with_auto_copies(False)))
                except ConfigError:
                    continue
                if r["fits"]:
                    out.append(r)
    out.sort(key=lambda r: r["step_s"])
    return out[:top]
