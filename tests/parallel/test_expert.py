"""Expert parallelism against the single-process layer: every rank feeds different tokens, and the
outputs, input gradients and (gathered) expert gradients must equal one LocalDispatcher layer run
on all ranks' tokens with the full weights (built from the same seed in each rank)."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from moetron.core.config import ConfigError
from moetron.core.moe import MoEConfig, MoELayer, RouterConfig
from moetron.core.moe.dispatcher import LocalDispatcher
from moetron.parallel.config import ExpertDispatch, ParallelConfig
from moetron.parallel.expert import ExpertParallel, ExpertParallelDispatcher
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.registry import ParallelState
from tests.distributed import run_distributed

D, E, K, FH = 16, 4, 2, 8
B, S = 2, 8  # tokens per rank: T = 16, slots T*K = 32


def _make_layer() -> MoELayer:
    cfg = MoEConfig(num_experts=E, expert_hidden=FH, router=RouterConfig(top_k=K, lb_loss_weight=0.0))
    torch.manual_seed(0)
    layer = MoELayer(D, cfg)
    layer.init_weights(0.3)
    return layer.double()


def _ep_layer(world_size: int, mode: str, capacity_factor: float):
    pcfg = ParallelConfig(ep=2, dp_shard=2, ep_dispatch=mode, ep_capacity_factor=capacity_factor)
    mesh = ParallelMesh.build(pcfg, world_size=world_size, device_type="cpu")
    layer = _make_layer()
    ref = copy.deepcopy(layer)
    state = ParallelState([layer], mesh, mesh.cfg, SimpleNamespace(moe=layer.cfg))
    strategy = ExpertParallel()
    assert strategy.enabled(state)
    strategy.validate(state)
    strategy.apply(state)
    # The strategy scales expert gradients by 1/ep (the data strategy then averages them over the
    # dp ranks, as dense gradients are); the checks here compare against the plain sum over ranks.
    assert layer.experts.grad_scale == 1.0 / world_size
    layer.experts.grad_scale = 1.0
    return layer, ref, mesh


def _moe(dispatcher, experts, x_TD, ids_TK, w_TK):
    """The layer's dispatch -> experts -> combine with given routing (no router)."""
    d = dispatcher.dispatch(x_TD, ids_TK, E, None)
    return dispatcher.combine(experts(d.x_RD, d.offsets_L), w_TK, d), d


def _naive_kept(ids_TK: torch.Tensor, P: int, cap: int) -> torch.Tensor:
    """Slots sync_free keeps: per peer, rows in (expert, flat slot) order, the first cap of them."""
    L = E // P
    kept = torch.zeros(ids_TK.shape, dtype=torch.bool)
    flat = ids_TK.reshape(-1).tolist()
    for p in range(P):
        n = 0
        for e in range(p * L, (p + 1) * L):
            for i, eid in enumerate(flat):
                if eid == e:
                    kept.view(-1)[i] = n < cap
                    n += 1
    return kept


