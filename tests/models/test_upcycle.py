"""Sparse upcycling: the MoE starts at the dense model (exactly, or within the documented
tolerance), the copies diverge with training, counts match the config, bad input fails at config time."""

import pytest
import torch

from moetron.core.config import ConfigError
from moetron.core.moe.config import MoEConfig
from moetron.core.weights import save_weights
from moetron.models import ModelConfig, cross_entropy_loss
from moetron.models.upcycle import UpcycleConfig, native_source, upcycle_config, upcycle_specs


def dense_cfg() -> ModelConfig:
    cfg = ModelConfig(d_model=64, n_layers=4, vocab_size=256, mlp_hidden=128, sliding_window=16)
    cfg.attention.n_heads, cfg.attention.n_kv_heads = 4, 2
    return cfg


@pytest.fixture(scope="module")
def dense():
    torch.manual_seed(0)
    cfg = dense_cfg()
    model = cfg.build().eval()
    # A dense model whose MLPs matter: larger weights than the 0.02 init make any mismatch visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.mul_(5.0)
    return cfg, model


def memory_source(model):
    sd = model.state_dict()
    return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}, lambda name: sd[name]


def upcycle(dense, **kw):
    cfg, model = dense
    up = UpcycleConfig.from_dict(kw)
    moe_cfg = upcycle_config(cfg, up)
    specs, produce = upcycle_specs(memory_source(model), cfg, moe_cfg, up, seed=1)
    moe = moe_cfg.build().eval()
    moe.load_state_dict({name: produce(name) for name in specs})
    assert set(specs) == set(moe.state_dict())
    return up, moe_cfg, moe


TOKENS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kw", [
    dict(num_experts=4, top_k=2),
    dict(num_experts=8, top_k=2, layers="every_other"),
    dict(num_experts=4, top_k=1, layers=[0, 3]),
    dict(num_experts=4, top_k=2, score="sigmoid"),
    dict(num_experts=4, top_k=2, router_init="random"),
    dict(num_experts=4, top_k=2, shared_expert=True),
    dict(num_experts=4, top_k=2, shared_expert=True, routed_fraction=0.0),
])
def test_g1_starts_exactly_at_dense(dense, kw):
    up, moe_cfg, moe = upcycle(dense, **kw)
    assert up.exact_start()[0]
    want = dense[1](TOKENS)
    with torch.no_grad():
        got = moe(TOKENS)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert moe_cfg.moe.dense_layers == [i for i in range(4) if i not in up.moe_layers(4)]
    if kw.get("layers") == "every_other":
        assert moe_cfg.moe.dense_layers == [0, 2]


@pytest.mark.parametrize("g,experts,top_k,shared", [(2, 8, 4, False), (4, 8, 4, False), (4, 16, 8, False),
                                                     (2, 8, 2, True)])
def test_granularity_within_tolerance(dense, g, experts, top_k, shared):
    """Documented: virtual_groups + top_k a multiple of g + renormalize -> scale down by g; logits
    within 1e-4 (fp32) of the dense model."""
    up, moe_cfg, moe = upcycle(dense, num_experts=experts, top_k=top_k, granularity=g, shared_expert=shared)
    assert moe_cfg.moe.expert_hidden == 128 // g
    assert up.exact_start()[0]
    with torch.no_grad():
        torch.testing.assert_close(moe(TOKENS), dense[1](TOKENS), rtol=0, atol=1e-4)


def test_expert_layout_is_paired_shards(dense):
    """Expert e = shard e % g of copy e // g: gate and up rows of the same hidden slice, down columns."""
    cfg, model = dense
    _, _, moe = upcycle(dense, num_experts=4, top_k=2, granularity=2)
    mlp, layer = model.blocks["1"].mlp, moe.blocks["1"].mlp
    F = 64
    for e in range(4):
        j = e % 2
        torch.testing.assert_close(layer.experts.w_gate_up[e, :F], mlp.gate_proj.weight[j * F:(j + 1) * F])
        torch.testing.assert_close(layer.experts.w_gate_up[e, F:], mlp.up_proj.weight[j * F:(j + 1) * F])
        torch.testing.assert_close(layer.experts.w_down[e], 2 * mlp.down_proj.weight[:, j * F:(j + 1) * F])
    w = layer.router.weight
    assert torch.equal(w[0], w[1]) and torch.equal(w[2], w[3]) and not torch.equal(w[0], w[2])


