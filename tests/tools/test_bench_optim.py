"""tools/bench_optim.py --tiny on the CPU (Triton interpreted, in a subprocess: TRITON_INTERPRET must
be set before triton is imported): every variant and BLOCK is measured and written with its
traffic and floor; bad arguments fail with one error."""

import json
import math
import os
import sys
from tests.processes import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "bench_optim.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_optim  # noqa: E402  (param_shapes: the tiny model's shapes, for the scales' bytes)

from moetron.core.moments_q8 import scale_shape  # noqa: E402


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")}
    return run_python([SCRIPT, *args], timeout=600, cwd=ROOT, env=env)


def test_tiny_rows(tmp_path):
    out = tmp_path / "optim.json"
    # one step each (interpreted), no warm-up: the first step allocates the state, which is all it changes.
    # Blocks of 4096 and 16384 (the tiny model's 211k parameters in 63 and 31 programs a step, against
    # 217 at the default 1024: the interpreter's cost is per program); the default block still runs
    # in the MX-pair row, whose tensors without whole MX blocks (the 1000-row embedding and head among
    # them) take the plain kernel at the module's BLOCK
    proc = _run("--tiny", "--steps", "1", "--warmup", "0", "--block", "4096,16384", "--mx-tiles", "64x2",
                "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["variant"], r["block"]) for r in rows] == [
        ("torch_fused_fp32", None), ("torch_foreach_fp32", None), ("foreach_bf16", None),
        *((v, b) for v in ("triton_fp32", "triton_bf16", "triton_bf16_copy") for b in (4096, 16384)),
        ("triton_bf16_mxpair", None),
        *((v, b) for v in ("triton_q8", "triton_q8_copy", "triton_fp8", "triton_fp8_copy") for b in (4096, 16384)),
        ("norm_foreach", None), ("norm_triton", None), ("triton_bf16_split", None)]
    assert [r["mx_tile"] for r in rows] == [None] * 9 + ["64x2"] + [None] * 11
    assert [r["mx_order"] for r in rows] == [None] * 9 + ["cols-first"] + [None] * 11  # the kernel's default order
    params = rows[0]["params"]
    assert params > 10_000 and all(r["params"] == params for r in rows)
    for r in rows:
        assert r["ms"] > 0 and r["gbps"] > 0
        assert abs(r["floor_ms"] - 1e3 * r["bytes_per_param"] * params / 4300e9) < 1e-9
        state_bytes = 0 if r["variant"].startswith("norm_") else 2 * params * (4 if r["variant"].endswith("fp32") else 2)
        if r["variant"].startswith(("triton_q8", "triton_fp8")):  # matrices: a byte an element, a scale a block
            scale = 8 if r["variant"].startswith("triton_q8") else 2  # two fp32 (q8) or two E8M0 bytes (fp8)
            state_bytes = sum(2 * math.prod(s) + scale * math.prod(scale_shape(s)) if len(s) >= 2 else 8 * math.prod(s)
                              for _, s in bench_optim.param_shapes(True))  # 1-D: fp32 moments
        assert abs(r["state_gib"] * 2**30 - state_bytes) < 1, r
    assert report["env"]["tiny"] is True and "triton_bf16_copy" in proc.stdout


def test_bad_arguments():
    from tests.cli_runs import run_command_lines

    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")}
    runs = run_command_lines([("bench_optim.py", ["--tiny", *args]) for args in (
        ["--variants", "adam8bit"], ["--block", "1000"], ["--mx-tiles", "128x3"], ["--mx-order", "cols"])], env=env)
    for (status, _, stderr), message in zip(runs, ("error: --variants: unknown ['adam8bit']", "powers of two",
                                                  "--mx-tiles takes COLSxWARPS",
                                                  "--mx-order takes rows-first and/or cols-first")):
        assert status == 2 and message in stderr and "Traceback" not in stderr, stderr


def test_a_failing_row_is_reported_and_the_others_run(tmp_path):
    """A row that raises (on a GPU: a swept tile that does not compile) is printed and written as
    failed, the rows after it still run, and the tool exits 1."""
    out = tmp_path / "optim.json"
    code = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'tools')!r}); import bench_optim\n"
            "real = bench_optim.build\n"
            "def build(variant, groups):\n"
            "    if variant == 'torch_foreach_fp32':\n"
            "        raise RuntimeError('no such tile')\n"
            "    return real(variant, groups)\n"
            "bench_optim.build = build\n"
            f"sys.exit(bench_optim.main(['--tiny', '--variants', 'torch_foreach_fp32,foreach_bf16', '--steps', '1', "
            f"'--warmup', '0', '--json', {str(out)!r}]))")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")}
    proc = run_python(["-c", code], timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 1 and "1 row(s) failed" in proc.stderr, proc.stdout + proc.stderr
    assert "failed: RuntimeError: no such tile" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["error"] == "RuntimeError: no such tile" and "ms" not in rows[0]
    assert rows[1]["variant"] == "foreach_bf16" and rows[1]["ms"] > 0 and "error" not in rows[1]
