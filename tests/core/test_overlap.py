"""optimizer.overlap (core/overlap.py): the optimizer step part by part on a side stream, each
forward unit waiting for its own update.

The reference is the ordinary step: PrecisionAwareAdamW.step_parts must give step()'s parameters,
moments and compute copies bit for bit (every update is elementwise within one tensor), and a
trainer with the switch the same losses and weights as one without, on the CPU (no stream: the
parts in place) and, on the GPU, with the stream and a compiled model. The pre-hooks run at a
compiled block's boundary; the layouts that read the parameters elsewhere are refused.
"""

import sys
from pathlib import Path

import pytest
import torch

from moetron.core.adamw import PrecisionAwareAdamW
from moetron.core.config import ConfigError
from moetron.core.optim import OptimizerConfig
from moetron.core.overlap import OptimizerOverlap, forward_units
from moetron.models.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
    return cfg, cfg.build(device=torch.device("cpu"))


def _optimizer(model, copies: bool):
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.ndim >= 2]
    opt = PrecisionAwareAdamW([{"params": decay}, {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.95), state_dtype=torch.bfloat16, kernel="foreach")
    if copies:  # bf16 compute copies holding the experts' gradients, as expert_grads_bf16 makes them
        experts = [p for n, p in model.named_parameters() if "experts" in n]
        opt.add_compute_copies({p: p.detach().bfloat16().requires_grad_() for p in experts}, grads=True)
    return opt


@pytest.mark.parametrize("copies", [False, True])
def test_step_parts_equals_step_bit_for_bit(copies):
    """Three steps of step() against step_parts() over the model's forward units (reversed, too:
    the order of the parts cannot matter), with bf16 moments, a deferred clip scale and, with
    ``copies``, bf16 copies holding some gradients: the same parameters, moments and copies."""
    results = []
    for mode in ("step", "parts", "reversed"):
        _, model = _model()
        opt = _optimizer(model, copies)
        parts = [list(u.parameters()) for u in forward_units(model)]
        parts = parts[::-1] if mode == "reversed" else parts
        seen = []
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in model.parameters():
                holder = opt.gradient_holder(p)
                grad = torch.randn(p.shape, generator=g)
                (holder if holder is not None else p).grad = grad.to(holder.dtype) if holder is not None else grad
            opt.defer_grad_scale(torch.tensor(0.5))
            if mode == "step":
                opt.step()
            else:
                opt.step_parts(parts, seen.append)
            opt.zero_grad()
        if mode != "step":
            assert seen == list(range(len(parts))) * 3
        state = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                 for p in model.parameters()]
        results.append((state, [c.detach().clone() for c in opt.compute_copies.values()]))
    for other in results[1:]:
        for a, b in zip(results[0][0], other[0]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert all(torch.equal(x, y) for x, y in zip(results[0][1], other[1]))
    assert not torch.equal(results[0][0][0][0], _model()[1].embed.weight)  # the steps moved the weights


def test_step_parts_needs_every_parameter_once():
    _, model = _model()
    opt = _optimizer(model, False)
    units = forward_units(model)
    with pytest.raises(ValueError, match="exactly one part"):
        opt.step_parts([list(u.parameters()) for u in units[1:]], lambda i: None)
    with pytest.raises(ValueError, match="exactly one part"):
        opt.step_parts([list(model.parameters()), list(units[0].parameters())], lambda i: None)


def test_forward_units_cover_the_model_in_forward_order():
    _, model = _model()
    units = forward_units(model)
    assert units[0] is model.embed and units[-1] is model.lm_head and units[-2] is model.norm
    assert units[1:-2] == list(model.blocks.values())
    ids = [id(p) for u in units for p in u.parameters()]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    assert forward_units(torch.nn.Linear(2, 2))[0].__class__ is torch.nn.Linear  # a model without units: whole


def _train(overlap: bool, device: str, compile: bool = False, steps: int = 3):
    from step_builder import RandomTokens, build_trainer

    from moetron.core.memory import MemoryConfig
    from moetron.core.precision import PrecisionConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
    dev = torch.device(device)
    data = RandomTokens(cfg.vocab_size, 2, 32, dev)
    # the weight copies off in both (their auto turns them on on a GPU only without the overlap)
    trainer = build_trainer(cfg, MemoryConfig(), data, dev, seq_len=32, compile=compile,
                            precision=PrecisionConfig().with_auto_copies(False),
                            optimizer=OptimizerConfig(state_dtype="bf16", overlap=overlap))
    losses = [trainer.train_step(data.next_batch())[0].item() for _ in range(steps)]
    trainer.wait_optimizer()
    return losses, [p.detach().cpu().clone() for p in trainer.params], trainer


def test_trainer_with_overlap_equals_without_on_cpu():
    off, w_off, t_off = _train(False, "cpu")
    on, w_on, t_on = _train(True, "cpu")
    assert t_on.overlap is not None and t_off.overlap is None
    assert on == off and on[2] != on[0]
    assert all(torch.equal(a, b) for a, b in zip(w_on, w_off))


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_trainer_with_overlap_equals_without_on_gpu(compile):
    """The side stream, its events and the hooks at compiled blocks: the same losses and weights as
    the sequential step, bit for bit."""
    off, w_off, _ = _train(False, "cuda", compile, steps=4)
    on, w_on, trainer = _train(True, "cuda", compile, steps=4)
    assert trainer.overlap.side is not None and not any(trainer.overlap.pending)
    assert on == off and on[3] != on[0]
    assert all(torch.equal(a, b) for a, b in zip(w_on, w_off))


def test_pre_hook_runs_at_a_compiled_blocks_boundary():
    """The wait hook is excluded from the traced graph and runs on every call of a compiled module."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    _, model = _model()
    opt = _optimizer(model, False)
    overlap = OptimizerOverlap(opt, forward_units(model), torch.device("cpu"))
    calls = []
    overlap.wait = calls.append
    block = model.blocks["0"]
    block.compile(backend="aot_eager")
    x = torch.randn(2, 8, model.cfg.d_model)
    want = block.forward(x)  # the module's own forward, no hooks
    counters["stats"].clear()
    for _ in range(2):
        torch.testing.assert_close(block(x), want, rtol=0, atol=0)
    assert calls == [1, 1] and counters["stats"]["unique_graphs"] == 1  # the block itself still compiled
    overlap.remove()
    block(x)
    assert calls == [1, 1]
    torch._dynamo.reset()


def test_overlap_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="overlap=true steps this package's AdamW"):
        OptimizerConfig(overlap=True, impl="torch").validate()
    with pytest.raises(ConfigError, match="overlap=true steps this package's AdamW"):
        OptimizerConfig(overlap=True, fused=True, state_dtype="fp32").validate()
    _, model = _model()
    with pytest.raises(ConfigError, match="overlap=true steps the optimizer unit by unit"):
        OptimizerOverlap(torch.optim.AdamW(model.parameters()), forward_units(model), torch.device("cpu"))
    # fp32 state on the CPU would be torch's AdamW: the switch takes this package's instead
    assert isinstance(OptimizerConfig(overlap=True).build(model), PrecisionAwareAdamW)


def test_overlap_is_refused_for_sharded_or_pipelined_models():
    from moetron.core.trainer import Trainer, TrainerConfig

    _, model = _model()
    opt = OptimizerConfig(overlap=True).build(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(ConfigError, match="shards or pipelines the model"):
        Trainer(TrainerConfig(steps=1, run_dir=""), [model, torch.nn.Linear(2, 2)], None, opt, sched, None, 1.0,
                torch.device("cpu"), overlap_optimizer=True)
