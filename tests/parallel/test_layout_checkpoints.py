"""A DCP checkpoint saved under one layout loads under another and training continues exactly.

Reference: the single process trains 3 steps straight. Layout A trains 2 steps and saves; layout B
loads that checkpoint and trains step 3: its loss must equal the reference's step 3 (float64 runs,
micro-batches of 2 sequences everywhere so the load-balance loss sees the same groups).
"""

import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.parallel.test_equivalence import TINY

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

MICRO = ["--trainer.micro_batch_size=2"]
LAYOUTS = {
    "single": (1, MICRO),
    "ep=2,dp_shard=2": (2, ["--parallel.dp_shard=2", "--parallel.ep=2", *MICRO]),
    "pp=2": (2, ["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.pp_microbatches=4"]),
}


def _train(rank, world, args, ckpt_dir, out, data_dir, steps, resume):
    os.environ["MOETRON_DATA_DIR"] = data_dir
    import pretrain

    from moetron.core.checkpoint import Checkpointer

    torch.set_default_dtype(torch.float64)
    cfg, _ = pretrain.parse_args(["--preset", "tiny-moe", *TINY, f"--trainer.run_dir={out}", f"--checkpoint.dir={ckpt_dir}", *args])
    checkpointer = Checkpointer(cfg.checkpoint)
    trainer, _ = pretrain.build(cfg, torch.device("cpu"), world, checkpointer)
    if resume:
        trainer.load(checkpointer.latest())
    losses = []
    while trainer.step < steps:
        loss, _ = trainer.train_step(trainer.data.next_batch())
        trainer.step += 1
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    if not resume:
        trainer.save()
    if rank == 0:
        torch.save(losses, os.path.join(out, "losses.pt"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_dir):
    out = str(tmp_path_factory.mktemp("straight"))
    run_distributed(_train, 1, MICRO, os.path.join(out, "ckpt"), out, data_dir, 3, False)
    return torch.load(os.path.join(out, "losses.pt"))


@pytest.mark.parametrize("save_as,load_as", [("ep=2,dp_shard=2", "single"), ("pp=2", "ep=2,dp_shard=2"),
                                             ("single", "pp=2")])
def test_checkpoint_moves_between_layouts(save_as, load_as, straight, tmp_path, data_dir):
    ckpt = str(tmp_path / "ckpt")
    world_a, args_a = LAYOUTS[save_as]
    run_distributed(_train, world_a, args_a, ckpt, str(tmp_path / "a"), data_dir, 2, False, timeout_s=300)
    world_b, args_b = LAYOUTS[load_as]
    run_distributed(_train, world_b, args_b, ckpt, str(tmp_path / "b"), data_dir, 3, True, timeout_s=300)
    first = torch.load(tmp_path / "a" / "losses.pt")
    resumed = torch.load(tmp_path / "b" / "losses.pt")
    assert first == pytest.approx(straight[:2], rel=1e-6)
    assert resumed == pytest.approx(straight[2:], rel=1e-6), (resumed, straight)