def test_inexact_settings_are_reported(dense):
    assert not UpcycleConfig(num_experts=8, top_k=2, granularity=2, router_init="random").exact_start()[0]
    assert not UpcycleConfig(num_experts=8, top_k=3, granularity=2).exact_start()[0]
    assert not UpcycleConfig(renormalize=False).exact_start()[0]
    assert not UpcycleConfig(noise_std=0.01).exact_start()[0]
    # Without renormalization the scale assumes a uniform router: close, not exact.
    up, _, moe = upcycle(dense, num_experts=4, top_k=2, renormalize=False, router_std=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(moe(TOKENS), dense[1](TOKENS), rtol=0, atol=1e-3)


def test_noise_makes_copies_differ(dense):
    _, _, moe = upcycle(dense, num_experts=4, top_k=2, noise_std=1e-3)
    w = moe.blocks["0"].mlp.experts.w_gate_up
    assert not torch.equal(w[0], w[1])
    torch.testing.assert_close(w[0], w[1], rtol=0, atol=1e-2)


def test_experts_diverge_with_training(dense):
    _, _, moe = upcycle(dense, num_experts=4, top_k=2, layers="every_other")
    for layer in moe.moe_layers().values():
        w = layer.experts.w_gate_up
        assert all(torch.equal(w[0], w[e]) for e in range(4))
    moe.train()
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = torch.randint(0, 256, (4, 33), generator=gen)
        loss = cross_entropy_loss(moe(ids[:, :-1]), ids[:, 1:])  # + the aux losses, attached to each layer
        opt.zero_grad()
        loss.backward()
        opt.step()
    for layer in moe.moe_layers().values():
        for w in (layer.experts.w_gate_up, layer.experts.w_down):
            for a in range(4):
                for b in range(a + 1, 4):
                    assert not torch.allclose(w[a], w[b], atol=1e-6), (a, b)


@pytest.mark.parametrize("kw", [dict(num_experts=8, top_k=2), dict(num_experts=16, top_k=4, granularity=4,
                                                                      shared_expert=True, layers="every_other")])
def test_counts_match_config(dense, kw):
    _, moe_cfg, moe = upcycle(dense, **kw)
    assert sum(p.numel() for p in moe.parameters()) == moe_cfg.num_params()
    assert moe_cfg.num_active_params() < moe_cfg.num_params()


@pytest.mark.parametrize("kw,match", [
    (dict(num_experts=4, top_k=5), "top_k=5 exceeds"),
    (dict(num_experts=8, top_k=2, granularity=3), "not a multiple of granularity"),
    (dict(num_experts=10, top_k=2, granularity=5), "does not divide the dense MLP hidden"),
    (dict(layers=[0, 4]), r"\[4\] are not layers"),
    (dict(layers=[1, 1]), "repeats"),
    (dict(layers="some"), "every_other"),
    (dict(routed_fraction=1.5), "routed_fraction"),
])
def test_bad_config(kw, match):
    with pytest.raises(ConfigError, match=match):
        upcycle_config(dense_cfg(), UpcycleConfig.from_dict(kw))


def test_moe_input_rejected():
    cfg = dense_cfg()
    cfg.moe = MoEConfig(num_experts=4, expert_hidden=32, dense_layers=[0])
    with pytest.raises(ConfigError, match="already an MoE"):
        upcycle_config(cfg, UpcycleConfig())


def test_streams_native_checkpoint(dense, tmp_path):
    """native_source -> upcycle_specs -> save_weights, then the MoE loads and matches the dense model."""
    from moetron.core.checkpoint import CheckpointConfig, Checkpointer

    cfg, model = dense
    src = str(tmp_path / "dense")
    specs, produce = memory_source(model)
    save_weights(src, specs, produce, {"config": {"model": cfg.to_dict()}})
    cfg2, source = native_source(src)
    assert cfg2 == cfg
    up = UpcycleConfig(num_experts=4, top_k=2, granularity=2)
    moe_cfg = upcycle_config(cfg2, up)
    calls = []
    specs, produce = upcycle_specs(source, cfg2, moe_cfg, up, seed=0)

    def counting(name):
        calls.append(name)
        return produce(name)

    out = str(tmp_path / "moe")
    save_weights(out, specs, counting, {"config": {"model": moe_cfg.to_dict()}})
    assert sorted(calls) == sorted(specs)
    moe = moe_cfg.build().eval()
    Checkpointer(CheckpointConfig()).load(out, moe, None, {}, model_only=True)
    with torch.no_grad():
        torch.testing.assert_close(moe(TOKENS), model(TOKENS), rtol=0, atol=1e-4)


def test_native_source_needs_a_model_config(dense, tmp_path):
    from moetron.core.checkpoint import CheckpointError

    _, model = dense
    src = str(tmp_path / "no_config")
    specs, produce = memory_source(model)
    save_weights(src, specs, produce, {"config": {}})
    with pytest.raises(CheckpointError, match="meta.json has no config.model"):
        native_source(src)
