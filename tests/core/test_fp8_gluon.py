"""The Gluon FP8 blockwise grouped GEMMs (core/precision/fp8_gluon.py). Gluon has no interpreter, so
on the CPU each kernel is compiled for SM90 (ptxas ships with Triton): warp-specialized (a TMA
producer and two wgmma consumers with their own register budgets), no register spills. On the GPU:
the forward / dgrad (rows) and wgrad (k) kernels, persistent and one CTA a tile, against float64 on
the dequantized operands and against fp8_triton's pipelined kernels, on ragged experts (an empty
one, group ends off the row tiles, rows past the end, a column count that is not a multiple of two
tiles)."""

import os
import re
import subprocess
import tempfile
import types

import pytest
import torch

from tests.core.test_precision_emulated import wide
from tests.interpreted import run_interpreted
from tests.core.test_precision_fp8 import _agree, _compile_sm90, _ref_err, assert_no_spills, check_rows

fg = pytest.importorskip("moetron.core.precision.fp8_gluon")
if not fg.AVAILABLE:
    pytest.skip("this Triton has no Gluon", allow_module_level=True)

ROWS_CONFIGS = [fg.CONFIG, fg.GluonConfig(3, True), fg.GluonConfig(4, False), fg.GluonConfig(4, True, True),
                fg.GluonConfig(5, False, True), fg.GluonConfig(4, True, True, 2), fg.GluonConfig(3, False, False, 3)]
"""The rows kernel's configs the GPU test runs; the raster groups of 2 and 3 row tiles leave a last group
short (the test's experts take 8 row tiles with the table's spare ones)."""
K_CONFIGS = [fg.GluonConfig(4, True), fg.GluonConfig(3, True), fg.GluonConfig(4, False), fg.GluonConfig(4, True, True),
             fg.GluonConfig(3, False, True)]


def _desc(rows: int, dtype: str = "float8e4nv") -> str:
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for([rows, 128], getattr(gl, dtype))
    name = {"float8e4nv": "fp8e4nv", "bfloat16": "bf16", "float32": "fp32"}[dtype]
    return f"tensordesc<{name}[{rows}, 128],{layout!r}>"


