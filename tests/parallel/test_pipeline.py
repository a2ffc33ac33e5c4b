"""Pipeline parallelism against the single-process run (the oracle): same losses, same parameters
after AdamW steps, MoE aux losses included; checkpoints portable between layouts; config errors.

The oracle runs the same micro-batches one after another on the whole model and adds the MoE aux
losses, computed by hand from each router's output, with the LM loss' weight (the load-balance
loss depends on the micro-batch, so the oracle splits the batch the same way, as the Trainer's
gradient accumulation does); the layers' own attached losses are switched off there (scale 0).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.distributed import run_distributed  # noqa: E402

from moetron.core.checkpoint import CheckpointConfig, Checkpointer  # noqa: E402
from moetron.core.config import ConfigError  # noqa: E402
from moetron.core.layers.attention import AttentionConfig  # noqa: E402
from moetron.core.moe.config import MoEConfig, RouterConfig  # noqa: E402
from moetron.core.moe.aux_loss import aux_loss_scale  # noqa: E402
from moetron.core.moe.layer import MoELayer, moe_layers  # noqa: E402
from moetron.core.moe.router import load_balance_loss, z_loss  # noqa: E402
from moetron.models import ModelConfig  # noqa: E402
from moetron.models.transformer import Transformer, cross_entropy_loss  # noqa: E402
from moetron.parallel.config import ParallelConfig  # noqa: E402
from moetron.parallel.mesh import ParallelMesh  # noqa: E402
from moetron.parallel.pipeline import PipelineParallel, split_stages  # noqa: E402
from moetron.parallel.registry import ParallelState  # noqa: E402

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

STEPS, BATCH, SEQ, LR = 3, 8, 16, 1e-2
RTOL, ATOL = 1e-5, 1e-6
"""fp32 on CPU: the pipeline changes only the order of a few float additions."""


def _model_cfg() -> ModelConfig:
    return ModelConfig(
        d_model=32, n_layers=4, vocab_size=64, mlp_hidden=64, sliding_window=8,
        attention=AttentionConfig(n_heads=2, n_kv_heads=1, rope_theta=10_000.0),
        moe=MoEConfig(num_experts=4, expert_hidden=32, dense_layers=[0],
                      router=RouterConfig(top_k=2, lb_loss_weight=0.01, z_loss_weight=0.001)),
    )


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(_model_cfg())


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, 64, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _reference(n_micro: int):
    """The single-process run: (model, optimizer, losses, aux totals of step 1, grad norm of step 1)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, aux0, gnorm0 = [], None, None
    routed = []  # (router output, micro-batch sequences) of every MoE layer's forward
    for layer in model.moe_layers().values():
        layer.router.register_forward_hook(lambda mod, args, out: routed.append(out))
    rcfg = _model_cfg().moe.router
    for step, batch in enumerate(_batches()):
        loss_sum, aux_sum = 0.0, {}
        for mb in batch.chunk(n_micro):
            routed.clear()
            with aux_loss_scale(0.0):  # the oracle adds the aux losses itself
                loss = cross_entropy_loss(model(mb[:, :-1]), mb[:, 1:]) / n_micro
            total = loss
            for r in routed:
                counts_E = torch.bincount(r.topk_ids_TK.reshape(-1), minlength=r.probs_TE.shape[1])
                aux = {"lb_loss": rcfg.lb_loss_weight * load_balance_loss(r.probs_TE, r.topk_ids_TK, counts_E,
                                                                          "micro_batch", mb.shape[0]),
                       "z_loss": rcfg.z_loss_weight * z_loss(r.logits_TE)}
                for name, value in aux.items():
                    total = total + value / n_micro
                    aux_sum[name] = aux_sum.get(name, 0.0) + value.item() / n_micro
            total.backward()
            loss_sum += loss.item()
        if step == 0:
            aux0 = aux_sum
            gnorm0 = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_sum)
    return model, opt, losses, aux0, gnorm0


def _apply(cfg: ParallelConfig, world_size: int, model: torch.nn.Module) -> ParallelState:
    mesh = ParallelMesh.build(cfg, world_size, "cpu")
    state = ParallelState([model], mesh, mesh.cfg, _model_cfg(), device=torch.device("cpu"),
                          loss_fn=cross_entropy_loss)
    strategy = PipelineParallel()
    assert strategy.enabled(state)
    strategy.validate(state)
    strategy.apply(state)
    return state


def _logged_aux(state: ParallelState) -> dict[str, float]:
    """The aux losses the trainer logs for the step just run: every layer's, on every stage."""
    stats = [layer.pop_load_stats() for layer in moe_layers(state.model_parts).values()]
    names = sorted({k for s in stats for k in ("lb_loss", "z_loss") if k in s})
    vec = torch.stack([sum(s[k] for s in stats) for k in names])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(vec)  # pp ranks hold different layers
    return dict(zip(names, vec.tolist()))


