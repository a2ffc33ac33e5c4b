"""Global grad-norm clipping against torch's clip_grad_norm_ on the full (unsharded) gradients."""

import torch

from tests.distributed import run_distributed


def _grads(dtypes=(torch.float32, torch.float32, torch.float64)):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n, 3, dtype=dt)) for n, dt in zip((4, 1, 6), dtypes)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    return params


def _reference(params, max_norm):
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(ref, params):
        r.grad = p.grad.clone()
    norm = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=False)
    return norm, [r.grad for r in ref]


def test_plain_tensors_match_torch():
    from moetron.core.grad import clip_grad_norm_

    for max_norm in (1.0, 1e9):  # clipped, and left alone
        params = _grads()
        norm_ref, grads_ref = _reference(params, max_norm)
        norm = clip_grad_norm_(params, max_norm)
        torch.testing.assert_close(norm.double(), norm_ref.double(), rtol=1e-6, atol=0)
        for p, g in zip(params, grads_ref):
            torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)


def _sharded(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from moetron.core.grad import clip_grad_norm_

    full = _grads(dtypes=(torch.float32,) * 3)
    norm_ref, grads_ref = _reference(full, 1.0)
    mesh = init_device_mesh("cpu", (world,))
    params = []
    for p, placement in zip(full, (Shard(0), Replicate(), None)):  # sharded, replicated, plain
        if placement is None:
            params.append(torch.nn.Parameter(p.detach().clone()))
            params[-1].grad = p.grad.clone()
            continue
        param = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [placement]))
        param.grad = distribute_tensor(p.grad, mesh, [placement])
        params.append(param)
    norm = clip_grad_norm_(params, 1.0)
    torch.testing.assert_close(norm, norm_ref, rtol=1e-6, atol=0)
    for p, g in zip(params, grads_ref):
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(got, g, rtol=1e-6, atol=1e-7)


def test_sharded_dtensors_match_torch():
    run_distributed(_sharded, 2)


def test_infinite_max_norm_measures_without_touching_the_gradients():
    import math

    from moetron.core.grad import clip_grad_norm_

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p) * 100  # far above any bound
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, math.inf)
    want = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in before]))
    torch.testing.assert_close(norm, want)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