def _compile(kind: str, bufs: int, out: str | None = None, tma_store: bool = False, group: int = 1):
    """The rows, k or tile-table kernel compiled for SM90 at OLMoE's shapes (no GPU needed);
    ``tma_store``: the TMA epilogue (GluonConfig.tma_store), its output descriptor of ``out``'s dtype
    (default: bf16 for the rows kernel, fp32 for the wgrad)."""
    R, K, N, E = 131072, 2048, 2048, 64
    common = dict(a_desc=_desc(128), b_desc=_desc(128), sa_ptr="*fp32", sb_ptr="*fp32")
    if out is None:
        out = "*fp32" if kind == "k" else "*bf16"
    c_desc = _desc(64, {"*bf16": "bfloat16", "*fp32": "float32"}[out]) if tma_store else out
    if kind == "rows":
        kernel, constexprs = fg._gluon_rows_kernel, dict(NUM_BUF=bufs, TMA_STORE=tma_store, num_warps=4)
        values = dict(common, c_desc=c_desc, tile_ptr="*i32", c_ptr=out, E=E, R=R, N=N, K=K, T=R // 128 + E, GM=group,
                      s_sam=K // 128, s_sak=1, s_sbe=N * K // 128 ** 2, s_sbk=1, s_sbn=K // 128, s_cm=N)
    elif kind == "k":
        kernel, constexprs = fg._gluon_k_kernel, dict(NUM_BUF=bufs, TMA_STORE=tma_store, num_warps=4)
        scales = f"tensordesc<fp32[1, 128],{fg.SCALE_LAYOUT.value!r}>"  # K-block-major, [1, 128] boxes
        values = dict(a_desc=_desc(128), b_desc=_desc(128), sa_desc=scales, sb_desc=scales, c_desc=c_desc,
                      off_ptr="*i32", c_ptr=out, M=N, N=K, E=E, s_ce=N * K, s_cm=K)
    else:
        kernel, constexprs = fg._gluon_tile_table_kernel, dict(BM=128, EP=64, num_warps=1)
        values = dict(off_ptr="*i32", table_ptr="*i32", E=E)
    options = types.SimpleNamespace(kwargs={}, num_warps=constexprs["num_warps"], num_stages=1)
    return _compile_sm90(kernel, options, values, constexprs, gluon=True)


@pytest.mark.parametrize("tma_store", [False, True])
def test_gluon_wgrad_with_bf16_out_compiles_for_sm90(tma_store):
    """The wgrad kernel storing bf16 (fp8_gluon_k's out_dtype: the optimizer's bf16 expert copies): the
    fp32 sums converted to bf16 once, by the rounding conversion (cvt.rn), then stored through the TMA
    store's bf16 buffer or from registers, at 4 stages, without spills."""
    compiled = _compile("k", 4, out="*bf16", tma_store=tma_store)
    ptx = compiled.asm["ptx"]
    assert re.search(r"cvt.rn.bf16x2.f32", ptx), "the fp32 sums not rounded to bf16 by cvt.rn"
    stores = len(re.findall(r"cp.async.bulk.tensor.\w+.global.shared::\w+", ptx))
    assert stores == (2 if tma_store else 0)
    assert_no_spills(compiled, f"k bf16{' tma-store' if tma_store else ''}")


@pytest.mark.parametrize("kind,bufs,tma_store,group", [("rows", 3, False, 1), ("rows", 4, False, 1), ("k", 3, False, 1),
                                                      ("k", 4, False, 1), ("rows", 5, True, 1), ("k", 4, True, 1),
                                                      ("rows", 4, True, 8)])
def test_gluon_kernels_compile_for_sm90(kind, bufs, tma_store, group):
    """Each kernel compiles for Hopper warp-specialized: the consumers' registers raised and the
    producer's lowered (setmaxnreg), each consumer's 64 x 128 wgmma (8 instructions a K-block in PTX),
    the two operands (and the wgrad's scales) through TMA into ``bufs`` stages, the output in 16-byte stores (and, with
    ``tma_store``, each consumer's full tiles by a TMA store whose buffer is reused only once the store
    has read it), and no register spills at the consumers' 232 registers (ptxas's own verdict)."""
    compiled = _compile(kind, bufs, tma_store=tma_store, group=group)
    ptx = compiled.asm["ptx"]
    what = f"{kind} s{bufs}{' tma-store' if tma_store else ''}{f' g{group}' if group > 1 else ''}"
    for direction, regs in (("inc", 232), ("dec", 40)):  # the consumers' budget up, the producer's down
        assert re.search(rf"setmaxnreg.{direction}.sync.aligned.u32\s+{regs};", ptx), \
            f"{what}: not warp-specialized with the consumers' / producer's register budgets"
    assert "wgmma.mma_async" in ptx and "wgmma.wait_group.sync.aligned 0;" in ptx, what
    loads = len(re.findall(r"cp.async.bulk.tensor.\w+.shared::\w+.global", ptx))
    stores = len(re.findall(r"cp.async.bulk.tensor.\w+.global.shared::\w+", ptx))
    assert loads == (4 if kind == "k" else 2), f"{what}: A's and B's loads (and the wgrad's scales) not through TMA"
    assert stores == (2 if tma_store else 0), f"{what}: {stores} TMA stores (one a consumer with tma_store)"
    if tma_store:  # each consumer waits for its last store to read the buffer, then all its warps sync
        assert re.search(r"cp.async.bulk.wait_group.read\s+0;\s*\n\s*bar.sync", ptx), f"{what}: buffer reused unsynced"
    assert "st.global.v4" in ptx, f"{what}: the output not stored in 16-byte vectors"
    assert compiled.metadata.shared >= bufs * 2 * 128 * 128, f"{what}: {bufs} stages of A and B"
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the ptxas this Triton compiled the kernel with (its PTX version)
    if os.path.exists(ptxas):  # ptxas's own verdict: no wgmma serialized (C7514 / C7515 ...)
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "k.ptx"), "w") as f:
                f.write(ptx)
            notes = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.path.join(tmp, "k.cubin")],
                                   capture_output=True, text=True).stderr
        assert "Used" in notes, notes[-500:]
        assert "serialized" not in notes and "warpgroup.wait is injected" not in notes, f"{what}: {notes.strip()[-400:]}"
    assert_no_spills(compiled, what)


