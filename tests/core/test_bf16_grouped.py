"""core.precision.bf16_grouped: the grouped expert GEMMs on fp32 master weights.

Oracles: a float64 per-group loop (values and gradients), the plain autograd composition of
torch._grouped_mm on cast copies (the code it replaces), and saved-tensor hooks (what it keeps for
backward), eager and through the compile partitioner (aot_eager_decomp_partition runs the same
min-cut partitioner as inductor, without compiling kernels).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from moetron.core.layers.mlp import swiglu
from moetron.models import ModelConfig
from moetron.core.precision.bf16_grouped import grouped_mm, grouped_swiglu_down

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is missing in this torch"
)

R, I, O, E = 96, 64, 48, 4


def _case(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, I, generator=g).to(device, torch.bfloat16).requires_grad_(True)
    w = torch.randn(E, O, I, generator=g).div(8).to(device).requires_grad_(True)  # fp32 master weight
    sizes = torch.tensor([20, 0, 40, 36])  # an empty group too
    offsets = torch.cumsum(sizes, 0).to(device, torch.int32)
    return x, w, offsets


def _loop(x, w, offsets):
    """float64 reference: rows of group e times w[e]^T."""
    out, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        out.append(x[start:end].double() @ w[e].double().T)
        start = end
    return torch.cat(out)


def test_grouped_mm_matches_float64_loop_and_plain_composition():
    x, w, offsets = _case()
    y = grouped_mm(x, w, offsets, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    gy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    assert gw.dtype == torch.float32 and gx.dtype == torch.bfloat16

    x64, w64 = x.detach().double().requires_grad_(True), w.detach().bfloat16().double().requires_grad_(True)
    y64 = _loop(x64, w64, offsets)
    gx64, gw64 = torch.autograd.grad(y64, (x64, w64), gy.double())
    torch.testing.assert_close(y.double(), y64, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx.double(), gx64, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(gw.double(), gw64, rtol=2e-2, atol=5e-2)
    assert gw[1].abs().max() == 0  # the empty group gets no gradient

    # The plain composition it replaces: the forward is the same GEMM call, bit for bit.
    plain = torch._grouped_mm(x, w.to(torch.bfloat16).transpose(-2, -1), offs=offsets)
    assert torch.equal(y, plain)


def test_grouped_swiglu_down_equals_activation_then_grouped_mm():
    x, _, offsets = _case(1)
    h = torch.randn(R, 2 * I, dtype=torch.bfloat16).requires_grad_(True)
    w = torch.randn(E, O, I).div(8).requires_grad_(True)
    y = grouped_swiglu_down(h, w, offsets, torch.bfloat16)
    gy = torch.randn_like(y)
    gh, gw = torch.autograd.grad(y, (h, w), gy)

    h2, w2 = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
    gate, up = h2.chunk(2, dim=-1)
    y2 = grouped_mm(swiglu(gate, up), w2, offsets, torch.bfloat16)
    gh2, gw2 = torch.autograd.grad(y2, (h2, w2), gy)
    assert torch.equal(y, y2)
    assert torch.equal(gw, gw2)
    assert torch.equal(gh, gh2)  # autograd's own activation gradient, on the recomputed product


class _Saved:
    def __init__(self):
        self.tensors = []

    def pack(self, t):
        self.tensors.append((tuple(t.shape), t.dtype))
        return t


def _saved(fn, *args):
    ledger = _Saved()
    with torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda t: t):
        out = fn(*args)
    out.float().sum().backward()
    return ledger.tensors


def _experts(x, w_up, w_down, offsets):
    h = grouped_mm(x, w_up, offsets, torch.bfloat16)
    return grouped_swiglu_down(h, w_down, offsets, torch.bfloat16)


def _experts_plain(x, w_up, w_down, offsets):
    h = torch._grouped_mm(x, w_up.to(torch.bfloat16).transpose(-2, -1), offs=offsets)
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(swiglu(gate, up), w_down.to(torch.bfloat16).transpose(-2, -1), offs=offsets)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile-partitioner"])
def test_no_bf16_weight_copy_and_no_product_saved(compiled):
    x, _, offsets = _case(2)
    F = 32
    w_up = torch.randn(E, 2 * F, I).div(8).requires_grad_(True)
    w_down = torch.randn(E, O, F).div(8).requires_grad_(True)
    run = torch.compile(_experts, backend="aot_eager_decomp_partition", fullgraph=True) if compiled else _experts
    saved = _saved(run, x, w_up, w_down, offsets)
    shapes = {s for s, dt in saved if dt == torch.bfloat16}
    assert (E, 2 * F, I) not in shapes and (E, O, F) not in shapes, saved  # no bf16 weight copies
    assert (R, F) not in shapes, saved  # no silu(gate) * up product
    # The plain composition does keep them: the test can tell.
    plain = torch.compile(_experts_plain, backend="aot_eager_decomp_partition") if compiled else _experts_plain
    plain_shapes = {s for s, dt in _saved(plain, x, w_up, w_down, offsets) if dt == torch.bfloat16}
    assert (E, 2 * F, I) in plain_shapes or (E, I, 2 * F) in plain_shapes


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile-partitioner"])
def test_saved_product_gives_the_same_bits_and_is_what_is_kept(compiled):
    """precision.save_swiglu_product: the product [R, F] is kept for the backward (and is the one
    extra bf16 tensor saved), and outputs and gradients are the same bits as with the recompute; also
    with each row scaled before the down projection (model.moe.weights_before_down)."""
    x, _, offsets = _case(2)
    F = 32
    w_up = torch.randn(E, 2 * F, I).div(8).requires_grad_(True)
    w_down = torch.randn(E, O, F).div(8).requires_grad_(True)
    scale = torch.rand(R).requires_grad_(True)

    def experts(x, w_up, w_down, offsets, save, scaled):
        h = grouped_mm(x, w_up, offsets, torch.bfloat16)
        return grouped_swiglu_down(h, w_down, offsets, torch.bfloat16, save_product=save,
                                   row_scale_R=scale if scaled else None)

    for scaled in (False, True):
        runs = {}
        for save in (False, True):
            fn = (lambda *a, save=save: experts(*a, save, scaled))
            run = torch.compile(fn, backend="aot_eager_decomp_partition", fullgraph=True) if compiled else fn
            saved = _saved(run, x, w_up, w_down, offsets)
            y = run(x, w_up, w_down, offsets)
            grads = torch.autograd.grad(y.float().square().sum(), (w_up, w_down, scale) if scaled else (w_up, w_down))
            runs[save] = saved, y, grads
        (saved_off, y_off, g_off), (saved_on, y_on, g_on) = runs[False], runs[True]
        assert torch.equal(y_on, y_off) and all(torch.equal(a, b) for a, b in zip(g_on, g_off)), scaled
        more, fewer = Counter(saved_on) - Counter(saved_off), Counter(saved_off) - Counter(saved_on)
        assert more == Counter({((R, F), torch.bfloat16): 1}), (scaled, more)
        assert set(fewer) <= {((0,), torch.bfloat16)}, (scaled, fewer)  # the empty stand-in saved without it


def test_trainer_with_the_saved_product_equals_without():
    """precision.save_swiglu_product through the config, the backend and the experts: three bf16 steps
    of a tiny MoE, the same losses bit for bit; refused outside the bf16 recipe."""
    from step_builder import RandomTokens, build_trainer  # tools/ (tests/conftest.py puts it on the path)

    from moetron.core.config import ConfigError
    from moetron.core.memory import MemoryConfig
    from moetron.core.precision import PrecisionConfig

    losses = {}
    for save in (False, True):
        cfg = ModelConfig.preset("tiny-moe")
        cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
        data = RandomTokens(cfg.vocab_size, 2, 32, torch.device("cpu"))
        trainer = build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32,
                                precision=PrecisionConfig(recipe="bf16", save_swiglu_product=save))
        assert trainer.precision.gemm.save_swiglu_product is save
        losses[save] = [trainer.train_step(data.next_batch())[0].item() for _ in range(3)]
    assert losses[True] == losses[False] and losses[False][2] != losses[False][0]
    with pytest.raises(ConfigError, match="save_swiglu_product"):
        PrecisionConfig(recipe="mxfp8", backend="emulated", save_swiglu_product=True).validate()
    with pytest.raises(ConfigError, match="precision.recipe=fp32"):
        PrecisionConfig(save_swiglu_product=True).build("cpu")  # auto on the CPU: fp32


def test_experts_grouped_mm_backend_matches_loop_under_autocast():
    """GroupedExperts through these ops (backend grouped_mm) against the per-expert loop."""
    from moetron.core.moe.config import ExpertsBackend
    from moetron.core.moe.experts import GroupedExperts

    torch.manual_seed(0)
    fused = GroupedExperts(E, I, 32, ExpertsBackend.grouped_mm)
    loop = GroupedExperts(E, I, 32, ExpertsBackend.loop)
    for w in (fused.w_gate_up, fused.w_down):
        torch.nn.init.normal_(w, std=0.1)
    loop.load_state_dict(fused.state_dict())
    x, _, offsets = _case(3)
    outs = []
    for m in (fused, loop):
        xx = x.detach().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xx, offsets)
        y.float().square().sum().backward()
        outs.append((y, xx.grad, m.w_gate_up.grad, m.w_down.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_weight_cache_casts_once_per_step_and_gives_the_same_results():
    """precision.expert_weight_copies: one bf16 copy per weight per step (fwd and bwd reuse it), the
    same values as casting each time, a new copy after the optimizer step's invalidate()."""
    from moetron.core.precision import bf16_grouped

    cid = bf16_grouped.register_cache()
    cache = bf16_grouped.cache(cid)
    x, w, offsets = _case(4)
    outs = []
    for use in (None, cid):
        xx, ww = x.detach().requires_grad_(True), w.detach().clone().requires_grad_(True)
        y = grouped_mm(xx, ww, offsets, torch.bfloat16, use)
        y.float().square().sum().backward()
        outs.append((y, xx.grad, ww.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert (cache.misses, cache.hits) == (1, 1)  # forward made it, backward reused it
    with torch.no_grad():
        ww.add_(1.0)  # an optimizer step (in place)...
    cache.invalidate()  # ...and the trainer's after_optimizer_step
    y2 = grouped_mm(x, ww, offsets, torch.bfloat16, cid)
    assert cache.misses == 2 and torch.equal(y2, grouped_mm(x, ww, offsets, torch.bfloat16))


def test_trainer_with_weight_copies_equals_without():
    """Three bf16 steps of a tiny MoE on the grouped-GEMM experts: the same losses with no copies,
    copies made once per step, and copies the optimizer writes (the trainer invalidates / re-pins
    them after each optimizer step; a stale copy would change the second step's loss). With the
    optimizer's copies no expert weight is ever cast."""
    from step_builder import RandomTokens, build_trainer  # tools/ (tests/conftest.py puts it on the path)

    from moetron.core.memory import MemoryConfig
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.core.precision import bf16_grouped

    losses, misses = {}, {}
    for copies in ("none", "step", "optimizer"):
        cfg = ModelConfig.preset("tiny-moe")
        cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
        data = RandomTokens(cfg.vocab_size, 2, 32, torch.device("cpu"))
        # PrecisionAwareAdamW (its foreach path on the CPU) for every mode, so the losses compare.
        trainer = build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32,
                                precision=PrecisionConfig(recipe="bf16", expert_weight_copies=copies),
                                optimizer=OptimizerConfig(state_dtype="bf16", impl="torch"))
        losses[copies] = [trainer.train_step(data.next_batch())[0].item() for _ in range(3)]
        cache_id = trainer.precision.gemm.weight_cache
        misses[copies] = None if cache_id is None else bf16_grouped.cache(cache_id).misses
    assert losses["none"] == losses["step"] == losses["optimizer"]
    assert losses["none"][2] != losses["none"][0]  # the weights did change between steps
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    assert moe_layers >= 1 and misses["step"] == 3 * moe_layers * 2  # each MoE layer's 2 weights, once a step
    assert misses["optimizer"] == 0  # every use served by the optimizer's copies


def test_optimizer_copies_need_an_optimizer_that_writes_them():
    from step_builder import RandomTokens, build_trainer

    from moetron.core.config import ConfigError
    from moetron.core.memory import MemoryConfig
    from moetron.core.precision import PrecisionConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=1", "moe.experts_backend=grouped_mm"])
    data = RandomTokens(cfg.vocab_size, 2, 32, torch.device("cpu"))
    with pytest.raises(ConfigError, match="expert_weight_copies=optimizer needs an optimizer"):
        build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32,
                      precision=PrecisionConfig(recipe="bf16", expert_weight_copies="optimizer"))