def _train(state: ParallelState):
    params = [p for part in state.model_parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    losses, aux0, gnorm0 = [], None, None
    from moetron.core.grad import clip_grad_norm_

    for step, batch in enumerate(_batches()):
        loss = state.step_fn(batch)
        if step == 0:
            aux0 = _logged_aux(state)
            gnorm0 = clip_grad_norm_(params, 1e9, state.grad_norm_groups).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return opt, losses, aux0, gnorm0


def _assert_matches(parts, ref_model, what: str, rtol: float = RTOL, atol: float = ATOL) -> int:
    ref = dict(ref_model.named_parameters())
    n = 0
    for part in parts:
        for name, p in part.named_parameters():
            torch.testing.assert_close(p.detach(), ref[name].detach(), rtol=rtol, atol=atol,
                                       msg=lambda m, name=name: f"{what}: {name}: {m}")
            n += 1
    return n


def _eval_losses(state: ParallelState, ref_model) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pipeline's forward-only loss of the first batch, the plain model's), in eval mode."""
    for part in state.model_parts:
        part.eval()
    ref_model.eval()
    with torch.no_grad():
        batch = _batches()[0]
        return state.eval_fn(batch), cross_entropy_loss(ref_model(batch[:, :-1]), batch[:, 1:])


def _check_pp2(rank: int, world_size: int, schedule: str, stages_per_rank: int, n_micro: int, tmp: str | None):
    cfg = ParallelConfig(pp=2, dp_shard=1, pp_schedule=schedule, pp_stages_per_rank=stages_per_rank,
                         pp_microbatches=n_micro)
    state = _apply(cfg, world_size, _model())
    info = state.pipeline
    assert info.stage_ids == [rank + 2 * v for v in range(stages_per_rank)]
    opt, losses, aux0, gnorm0 = _train(state)
    ref_model, ref_opt, ref_losses, ref_aux0, ref_gnorm0 = _reference(n_micro)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    assert set(aux0) == {"lb_loss", "z_loss"}
    torch.testing.assert_close(torch.tensor([aux0[k] for k in sorted(aux0)]),
                               torch.tensor([ref_aux0[k] for k in sorted(aux0)]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(gnorm0), torch.tensor(ref_gnorm0), rtol=RTOL, atol=0)
    mine = _assert_matches(state.model_parts, ref_model, f"rank {rank} after {STEPS} steps")
    counts = [None] * world_size
    torch.distributed.all_gather_object(counts, mine)
    assert sum(counts) == len(list(ref_model.parameters()))  # every parameter lives on exactly one rank

    # eval: forward-only loss through the pipeline equals the plain model's.
    loss, ref = _eval_losses(state, ref_model)
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)

    if tmp is None:
        return
    ckpt = Checkpointer(CheckpointConfig(dir=os.path.join(tmp, "pp2")))
    ckpt.save(STEPS, state.model_parts if len(state.model_parts) > 1 else state.model_parts[0], opt, {}, {})
    # A single-process checkpoint (saved by the parent) loads into freshly split stages.
    fresh = _apply(cfg, world_size, _model(seed=99))
    fresh_params = [p for part in fresh.model_parts for p in part.parameters()]
    fresh_opt = torch.optim.AdamW(fresh_params, lr=LR)
    parts = fresh.model_parts if len(fresh.model_parts) > 1 else fresh.model_parts[0]
    Checkpointer(CheckpointConfig()).load(os.path.join(tmp, "single", f"step_{STEPS:08d}"), parts, fresh_opt, {})
    _assert_matches(fresh.model_parts, ref_model, f"rank {rank} loaded from the single-process checkpoint")
    ref_params = dict(ref_model.named_parameters())
    for part in fresh.model_parts:
        for name, p in part.named_parameters():
            torch.testing.assert_close(fresh_opt.state[p]["exp_avg"], ref_opt.state[ref_params[name]]["exp_avg"])


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp2_matches_single_process(schedule, tmp_path):
    tmp = None
    if schedule == "1f1b":  # also the checkpoint round trip, both ways
        ref_model, ref_opt, *_ = _reference(4)
        tmp = str(tmp_path)
        Checkpointer(CheckpointConfig(dir=os.path.join(tmp, "single"))).save(STEPS, ref_model, ref_opt, {}, {})
    run_distributed(_check_pp2, 2, schedule, 1, 4, tmp)
    if tmp is not None:
        model = _model(seed=7)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        Checkpointer(CheckpointConfig()).load(os.path.join(tmp, "pp2", f"step_{STEPS:08d}"), model, opt, {})
        _assert_matches([model], ref_model, "pp=2 checkpoint loaded in one process")
        ref_params = dict(ref_model.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(opt.state[p]["exp_avg"], ref_opt.state[ref_params[name]]["exp_avg"])


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_pp2_interleaved_matches_single_process(schedule, tmp_path):
    # 4 layers -> 4 stages of one block; rank 0 runs stages 0 and 2, rank 1 stages 1 and 3; the
    # list-of-parts checkpoint path is exercised too.
    ref_model, ref_opt, *_ = _reference(4)
    Checkpointer(CheckpointConfig(dir=os.path.join(tmp_path, "single"))).save(STEPS, ref_model, ref_opt, {}, {})
    run_distributed(_check_pp2, 2, schedule, 2, 4, str(tmp_path))
    model = _model(seed=7)
    Checkpointer(CheckpointConfig()).load(os.path.join(tmp_path, "pp2", f"step_{STEPS:08d}"), model, None, {})
    _assert_matches([model], ref_model, "interleaved pp=2 checkpoint loaded in one process")


@pytest.mark.parametrize("schedule,stages_per_rank", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_one_process_pipeline_matches_plain_run(schedule, stages_per_rank):
    cfg = ParallelConfig(pp=1, dp_shard=1, strategies=["pipeline"], pp_schedule=schedule,
                         pp_stages_per_rank=stages_per_rank, pp_microbatches=4)
    state = _apply(cfg, 1, _model())
    assert len(state.model_parts) == stages_per_rank
    _, losses, aux0, gnorm0 = _train(state)
    ref_model, _, ref_losses, ref_aux0, ref_gnorm0 = _reference(4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    assert aux0 == pytest.approx(ref_aux0, rel=RTOL)
    assert gnorm0 == pytest.approx(ref_gnorm0, rel=RTOL)
    _assert_matches(state.model_parts, ref_model, "one-process pipeline")
    # The trainer logs MoE layers' aux losses from their stats: every layer reports both.
    layers = [m for part in state.model_parts for m in part.modules() if isinstance(m, MoELayer)]
    assert layers and all({"lb_loss", "z_loss"} <= set(m.pop_load_stats()) for m in layers)


def test_split_stages_keeps_names_and_balances():
    model = _model()
    names = {n for n, _ in model.named_parameters()}
    stages = split_stages(model, 3)
    assert [list(s.blocks.keys()) for s in stages] == [["0", "1"], ["2"], ["3"]]
    assert stages[0].embed is model.embed and stages[0].norm is None and stages[0].lm_head is None
    assert stages[-1].embed is None and stages[-1].lm_head is model.lm_head
    split = [n for s in stages for n, _ in s.named_parameters()]
    assert len(split) == len(names) and set(split) == names
    assert "blocks.3.attention.q_proj.weight" in {n for n, _ in stages[2].named_parameters()}
    # Chaining the stages is the model.
    x = torch.randint(0, 64, (2, SEQ))
    h = x
    for s in stages:
        h = s.eval()(h)
    torch.testing.assert_close(h, model.eval()(x))


def test_config_errors():
    cfg = ParallelConfig(pp=8, dp_shard=1).resolve(8)
    state = ParallelState([_model()], ParallelMesh(cfg, None), cfg, _model_cfg(), loss_fn=cross_entropy_loss)
    with pytest.raises(ConfigError, match=r"parallel.pp=8 x stages_per_rank=1 = 8 stages but the model has 4 layers"):
        PipelineParallel().validate(state)
    cfg = ParallelConfig(pp=2, dp_shard=1, pp_microbatches=1).resolve(2)
    state = ParallelState([_model()], ParallelMesh(cfg, None), cfg, _model_cfg(), loss_fn=cross_entropy_loss)
    with pytest.raises(ConfigError, match=r"pp_microbatches >= the number of stages \(2\)"):
        PipelineParallel().validate(state)
    state.cfg = ParallelConfig(pp=2, dp_shard=1, pp_microbatches=4).resolve(2)
    state.local_batch_size = 6
    with pytest.raises(ConfigError, match=r"batch of 6 sequences.*pp_microbatches=4"):
        PipelineParallel().validate(state)
    with pytest.raises(ConfigError, match=r"at most 4 stages"):
        split_stages(_model(), 5)
    # The step function checks the batch it gets.
    cfg = ParallelConfig(pp=1, dp_shard=1, strategies=["pipeline"], pp_microbatches=4)
    state = _apply(cfg, 1, _model())
    with pytest.raises(ConfigError, match=r"batch of 6 sequences does not split into parallel.pp_microbatches=4"):
        state.step_fn(torch.zeros(6, SEQ + 1, dtype=torch.long))


def _pp_load_stats(rank, world, out, data_dir):
    os.environ["MOETRON_DATA_DIR"] = data_dir
    import pretrain

    from tests.parallel.test_equivalence import TINY

    cfg, _ = pretrain.parse_args(["--preset", "tiny-moe", *TINY, f"--trainer.run_dir={out}",
                                  "--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.pp_microbatches=4"])
    trainer, _ = pretrain.build(cfg, torch.device("cpu"), world)
    trainer.train_step(trainer.data.next_batch())
    trainer.step = 1
    record = trainer._pop_moe_metrics(1)
    if rank == 0:
        torch.save({"layers": sorted(trainer.load_log.records[-1]["layers"].tolist()), "record": record},
                   os.path.join(out, "stats.pt"))


def test_load_stats_cover_every_stage(tmp_path):
    """Rank 0 holds stage 0 only, yet its load log lists the MoE layers of both stages."""
    run_distributed(_pp_load_stats, 2, str(tmp_path), str(tmp_path / "data"), timeout_s=300)
    got = torch.load(tmp_path / "stats.pt")
    assert got["layers"] == [1, 2, 3]  # tiny MoE: layer 0 dense, layers 1-3 MoE over two stages
    assert got["record"]["moe_max_violation"] >= 0


def test_balanced_split_minimizes_the_largest_stage():
    import itertools
    import random

    from moetron.parallel.pipeline import balanced_split

    assert balanced_split([1.0] * 4, 3) == [2, 1, 1]  # equal costs: earlier stages take the remainder
    assert balanced_split([1.0] * 8, 2, last_extra=1.5) == [5, 3]  # the LM head weighs 1.5 blocks
    assert balanced_split([1.0] * 8, 4, last_extra=1.5) == [3, 2, 2, 1]
    rng = random.Random(0)
    for _ in range(200):  # against every cut of up to 9 blocks
        n, s = rng.randint(1, 9), rng.randint(1, 4)
        if s > n:
            continue
        costs, extra = [rng.uniform(0.1, 3) for _ in range(n)], rng.uniform(0, 4)
        counts = balanced_split(costs, s, extra)
        assert len(counts) == s and sum(counts) == n and min(counts) >= 1

        def worst(cuts):
            bounds = [0, *cuts, n]
            return max(sum(costs[a:b]) + (extra if b == n else 0) for a, b in zip(bounds, bounds[1:]))

        brute = min(worst(c) for c in itertools.combinations(range(1, n), s - 1))
        got = worst(list(itertools.accumulate(counts))[:-1])
        assert got == pytest.approx(brute, rel=1e-12)


def test_flops_split_weighs_the_head():
    cfg = ParallelConfig(pp=2, dp_shard=1)
    assert cfg.pp_split == "layers"
    mcfg = _model_cfg()
    costs = [mcfg.block_flops_per_token(i, SEQ) for i in range(mcfg.n_layers)]
    # Independently for the dense layer 0: 6 x its built parameters + 12 x width x context.
    model = _model()
    width = mcfg.attention.n_heads * mcfg.attention.head_width(mcfg.d_model)
    built = sum(p.numel() for p in model.blocks["0"].parameters())
    assert costs[0] == 6.0 * built + 12.0 * width * min(SEQ, mcfg.window_of(0) or SEQ)
    # The blocks, the LM head and the final norm add up to the model's own FLOPs per token.
    head = 6.0 * mcfg.d_model * mcfg.vocab_size
    assert sum(costs) + head + 6.0 * mcfg.d_model == pytest.approx(mcfg.flops_per_token(SEQ), rel=1e-12)
    assert costs[0] != costs[1]  # layer 0 is dense, layer 1 MoE: the costs tell them apart
    stages = split_stages(_model(), 2, costs, head_cost=head)
    counts = [len(s.blocks) for s in stages]
    assert sum(counts) == mcfg.n_layers
    loads = [sum(costs[:counts[0]]), sum(costs[counts[0]:]) + head]
    for other in range(1, mcfg.n_layers):  # no other cut has a lighter heaviest stage
        assert max(loads) <= max(sum(costs[:other]), sum(costs[other:]) + head) * (1 + 1e-12)


def test_pretrain_checks_the_rank_batch_against_micro_batches_at_build(tmp_path, monkeypatch):
    """pretrain hands the strategies the per-rank batch (ParallelState.local_batch_size), so a batch
    that does not split into pp_microbatches fails before any step runs, naming both numbers."""
    import pretrain
    from tests.parallel.test_equivalence import TINY

    monkeypatch.setenv("MOETRON_DATA_DIR", str(tmp_path / "data"))
    cfg, _ = pretrain.parse_args(["--preset", "tiny-moe", *TINY, "--trainer.run_dir=", "--parallel.strategies=[pipeline]",
                                  "--parallel.pp_microbatches=3"])
    with pytest.raises(ConfigError, match=r"batch of 8 sequences.*pp_microbatches=3"):
        pretrain.build(cfg, torch.device("cpu"), 1)
