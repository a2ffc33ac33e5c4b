"""precision.bf16_residual: the residual stream between the blocks in bf16 on one unsharded device (on by
default with the bf16 recipe: ``auto``).

Oracle: the model's forward composed by hand from its own modules, with the embedding's output cast
to bf16 and nothing else changed (what FSDP2's bf16 parameters do to the stream in sharded runs); the
switch must give that forward's loss and gradients bit for bit, differ from the fp32 stream's (so it
acts), stay within bf16 rounding of it, and carry bf16 between pipeline stages.
"""

from __future__ import annotations

import pytest
import torch

from moetron.core.config import ConfigError
from moetron.core.precision import PrecisionConfig
from moetron.models import ModelConfig
from moetron.parallel.pipeline.stages import split_stages


def _model(bf16_residual: bool):
    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
    torch.manual_seed(0)
    model = cfg.build(device="cpu")
    policy = PrecisionConfig(recipe="bf16", bf16_residual=bf16_residual).build("cpu")
    policy.apply(model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    return model, policy, tokens[:, :-1], tokens[:, 1:]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_switch_is_the_forward_with_the_embedding_cast_to_bf16():
    model, policy, ids, labels = _model(True)
    assert model.embed.out_dtype == torch.bfloat16
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype)) for b in model.blocks.values()]
    with policy.autocast():
        loss = model(ids, labels)
    loss.backward()
    got, got_grads = loss.detach(), _grads(model)
    for h in hooks:
        h.remove()
    assert seen == [torch.bfloat16] * 2
    model.zero_grad(set_to_none=True)
    with policy.autocast():  # the reference: the same modules, the stream cast by hand
        h = model.embed(ids).to(torch.bfloat16)
        for block in model.blocks.values():
            h = block(h)
        ref = model.lm_head(model.norm(h), labels)
    ref.backward()
    assert torch.equal(got, ref.detach())
    ref_grads = _grads(model)
    assert got_grads.keys() == ref_grads.keys() and all(torch.equal(got_grads[n], ref_grads[n]) for n in ref_grads)
    assert got_grads["embed.weight"].dtype == torch.float32 and got_grads["embed.weight"].abs().sum() > 0


def test_the_bf16_stream_is_within_rounding_of_the_fp32_one_and_not_equal():
    runs = {}
    for on in (False, True):
        model, policy, ids, labels = _model(on)
        with policy.autocast():
            loss = model(ids, labels)
        loss.backward()
        runs[on] = loss.item(), _grads(model)
    (l32, g32), (l16, g16) = runs[False], runs[True]
    assert l16 != l32 and l16 == pytest.approx(l32, rel=2e-2)
    rel = [((g16[n] - g32[n]).norm() / g32[n].norm()).item() for n in g32 if g32[n].norm() > 0]
    assert max(rel) > 0 and sorted(rel)[len(rel) // 2] < 0.1


def test_pipeline_stages_carry_the_bf16_stream_and_equal_the_model():
    model, policy, ids, labels = _model(True)
    with policy.autocast():
        whole = model(ids)
    first, last = split_stages(model, 2)
    for stage in (first, last):  # as the pipeline strategy sets it (parallel/pipeline/__init__.py); the first
        stage.autocast = policy.autocast  # stage shares the model's embedding, whose out_dtype apply() set
    h = first(ids)
    assert h.dtype == torch.bfloat16 == policy.boundary_dtype(torch.float32, sharded=False)
    assert torch.equal(last(h), whole)
    plain = PrecisionConfig(recipe="bf16", bf16_residual=False).build("cpu")
    assert plain.residual_dtype is None and plain.boundary_dtype(torch.float32, sharded=False) == torch.float32


def _trained_losses(compile: bool) -> list[float]:
    from step_builder import RandomTokens, build_trainer  # tools/ (tests/conftest.py puts it on the path)

    from moetron.core.memory import MemoryConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
    data = RandomTokens(cfg.vocab_size, 2, 32, torch.device("cpu"))
    trainer = build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32, compile=compile,
                            precision=PrecisionConfig(recipe="bf16", bf16_residual=True))
    assert trainer.model.embed.out_dtype == torch.bfloat16
    batch = data.next_batch()
    return [trainer.train_step(batch)[0].item() for _ in range(3)]


def test_bf16_residual_trains_eager_and_compiled():
    """Three steps on one batch: the loss falls, and the compiled blocks (inductor on the CPU, bf16 inputs at
    every block) give the eager losses within bf16 rounding (inductor fuses and rounds in its own order)."""
    eager, compiled = _trained_losses(False), _trained_losses(True)
    assert eager[2] < eager[0] and compiled[2] < compiled[0]
    assert compiled == pytest.approx(eager, rel=1e-2)


def test_bf16_residual_refuses_an_fp32_run():
    with pytest.raises(ConfigError, match="precision.recipe=bf16, or drop bf16_residual"):
        PrecisionConfig(bf16_residual=True).build("cpu")  # auto on the CPU: fp32
    with pytest.raises(ConfigError, match="precision.recipe=bf16, or drop bf16_residual"):
        PrecisionConfig(recipe="fp32", bf16_residual="true").validate()  # known before the build


@pytest.mark.parametrize("recipe, value, want", [
    ("bf16", "auto", torch.bfloat16), ("bf16", False, None), ("bf16", "false", None), ("bf16", True, torch.bfloat16),
    ("auto", "auto", None), ("fp32", "auto", None),  # auto: fp32 on the CPU, no compute dtype
    ("fp8_blockwise", "auto", None), ("fp8_blockwise", "true", torch.bfloat16),  # not measured there: asked for
])
def test_auto_is_on_with_the_bf16_recipe_only(recipe, value, want):
    """The build's residual dtype, and the planner's switch, from the one rule (config.residual_on)."""
    from moetron.core.optim import OptimizerConfig
    from moetron.parallel.config import ParallelConfig
    from moetron.run.planner.hardware import GPUS
    from moetron.run.planner.switches import switches

    config = PrecisionConfig(recipe=recipe, bf16_residual=value)
    assert config.build("cpu", verbose=False).residual_dtype == want
    if recipe in ("bf16", "fp8_blockwise"):  # the planner's GPU (auto is bf16 there; fp32 it refuses)
        sw = switches(ModelConfig.preset("tiny-moe"), ParallelConfig(), config, OptimizerConfig(), GPUS["h100"], compiled=True)
        assert sw.bf16_residual == (want is not None)
