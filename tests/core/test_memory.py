"""Activation recompute changes nothing but memory: losses, every gradient and the MoE load
statistics are bit-identical to the run without it (tiny MoE, CPU, fp32). The oracle is the same
model without recompute; that recompute really happens is checked by counting saved activations."""

import copy

import pytest
import torch

from moetron.core.config import ConfigError
from moetron.core.memory import MemoryConfig
from moetron.core.moe.aux_loss import aux_loss_scale
from moetron.models import ModelConfig, cross_entropy_loss


def _model():
    cfg = ModelConfig.tiny_moe()
    cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.mlp_hidden, cfg.sliding_window = 64, 4, 256, 96, 8
    cfg.attention.n_heads, cfg.attention.n_kv_heads = 4, 2
    cfg.moe.num_experts, cfg.moe.expert_hidden, cfg.moe.dense_layers = 4, 32, [0]
    cfg.moe.router.z_loss_weight = 1e-3
    torch.manual_seed(0)
    return cfg.build()


def _step(model, ids, saved):
    """One forward/backward with gradient accumulation over 2 micro-batches; counts saved tensors."""
    model.train()
    losses = []
    pack = lambda t: (saved.append(t.numel()), t)[1]  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for mb in ids.chunk(2):
            with aux_loss_scale(0.5):
                loss = cross_entropy_loss(model(mb[:, :-1]), mb[:, 1:]) * 0.5
            loss.backward()
            losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    stats = {i: layer.pop_load_stats() for i, layer in model.moe_layers().items()}
    return losses, grads, stats


SETTINGS = {
    "full": dict(recompute="full"),
    "full_every_2": dict(recompute="full", recompute_every=2),
    "selective_cheap": dict(recompute="selective", recompute_modules=["norm", "swiglu", "router"]),
    "selective_all": dict(recompute="selective",
                          recompute_modules=["norm", "swiglu", "router", "attention", "mlp", "experts"]),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_recompute_is_bit_exact(name):
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    base = _model()
    other = copy.deepcopy(base)
    assert MemoryConfig(**SETTINGS[name]).apply(other) > 0
    saved_base, saved_other = [], []
    losses0, grads0, stats0 = _step(base, ids, saved_base)
    losses1, grads1, stats1 = _step(other, ids, saved_other)
    assert [l.item() for l in losses1] == [l.item() for l in losses0]
    for n, g in grads0.items():
        assert torch.equal(grads1[n], g), n
    for i, s in stats0.items():  # recorded once, not again by the replay in backward
        for k, v in s.items():
            assert torch.equal(stats1[i][k], v), (i, k)
    assert sum(saved_other) < sum(saved_base)  # it really keeps less


def test_parameter_names_unchanged():
    base = _model()
    other = copy.deepcopy(base)
    MemoryConfig(recompute="full").apply(other)
    assert [n for n, _ in other.named_parameters()] == [n for n, _ in base.named_parameters()]
    assert other.state_dict().keys() == base.state_dict().keys()


@pytest.mark.parametrize("kw,match", [
    (dict(recompute="selective", recompute_modules=["attn"]), r"\['attn'\] are not recomputable"),
    (dict(recompute="selective"), "needs memory.recompute_modules"),
    (dict(recompute="full", recompute_modules=["norm"]), "only read with memory.recompute=selective"),
    (dict(recompute="none", recompute_every=2), "only read with memory.recompute=full"),
    (dict(recompute="full", recompute_every=0), "must be >= 1"),
])
def test_bad_recompute_settings(kw, match):
    with pytest.raises(ConfigError, match=match):
        MemoryConfig(**kw).validate()


@pytest.mark.parametrize("overrides", [["recompute=full"], ["recompute=selective", "recompute_modules=[norm,swiglu,router]"]],
                         ids=["full", "selective"])
def test_recomputed_block_compiles_as_one_graph(overrides):
    """A recomputed MoE block compiles without graph breaks (fullgraph=True raises on one): the
    RoPE table cache and the MoE load statistics used to write module state inside the checkpointed
    region, which torch.compile refuses there, so compiled full recompute ran the block eagerly."""
    import torch._dynamo

    torch._dynamo.reset()
    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
    model = cfg.build(device=torch.device("cpu"))
    memory = MemoryConfig()
    memory.apply_overrides(overrides)
    memory.apply(model)
    block = model.blocks["1"]
    assert block.is_moe
    block.train()
    block.compile(backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 32, cfg.d_model, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    y.float().sum().backward()
    tokens = block.mlp.step_tokens_E.sum().item()
    assert tokens == 2 * 32 * cfg.moe.router.top_k  # statistics counted once, not replayed
    torch._dynamo.reset()


@pytest.mark.parametrize("caller", ["model", "pipeline_stages", "cold"])
def test_compiled_block_reads_prefilled_rope_tables(caller):
    """The model's forward, and each pipeline stage's, fills its blocks' RoPE caches before running
    the (compiled) blocks; a compiled, recomputed block then reads the tables instead of computing
    cos/sin in its graph, where inductor fused them into the RoPE and norm kernels per element of q
    and k. A compiled block called on its own (nothing filled) computes them itself. Outputs equal
    the eager model's."""
    import torch._dynamo

    from moetron.parallel.pipeline.stages import split_stages

    torch._dynamo.reset()
    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
    model = cfg.build(device=torch.device("cpu"))
    memory = MemoryConfig()
    memory.apply_overrides(["recompute=full"])
    memory.apply(model)
    reference = copy.deepcopy(model)
    graph_ops: list[str] = []

    def recording_backend(gm, example_inputs):
        for sub in gm.modules():  # the checkpointed region is a subgraph of its own
            if isinstance(sub, torch.fx.GraphModule):
                graph_ops.extend(str(node.target) for node in sub.graph.nodes
                                 if node.op in ("call_function", "call_method"))
        return gm.forward

    for block in model.blocks.values():
        block.compile(backend=recording_backend, fullgraph=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    if caller == "model":
        torch.testing.assert_close(model(ids), reference(ids), rtol=0, atol=0)
    elif caller == "pipeline_stages":  # one block a stage: the second stage starts from hidden states
        first, second = split_stages(model, 2)
        torch.testing.assert_close(second(first(ids)), reference(ids), rtol=0, atol=0)
    else:
        x = torch.randn(2, 32, cfg.d_model)
        torch.testing.assert_close(model.blocks["1"](x), reference.blocks["1"](x), rtol=0, atol=0)
    assert graph_ops
    computes_tables = any(op.endswith(("cos", "sin")) for op in graph_ops)
    assert computes_tables is (caller == "cold")
    torch._dynamo.reset()
