"""Optimizer groups: weight decay on matrices only; DTensors and plain tensors never share a group.
LR schedules against multipliers worked out by hand."""

import pytest
import torch
from torch import nn

from tests.distributed import run_distributed


def _mixed_tensor_kinds(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from moetron.core.optim import OptimizerConfig

    torch.manual_seed(0)
    model = nn.Module()
    model.dense = nn.Linear(4, 4, bias=False)
    model.norm = nn.Parameter(torch.ones(4))
    mesh = init_device_mesh("cpu", (1,))
    # what expert parallel without FSDP leaves: expert weights as DTensors beside plain tensors
    model.experts = nn.Parameter(distribute_tensor(torch.randn(2, 4, 4), mesh, [Shard(0)]))
    model.bias = nn.Parameter(distribute_tensor(torch.randn(2), mesh, [Shard(0)]))
    opt = OptimizerConfig(lr=1e-2, weight_decay=0.1, fused=True).build(model)
    kinds = [({isinstance(p, DTensor) for p in g["params"]}, g["weight_decay"]) for g in opt.param_groups]
    assert sorted(kinds, key=str) == sorted([({True}, 0.1), ({False}, 0.1), ({True}, 0.0), ({False}, 0.0)], key=str)
    before = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(3, 4)
    loss = model.dense(x).sum() + (model.experts.to_local() * 2).sum() + model.norm.sum() + model.bias.to_local().sum()
    loss.backward()
    opt.step()  # the fused kernel: one call per group of one tensor kind
    for n, p in model.named_parameters():
        now = p.full_tensor() if isinstance(p, DTensor) else p
        assert not torch.equal(now, before[n]), n


def test_dtensor_and_plain_parameters_get_separate_groups():
    run_distributed(_mixed_tensor_kinds, 1)


def test_groups_unsplit_without_dtensors():
    from moetron.core.optim import OptimizerConfig

    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    opt = OptimizerConfig(lr=1e-3, weight_decay=0.1).build(model)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    decay = {id(p) for p in opt.param_groups[0]["params"]}
    assert decay == {id(model[1].weight)}  # matrices decay; embedding, biases and norms do not


def _lrs(kind, steps, **kw):
    from moetron.core.optim import SchedulerConfig

    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2.0)
    sched = SchedulerConfig(kind=kind, **kw).build(opt, total_steps=20)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"] / 2.0)
        opt.step()
        sched.step()
    return out


def test_lr_schedules_hit_their_landmarks():
    """Pinned multipliers of the peak LR (warmup 4 of 20 steps, floor 0.1), worked out by hand."""
    approx = lambda x: pytest.approx(x, abs=1e-12)  # noqa: E731
    cos = _lrs("cosine", 26, warmup_steps=4, min_lr_ratio=0.1)
    assert cos[:5] == [approx(0.25), approx(0.5), approx(0.75), approx(1.0), approx(1.0)]
    assert cos[12] == approx(0.55)  # half way through the decay: the mean of peak and floor
    assert cos[8] == approx(0.1 + 0.9 * (1 + 2 ** -0.5) / 2)  # a quarter of the way: cos(pi/4)
    assert cos[20:] == [approx(0.1)] * 6  # the floor, also past the last step
    assert all(a >= b for a, b in zip(cos[3:], cos[4:]))
    wsd = _lrs("wsd", 22, warmup_steps=4, min_lr_ratio=0.1, decay_fraction=0.25)  # decay over steps 15..20
    assert wsd[:4] == [approx(0.25), approx(0.5), approx(0.75), approx(1.0)]
    assert wsd[4:16] == [approx(1.0)] * 12
    assert wsd[16:21] == [approx(1 - 0.9 * k / 5) for k in range(1, 6)]
    assert wsd[21] == approx(0.1)
    const = _lrs("constant", 22, warmup_steps=2)
    assert const[:2] == [approx(0.5), approx(1.0)] and const[2:] == [approx(1.0)] * 20
    assert _lrs("cosine", 1, warmup_steps=0)[0] == approx(1.0)  # no warmup: the peak at once