def _check(rank, world_size, mode, capacity_factor):
    P = world_size
    layer, ref, mesh = _ep_layer(world_size, mode, capacity_factor)
    L = E // P
    disp = layer.dispatcher
    assert isinstance(disp, ExpertParallelDispatcher) and disp.num_local_experts == L
    assert disp.mode == mode  # the mode under test, not a default
    assert layer.balance_group is mesh.group("dp")
    w = layer.experts.w_gate_up
    assert w.shape == (E, 2 * FH, D) and w.to_local().shape == (L, 2 * FH, D)
    torch.testing.assert_close(w.full_tensor(), ref.experts.w_gate_up)

    # (a) the whole layer: outputs, input gradients, expert and router gradients
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(P, B, S, D, dtype=torch.float64, generator=gen)
    g_all = torch.randn(P, B, S, D, dtype=torch.float64, generator=gen)
    x = x_all[rank].clone().requires_grad_()
    out = layer(x)
    (out * g_all[rank]).sum().backward()
    x_ref = x_all.reshape(P * B, S, D).clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * g_all.reshape(P * B, S, D)).sum().backward()
    torch.testing.assert_close(out, out_ref.view(P, B, S, D)[rank], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, x_ref.grad.view(P, B, S, D)[rank], rtol=1e-10, atol=1e-10)
    for name in ("w_gate_up", "w_down"):
        grad = getattr(layer.experts, name).grad
        torch.testing.assert_close(grad.to_local(), getattr(ref.experts, name).grad[rank * L:(rank + 1) * L],
                                   rtol=1e-10, atol=1e-10, msg=name)
        torch.testing.assert_close(grad.full_tensor(), getattr(ref.experts, name).grad, rtol=1e-10, atol=1e-10)
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    torch.testing.assert_close(router_grad, ref.router.weight.grad, rtol=1e-10, atol=1e-10)
    tokens_E = layer.log_tokens_E.clone()  # this rank's tokens per global expert; summed = all tokens
    dist.all_reduce(tokens_E)
    torch.testing.assert_close(tokens_E, ref.log_tokens_E)
    assert layer.pop_load_stats()["dropped"].item() == 0

    # A peer that receives no rows: every slot of every rank goes to rank 0's experts.
    T = B * S
    gen = torch.Generator().manual_seed(2)
    ids_all = torch.stack([torch.randperm(L, generator=gen)[:K] for _ in range(P * T)]).view(P, T, K)
    _compare_dispatch(rank, P, layer, ref, ids_all, torch.ones(P, T, K, dtype=torch.bool))

    # (c) every mode: the layer's capacity drops slots on the sending rank, as the local dispatcher does on
    # the same tokens: dropped slots travel as -1 (all_gather) and reach no expert anywhere.
    gen = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(P * T)]).view(P, T, K)[rank]
    x = torch.randn(P, T, D, dtype=torch.float64, generator=gen)[rank]
    w = torch.rand(P, T, K, dtype=torch.float64, generator=gen)[rank]
    d = disp.dispatch(x, ids, E, 3)
    out = disp.combine(layer.experts(d.x_RD, d.offsets_L), w, d)
    local = LocalDispatcher(E)
    d_ref = local.dispatch(x, ids, E, 3)
    out_ref = local.combine(ref.experts(d_ref.x_RD, d_ref.offsets_L), w, d_ref)
    assert (d_ref.state.dest_row_TK < 0).any()  # something was dropped
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-10)
    assert torch.equal(d.kept_per_expert_E, d_ref.kept_per_expert_E)

    if mode == ExpertDispatch.all_gather:
        # (d) a tiny capacity factor bounds each rank's expert buffer to R rows of all P*T*K gathered
        # slots; the receiver drops its last experts' rows past R (in gathered order: source rank,
        # token, k), counts them, and takes them out of its kept counts.
        disp.capacity_factor = 0.25
        R = disp.peer_capacity(P * T * K)
        assert R == math.ceil(0.25 * T * K) == 8
        disp.pop_overflow()
        ids_all = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(P * T)]).view(P, T, K)
        kept_all = _naive_kept(ids_all.reshape(P * T, K), P, R).view(P, T, K)
        assert (~kept_all).any()
        d = _compare_dispatch(rank, P, layer, ref, ids_all, kept_all)
        mine = (ids_all // L == rank)
        assert disp.pop_overflow().item() == int((mine & ~kept_all).sum())
        kept = d.kept_per_expert_E.long().clone()
        dist.all_reduce(kept)
        assert kept.sum().item() == int(kept_all.sum())
        disp.capacity_factor = 2.0

    if mode == ExpertDispatch.sync_free:
        # (b) a tiny capacity factor: rows past cap per peer are dropped, counted, and contribute nothing.
        disp.capacity_factor = 0.25
        cap = disp.peer_capacity(T * K)
        assert cap == math.ceil(0.25 * T * K / P) == 4
        disp.pop_overflow()
        ids_all = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(P * T)]).view(P, T, K)
        kept_all = torch.stack([_naive_kept(ids_all[p], P, cap) for p in range(P)])
        assert (~kept_all[rank]).any()
        d = _compare_dispatch(rank, P, layer, ref, ids_all, kept_all)
        assert disp.pop_overflow().item() == int((~kept_all[rank]).sum())
        assert d.kept_per_expert_E.sum().item() == int(kept_all[rank].sum())
        assert d.tokens_per_expert_E.sum().item() == T * K


