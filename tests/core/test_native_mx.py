"""The native MXFP8 grouped GEMM (core/precision/native_mx.py) on the CPU, where it cannot run: no
Blackwell here. What is checked instead:

(a) the scale layouts handed to torch's grouped kernel are, per group, torchao's to_blocked of that
    group's scales, bit for bit, and the padding puts every expert's rows at a multiple of 32 without
    mixing experts;
(b) through a fake torch.nn.functional.scaled_grouped_mm that checks the call's contract (dtypes,
    recipes, swizzles, row- / column-major operands, scale shapes), finds each group's scales where
    the kernel reads them (MSLK / FBGEMM mx8mx8bf16_grouped_mm: 2d-3d groups at rows
    sum round_up(m_h, 128); 2d-2d groups at bytes round_up(rows, 128) * sum round_up(k_h / 32, 4)),
    un-swizzles and dequantizes them and multiplies in float64: the operands it decodes are the
    emulated backend's, bit for bit, and fwd / dgrad / wgrad equal the emulated backend's within one
    bf16 rounding of the output (error over the products' magnitudes <= 2^-8);
(c) native mxfp8 still refuses SM90 and the CPU, and now builds for the experts on SM100.
"""

import pytest
import torch
import torch.nn.functional as F

from moetron.core.config import ConfigError
from moetron.core.precision import PrecisionConfig
from moetron.core.precision.emulated import EmulatedGemm, MXFormat, mx_qdq
from moetron.core.precision.grouping import pad_groups, padded_source_rows
from moetron.core.precision.mx import swizzle_mx_scales
from moetron.core.precision.native_mx import (NativeMXGemm, _unpadded_rows, swizzle_mx_scales_k_groups,
                                              swizzle_mx_scales_m_groups, swizzle_mx_scales_per_group,
                                              unswizzle_mx_scales)
from tests.core.test_precision_emulated import wide

OFFSETS = [37, 37, 150, 290, 300]  # an empty expert, ragged sizes, one over 128 rows
ROWS = 310  # 10 rows past the end


