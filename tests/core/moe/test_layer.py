"""The MoE layer against a naive loop over tokens and their k experts, written independently."""

import math

import pytest
import torch
import torch.nn.functional as F

from moetron.core.config import ConfigError
from moetron.core.moe.aux_loss import aux_loss_scale
from moetron.core.moe import LoadBalanceGranularity, MoEConfig, MoELayer, RouterConfig, load_balance_loss, z_loss
from moetron.models import ModelConfig

D, E, FH = 16, 6, 12


def naive_moe(layer: MoELayer, x_TD: torch.Tensor, capacity: int | None):
    """Float64 loops: route each token, run each chosen expert on it, weight and sum."""
    cfg = layer.cfg.router
    W = layer.router.weight.double()
    out = torch.zeros(x_TD.shape, dtype=torch.float64)
    used = [0] * E
    for t in range(x_TD.shape[0]):
        x = x_TD[t].double()
        logits = W @ x
        scores = torch.softmax(logits, 0) if cfg.score == "softmax" else torch.sigmoid(logits)
        chosen = sorted(range(E), key=lambda e: -float(scores[e].detach()))[: cfg.top_k]
        weights = [scores[e] for e in chosen]
        if cfg.renormalize:
            s = sum(weights)
            weights = [w / s for w in weights]
        for e, w in zip(chosen, weights):
            used[e] += 1
            if capacity is not None and used[e] > capacity:
                continue  # dropped: later slots of a full expert contribute nothing
            gu = layer.experts.w_gate_up[e].double() @ x
            h = F.silu(gu[:FH]) * gu[FH:]
            out[t] += cfg.scale * w * (layer.experts.w_down[e].double() @ h)
        if layer.shared is not None:
            s = layer.shared
            out[t] += s.down_proj.weight.double() @ (F.silu(s.gate_proj.weight.double() @ x) * (s.up_proj.weight.double() @ x))
    return out


def make_layer(**kw):
    router = RouterConfig(**{"top_k": 2, "lb_loss_weight": 0.0, **kw.pop("router", {})})
    cfg = MoEConfig(num_experts=E, expert_hidden=FH, router=router, **kw)
    cfg.validate_for(4)
    torch.manual_seed(0)
    layer = MoELayer(D, cfg)
    layer.init_weights(0.3)
    if layer.shared is not None:
        for p in layer.shared.parameters():
            torch.nn.init.normal_(p, std=0.3)
    return layer.double()


CASES = [
    dict(router=dict(score="softmax", renormalize=True)),
    dict(router=dict(score="softmax", renormalize=False)),
    dict(router=dict(score="sigmoid", renormalize=True)),
    dict(router=dict(score="sigmoid", renormalize=False, scale=2.5)),
    dict(router=dict(score="softmax", top_k=3), num_shared_experts=1, shared_expert_hidden=8),
    dict(router=dict(score="softmax", top_k=2), capacity_factor=0.5),
    dict(router=dict(score="sigmoid", top_k=1), capacity_factor=1.0, num_shared_experts=2),
]


@pytest.mark.parametrize("before_down", [False, True], ids=["weights-in-combine", "weights-before-down"])
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_layer_matches_naive_loop(case, before_down):
    layer = make_layer(**case, weights_before_down=before_down)
    x = torch.randn(2, 9, D, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    capacity = layer.cfg.capacity(18)
    x_ref = x.detach().clone().requires_grad_()
    params = dict(layer.named_parameters())
    ref = naive_moe(layer, x_ref.view(-1, D), capacity).view(2, 9, D)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    if layer.cfg.capacity_factor is not None:
        assert layer.log_dropped.item() > 0  # the case really drops
    # gradients: input and every parameter
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), [x, *params.values()], allow_unused=True)
    grads_ref = torch.autograd.grad((ref * g).sum(), [x_ref, *params.values()], allow_unused=True)
    for name, a, b in zip(["x", *params], grads, grads_ref):
        if a is None and b is None:
            continue
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