def test_weights_before_down_keeps_no_expert_output_rows():
    """model.moe.weights_before_down on the fused bf16 path: output and gradients as close to the
    float64 truth (the same layer in float64 on the loop path) as weighting in the combine is, and
    one [rows, D] tensor fewer saved for backward (the expert outputs the combine kept for its
    weights' gradient)."""
    from moetron.core.moe import MoELayer
    from moetron.core.moe.config import MoEConfig, RouterConfig

    D_, T_ = 32, 48
    torch.manual_seed(1)
    x0 = torch.randn(1, T_, D_)

    def run(before, backend, dtype, autocast):
        cfg = MoEConfig(num_experts=4, expert_hidden=16, router=RouterConfig(top_k=2, lb_loss_weight=0.0),
                        experts_backend=backend, weights_before_down=before)
        cfg.validate_for(2)
        torch.manual_seed(0)
        layer = MoELayer(D_, cfg)
        layer.init_weights(0.2)
        layer = layer.to(dtype)
        x = x0.detach().to(dtype).clone().requires_grad_(True)  # a fresh leaf each run
        ledger = _Saved()
        with torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = layer(x)
        y.double().square().sum().backward()
        rows = sum(1 for s, dt in ledger.tensors if s == (T_ * 2, D_) and dt == torch.bfloat16)
        return [t.double() for t in (y, x.grad, layer.router.weight.grad, layer.experts.w_down.grad)], rows

    truth, _ = run(False, "loop", torch.float64, False)
    errors, rows = {}, {}
    for before in (False, True):
        got, rows[before] = run(before, "grouped_mm", torch.float32, True)
        errors[before] = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, truth)]
    for e_before, e_combine in zip(errors[True], errors[False]):
        assert e_before <= 2 * e_combine + 2**-8, (errors[True], errors[False])
    assert rows[True] == rows[False] - 1 and rows[False] >= 2


