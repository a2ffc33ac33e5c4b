"""MXFP8 GEMMs on Blackwell (SM100+): dense linears through torch.nn.functional.scaled_mm, the routed
experts through torch.nn.functional.scaled_grouped_mm, both with BlockWise1x32 E8M0 scales in the
swizzled 128x4 layout (mx.swizzle_mx_scales, SwizzleType.SWIZZLE_32_4_4). Each GEMM's operands are
quantized along its own reduction dim (forward along I, dgrad along O, wgrad along the tokens,
padded with zero rows to a multiple of 32), weights quantized once per optimizer step.

NOT RUN: written against torch's documented API, never executed on Blackwell (there is none here).
Checked on the CPU: the swizzle against torchao's to_blocked, bit for bit (dense, and per group for
the grouped GEMM); the grouped GEMM's autograd through a fake scaled_grouped_mm that decodes its
operands as the kernel addresses them, against the emulated backend (tests/core/test_native_mx.py).

The grouped GEMM (y = x w^T per expert, w [E, O, I]), in the layouts torch's MXFP8 grouped kernel
reads (as read from FBGEMM's mx8mx8bf16_grouped kernel, MSLK's now, which torch calls, and from
torch's own test of it):

- every expert's rows are padded to a multiple of 32 once (grouping.padded_source_rows: on the
  device, static size, no host sync); the three GEMMs run on the padded rows with the padded
  offsets, and the forward and dgrad outputs are gathered back to the caller's rows;
- forward and dgrad are "2d-3d": A [P, K] row-major (K = I, resp. O), B [E, K, N] column-major
  (w^T, resp. w, per expert), output [P, N]. A's scales: each group's to_blocked, one after
  another, group g starting at row sum_{h<g} round_up(p_h, 128) of a [S, round_up(K/32, 4)] view;
  B's scales: [E, round_up(N, 128) * round_up(K/32, 4)], one to_blocked per expert;
- the wgrad is "2d-2d": A = dy^T [O, P] row-major, B = x [P, I] column-major (x^T stored), groups
  along the reduction dim P, output [E, O, I]. Each operand's scales: each group's to_blocked of its
  [rows, p_g / 32] block, one after another, group g at byte round_up(rows, 128) * sum_{h<g}
  round_up(p_h / 32, 4). An empty expert gets a zero gradient here (the kernel skips its group).

Legend: T tokens, R expert-sorted rows, P padded rows, E experts, I / O input / output dims,
B blocks of 32 along a reduction dim.
"""


from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import WeightCache
from .emulated import MXFormat
from .gemm import GemmBackend
from .grouping import pad_groups, pad_rows, padded_source_rows
from .mx import MX_BLOCK, quantize_mx, swizzle_mx_scales

__all__ = ["NativeMXGemm", "swizzle_mx_scales_k_groups", "swizzle_mx_scales_m_groups", "swizzle_mx_scales_per_group",
           "unswizzle_mx_scales"]

