"""precision.dense_weight_copies: the dense linears compute on the optimizer's bf16 weight copies;
precision.head_weight_copy: the fused LM loss computes on the optimizer's bf16 copy of the head weight;
precision.embedding_weight_copy: the token embedding gathers from the optimizer's bf16 copy of its weight.

Oracle: the same run without the switch (autocast casting the fp32 master weights), which with one
micro-batch per step must give the same losses and weights bit for bit: autocast rounds each weight
to bf16 for the GEMM and its bf16 gradient to fp32 for the optimizer, which is exactly what the
copies and their bf16 gradients hold. Also where the gradients go, resume, and the refusals.
"""

from __future__ import annotations

import pytest
import torch

from moetron.core.config import ConfigError
from moetron.core.layers.embedding import Embedding
from moetron.core.layers.linear import Linear
from moetron.core.layers.loss import LMHead
from moetron.models import ModelConfig
from tests.core.test_bf16_grouped import assert_resume_rewrites_copies
from tests.core.test_precision_emulated import cuda_losses_on_one_batch


def _trainer(dense: bool, micro_batch=None, compile=False, optimizer=None, head: bool = False,
             head_grads: bool = False, embedding: bool = False):
    """A tiny MoE (a dense first layer, attention, a shared expert, the fused loss) on the CPU in
    bf16; ``optimizer`` (an OptimizerConfig) defaults to PrecisionAwareAdamW's foreach path (it writes
    compute copies) for both modes."""
    from step_builder import RandomTokens, build_trainer  # tools/ (tests/conftest.py puts it on the path)

    from moetron.core.memory import MemoryConfig
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
    data = RandomTokens(cfg.vocab_size, 2, 32, torch.device("cpu"))
    trainer = build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32, micro_batch=micro_batch,
                            compile=compile, precision=PrecisionConfig(recipe="bf16", dense_weight_copies=dense,
                                                             head_weight_copy=head, head_grads_bf16=head_grads,
                                                             embedding_weight_copy=embedding),
                            optimizer=optimizer or OptimizerConfig(state_dtype="bf16", impl="torch"))
    return trainer, data


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["unclipped", "clipped"])
def test_dense_copies_train_as_the_fp32_masters_bit_for_bit(clip):
    """Three steps with and without the copies: the same losses and the same weights, bit for bit,
    unclipped; clipped (0.05, below the tiny model's gradient norm: every step scales), the norm of bf16
    gradients is reduced in another order, so the updates agree to a few ulps from the second step on."""
    runs = {}
    for dense in (False, True):
        trainer, data = _trainer(dense)
        trainer.cfg.grad_clip = clip
        history = [tuple(t.item() for t in trainer.train_step(data.next_batch())) for _ in range(3)]
        runs[dense] = history, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    (h32, p32), (h16, p16) = runs[False], runs[True]
    assert h32[2][0] != h32[0][0] and p32.keys() == p16.keys()
    if clip == 0.0:
        assert [h[0] for h in h16] == [h[0] for h in h32]
        assert all(torch.equal(p16[k], p32[k]) for k in p32)
        for (_, n32), (_, n16) in zip(h32, h16):
            assert n16 == pytest.approx(n32, rel=1e-6)
    else:
        assert all(h[1] > clip for h in h32)
        assert [h[0] for h in h16] == pytest.approx([h[0] for h in h32], rel=1e-4)
        assert max(float((p16[k] - p32[k]).abs().max()) for k in p32) <= 1e-3