def test_gluon_rows_kernel_stores_in_the_output_dtype():
    """The rows kernel stores in its output's dtype: fp32 where the caller asks for it (the GPU test
    checks against float64), not the bf16-rounded values (call 2 of session 35 failed so)."""
    assert "cvt.rn.bf16" in _compile("rows", 4).asm["ptx"]
    assert "cvt.rn.bf16" not in _compile("rows", 4, out="*fp32").asm["ptx"]


def test_gluon_tile_table_compiles_for_sm90():
    assert "st.global" in _compile("table", 0).asm["ptx"]


def test_gluon_config_checks_its_ring():
    with pytest.raises(ValueError, match="2 to 6 stages"):
        fg.GluonConfig(8, True)
    with pytest.raises(ValueError, match="1 to 64 row tiles"):
        fg.GluonConfig(4, True, True, 0)
    assert fg.GluonConfig(4, 0).name == "BM128 BN128 s4 ws gluon"
    assert fg.GluonConfig(3, 1).name == "BM128 BN128 s3 ws persistent gluon"
    assert fg.GluonConfig(4, 1, 1, 8).name == "BM128 BN128 s4 ws persistent tma-store g8 gluon"
    assert fg.GluonConfig(4, 1, 1) == (4, True, True, 1)  # row tile by row tile unless asked