def test_group_limited_routing_picks_within_best_groups():
    layer = make_layer(router=dict(top_k=2, n_groups=3, topk_groups=1))
    x = torch.randn(40, D, dtype=torch.float64)
    ids = layer.router(x).topk_ids_TK
    assert torch.equal(ids[:, 0] // 2, ids[:, 1] // 2)  # both experts from one group of 2


def test_load_balance_loss_hand_values():
    probs = torch.tensor([[0.9, 0.1], [0.7, 0.3]])
    ids = torch.tensor([[0], [0]])
    counts = torch.tensor([2, 0])
    # f = [1, 0], P = [0.8, 0.2]: 2 * (1 * 0.8) = 1.6
    assert load_balance_loss(probs, ids, counts, LoadBalanceGranularity.micro_batch, 1).item() == pytest.approx(1.6)
    # uniform routing and probabilities give exactly 1
    probs_u = torch.full((4, 4), 0.25)
    ids_u = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert load_balance_loss(probs_u, ids_u, torch.tensor([2, 2, 2, 2]), "micro_batch", 1).item() == pytest.approx(1.0)
    # sequence-level: seq 0 = tokens 0-1 all on expert 0 (f=[1,0], P=[.8,.2] -> 1.6);
    # seq 1 = tokens 2-3 split (f=[.5,.5], P=[.5,.5] -> 1.0); mean 1.3
    probs_s = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.5, 0.5], [0.5, 0.5]])
    ids_s = torch.tensor([[0], [0], [0], [1]])
    got = load_balance_loss(probs_s, ids_s, torch.tensor([3, 1]), "sequence", 2)
    assert got.item() == pytest.approx(1.3)


def test_z_loss_hand_value():
    assert z_loss(torch.zeros(3, 2)).item() == pytest.approx(math.log(2) ** 2)
    assert z_loss(torch.tensor([[0.0, math.log(3.0)]])).item() == pytest.approx(math.log(4.0) ** 2)


def _hand_aux_losses(layer, x):
    """(lb_loss, z_loss) of layer's router on x, weighted 0.5 and 0.1, from the formulas by hand."""
    r = layer.router(x.view(-1, D))
    z = 0.1 * torch.logsumexp(r.logits_TE, dim=-1).square().mean()
    # Switch loss by hand: E * sum_e (fraction of the 10 * 2 slots on e) * (mean prob of e)
    f = torch.zeros(E, dtype=torch.float64).index_add_(0, r.topk_ids_TK.reshape(-1), torch.ones(20, dtype=torch.float64)) / 20
    return 0.5 * E * (f * r.probs_TE.mean(0)).sum(), z


def test_aux_losses_reported_and_weighted():
    layer = make_layer(router=dict(lb_loss_weight=0.5, z_loss_weight=0.1))
    x = torch.randn(2, 5, D, dtype=torch.float64)
    layer(x)
    lb, z = _hand_aux_losses(layer, x)
    stats = layer.pop_load_stats()
    assert layer.aux_names == ("lb_loss", "z_loss")
    assert stats["z_loss"].item() == pytest.approx(z.item())
    assert stats["lb_loss"].item() == pytest.approx(lb.item())
    with aux_loss_scale(0.25):  # a micro-batch of weight 1/4: reported (and trained) at that weight
        layer(x)
    assert layer.pop_load_stats()["z_loss"].item() == pytest.approx(0.25 * z.item())
    layer.eval()
    layer(x)
    stats = layer.pop_load_stats()
    assert stats["lb_loss"].item() == 0 and stats["z_loss"].item() == 0  # evaluation adds no auxiliary losses


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_aux_losses_train_through_the_output(scale):
    """The router gets the aux losses' gradient from the layer's output alone, at the step's scale."""
    layer = make_layer(router=dict(lb_loss_weight=0.5, z_loss_weight=0.1))
    x = torch.randn(2, 5, D, dtype=torch.float64)
    with aux_loss_scale(scale):
        (layer(x) * 0).sum().backward()  # the LM loss contributes nothing: only the attached losses
    got = layer.router.weight.grad.clone()
    layer.router.weight.grad = None
    lb, z = _hand_aux_losses(layer, x)
    (scale * (lb + z)).backward()
    # rtol: the layer counts the routed fractions f_e in fp32
    torch.testing.assert_close(got, layer.router.weight.grad, rtol=1e-6, atol=1e-9)
    assert got.abs().sum() > 0


def test_load_stats_match_routing():
    """pop_load_stats: per-expert counts, drops and mean routing entropy of the training forwards."""
    layer = make_layer(router=dict(top_k=2), capacity_factor=0.5)
    xs = [torch.randn(2, 9, D, dtype=torch.float64) for _ in range(2)]
    counts, entropy, dropped = torch.zeros(E, dtype=torch.float64), 0.0, 0
    for x in xs:
        layer(x)
        r = layer.router(x.view(-1, D))
        step = torch.zeros(E, dtype=torch.float64).index_add_(0, r.topk_ids_TK.reshape(-1), torch.ones(36, dtype=torch.float64))
        counts += step
        dropped += int((step - layer.cfg.capacity(18)).clamp_min(0).sum())
        entropy += sum(-sum(p * math.log(p) for p in row if p > 0) for row in r.probs_TE.tolist())
    stats = layer.pop_load_stats()
    torch.testing.assert_close(stats["tokens_per_expert"], counts)
    assert dropped > 0 and stats["dropped"].item() == dropped
    assert stats["entropy"].item() == pytest.approx(entropy / 36)
    assert layer.pop_load_stats()["tokens_per_expert"].sum() == 0  # popping resets the counts