def test_dense_copies_compiled_equal_the_fp32_masters_bit_for_bit():
    """The same under torch.compile (inductor on the CPU): the copies are graph inputs, and two steps
    on one batch give the losses of the run without them, bit for bit."""
    runs = {}
    for dense in (False, True):
        trainer, data = _trainer(dense, compile=True)
        batch = data.next_batch()
        runs[dense] = [trainer.train_step(batch)[0].item() for _ in range(2)]
    assert runs[True] == runs[False] and runs[False][1] < runs[False][0]
    with trainer.precision.autocast():  # the compiled graph differentiates the copies, not the masters
        trainer.model(batch[:, :-1], batch[:, 1:]).backward()
    linears = [m for m in trainer.model.modules() if isinstance(m, Linear) and not isinstance(m, LMHead)]
    assert linears and all(m.weight.grad is None and m.weight_copy.grad is not None for m in linears)


def test_dense_copies_hold_the_gradients_and_the_optimizer_rewrites_them():
    """Where things live: every Linear but the LM head computes on a bf16 leaf that receives its
    gradient (its fp32 weight gets none); the head keeps its fp32 weight and gradient; after a step
    each copy is the bf16 rounding of its updated weight."""
    trainer, data = _trainer(True)
    model = trainer.model
    linears = [m for m in model.modules() if isinstance(m, Linear) and not isinstance(m, LMHead)]
    (head,) = [m for m in model.modules() if isinstance(m, LMHead)]
    assert len(linears) >= 2 * 4 + 3 + 3  # 2 layers' q/k/v/o, the dense SwiGLU, the shared expert
    assert all(m.weight_copy.dtype == torch.bfloat16 and m.weight_copy.requires_grad for m in linears)
    assert head.weight_copy is None
    holders = trainer.optimizer.gradient_holders()
    assert {id(h) for h in holders} >= {id(m.weight_copy) for m in linears}
    batch = data.next_batch()
    with trainer.precision.autocast():
        model(batch[:, :-1], batch[:, 1:]).backward()
    assert all(m.weight.grad is None and m.weight_copy.grad.dtype == torch.bfloat16 for m in linears)
    assert head.weight.grad is not None and head.weight.grad.dtype == torch.float32
    trainer.optimizer.zero_grad()
    assert all(m.weight_copy.grad is None for m in linears)
    before = [m.weight.detach().clone() for m in linears]
    trainer.train_step(data.next_batch())
    assert all(not torch.equal(m.weight, b) for m, b in zip(linears, before))  # they trained
    assert all(torch.equal(m.weight_copy, m.weight.detach().to(torch.bfloat16)) for m in linears)


def test_resume_rewrites_the_dense_copies(tmp_path):
    """After Trainer.load the copies hold the loaded weights: the resumed trainer's next step equals
    the uninterrupted one's."""
    assert_resume_rewrites_copies(lambda: _trainer(True), tmp_path)


def test_dense_copies_refuse_what_they_cannot_serve():
    from moetron.core.precision import PrecisionConfig

    with pytest.raises(ConfigError, match="bf16-recipe option"):
        PrecisionConfig(recipe="mxfp8", dense_weight_copies=True).validate()
    with pytest.raises(ConfigError, match="precision.recipe=fp32"):
        PrecisionConfig(dense_weight_copies=True).build("cpu")  # auto on the CPU: fp32
    from moetron.core.optim import OptimizerConfig

    with pytest.raises(ConfigError, match="needs an optimizer that writes bf16 copies"):
        _trainer(True, optimizer=OptimizerConfig())  # the default on the CPU: torch's AdamW, no copies
    trainer, data = _trainer(True, micro_batch=1)
    with pytest.raises(ConfigError, match="accumulates 2 micro-batches"):
        trainer.train_step(data.next_batch())


def test_dense_copies_refuse_weights_that_are_not_unsharded_fp32_parameters():
    """A bf16 weight (what FSDP2's or a cast model's linears would hand over) gets the layout error,
    before anything is attached."""
    from moetron.core.adamw import PrecisionAwareAdamW
    from moetron.core.precision.gemm import attach_dense_copies

    model = torch.nn.Sequential(Linear(8, 8), Linear(8, 8))
    optimizer = PrecisionAwareAdamW(model.parameters(), kernel="foreach", state_dtype=torch.bfloat16)
    model[1].weight.data = model[1].weight.data.bfloat16()
    with pytest.raises(ConfigError, match="unsharded fp32 weights"):
        attach_dense_copies(optimizer, [model])
    assert model[0].weight_copy is None and not optimizer.compute_copies
    model[1].weight.data = model[1].weight.data.float()
    copies = attach_dense_copies(optimizer, [model])
    assert len(copies) == 2 and all(m.weight_copy is copies[m.weight] for m in model)


