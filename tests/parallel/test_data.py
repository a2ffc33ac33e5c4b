"""Data + expert parallelism on a model that is not moetron's Transformer: the strategies find its
MoE layers through the one registry (core.moe.moe_layers), whatever its blocks call them.

Oracle: the same model in one process on the whole batch (float64, gloo on the CPU). Under dp_shard=2
x ep=2 every gradient, dense and expert, must be the mean over the two ranks' tokens: expert
gradients sum the tokens the all-to-all brings in, and the expert strategy's 1/ep scale with
FSDP2's average makes them the mean. A model whose MLP is not named ``mlp`` used to miss that scale
(the data strategy looked for ``block.mlp``) and got expert gradients twice too large.
"""

import copy
from types import SimpleNamespace

import torch
from torch import nn

from moetron.core.moe import MoEConfig, MoELayer, RouterConfig, moe_layers
from moetron.core.layers import RMSNorm
from moetron.models import cross_entropy_loss
from moetron.parallel import ParallelConfig, ParallelMesh, ParallelState, apply_strategies
from tests.distributed import run_distributed

D, V, E = 16, 32, 4


class FeedForwardBlock(nn.Module):
    def __init__(self, index: int, cfg: MoEConfig):
        super().__init__()
        self.pre = RMSNorm(D, 1e-6)
        self.feed_forward = MoELayer(D, cfg, layer_index=index)  # not "mlp"

    def forward(self, h):
        return h + self.feed_forward(self.pre(h))


class OtherDecoder(nn.Module):
    """A ParallelModel (moetron.parallel.model) built without moetron.models."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleDict({str(i): FeedForwardBlock(i, cfg) for i in range(2)})
        self.norm = RMSNorm(D, 1e-6)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks.values():
            h = block(h)
        return self.lm_head(self.norm(h))

    def moe_layers(self):
        return moe_layers(self)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check(rank, world_size, dispatch):
    torch.set_default_dtype(torch.float64)
    cfg = MoEConfig(num_experts=E, expert_hidden=8, router=RouterConfig(top_k=2, lb_loss_weight=0.0))
    torch.manual_seed(0)
    model = OtherDecoder(cfg)
    for layer in model.moe_layers().values():
        layer.init_weights(0.3)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, V, (2 * world_size, 9), generator=torch.Generator().manual_seed(1))

    pcfg = ParallelConfig(dp_shard=2, ep=2, ep_dispatch=dispatch)
    mesh = ParallelMesh.build(pcfg, world_size, "cpu")
    state = apply_strategies(ParallelState([model], mesh, mesh.cfg, SimpleNamespace(moe=cfg)))
    assert state.applied == ["expert", "data"]
    mine = ids[2 * rank:2 * rank + 2]
    cross_entropy_loss(model(mine[:, :-1]), mine[:, 1:]).backward()
    cross_entropy_loss(ref(ids[:, :-1]), ids[:, 1:]).backward()

    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(_full(grads[name].grad), p.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert any("feed_forward.experts" in n for n in grads)


def test_expert_gradients_on_a_model_without_an_mlp_attribute():
    run_distributed(_check, 2, "all_gather")


def test_expert_gradients_on_a_model_without_an_mlp_attribute_synced():
    run_distributed(_check, 2, "synced")


def _grad_sync(rank, world_size, data_dir):
    """trainer.grad_sync=step: no reduce-scatter before the last micro-batch, the same gradients."""
    import os

    import pretrain
    from tests.parallel.test_equivalence import TINY

    os.environ["MOETRON_DATA_DIR"] = data_dir

    def build(mode, **kw):
        cfg, _ = pretrain.parse_args(["--preset", "tiny-moe", *TINY, "--trainer.run_dir=", "--parallel.dp_shard=2",
                                      "--trainer.micro_batch_size=2", f"--trainer.grad_sync={mode}"])
        return pretrain.build(cfg, torch.device("cpu"), world_size, **kw)

    # A backward with sync off leaves the gradient unsharded inside FSDP2: no .grad on any shard.
    trainer, state = build("step")
    batch = trainer.data.next_batch()[:2]
    state.grad_sync(False)
    with state.precision.autocast():
        cross_entropy_loss(trainer.model(batch[:, :-1]), batch[:, 1:]).backward()
    assert all(p.grad is None for p in trainer.params)

    grads = {}
    for mode in ("micro_batch", "step"):
        seen = []
        trainer, state = build(mode, pre_step_hook=lambda parts: seen.append(
            {n: _full(p.grad).clone() for part in parts for n, p in part.named_parameters()}))
        calls = []
        trainer.grad_sync = lambda enabled, sync=state.grad_sync: (calls.append(enabled), sync(enabled))
        trainer.train_step(trainer.data.next_batch())
        assert calls == ([False, True] if mode == "step" else [])  # 4 sequences per rank, 2 micro-batches
        grads[mode] = seen[0]
    assert grads["step"].keys() == grads["micro_batch"].keys()
    for name, g in grads["micro_batch"].items():
        torch.testing.assert_close(grads["step"][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_grad_sync_once_per_step_matches_every_micro_batch(tmp_path):
    run_distributed(_grad_sync, 2, str(tmp_path / "data"))
