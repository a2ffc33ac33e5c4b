"""Activation recompute under expert and pipeline parallelism (gloo, 2 processes): one training
step's loss and every gradient are bit-identical to the same layout without recompute."""

import os

import pytest
import torch

from tests.distributed import run_distributed

LAYOUTS = {
    "ep=2": ["--parallel.dp_shard=2", "--parallel.ep=2"],
    "pp=2": ["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.pp_microbatches=2"],
}
RECOMPUTE = {
    "full": ["--memory.recompute=full"],
    "selective": ["--memory.recompute=selective", "--memory.recompute_modules=[norm,swiglu,router,attention,experts]"],
}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check(rank, world_size, data_dir, layout, recompute):
    import pretrain
    from tests.parallel.test_equivalence import TINY

    os.environ["MOETRON_DATA_DIR"] = data_dir
    results = []
    for extra in ([], RECOMPUTE[recompute]):
        cfg, _ = pretrain.parse_args(["--preset", "tiny-moe", *TINY, "--trainer.run_dir=", *LAYOUTS[layout], *extra])
        seen = []
        trainer, _ = pretrain.build(cfg, torch.device("cpu"), world_size, pre_step_hook=lambda parts: seen.append(
            {n: _full(p.grad).clone() for part in parts for n, p in part.named_parameters() if p.grad is not None}))
        loss, _ = trainer.train_step(trainer.data.next_batch())
        results.append((loss.item(), seen[0]))
    (loss0, grads0), (loss1, grads1) = results
    assert loss1 == loss0
    assert grads0 and grads1.keys() == grads0.keys()
    for name, g in grads0.items():
        assert torch.equal(grads1[name], g), name


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_recompute_bit_exact_under_parallelism(tmp_path, layout, recompute):
    run_distributed(_check, 2, str(tmp_path / "data"), layout, recompute)
