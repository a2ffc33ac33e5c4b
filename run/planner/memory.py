"""The planner's memory terms, per block and per rank [code, and the measured compiled breakdown]:
the saved activations of a block (activation_terms, under the recompute policy
block_activation_bytes), a rank's GEMM weights by precision module (stage_linear), what the loss
holds (loss_memory), what a block's backward allocates beyond its gradients
(block_backward_transient), and for one rank's slice the terms freed at its peak and the experts'
gate|up wgrad transient. model.py adds them up to a rank's peak."""

from __future__ import annotations

__all__ = ['SLICE_FREED', 'SLICE_FREED_AT_GATE_UP', 'activation_terms', 'attention_widths', 'block_activation_bytes',
           'block_norms',
           'block_backward_transient', 'gate_up_wgrad_transient', 'loss_memory', 'stage_linear']

import torch

from moetron.core.layers.loss import chunk_bounds, logit_bytes
from moetron.core.memory import MemoryConfig, Recompute
from moetron.core.precision.blockwise import FP8_BLOCK
from moetron.core.precision.grouping import padded_rows
from moetron.models import BlockType, ModelConfig
from .hardware import FP8_SAVED
from .switches import Switches


def activation_terms(cfg: ModelConfig, layer: int, sw: Switches = Switches(),
                     bf16_params: bool = False) -> dict[str, tuple[str, float]]:
    """Saved-for-backward bytes per token of one block, by term: {name: (module it belongs to for
    selective recompute, bytes)}.

    Eager, counted from the code: the residual stream is fp32 (bf16 under precision.bf16_residual, and
    then q, k and v, and a dense SwiGLU's gate and up, save the one bf16 input); torch's RMSNorm keeps
    an fp32 input and normalized output, model.triton_rmsnorm's its input and a scale a row
    (_norm_saved over block_norms: which norms a block has and what each reads); each linear keeps its input as its GEMM saves it (bf16, or fp8 + scales under a
    low-precision recipe; q, k, v separately, or once with precision.quantize_input_once, and so a
    dense SwiGLU's gate and up); rope multiplies by constant tables (nothing per token);
    SDPA keeps q, k, v, out; the MoE layer keeps x_TD, the T*K dispatched rows x_RD, the gate|up
    output h and the expert outputs y_RD (the combine's weight gradient); the bf16 experts' fused
    SwiGLU-down op recomputes the product (core/precision/bf16_grouped.py; keeps it, 2 B x K x F, with
    save_swiglu_product), a low-precision backend
    composes it (silu(gate) and the product, fp8, kept); a dense SwiGLU keeps gate, up, silu, product.

    precision.bf16_residual, compiled: the norms' [T, D] is the stream's, 2 B.

    Compiled, from the measured OLMoE-8L breakdown (tools/bench_memory.py, 143 KiB/token/block once
    the expert weight copies and the product were gone), generalized by shape: [T, *] bf16 x5 (the
    qkv input, q and k before their norms, the o-proj input, one more [T, D]), q, k, v, out for SDPA,
    x_RD, h, y_RD, one fp32 [T, D] for the norms and 0.5 D + 4 E bytes of router state; a dense
    SwiGLU (not measured) keeps its input, gate|up and the product. A low-precision recipe's q, k and
    v (gate and up) keep a quantized input each, or one with precision.quantize_input_once (measured
    with native fp8_blockwise, session 38).

    ``bf16_params`` (tools/bench_slice.py's blocks: bf16 weights and a bf16 stream, no autocast
    casts): eager, q, k and v save the one bf16 norm output (autocast casts an fp32 input once per
    linear); the rest is the same count.
    """
    D = cfg.d_model
    att = cfg.attention
    A, G = attention_widths(cfg)
    g_att, g_mlp, g_exp = sw.saved_input("attention"), sw.saved_input("mlp"), sw.saved_input("experts")
    terms: dict[str, tuple[str, float]] = {}
    moe = cfg.moe if cfg.is_moe_layer(layer) else None
    if not sw.compiled:
        norms = {name: ("norm", sum(_norm_saved(sw, w, b) for w, b in rows))
                 for name, rows in block_norms(cfg, sw, bf16_params).items()}
        terms["attn_norm"] = norms["attn_norm"]
        shared = sw.quantize_input_once and sw.low("attention")  # one saved operand for q, k and v
        bf16_in = (bf16_params or sw.bf16_residual) and not sw.low("attention")  # q, k, v read one bf16 tensor
        terms["qkv_inputs"] = ("attention", (1 if bf16_in or shared else 3) * g_att * D)
        if att.qk_norm:
            terms["qk_norm"] = norms["qk_norm"]
        terms["sdpa_qkv_out"] = ("attention", 2.0 * (A + 2 * G) + 2.0 * A)
        terms["o_proj_input"] = ("attention", g_att * A)
        terms["mlp_norm"] = norms["mlp_norm"]
        if moe is not None:
            K, F, E = moe.router.top_k, moe.expert_hidden, moe.num_experts
            terms["router"] = ("router", 4.0 * D + 4.0 * E)  # fp32 input + softmax probs
            terms["dispatch_rows"] = ("experts", 2.0 * D + g_exp * K * D)  # x_TD bf16 + x_RD (T*K rows)
            terms["expert_hidden"] = ("experts", K * 4.0 * F)  # gate|up output of the grouped GEMM
            if sw.low("experts"):  # composed SwiGLU: silu(gate) and the product (w_down's input)
                terms["expert_swiglu"] = ("swiglu", K * (2.0 * F + g_exp * F))
            elif sw.save_swiglu_product:  # the fused op keeps its product (precision.save_swiglu_product)
                terms["expert_product"] = ("swiglu", K * 2.0 * F)
            if not moe.weights_before_down:  # the weights applied before the down projection: no y_RD kept
                terms["expert_out"] = ("experts", 2.0 * K * D)  # y_RD for the combine's weight gradient
            if moe.shared_width():
                S = moe.shared_width()
                terms["shared_mlp"] = ("mlp", 4.0 * S + g_mlp * D)
                terms["shared_swiglu"] = ("swiglu", 2.0 * S + g_mlp * S)
        else:
            H = cfg.mlp_hidden
            one = (sw.quantize_input_once and sw.low("mlp")) or (sw.bf16_residual and not sw.low("mlp"))
            terms["mlp"] = ("mlp", (1 if one else 2) * g_mlp * D + 4.0 * H)
            terms["mlp_swiglu"] = ("swiglu", 2.0 * H + g_mlp * H)
        return terms
    # a low-precision recipe's linears each save their own quantized input unless they share one
    # (precision.quantize_input_once; measured: native fp8_blockwise OLMoE-8L +0.5 GiB and olmoe3-4l-8e
    # +0.77 GiB without it, session 38); bf16's q, k and v save the one tensor
    copies = lambda module, n: 1 if not sw.low(module) or sw.quantize_input_once else n  # noqa: E731
    terms["norms"] = ("norm", sw.stream_bytes() * D)  # the stream's [T, D]
    terms["qkv_input"] = ("attention", copies("attention", 3) * g_att * D)
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
        elif sw.save_swiglu_product:
            terms["expert_product"] = ("swiglu", K * 2.0 * F)
        if not moe.weights_before_down:
            terms["expert_out"] = ("experts", 2.0 * K * D)
        if moe.shared_width():
            S = moe.shared_width()
            terms["shared_mlp"] = ("mlp", copies("mlp", 2) * g_mlp * D + 4.0 * S)
            terms["shared_swiglu"] = ("swiglu", g_mlp * S)
    else:
        H = cfg.mlp_hidden
        terms["mlp"] = ("mlp", copies("mlp", 2) * g_mlp * D + 4.0 * H)
        terms["mlp_swiglu"] = ("swiglu", g_mlp * H)
    return terms