# ---- precision.head_weight_copy ----------------------------------------------------------------

@pytest.mark.parametrize("dense,micro_batch", [(False, None), (True, None), (False, 1)],
                         ids=["head", "head+dense", "head, 2 micro-batches"])
def test_head_copy_trains_as_the_fp32_master_bit_for_bit(dense, micro_batch):
    """Three steps with the head's copy (alone, with the dense copies, and over two micro-batches,
    which the head's copy allows: its gradient stays fp32 on the master) against the same run
    without it: the same losses and weights, bit for bit (the copy is the cast's rounding)."""
    runs = {}
    for head in (False, True):
        trainer, data = _trainer(dense, micro_batch=micro_batch, head=head)
        losses = [trainer.train_step(data.next_batch())[0].item() for _ in range(3)]
        runs[head] = losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    assert runs[True][0] == runs[False][0] and runs[False][0][2] != runs[False][0][0]
    assert all(torch.equal(runs[True][1][k], v) for k, v in runs[False][1].items())


def test_head_copy_is_what_the_loss_computes_on_and_the_optimizer_rewrites(monkeypatch):
    """The fused loss takes the copy instead of casting (the tensor handed to its chunks is the copy
    itself); the copy takes no gradient, the fp32 weight does; after a step the copy is the bf16
    rounding of the updated weight; an optimizer without copies is refused by name."""
    from moetron.core.layers import loss as L

    trainer, data = _trainer(False, head=True)
    (head,) = [m for m in trainer.model.modules() if isinstance(m, LMHead)]
    assert head.weight_bf16.dtype == torch.bfloat16 and not head.weight_bf16.requires_grad
    assert head.weight_copy is None  # compute_weight (the logits path) stays the fp32 master
    handed = []
    chunked = L._chunked

    def spy(h, w, labels, ignore, z, chunk, dtype, w_cast, **kw):
        handed.append(w_cast)
        return chunked(h, w, labels, ignore, z, chunk, dtype, w_cast, **kw)

    monkeypatch.setattr(L, "_chunked", spy)
    batch = data.next_batch()
    with trainer.precision.autocast():
        trainer.model(batch[:, :-1], batch[:, 1:]).backward()
    assert handed and handed[0] is head.weight_bf16
    assert head.weight.grad.dtype == torch.float32 and head.weight_bf16.grad is None
    trainer.optimizer.zero_grad()
    before = head.weight.detach().clone()
    trainer.train_step(data.next_batch())
    assert not torch.equal(head.weight, before)
    assert torch.equal(head.weight_bf16, head.weight.detach().to(torch.bfloat16))
    from moetron.core.optim import OptimizerConfig

    with pytest.raises(ConfigError, match="head_weight_copy=true needs an optimizer"):
        _trainer(False, head=True, optimizer=OptimizerConfig())
    from moetron.core.adamw import PrecisionAwareAdamW
    from moetron.core.precision.gemm import attach_head_copy

    plain = LMHead(8, 16, fused=False)
    with pytest.raises(ConfigError, match="model.fused_loss=false"):
        attach_head_copy(PrecisionAwareAdamW(plain.parameters(), kernel="foreach", state_dtype=torch.bfloat16), [plain])


def test_resume_rewrites_the_head_copy(tmp_path):
    assert_resume_rewrites_copies(lambda: _trainer(False, head=True), tmp_path)


