"""The planner's step-time model: the GEMM rates (gemm_rate), a collective's bandwidth over a mesh
group, and the seconds of one micro-batch forward + backward through a stage's blocks and their
parts (stage_time: GEMMs, attention, elementwise HBM traffic from reference_activation_bytes, the
experts' recast and the quantization passes, the EP all-to-all). model.py adds the step's other
terms (optimizer, offload copies, FSDP and DP communication, pipeline sends and bubble)."""

from __future__ import annotations

__all__ = ['bf16_rate', 'cublas_bf16_speedup', 'expert_gemm_share', 'fp8_rowwise_speedup', 'gemm_rate', 'mx_emulated_quant_s', 'reference_activation_bytes',
           'rowwise_quant_s', 'stage_time']

import math

from moetron.core.memory import MemoryConfig, Recompute
from moetron.models import ModelConfig
from .hardware import (
    GPU, GPUS_PER_NODE, EXPERT_GEMM_MEASURED, EFF_FP8_GEMM, EFF_FP8_EXPERT, EFF_FP8_GLUON_EXPERT, EFF_FP8_CUBLAS_EXPERT,
    CUBLAS_CALL_S, BF16_CUBLAS_MEASURED, BF16_CUBLAS_CALL_S, EFF_ATTN, DETERMINISTIC_ATTN, EFF_COMM, HBM_TRAFFIC,
    RECOMPUTE_FORWARD, QUANT_BYTES, WEIGHT_QUANT_BYTES, QUANT_ROWS_BYTES, MX_EMULATED_BYTES, EFF_MX_QUANT,
    EFF_MX_FUSED, FP8_ROWWISE_MEASURED, EFF_FP8_ROWWISE_GEMM, ROWWISE_QUANT_BYTES, EFF_ROWWISE_ROWS, EFF_ROWWISE_COLS,
    RESIDUAL_SAVED_BYTES, EAGER_NORM_SAVED_BYTES, EAGER_ROPE_SAVED_BYTES,
)
from .memory import _expert_params, _linear_params, attention_widths, block_norms
from .switches import Switches


def reference_activation_bytes(cfg: ModelConfig, layer: int) -> float:
    """Saved bytes per token of a block as the eager count stood when HBM_TRAFFIC was fitted (bf16,
    the SwiGLU product and silu kept, rope counted): the basis of the elementwise-traffic estimate,
    which measures work done, not what is kept."""
    D = cfg.d_model
    att = cfg.attention
    A, G = attention_widths(cfg)
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


def _operand_widths(cfg: ModelConfig, layer: int, input_once: bool = False
                    ) -> dict[str, tuple[list[tuple[float, int]], list[tuple[float, int]]]]:
    """Per token, by precision module: the quantized operands of its GEMMs as (elements, row width),
    the inputs x (q, k and v each quantize their x, and so do a dense SwiGLU's gate and up, unless
    ``input_once``: precision.quantize_input_once; the experts' gate|up is one GEMM), then the output
    gradients dy in backward. The widths matter to fp8_rowwise (its fused rows + column-maxima kernel
    serves grouped rows up to 4096 columns)."""
    D = cfg.d_model
    A, G = attention_widths(cfg)
    qkv, gate_up = (1.0, 1.0) if input_once else (3.0, 2.0)
    out = {"attention": ([(qkv * D, D), (float(A), A)], [(float(A), A), (2.0 * G, G), (float(D), D)]),
           "mlp": ([], []), "experts": ([], [])}
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        K, F, S = moe.router.top_k, moe.expert_hidden, moe.shared_width()
        out["experts"] = ([(K * D, D), (K * F, F)], [(2.0 * K * F, 2 * F), (K * D, D)])
        if S:
            out["mlp"] = ([(gate_up * D, D), (float(S), S)], [(2.0 * S, S), (float(D), D)])
    else:
        H = cfg.mlp_hidden
        out["mlp"] = ([(gate_up * D, D), (float(H), H)], [(2.0 * H, H), (float(D), D)])
    return out


def _gemm_operands(cfg: ModelConfig, layer: int, input_once: bool = False) -> dict[str, tuple[float, float]]:
    """Per token, by precision module: (elements of every GEMM's input x, of its output gradient dy),
    _operand_widths' elements summed."""
    return {k: (sum(e for e, _ in xs), sum(e for e, _ in dys))
            for k, (xs, dys) in _operand_widths(cfg, layer, input_once).items()}