def attention_widths(cfg: ModelConfig) -> tuple[int, int]:
    """(A, G): the query width (heads x head width) and the key / value width (kv heads x head width)."""
    att = cfg.attention
    hd = att.head_width(cfg.d_model)
    return att.n_heads * hd, att.kv_heads() * hd


def block_norms(cfg: ModelConfig, sw: Switches, bf16_params: bool = False) -> dict[str, list[tuple[int, float]]]:
    """A block's RMSNorms by activation term, each as (width, bytes an element of its input) [code]: the
    two block norms read the stream (pre_norm: Switches.stream_bytes) or a linear's bf16 output
    (reordered_norm, Olmo 3's); the q and k norms (QK-norm) a linear's bf16 output. The one count of the
    norms that the eager memory terms and the eager norm's traffic term (timing.stage_time) take."""
    D = cfg.d_model
    block_in = sw.stream_bytes(bf16_params) if cfg.block_type == BlockType.pre_norm else 2.0
    norms = {"attn_norm": [(D, block_in)], "mlp_norm": [(D, block_in)]}
    if cfg.attention.qk_norm:
        A, G = attention_widths(cfg)
        norms["qk_norm"] = [(A, 2.0), (G, 2.0)]
    return norms


def _norm_saved(sw: Switches, width: int, x_bytes: float) -> float:
    """Bytes per token an eager RMSNorm of ``width`` keeps for its backward [code]: torch's path an fp32
    x (the input, or its fp32 copy) and the fp32 normalized rows, 8 B an element; model.triton_rmsnorm's
    kernel its input as it came (``x_bytes`` an element) and one fp32 scale a row."""
    return x_bytes * width + 4.0 if sw.triton_rmsnorm else 8.0 * width