def test_head_copy_refuses_other_recipes_and_sharded_layouts():
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.parallel.config import ParallelConfig
    from moetron.run.planner.hardware import GPUS
    from moetron.run.planner.switches import switches

    with pytest.raises(ConfigError, match="head_weight_copy=true has the LM head compute"):
        PrecisionConfig(recipe="fp8_rowwise", head_weight_copy=True).validate()
    with pytest.raises(ConfigError, match="precision.recipe=fp32"):
        PrecisionConfig(head_weight_copy=True).build("cpu")
    precision = PrecisionConfig(recipe="bf16", head_weight_copy=True)
    args = (OptimizerConfig(), GPUS["h100"], True)
    assert switches(ModelConfig.tiny_moe(), ParallelConfig(), precision, *args).head_weight_copy
    with pytest.raises(ConfigError, match="head_weight_copy=true is for one unsharded GPU"):
        switches(ModelConfig.tiny_moe(), ParallelConfig(dp_shard=2), precision, *args)


@pytest.mark.gpu
def test_dense_copies_train_as_the_fp32_masters_on_gpu():
    """On CUDA (the optimizer's Triton kernel writing the copies, compiled blocks): three steps on one
    batch with and without the copies (the dense ones and the head's), unclipped. The same values by construction;
    compared to 1e-5 because a CUDA step is not bit-reproducible run to run; the loss must fall. Clipped (the
    trainer's default 1.0 scales every step of this model), the norm summed over bf16 gradients in another order
    moves step 3's loss by 3.3e-5 (relative) on the H100 (session 50: docs/bench/session50/copies_clip_probe.py;
    unclipped the losses were equal to the last digit), as the CPU's clipped test allows (1e-4)."""
    from moetron.core.precision import PrecisionConfig

    copied = {}

    def record(trainer):
        copied[len(copied)] = any(getattr(m, "weight_copy", None) is not None for m in trainer.model.modules())

    runs = {dense: cuda_losses_on_one_batch(PrecisionConfig(
        recipe="bf16", expert_weight_copies="optimizer", expert_grads_bf16=True, dense_weight_copies=dense,
        head_weight_copy=dense), check=record, grad_clip=0.0) for dense in (False, True)}
    assert copied == {0: False, 1: True}
    assert runs[True] == pytest.approx(runs[False], rel=1e-5) and runs[False][2] < runs[False][0]


@pytest.mark.gpu
def test_auto_copies_are_on_by_default_on_gpu():
    """On CUDA the default precision (recipe auto, the copy switches auto) on one GPU with one micro-batch
    builds the optimizer's copies (the experts', the dense linears', the head's) and trains as all four off,
    unclipped, to 1e-5 (a CUDA step is not bit-reproducible run to run; clipped, see the test above); the loss
    must fall."""
    from moetron.core.precision import PrecisionConfig

    held = {}

    def record(trainer):
        held[len(held)] = len(trainer.optimizer.compute_copies), len(trainer.optimizer.split_parameters())

    runs = {on: cuda_losses_on_one_batch(PrecisionConfig() if on else PrecisionConfig().with_auto_copies(False),
                                         check=record, grad_clip=0.0) for on in (False, True)}
    # optimizer.split_master's auto holds the copied weights' masters split where the copies are on
    assert held[0] == (0, 0) and held[1][0] > 0 and held[1][1] == held[1][0]
    assert runs[True] == pytest.approx(runs[False], rel=1e-5) and runs[False][2] < runs[False][0]


