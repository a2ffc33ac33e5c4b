"""The single-GPU path of every strategy that applies on one device, against the CPU run.

FSDP2 with one rank (strategies=[data]), the expert-parallel dispatcher with ep=1
(strategies=[expert]), and a one-stage pipeline with several micro-batches (strategies=[pipeline]):
each trains the tiny MoE for a few steps under torchrun with one process on the GPU (NCCL) in
fp32, and its losses must match the same run on the CPU (gloo), both from the same initial
weights. Skipped without CUDA; run on the
device with `pytest tests/parallel/test_single_gpu.py` (MOETRON_GPU_TEST_DEVICE=cpu exercises the
harness on a CPU-only machine).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.parallel.test_equivalence import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICE = os.environ.get("MOETRON_GPU_TEST_DEVICE", "cuda")
# Marked gpu so that the GPU suite (`pytest -m gpu tests/`) runs it (until session 20 it was unmarked,
# and that command deselected it); not with MOETRON_GPU_TEST_DEVICE=cpu, which conftest would skip.
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

STRATEGIES = {
    "fsdp2_one_rank": ["--parallel.strategies=[data]"],
    "ep_dispatcher_ep1": ["--parallel.strategies=[expert]"],
    "pipeline_one_stage": ["--parallel.strategies=[pipeline]", "--parallel.pp_microbatches=4"],
}


def _train(args, run_dir, device, data_dir):
    env = dict(os.environ, MOETRON_DATA_DIR=data_dir, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           os.path.join(ROOT, "tools", "pretrain.py"), "--preset", "tiny-moe", *TINY,
           # the device comes after TINY's --trainer.device=cpu: the later override wins
           # the same initial weights on both devices (the CUDA generator draws other numbers)
           "--trainer.steps=5", "--model.init_on_cpu=true", f"--trainer.device={device}", f"--trainer.run_dir={run_dir}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    strategy = args[0].split("[")[1].rstrip("]")
    assert f"parallel strategies applied: ['{strategy}']" in proc.stdout, proc.stdout[-2000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_single_device_strategy_matches_cpu(name, tmp_path):
    data_dir = str(tmp_path / "data")
    args = STRATEGIES[name]
    on_device = _train(args, str(tmp_path / "device"), DEVICE, data_dir)
    on_cpu = _train(args, str(tmp_path / "cpu"), "cpu", data_dir)
    assert sorted(on_device) == sorted(on_cpu) == [1, 2, 3, 4, 5]
    # The same initial weights (init_on_cpu) and fp32 on both: the first loss differs only by the GPU
    # kernels' summation order; later ones also by five AdamW steps at lr 1e-2 compounding it
    # (measured on an H200: step 1 equal to all printed digits, step 5 within 2.3e-4).
    for step in on_cpu:
        rel = 1e-5 if step == 1 else 1e-3
        assert on_device[step] == pytest.approx(on_cpu[step], rel=rel), (step, on_device, on_cpu)
