"""Emulated low-precision GEMMs (core/precision/emulated.py): each GEMM's operands quantized along
that GEMM's reduction dim, checked against a float64 computation on the independently quantized and
dequantized operands; activations saved as fp8 payloads; weights quantized once per step.

Tolerance: each output element's error, over the sum of its products' magnitudes (|A| @ |B|), is at
most 2^-7. The emulation is a bf16 GEMM on the same operands (one rounding of the output to bf16:
2^-9, plus the CPU kernel's summation): measured <= 0.0034 here. Quantizing an operand along the
wrong axis, or blocks that mix experts, measured >= 0.025 on these wide-range inputs, and fails.
"""

import pytest
import torch

from moetron.core.precision.blockwise import dequantize_128x128, dequantize_1x128, quantize_128x128, quantize_1x128
from moetron.core.precision.emulated import BlockwiseFormat, EmulatedGemm, MXFormat
from moetron.core.precision.grouping import pad_groups
from moetron.core.precision.mx import dequantize_mx, quantize_mx

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

TOL = 2.0 ** -7


def wide(*shape, seed=0):
    """Random values whose magnitude varies along every dim (so the quantization axis matters)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    for d, n in enumerate(shape):
        view = [1] * len(shape)
        view[d] = n
        x = x * torch.logspace(-2, 2, n, dtype=torch.float64)[torch.randperm(n, generator=g)].view(view)
    return x.float()


def padded_qdq(x, axis, multiple, qdq):
    """qdq(x zero-padded along ``axis`` to a whole number of blocks, axis), cut back, float64."""
    axis = axis % x.dim()
    n = x.shape[axis]
    shape = list(x.shape)
    shape[axis] = -n % multiple
    return qdq(torch.cat([x, x.new_zeros(shape)], dim=axis), axis).narrow(axis, 0, n).double()


def mx_ref(x, axis, mode):
    return padded_qdq(x, axis, 32, lambda t, a: dequantize_mx(*quantize_mx(t, 32, a, mode), 32, a))


def bw_ref(x, axis):
    return padded_qdq(x, axis, 128, lambda t, a: dequantize_1x128(*quantize_1x128(t, a), a))


FORMATS = {
    "mx_rceil": (lambda: MXFormat("rceil"), lambda x, a: mx_ref(x, a, "rceil"), lambda w, a: mx_ref(w, a, "rceil")),
    "mx_floor": (lambda: MXFormat("floor"), lambda x, a: mx_ref(x, a, "floor"), lambda w, a: mx_ref(w, a, "floor")),
    "fp8_blockwise": (BlockwiseFormat, bw_ref, lambda w, a: dequantize_128x128(*quantize_128x128(w)).double()),
}


def rel_err(actual, a, b) -> float:
    """The largest error of actual against the float64 product a @ b, elementwise over |a| @ |b|."""
    return ((actual.double() - a @ b).abs() / (a.abs() @ b.abs()).clamp_min(1e-300)).max().item()


def close(actual, a, b, what):
    """actual against the float64 product a @ b, elementwise over |a| @ |b|, within TOL."""
    err = rel_err(actual, a, b)
    assert err <= TOL, f"{what}: error {err:.3g} of the products' magnitude > {TOL:.3g}"


@pytest.mark.parametrize("save_x_bf16", [False, True])  # precision.emulated_save_x_bf16
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_linear_matches_float64_on_quantized_operands(fmt_name, save_x_bf16):
    make, act, wq = FORMATS[fmt_name]
    gemm = EmulatedGemm(make(), save_x_bf16=save_x_bf16)
    T, I, O = 200, 256, 384  # 200 tokens: not a whole number of blocks, the wgrad pads
    x = wide(T, I, seed=1).requires_grad_()
    w = wide(O, I, seed=2).requires_grad_()
    dy = wide(T, O, seed=3).bfloat16().float()  # gradients arrive in the output dtype, bf16
    y = gemm.linear(x, w)
    y.backward(dy)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == w.grad.dtype == torch.float32
    close(y, act(x, -1), wq(w, -1).T, "forward")
    close(x.grad, act(dy, -1), wq(w, 0), "dgrad")
    close(w.grad, act(dy, 0).T, act(x, 0), "wgrad")


def check_grouped(act, wq, x, w, offsets, y, dy, wgrad_act=None):
    """Per-expert loops: each expert's rows quantized on their own (padded to whole blocks alone).
    ``wgrad_act``: the wgrad's operands (default ``act``)."""
    wgrad_act = wgrad_act or act
    start = 0
    for e, end in enumerate(offsets.tolist()):
        xe, dye = x[start:end].detach(), dy[start:end]
        if end > start:
            close(y[start:end], act(xe, -1), wq(w[e].detach(), -1).T, f"forward, expert {e}")
            close(x.grad[start:end], act(dye, -1), wq(w[e].detach(), 0), f"dgrad, expert {e}")
            close(w.grad[e], wgrad_act(dye, 0).T, wgrad_act(xe, 0), f"wgrad, expert {e}")
        else:
            assert not w.grad[e].any()
        start = end