@pytest.mark.parametrize("chunk", [64, 24], ids=["one_chunk", "chunks"])
def test_fused_loss_gives_a_bf16_weight_its_rounded_gradient(chunk):
    """precision.head_grads_bf16's loss: a bf16 weight leaf gets the gradient the fp32 weight of the same
    values gets, rounded to bf16 (in one chunk the GEMM writes it; over chunks the fp32 sum rounded once;
    on the CPU, whose GEMMs have no wider output, both are the bf16 product), and the same loss and grad_h."""
    from moetron.core.layers.loss import linear_cross_entropy

    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 32, 16, generator=g).to(torch.bfloat16)
    w32 = torch.randn(50, 16, generator=g).to(torch.bfloat16).float()
    labels = torch.randint(0, 50, (2, 32), generator=g)
    out = {}
    for name, w in (("fp32", w32.clone()), ("bf16", w32.to(torch.bfloat16))):
        w.requires_grad_(True)
        hh = h.clone().requires_grad_(True)
        loss = linear_cross_entropy(hh, w, labels, chunk_tokens=chunk)
        loss.backward()
        out[name] = (loss.detach(), hh.grad, w.grad)
    assert out["bf16"][2].dtype == torch.bfloat16 and out["fp32"][2].dtype == torch.float32
    assert torch.equal(out["bf16"][2], out["fp32"][2].to(torch.bfloat16))
    assert torch.equal(out["bf16"][0], out["fp32"][0]) and torch.equal(out["bf16"][1], out["fp32"][1])


def test_head_grads_bf16_hold_the_heads_gradient_on_its_copy():
    """precision.head_grads_bf16: the head's gradient is bf16 on its copy (none on the fp32 weight).
    On the CPU the head-copy run's fp32 gradient is itself a bf16 product (its GEMMs have no wider
    output: _mm_into), so the two runs give the same losses and weights bit for bit (on the GPU the
    fp32 gradient is the GEMM's sum, which this switch rounds). Refused without the head copy and with
    accumulation."""
    from moetron.core.precision import PrecisionConfig

    runs = {}
    for grads in (False, True):
        trainer, data = _trainer(False, head=True, head_grads=grads)
        history = [trainer.train_step(data.next_batch())[0].item() for _ in range(3)]
        runs[grads] = history, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    (head,) = [m for m in trainer.model.modules() if isinstance(m, LMHead)]
    assert head.weight_bf16.requires_grad and id(head.weight_bf16) in {id(t) for t in trainer.optimizer.gradient_holders()}
    batch = data.next_batch()
    with trainer.precision.autocast():
        trainer.model(batch[:, :-1], batch[:, 1:]).backward()
    assert head.weight.grad is None and head.weight_bf16.grad.dtype == torch.bfloat16
    (h0, w0), (h1, w1) = runs[False], runs[True]
    assert h1 == h0 and h0[2] != h0[0]
    assert w1.keys() == w0.keys() and all(torch.equal(w1[k], w0[k]) for k in w0)
    with pytest.raises(ConfigError, match="needs --precision.head_weight_copy=true"):
        PrecisionConfig(recipe="bf16", head_grads_bf16=True, head_weight_copy=False).validate()
    # head_weight_copy left at auto: valid as written (auto turns the copy on for one GPU), refused where the
    # layout resolves it off (here the build's own resolution: no layout known, so off)
    PrecisionConfig(recipe="bf16", head_grads_bf16=True).validate()
    with pytest.raises(ConfigError, match="needs --precision.head_weight_copy=true"):
        PrecisionConfig(recipe="bf16", head_grads_bf16=True).build("cpu")
    trainer, data = _trainer(False, micro_batch=1, head=True, head_grads=True)
    with pytest.raises(ConfigError, match="accumulates 2 micro-batches"):
        trainer.train_step(data.next_batch())