def round_up(n, m):
    return -(-n // m) * m


def groups(offsets):
    start = 0
    for g, end in enumerate(offsets):
        yield g, start, end
        start = end


# ---------------------------------------------------------------------------------------------- (a)

def test_unswizzle_inverts_swizzle():
    g = torch.Generator().manual_seed(0)
    for rows, blocks in [(128, 4), (300, 7), (1, 1), (256, 64), (129, 5), (32, 3)]:
        scale = torch.randint(0, 256, (rows, blocks), dtype=torch.uint8, generator=g)
        flat = swizzle_mx_scales(scale)
        assert torch.equal(unswizzle_mx_scales(flat, rows, blocks), scale), (rows, blocks)
        padded = unswizzle_mx_scales(flat, round_up(rows, 128), round_up(blocks, 4))
        assert torch.equal(swizzle_mx_scales(padded), flat)  # and the other way round, padding included


def test_grouped_scale_layouts_match_torchao_to_blocked_per_group():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.utils import to_blocked

    g = torch.Generator().manual_seed(1)
    offsets = torch.tensor(OFFSETS)
    _, padded = padded_source_rows(offsets, ROWS, 32)
    P = round_up(ROWS + 5 * 31, 32)

    # 2d-3d operand A (forward / dgrad): groups along the rows, blocks along K = 5 x 32 (not a whole tile)
    scale = torch.randint(0, 256, (P, 5), dtype=torch.uint8, generator=g)
    out = swizzle_mx_scales_m_groups(scale, padded)
    assert out.shape[0] >= P and out.shape[1] == 8 and out.is_contiguous()
    flat, row = out.reshape(-1), 0
    for _, start, end in groups(padded.tolist()):
        if end > start:
            want = to_blocked(scale[start:end]).flatten()
            assert torch.equal(flat[row * 8: row * 8 + want.numel()], want), (start, end)
        row += round_up(end - start, 128)

    # 2d-2d operands (wgrad): groups along the reduction dim, in blocks of 32 (p_g / 32 columns each)
    for rows in (96, 160, 1):
        scale = torch.randint(0, 256, (rows, P // 32), dtype=torch.uint8, generator=g)
        out = swizzle_mx_scales_k_groups(scale, padded // 32)
        Mr = round_up(rows, 128)
        assert out.shape[0] == Mr and out.is_contiguous()
        flat, col = out.reshape(-1), 0
        for _, start, end in groups((padded // 32).tolist()):
            if end > start:
                want = to_blocked(scale[:, start:end]).flatten()
                assert torch.equal(flat[Mr * col: Mr * col + want.numel()], want), (rows, start, end)
            col += round_up(end - start, 4)
        assert out.numel() >= Mr * col

    # 3-D operand B (the weights): one to_blocked per expert
    scale = torch.randint(0, 256, (5, 160, 3), dtype=torch.uint8, generator=g)
    out = swizzle_mx_scales_per_group(scale)
    assert torch.equal(out, torch.stack([to_blocked(s).flatten() for s in scale]))


def test_padding_puts_each_expert_at_a_multiple_of_32_without_mixing():
    offsets = torch.tensor(OFFSETS)
    src, padded = padded_source_rows(offsets, ROWS, 32)
    assert padded.tolist() == [64, 64, 192, 352, 384] and all(p % 32 == 0 for p in padded.tolist())
    for (e, start, end), (_, pstart, pend) in zip(groups(OFFSETS), groups(padded.tolist())):
        rows = src[pstart:pend]
        assert rows[: end - start].tolist() == list(range(start, end))  # the expert's rows, in order
        assert (rows[end - start:] == -1).all()  # then zero rows: no other expert's
    assert (src[padded[-1]:] == -1).all()
    dst, valid = _unpadded_rows(offsets, padded, ROWS)
    assert valid.tolist() == [True] * 300 + [False] * 10
    assert torch.equal(src[dst[:300]].long(), torch.arange(300))  # the way back


# ---------------------------------------------------------------------------------------------- (b)

def decode(data, codes):
    """e4m3 data [rows, K] and natural E8M0 codes [rows, K / 32] -> float64."""
    scale = torch.exp2(codes.double() - 127)
    scale[codes == 255] = float("nan")
    return data.double() * scale.repeat_interleave(32, dim=1)


class FakeScaledGroupedMM:
    """torch.nn.functional.scaled_grouped_mm as the SM100 kernel would run it, in float64."""

    def __init__(self):
        self.calls = []

    def __call__(self, mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
                 swizzle_b=None, bias=None, offs=None, output_dtype=torch.bfloat16, contraction_dim=(),
                 use_fast_accum=False):
        assert scale_recipe_a == scale_recipe_b == F.ScalingType.BlockWise1x32
        assert swizzle_a == swizzle_b == F.SwizzleType.SWIZZLE_32_4_4
        assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
        assert scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu
        assert bias is None and output_dtype == torch.bfloat16
        assert offs.dtype == torch.int32 and offs.dim() == 1
        assert mat_a.dim() == 2 and mat_a.stride(-1) == 1 and mat_a.stride(-2) > 1, "A row-major"
        assert mat_b.stride(-2) == 1 and mat_b.stride(-1) > 1, "B column-major"
        sa, sb = scale_a.view(torch.uint8), scale_b.view(torch.uint8)
        bounds = list(groups(offs.tolist()))
        if mat_b.dim() == 3:
            return self.grouped_2d3d(mat_a, mat_b, sa, sb, bounds)
        return self.grouped_2d2d(mat_a, mat_b, sa, sb, bounds)

    def grouped_2d3d(self, a, b, sa, sb, bounds):
        (M, K), (G, K2, N) = a.shape, b.shape
        assert K == K2 and G == len(bounds) and K % 32 == 0
        Kb4 = round_up(K // 32, 4)
        assert sa.dim() == 2 and sa.shape[0] >= M and sa.is_contiguous()  # torch's checks
        assert tuple(sb.shape) == (G, round_up(N, 128) * Kb4)
        flat = sa.reshape(-1)
        out = torch.full((M, N), float("nan"), dtype=torch.float64)  # rows of no group: unwritten
        a_hat, b_hat, row = torch.zeros(M, K, dtype=torch.float64), [], 0
        for g, start, end in bounds:
            w = decode(b[g].t(), unswizzle_mx_scales(sb[g], N, K // 32))  # [N, K]
            b_hat.append(w)
            m = end - start
            if m:
                region = flat[row * Kb4: (row + round_up(m, 128)) * Kb4]
                a_hat[start:end] = decode(a[start:end], unswizzle_mx_scales(region, m, K // 32))
                out[start:end] = a_hat[start:end] @ w.t()
            row += round_up(m, 128)
        assert flat.numel() >= row * Kb4
        self.calls.append(("2d3d", a_hat, b_hat))
        return out.to(torch.bfloat16)

    def grouped_2d2d(self, a, b, sa, sb, bounds):
        (M, K), (K2, N) = a.shape, b.shape
        assert K == K2
        Mr, Nr = round_up(M, 128), round_up(N, 128)
        assert sa.dim() == sb.dim() == 2 and sa.shape[0] >= M and sb.shape[0] >= N  # torch's checks
        fa, fb = sa.reshape(-1), sb.reshape(-1)
        out = torch.full((len(bounds), M, N), float("nan"), dtype=torch.float64)  # empty groups: unwritten
        a_hat, b_hat, col = torch.zeros(M, K, dtype=torch.float64), torch.zeros(N, K, dtype=torch.float64), 0
        for g, start, end in bounds:
            k = end - start
            assert k % 32 == 0, "a block of 32 along K would hold two groups"
            kb, kb4 = k // 32, round_up(k // 32, 4)
            if k:
                sa_g = unswizzle_mx_scales(fa[Mr * col: Mr * (col + kb4)], M, kb)
                sb_g = unswizzle_mx_scales(fb[Nr * col: Nr * (col + kb4)], N, kb)
                a_hat[:, start:end] = decode(a[:, start:end], sa_g)
                b_hat[:, start:end] = decode(b[start:end].t(), sb_g)
                out[g] = a_hat[:, start:end] @ b_hat[:, start:end].t()
            col += kb4
        assert fa.numel() >= Mr * col and fb.numel() >= Nr * col
        self.calls.append(("2d2d", a_hat, b_hat))
        return out.to(torch.bfloat16)


def close(actual, expected, a, b, what):
    """actual against expected (the emulation), elementwise over the products' magnitudes |a| @ |b|,
    or within one bf16 ulp of expected: both are bf16 roundings of sums taken in two orders (float64
    here, the CPU's fp32 GEMM there), which may straddle a rounding boundary (measured: 0.6% of the
    magnitude, one ulp, on one of 15,360 elements of an AMD EPYC machine's CPU GEMM)."""
    diff = (actual.double() - expected.double()).abs()
    _, exp = torch.frexp(expected.double())
    ulp = torch.ldexp(torch.ones_like(diff), exp - 8)  # bf16: 8 significant bits
    err = (diff / (a.abs() @ b.abs()).clamp_min(1e-300)).where(diff > ulp, torch.zeros_like(diff)).max().item()
    same = (actual == expected).double().mean().item()
    print(f"{what}: max error {err:.3g} of the products' magnitude beyond one ulp, {same:.2%} bit-equal")
    assert err <= 2.0 ** -8, f"{what}: {err:.3g}"


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_grouped_autograd_hands_the_kernel_the_emulations_operands(mode, monkeypatch):
    fake = FakeScaledGroupedMM()
    monkeypatch.setattr(F, "scaled_grouped_mm", fake)
    E, I, O = 5, 160, 96  # 5 and 3 blocks of 32: the scale tiles pad; I > 128: two row tiles in the wgrad
    offsets = torch.tensor(OFFSETS)
    x0, w0 = wide(ROWS, I, seed=4), wide(E, O, I, seed=5)
    dy = wide(ROWS, O, seed=6).bfloat16()

    def run(gemm, w=None):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_() if w is None else w
        y = gemm.grouped_mm(x, w, offsets)
        y.backward(dy)
        return y, x.grad, w.grad

    native = NativeMXGemm(mode)
    native.format = MXFormat(mode, kernels="torch")
    w = w0.clone().requires_grad_()
    y, dx, dw = run(native, w)
    dw = dw.clone()
    y_e, dx_e, dw_e = run(EmulatedGemm(MXFormat(mode, kernels="torch")))
    assert y.dtype == torch.bfloat16 and dx.dtype == dw.dtype == torch.float32

    # the operands the kernel decodes are the emulation's, bit for bit
    src, padded = padded_source_rows(offsets, ROWS, 32)
    fmt = MXFormat(mode, kernels="torch")
    qdq = lambda t, axis: mx_qdq(t, axis, mode, torch.float64)  # noqa: E731
    (k_fwd, a_fwd, b_fwd), (k_dgrad, a_dgrad, b_dgrad), (k_wgrad, a_wgrad, b_wgrad) = fake.calls
    assert (k_fwd, k_dgrad, k_wgrad) == ("2d3d", "2d3d", "2d2d")
    assert torch.equal(a_fwd, pad_groups(qdq(x0, -1), offsets, 32)[0])
    assert all(torch.equal(b_fwd[e], qdq(w0[e], -1)) for e in range(E))
    assert torch.equal(a_dgrad, pad_groups(qdq(dy, -1), offsets, 32)[0])
    assert all(torch.equal(b_dgrad[e], qdq(w0[e], 0).t()) for e in range(E))
    assert torch.equal(a_wgrad, fmt.qdq(dy, 0, src).double().t())
    assert torch.equal(b_wgrad, fmt.qdq(x0, 0, src).double().t())

    # and the results are the emulation's up to the output's bf16 rounding
    assert not dx[300:].any() and not dw[1].any()  # rows past the end, the empty expert: zero, not unwritten
    for (e, start, end), (_, pstart, pend) in zip(groups(OFFSETS), groups(padded.tolist())):
        if end > start:
            xe, dye = qdq(x0[start:end], -1), qdq(dy[start:end], -1)
            close(y[start:end], y_e[start:end], xe, qdq(w0[e], -1).t(), f"forward, expert {e}")
            close(dx[start:end], dx_e[start:end], dye, qdq(w0[e], 0), f"dgrad, expert {e}")
            close(dw[e], dw_e[e], a_wgrad[:, pstart:pend], b_wgrad[:, pstart:pend].t(), f"wgrad, expert {e}")

    # the weights are quantized once per step: a second micro-batch reuses both copies
    assert native.cache.misses == 2
    run(native, w)  # (the gradient accumulates into w.grad: not an in-place write of w)
    assert native.cache.misses == 2 and native.cache.hits == 2
    native.after_optimizer_step()
    run(native, w)
    assert native.cache.misses == 4


def test_saved_activation_is_the_fp8_wgrad_operand(monkeypatch):
    monkeypatch.setattr(F, "scaled_grouped_mm", FakeScaledGroupedMM())
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = wide(ROWS, 64, seed=7).bfloat16().requires_grad_()
    w = wide(5, 32, 64, seed=8).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        NativeMXGemm().grouped_mm(x, w, torch.tensor(OFFSETS))
    P = padded_source_rows(torch.tensor(OFFSETS), ROWS, 32)[0].numel()
    assert any(t.dtype == torch.float8_e4m3fn and tuple(t.shape) == (64, P) for t in saved)  # x^T, fp8
    assert not any(t.dtype == torch.bfloat16 and t.shape == x.shape for t in saved)


# ---------------------------------------------------------------------------------------------- (c)

def cfg(**kw):
    return PrecisionConfig.from_dict(kw)


def test_native_mx_still_refuses_below_sm100_and_on_the_cpu():
    with pytest.raises(ConfigError, match="SM100.*SM9x.*fp8_blockwise"):
        cfg(recipe="mxfp8", backend="native").resolved_backend("cuda", 9)
    with pytest.raises(ConfigError, match="SM100.*the CPU.*backend=emulated"):
        cfg(recipe="mxfp8", backend="native").build("cpu")


def test_native_mx_builds_for_the_experts_on_sm100(monkeypatch):
    from moetron.core.precision import config as config_mod

    c = cfg(recipe="mxfp8", backend="native")
    c.resolved_backend = lambda *a, **k: "native"  # as on an SM100 GPU
    monkeypatch.setattr(config_mod, "_capability_major", lambda device_type: 10)
    policy = c.build("cuda")
    assert isinstance(policy.gemm, NativeMXGemm) and "experts" in policy.modules
    monkeypatch.setattr(config_mod, "_capability_major", lambda device_type: 12)  # torch's kernel: 10.x only
    with pytest.raises(ConfigError, match="grouped GEMM.*10.x.*SM12x.*emulated"):
        c.build("cuda")
    c.modules = ["attention", "mlp"]
    assert isinstance(c.build("cuda").gemm, NativeMXGemm)  # the dense linears alone still build there