def _copies_trainer(grads_bf16: bool, micro_batch=None, device: str = "cpu", **precision):
    """A tiny MoE's trainer on ``device`` (the CPU) with the optimizer's bf16 expert copies; ``precision``:
    other PrecisionConfig fields (the recipe, or expert_weight_copies="none" for the run without)."""
    from step_builder import RandomTokens, build_trainer

    from moetron.core.memory import MemoryConfig
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
    data = RandomTokens(cfg.vocab_size, 2, 32, torch.device(device))
    trainer = build_trainer(cfg, MemoryConfig(), data, torch.device(device), seq_len=32, micro_batch=micro_batch,
                            precision=PrecisionConfig(**{"recipe": "bf16", "expert_weight_copies": "optimizer",
                                                         "expert_grads_bf16": grads_bf16, **precision}),
                            optimizer=OptimizerConfig(state_dtype="bf16", impl="torch"))
    return trainer, data


def assert_quantized_copies_run_follows_fp32(recipe: str, backend: str = "emulated", device: str = "cpu",
                                             must_decrease: bool = True, **precision):
    """A low-precision recipe with precision.expert_weight_copies=optimizer, expert_grads_bf16=true
    against the same recipe without: with the copies the experts compute with the optimizer's bf16
    copies (the parameters get no gradient), the optimizer rewrites the copies from the updated fp32
    weights, and the run follows the one quantizing the fp32 weights (the quantization of bf16(w)
    against that of w: the last bit of a few elements). ``precision``: other PrecisionConfig fields of
    both runs. ``must_decrease``: the third step's loss below the first's (random tokens sit near
    ln(vocab) from the start: on the GPU, whose initialization differs, three steps need not descend;
    there the expert weights must have moved from their initial values instead, as they must
    everywhere). Returns each run's gemm backend."""
    from moetron.core.moe.experts import GroupedExperts

    runs, gemms = {}, {}
    for copies in (False, True):
        torch.manual_seed(0)
        trainer, data = _copies_trainer(copies, device=device, recipe=recipe, backend=backend,
                                        expert_weight_copies="optimizer" if copies else "none", **precision)
        gemms[copies] = trainer.precision.gemm
        assert gemms[copies].expert_copies == copies
        experts = [m for m in trainer.model.modules() if isinstance(m, GroupedExperts)]
        initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        losses = [trainer.train_step(data.next_batch())[0].item() for _ in range(3)]
        for m in experts:
            if copies:
                assert m.weight_copies is not None and m.w_gate_up.grad is None
                for w, c in zip((m.w_gate_up, m.w_down), m.weight_copies):
                    assert c.dtype == torch.bfloat16 and torch.equal(c.detach(), w.detach().to(torch.bfloat16))
            else:
                assert m.weight_copies is None
        runs[copies] = losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, initial
    (l32, p32, i32), (l16, p16, i16) = runs[False], runs[True]
    assert not must_decrease or (l32[2] < l32[0] and l16[2] < l16[0])
    assert l16 == pytest.approx(l32, rel=2e-3)
    moved = [k for k in p32 if "w_gate_up" in k or "w_down" in k]
    assert moved and all(not torch.equal(p[k], i[k]) for p, i in ((p16, i16), (p32, i32)) for k in moved)
    assert all(((p16[k] - p32[k]).norm() / p32[k].norm()).item() < 1e-2 for k in moved)
    return gemms