def block_activation_bytes(cfg: ModelConfig, layer: int, memory: MemoryConfig, sw: Switches = Switches(),
                           bf16_params: bool = False) -> float:
    """Saved bytes per token of block ``layer`` under the recompute policy: the block input (fp32
    residual; bf16 under ``bf16_params`` or precision.bf16_residual) alone for a fully recomputed
    block; the named modules' terms dropped for selective."""
    if memory.recompute == Recompute.full and layer % memory.recompute_every == 0:
        return sw.stream_bytes(bf16_params) * cfg.d_model
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
    A, G = attention_widths(cfg)
    out = {"attention": D * (2 * A + 2 * G), "mlp": 0, "experts": 0}
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        out["experts"] = moe.num_experts * 3 * D * moe.expert_hidden
        out["mlp"] = 3 * D * moe.shared_width()
    else:
        out["mlp"] = 3 * D * cfg.mlp_hidden
    return out


def loss_memory(cfg: ModelConfig, sw: Switches, tokens: int) -> dict[str, float]:
    """Bytes the LM head's loss holds for a micro-batch of ``tokens`` [code]:
    ``saved`` (kept from its forward until its backward), ``peak`` (all it holds at its own peak,
    saved included) and ``where`` that peak is.

    fused (core/layers/loss.py): grad_h [T, D] (h's dtype: the residual stream's, fp32 or bf16 under
    precision.bf16_residual) and grad_W [V, D] (fp32, or bf16 under head_grads_bf16 in one chunk:
    Switches.head_grad_bytes) are kept; its forward's last chunk also holds the bf16 weight (unless head_weight_copy: the
    optimizer's copy, counted with the step's copies) and hidden casts and one
    chunk's bf16 logits, turned into dlogits in place by the Triton kernel that CUDA runs (2 B x C x V;
    C the largest of the balanced chunks, chunk_bounds);
    its backward holds both kept gradients and their scaled copies, or, with fused_loss_prescale,
    hands the kept ones on (nothing more). plain: the fp32 log-softmax
    [T, V] and the head's bf16 input are kept; inside its backward the nll gradient, the log-softmax
    gradient (fp32) and the bf16 logits' gradient join them: 10 B per logit, which is what the
    OLMoE-8L measurement holds at its peak (15.37 GiB at 16384 x 100352) [measured]."""
    T, D, V = tokens, cfg.d_model, cfg.vocab_size
    stream = sw.stream_bytes()
    norm = stream * T * D  # the final RMSNorm's input
    if sw.fused_loss:
        saved = norm + stream * T * D + sw.head_grad_bytes(T) * V * D
        C = max((end - start for start, end in chunk_bounds(T, sw.loss_chunk_tokens)), default=0)
        w_cast = 0.0 if sw.head_weight_copy else 2.0 * V * D  # head_weight_copy: the step's copy (held elsewhere)
        in_forward = saved + w_cast + 2.0 * T * D + logit_bytes(torch.bfloat16, triton=True) * C * V
        in_backward = saved + (0.0 if sw.fused_loss_prescale else stream * T * D + sw.head_grad_bytes(T) * V * D)
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
    # a bf16 wgrad (precision.fp8_wgrad none / dense) quantizes nothing along the tokens
    dh_tokens = 0.0 if sw.bf16_wgrad("experts") else FP8_SAVED * P * 2 * F
    # the bf16 gradient the wgrad writes: every kernel stores the weight's dtype itself (the FP8 ones
    # since session 37: fp8_triton.fp8_grouped_mm_k's out_dtype; an fp32 output and its cast, 6 B, before)
    out = {"dh_tokens": dh_tokens, "dx": 2.0 * R * D, "wgrad": 2.0 * local * 2 * F * D}
    if sw.compiled:
        out["block_grads"] = 2.0 * (local * D * F + 3 * D * S)
    else:
        out["dh_and_rows"] = (2.0 + FP8_SAVED) * R * 2 * F
    return out