def mx_emulated_quant_s(gpu: GPU, sw: Switches, module: str, inputs: float, outputs: float, weights: float,
                        recomputed: bool, microbatches: int) -> float:
    """Seconds of mxfp8 emulated's quantization kernels for one micro-batch through a module's GEMMs
    with ``inputs`` / ``outputs`` elements of x / y and ``weights`` weight elements [code bytes,
    measured rates]: x's rows and columns in forward (again when the block is ``recomputed``), its
    payload dequantized and dy's rows and columns in backward, each weight along I and along O
    (compiled: in the graph, in forward and backward and a recomputed forward; eager and
    quantize_weights_once: from the WeightCache, once per step of ``microbatches``, both
    orientations from one read when fused). precision.emulated_save_x_bf16: x's columns in bf16 (dy's
    bytes) and no dequantize."""
    b, hbm = MX_EMULATED_BYTES, gpu.hbm_tbps * 1e12
    mode = "fused" if sw.mx_fused else "two_pass"
    forwards = 2 if recomputed else 1
    # emulated_save_x_bf16: x's columns written in bf16 as dy's are, and no payload to dequantize
    x_bytes, dequant = (b[f"grad_{mode}"], 0.0) if sw.emulated_save_x_bf16 else (b[f"input_{mode}"], b["input_dequant"])
    paired = x_bytes * inputs * forwards + b[f"grad_{mode}"] * outputs
    separate = dequant * inputs
    # the experts on the optimizer's bf16 copies read 2 B of each weight element, not the fp32 master's 4
    lighter = 2.0 if module == "experts" and sw.expert_weight_copies else 0.0
    if module == "experts" and sw.quantized_expert_copies:  # the optimizer's step quantizes them (model.py)
        weights = 0.0
    if sw.caches_weights(module) and sw.mx_fused:  # one cache entry holds both orientations, one read
        paired += (b["weight_pair"] - lighter) * weights / microbatches
    else:
        separate += (b["weight"] - lighter) * weights * (2 / microbatches if sw.caches_weights(module)
                                                         else (3 if recomputed else 2))
    return paired / (hbm * (EFF_MX_FUSED if sw.mx_fused else EFF_MX_QUANT)) + separate / (hbm * EFF_MX_QUANT)


def weight_quant_bytes(sw: Switches, module: str, cached: bool) -> float:
    """HBM bytes per weight element of one weight quantization of a module's GEMMs. Native fp8_blockwise
    [code bytes]: its kernel's (core/precision/blockwise_triton.py quantize_128x128_triton), the master
    read (fp32, or the experts' bf16 copies) and the e4m3 written: w and w^T together where the weight
    cache keeps both (eager, quantize_weights_once), only the pass's own inside a traced graph
    (fp8_gemm._weights). Other backends: WEIGHT_QUANT_BYTES (assumed)."""
    if (sw.recipe, sw.backend) != ("fp8_blockwise", "native"):
        return WEIGHT_QUANT_BYTES[sw.backend]
    master = 2.0 if module == "experts" and sw.expert_weight_copies else 4.0
    return master + (2.0 if cached else 1.0)


def rowwise_quant_s(gpu: GPU, sw: Switches, module: str, operands: list[tuple[float, int]], tokens: float,
                    weights: float, passes: float, microbatches: int) -> float:
    """Seconds of native fp8_rowwise's quantization for one micro-batch through a module's GEMMs
    [code bytes, measured rates]: each operand's rows (``operands``: (elements per token, row width),
    x in forward and dy in backward, ``passes`` times: 1, or more for a recomputed block) and, with
    FP8 weight gradients, its columns along the tokens (the experts' grouped operands' column maxima in
    the rows' read where fp8_rowwise_triton.rows_chunks_fits, else a pass of their own); each weight
    along I (forward) and along O (dgrad) from its master, fp32 or the experts' bf16 copies (compiled:
    in every forward and backward; eager: the WeightCache, once per step of ``microbatches``)."""
    try:
        from moetron.core.precision.fp8_rowwise_triton import rows_chunks_fits
    except ImportError as e:  # the tile rule lives beside the kernel, which imports triton
        from moetron.core.config import ConfigError

        raise ConfigError(f"planning fp8_rowwise reads its fused kernel's tile rule "
                          f"(core/precision/fp8_rowwise_triton.py), which needs triton ({e}): pip install triton, "
                          f"or plan with fp8_blockwise or bf16") from e

    b, hbm = ROWWISE_QUANT_BYTES, gpu.hbm_tbps * 1e12
    rows_b = cols_b = 0.0
    for elements, width in operands:
        n = elements * tokens * passes
        rows_b += b["rows"] * n
        if sw.bf16_wgrad(module):
            continue
        cols_b += b["cols"] * n
        if module == "experts" and not (sw.fp8_fused_amax and rows_chunks_fits(width)):
            rows_b += b["chunks"] * n
    master = 2.0 if module == "experts" and sw.expert_weight_copies else 4.0
    per_orientation = (master + 1.0) * weights * (1 / microbatches if sw.caches_weights(module) else passes)
    return (rows_b + per_orientation) / (hbm * EFF_ROWWISE_ROWS) + (cols_b + per_orientation) / (hbm * EFF_ROWWISE_COLS)