def _compare_dispatch(rank, P, layer, ref, ids_all, kept_all):
    """dispatch/experts/combine with given routing vs. the local layer with dropped slots zeroed."""
    T = ids_all.shape[1]
    gen = torch.Generator().manual_seed(3)
    x_all = torch.randn(P, T, D, dtype=torch.float64, generator=gen)
    w_all = torch.rand(P, T, K, dtype=torch.float64, generator=gen)
    g_all = torch.randn(P, T, D, dtype=torch.float64, generator=gen)
    for p in (*layer.experts.parameters(), *ref.experts.parameters()):
        p.grad = None
    x = x_all[rank].clone().requires_grad_()
    out, d = _moe(layer.dispatcher, layer.experts, x, ids_all[rank], w_all[rank])
    (out * g_all[rank]).sum().backward()
    x_ref = x_all.reshape(P * T, D).clone().requires_grad_()
    w_ref = (w_all * kept_all).reshape(P * T, K)
    out_ref, _ = _moe(LocalDispatcher(E), ref.experts, x_ref, ids_all.reshape(P * T, K), w_ref)
    (out_ref * g_all.reshape(P * T, D)).sum().backward()
    torch.testing.assert_close(out, out_ref.view(P, T, D)[rank], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, x_ref.grad.view(P, T, D)[rank], rtol=1e-10, atol=1e-10)
    L = layer.dispatcher.num_local_experts
    for name in ("w_gate_up", "w_down"):
        grad, grad_ref = getattr(layer.experts, name).grad, getattr(ref.experts, name).grad[rank * L:(rank + 1) * L]
        # Local experts that received no rows may get no gradient at all (the loop backend runs nothing).
        grad = torch.zeros_like(grad_ref) if grad is None else grad.to_local()
        torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-10, msg=name)
    return d


@pytest.mark.parametrize("mode", [ExpertDispatch.synced, ExpertDispatch.sync_free, ExpertDispatch.all_gather])
def test_expert_parallel_matches_single_process(mode):
    # sync_free: factor P makes cap = T*K, so nothing can overflow in the equivalence checks.
    run_distributed(_check, 2, str(mode), 2.0)


def _save_sharded(rank, world_size, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    layer, ref, mesh = _ep_layer(world_size, "synced", 2.0)
    fully_shard(layer.experts, mesh=mesh.expert_fsdp)  # what the data strategy does after expert
    fully_shard(layer, mesh=mesh.dense_fsdp)
    x = torch.randn(B, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    xs = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(xs, x)
    torch.testing.assert_close(layer(x), ref(torch.cat(xs))[rank * B:(rank + 1) * B], rtol=1e-10, atol=1e-10)
    dcp.save(layer.state_dict(), checkpoint_id=path)


def test_checkpoint_holds_global_experts(tmp_path):
    """ep=2 (+ FSDP2 on the experts) saves the global [E, ...] tensors: a single process loads them."""
    import torch.distributed.checkpoint as dcp

    run_distributed(_save_sharded, 2, str(tmp_path / "ckpt"))
    layer = _make_layer()
    expected = {k: v.clone() for k, v in layer.state_dict().items()}
    sd = {k: torch.zeros_like(v) for k, v in layer.state_dict().items()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"))
    for name in ("experts.w_gate_up", "experts.w_down", "router.weight"):
        torch.testing.assert_close(sd[name], expected[name], msg=name)


def test_validate_errors():
    def state(num_experts, ep):
        cfg = ParallelConfig(ep=ep, dp_shard=ep)
        return ParallelState([], ParallelMesh(cfg, None), cfg, SimpleNamespace(moe=MoEConfig(num_experts=num_experts)))

    with pytest.raises(ConfigError, match=r"model.moe.num_experts=6 is not divisible by parallel.ep=4"):
        ExpertParallel().validate(state(6, 4))
    with pytest.raises(ConfigError, match=r"parallel.ep=8 exceeds model.moe.num_experts=4"):
        ExpertParallel().validate(state(4, 8))
    ExpertParallel().validate(state(8, 4))
    assert not ExpertParallel().enabled(state(8, 1))


def test_auto_dispatch_resolution():
    from moetron.parallel.expert import resolve_dispatch

    assert resolve_dispatch("auto", 2, 8) == ExpertDispatch.all_gather
    assert resolve_dispatch("auto", 4, 4) == ExpertDispatch.all_gather
    assert resolve_dispatch("auto", 8, 4) == ExpertDispatch.synced
    assert resolve_dispatch("sync_free", 2, 8) == ExpertDispatch.sync_free
    assert ParallelConfig().ep_dispatch == ExpertDispatch.auto
    with pytest.raises(ValueError, match="resolved by the strategy"):
        ExpertParallelDispatcher(4, None, "auto")