@pytest.mark.parametrize("save_x_bf16", [False, True])  # precision.emulated_save_x_bf16
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_grouped_mm_matches_float64_per_expert(fmt_name, save_x_bf16):
    make, act, wq = FORMATS[fmt_name]
    gemm = EmulatedGemm(make(), save_x_bf16=save_x_bf16)
    E, I, O = 5, 256, 128
    offsets = torch.tensor([37, 37, 150, 290, 300])  # an empty expert, ragged sizes
    x = wide(310, I, seed=4).requires_grad_()  # 10 rows past the end (capacity padding)
    w = wide(E, O, I, seed=5).requires_grad_()
    dy = wide(310, O, seed=6).bfloat16().float()
    dy[300:] = 0  # rows past the end are unspecified: their gradient is never read
    y = gemm.grouped_mm(x, w, offsets)
    y.backward(dy)
    check_grouped(act, wq, x, w, offsets, y, dy)


def test_pad_groups_aligns_each_expert_without_mixing():
    x = torch.arange(1, 11, dtype=torch.float32)[:, None].repeat(1, 2)
    out, padded = pad_groups(x, torch.tensor([3, 3, 8]), 4)  # rows 8, 9 are past the end
    assert padded.tolist() == [4, 4, 12]
    assert out[:, 0].tolist()[:12] == [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]
    assert out.shape[0] % 4 == 0 and not out[12:].any()


@pytest.mark.parametrize("grouped", [False, True])
def test_activations_are_saved_as_fp8_payloads(grouped):
    gemm = EmulatedGemm(MXFormat())
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, 96, 128) if grouped else torch.randn(96, 128))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = gemm.grouped_mm(x, w, torch.tensor([10, 40, 40, 64])) if grouped else gemm.linear(x, w)
    big = [t for t in saved if t.numel() >= x.numel() and t is not w]
    assert big and all(t.dtype == torch.float8_e4m3fn for t in big), [t.dtype for t in big]
    y.sum().backward()


def _run_save_x(fmt, grouped: bool, x_bf16: bool, device: str = "cpu"):
    """One GEMM forward and backward with precision.emulated_save_x_bf16 as given: the results and
    the tensors saved for the backward."""
    gemm = EmulatedGemm(fmt, save_x_bf16=x_bf16)
    x = wide(80, 128, seed=4).bfloat16().to(device).requires_grad_()  # fp8_blockwise: 128-wide tiles
    w = torch.nn.Parameter((wide(3, 128, 128, seed=5) if grouped else wide(128, 128, seed=5)).to(device))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = gemm.grouped_mm(x, w, torch.tensor([20, 20, 75], device=device)) if grouped else gemm.linear(x, w)
    dy = wide(*y.shape, seed=6).bfloat16().to(device)
    if grouped:
        dy[75:] = 0
    y.backward(dy)
    n = 75 if grouped else 80  # rows past the last group are unspecified on CUDA's grouped kernel
    return (y[:n], x.grad[:n], w.grad), saved


# Run in one interpreted subprocess (tests/interpreted.py), each test checking its own.
INTERPRETED = ("_check_save_x('mx_triton', False)", "_check_save_x('mx_triton', True)", "_fused_kernels_match_torch('cpu')",
               "_rows_and_cols_tiles_match_torch('cpu')")