def _group_bw(gpu: GPU, size: int, stride: int) -> float:
    """Bytes/s of a collective over a mesh group of ``size`` ranks ``stride`` apart (ranks fill
    nodes of 8 in mesh order: ep innermost, then efsdp, dp_replicate, pp outermost)."""
    inside = size * stride <= GPUS_PER_NODE
    return (gpu.nvlink_gbps if inside else gpu.internode_gbps) * 1e9 * EFF_COMM


def gemm_rate(gpu: GPU, sw: Switches, module: str, grouped: bool, expert_share: float = 1.0) -> float:
    """FLOP/s of a module's GEMMs: fp8 peak x fp8 efficiency for a native low-precision recipe,
    else the bf16 rate in a step (gpu.gemm_eff; emulated backends run bf16 GEMMs). ``grouped``: the
    routed experts, at ``expert_share`` of the dense rate (expert_gemm_share at their shape) in bf16 and
    native mxfp8; the FP8 blockwise kernels at their own measured rates."""
    if sw.recipe != "bf16" and sw.backend == "native" and sw.low(module):
        if sw.rowwise_native and not grouped:
            return gpu.fp8_tflops * 1e12 * EFF_FP8_ROWWISE_GEMM[sw.fp8_fast_accum]
        if not grouped:
            return gpu.fp8_tflops * 1e12 * EFF_FP8_GEMM
        if sw.recipe == "mxfp8":  # never run here: assumed to keep bf16's grouped share of the dense rate
            return gpu.fp8_tflops * 1e12 * EFF_FP8_GEMM * expert_share
        return gpu.fp8_tflops * 1e12 * (EFF_FP8_GLUON_EXPERT if sw.fp8_experts == "gluon" else EFF_FP8_EXPERT)
    return bf16_rate(gpu, expert_share if grouped else 1.0)


def bf16_rate(gpu: GPU, share: float = 1.0) -> float:
    """FLOP/s of bf16 GEMMs inside a step: the dense linears' (gpu.gemm_eff of the bf16 peak), times
    ``share`` (the routed experts': expert_gemm_share at their shape)."""
    return gpu.bf16_tflops * 1e12 * gpu.gemm_eff * share


def expert_gemm_share(rows: float, d_model: int, hidden: int) -> float:
    """The bf16 grouped expert GEMMs' in-step rate as a share of the dense linears' for local experts
    of ``rows`` rows x ``d_model`` x ``hidden``: EXPERT_GEMM_MEASURED's shares, linear in the log of
    rows x d_model x hidden between the measured shapes, the nearest end's share outside them."""
    return _log_interpolated([(r * d * f, share) for r, d, f, share in EXPERT_GEMM_MEASURED.values()],
                             rows * d_model * hidden)


def cublas_bf16_speedup(rows: float, d_model: int, hidden: int) -> float:
    """cuBLAS per-expert GEMMs' rate over torch._grouped_mm's (precision.bf16_experts=cublas) for
    local experts of ``rows`` rows x ``d_model`` x ``hidden``: BF16_CUBLAS_MEASURED's ratios, linear in
    log(rows x d_model x hidden) between the measured shapes, the nearest end's ratio outside them."""
    return _log_interpolated([(r * d * f, grouped / cublas) for r, d, f, grouped, cublas in BF16_CUBLAS_MEASURED.values()],
                             rows * d_model * hidden)


def fp8_rowwise_speedup(rows: float, d_model: int, hidden: int, fast_accum: bool) -> float:
    """fp8_rowwise's grouped GEMMs' rate over torch._grouped_mm's for local experts of ``rows`` rows x
    ``d_model`` x ``hidden``: FP8_ROWWISE_MEASURED's ratios (with fast_accum or fp32 promotion), as
    cublas_bf16_speedup interpolates its own."""
    return _log_interpolated([(r * d * f, fast if fast_accum else promoted)
                              for r, d, f, promoted, fast in FP8_ROWWISE_MEASURED.values()], rows * d_model * hidden)