_E8M0 = torch.float8_e8m0fnu
_TILE_ROWS, _TILE_BLOCKS = 128, 4
_TILE = _TILE_ROWS * _TILE_BLOCKS


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def unswizzle_mx_scales(flat: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """The inverse of swizzle_mx_scales: its flat 128x4-tile layout -> natural [rows, blocks] scales."""
    Mt, Bt = -(-rows // _TILE_ROWS), -(-blocks // _TILE_BLOCKS)
    tiles = flat.reshape(-1)[:Mt * Bt * _TILE].view(Mt, Bt, 32, 4, _TILE_BLOCKS)
    # (i, j, b, a, c) -> (i, a, b, j, c): the swizzle's permutation is its own inverse
    return tiles.permute(0, 3, 2, 1, 4).reshape(Mt * _TILE_ROWS, Bt * _TILE_BLOCKS)[:rows, :blocks]


def swizzle_mx_scales_per_group(scale_GMB: torch.Tensor) -> torch.Tensor:
    """[G, M, B] natural scales (a 3-D operand: one matrix per expert) -> [G, round_up(M, 128) *
    round_up(B, 4)]: each group's swizzle_mx_scales, as the grouped GEMM's 3-D operand wants."""
    G, M, B = scale_GMB.shape
    Mp = _round_up(M, _TILE_ROWS)
    padded = scale_GMB.new_zeros(G, Mp, B)
    padded[:, :M] = scale_GMB
    # whole 128-row tiles per group: the swizzle of the stack is the groups' swizzles one after another
    return swizzle_mx_scales(padded.reshape(G * Mp, B)).view(G, -1)


def swizzle_mx_scales_m_groups(scale_PB: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Natural [P, B] scales of a 2-D operand whose rows are in groups ending at offsets_E -> [S, round_up(B, 4)]
    (S static, >= P): each group's swizzle_mx_scales one after another, group g from row
    sum_{h<g} round_up(p_h, 128). Rows are padded per group to whole 128-row tiles (pad_groups), so
    the swizzle of the whole is the groups' swizzles in order; on the device, no host sync."""
    padded, _ = pad_groups(scale_PB, offsets_E, _TILE_ROWS)
    return swizzle_mx_scales(padded).view(padded.shape[0], -1)


def swizzle_mx_scales_k_groups(scale_MB: torch.Tensor, block_offsets_E: torch.Tensor) -> torch.Tensor:
    """Natural [M, B] scales along a reduction dim cut into groups (ending at block_offsets_E, in
    blocks of 32) -> [round_up(M, 128), C] (C static, >= sum_g round_up(b_g, 4)): each group's
    swizzle_mx_scales of its [M, b_g] columns, one after another, group g at byte
    round_up(M, 128) * sum_{h<g} round_up(b_h, 4). On the device, no host sync: the columns are
    padded per group to whole tiles (pad_groups on the transpose), swizzled as one matrix, and the
    tiles reordered from (tile row, tile column) to (group, tile row, tile column)."""
    cols_CM, tile_offsets_E = pad_groups(scale_MB.t(), block_offsets_E, _TILE_BLOCKS)
    flat = swizzle_mx_scales(cols_CM.t())
    Mr, C = _round_up(scale_MB.shape[0], _TILE_ROWS), cols_CM.shape[0]
    nrt, nct = Mr // _TILE_ROWS, C // _TILE_BLOCKS
    device = scale_MB.device
    ends_E = tile_offsets_E.to(torch.int64) // _TILE_BLOCKS
    ct = torch.arange(nct, device=device)
    group = torch.searchsorted(ends_E, ct, right=True)  # E: the unused tiles past the last group
    starts = torch.cat([ends_E.new_zeros(1), ends_E])[group]
    widths = torch.cat([ends_E, ends_E.new_full((1,), nct)])[group] - starts
    rt = torch.arange(nrt, device=device)[:, None]
    dest = nrt * starts + rt * widths + (ct - starts)  # [nrt, nct]: a permutation of the tiles
    out = torch.empty_like(flat).view(-1, _TILE)
    out[dest.reshape(-1)] = flat.view(-1, _TILE)
    return out.view(Mr, C)


def _mx_rows(x_MK: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized along K -> (e4m3 data [M, K], swizzled e8m0 scales)."""
    data, scale = quantize_mx(x_MK, MX_BLOCK, -1, mode)
    return data, swizzle_mx_scales(scale).view(torch.float8_e8m0fnu)


def _mx_mm(a, sa, bt, sbt) -> torch.Tensor:
    """a [M, K] @ bt[N, K]^T, both quantized along K."""
    st, sw = F.ScalingType, F.SwizzleType
    return F.scaled_mm(a, bt.t(), sa, st.BlockWise1x32, sbt, st.BlockWise1x32,
                       swizzle_a=sw.SWIZZLE_32_4_4, swizzle_b=sw.SWIZZLE_32_4_4, output_dtype=torch.bfloat16)


class _NativeMXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TI, w_OI, gemm: "NativeMXGemm"):
        mode = gemm.scale_mode
        w_q, w_s = gemm.cache.get(w_OI, "mx_native_fwd", lambda w: _mx_rows(w, mode))
        y = _mx_mm(*_mx_rows(x_TI, mode), w_q, w_s)
        ctx.save_for_backward(*_mx_rows(pad_rows(x_TI, MX_BLOCK).t().contiguous(), mode), w_OI)  # x^T along tokens
        ctx.gemm, ctx.x_dtype = gemm, x_TI.dtype
        return y

    @staticmethod
    def backward(ctx, dy_TO):
        xt_q, xt_s, w_OI = ctx.saved_tensors
        gemm, mode = ctx.gemm, ctx.gemm.scale_mode
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wt_q, wt_s = gemm.cache.get(w_OI, "mx_native_dgrad", lambda w: _mx_rows(w.t().contiguous(), mode))
            dx = _mx_mm(*_mx_rows(dy_TO, mode), wt_q, wt_s).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyt_q, dyt_s = _mx_rows(pad_rows(dy_TO, MX_BLOCK).t().contiguous(), mode)
            dw = _mx_mm(dyt_q, dyt_s, xt_q, xt_s).to(w_OI.dtype)
        return dx, dw, None


def _scaled_grouped_mm(a, sa, b, sb, offsets_E) -> torch.Tensor:
    """torch's MXFP8 grouped GEMM: a row-major, b column-major, e8m0 scales swizzled per group."""
    st, sw = F.ScalingType, F.SwizzleType
    return F.scaled_grouped_mm(a, b, sa.view(_E8M0), st.BlockWise1x32, sb.view(_E8M0), st.BlockWise1x32,
                               swizzle_a=sw.SWIZZLE_32_4_4, swizzle_b=sw.SWIZZLE_32_4_4, offs=offsets_E,
                               output_dtype=torch.bfloat16)


def _mx_experts(w_EMK: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, M, K] quantized along K -> (e4m3 [E, M, K], per-expert swizzled scales [E, ...])."""
    data, scale = quantize_mx(w_EMK, MX_BLOCK, -1, mode)
    return data, swizzle_mx_scales_per_group(scale)


def _along_tokens(fmt: MXFormat, x_RC: torch.Tensor, src_P: torch.Tensor, padded_offsets_E: torch.Tensor):
    """The wgrad operand: x[src_P] [P, C] quantized along the (padded) tokens -> (e4m3 x^T [C, P]
    contiguous, its scales in the 2d-2d grouped layout)."""
    data_PC, scale_BC = fmt.quantize(x_RC, 0, src_P)
    return data_PC.t().contiguous(), swizzle_mx_scales_k_groups(scale_BC.t(), padded_offsets_E // MX_BLOCK)


def _unpadded_rows(offsets_E: torch.Tensor, padded_offsets_E: torch.Tensor, rows: int):
    """(dst_R, valid_R): row r of the caller's layout is row dst_R[r] of the padded one; rows past
    offsets_E[-1] are not in any group (valid_R False)."""
    offsets_E, padded_offsets_E = offsets_E.to(torch.int64), padded_offsets_E.to(torch.int64)
    r = torch.arange(rows, device=offsets_E.device)
    group = torch.searchsorted(offsets_E, r, right=True).clamp_max(offsets_E.numel() - 1)
    starts = torch.cat([offsets_E.new_zeros(1), offsets_E[:-1]])
    padded_starts = torch.cat([padded_offsets_E.new_zeros(1), padded_offsets_E[:-1]])
    dst = padded_starts[group] + r - starts[group]
    valid = r < offsets_E[-1]
    return torch.where(valid, dst, 0), valid


def _take_rows(y_PN: torch.Tensor, dst_R: torch.Tensor, valid_R: torch.Tensor) -> torch.Tensor:
    """y's rows back in the caller's layout; zero past the last group (the kernel leaves those unwritten)."""
    return torch.where(valid_R[:, None], y_PN[dst_R], torch.zeros((), dtype=y_PN.dtype, device=y_PN.device))


class _NativeMXGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI, w_EOI, offsets_E, gemm: "NativeMXGemm"):
        fmt, mode = gemm.format, gemm.scale_mode
        rows = x_RI.shape[0]
        src_P, padded_offsets_E = padded_source_rows(offsets_E, rows, MX_BLOCK)
        dst_R, valid_R = _unpadded_rows(offsets_E, padded_offsets_E, rows)
        x_q, x_s = fmt.quantize(x_RI, -1, src_P)  # [P, I] along I
        w_q, w_s = gemm.cache.get(w_EOI, "mx_native_grouped_fwd", lambda w: _mx_experts(w, mode))  # along I
        y_PO = _scaled_grouped_mm(x_q, swizzle_mx_scales_m_groups(x_s, padded_offsets_E),
                                  w_q.transpose(-2, -1), w_s, padded_offsets_E)
        # the wgrad operand, saved quantized: x^T along the padded tokens
        ctx.save_for_backward(*_along_tokens(fmt, x_RI, src_P, padded_offsets_E), w_EOI, offsets_E, src_P,
                              padded_offsets_E, dst_R, valid_R)
        ctx.gemm, ctx.x_dtype = gemm, x_RI.dtype
        return _take_rows(y_PO, dst_R, valid_R)

    @staticmethod
    def backward(ctx, dy_RO):
        xt_q, xt_s, w_EOI, offsets_E, src_P, padded_offsets_E, dst_R, valid_R = ctx.saved_tensors
        gemm = ctx.gemm
        fmt, mode = gemm.format, gemm.scale_mode
        dx_RI = dw_EOI = None
        if ctx.needs_input_grad[0]:
            dy_q, dy_s = fmt.quantize(dy_RO, -1, src_P)  # [P, O] along O
            # w^T [E, I, O] along O, handed over as w [E, O, I] column-major
            wt_q, wt_s = gemm.cache.get(w_EOI, "mx_native_grouped_dgrad",
                                        lambda w: _mx_experts(w.transpose(-2, -1).contiguous(), mode))
            dx_PI = _scaled_grouped_mm(dy_q, swizzle_mx_scales_m_groups(dy_s, padded_offsets_E),
                                       wt_q.transpose(-2, -1), wt_s, padded_offsets_E)
            dx_RI = _take_rows(dx_PI, dst_R, valid_R).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyt_q, dyt_s = _along_tokens(fmt, dy_RO, src_P, padded_offsets_E)  # dy^T [O, P]
            dw_EOI = _scaled_grouped_mm(dyt_q, dyt_s, xt_q.t(), xt_s, padded_offsets_E)
            # the kernel skips an empty group's output: its gradient is zero
            sizes_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
            dw_EOI = torch.where((sizes_E > 0)[:, None, None], dw_EOI,
                                 torch.zeros((), dtype=dw_EOI.dtype, device=dw_EOI.device)).to(w_EOI.dtype)
        return dx_RI, dw_EOI, None, None


class NativeMXGemm(GemmBackend):
    """MXFP8 through Blackwell's MX GEMMs, dense and grouped (see the module docstring)."""

    name = "mxfp8_native"
    label = "mxfp8 (native MX GEMMs)"

    def __init__(self, scale_mode: str = "rceil") -> None:
        if (not hasattr(F, "scaled_mm") or not hasattr(F, "scaled_grouped_mm")
                or not hasattr(getattr(F, "SwizzleType", None), "SWIZZLE_32_4_4")):
            raise RuntimeError(f"native mxfp8 needs torch.nn.functional.scaled_mm and scaled_grouped_mm with MX "
                               f"scales (torch {torch.__version__} lacks them): upgrade torch or use "
                               f"--precision.backend=emulated")
        self.scale_mode = scale_mode
        self.format = MXFormat(scale_mode)  # the activations' quantization (the fused kernels on CUDA)
        self.cache = WeightCache()

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._linear(_NativeMXLinear, x, w)

    def grouped_mm(self, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        return self._grouped(_NativeMXGroupedMM, x_RI, w_EOI, offsets_E, self)

    def after_optimizer_step(self) -> None:
        self.cache.invalidate()