def _check_save_x(fmt_name: str, grouped: bool, device: str = "cpu") -> None:
    """precision.emulated_save_x_bf16 keeps x's wgrad operand (its columns along the tokens, padded to
    whole blocks) as a bf16 tensor, its quantize-dequantize, and no fp8 payload: the output and both
    gradients equal the default's (the payload, dequantized in the backward) bit for bit."""
    make = {"mx_torch": lambda: MXFormat("rceil", kernels="torch"),
            "mx_triton": lambda: MXFormat("rceil", kernels="triton"), "fp8_blockwise": BlockwiseFormat}[fmt_name]
    base, saved0 = _run_save_x(make(), grouped, False, device)
    got, saved1 = _run_save_x(make(), grouped, True, device)
    for a, b in zip(base, got):
        assert torch.equal(a, b)
    fp8 = [tuple(t.shape) for t in saved0 if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 1 and fp8[0][0] % make().block == 0, fp8  # the payload's rows: whole blocks
    padded = fp8[0]
    assert not [t for t in saved1 if t.dtype == torch.float8_e4m3fn]
    assert [t for t in saved1 if t.dtype == torch.bfloat16 and tuple(t.shape) == padded]


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("fmt_name", ["mx_torch", "fp8_blockwise"])
def test_emulated_save_x_bf16_keeps_bf16_not_the_payload_same_results(fmt_name, grouped):
    _check_save_x(fmt_name, grouped)


def test_emulated_save_x_bf16_on_the_mx_kernels_interpreted():
    from tests.interpreted import run_interpreted

    for grouped in (False, True):
        run_interpreted("tests.core.test_precision_emulated", f"_check_save_x('mx_triton', {grouped})", timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("fmt_name", ["mx_triton", "fp8_blockwise"])
def test_emulated_save_x_bf16_on_gpu(fmt_name, grouped):
    _check_save_x(fmt_name, grouped, "cuda")


def test_emulated_save_x_bf16_under_a_traced_graph_equals_eager():
    """The switch in a real traced graph (torch.compile, aot_eager on the CPU) through the linear: the
    compiled forward and backward equal the eager default's bit for bit."""
    torch._dynamo.reset()
    x0 = wide(80, 64, seed=4).bfloat16()
    w = torch.nn.Parameter(wide(128, 64, seed=5))
    grads = []
    for on in (False, True):
        gemm = EmulatedGemm(MXFormat(kernels="torch"), save_x_bf16=on)
        fn = lambda x: gemm.linear(x, w).float().square().sum()  # noqa: E731
        x = x0.clone().requires_grad_()
        (torch.compile(fn, backend="aot_eager") if on else fn)(x).backward()
        grads.append((x.grad, w.grad.clone()))
        w.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    torch._dynamo.reset()


@pytest.mark.parametrize("switch", ["quantize_weights_once", "per_expert"])
def test_quantize_weights_once_serves_the_cache_inside_compiled_code(switch):
    """precision.quantize_weights_once: a compiled forward (torch.compile, aot_eager on the CPU) and
    its backward, three micro-batches through the grouped GEMM, quantize each expert weight once per
    step (forward and dgrad tags: 2 misses, then 4 hits) and give the eager results. Without it the
    traced forward bypasses the cache (on the CPU the grouped GEMM's host loop breaks the graph
    before the backward, whose dgrad lookups then still run: 1 miss, 2 hits; on a GPU,
    torch._grouped_mm traces whole and neither pass looks the cache up). precision.bf16_experts=cublas
    (``per_expert``: a host sync per GEMM) leaves the graph the same way, so it gets the same."""
    torch._dynamo.reset()
    gemm = EmulatedGemm(MXFormat(kernels="torch"))
    setattr(gemm, switch, True)
    offsets = torch.tensor([20, 20, 64])
    w = torch.nn.Parameter(wide(3, 64, 64, seed=7))
    xs = [wide(64, 64, seed=s) for s in range(3)]

    def loss(x):  # compiled like a block: the forward; backward runs from outside, as the trainer's
        return gemm.grouped_mm(x, w, offsets).float().square().sum()

    compiled = torch.compile(loss, backend="aot_eager")
    for x in xs:
        compiled(x.clone().requires_grad_()).backward()
    got = w.grad.clone()
    assert (gemm.cache.misses, gemm.cache.hits) == (2, 4)
    w.grad = None
    reference = EmulatedGemm(MXFormat(kernels="torch"))
    reference.per_expert = gemm.per_expert  # (its wgrad in fp32 straight from the sums)
    for x in xs:
        reference.grouped_mm(x.clone().requires_grad_(), w, offsets).float().square().sum().backward()  # eager
    assert torch.equal(got, w.grad)
    torch._dynamo.reset()


def test_weights_are_quantized_once_per_step():
    gemm = EmulatedGemm(MXFormat())
    w = torch.nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.SGD([w], lr=0.1)
    x = torch.randn(32, 64)
    for _ in range(3):  # three micro-batches: the forward and the dgrad quantizations are made once
        gemm.linear(x.requires_grad_(), w).sum().backward()
    assert (gemm.cache.misses, gemm.cache.hits) == (2, 4)
    opt.step()  # in place: the version changes, the next use requantizes
    gemm.linear(x, w).sum().backward()
    assert gemm.cache.misses == 4
    y_new = gemm.linear(x, w)
    assert torch.equal(y_new, EmulatedGemm(MXFormat()).linear(x, w))  # the fresh weights, not stale
    gemm.after_optimizer_step()
    gemm.linear(x, w)
    assert gemm.cache.misses == 5
    # an expert's slice of a parameter is cached on the parameter, per slice
    we = torch.nn.Parameter(torch.randn(3, 64, 64))
    for _ in range(2):
        for e in range(3):
            gemm.linear(x, we[e])
    assert gemm.cache.misses == 5 + 3


def _fused_kernels_match_torch(device: str) -> None:
    """mxfp8 emulated through the Triton kernels (the fused rows-and-columns quantization, one read
    per operand, the weights' two orientations included) against the torch reference ops: the same
    outputs and gradients, bit for bit, for a linear (tokens not a whole block) and a grouped GEMM
    (an empty expert, rows past the end)."""
    from moetron.core.precision import emulated

    assert emulated.FUSED
    for mode in ("rceil", "floor"):
        results = []
        for kernels in ("triton", "torch"):
            gemm = EmulatedGemm(MXFormat(mode, kernels=kernels))
            x = wide(70, 64, seed=1).bfloat16().to(device).requires_grad_()
            w = wide(96, 64, seed=2).to(device).requires_grad_()
            y = gemm.linear(x, w)
            y.backward(wide(70, 96, seed=3).bfloat16().to(device))
            xg = wide(80, 64, seed=4).bfloat16().to(device).requires_grad_()
            wg = wide(3, 96, 64, seed=5).to(device).requires_grad_()
            offsets = torch.tensor([20, 20, 75], device=device)
            yg = gemm.grouped_mm(xg, wg, offsets)
            dyg = wide(80, 96, seed=6).bfloat16().to(device)
            dyg[75:] = 0
            yg.backward(dyg)
            results.append([y, x.grad, w.grad, yg[:75], xg.grad[:75], wg.grad])
            # the Triton path quantizes each weight's two orientations from one read: one entry each
            assert gemm.cache.misses == (2 if kernels == "triton" else 4), (kernels, gemm.cache.misses)
        for got, want, what in zip(*results, ("y", "dx", "dw", "grouped y", "grouped dx", "grouped dw")):
            assert torch.equal(got, want), (mode, what)


def test_fused_mx_kernels_match_the_torch_ops_interpreted():
    from tests.interpreted import run_interpreted

    run_interpreted("tests.core.test_precision_emulated", "_fused_kernels_match_torch('cpu')", timeout=600)


@pytest.mark.gpu
def test_fused_mx_kernels_match_the_torch_ops_on_gpu():
    _fused_kernels_match_torch("cuda")


def _rows_and_cols_tiles_match_torch(device: str) -> None:
    """mx_rows_and_cols_triton under each tile that tools/bench_quantize.py --mx sweeps (columns per
    program, warps; mx_triton.TILES) equals the torch reference, bit for bit: a gathered grouped
    operand (4 experts, one empty, padded to 32-row blocks, rows past the last group) with the
    columns as a payload and as bf16, and a dense operand whose rows are not a whole block; 192
    columns, so the 64-column tile divides them and the wider ones end in a partial tile. Each launch's grid is the tile's. On the GPU every tile;
    interpreted, one per (columns, codes), the interpreter running each warps count the same."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
    from bench_quantize import MX_TILES  # tools/ (also in the interpreter's subprocess)

    from moetron.core.precision import mx_triton
    from moetron.core.precision.grouping import padded_source_rows

    kernel = mx_triton._mx_rows_and_cols_kernel
    grids = []

    class Recorded:  # the kernel, its launch grids recorded
        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return kernel[grid]

    x = wide(100, 192, seed=7).bfloat16().to(device)
    ends = torch.tensor([25, 25, 65, 95], device=device, dtype=torch.int32)
    src, _ = padded_source_rows(ends, 100, 32)
    ref = MXFormat("rceil", kernels="torch")
    want_grouped = (ref.rows_and_cols(x, src, ends, True), ref.rows_and_cols(x, src, ends, False))
    want_dense = ref.rows_and_cols(x[:35], None, None, True)
    saved, saved_order = dict(mx_triton.TILES["both"]), mx_triton.GRID_COLS_FIRST
    mx_triton._mx_rows_and_cols_kernel = Recorded()
    # the interpreter ignores num_warps: on the CPU one tile per (columns, codes) runs the same code
    tiles = MX_TILES if device != "cpu" else list({(c, k): (c, w, k) for c, w, k in reversed(MX_TILES)}.values())
    # each tile in the default order, and the smallest and largest in the other (GRID_COLS_FIRST)
    runs = [(t, saved_order) for t in tiles] + [(t, not saved_order) for t in (tiles[0], tiles[-1])]
    try:
        for (cols, warps, codes), cols_first in runs:
            mx_triton.TILES["both"] = {"cols": cols, "num_warps": warps, "codes_from_tile": codes}
            mx_triton.GRID_COLS_FIRST = cols_first
            grids.clear()
            got_grouped = tuple(mx_triton.mx_rows_and_cols_triton(x, src, ends, "rceil", p) for p in (True, False))
            got_dense = mx_triton.mx_rows_and_cols_triton(x[:35], None, None, "rceil", True)
            col_tiles = -(-192 // cols)
            want_grids = [(src.numel() // 32, col_tiles), (-(-100 // 32), col_tiles)] * 2 + [(64 // 32, col_tiles)]
            assert grids == [(p * c,) if cols_first else (p, c) for p, c in want_grids]
            for got, want in zip((*got_grouped, got_dense), (*want_grouped, want_dense)):
                assert len(got) == len(want)
                for g, w in zip(got, want):
                    # rows of the grouped rows output past the last group are quantized too (the TAIL launch)
                    assert torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                                       w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w), \
                        (cols, warps, codes, cols_first)
    finally:
        mx_triton.TILES["both"] = saved
        mx_triton.GRID_COLS_FIRST = saved_order
        mx_triton._mx_rows_and_cols_kernel = kernel


def test_both_tile_setting_is_checked():
    from moetron.core.precision.mx_triton import _both_tile

    assert _both_tile("256,8") == {"cols": 256, "num_warps": 8, "codes_from_tile": False}
    assert _both_tile("128,2,tile-codes") == {"cols": 128, "num_warps": 2, "codes_from_tile": True}
    for bad in ("128", "96,4", "128,3", "2048,4", "a,b", "128,4,codes", "128,4,tile-codes,1"):
        with pytest.raises(ValueError, match="want 'cols,warps'"):
            _both_tile(bad)


def test_grid_order_setting_is_checked():
    from moetron.core.precision.mx_triton import _grid_order

    assert _grid_order("cols-first") is True and _grid_order("rows-first") is False
    for bad in ("cols", "", "Cols-First"):
        with pytest.raises(ValueError, match="want 'rows-first' or 'cols-first'"):
            _grid_order(bad)


def test_rows_and_cols_tiles_match_the_torch_ops_interpreted():
    from tests.interpreted import run_interpreted

    run_interpreted("tests.core.test_precision_emulated", "_rows_and_cols_tiles_match_torch('cpu')", timeout=600)


@pytest.mark.gpu
def test_rows_and_cols_tiles_match_the_torch_ops_on_gpu():
    _rows_and_cols_tiles_match_torch("cuda")


def test_per_expert_grouped_reads_the_groups_once_per_pass_and_matches_float64():
    """precision.bf16_experts=cublas on an emulated backend (one GEMM per expert): against float64 per
    expert like the grouped kernel, and the group sizes read to the host once in the forward and once
    for the backward's dgrad and wgrad (the wgrad's padded groups derived on the host,
    grouping.padded_host_ends, equal to padded_source_rows' device ones)."""
    from moetron.core.precision import emulated, grouping

    make, act, wq = FORMATS["mx_rceil"]
    gemm = EmulatedGemm(make())
    gemm.per_expert = True
    offsets = torch.tensor([37, 37, 150, 290, 300])
    _, padded = grouping.padded_source_rows(offsets, 310, 32)
    assert grouping.padded_host_ends(offsets.tolist(), 32) == padded.tolist()
    x = wide(310, 256, seed=4).requires_grad_()
    w = wide(5, 128, 256, seed=5).requires_grad_()
    dy = wide(310, 128, seed=6).bfloat16().float()
    dy[300:] = 0
    from tests.host_reads import counted_host_reads

    with counted_host_reads(emulated) as reads:
        y = gemm.grouped_mm(x, w, offsets)
        y.backward(dy)
    assert sum(reads) == 2, reads
    check_grouped(act, wq, x, w, offsets, y, dy)


def _grouped_mm_on_bf16_weights_equals_the_fp32_path(fmt_name: str, device: str) -> None:
    make, act, wq = FORMATS[fmt_name]
    E, I, O = 5, 256, 128
    offsets = torch.tensor([37, 37, 150, 290, 300], device=device)
    x0 = wide(310, I, seed=4).bfloat16().to(device)
    w16 = wide(E, O, I, seed=5).bfloat16().to(device)
    dy = wide(310, O, seed=6).bfloat16().float().to(device)
    dy[300:] = 0
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = x0.float().requires_grad_(), w16.to(dtype).requires_grad_()
        y = EmulatedGemm(make()).grouped_mm(x, w, offsets)
        y.backward(dy)
        assert w.grad.dtype == dtype
        runs[dtype] = y, x.grad, w.grad
        if dtype == torch.float32 and device == "cpu":
            check_grouped(act, wq, x, w, offsets, y, dy)
    (y32, dx32, dw32), (y16, dx16, dw16) = runs[torch.float32], runs[torch.bfloat16]
    n = int(offsets[-1])  # rows past the last group: unspecified on CUDA's one kernel (grouped_mm_2d3d)
    assert torch.equal(y16[:n], y32[:n]) and torch.equal(dx16[:n], dx32[:n])
    assert torch.equal(dw16, dw32.to(torch.bfloat16)) and torch.equal(dw16.float(), dw32)


@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_grouped_mm_on_bf16_weight_copies_equals_the_fp32_path(fmt_name):
    """precision.expert_weight_copies=optimizer on the emulated backend hands the grouped GEMM the
    bf16 copy itself. Its output and input gradient equal, bit for bit, those of an fp32 weight
    holding the same (bf16) values, and its weight gradient is that run's fp32 gradient rounded to
    bf16, exactly (the grouped GEMM's output is bf16 either way; the fp32 path only widens it). The
    fp32 run is checked against float64 on the quantized operands (check_grouped), the bf16 run by
    that equality."""
    _grouped_mm_on_bf16_weights_equals_the_fp32_path(fmt_name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", ["mx_rceil", "mx_floor"])
def test_grouped_mm_on_bf16_weight_copies_equals_the_fp32_path_on_gpu(fmt_name):
    """The same on CUDA, where the weights' quantization reads bf16 through the Triton kernels."""
    _grouped_mm_on_bf16_weights_equals_the_fp32_path(fmt_name, "cuda")


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_blockwise"])
def test_emulated_recipes_train_on_the_optimizers_bf16_copies(recipe):
    """mxfp8 / fp8_blockwise emulated with precision.expert_weight_copies=optimizer,
    expert_grads_bf16=true: the experts compute with the optimizer's bf16 copies and the run follows
    the one quantizing the fp32 weights (the block quantization of bf16(w) against that of w)."""
    from tests.core.test_bf16_grouped import assert_quantized_copies_run_follows_fp32

    gemms = assert_quantized_copies_run_follows_fp32(recipe)
    assert all(isinstance(g, EmulatedGemm) and g.format.name == recipe for g in gemms.values())


def test_codes_from_tile_compile_without_byte_stores_through_shared_memory():
    """The fused MX kernel compiled for SM90 on the CPU (no GPU needed), the columns as a payload:
    without TILES["both"]["codes_from_tile"] its E8M0 codes pass through shared memory one byte per
    store (st.shared.b8) before one byte-wide global store; with it (the default since session 23,
    0.614 -> 0.594 ms on OLMoE-8L's routed x) they leave from the tile's own layout, with no
    byte-wide shared stores and fewer CTA barriers. Everything else is the same kernel."""
    import re
    import types

    pytest.importorskip("triton")
    from tests.core.test_precision_fp8 import _compile_sm90

    from moetron.core.precision import mx_triton

    C, R = 2048, 131072
    values = dict(x_ptr="*bf16", src_ptr="*i32", end_ptr="*i32", rows_ptr="*bf16", cols_ptr="*bf16",
                  data_ptr="*fp8e4nv", scale_ptr="*u8", P=R + 64 * 32, R=R, C=C, s_xp=C, s_xc=1, s_rp=C, s_rc=1,
                  s_cp=C, s_cc=1, s_dp=C, s_dc=1, s_sp=C, s_sc=1)
    ptx = {}
    for codes in (False, True):
        constexprs = dict(TAIL=False, GATHER=True, COLS_PAYLOAD=True, FLOOR=False, IN_BF16=True, HW=True, TC=128,
                          CODES_FROM_TILE=codes, COLS_FIRST=mx_triton.GRID_COLS_FIRST)
        config = types.SimpleNamespace(kwargs={}, num_warps=4, num_stages=1)
        ptx[codes] = _compile_sm90(mx_triton._mx_rows_and_cols_kernel, config, values, constexprs).asm["ptx"]
    count = {k: {op: len(re.findall(rf"\b{re.escape(op)}\b", v)) for op in ("st.shared.b8", "bar.sync")}
             for k, v in ptx.items()}
    assert count[False]["st.shared.b8"] > 0 and count[True]["st.shared.b8"] == 0, count
    assert count[True]["bar.sync"] < count[False]["bar.sync"], count


def test_quantized_expert_copies_train_bit_for_bit_as_the_plain_copies(monkeypatch):
    """precision.quantized_expert_copies: the optimizer writes each expert copy MX-quantized along I
    (the forward's operand, which takes the gradient) and a second copy along O (the dgrad's), and the
    grouped GEMMs quantize no expert weight. Three steps give the losses and every parameter bit for
    bit as the plain copies do (the same quantization of the same bf16 copy, made elsewhere); the
    copies are the torch reference's quantize-dequantize of bf16(w) both ways, also after a refresh
    (what a checkpoint load calls); the parameters get no gradient."""
    from tests.core.test_adamw_triton import mx_qdq_reference
    from tests.core.test_bf16_grouped import _copies_trainer

    from moetron.core.moe.experts import GroupedExperts

    weight_calls = []
    real_weight = MXFormat.weight
    monkeypatch.setattr(MXFormat, "weight", lambda self, w, axis: weight_calls.append(w.dim()) or real_weight(self, w, axis))
    runs = {}
    for quantized in (False, True):
        torch.manual_seed(0)
        weight_calls.clear()
        trainer, data = _copies_trainer(True, recipe="mxfp8", backend="emulated", quantized_expert_copies=quantized)
        assert trainer.precision.gemm.quantized_copies == quantized
        experts = [m for m in trainer.model.modules() if isinstance(m, GroupedExperts)]
        losses = [trainer.train_step(data.next_batch())[0].item() for _ in range(3)]
        assert (3 in weight_calls) != quantized  # the expert weights [E, O, I] quantized by the GEMMs, or never
        for m in experts:
            assert m.w_gate_up.grad is None and m.w_down.grad is None
            if quantized:
                for w, c, d in zip((m.w_gate_up, m.w_down), m.weight_copies, m.weight_copies_dgrad):
                    w16 = w.detach().to(torch.bfloat16)
                    assert torch.equal(c.detach(), mx_qdq_reference(w16, -1, "rceil"))
                    assert torch.equal(d, mx_qdq_reference(w16, -2, "rceil"))
            else:
                assert m.weight_copies_dgrad is None
        if quantized:
            trainer.optimizer.refresh_compute_copies()
            m = experts[0]
            assert torch.equal(m.weight_copies_dgrad[1], mx_qdq_reference(m.w_down.detach().to(torch.bfloat16), -2, "rceil"))
        runs[quantized] = losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    (l0, p0), (l1, p1) = runs[False], runs[True]
    assert l1 == l0 and l0[2] < l0[0]
    assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)


def test_quantized_expert_copies_rule():
    """One ConfigError naming the fix where the switch meets another recipe, backend, or no copies."""
    from moetron.core.config import ConfigError
    from moetron.core.precision import PrecisionConfig

    copies = dict(expert_weight_copies="optimizer", expert_grads_bf16=True)
    PrecisionConfig(recipe="mxfp8", backend="emulated", quantized_expert_copies=True, **copies).validate()
    with pytest.raises(ConfigError, match="--precision.recipe=mxfp8 --precision.backend=emulated"):
        PrecisionConfig(recipe="fp8_blockwise", backend="emulated", quantized_expert_copies=True, **copies).validate()
    with pytest.raises(ConfigError, match="--precision.recipe=mxfp8 --precision.backend=emulated"):
        PrecisionConfig(recipe="mxfp8", backend="native", quantized_expert_copies=True).validate()
    with pytest.raises(ConfigError, match="expert_weight_copies=optimizer --precision.expert_grads_bf16=true"):
        PrecisionConfig(recipe="mxfp8", backend="emulated", quantized_expert_copies=True).validate()
    with pytest.raises(ConfigError, match="leaves the experts in bf16: add experts to --precision.modules"):
        PrecisionConfig(recipe="mxfp8", backend="emulated", quantized_expert_copies=True, modules=["attention"],
                        **copies).validate()


def test_the_mx_pair_update_compiles_for_sm90():
    """adamw_update_mx_pair_'s kernel compiled for SM90 on the CPU (no GPU needed): the bf16 moments
    and gradients of the experts' copies, the GPU's conversions (HW), 128 columns a program."""
    import types

    pytest.importorskip("triton")
    from tests.core.test_precision_fp8 import _compile_sm90

    from moetron.core import adamw_triton

    values = dict(p_ptr="*fp32", g_ptr="*bf16", m_ptr="*bf16", v_ptr="*bf16", rows_ptr="*bf16", cols_ptr="*bf16",
                  scale_ptr="*fp32", P=131072, C=2048,
                  **{name: "fp32" for name in ("decay", "lerp_weight", "beta2", "one_minus_beta2", "bc2_sqrt", "eps",
                                               "neg_step_size")})
    config = types.SimpleNamespace(kwargs={}, num_warps=4, num_stages=1)
    for cols_first in (False, True):
        constexprs = dict(GRAD_BF16=True, STATE_BF16=True, LERP_SMALL=True, GRAD_SCALE=True, FLOOR=False, HW=True,
                          TC=adamw_triton.MX_PAIR_TILE_COLS, COLS_FIRST=cols_first)
        ptx = _compile_sm90(adamw_triton._adamw_mx_pair_kernel, config, values, constexprs).asm["ptx"]
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and ".target sm_90" in ptx
        # the 1-D grid's tile ids: one program id read, divided by the column tiles
        assert ("%ctaid.y" in ptx) is not cols_first


def _prequantized_grouped_mm_traces_as_eager(device: str, backend: str) -> None:
    from tests.core.test_adamw_triton import mx_qdq_reference

    gemm = EmulatedGemm(MXFormat(), expert_copies=True, quantized_copies=True)
    offsets = torch.tensor([40, 40, 96], device=device)
    x0 = wide(100, 64, seed=1).bfloat16().to(device)
    w16 = wide(3, 32, 64, seed=2).bfloat16()
    w_fwd, w_dgrad = (mx_qdq_reference(w16, axis, "rceil").to(device) for axis in (-1, -2))
    dy = wide(100, 32, seed=3).bfloat16().to(device)
    runs = []
    for mode in ("plain", "eager", "compiled"):
        x = x0.clone().requires_grad_()
        if mode == "plain":
            w = w16.to(device).requires_grad_()
            y = EmulatedGemm(MXFormat()).grouped_mm(x, w, offsets)
        else:
            w = w_fwd.clone().requires_grad_()
            fn = lambda x, w: gemm.grouped_mm(x, w, offsets, w_dgrad=w_dgrad)  # noqa: E731
            y = (torch.compile(fn, backend=backend) if mode == "compiled" else fn)(x, w)
        y.backward(dy)
        runs.append((y[:96], x.grad[:96], w.grad))  # rows past the last group: unspecified on CUDA
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_prequantized_grouped_mm_traces_as_eager():
    """The grouped op with pre-quantized weights (w_dgrad, precision.quantized_expert_copies) in a
    traced graph (torch.compile, aot_eager on the CPU): output and gradients equal eager's, and
    equal the op quantizing the same bf16 weight itself (the weight gradient lands on w)."""
    _prequantized_grouped_mm_traces_as_eager("cpu", "aot_eager")


@pytest.mark.gpu
def test_prequantized_grouped_mm_compiles_as_eager_on_gpu():
    """The same on CUDA (the Triton quantization kernels, inductor)."""
    _prequantized_grouped_mm_traces_as_eager("cuda", "inductor")


def cuda_losses_on_one_batch(precision, steps: int = 3, check=None, grad_clip: float | None = None) -> list[float]:
    """A tiny MoE (2 layers) compiled on CUDA with ``precision`` and bf16 optimizer state: the losses
    of ``steps`` steps on one batch (so they must fall). ``check(trainer)``: called once built.
    ``grad_clip``: the trainer's (None: its default, 1.0, which scales every step of this model)."""
    from step_builder import RandomTokens, build_trainer

    from moetron.core.memory import MemoryConfig
    from moetron.core.optim import OptimizerConfig
    from moetron.core.trainer import TrainerConfig
    from moetron.models import ModelConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2"])
    dev = torch.device("cuda")
    data = RandomTokens(cfg.vocab_size, 2, 64, dev)
    trainer = build_trainer(cfg, MemoryConfig(), data, dev, seq_len=64, compile=True, precision=precision,
                            optimizer=OptimizerConfig(state_dtype="bf16"),
                            trainer=None if grad_clip is None else TrainerConfig(grad_clip=grad_clip))
    if check is not None:
        check(trainer)
    batch = data.next_batch()
    return [trainer.train_step(batch)[0].item() for _ in range(steps)]


@pytest.mark.gpu
def test_quantized_expert_copies_train_as_the_plain_copies_on_gpu():
    """On CUDA (the optimizer's Triton MX-pair kernel, the emulated Triton kernels, compiled blocks):
    three steps with and without precision.quantized_expert_copies. The same values by construction;
    the losses compared to 1e-4 because a CUDA step is not bit-reproducible run to run. One batch,
    three times: its loss must fall (on fresh random batches it need not, and on the H100 it rose)."""
    from moetron.core.precision import PrecisionConfig

    runs = {quantized: cuda_losses_on_one_batch(PrecisionConfig(
        recipe="mxfp8", backend="emulated", expert_weight_copies="optimizer", expert_grads_bf16=True,
        quantized_expert_copies=quantized)) for quantized in (False, True)}
    assert runs[True] == pytest.approx(runs[False], rel=1e-4) and runs[False][2] < runs[False][0]