def _log_interpolated(points: list[tuple[float, float]], size: float) -> float:
    """The ratio at ``size`` of measured (size, ratio) points: linear in log(size) between them, the
    nearest end's ratio outside."""
    points = sorted(points)
    if size <= points[0][0]:
        return points[0][1]
    for (s0, r0), (s1, r1) in zip(points, points[1:]):
        if size <= s1:
            return r0 + (r1 - r0) * math.log(size / s0) / math.log(s1 / s0)
    return points[-1][1]


def stage_time(cfg: ModelConfig, layers: list[int], *, sw: Switches, memory: MemoryConfig, gpu: GPU, seq_len: int,
               tokens: int, ep: int, compiled: bool, microbatches: int = 1, last: bool = False,
               all_to_all: bool = True, fp32_master: bool = True, deterministic: bool = False) -> tuple[float, dict]:
    """Seconds for one micro-batch of ``tokens`` forward + backward through blocks ``layers`` (with
    E/ep local experts fed T*K rows), and its parts. ``last``: the stage holds the LM head and loss.
    ``all_to_all``: the EP dispatch / combine is run (exposed); ``fp32_master``: the bf16 experts recast
    fp32 master weights in backward (False where the weights are bf16 already, as tools/bench_slice.py
    holds them). ``microbatches`` spreads an eager run's weight-cache quantization over the step.
    ``deterministic``: trainer.deterministic's attention kernels (DETERMINISTIC_ATTN)."""
    mem, T_mb, m = memory, tokens, microbatches
    bf16_flops = gpu.bf16_tflops * 1e12
    width = attention_widths(cfg)[0]
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

    moe = cfg.moe
    # a local expert's rows: its share of the tokens' top-k choices, gathered from the ep ranks
    rows = tokens * moe.router.top_k * ep / moe.num_experts if moe is not None else 0.0
    expert_share = expert_gemm_share(rows, cfg.d_model, moe.expert_hidden) if moe is not None else 1.0
    bf16_grouped = bf16_rate(gpu, expert_share)  # the bf16 experts' rate; the ratios below scale it

    def module_time(k: str, grouped: bool, rate: float) -> float:
        """A module's GEMMs at ``rate``, their wgrad third at the bf16 rate under fp8_wgrad=false."""
        flops = T_mb * extra * by_module[k]
        if not sw.bf16_wgrad(k):
            return flops / rate
        return flops * 2 / 3 / rate + flops / 3 / (bf16_grouped if grouped else bf16_rate(gpu))

    passes = 4 if sw.bf16_wgrad("experts") else 6  # the cuBLAS loop's passes per layer (gate|up, down)
    t_experts = module_time("experts", True, gemm_rate(gpu, sw, "experts", True, expert_share))
    if sw.fp8_blockwise_experts and sw.fp8_experts == "cublas":
        # [measured] one cuBLAS call per local expert for each of a layer's fp8 GEMM passes (gate|up and
        # down: forward, dgrad, wgrad), each ~55 us of CPU: the GPU waits where those add up to more
        calls = sum(passes * cfg.moe.num_experts // ep for i in layers if cfg.is_moe_layer(i)) * extra
        t_experts = max(module_time("experts", True, gpu.fp8_tflops * 1e12 * EFF_FP8_CUBLAS_EXPERT),
                        calls * CUBLAS_CALL_S)
    elif sw.rowwise_native and sw.low("experts"):
        # [measured, session 11] torch._scaled_grouped_mm at the grouped rate x the probe's ratio at this
        # GEMM size (its wgrad third at the bf16 grouped rate under fp8_wgrad none / dense)
        speedup = fp8_rowwise_speedup(rows, cfg.d_model, moe.expert_hidden, sw.fp8_fast_accum)
        t_experts = module_time("experts", True, bf16_grouped * speedup)
    elif sw.cublas_bf16_experts:
        # [measured, session 9] one torch.mm per local expert for each of the 6 bf16 GEMM passes of a
        # layer: the grouped rate x cuBLAS's measured ratio at this GEMM size, or the CPU time per call
        # the host syncs expose, whichever is longer
        calls = sum(6 * moe.num_experts // ep for i in layers if cfg.is_moe_layer(i)) * extra
        rate = bf16_grouped * cublas_bf16_speedup(rows, cfg.d_model, moe.expert_hidden)
        t_experts = max(module_time("experts", True, rate), calls * BF16_CUBLAS_CALL_S)
    t_gemm = T_mb * extra * other_f / bf16_rate(gpu) + t_experts + sum(
        module_time(k, False, gemm_rate(gpu, sw, k, False)) for k in ("attention", "mlp"))
    t_attn = T_mb * attn_f / (bf16_flops * EFF_ATTN) * extra * (DETERMINISTIC_ATTN if deterministic else 1.0)
    ref_bytes = sum(reference_activation_bytes(cfg, i) for i in layers)
    traffic = HBM_TRAFFIC["compiled" if compiled else "eager"] * ref_bytes * T_mb * extra
    if sw.bf16_residual:  # [measured fit] the stream and its gradient in bf16 (RESIDUAL_SAVED_BYTES)
        traffic -= RESIDUAL_SAVED_BYTES * cfg.d_model * len(layers) * T_mb * extra
    # [measured fit] eager only (Switches): the Triton norm's passes over every normed element, RoPE's over q and k
    if sw.triton_rmsnorm:
        normed = sum(w for rows in block_norms(cfg, sw).values() for w, _ in rows)
        traffic -= EAGER_NORM_SAVED_BYTES * normed * len(layers) * T_mb * extra
    if sw.triton_rope:
        traffic -= EAGER_ROPE_SAVED_BYTES * sum(attention_widths(cfg)) * len(layers) * T_mb * extra
    # [code] the bf16 experts recast their fp32 weights in backward (read 4 + write 2 B per
    # element) and recompute the SwiGLU product (read gate|up, write silu and product: ~10 B x F per row;
    # 2 B less where save_swiglu_product kept the product: its write gone).
    recast = 0.0
    if cfg.moe is not None and not sw.low("experts"):
        for i in layers:
            if cfg.is_moe_layer(i):
                recast += (6.0 * _expert_params(cfg, i) / ep if fp32_master and not sw.expert_weight_copies else 0.0) + \
                    (8.0 if sw.save_swiglu_product else 10.0) * cfg.moe.expert_hidden * cfg.moe.router.top_k * T_mb
    # [code bytes, assumed rates] quantization passes over every low-precision GEMM's operands;
    # mxfp8 emulated: its kernels' bytes at their measured rates (mx_emulated_quant_s)
    quant = t_mx = 0.0
    if sw.recipe != "bf16":
        qb = QUANT_BYTES[sw.backend]
        for i in layers:
            ops, wl = _gemm_operands(cfg, i, sw.quantize_input_once), _linear_params(cfg, i)
            for k in modules:
                if not sw.low(k):
                    continue
                weights = wl[k] / (ep if k == "experts" else 1)
                if sw.mx_emulated:
                    t_mx += mx_emulated_quant_s(gpu, sw, k, ops[k][0] * T_mb, ops[k][1] * T_mb, weights,
                                                i in recomputed, m)
                    continue
                if sw.rowwise_native:
                    t_mx += rowwise_quant_s(gpu, sw, k, sum(_operand_widths(cfg, i, sw.quantize_input_once)[k], []), T_mb, weights,
                                            2.0 if i in recomputed else 1.0, m)
                    continue
                quant += (QUANT_ROWS_BYTES if sw.bf16_wgrad(k) else qb) * sum(ops[k]) * T_mb * extra
                # the cache: once per step; a traced graph: forward and backward of every micro-batch
                cached = sw.caches_weights(k)
                quant += weight_quant_bytes(sw, k, cached) * weights * (1 / m if cached else 2 * extra)
    t_hbm = traffic / gpu.stream_bps
    # the recast's bytes are counted, streamed like the traffic; QUANT_BYTES are measured rates written as
    # bytes at the datasheet's rate
    t_extra = recast / gpu.stream_bps + quant / (gpu.hbm_tbps * 1e12) + t_mx
    t_a2a = 0.0
    if all_to_all and cfg.moe is not None and ep > 1:
        K = cfg.moe.router.top_k
        rows_out = T_mb * (ep - 1) if K >= ep else T_mb * K * (ep - 1) / ep  # all_gather vs synced
        n_moe = sum(1 for i in layers if cfg.is_moe_layer(i))
        passes = 4 + (2 * share if share else 0)  # dispatch + combine, fwd and bwd (+ recompute)
        t_a2a = n_moe * passes * rows_out * cfg.d_model * 2.0 / _group_bw(gpu, ep, 1)
    return t_gemm + t_attn + t_hbm + t_extra + t_a2a, {"gemm": t_gemm, "attention": t_attn, "hbm": t_hbm,
                                                     "recast_quant": t_extra, "ep_a2a": t_a2a}