def _grads_of_one_step(trainer, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and each parameter's gradient after one forward and backward, read from its optimizer copy where the
    copy holds it (named as the parameter)."""
    trainer.optimizer.zero_grad(set_to_none=True)
    for t in trainer.optimizer.gradient_holders():
        t.grad = None
    with trainer.precision.autocast():
        loss = trainer.model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    copies = getattr(trainer.optimizer, "compute_copies", {})
    out = {}
    for name, p in trainer.model.named_parameters():
        grad = p.grad if p.grad is not None else copies[p].grad
        out[name] = grad.detach().clone()
    return loss.detach(), out


def test_embedding_copy_gathers_the_same_rows_and_rounds_the_fp32_gradient():
    """precision.embedding_weight_copy (the bf16 stream on, as auto has it with bf16): the same loss to the
    bit, every other gradient the same bits, and the embedding's gradient, bf16 on its copy, is the fp32
    gradient the master gets without the switch rounded to bf16, exactly (oracle: the run without it).
    Three steps on one batch train as closely as that rounding allows."""
    grads, runs = {}, {}
    for on in (False, True):
        trainer, data = _trainer(False, embedding=on)
        batch = data.next_batch()
        grads[on] = _grads_of_one_step(trainer, batch)
        trainer, _ = _trainer(False, embedding=on)
        runs[on] = [trainer.train_step(batch)[0].item() for _ in range(3)]  # one batch: the loss falls
    (l0, g0), (l1, g1) = grads[False], grads[True]
    assert torch.equal(l0, l1) and g0.keys() == g1.keys()
    assert g0["embed.weight"].dtype == torch.float32 and g1["embed.weight"].dtype == torch.bfloat16
    assert g0["embed.weight"].abs().sum() > 0
    assert torch.equal(g1["embed.weight"], g0["embed.weight"].to(torch.bfloat16))
    assert all(torch.equal(g1[k], g0[k]) for k in g0 if k != "embed.weight")
    assert runs[True][0] == runs[False][0] and runs[True] == pytest.approx(runs[False], rel=1e-3)
    assert runs[False][2] < runs[False][0]
    (emb,) = [m for m in trainer.model.modules() if isinstance(m, Embedding)]
    assert emb.weight_copy.dtype == torch.bfloat16
    assert id(emb.weight_copy) in {id(t) for t in trainer.optimizer.gradient_holders()}
    # The optimizer's step rewrote the copy from the master it updated.
    assert torch.equal(emb.weight_copy.detach(), emb.weight.detach().to(torch.bfloat16))


def test_embedding_copy_refusals():
    """One ConfigError each: the fp32 stream (the rows would be rounded), a recipe other than bf16,
    gradient accumulation (bf16 sums)."""
    from moetron.core.precision import PrecisionConfig

    with pytest.raises(ConfigError, match="bf16_residual=auto"):
        PrecisionConfig(recipe="bf16", embedding_weight_copy=True, bf16_residual=False).validate()
    with pytest.raises(ConfigError, match="embedding_weight_copy=true has the token embedding"):
        PrecisionConfig(recipe="fp32", embedding_weight_copy=True).validate()
    trainer, data = _trainer(False, micro_batch=1, embedding=True)
    with pytest.raises(ConfigError, match="accumulates 2 micro-batches"):
        trainer.train_step(data.next_batch())


def test_embedding_copy_with_split_masters_saves_and_resumes(tmp_path):
    """With optimizer.split_master the embedding's master is split too (its fp32 storage freed between
    steps); a save between steps is the ordinary fp32 checkpoint: loaded into a run without either switch
    it gives the same weights, and evaluation without grad gathers from the copy."""
    from moetron.core.optim import OptimizerConfig

    trainer, data = _trainer(False, embedding=True,
                             optimizer=OptimizerConfig(state_dtype="bf16", impl="torch", split_master=True))
    for _ in range(2):
        trainer.train_step(data.next_batch())
    (emb,) = [m for m in trainer.model.modules() if isinstance(m, Embedding)]
    assert emb.weight.untyped_storage().size() == 0  # freed between steps
    batch = data.next_batch()
    with torch.no_grad(), trainer.precision.autocast():
        eval_loss = trainer.model(batch[:, :-1], batch[:, 1:]).item()
    with trainer.masters_materialized():
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    assert torch.equal(emb.weight_copy.detach(), state["embed.weight"].to(torch.bfloat16))
    plain, _ = _trainer(False)
    plain.model.load_state_dict(state)
    with torch.no_grad(), plain.precision.autocast():
        assert plain.model(batch[:, :-1], batch[:, 1:]).item() == eval_loss


def test_auto_copies_resolve_as_the_run_would():
    """precision's weight copies default to auto: on (the optimizer's bf16 expert copies and their bf16
    gradients, the dense and head copies) for bf16 on one CUDA GPU with one micro-batch a step and this
    package's AdamW, off for every other layout, recipe, device and optimizer; a value given is kept; the
    command line spells it ``auto``; the build without a layout (PrecisionConfig.build) takes them off."""
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.core.precision.config import AUTO_COPIES, copies_off_overrides
    from moetron.parallel.config import ParallelConfig
    from moetron.run.build import resolve_auto

    def switches(p):
        return str(p.expert_weight_copies), p.expert_grads_bf16, p.dense_weight_copies, p.head_weight_copy

    auto = PrecisionConfig()
    assert auto.auto_copies and all(getattr(auto, f) is None for f in AUTO_COPIES)
    assert switches(auto.with_auto_copies(True)) == ("optimizer", True, True, True)
    assert switches(auto.with_auto_copies(False)) == ("none", False, False, False)
    mixed = PrecisionConfig(expert_weight_copies="step", head_weight_copy=False).with_auto_copies(True)
    assert switches(mixed) == ("step", False, True, False)  # given kept; expert grads need the optimizer's copies
    off_overrides = [o.replace("--precision.", "--") for o in copies_off_overrides()]  # what the notes tell users
    assert switches(PrecisionConfig().apply_overrides(off_overrides).with_auto_copies(True)) == ("none", False, False, False)
    spelled = PrecisionConfig().apply_overrides(["--dense_weight_copies=false", "--dense_weight_copies=auto",
                                                 "--expert_weight_copies=auto", "--head_weight_copy=true"])
    assert spelled.dense_weight_copies is None and spelled.expert_weight_copies is None and spelled.head_weight_copy is True

    def resolved(device="cuda", one_rank=True, local=4, micro=None, precision=None, **optimizer):
        return resolve_auto(precision or PrecisionConfig(), OptimizerConfig(**optimizer), device, one_rank=one_rank,
                            local_batch=local, micro_batch=micro, fused_loss=True)[0]

    assert switches(resolved()) == ("optimizer", True, True, True)
    assert switches(resolved(micro=4)) == ("optimizer", True, True, True)  # one micro-batch of the whole batch
    assert switches(resolved(impl="torch", state_dtype="bf16")) == ("optimizer", True, True, True)  # foreach: ours
    for case in (dict(device="cpu"), dict(one_rank=False), dict(micro=2), dict(impl="torch"), dict(fused=True),
                 dict(overlap=True), dict(precision=PrecisionConfig(recipe="fp32")),
                 dict(precision=PrecisionConfig(recipe="fp8_rowwise"))):
        assert switches(resolved(**case)) == ("none", False, False, False), case
    assert switches(resolved(one_rank=False, precision=PrecisionConfig(dense_weight_copies=True))) == ("none", False, True, False)
    assert ParallelConfig().one_rank(1) and ParallelConfig(dp_shard=1).one_rank(1)
    for layout, world in ((ParallelConfig(), 2), (ParallelConfig(strategies=["data"]), 1),
                          (ParallelConfig(strategies=["pipeline", "data"]), 1), (ParallelConfig(dp_shard=2), 2)):
        assert not layout.one_rank(world), (layout, world)
    policy = PrecisionConfig(recipe="bf16").build("cpu")  # no layout known: off
    assert not policy.gemm.dense_copies and not policy.gemm.head_copy


def test_auto_copies_on_train_as_off():
    """The rule auto turns on (all four copy switches together) against all four off, one micro-batch, three
    steps: the same losses and weights bit for bit unclipped; clipped (every step scaled) within the few ulps
    of the clipping norm's other summation order."""
    from step_builder import RandomTokens, build_trainer  # tools/

    from moetron.core.memory import MemoryConfig
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
    for clip in (0.0, 0.05):
        runs = {}
        for on in (False, True):
            data = RandomTokens(cfg.vocab_size, 2, 32, torch.device("cpu"))
            trainer = build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32,
                                    precision=PrecisionConfig(recipe="bf16").with_auto_copies(on),
                                    optimizer=OptimizerConfig(state_dtype="bf16", impl="torch"))
            assert bool(trainer.optimizer.compute_copies) == on
            trainer.cfg.grad_clip = clip
            losses = [trainer.train_step(data.next_batch())[0].item() for _ in range(3)]
            runs[on] = losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        (l0, w0), (l1, w1) = runs[False], runs[True]
        assert l0[2] != l0[0] and w0.keys() == w1.keys()
        if clip == 0.0:
            assert l1 == l0 and all(torch.equal(w1[k], w0[k]) for k in w0)
        else:
            assert l1 == pytest.approx(l0, rel=1e-4) and max(float((w1[k] - w0[k]).abs().max()) for k in w0) <= 1e-3


