"""The Gluon FP8 blockwise grouped GEMMs (core/precision/fp8_gluon.py). Gluon has no interpreter, so
on the CPU each kernel is compiled for SM90 (ptxas ships with Triton): async wgmma kept one in flight
while the previous K-block is promoted, TMA loads, no register spills. On the GPU: the forward / dgrad
(rows) and wgrad (k) kernels against float64 on the dequantized operands and against fp8_triton's
pipelined kernels, on ragged experts (an empty one, group ends off the row tiles, rows past the end,
a column count that is not a multiple of two tiles)."""

import os
import subprocess
import tempfile
import types

import pytest
import torch

from tests.core.test_precision_emulated import wide
from tests.core.test_precision_fp8 import _agree, _compile_sm90, _ref_err, assert_no_spills, check_rows

fg = pytest.importorskip("moetron.core.precision.fp8_gluon")
if not fg.AVAILABLE:
    pytest.skip("this Triton has no Gluon", allow_module_level=True)

ROWS_CONFIGS = [fg.CONFIG, fg.GluonConfig(64, 128, 4, 3), fg.GluonConfig(128, 128, 8, 4), fg.GluonConfig(64, 64, 4, 4)]
K_CONFIGS = [fg.K_CONFIG, fg.GluonConfig(128, 64, 8, 4), fg.GluonConfig(64, 64, 4, 6)]


def _desc(rows: int) -> str:
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)
    return f"tensordesc<fp8e4nv[{rows}, 128],{layout!r}>"


def _compile(kind: str, config):
    """The rows or k kernel compiled for SM90 at OLMoE's shapes (no GPU needed)."""
    bm, bn, warps, bufs = config
    R, K, N, E, P = 131072, 2048, 2048, 64, 131072 + 64 * 128
    common = dict(a_desc=_desc(bm), b_desc=_desc(bn), sa_ptr="*fp32", sb_ptr="*fp32", off_ptr="*i32")
    if kind == "rows":
        kernel, constexprs = fg._gluon_rows_kernel, dict(EP=64, NUM_BUF=bufs, num_warps=warps)
        values = dict(common, c_ptr="*bf16", E=E, R=R, N=N, K=K, s_sam=K // 128, s_sak=1, s_sbe=N * K // 128 ** 2,
                      s_sbk=1, s_sbn=K // 128, s_cm=N)
    else:
        kernel, constexprs = fg._gluon_k_kernel, dict(NUM_BUF=bufs, num_warps=warps)
        values = dict(common, c_ptr="*fp32", M=N, N=K, s_sam=P // 128, s_sak=1, s_sbn=P // 128, s_sbk=1, s_ce=N * K,
                      s_cm=K)
    options = types.SimpleNamespace(kwargs={}, num_warps=warps, num_stages=1)
    return _compile_sm90(kernel, options, values, constexprs, gluon=True)


@pytest.mark.parametrize("kind,config", [("rows", c) for c in ROWS_CONFIGS] + [("k", c) for c in K_CONFIGS],
                         ids=lambda v: v if isinstance(v, str) else v.name.replace(" ", "-"))
def test_gluon_kernels_compile_for_sm90(kind, config):
    """Each tile the benchmark times compiles for Hopper: wgmma issued asynchronously with one group
    left in flight at the promotion (wait_group 1) and ptxas keeping them so (it serializes every
    wgmma of a kernel where registers of one in flight are touched, and says so: the first version's
    failure), operands through TMA into NUM_BUF buffers, the output in 16-byte stores, and no register spills."""
    compiled = _compile(kind, config)
    ptx = compiled.asm["ptx"]
    what = f"{kind} {config.name}"
    assert "wgmma.mma_async" in ptx, what
    assert "wgmma.wait_group.sync.aligned 1;" in ptx, f"{what}: no MMA left in flight at the promotion"
    assert "cp.async.bulk.tensor" in ptx, f"{what}: operand loads not through TMA"
    assert "st.global.v4" in ptx, f"{what}: the output not stored in 16-byte vectors"
    bm, bn, _, bufs = config
    assert compiled.metadata.shared >= bufs * (bm + bn) * 128, f"{what}: {bufs} buffers of A and B"
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the ptxas this Triton compiled the kernel with (its PTX version)
    if os.path.exists(ptxas):  # ptxas's own verdict on the pipeline: no wgmma serialized (C7514 / C7515 ...)
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "k.ptx"), "w") as f:
                f.write(ptx)
            notes = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.path.join(tmp, "k.cubin")],
                                   capture_output=True, text=True).stderr
        assert "Used" in notes, notes[-500:]
        assert "serialized" not in notes and "warpgroup.wait is injected" not in notes, f"{what}: {notes.strip()[-400:]}"
    assert_no_spills(compiled, what)


def test_gluon_config_needs_one_warpgroup_per_64_rows():
    with pytest.raises(ValueError, match="16 x num_warps"):
        fg.GluonConfig(128, 128, 4, 4)


def test_gluon_tile_is_read_when_called(monkeypatch):
    """The module's CONFIG is the tile of every later call (tools/bench_fp8_variants.py sets it to time
    each tile; a default bound at import would time one tile under every name: session 10's call 3)."""
    a = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    b = torch.zeros(2, 256, 256, dtype=torch.float8_e4m3fn).transpose(1, 2)
    assert fg.rows_descriptors(a, b)[0].block_shape == [fg.CONFIG[0], 128]
    monkeypatch.setattr(fg, "CONFIG", fg.GluonConfig(128, 64, 8, 3))
    a_desc, b_desc = fg.rows_descriptors(a, b)
    assert a_desc.block_shape == [128, 128] and b_desc.block_shape == [64, 128]


def test_gluon_descriptors_only_where_tma_reads_the_operands():
    """The Gluon kernels run only on SM90 and only where TMA can read the operands; elsewhere
    fp8_triton runs its pipelined kernel (its interpreted test checks the same bits come out)."""
    assert not fg.supported(torch.device("cpu"))
    a = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    assert fg.rows_descriptors(a, torch.zeros(2, 128, 128, dtype=torch.float8_e4m3fn).transpose(1, 2)) is not None
    # N-contiguous B, and experts not back to back: no descriptors (the pipelined kernel's pointer loads)
    assert fg.rows_descriptors(a, torch.zeros(2, 128, 128, dtype=torch.float8_e4m3fn)) is None
    assert fg.rows_descriptors(a, torch.zeros(2, 384, 128, dtype=torch.float8_e4m3fn).transpose(1, 2)[..., :192]) is None
    bt = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    assert fg.k_descriptors(bt, bt) is not None
    assert fg.k_descriptors(bt.t(), bt) is None  # A not K-contiguous
    assert fg.k_descriptors(bt[:, 1:], bt) is None  # a base off 16 bytes


def check_gluon(device: str) -> None:
    from moetron.core.precision import fp8_triton as ft
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
        fg.gluon_grouped_mm_k(a_q, a_s, b_q, b_s, padded, out, config=config)
        out = out.cpu()
        what = f"wgrad {config.name}"
        assert torch.equal(out[1], torch.zeros(M, N)), f"{what}: the empty expert"
        for e, (s, t) in ((0, (0, 128)), (2, (128, 512)), (3, (512, 640))):
            err = _ref_err(out[e], a_d[:, s:t], b_d[:, s:t].T)
            assert err <= tol, f"{what}: expert {e} error {err:.2e} against float64"
        assert _agree(out, pipelined, device), what


@pytest.mark.gpu
def test_gluon_on_gpu_matches_float64_and_pipelined():
    if not fg.supported(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on SM90 only")
    check_gluon("cuda")