def test_expert_bias_moves_load_toward_balance():
    """A skewed stream (inputs leaning toward expert 0's router row) gets balanced by the bias.

    The router is set by hand, so the skew comes from the construction, not from a seed's draws:
    nn.init.trunc_normal_ samples differently in torch 2.11 (inverse CDF) and 2.13 (rejection), and
    with random rows about half of all seeds missed one bound or the other on either version."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, expert_hidden=8,
                    router=RouterConfig(top_k=2, expert_bias=True, bias_update_rate=1e-3, lb_loss_weight=0.0))
    layer = MoELayer(D, cfg)
    layer.init_weights(0.5)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(8, D))  # expert e's logit is input coordinate e
    # Expert 0's logit ~ N(2, 1), the others' N(0, 1): it takes ~3.4x the mean load (before ~2.4 over
    # seeds and torch versions), and 400 steps of 1e-3 bring it under 0.11.
    skew = 2.0 * layer.router.weight.detach()[0].clone()

    def violation(steps=20):
        """max/mean - 1 of the load over `steps` batches, the bias held fixed."""
        layer.pop_load_stats()
        with torch.no_grad():
            for _ in range(steps):
                layer(torch.randn(4, 64, D) + skew)
        layer.step_tokens_E.zero_()
        counts = layer.pop_load_stats()["tokens_per_expert"]
        return (counts.max() / counts.mean() - 1).item()

    before = violation()
    for _ in range(400):
        with torch.no_grad():
            layer(torch.randn(4, 64, D) + skew)
        layer.update_expert_bias()
    after = violation()
    assert before > 1.5 and after < 0.25 * before, (before, after)
    bias = layer.router.expert_bias
    assert bias[0] == bias.min()  # the over-loaded expert got the lowest bias
    assert layer.router.weight.grad is None  # moved without gradients


def test_expert_bias_resumes_exactly(tmp_path):
    """The expert bias is model state: a trainer stopped after two steps, saved and loaded into a
    fresh one (its bias zero) continues exactly as the uninterrupted trainer does: the same losses
    and the same bias, which did move."""
    from step_builder import RandomTokens, build_trainer  # tools/ (tests/conftest.py puts it on the path)

    from moetron.core.checkpoint import CheckpointConfig, Checkpointer
    from moetron.core.memory import MemoryConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.router.expert_bias=true", "moe.router.bias_update_rate=1e-2"])

    def fresh():
        data = RandomTokens(cfg.vocab_size, 2, 32, torch.device("cpu"))
        return build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32, precision="fp32"), data

    def biases(trainer):
        return [layer.router.expert_bias.clone() for layer in trainer.model.moe_layers().values()]

    straight, data = fresh()
    batches = [data.next_batch() for _ in range(4)]
    want = [straight.train_step(b)[0].item() for b in batches]
    first, _ = fresh()
    first.checkpointer = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    got = [first.train_step(b)[0].item() for b in batches[:2]]
    first.step = 2
    path = first.save()
    resumed, _ = fresh()
    assert all(b.abs().max() == 0 for b in biases(resumed))
    resumed.checkpointer = first.checkpointer
    resumed.load(path)
    assert all(torch.equal(a, b) for a, b in zip(biases(resumed), biases(first)))
    got += [resumed.train_step(b)[0].item() for b in batches[2:]]
    assert got == want
    final = biases(straight)
    assert all(torch.equal(a, b) for a, b in zip(biases(resumed), final)) and all(b.abs().max() > 0 for b in final)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(router=RouterConfig(top_k=9)), "top_k=9 exceeds model.moe.num_experts=8"),
        (dict(router=RouterConfig(top_k=2, n_groups=3, topk_groups=1)), "does not split into n_groups=3"),
        (dict(capacity_factor=0.0), "capacity_factor must be positive"),
        (dict(dense_layers=[7]), "not layers of a 4-layer model"),
    ],
)
def test_bad_moe_configs(kw, message):
    with pytest.raises(ConfigError, match=message):
        MoEConfig(num_experts=8, **kw).validate_for(4)


def test_unknown_router_type():
    with pytest.raises(ConfigError, match="score: 'relu' is not one of 'softmax', 'sigmoid'"):
        ModelConfig.tiny_moe().apply_overrides(["--moe.router.score=relu"])


def test_aux_loss_attach_compiles_without_graph_breaks():
    """The layer's aux-loss path (attach + the scale read for its metrics) traces in one graph, and a
    new scale recompiles instead of reusing a stale one."""
    import torch._dynamo as dynamo

    from moetron.core.moe.aux_loss import attach_aux_loss, current_aux_loss_scale

    w = torch.ones(3, requires_grad=True)

    def f(x):
        aux = (w * x).sum() ** 2
        scale = current_aux_loss_scale()  # as the layer does: one read, trained and logged
        return attach_aux_loss(x * 2, aux, scale), aux.detach() * scale

    assert dynamo.explain(f)(torch.ones(3)).graph_break_count == 0
    compiled = torch.compile(f, backend="aot_eager")
    for scale in (1.0, 0.5):
        w.grad = None
        with aux_loss_scale(scale):
            out, logged = compiled(torch.ones(3))
        out.sum().backward()
        assert logged.item() == 9 * scale
        torch.testing.assert_close(w.grad, torch.full((3,), 6.0 * scale))


def test_weights_before_down_refuses_a_dispatcher_that_cannot_place_them():
    from moetron.core.config import ConfigError
    from moetron.core.moe.dispatcher import TokenDispatcher

    class RowsElsewhere(TokenDispatcher):  # like the expert-parallel all-to-all dispatchers
        num_local_experts = E

    layer = make_layer(weights_before_down=True)
    with pytest.raises(ConfigError, match="weights_before_down=false, or parallel.ep=1"):
        layer.set_dispatcher(RowsElsewhere())
    make_layer().set_dispatcher(RowsElsewhere())  # without the switch any dispatcher goes


def test_compiled_grouped_gemm_loops_do_not_recompile_as_groups_change():
    """grouping's per-group GEMM loops (the CPU's grouped GEMMs, the emulated recipes' included) run
    eagerly inside a compiled function: new group sizes compile nothing new, and the results are
    the loop's."""
    from torch._dynamo.utils import counters

    from moetron.core.precision.grouping import grouped_mm_2d2d, grouped_mm_2d3d

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda a, b, offs: grouped_mm_2d3d(a, b, offs) + 1, backend="aot_eager")
    wgrad = torch.compile(lambda a, b, offs: grouped_mm_2d2d(a.t(), b, offs) * 2, backend="aot_eager")
    a, b = torch.randn(40, 8), torch.randn(3, 8, 4)
    graphs = None
    for ends in ([10, 20, 40], [0, 33, 40], [5, 5, 39]):
        offs = torch.tensor(ends)
        assert torch.equal(fn(a, b, offs), grouped_mm_2d3d(a, b, offs) + 1)
        assert torch.equal(wgrad(a, a, offs), grouped_mm_2d2d(a.t(), a, offs) * 2)
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs


