"""The recipe's launch paths (examples/pretrain_moe_1t.sh): two torchrun "nodes" on this machine
(--nnodes 2, node ranks 0 and 1, c10d rendezvous on 127.0.0.1) train the CPU proxy with ep=2 over
gloo, checkpoint half-way and resume; the SLURM path's command lines, from SLURM variables set by
hand; the sbatch example runs the script through srun."""

import os
import subprocess
import sys

import pytest

from tests.distributed import free_port
from tests.tools.test_pretrain import ROOT, SMALL, losses

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

SCRIPT = os.path.join(ROOT, "examples", "pretrain_moe_1t.sh")
TINY_MOE = [a for a in SMALL if not a.startswith("--scheduler.warmup_steps")] + [
    "--model.moe.num_experts=4", "--model.moe.expert_hidden=32", "--model.moe.router.top_k=2",
    "--parallel.ep=2", "--trainer.device=cpu"]


def _env(**kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not this machine's own job
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT) prints its threads' Python stacks into the
    # output the test shows
    env.update(OMP_NUM_THREADS="1", MOETRON_PYTHON=sys.executable, PYTHONFAULTHANDLER="1")
    env.update({k: str(v) for k, v in kw.items()})
    return env


def _outputs_stopping_at_first_failure(procs, timeout: float) -> list[str]:
    """Each process' output. Where one exits non-zero the others are killed (their whole process
    groups: the script's torchrun and its ranks) instead of left waiting in the rendezvous for a peer
    that is gone, which would hold the suite until ``timeout`` (session 31: a rank aborted at the
    interpreter's finalization, gloo's teardown, in 4 of 15 full suite runs, and node 0 once waited
    its 600 s; core.distributed.finish_distributed ends ranks before it since)."""
    import concurrent.futures as cf
    import signal

    with cf.ThreadPoolExecutor(len(procs)) as pool:
        futures = {pool.submit(p.communicate, timeout=timeout): p for p in procs}
        pending = set(futures)
        while pending:
            done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            if any(futures[f].returncode != 0 for f in done):
                for f in pending:
                    try:
                        os.killpg(futures[f].pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        return [f.result()[0] for f in futures]


def test_two_nodes_train_checkpoint_and_resume(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    common = dict(STEPS=4, NNODES=2, NPROC=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RUN_DIR=run_dir,
                  MOETRON_DATA_DIR=tmp_path / "data")
    procs = [subprocess.Popen(["bash", SCRIPT, *TINY_MOE], cwd=ROOT, env=_env(NODE_RANK=r, **common),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in (0, 1)]
    outs = _outputs_stopping_at_first_failure(procs, timeout=600)
    if any(p.returncode != 0 for p in procs):  # both nodes' ends: the one that failed first, and the one stopped
        pytest.fail("\n".join(f"node {r} (exit {p.returncode}):\n{out[-3000:]}"
                               for r, (p, out) in enumerate(zip(procs, outs))))
    for r, out in enumerate(outs):
        assert f"== launch: multi-node: 2 node(s) x 1 rank(s), this is node {r}" in out
    # c10d hands out global ranks in joining order: rank 0 (which prints) may sit on either node
    assert "resumed from" in outs[0] + outs[1] and "== summary" in outs[0], outs[0][-3000:]
    assert "parallel strategies applied: ['expert', 'data']" in outs[0] + outs[1]  # ep=2 over the two nodes
    assert sorted(losses(str(run_dir))) == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "step_00000002").is_dir() and (run_dir / "checkpoints" / "step_00000004").is_dir()


def test_multi_node_needs_its_settings():
    out = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=_env(NNODES=2, NODE_RANK=1), capture_output=True, text=True)
    assert out.returncode == 2 and "NNODES=2 needs MASTER_ADDR" in out.stderr


def test_slurm_command_lines():
    env = _env(PRINT_LAUNCH=1, NPROC=8, SLURM_JOB_ID=77, SLURM_NNODES=64, SLURM_NODEID=5,
               SLURM_JOB_NODELIST="gpu-001,gpu-002", MASTER_PORT=29511)
    out = subprocess.run(["bash", SCRIPT, "--trainer.device=cpu"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "== launch: slurm: 64 node(s) x 8 rank(s), this is node 5" in lines[0] and "gpu-001:29511" in lines[0]
    torchrun = (f"{sys.executable} -m torch.distributed.run --nnodes 64 --node-rank 5 --nproc-per-node 8 "
                f"--rdzv-backend c10d --rdzv-endpoint gpu-001:29511 --rdzv-id pretrain_moe_1t-slurm-77-")
    assert lines[2].startswith(torchrun + "1 tools/pretrain.py ") and "--trainer.run_dir=runs/pretrain_moe_1t-slurm-77" in lines[2]
    assert lines[2].endswith("--trainer.stop_at_step=120 --trainer.device=cpu")
    assert lines[3] == torchrun + "2 tools/pretrain.py --config runs/pretrain_moe_1t-slurm-77/config.yaml --trainer.stop_at_step=null --resume"


def test_sbatch_example_runs_the_script_under_srun():
    text = open(os.path.join(ROOT, "examples", "slurm", "pretrain_moe_1t.sbatch")).read()
    assert "#SBATCH --ntasks-per-node=1" in text and "NCCL_NVLS_ENABLE=0" in text
    assert "srun --kill-on-bad-exit=1 bash examples/pretrain_moe_1t.sh" in text
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "examples", "slurm", "pretrain_moe_1t.sbatch")]).returncode == 0


def test_dry_run_plans_the_full_recipe_and_prints_its_launch():
    import time

    t0 = time.monotonic()
    out = subprocess.run(["bash", SCRIPT, "--dry-run"], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert time.monotonic() - t0 < 60  # seconds, on a laptop: nothing is built
    text = out.stdout
    assert "== dry run: recipe moe-1t on 512 x b300 (64 nodes x 8)" in text
    assert "1.20T total params" in text and "memory per rank" in text and "TFLOP/s/GPU" in text
    assert "layout dp_replicate 1 x dp_shard 64 (ep 8 x efsdp 8) x pp 8" in text
    last = text.strip().splitlines()[-1]
    assert "--nnodes 64 --node-rank $SLURM_NODEID --nproc-per-node 8" in last and "tools/pretrain.py --recipe moe-1t" in last
