"""Strategies as plug-ins: a toy strategy registered from outside the package trains; bad layouts fail clearly."""

import os

import pytest
import torch

from moetron.core.config import ConfigError
from moetron.parallel import STRATEGIES, ParallelConfig, ParallelMesh, ParallelState, ParallelStrategy, register_strategy
from tests.parallel.test_equivalence import TINY


class FreezeEmbedding(ParallelStrategy):
    """A toy strategy: train everything but the input embedding (and say where it ran)."""

    name = "freeze_embedding"
    order = 45  # after data parallelism

    def apply(self, state: ParallelState) -> None:
        for part in state.model_parts:
            embed = getattr(part, "embed", None)
            if embed is not None:
                embed.weight.requires_grad_(False)
        APPLIED_LOG.append(self.name)


APPLIED_LOG: list[str] = []
register_strategy(FreezeEmbedding)


def test_toy_strategy_trains(tmp_path, monkeypatch):
    import pretrain

    monkeypatch.setenv("MOETRON_DATA_DIR", str(tmp_path / "data"))
    cfg, _ = pretrain.parse_args(["--preset", "tiny-moe", *TINY, f"--trainer.run_dir={tmp_path}/run",
                                  "--parallel.strategies=[freeze_embedding]"])
    trainer, state = pretrain.build(cfg, torch.device("cpu"), 1)
    assert state.applied == ["freeze_embedding"] and APPLIED_LOG == ["freeze_embedding"]
    model = state.model_parts[0]
    embed0, head0 = model.embed.weight.clone(), model.lm_head.weight.clone()
    losses = [trainer.train_step(trainer.data.next_batch())[0].item() for _ in range(3)]
    assert torch.equal(model.embed.weight, embed0)  # the strategy's effect
    assert not torch.equal(model.lm_head.weight, head0)  # the rest trains
    assert all(l == l for l in losses)


def test_strategy_order_and_names():
    assert [STRATEGIES[n].order for n in ("pipeline", "expert", "data")] == [10, 20, 40]
    with pytest.raises(ConfigError, match="already registered"):
        register_strategy(type("Other", (ParallelStrategy,), {"name": "data"}))


def test_unknown_strategy_named():
    state = ParallelState([torch.nn.Linear(2, 2)], ParallelMesh.build(ParallelConfig(), 1, "cpu"),
                          ParallelConfig(strategies=["warp_drive"]).resolve(1), None)
    from moetron.parallel import apply_strategies

    with pytest.raises(ConfigError, match=r"unknown parallel strategies \['warp_drive'\]"):
        apply_strategies(state)


@pytest.mark.parametrize(
    "cfg,world,message",
    [
        (ParallelConfig(dp_shard=3), 4, "do not match the world size 4"),
        (ParallelConfig(pp=3), 4, "world size 4 is not divisible by dp_replicate x pp x tp"),
        (ParallelConfig(ep=3), 4, "parallel.ep=3 must divide dp_shard=4"),
        (ParallelConfig(tp=2), 4, "tp > 1 is not implemented"),
        (ParallelConfig(pp_schedule="interleaved_1f1b"), 4, "needs parallel.pp_stages_per_rank >= 2"),
    ],
)
def test_sizes_that_do_not_divide(cfg, world, message):
    with pytest.raises(ConfigError, match=message):
        cfg.resolve(world)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--parallel.ep=8", "--parallel.dp_shard=8"], "exceeds model.moe.num_experts=4"),
        (["--parallel.pp=8", "--parallel.dp_shard=1"], "stages but the model has 4 layers"),
    ],
)
def test_layout_bigger_than_the_model(args, message, tmp_path):
    """Checked before any process group exists: the strategies validate against the model config."""
    import pretrain

    from moetron.parallel import expert, pipeline

    cfg, _ = pretrain.parse_args(["--preset", "tiny-moe", *TINY, f"--trainer.run_dir={tmp_path}", *args])
    resolved = cfg.parallel.resolve(8)
    state = ParallelState([cfg.model.build(device="meta")], ParallelMesh(resolved, None), resolved, cfg.model)
    with pytest.raises(ConfigError, match=message):
        for strategy in (pipeline.PipelineParallel(), expert.ExpertParallel()):
            if strategy.enabled(state):
                strategy.validate(state)