def test_expert_grads_bf16_give_the_fp32_gradient_updates_bit_for_bit():
    """precision.expert_grads_bf16: the experts' gradients stay on the optimizer's bf16 copies (the
    expert parameters get none). Unclipped, three steps give the same losses and parameters bit for
    bit as fp32 gradients: the grouped GEMM rounds its weight gradient to bf16 either way, so holding
    it in bf16 loses nothing with one micro-batch. The gradient norm agrees to fp32 rounding (a bf16
    tensor's norm is reduced in another order); so, clipped, the updates agree to a few ulps."""
    from moetron.core.moe.experts import GroupedExperts

    runs = {}
    for clip in (0.0, 0.05):  # 0.05: below the tiny model's norm, so the clip coefficient matters
        for grads_bf16 in (False, True):
            trainer, data = _copies_trainer(grads_bf16)
            trainer.cfg.grad_clip = clip
            history = [tuple(t.item() for t in trainer.train_step(data.next_batch())) for _ in range(3)]
            runs[clip, grads_bf16] = (history, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    (h32, p32), (h16, p16) = runs[0.0, False], runs[0.0, True]
    assert [h[0] for h in h32] == [h[0] for h in h16] and h32[2][0] != h32[0][0]
    assert p32.keys() == p16.keys() and all(torch.equal(p32[k], p16[k]) for k in p32)
    for (_, n32), (_, n16) in zip(h32, h16):
        assert n16 == pytest.approx(n32, rel=1e-6)
    (c32, q32), (c16, q16) = runs[0.05, False], runs[0.05, True]
    assert all(h[1] > 0.05 for h in c32)  # clipped every step
    # (2.4e-5 apart by the third step on an AMD EPYC's CPU kernels, under 1e-5 on others)
    assert [h[0] for h in c16] == pytest.approx([h[0] for h in c32], rel=1e-4)
    # The clip coefficients differ in their last bits, and from the second step on so does everything
    # downstream; some elements' bf16 Adam moments round the other way: at most about an update apart.
    assert max(float((q16[k] - q32[k]).abs().max()) for k in q32) <= 1e-3
    assert any(not torch.equal(q32[k], p32[k]) for k in q32)  # the clip did change the updates
    # Where the gradients went: bf16 on the copies, nothing on the expert parameters.
    holders = trainer.optimizer.gradient_holders()
    experts = [m for m in trainer.model.modules() if isinstance(m, GroupedExperts)]
    assert len(holders) == 2 * len(experts) >= 2
    batch = data.next_batch()
    with trainer.precision.autocast():
        trainer.model(batch[:, :-1], batch[:, 1:]).backward()
    assert all(m.w_gate_up.grad is None and m.w_down.grad is None for m in experts)
    assert all(h.grad is not None and h.grad.dtype == torch.bfloat16 for h in holders)
    trainer.optimizer.zero_grad()
    assert all(h.grad is None for h in holders)


def test_expert_grads_bf16_refuses_what_it_cannot_serve():
    from moetron.core.config import ConfigError
    from moetron.core.precision import PrecisionConfig

    with pytest.raises(ConfigError, match="needs --precision.expert_weight_copies=optimizer"):
        PrecisionConfig(recipe="bf16", expert_weight_copies="step", expert_grads_bf16=True).validate()
    trainer, data = _copies_trainer(True, micro_batch=1)
    with pytest.raises(ConfigError, match="accumulates 2 micro-batches"):
        trainer.train_step(data.next_batch())


@pytest.mark.parametrize("grads_bf16", [False, True], ids=["copies", "copies+bf16_grads"])
def test_resume_rewrites_the_optimizer_copies(tmp_path, grads_bf16):
    """After Trainer.load the optimizer's bf16 expert copies hold the loaded weights, not the ones
    they were made from: a resumed trainer's next step equals the uninterrupted trainer's."""
    assert_resume_rewrites_copies(lambda: _copies_trainer(grads_bf16), tmp_path)


def assert_resume_rewrites_copies(make, tmp_path, make_resumed=None):
    """``make()`` -> (trainer, data), a trainer whose optimizer writes compute copies: two steps,
    save, then a fresh trainer (its copies made from the initial weights; ``make_resumed()``'s, default
    ``make()``'s) loads the checkpoint; its next step must equal the uninterrupted trainer's, and so must
    the weights after it."""
    from moetron.core.checkpoint import CheckpointConfig, Checkpointer

    first, data = make()
    first.checkpointer = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    for _ in range(2):
        first.train_step(data.next_batch())
    first.step = 2
    path = first.save()
    resumed, _ = (make_resumed or make)()  # fresh: its copies hold the initial weights
    resumed.checkpointer = first.checkpointer
    resumed.load(path)
    batch = data.next_batch()
    assert resumed.train_step(batch)[0].item() == first.train_step(batch)[0].item()
    w0, w1 = first.model.state_dict(), resumed.model.state_dict()
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)