def test_compiled_cpu_blocks_do_not_recompile_as_routing_changes():
    """The CPU's per-expert loop (core.moe.experts.loop_grouped_mm; grouping's, above) reads the
    group sizes on the host; traced, torch.compile specialized on them and recompiled at
    every step's routing (until its cache limit: minutes a step on the CPU). They run eagerly now:
    after the first step no new graph is compiled, and the losses follow eager's (the first one
    equal; aot_eager's decompositions round a few bf16 values otherwise: 7e-5 apart by step 3)."""
    import sys

    from torch._dynamo.utils import counters

    sys.path.insert(0, "tools")
    from step_builder import RandomTokens, build_trainer

    from moetron.core.memory import MemoryConfig
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig

    losses = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        cfg = ModelConfig.preset("tiny-moe")
        cfg.apply_overrides(["n_layers=2"])  # (tiny-moe's first block is dense)
        data = RandomTokens(cfg.vocab_size, 1, 32, torch.device("cpu"))
        trainer = build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32,
                                precision=PrecisionConfig(recipe="bf16"), optimizer=OptimizerConfig())
        if compiled:
            for block in trainer.model.blocks.values():
                block.compile(backend="aot_eager")
        losses[compiled] = [trainer.train_step(data.next_batch())[0].item()]
        graphs = counters["stats"]["unique_graphs"]
        losses[compiled] += [trainer.train_step(data.next_batch())[0].item() for _ in range(2)]
        if compiled:
            assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs
    assert losses[True][0] == losses[False][0] and losses[True] == pytest.approx(losses[False], rel=1e-3)
