"""RMSNorm's forward and backward in one Triton pass each (model.triton_rmsnorm; core/layers/norm.py).

The eager step runs RMSNorm as torch's separate kernels: a cast to fp32, a square, a mean, an add, a
reciprocal square root and two products forward, about as many again backward, each a pass over the
[T, D] rows in fp32, and autograd keeps several of those fp32 tensors until the backward. Here the
forward reads x once and writes y and one fp32 scale per row (rstd); the backward reads x and dy once,
writes dx, and sums the weight's gradient per program in fp32 (one [programs, D] partial, summed after).
Under torch.compile the norm is left to inductor, which fuses it with the residual adds beside it.

    y  = w * (x * rstd),        rstd = 1 / sqrt(sum(x^2) / D + eps)        (in fp32, per row)
    dx = rstd * (g - xhat * sum(g * xhat) / D),  g = dy * w,  xhat = x * rstd
    dw = sum over rows of dy * xhat

The same quantities in fp32 as the module's torch path (norm.py): the forward its operations in its
order, the backward the closed form above where autograd composes the pieces; the row sums in the
kernel's order, not torch's. So results agree to fp32 rounding (a bf16 output to one rounding), which
the tests check against float64 and the torch path. Division and square root are IEEE (div_rn, sqrt_rn), so the CPU
interpreter (TRITON_INTERPRET=1) computes what the GPU does.

Legend: T rows (leading dims flattened), D the normalized dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_round import load_fp32, store_rounded

__all__ = ["rmsnorm_backward", "rmsnorm_forward"]

MAX_D = 16384
"""The widest row a program holds in registers (next power of two of D, fp32); wider rows take the
torch path (core/layers/norm.py)."""


@triton.jit
def _rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, D, stride_x, stride_y, eps,
                        X_BF16: tl.constexpr, W_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = load_fp32(x_ptr + row * stride_x + cols, mask, X_BF16)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, axis=0), D * 1.0) + eps))
    w = load_fp32(w_ptr + cols, mask, W_BF16)
    store_rounded(y_ptr + row * stride_y + cols, w * (x * rstd), mask, X_BF16)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rmsnorm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, T, D, rows_per_program, stride_dy,
                        stride_x, stride_dx, X_BF16: tl.constexpr, W_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = load_fp32(w_ptr + cols, mask, W_BF16)
    dw = tl.zeros([BLOCK_D], tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = first + i
        inside = mask & (row + tl.zeros([BLOCK_D], tl.int64) < T)  # a [BLOCK_D] mask (the interpreter wants one)
        x = load_fp32(x_ptr + row * stride_x + cols, inside, X_BF16)
        dy = load_fp32(dy_ptr + row * stride_dy + cols, inside, X_BF16)
        rstd = tl.load(rstd_ptr + tl.minimum(row, T - 1))  # a row past T loads zeros above: adds nothing
        xhat = x * rstd
        g = dy * w
        c = tl.div_rn(tl.sum(g * xhat, axis=0), D * 1.0)
        store_rounded(dx_ptr + row * stride_dx + cols, (g - xhat * c) * rstd, inside, X_BF16)
        dw += dy * xhat
    tl.store(dw_ptr + pid.to(tl.int64) * D + cols, dw, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x_TD = x.reshape(-1, x.shape[-1])
    return x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()


def _block(D: int) -> tuple[int, int]:
    """(BLOCK_D, warps): one row per program, 4-16 elements a thread."""
    block = triton.next_power_of_2(D)
    return block, max(1, min(16, block // 256))


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the Triton RMSNorm takes fp32 or bf16 x and weight, got {x.dtype} and {weight.dtype}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or not weight.is_contiguous():
        raise ValueError(f"the Triton RMSNorm needs a contiguous weight [D = {x.shape[-1]}], got {tuple(weight.shape)}")
    if triton.next_power_of_2(x.shape[-1]) > MAX_D:
        raise ValueError(f"the Triton RMSNorm holds a row in registers: D <= {MAX_D}, got {x.shape[-1]}")


def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's dtype and shape, rstd [T] fp32) of the module docstring's forward; x fp32 or bf16,
    its last dim contiguous or copied so; weight [D] fp32 or bf16."""
    _check(x, weight)
    x_TD = _rows(x)
    T, D = x_TD.shape
    y_TD = torch.empty_like(x_TD, memory_format=torch.contiguous_format)
    rstd_T = torch.empty(T, device=x.device, dtype=torch.float32)
    if T and D:
        block, warps = _block(D)
        _rmsnorm_fwd_kernel[(T,)](x_TD, weight, y_TD, rstd_T, D, x_TD.stride(0), y_TD.stride(0), eps,
                                  X_BF16=x.dtype == torch.bfloat16, W_BF16=weight.dtype == torch.bfloat16,
                                  BLOCK_D=block, num_warps=warps)
    return y_TD.view(x.shape), rstd_T


def _programs(T: int, device: torch.device) -> int:
    """Programs of the backward: a few per SM on a GPU (each sums its rows' weight gradient), few on the
    CPU interpreter."""
    per = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(T, per))


def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd_T: torch.Tensor,
                     weight_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx in x's dtype and shape, dw [D] in weight's dtype or None) of the module docstring's backward,
    from the forward's x and rstd and the incoming dy (x's shape; cast to x's dtype)."""
    _check(x, weight)
    x_TD, dy_TD = _rows(x), _rows(dy.to(x.dtype))
    T, D = x_TD.shape
    dx_TD = torch.empty_like(x_TD, memory_format=torch.contiguous_format)
    programs = _programs(T, x.device)
    # every program writes its row of partial sums (rows past T add zeros): no fill, but for T = 0
    dw_PD = (torch.empty if T else torch.zeros)(programs, D, device=x.device, dtype=torch.float32)
    if T and D:
        block, warps = _block(D)
        _rmsnorm_bwd_kernel[(programs,)](dy_TD, x_TD, weight, rstd_T, dx_TD, dw_PD, T, D, triton.cdiv(T, programs),
                                         dy_TD.stride(0), x_TD.stride(0), dx_TD.stride(0),
                                         X_BF16=x.dtype == torch.bfloat16, W_BF16=weight.dtype == torch.bfloat16,
                                         BLOCK_D=block, num_warps=warps)
    dw = dw_PD.sum(0).to(weight.dtype) if weight_grad else None
    return dx_TD.view(x.shape), dw