@pytest.mark.parametrize("saved_on", [True, False], ids=["saved_with_copies", "saved_without"])
def test_a_checkpoint_resumes_across_the_copies_auto_choice(saved_on, tmp_path):
    """auto decides the copies by layout, so a run may save on one GPU (copies on) and resume where they are off,
    or the other way: the checkpoint holds the fp32 masters and Adam state either way, the copies are rebuilt from
    them. Two unclipped steps, save, load into a trainer of the other choice: its next step equals the
    uninterrupted run's, bit for bit, and so do the weights after it."""
    from step_builder import RandomTokens, build_trainer  # tools/

    from moetron.core.memory import MemoryConfig
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.core.trainer import TrainerConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])

    def make(on: bool):
        data = RandomTokens(cfg.vocab_size, 2, 32, torch.device("cpu"))
        trainer = build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32,
                                precision=PrecisionConfig(recipe="bf16").with_auto_copies(on),
                                optimizer=OptimizerConfig(state_dtype="bf16", impl="torch"),
                                trainer=TrainerConfig(grad_clip=0.0))
        assert bool(trainer.optimizer.compute_copies) == on
        return trainer, data

    assert_resume_rewrites_copies(lambda: make(saved_on), tmp_path, lambda: make(not saved_on))


def test_an_out_of_memory_step_names_the_copies(monkeypatch):
    """A step that runs out of memory while the optimizer's weight copies are held (auto's choice on one GPU)
    keeps its error and gains a note naming them, their size and the overrides that free them; without copies
    no note, nor where every copy holds its master split (optimizer.split_master: turning them off frees nothing)."""
    from moetron.core.optim import OptimizerConfig

    for dense, split, copied in ((True, False, True), (False, False, False), (True, True, False)):
        # split: optimizer.split_master holds the dense masters as those copies, which then cost nothing to free
        trainer, _ = _trainer(dense, optimizer=OptimizerConfig(state_dtype="bf16", impl="torch", split_master=split))

        def oom(batch):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        monkeypatch.setattr(trainer, "train_step", oom)
        trainer.cfg.eval_batches = 0  # random tokens: no held-out set
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as info:
            trainer.fit()
        notes = getattr(info.value, "__notes__", [])
        if copied:  # the dense linears' weights (not the head's), 2 B each
            held = 2 * sum(m.weight.numel() for m in trainer.model.modules()
                           if isinstance(m, Linear) and not isinstance(m, LMHead))
            assert held > 0 and len(notes) == 1 and f"hold {held / 2**30:.2f} GiB" in notes[0]
            assert "--precision.dense_weight_copies=false" in notes[0]
        else:
            assert notes == [] and (bool(trainer.optimizer.split_parameters()) if split else not trainer.optimizer.compute_copies)
