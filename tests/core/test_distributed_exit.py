"""core.distributed.finish_distributed: a rank of a finished distributed run leaves with status 0
through os._exit after destroying its process group, with what it printed flushed and nothing after
the call run (the interpreter's finalization, where gloo's threads could abort a good run, is
skipped); a process without torch.distributed returns from it normally. Two real gloo ranks."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.distributed import free_port
from tests.reporting import ROOT

RANK = r"""
import atexit, sys
import torch, torch.distributed as dist
from moetron.core.distributed import finish_distributed
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
atexit.register(lambda: print("finalized", flush=True))
print(f"rank {dist.get_rank()} summed {t.item():g}")  # buffered: stdout is a pipe
finish_distributed()
print("after the call")
sys.exit(3)
"""


def test_ranks_exit_zero_flushed_and_without_finalization():
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    for rank, p in enumerate(procs):
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 0, out
        assert f"rank {rank} summed 2" in out
        assert "after the call" not in out and "finalized" not in out


def test_without_torch_distributed_it_returns():
    out = subprocess.run([sys.executable, "-c", "from moetron.core.distributed import finish_distributed\n"
                          "finish_distributed(); print('returned')"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "returned" in out.stdout, out.stderr
