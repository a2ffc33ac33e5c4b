"""tools/bench_grouped_mm.py: the passes' operands are the experts' GEMMs in the model's layouts
(checked against a loop over the groups), and --tiny runs on the CPU with one row per (GEMM, pass)."""

import json
import os
import sys

import pytest
import torch
from tests.processes import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))


@pytest.mark.parametrize("pass_", ["fwd", "dgrad", "wgrad"])
def test_each_pass_is_the_experts_gemm_per_group(pass_):
    """fwd: y[rows of e] = x @ w[e]^T (w [E, O, I]); dgrad: dx[rows of e] = dy @ w[e]; wgrad:
    dw[e] = dy[rows of e]^T @ x[rows of e]; float64 loops over the groups as the reference."""
    import bench_grouped_mm as b

    R, I, O, E = 40, 32, 48, 4
    offs = torch.tensor([13, 13, 31, 40], dtype=torch.int32)  # ragged, an empty group
    args, kwargs = b.operands(pass_, R, I, O, offs, torch.device("cpu"))
    got = b.torch_op(pass_)(*args, **kwargs).double()
    ends = kwargs["offs"].tolist()
    assert ends == [13, 13, 31, 40]
    a, bmat = (t.double() for t in args)
    start = 0
    for e, end in enumerate(ends):
        if pass_ == "wgrad":  # a = dy^T [O, R], b = x [R, I]
            want = a[:, start:end] @ bmat[start:end]
            assert got.shape == (E, O, I)
            torch.testing.assert_close(got[e], want, rtol=2e-2, atol=2e-2)  # an empty group: zeros
        else:  # b[e] = w[e]^T [I, O] (fwd) or w[e] [O, I] (dgrad)
            want = a[start:end] @ bmat[e]
            assert got.shape == (R, O if pass_ == "fwd" else I)
            torch.testing.assert_close(got[start:end], want, rtol=2e-2, atol=2e-2)
        start = end
    if pass_ == "fwd":  # w is [E, O, I] contiguous, as GroupedExperts holds it: the GEMM reads its transpose
        assert bmat.shape == (E, I, O) and args[1].transpose(-2, -1).is_contiguous()


def test_tiny_run_reports_every_pass(tmp_path):
    out = tmp_path / "grouped_mm.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = run_python([os.path.join(ROOT, "tools", "bench_grouped_mm.py"), "--tiny", "--iters", "2",
                       "--json", str(out)], timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["gemm"], r["pass_"]) for r in rows} == {(g, p) for g in ("gate_up", "down")
                                                       for p in ("fwd", "dgrad", "wgrad", "fwd fp8")}
    for r in rows:
        I, O = (256, 256) if r["gemm"] == "gate_up" else (128, 256)
        assert (r["I"], r["O"], r["rows"]) == (I, O, 64 * 2)
        assert r["tflop"] == pytest.approx(2 * r["rows"] * I * O / 1e12)
        sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
        if r["pass_"] == "fwd fp8" and not sm90:
            assert "SM90" in r["error"]
        else:
            assert r["torch_ms"] > 0 and r["torch_tflops"] > 0


def test_a_fallback_to_torchs_kernel_is_not_taken_for_triton():
    """inductor's output for torch._grouped_mm where it has no Triton template (here: the CPU, which
    calls torch's kernel back) is told apart from a Triton grouped GEMM, so the benchmark never times
    torch's kernel twice under two names."""
    import bench_grouped_mm as b
    from torch._inductor.utils import run_and_get_code

    args, kwargs = b.operands("fwd", 40, 32, 48, torch.tensor([13, 26, 40], dtype=torch.int32), torch.device("cpu"))
    torch._dynamo.reset()
    out, codes = run_and_get_code(b.triton_fn("fwd"), *args, **kwargs)
    torch.testing.assert_close(out, b.torch_op("fwd")(*args, **kwargs))
    assert codes and not b.generated_triton_grouped_mm(codes)
    assert b.generated_triton_grouped_mm(["@triton.jit\ndef triton_tem_fused__grouped_mm_0(...):"])
