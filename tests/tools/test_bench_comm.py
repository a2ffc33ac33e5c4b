"""tools/bench_comm.py: every collective and size measured and verified on two gloo ranks, busbw =
algbw x the nccl-tests factor; a one-rank run without torchrun; bad input exits 2 and says why."""

import json
import os

import pytest

from tests.processes import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "tools", "bench_comm.py")
OPS = ["all_to_all", "all_reduce", "reduce_scatter", "all_gather"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _run(args, nproc=None, timeout=120):
    """The tool as ``python`` runs it, or under torchrun (its agent forked warm, its ranks new interpreters)."""
    launch = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return run_python([*launch, BENCH, *args], env=ENV, cwd=ROOT, timeout=timeout)


def test_two_ranks_every_op_and_size(tmp_path):
    out = str(tmp_path / "comm.json")
    proc = _run(["--device", "cpu", "--sizes", "4Ki", "64Ki", "--iters", "3", "--warmup", "1", "--json", out], nproc=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.load(open(out))
    rows = {(r["op"], r["bytes"]): r for r in result["rows"]}
    assert sorted(rows) == sorted((op, size) for op in OPS for size in (4096, 65536))
    factors = {"all_reduce": 1.0, "all_to_all": 0.5, "reduce_scatter": 0.5, "all_gather": 0.5}  # n = 2
    for (op, size), r in rows.items():
        assert r["verified"] and r["time_us"] > 0, r
        assert r["algbw_gbps"] == pytest.approx(size / (r["time_us"] * 1e-6) / 1e9)
        assert r["bus_factor"] == factors[op]
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factors[op])
        assert r["count"] == size // 2 and r["dtype"] == "bf16"
    env = result["env"]
    assert env["world_size"] == 2 and env["backend"] == "gloo" and env["nccl"] is None
    assert env["env_vars"]["NCCL_NVLS_ENABLE"] == "0"
    assert env["command"].startswith("torchrun --nproc-per-node 2 tools/bench_comm.py")
    assert "busbw GB/s" in proc.stdout and "topology" in proc.stdout


def test_one_rank_without_torchrun(tmp_path):
    out = str(tmp_path / "comm.json")
    proc = _run(["--device", "cpu", "--sizes", "4Ki", "--iters", "2", "--dtype", "fp32", "--json", out])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.load(open(out))["rows"]
    assert [r["op"] for r in rows] == OPS
    assert all(r["time_us"] > 0 and r["bus_factor"] == 0 and r["busbw_gbps"] == 0 for r in rows)


BAD_INPUT = [
    (["--ops", "all_reduce", "broadcast"], "valid ops: all_to_all, all_reduce, reduce_scatter, all_gather"),
    (["--sizes", "1X"], "--sizes '1X' is not a positive size"),
    (["--sizes", "4097"], "does not divide for all_to_all"),
]


@pytest.fixture(scope="module")
def bad_input_runs():
    """Every BAD_INPUT case as ``python tools/bench_comm.py ...`` runs it (tests/cli_runs.py)."""
    from tests.cli_runs import run_command_lines

    return run_command_lines([("bench_comm.py", ["--device", "cpu", "--json", "", *args]) for args, _ in BAD_INPUT],
                              env=ENV, timeout=180)


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[m for _, m in BAD_INPUT])
def test_bad_input_exits_2(case, bad_input_runs):
    status, stdout, stderr = bad_input_runs[case]
    assert status == 2, stdout + stderr
    assert "error: " in stderr and BAD_INPUT[case][1] in stderr, stderr
    assert "Traceback" not in stderr