class _Launches:
    """Stands in for a Gluon kernel: records each launch's grid and keyword arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


def test_gluon_launches_read_the_config_at_each_call(monkeypatch):
    """The wrappers launch with the module's CONFIG / K_CONFIG as they are at each call
    (tools/bench_fp8_variants.py sets them to time each; a default bound at import timed one config
    under every name: session 10's call 3), one CTA a tile or one per SM (persistent), the row-tile
    table first with one row per possible row tile, and the wgrad's ring no deeper than fits."""
    rows, table, k = _Launches(), _Launches(), _Launches()
    monkeypatch.setattr(fg, "_gluon_rows_kernel", rows)
    monkeypatch.setattr(fg, "_gluon_tile_table_kernel", table)
    monkeypatch.setattr(fg, "_gluon_k_kernel", k)
    monkeypatch.setattr(fg, "_sm_count", lambda index: 8)
    R, K, N, E = 1000, 256, 384, 3  # 8 + 3 row tiles x 3 column tiles = 33 tiles
    a = torch.zeros(R, K, dtype=torch.float8_e4m3fn)
    b = torch.zeros(E, N, K, dtype=torch.float8_e4m3fn).transpose(1, 2)
    sa, sb = torch.ones(R, K // 128), torch.ones(E, K // 128, N // 128)
    offsets = torch.tensor([100, 600, 1000], dtype=torch.int32)
    out = torch.empty(R, N, dtype=torch.bfloat16)
    for config, grid in ((fg.GluonConfig(3, False), (33, )), (fg.GluonConfig(5, True), (8, )),
                         (fg.GluonConfig(4, True, True, 4), (8, ))):
        monkeypatch.setattr(fg, "CONFIG", config)
        fg.gluon_grouped_mm_rows(a, sa, b, sb, offsets, out)
        assert rows.calls[-1][0] == grid and rows.calls[-1][2]["NUM_BUF"] == config[0], config.name
        assert rows.calls[-1][1][11:13] == (11, config[3]), config.name  # T row tiles, GM a raster group
        assert table.calls[-1][0] == (11, ) and table.calls[-1][1][1].shape == (11, 3)
    at, bt = torch.zeros(256, 640, dtype=torch.float8_e4m3fn), torch.zeros(384, 640, dtype=torch.float8_e4m3fn)
    padded = torch.tensor([128, 384, 640], dtype=torch.int32)
    k_out = torch.empty(3, 256, 384)
    k_args = (at, torch.ones(5, 256).t(), bt, torch.ones(5, 384).t(), padded, k_out)  # K-block-major scales
    monkeypatch.setattr(fg, "K_CONFIG", fg.GluonConfig(3, False))
    fg.gluon_grouped_mm_k(*k_args)
    assert k.calls[-1][0] == (3 * 2 * 3, ) and k.calls[-1][2]["NUM_BUF"] == 3
    monkeypatch.setattr(fg, "K_CONFIG", None)  # the product default: its wrapper's own ring
    fg.gluon_grouped_mm_k(*k_args)
    assert k.calls[-1][0] == (8, ) and k.calls[-1][2]["NUM_BUF"] == 4
    with pytest.raises(ValueError, match="fits 4 stages"):
        fg.gluon_grouped_mm_k(*k_args, config=fg.GluonConfig(5, True))


def test_gluon_descriptors_only_where_tma_reads_the_operands():
    """The Gluon kernels run only on SM90 and only where TMA can read the operands; elsewhere
    fp8_triton runs its pipelined kernel (its interpreted test checks the same bits come out)."""
    assert not fg.supported(torch.device("cpu"))
    a = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    assert fg.rows_descriptors(a, torch.zeros(2, 128, 128, dtype=torch.float8_e4m3fn).transpose(1, 2)) is not None
    assert [d.block_shape for d in fg.rows_descriptors(a, torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn)
                                                      .transpose(1, 2))] == [[128, 128], [128, 128]]
    assert fg.rows_descriptors(a, torch.zeros(2, 192, 128, dtype=torch.float8_e4m3fn).transpose(1, 2)) is None  # N
    # N-contiguous B, and experts not back to back: no descriptors (the pipelined kernel's pointer loads)
    assert fg.rows_descriptors(a, torch.zeros(2, 128, 128, dtype=torch.float8_e4m3fn)) is None
    assert fg.rows_descriptors(a, torch.zeros(2, 384, 128, dtype=torch.float8_e4m3fn).transpose(1, 2)[..., :192]) is None
    bt = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    s = torch.ones(3, 256).t()  # the scales K-block-major: [P / 128, rows] stored
    assert [d.block_shape for d in fg.k_descriptors(bt, s, bt, s)] == [[128, 128], [128, 128], [1, 128], [1, 128]]
    assert fg.k_descriptors(bt.t(), s, bt, s) is None  # A not K-contiguous
    assert fg.k_descriptors(bt[:, 1:], s, bt, s) is None  # a base off 16 bytes
    assert fg.k_descriptors(bt, s.t().contiguous(), bt, s) is None  # row-major scales: the pipelined kernel's
    assert fg.k_descriptors(bt, s, bt, torch.ones(3, 260).t()[:256]) is not None
    assert fg.k_descriptors(bt, s, bt, torch.ones(3, 258).t()[:256]) is None  # a K-block's row off 16 bytes


def check_products_wgrad_operands(quant: str) -> None:
    """The wgrad operands fp8_blockwise makes (the experts' padded token tiles, quantized by ``quant``)
    are ones the Gluon wgrad's descriptors accept, so on SM90 ``fp8_experts=gluon`` runs it rather than
    falling back to the pipelined kernel unseen (scales K-block-major, rows 16-byte aligned); with
    KBLOCK_MAJOR_TOKEN_SCALES off they are refused."""
    from moetron.core.precision import fp8_gemm
    from moetron.core.precision.grouping import padded_source_rows

    gemm = fp8_gemm.Fp8BlockwiseGemm("triton", quant, "gluon")
    src_P, _ = padded_source_rows(torch.tensor([40, 40, 140, 150]), 150, 128)
    operands = lambda: [fp8_gemm._quantize(gemm, wide(150, c, seed=c).bfloat16(), True, True, src_P)[1]  # noqa: E731
                        for c in (128, 256)]
    dyt, xt = operands()
    assert fg.k_descriptors(*dyt, *xt) is not None
    default, fp8_gemm.KBLOCK_MAJOR_TOKEN_SCALES = fp8_gemm.KBLOCK_MAJOR_TOKEN_SCALES, False
    try:
        dyt, xt = operands()
    finally:
        fp8_gemm.KBLOCK_MAJOR_TOKEN_SCALES = default
    assert fg.k_descriptors(*dyt, *xt) is None


def test_the_products_wgrad_operands_take_the_gluon_wgrad():
    check_products_wgrad_operands("torch")
    run_interpreted("tests.core.test_fp8_gluon", "check_products_wgrad_operands('triton')")


def test_gluon_ops_compile_and_fall_back_off_sm90():
    """The custom ops torch.compile sees instead of the Gluon launches (Inductor cannot recompile a
    traced Gluon kernel: session 35 call 4): their schemas and fake tensors (opcheck), and off SM90
    the pipelined kernels' bits, also compiled (fullgraph: the op is opaque to Dynamo)."""
    run_interpreted("tests.core.test_fp8_gluon", "check_gluon_ops()")


def check_gluon_ops() -> None:
    from moetron.core.precision import fp8_triton as ft
    from moetron.core.precision.blockwise import (dequantize_1x128, dequantize_128x128, quantize_1x128,
                                                  quantize_128x128)

    offsets = torch.tensor([40, 40, 201], dtype=torch.int32)
    a_q, a_s = quantize_1x128(wide(210, 256, seed=1), -1)
    w_q, w_s = quantize_128x128(wide(3, 128, 256, seed=2))
    args = (a_q, a_s, w_q.transpose(1, 2), w_s.transpose(1, 2), offsets)
    want = ft.fp8_grouped_mm_rows(*args, torch.float32, kernel="pipelined")
    got = torch.compile(torch.ops.moetron.fp8_gluon_rows, fullgraph=True, backend="aot_eager")(*args, torch.float32)
    # against float64 on the dequantized operands, expert by expert (and the pipelined kernel's bits)
    check_rows(got, offsets, dequantize_1x128(a_q, a_s, -1), dequantize_128x128(w_q, w_s), want, "cpu", 1e-5,
               "the compiled rows op")
    torch.library.opcheck(torch.ops.moetron.fp8_gluon_rows.default, (*args, torch.bfloat16),
                          test_utils=("test_faketensor", ))
    padded = torch.tensor([128, 128, 256], dtype=torch.int32)
    (ka_q, ka_s), (kb_q, kb_s) = quantize_1x128(wide(128, 256, seed=3), -1), quantize_1x128(wide(256, 256, seed=4), -1)
    kargs = (ka_q, ka_s, kb_q, kb_s, padded, torch.float32)
    k_out = torch.ops.moetron.fp8_gluon_k(*kargs)
    ka_d, kb_d = dequantize_1x128(ka_q, ka_s, -1), dequantize_1x128(kb_q, kb_s, -1)
    assert torch.equal(k_out[1], torch.zeros(128, 256)), "the empty expert"
    for e, (s, t) in ((0, (0, 128)), (2, (128, 256))):
        assert _ref_err(k_out[e], ka_d[:, s:t], kb_d[:, s:t].T) <= 1e-5, f"wgrad op, expert {e}"
    torch.library.opcheck(torch.ops.moetron.fp8_gluon_k.default, kargs, test_utils=("test_faketensor", ))
    # bf16 out (the optimizer's bf16 expert copies): the fp32 sums rounded once, by the store (which
    # Triton's interpreter truncates; the GPU rounds to nearest even: test_precision_fp8's GPU test)
    k16 = torch.ops.moetron.fp8_gluon_k(*kargs[:-1], torch.bfloat16)
    assert k16.dtype == torch.bfloat16
    assert torch.equal(k16, (k_out.view(torch.int32) & -65536).view(torch.float32).bfloat16())


def check_gluon(device: str) -> None:
    from moetron.core.precision import fp8_triton as ft
    from moetron.core.precision.fp8_cublas import m_fastest  # the Gluon wgrad's scales: K-block-major
    from moetron.core.precision.blockwise import (dequantize_1x128, dequantize_128x128, quantize_1x128,
                                                  quantize_128x128)

    tol = 2 ** -9  # Hopper's FP8 MMA sums each 128-long K-block with fewer bits than fp32
    K, R = 512, 300
    offsets = torch.tensor([40, 40, 201, 290, 290], dtype=torch.int32, device=device)  # 10 rows past the end
    for N in (384, 640):
        x, w = wide(R, K, seed=1).to(device), wide(5, N, K, seed=2).to(device)
        a_q, a_s = quantize_1x128(x, -1)
        w_q, w_s = quantize_128x128(w)
        a_d, w_d = dequantize_1x128(a_q, a_s, -1).cpu(), dequantize_128x128(w_q, w_s).cpu()
        b, sb = w_q.transpose(1, 2), w_s.transpose(1, 2)
        pipelined = ft.fp8_grouped_mm_rows(a_q, a_s, b, sb, offsets, torch.float32, kernel="pipelined").cpu()
        for config in ROWS_CONFIGS:
            out = torch.full((R, N), float("nan"), dtype=torch.float32, device=device)
            fg.gluon_grouped_mm_rows(a_q, a_s, b, sb, offsets, out, config=config)
            out = out.cpu()
            what = f"rows N {N} {config.name}"
            check_rows(out, offsets, a_d, w_d, pipelined, device, tol, what)
            assert out[290:].isnan().all(), f"{what}: rows past the last expert written"
        bf16 = ft.fp8_grouped_mm_rows(a_q, a_s, b, sb, offsets, torch.bfloat16, kernel="gluon").cpu()
        assert torch.allclose(bf16[:290].float(), pipelined[:290], rtol=2 ** -7, atol=0)
    M, N, P = 320, 384, 640  # wgrad over padded 128-row groups, one empty, one of three K-blocks
    padded = torch.tensor([128, 128, 512, 640], dtype=torch.int32, device=device)
    dyt, xt = wide(M, P, seed=3).to(device), wide(N, P, seed=4).to(device)
    a_q, a_s = quantize_1x128(dyt, -1)
    b_q, b_s = quantize_1x128(xt, -1)
    a_d, b_d = dequantize_1x128(a_q, a_s, -1).cpu(), dequantize_1x128(b_q, b_s, -1).cpu()
    pipelined = ft.fp8_grouped_mm_k(a_q, a_s, b_q, b_s, padded, kernel="pipelined").cpu()
    for config in K_CONFIGS:
        out = torch.full((4, M, N), float("nan"), dtype=torch.float32, device=device)
        fg.gluon_grouped_mm_k(a_q, m_fastest(a_s), b_q, m_fastest(b_s), padded, out, config=config)
        out = out.cpu()
        what = f"wgrad {config.name}"
        assert torch.equal(out[1], torch.zeros(M, N)), f"{what}: the empty expert"
        for e, (s, t) in ((0, (0, 128)), (2, (128, 512)), (3, (512, 640))):
            err = _ref_err(out[e], a_d[:, s:t], b_d[:, s:t].T)
            assert err <= tol, f"{what}: expert {e} error {err:.2e} against float64"
        assert _agree(out, pipelined, device), what
    check_gluon_persistent(device)


def check_gluon_persistent(device: str) -> None:
    """More tiles than the GPU has SMs, so each persistent CTA runs several and the ring's phase
    carries from tile to tile (an odd K-block count, so tiles start mid-ring): the same outputs as
    one CTA a tile and as the pipelined kernels."""
    from moetron.core.precision import fp8_triton as ft
    from moetron.core.precision.blockwise import quantize_128x128, quantize_1x128
    from moetron.core.precision.fp8_cublas import m_fastest

    R, K, N = 6000, 384, 1024
    offsets = torch.tensor([700, 700, 2100, 2113, 4000, 5900, 5990], dtype=torch.int32, device=device)
    a_q, a_s = quantize_1x128(wide(R, K, seed=5).to(device), -1)
    w_q, w_s = quantize_128x128(wide(7, N, K, seed=6).to(device))
    b, sb = w_q.transpose(1, 2), w_s.transpose(1, 2)
    pipelined = ft.fp8_grouped_mm_rows(a_q, a_s, b, sb, offsets, torch.float32, kernel="pipelined")
    outs = []
    for config in ROWS_CONFIGS:
        out = torch.full((R, N), float("nan"), dtype=torch.float32, device=device)
        outs.append(fg.gluon_grouped_mm_rows(a_q, a_s, b, sb, offsets, out, config=config)[:5990])
        assert _agree(outs[-1], pipelined[:5990], device), f"rows {config.name}"
        assert out[5990:].isnan().all(), f"rows {config.name}: rows past the last expert written"
    assert all(torch.equal(o, outs[0]) for o in outs), "rows: persistent and one CTA a tile differ"
    padded = torch.tensor([768, 768, 2304, 2432, 4352, 6272, 6400], dtype=torch.int32, device=device)
    a_q, a_s = quantize_1x128(wide(1024, 6400, seed=7).to(device), -1)
    b_q, b_s = quantize_1x128(wide(640, 6400, seed=8).to(device), -1)
    pipelined = ft.fp8_grouped_mm_k(a_q, a_s, b_q, b_s, padded, kernel="pipelined")
    outs = []
    for config in K_CONFIGS:
        out = torch.full((7, 1024, 640), float("nan"), dtype=torch.float32, device=device)
        outs.append(fg.gluon_grouped_mm_k(a_q, m_fastest(a_s), b_q, m_fastest(b_s), padded, out, config=config))
        assert _agree(out, pipelined, device) and torch.equal(out[1], torch.zeros_like(out[1])), f"wgrad {config.name}"
    assert all(torch.equal(o, outs[0]) for o in outs), "wgrad: persistent and one CTA a tile differ"


@pytest.mark.gpu
def test_gluon_on_gpu_matches_float64_and_pipelined():
    if not fg.supported(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on SM90 only")
    check_gluon("cuda")


@pytest.mark.gpu
def test_gluon_experts_compiled_match_eager_on_gpu():
    """fp8_experts=gluon's grouped GEMM (forward, dgrad and the weight gradient) under torch.compile
    agrees with its eager run (the same kernels: within the FP8 MMA's accumulation): the custom ops keep Inductor off the Gluon kernels (session 35 call 4's
    compiled steps failed when Dynamo traced them), and the outputs agree with the Triton experts'."""
    if not fg.supported(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on SM90 only")
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    R, I, O, E = 2000, 512, 768, 4
    offsets = torch.tensor([300, 300, 1500, 1990], dtype=torch.int32, device="cuda")
    x0, w0 = wide(R, I, seed=9).cuda(), wide(E, O, I, seed=10).cuda()
    dy = wide(R, O, seed=11).cuda().bfloat16()

    def run(experts: str, compiled: bool):
        gemm = Fp8BlockwiseGemm("triton", experts=experts)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn = torch.compile(gemm.grouped_mm, fullgraph=True) if compiled else gemm.grouped_mm
        y = fn(x, w, offsets)
        y.backward(dy)
        return y[:1990].float(), x.grad[:1990], w.grad

    eager, compiled, triton_experts = run("gluon", False), run("gluon", True), run("triton", False)
    for name, a, b, t in zip(("y", "dx", "dw"), eager, compiled, triton_experts):
        assert _agree(b, a, "cuda"), f"{name}: compiled differs from eager"
        assert _agree(a, t, "cuda"), f"{name}: the Gluon experts differ from the Triton ones"
