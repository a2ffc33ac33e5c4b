"""One-pass AdamW update in Triton: each parameter tensor is read and written once (p, grad, both
moments, and optionally a bf16 copy of the updated weight), where torch's foreach path makes about
ten passes and its fused kernel cannot store bf16 moments.

The maths is torch.optim.AdamW's foreach (non-capturable) path on CUDA, operation for operation in
fp32 and in its order, with the FMAs nvcc forms in those kernels written out (tl.fma) and Triton's
own contraction off, IEEE division and square root (div_rn, sqrt_rn; Triton's defaults are
approximate):

    p  = p * (1 - lr * wd)                          # _foreach_mul_
    m  = fma(1 - beta1, g - m, m)                   # _foreach_lerp_ (weight < 0.5; else its other form)
    v  = fma(1 - beta2, g * g, v * beta2)           # _foreach_mul_, _foreach_addcmul_
    d  = sqrt(v) / sqrt(1 - beta2^t) + eps          # _foreach_sqrt, _foreach_div_, _foreach_add_
    p  = fma(-lr / (1 - beta1^t), m / d, p)         # _foreach_addcdiv_

Every scalar is computed on the host in double from the step count, as torch does, and rounded to
fp32 where torch's kernels take it (opmath float). bf16 moments are widened exactly and stored
rounded to nearest even (written with integer ops, so the interpreter rounds as the GPU does); the
update uses the unrounded fp32 moments, as core.adamw.PrecisionAwareAdamW's foreach path does.

Runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (set before triton is imported).
Tensors must be contiguous; p fp32; grad fp32 or bf16; moments fp32 or bf16.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .precision import mx_triton
from .precision.mx_triton import (HW_CONVERT, abs_bits, exp2_int, lean_block_scale, lean_qdq, lean_rows_qdq,
                                   store_bf16, tile_grid, tile_ids, to_e4m3, widen)
from .moments_q8 import (CODE_DTYPES, E4M3_MIN_NORMAL, FP8, FP8_ROOT_FLOOR, FP32_MIN_NORMAL, QBLOCK, TABLE,
                         kernel_tables, scale_dtype, scale_shape, sr_key)
from .triton_round import load_fp32, round_to_bf16, store_rounded

__all__ = ["BLOCK", "FP8_ROWS", "MX_PAIR_TILE_COLS", "MX_PAIR_WARPS", "Q8_ROWS", "Q8_WARPS", "adamw_update_",
           "adamw_update_mx_pair_", "adamw_update_q8_", "adamw_update_split_", "fmix32", "q8_encode", "sr_e4m3"]

BLOCK = 1024
"""Elements per program when a call names none (read at each call; tools/bench_optim.py --block
sweeps it). 4 warps up to 2048 (8 or 16 fp32 per thread: 16-byte loads), 8 above."""


@triton.jit
def _adamw_math(p, g, m, v, decay, lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size,
                LERP_SMALL: tl.constexpr):
    """(p, m, v) after one AdamW step of fp32 values (the module docstring's operations, in order)."""
    p = p * decay
    # torch's lerp (ATen/native/Lerp.h): the form whose weight is small, for accuracy
    if LERP_SMALL:
        m = tl.fma(lerp_weight, g - m, m)
    else:
        m = tl.fma(-(g - m), 1.0 - lerp_weight, g)
    v = tl.fma(one_minus_beta2, g * g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = tl.fma(neg_step_size, tl.div_rn(m, denom), p)
    return p, m, v


@triton.jit
def join_split(hi, lo):
    """The fp32 master held split (SPLIT_MASTER): its bf16 rounding ``hi`` (int16 bits) and the remainder
    ``lo`` (int16, |lo| <= 32767 units of the fp32's last bit) -> the fp32 value, exactly."""
    bits = (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16) + lo.to(tl.int32).to(tl.uint32, bitcast=True)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def store_split(hi_ptr, lo_ptr, p, mask):
    """fp32 p held split: hi = p rounded to the nearest even bf16 (by the bits; as round_to_bf16 for
    every non-NaN p), lo = p - hi in units of p's last bit, clamped to +-32767: the one value out of
    that range is a tie (p's low half exactly 0x8000, the rounding's +-32768), so at a tie the master
    kept moves one fp32 ulp toward hi (core.adamw.split_fp32, the reference)."""
    bits = p.to(tl.uint32, bitcast=True)
    hi = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    lo = (bits - (hi << 16)).to(tl.int32, bitcast=True)
    lo = tl.minimum(tl.maximum(lo, -32767), 32767)
    tl.store(hi_ptr, hi.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    tl.store(lo_ptr, lo.to(tl.int16), mask=mask)


@triton.jit
def _load_p_g(p_ptr, lo_ptr, g_ptr, scale_ptr, offs, mask, GRAD_BF16: tl.constexpr, GRAD_SCALE: tl.constexpr,
              SPLIT: tl.constexpr):
    """The master p (fp32; SPLIT: held split, ``p_ptr`` its bf16 half's int16 bits and ``lo_ptr`` the rest,
    join_split) and the gradient at ``offs`` (fp32, times the clip coefficient where GRAD_SCALE)."""
    if SPLIT:
        p = join_split(tl.load(p_ptr + offs, mask=mask, other=0), tl.load(lo_ptr + offs, mask=mask, other=0))
    else:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = load_fp32(g_ptr + offs, mask, GRAD_BF16)
    if GRAD_SCALE:  # the clip coefficient, as torch._foreach_mul_(grads, coef) would apply it
        g = g * tl.load(scale_ptr)
    return p, g


@triton.jit
def _store_p(p_ptr, lo_ptr, p, offs, mask, SPLIT: tl.constexpr):
    """_load_p_g's master written back: split (store_split) or fp32."""
    if SPLIT:
        store_split(p_ptr + offs, lo_ptr + offs, p, mask)
    else:
        tl.store(p_ptr + offs, p, mask=mask)


@triton.jit
def _adamw_at(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, offs, mask, decay, lerp_weight, beta2, one_minus_beta2, bc2_sqrt,
              eps, neg_step_size, GRAD_BF16: tl.constexpr, STATE_BF16: tl.constexpr, LERP_SMALL: tl.constexpr,
              GRAD_SCALE: tl.constexpr, lo_ptr=None, SPLIT: tl.constexpr = False):
    """One AdamW step of the elements at ``offs`` (loaded, updated by _adamw_math, stored); the new p.
    SPLIT: the master is held split (_load_p_g)."""
    p, g = _load_p_g(p_ptr, lo_ptr, g_ptr, scale_ptr, offs, mask, GRAD_BF16, GRAD_SCALE, SPLIT)
    m = load_fp32(m_ptr + offs, mask, STATE_BF16)
    v = load_fp32(v_ptr + offs, mask, STATE_BF16)
    p, m, v = _adamw_math(p, g, m, v, decay, lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size,
                          LERP_SMALL)
    _store_p(p_ptr, lo_ptr, p, offs, mask, SPLIT)
    store_rounded(m_ptr + offs, m, mask, STATE_BF16)
    store_rounded(v_ptr + offs, v, mask, STATE_BF16)
    return p


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, scale_ptr, n, decay, lerp_weight, beta2, one_minus_beta2,
                  bc2_sqrt, eps, neg_step_size,
                  GRAD_BF16: tl.constexpr, STATE_BF16: tl.constexpr, LERP_SMALL: tl.constexpr,
                  WRITE_OUT: tl.constexpr, GRAD_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                  SPLIT: tl.constexpr = False):
    """One AdamW step of BLOCK elements; WRITE_OUT: their bf16 rounding into out_ptr too; SPLIT: the master
    held split, p_ptr its bf16 half (int16 bits), out_ptr the rest (_adamw_at)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = _adamw_at(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, offs, mask, decay, lerp_weight, beta2, one_minus_beta2,
                  bc2_sqrt, eps, neg_step_size, GRAD_BF16, STATE_BF16, LERP_SMALL, GRAD_SCALE, out_ptr, SPLIT)
    if WRITE_OUT:
        tl.store(out_ptr + offs, round_to_bf16(p), mask=mask)


@triton.jit
def _adamw_mx_pair_kernel(p_ptr, g_ptr, m_ptr, v_ptr, rows_ptr, cols_ptr, scale_ptr, P, C, decay, lerp_weight, beta2,
                          one_minus_beta2, bc2_sqrt, eps, neg_step_size,
                          GRAD_BF16: tl.constexpr, STATE_BF16: tl.constexpr, LERP_SMALL: tl.constexpr,
                          GRAD_SCALE: tl.constexpr, FLOOR: tl.constexpr, HW: tl.constexpr, TC: tl.constexpr,
                          COLS_FIRST: tl.constexpr):
    """_adamw_kernel's update of a [32, TC] tile of the 2-D view [P, C] (P, C multiples of 32), then
    the updated weight rounded to bf16 and quantized to MX both ways from the tile (the lean
    arithmetic of mx_triton's fused kernel, on the bf16 bits): along C into ``rows`` and along the
    32 rows into ``cols``, each dequantized to bf16. COLS_FIRST: the tiles' order
    (mx_triton.GRID_COLS_FIRST)."""
    pid_p, pid_c = tile_ids(C, TC, COLS_FIRST)
    r = pid_p * 32 + tl.arange(0, 32)
    c = pid_c * TC + tl.arange(0, TC)
    mask = (r[:, None] < P) & (c[None, :] < C)
    offs = r[:, None].to(tl.int64) * C + c[None, :]
    p = _adamw_at(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, offs, mask, decay, lerp_weight, beta2, one_minus_beta2,
                  bc2_sqrt, eps, neg_step_size, GRAD_BF16, STATE_BF16, LERP_SMALL, GRAD_SCALE)
    bits = round_to_bf16(p).to(tl.int16, bitcast=True)  # the bf16 compute copy's bits
    x = widen(bits, True, HW)
    a = abs_bits(bits, True)
    store_bf16(rows_ptr + offs, lean_rows_qdq(x, a, FLOOR, True, HW, TC), mask, HW)
    e_c, _, fin_c = lean_block_scale(tl.max(a, axis=0), FLOOR, True)
    _, deq_c = lean_qdq(x, e_c[None, :], fin_c[None, :], HW)
    store_bf16(cols_ptr + offs, deq_c, mask, HW)


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32 (Triton passes float arguments as fp32; this makes the
    rounding explicit and the same under the interpreter)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def adamw_update_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  out_bf16: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None,
                  block: int | None = None) -> None:
    """One AdamW step of one tensor, in place, in one kernel launch.

    ``p`` fp32 [N...]; ``grad`` fp32 or bf16, ``exp_avg`` / ``exp_avg_sq`` fp32 or bf16 (the same
    dtype), all of p's shape, contiguous, on p's device; ``step``: the step count after this step's
    increment (1 on the first); ``out_bf16``: None, or a contiguous bf16 tensor of p's shape that
    receives the updated p rounded to nearest; ``grad_scale``: None, or a 0-dim fp32 tensor on p's
    device multiplying the gradient first (the gradient-clipping coefficient, read on the device:
    the same fp32 product torch._foreach_mul_ forms, without the pass over the gradients). No host
    sync: every other scalar is a host float."""
    n = p.numel()
    args = _scalars(p, grad, exp_avg, exp_avg_sq, [] if out_bf16 is None else [out_bf16], grad_scale, step=step, lr=lr,
                    beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if n == 0:
        return
    block = block or BLOCK
    grid = (triton.cdiv(n, block),)
    _adamw_kernel[grid](
        p, grad, exp_avg, exp_avg_sq, p if out_bf16 is None else out_bf16,
        p if grad_scale is None else grad_scale, n, *args,
        GRAD_BF16=grad.dtype == torch.bfloat16, STATE_BF16=exp_avg.dtype == torch.bfloat16,
        LERP_SMALL=abs(args[1]) < 0.5, WRITE_OUT=out_bf16 is not None,
        GRAD_SCALE=grad_scale is not None, BLOCK=block,
        num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False,
    )


def adamw_update_split_(hi: torch.Tensor, lo: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                        exp_avg_sq: torch.Tensor, *, step: float, lr: float, beta1: float, beta2: float, eps: float,
                        weight_decay: float, grad_scale: torch.Tensor | None = None,
                        block: int | None = None) -> None:
    """adamw_update_ of an fp32 master held split (optimizer.split_master): ``hi`` bf16, its rounding
    to nearest even, which the model computes with, and ``lo`` int16, the rest
    (core.adamw.join_fp32(hi, lo) is the master). Reads and writes 8 bytes of master an element where
    adamw_update_ with out_bf16 moves 10 (read 4, write 4 + 2); the same update of the joined master
    bit for bit, written back split (store_split: at a bf16 tie the kept master moves one fp32 ulp
    toward hi). Arguments as adamw_update_'s."""
    if hi.dtype != torch.bfloat16 or lo.dtype != torch.int16:
        raise TypeError(f"adamw_update_split_ takes a bf16 hi and an int16 lo, got {hi.dtype} and {lo.dtype}")
    n = hi.numel()
    args = _scalars(hi, grad, exp_avg, exp_avg_sq, [hi], grad_scale, step=step, lr=lr, beta1=beta1, beta2=beta2,
                    eps=eps, weight_decay=weight_decay, master=False)
    if lo.shape != hi.shape or lo.device != hi.device or not lo.is_contiguous():
        raise ValueError("adamw_update_split_ needs a contiguous lo of hi's shape on its device")
    if n == 0:
        return
    block = block or BLOCK
    grid = (triton.cdiv(n, block),)
    _adamw_kernel[grid](
        hi.view(torch.int16), grad, exp_avg, exp_avg_sq, lo, hi if grad_scale is None else grad_scale, n, *args,
        GRAD_BF16=grad.dtype == torch.bfloat16, STATE_BF16=exp_avg.dtype == torch.bfloat16,
        LERP_SMALL=abs(args[1]) < 0.5, WRITE_OUT=False, GRAD_SCALE=grad_scale is not None, BLOCK=block,
        SPLIT=True, num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False,
    )


def _scalars(p, grad, exp_avg, exp_avg_sq, outs, grad_scale, *, step, lr, beta1, beta2, eps, weight_decay,
             master: bool = True, moments: bool = True) -> tuple:
    """The update's checks (TypeError / ValueError naming the tensor) and its fp32 scalars, in the
    kernels' order: decay, lerp weight, beta2, 1 - beta2, sqrt(bias correction 2), eps, -step size.
    ``moments``: check the moments' dtypes too (fp32 or bf16; the 8-bit kernel checks its own)."""
    if master and p.dtype != torch.float32:
        raise TypeError(f"adamw_update_ takes fp32 parameters, got {p.dtype}")
    if moments and (exp_avg.dtype != exp_avg_sq.dtype or exp_avg.dtype not in (torch.float32, torch.bfloat16)):
        raise TypeError(f"moments must both be fp32 or bf16, got {exp_avg.dtype} and {exp_avg_sq.dtype}")
    if grad.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"grad must be fp32 or bf16, got {grad.dtype}")
    for out in outs:
        if out.dtype != torch.bfloat16:
            raise TypeError(f"the bf16 outputs must be bf16, got {out.dtype}")
    if any(t.shape != p.shape or t.device != p.device or not t.is_contiguous()
           for t in (p, grad, exp_avg, exp_avg_sq, *outs)):
        raise ValueError("adamw_update_ needs contiguous tensors of the parameter's shape on its device")
    if grad_scale is not None and (grad_scale.dtype != torch.float32 or grad_scale.numel() != 1
                                   or grad_scale.device != p.device):
        raise ValueError("grad_scale must be a one-element fp32 tensor on the parameter's device")
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return (_fp32(1 - lr * weight_decay), _fp32(1 - beta1), _fp32(beta2), _fp32(1 - beta2),
            _fp32(bias_correction2**0.5), _fp32(eps), _fp32((lr / bias_correction1) * -1))


MX_PAIR_TILE_COLS = 128
"""Columns per program of adamw_update_mx_pair_ (32 rows each), read at each call (tools/bench_optim.py
--mx-tiles sweeps it with MX_PAIR_WARPS)."""
MX_PAIR_WARPS = 8
"""Warps per program of adamw_update_mx_pair_, read at each call. 8 with 128 columns: the fastest of
eight tiles on an H100 (session 28, twice: 32.2 ms against 4 warps' 33.5 ms for 3.77B parameters) and
on the H200 within 1% of the best of four (session 29: 26.4 ms against 4 warps' 30.4, 64 x 8 26.2;
the plain copy 20.1; docs/performance.md), all in the old rows-first order. In the cols-first order
(mx_triton.GRID_COLS_FIRST, session 30, an H100): 31.14 ms, 64 x 4 31.62, the plain copy 28.01."""


def adamw_update_mx_pair_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                          rows: torch.Tensor, cols: torch.Tensor, scale_mode: str, step: float, lr: float,
                          beta1: float, beta2: float, eps: float, weight_decay: float,
                          grad_scale: torch.Tensor | None = None) -> None:
    """adamw_update_ (the same p and moments, bit for bit), then the updated weight's bf16 rounding
    quantized to MXFP8 both ways and dequantized, in the same pass: ``rows`` (bf16, p's shape)
    along the last dim (the forward GEMM's weight operand), ``cols`` along the second to last (the
    dgrad's; blocks of 32 rows never cross the leading dims) -- mx_qdq(bf16(p), -1) and (.., -2),
    what the emulated backend would make from a bf16 compute copy. ``scale_mode`` "rceil" or
    "floor". p [..., O, I] with O and I multiples of 32."""
    if scale_mode not in ("rceil", "floor"):
        raise ValueError(f"scale_mode must be rceil or floor, got {scale_mode!r}")
    if p.dim() < 2 or p.shape[-1] % 32 or p.shape[-2] % 32:
        raise ValueError(f"adamw_update_mx_pair_ takes [..., O, I] weights with O and I multiples of 32, "
                         f"got {tuple(p.shape)}")
    args = _scalars(p, grad, exp_avg, exp_avg_sq, [rows, cols], grad_scale, step=step, lr=lr, beta1=beta1,
                    beta2=beta2, eps=eps, weight_decay=weight_decay)
    C = p.shape[-1]
    P = p.numel() // C
    if P == 0:
        return
    cols_first = mx_triton.GRID_COLS_FIRST  # read at each call, as the tile
    grid = tile_grid(P // 32, triton.cdiv(C, MX_PAIR_TILE_COLS), cols_first)
    _adamw_mx_pair_kernel[grid](
        p, grad, exp_avg, exp_avg_sq, rows, cols, p if grad_scale is None else grad_scale, P, C, *args,
        GRAD_BF16=grad.dtype == torch.bfloat16, STATE_BF16=exp_avg.dtype == torch.bfloat16,
        LERP_SMALL=abs(args[1]) < 0.5, GRAD_SCALE=grad_scale is not None, FLOOR=scale_mode == "floor",
        HW=HW_CONVERT, TC=MX_PAIR_TILE_COLS, COLS_FIRST=cols_first, num_warps=MX_PAIR_WARPS,
        enable_fp_fusion=False,
    )


# ---- 8-bit moments (optimizer.state_dtype=q8 / fp8; core.moments_q8, the torch reference and q8's tables) ----

@triton.jit
def q8_encode(r, tab_ptr, ENC: tl.constexpr):
    """core.moments_q8.encode: magnitudes r (fp32, [0, 1]) -> codes (int32), the same operations in order,
    through the encoding tables at ``tab_ptr + ENC`` (core.moments_q8.kernel_tables, TABLE)."""
    e = ((r.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    row = tl.minimum(tl.maximum(e, -32), 0) + 32  # core.moments_q8.EXP_MIN
    count = tl.load(tab_ptr + ENC + row).to(tl.int32)  # TABLE.COUNT = 0
    count += (r > tl.load(tab_ptr + ENC + 33 + row)).to(tl.int32)  # TABLE.NEXT
    lo = (1 << tl.maximum(count - 1, 0)) - 1
    c = tl.floor(r * tl.load(tab_ptr + ENC + 66 + count) + tl.load(tab_ptr + ENC + 75 + count)).to(tl.int32)
    return tl.minimum(tl.maximum(c, lo), 2 * lo + 1)  # TABLE.MUL, TABLE.ADD above


@triton.jit
def fmix32(x):
    """core.moments_q8.fmix32 on int32 bits (the uint32's): logical shifts by masking, products wrapping."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * -2048144789  # 0x85ebca6b as int32
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * -1028477387  # 0xc2b2ae35 as int32
    return x ^ ((x >> 16) & 0xFFFF)


@triton.jit
def sr_e4m3(y, key):
    """core.moments_q8.sr_e4m3: fp32 y in [0, 448] rounded stochastically to E4M3's grid (fp32 values), the
    random bits fmix32((bits(y) >> 8) ^ key)'s lowest 20."""
    r = fmix32((y.to(tl.int32, bitcast=True) >> 8) ^ key) & 0xFFFFF
    sub = y < 0.015625  # E4M3's smallest normal, 2^-6
    z = tl.where(sub, y + 0.015625, y)
    out = ((z.to(tl.int32, bitcast=True) + r) & -1048576).to(tl.float32, bitcast=True)  # ~0xFFFFF
    return tl.where(sub, out - 0.015625, out)


@triton.jit
def _q8_load(codes_ptr, scales_ptr, tab_ptr, offs, soffs, mask, rmask, DEC: tl.constexpr, FP8: tl.constexpr):
    """A [rows, QB] tile of 8-bit values as fp32 (core.moments_q8.dequantize): q8, each byte's value read from
    the codebook at ``tab_ptr + DEC`` (signed or not), times its block's scale; FP8, each E4M3 value (the GPU's
    conversion) times its block's power of two, NaN under the E8M0 NaN code (core.precision.mx.dequantize_mx)."""
    if FP8:
        code = tl.load(scales_ptr + soffs, mask=rmask, other=127).to(tl.int32)[:, None]
        d = tl.load(codes_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.where(code == 255, float("nan"), d * exp2_int(tl.where(code == 255, 127, code) - 127))
    else:
        c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
        scale = tl.load(scales_ptr + soffs, mask=rmask, other=0.0)
        x = tl.load(tab_ptr + DEC + c) * scale[:, None]
    return x


@triton.jit
def _q8_store(codes_ptr, scales_ptr, tab_ptr, x, offs, soffs, mask, rmask, key, ENC: tl.constexpr,
              SIGNED: tl.constexpr, FP8: tl.constexpr, HW: tl.constexpr):
    """Store a [rows, QB] tile of fp32 values in 8 bits, each row one block (core.moments_q8.quantize_): FP8,
    as E4M3 under the block's E8M0 scale (mx_triton's lean_block_scale, rceil; the GPU's conversion, HW), to
    nearest even (SIGNED), or floored at E4M3's smallest subnormal and rounded stochastically under ``key``."""
    if FP8:
        e, code, _ = lean_block_scale(tl.max(tl.where(mask, abs_bits(x, False), 0), axis=1), False, False)
        y = x * exp2_int(-e)[:, None]
        if not SIGNED:  # core.moments_q8.FP8_ROOT_FLOOR (2^-9), then sr_e4m3: y is then on E4M3's grid
            y = sr_e4m3(tl.where(x > 0, tl.maximum(y, 0.001953125), y), key)
        tl.store(codes_ptr + offs, to_e4m3(y, 1.0, HW), mask=mask)
        tl.store(scales_ptr + soffs, code.to(tl.uint8), mask=rmask)
    else:
        a = tl.where(mask, tl.abs(x), 0.0)
        amax = tl.max(a, axis=1)
        amax = tl.where(amax >= 1.1754943508222875e-38, amax, 0.0)  # core.moments_q8.FP32_MIN_NORMAL: zeros
        inv = tl.where(amax > 0, tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax), 0.0)
        c = q8_encode(a * inv[:, None], tab_ptr, ENC)
        if SIGNED:
            c = tl.where((x < 0) & (c > 0), c + 128, c)
        tl.store(codes_ptr + offs, c.to(tl.uint8), mask=mask)
        tl.store(scales_ptr + soffs, amax, mask=rmask)


@triton.jit(do_not_specialize=["sr_key"])  # a new key every step: one compiled kernel
def _adamw_q8_kernel(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, out_ptr, scale_ptr, tab_ptr, R, C, NB, decay,
                     lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size, sr_key,
                     GRAD_BF16: tl.constexpr, LERP_SMALL: tl.constexpr, WRITE_OUT: tl.constexpr,
                     GRAD_SCALE: tl.constexpr, SPLIT: tl.constexpr, TR: tl.constexpr, QB: tl.constexpr,
                     FP8: tl.constexpr, HW: tl.constexpr):
    """_adamw_kernel's update of a [TR, QB] tile of the 2-D view [R, C] (TR rows, one quantization block
    of each) with 8-bit moments (core.moments_q8.load_moments / store_moments): codes at m_ptr / v_ptr
    ([R, C], uint8 or, FP8, E4M3; v_ptr's are of the second moment's square root), their blocks' scales at
    ms_ptr / vs_ptr ([R, NB], fp32 or, FP8, E8M0 codes), q8's tables at tab_ptr (kernel_tables); the update
    uses the unrounded fp32 moments, as the bf16 state's does. ``sr_key``: the step's key of the root's
    stochastic rounding (FP8; core.moments_q8.sr_key)."""
    pid = tl.program_id(0)
    pid_r = pid // NB
    pid_b = pid % NB
    r = pid_r * TR + tl.arange(0, TR)
    c = pid_b * QB + tl.arange(0, QB)
    rmask = r < R
    mask = rmask[:, None] & (c[None, :] < C)
    offs = r[:, None].to(tl.int64) * C + c[None, :]
    soffs = r.to(tl.int64) * NB + pid_b
    p, g = _load_p_g(p_ptr, out_ptr, g_ptr, scale_ptr, offs, mask, GRAD_BF16, GRAD_SCALE, SPLIT)
    m = _q8_load(m_ptr, ms_ptr, tab_ptr, offs, soffs, mask, rmask, 0, FP8)  # TABLE.DEC_M
    s = _q8_load(v_ptr, vs_ptr, tab_ptr, offs, soffs, mask, rmask, 256, FP8)  # TABLE.DEC_V
    v = s * s
    p, m, v = _adamw_math(p, g, m, v, decay, lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size,
                          LERP_SMALL)
    _store_p(p_ptr, out_ptr, p, offs, mask, SPLIT)
    if WRITE_OUT:  # never with SPLIT, whose out_ptr is the master's rest
        tl.store(out_ptr + offs, round_to_bf16(p), mask=mask)
    _q8_store(m_ptr, ms_ptr, tab_ptr, m, offs, soffs, mask, rmask, sr_key, 512, True, FP8, HW)  # TABLE.ENC_M
    _q8_store(v_ptr, vs_ptr, tab_ptr, tl.sqrt_rn(v), offs, soffs, mask, rmask, sr_key, 596, False, FP8,
              HW)  # TABLE.ENC_V


# the offsets and constants _adamw_q8_kernel, q8_encode and sr_e4m3 write as literals
assert (TABLE.DEC_M, TABLE.DEC_V, TABLE.ENC_M, TABLE.ENC_V, TABLE.COUNT, TABLE.NEXT, TABLE.MUL, TABLE.ADD) == (
    0, 256, 512, 596, 0, 33, 66, 75), "core.moments_q8.TABLE moved: update the kernel's offsets"
assert (FP8_ROOT_FLOOR, E4M3_MIN_NORMAL, FP32_MIN_NORMAL) == (0.001953125, 0.015625, 1.1754943508222875e-38), \
    "core.moments_q8's constants moved: update the kernel's literals"

Q8_ROWS = 2
"""Rows (quantization blocks) per program of adamw_update_q8_ (Q8_WARPS warps): a tile of Q8_ROWS x QBLOCK elements,
read at each call (tools/bench_optim.py --block sweeps it as Q8_ROWS x 256). Compiled for SM90 on the CPU as
launched (docs/bench/session60/sass_count.py, the split form): 52 registers at 2 rows, 67 at 4, 122 at 8, 213 at
16. On an H100 (session 59, tools/bench_optim.py, 3.77B parameters, 4 warps) 2 rows 37.4 ms, 4 rows 38.1, 8
rows 46.6, against bf16 moments' 25.0: 2 is the fastest measured, and the kernel is bound by its instructions, not
by HBM (185 SASS instructions an element a thread at 4 rows against bf16's 107, counted statically as launched,
docs/bench/session60/sass_count.py). fp8's code has its own FP8_ROWS."""
FP8_ROWS = 4
"""Q8_ROWS for fp8's code (optimizer.state_dtype=fp8), read at each call (tools/bench_optim.py --block sweeps it for
the triton_fp8 rows). Compiled for SM90 on the CPU (session 60, the split form, docs/bench/session60/sass_count.py):
184 SASS instructions an element a thread at 2 rows (47 registers), 140 at 4 (63), 124 at 8 (115), 117 at 16
(206). 4: about q8's registers at its fastest measured tiles, with fewer instructions than 2 rows; chosen from those
counts, **not yet timed on a GPU**."""
Q8_WARPS = 4
"""Warps per program of adamw_update_q8_, read at each call (a tile's rows share them)."""


def adamw_update_q8_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     exp_avg_scales: torch.Tensor, exp_avg_sq_scales: torch.Tensor, *, step: float, lr: float,
                     beta1: float, beta2: float, eps: float, weight_decay: float,
                     out_bf16: torch.Tensor | None = None, lo: torch.Tensor | None = None,
                     grad_scale: torch.Tensor | None = None) -> None:
    """adamw_update_ with 8-bit moments (core.moments_q8), the code by the codes' dtype: ``exp_avg`` /
    ``exp_avg_sq`` codes of p's shape, uint8 (optimizer.state_dtype=q8) or float8_e4m3fn (fp8), and
    ``exp_avg_scales`` / ``exp_avg_sq_scales`` of core.moments_q8.scale_shape(p.shape) and scale_dtype (fp32,
    or uint8 E8M0 codes). Each is read and written once: 2 bytes of moments an element, read and written, where
    bf16 moves 4 (and 1/16 or 1/64 of a byte of scales a block of 256, read and written). q8's codebooks come
    from core.moments_q8.kernel_tables (made on a device's first call). ``lo``: the master is held split
    (adamw_update_split_): ``p`` is then its bf16 half and ``lo`` the int16 rest, and ``out_bf16`` must be
    None. Other arguments as adamw_update_'s."""
    split = lo is not None
    if split and (p.dtype != torch.bfloat16 or lo.dtype != torch.int16 or out_bf16 is not None):
        raise TypeError("adamw_update_q8_ with lo takes a bf16 p (the split master's half), an int16 lo and no "
                        "out_bf16")
    if exp_avg.dtype != exp_avg_sq.dtype or exp_avg.dtype not in CODE_DTYPES:
        raise TypeError(f"8-bit moments are both uint8 codes (q8) or both {FP8} (fp8), got {exp_avg.dtype} and "
                        f"{exp_avg_sq.dtype}")
    sdtype = scale_dtype(exp_avg.dtype)
    for s in (exp_avg_scales, exp_avg_sq_scales):
        if s.dtype != sdtype or tuple(s.shape) != scale_shape(p.shape) or s.device != p.device \
                or not s.is_contiguous():
            raise ValueError(f"8-bit moments' scales must be contiguous {sdtype} of shape {scale_shape(p.shape)} "
                             f"on {p.device}, got {s.dtype} {tuple(s.shape)} on {s.device}")
    if lo is not None and (lo.shape != p.shape or lo.device != p.device or not lo.is_contiguous()):
        raise ValueError("adamw_update_q8_ needs a contiguous lo of p's shape on its device")
    args = _scalars(p, grad, exp_avg, exp_avg_sq, [] if out_bf16 is None else [out_bf16], grad_scale, step=step,
                    lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, master=not split,
                    moments=False)
    C = p.shape[-1] if p.dim() else 1
    R = p.numel() // C if C else 0
    if R == 0 or C == 0:
        return
    nb = triton.cdiv(C, QBLOCK)
    fp8 = exp_avg.dtype == FP8
    tr = FP8_ROWS if fp8 else Q8_ROWS
    grid = (triton.cdiv(R, tr) * nb,)
    out = lo if split else (p if out_bf16 is None else out_bf16)
    _adamw_q8_kernel[grid](
        p.view(torch.int16) if split else p, grad, exp_avg, exp_avg_sq, exp_avg_scales, exp_avg_sq_scales, out,
        p if grad_scale is None else grad_scale,
        exp_avg_scales if fp8 else kernel_tables(p.device), R, C, nb,  # fp8 reads no table: any pointer
        *args, sr_key(step) if fp8 else 0, GRAD_BF16=grad.dtype == torch.bfloat16, LERP_SMALL=abs(args[1]) < 0.5,
        WRITE_OUT=out_bf16 is not None,
        GRAD_SCALE=grad_scale is not None, SPLIT=split, TR=tr, QB=QBLOCK, FP8=fp8, HW=HW_CONVERT,
        num_warps=Q8_WARPS, enable_fp_fusion=False,
    )