def test_per_expert_cublas_path_matches_float64_and_the_grouped_kernel():
    """precision.bf16_experts=cublas: one torch.mm per group (written into the output in place),
    forward and backward of both expert ops, rows past the last group (capacity padding) and an
    empty group included, against a float64 loop and against torch._grouped_mm's path."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(R, I, generator=g).to(torch.bfloat16).requires_grad_(True)
    w_up = torch.randn(E, 2 * O, I, generator=g).div(8).requires_grad_(True)
    w_down = torch.randn(E, I, O, generator=g).div(8).requires_grad_(True)
    scale = torch.rand(R, generator=g).requires_grad_(True)
    offsets = torch.cumsum(torch.tensor([20, 0, 40, 30]), 0).to(torch.int32)  # 6 rows past the end
    used = int(offsets[-1])
    gy = torch.randn(used, I, generator=g).to(torch.bfloat16)

    def run(per_expert):
        h = grouped_mm(x, w_up, offsets, torch.bfloat16, per_expert=per_expert)
        y = grouped_swiglu_down(h, w_down, offsets, torch.bfloat16, row_scale_R=scale, per_expert=per_expert)
        grads = torch.autograd.grad(y[:used], (x, w_up, w_down, scale), gy)
        return (h, y, *grads)

    import moetron.core.precision.bf16_grouped as bf16_grouped
    from tests.host_reads import counted_host_reads

    with counted_host_reads(bf16_grouped) as reads:
        h, y, gx, gw_up, gw_down, gscale = run(True)
    assert sum(reads) == 4  # device -> host reads: each op's forward, and its backward's dgrad + wgrad once
    assert y.dtype == torch.bfloat16 and gw_up.dtype == torch.float32
    assert h[used:].abs().max() == 0 and y[used:].abs().max() == 0  # the loop zeroes the padding rows
    assert gx[used:].abs().max() == 0 and gw_up[1].abs().max() == 0 and gw_down[1].abs().max() == 0

    # float64 on the same bf16-rounded operands
    x64 = x.detach().double().requires_grad_(True)
    wu64 = w_up.detach().bfloat16().double().requires_grad_(True)
    wd64 = w_down.detach().bfloat16().double().requires_grad_(True)
    s64 = scale.detach().double().requires_grad_(True)
    h64 = _loop(x64, wu64, offsets)
    gate, up = h64.chunk(2, dim=-1)
    y64 = _loop(torch.nn.functional.silu(gate) * up * s64[:used, None], wd64, offsets)
    ref = torch.autograd.grad(y64, (x64, wu64, wd64, s64), gy.double())
    torch.testing.assert_close(h[:used].double(), h64, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y[:used].double(), y64, rtol=3e-2, atol=3e-2)
    for name, got, want in zip(("dx", "dw_up", "dw_down", "dscale"), (gx, gw_up, gw_down, gscale), ref):
        # bf16 intermediates (h, the product, their gradients) against exact ones: a relative norm
        err = ((got[: want.shape[0]].double() - want).norm() / want.norm()).item()
        assert err < 1e-2, (name, err)

    # against the grouped kernel's path: the same bf16 GEMMs per group, fp32 sums in its own order
    for got, want in zip((h, y, gx, gw_up, gw_down, gscale), run(False)):
        n = used if got.shape[0] == R else got.shape[0]
        torch.testing.assert_close(got[:n].float(), want[:n].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_per_expert_cublas_on_gpu_matches_the_grouped_kernel():
    """On the GPU: cuBLAS per expert against torch._grouped_mm (CUTLASS), both expert ops, fwd + bwd,
    ragged groups (an empty one, sizes not multiples of 8 or 16) and padding rows past the end."""
    g = torch.Generator().manual_seed(7)
    R_, D, F_, E_ = 4096, 512, 384, 6
    sizes = torch.tensor([1000, 0, 7, 1501, 1, 1480])  # 4 rows past the end
    offsets = torch.cumsum(sizes, 0).to("cuda", torch.int32)
    used = int(sizes.sum())
    x = torch.randn(R_, D, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    w_up = (torch.randn(E_, 2 * F_, D, generator=g) * D ** -0.5).cuda().requires_grad_(True)
    w_down = (torch.randn(E_, D, F_, generator=g) * F_ ** -0.5).cuda().requires_grad_(True)
    gy = torch.randn(used, D, generator=g).to("cuda", torch.bfloat16)
    out = {}
    for per_expert in (False, True):
        h = grouped_mm(x, w_up, offsets, torch.bfloat16, per_expert=per_expert)
        y = grouped_swiglu_down(h, w_down, offsets, torch.bfloat16, triton_swiglu=True, per_expert=per_expert)
        out[per_expert] = (h[:used], y[:used], *torch.autograd.grad(y[:used], (x, w_up, w_down), gy))
    for name, a, b in zip(("h", "y", "dx", "dw_up", "dw_down"), out[True], out[False]):
        a, b = a.float(), b.float()
        if name == "dx":
            assert a[used:].abs().max() == 0
            a, b = a[:used], b[:used]
        err = ((a - b).norm() / b.norm()).item()
        assert err < 5e-3, (name, err)  # bf16 outputs, fp32 sums in two orders
    assert out[True][3][1].abs().max() == 0 and out[True][4][1].abs().max() == 0  # the empty expert
