"""The fused, chunked LM-head loss (core.layers.loss.linear_cross_entropy) against the plain one
(logits, then F.cross_entropy): loss and gradients in float64 and fp32, ignored tokens, z-loss,
chunks that do not divide the tokens, bf16 autocast with an fp32 master weight; no [T, V] tensor
is ever made; bad inputs; and whole tiny-model trainer steps with model.fused_loss on and off.

Legend: T tokens, D model dim, V vocab.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetron.core.config import ConfigError
from moetron.core.layers import loss as L
from moetron.core.layers.loss import (LMHead, chunk_bounds, cross_entropy, declared_loss_weight, default_chunk_tokens,
                                      linear_cross_entropy, logit_bytes, loss_weight)
from moetron.core.optim import OptimizerConfig, SchedulerConfig
from moetron.core.precision import PrecisionPolicy
from moetron.core.precision.gemm import DEFAULT_GEMM
from moetron.core.trainer import Trainer, TrainerConfig
from moetron.models import ModelConfig, cross_entropy_loss
from moetron.core.layers.attention import AttentionConfig
from moetron.core.moe.config import MoEConfig, RouterConfig

T, D, V = 37, 8, 50
IGNORE = -100


def _inputs(dtype, seed=0, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    h_TD = torch.randn(T, D, generator=g, dtype=dtype).requires_grad_()
    w_VD = (0.5 * torch.randn(V, D, generator=g, dtype=dtype)).requires_grad_()
    labels_T = torch.randint(0, V, (T,), generator=g)
    if ignore_every:
        labels_T[::ignore_every] = IGNORE
    return h_TD, w_VD, labels_T


def _plain(h_TD, w_VD, labels_T, z_loss_weight=0.0):
    logits_TV = h_TD @ w_VD.t()
    loss = cross_entropy(logits_TV, labels_T, IGNORE)
    if z_loss_weight:
        lse_T = torch.logsumexp(logits_TV.float() if logits_TV.dtype != torch.float64 else logits_TV, -1)
        loss = loss + z_loss_weight * lse_T[labels_T != IGNORE].square().mean()
    return loss


TOL = {torch.float64: dict(rtol=1e-12, atol=1e-13), torch.float32: dict(rtol=1e-5, atol=1e-6)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 7, 16, T, T + 5, None])
@pytest.mark.parametrize("z_loss_weight", [0.0, 0.1])
def test_fused_matches_plain_loss_and_grads(dtype, chunk, z_loss_weight):
    h, w, y = _inputs(dtype)
    loss = linear_cross_entropy(h, w, y, chunk_tokens=chunk, z_loss_weight=z_loss_weight)
    # A grad_output other than 1 (the trainer scales each micro-batch's loss by its share).
    grads = torch.autograd.grad(loss * 0.37, (h, w))
    ref = _plain(h, w, y, z_loss_weight)
    ref_grads = torch.autograd.grad(ref * 0.37, (h, w))
    assert loss.dtype == ref.dtype == dtype
    torch.testing.assert_close(loss, ref, **TOL[dtype])
    for g, r, name in zip(grads, ref_grads, ("h", "weight")):
        assert g.dtype == dtype
        torch.testing.assert_close(g, r, **TOL[dtype], msg=lambda m, name=name: f"grad {name}: {m}")


# ---- a declared incoming gradient (model.fused_loss_prescale) ---------------------------------------

@pytest.mark.parametrize("grad", [1.0, 0.25])
@pytest.mark.parametrize("z_loss_weight", [0.0, 0.1])
def test_declared_power_of_two_gradient_gives_the_same_bits(grad, z_loss_weight):
    """Declaring the gradient folds it into the per-row coefficient instead of scaling afterwards: at
    1 or any power of two both are exact, so the gradients are the same bits."""
    h, w, y = _inputs(torch.float32)
    ref = torch.autograd.grad(linear_cross_entropy(h, w, y, chunk_tokens=7, z_loss_weight=z_loss_weight) * grad, (h, w))
    with loss_weight(grad):
        loss = linear_cross_entropy(h, w, y, chunk_tokens=7, z_loss_weight=z_loss_weight)
    got = torch.autograd.grad(loss * grad, (h, w))
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


def test_declared_gradient_is_folded_in_and_checked():
    """Any weight: the gradients match the plain loss' in float64; the backward refuses a gradient
    other than the one declared; the declaration ends with its block."""
    h, w, y = _inputs(torch.float64)
    ref = torch.autograd.grad(_plain(h, w, y, 0.1) * 0.37, (h, w))
    with loss_weight(0.37):
        loss = linear_cross_entropy(h, w, y, chunk_tokens=5, z_loss_weight=0.1)
        wrong = linear_cross_entropy(h, w, y, chunk_tokens=5)
    assert declared_loss_weight() is None
    # The MoE aux losses' own setting shares the weight but declares nothing to the LM loss.
    from moetron.core.layers.loss import current_loss_weight
    from moetron.core.moe.aux_loss import aux_loss_scale, current_aux_loss_scale

    with loss_weight(0.5), aux_loss_scale(0.25):
        assert declared_loss_weight() is None and current_loss_weight() == current_aux_loss_scale() == 0.25
    with loss_weight(0.5):
        assert declared_loss_weight() == current_aux_loss_scale() == 0.5
    for g, r in zip(torch.autograd.grad(loss * 0.37, (h, w)), ref):
        torch.testing.assert_close(g, r, **TOL[torch.float64])
    with pytest.raises(RuntimeError, match="other than the 0.37 declared"):
        torch.autograd.grad(wrong * 0.5, (h, w))


def test_declared_gradient_becomes_the_weight_grad_without_a_copy(monkeypatch):
    """With a declared gradient the weight's .grad is the very tensor the forward computed (the
    autograd engine frees the saved one first, so the accumulator keeps it): no scaled second copy
    of the [V, D] gradient exists at any time. Undeclared, the backward's scaled copy is."""
    made = []
    chunked = L._chunked

    def spy(*args, **kwargs):
        out = chunked(*args, **kwargs)
        made.append(out[3].data_ptr())
        return out

    monkeypatch.setattr(L, "_chunked", spy)
    for declared in (True, False):
        h, w, y = _inputs(torch.float32)
        with loss_weight(1.0, declared=declared):
            linear_cross_entropy(h, w, y, chunk_tokens=7).backward()
        assert (w.grad.data_ptr() == made[-1]) == declared


def test_z_value_for_logging_and_leading_dims():
    h, w, y = _inputs(torch.float64)
    loss, z = linear_cross_entropy(h.reshape(1, T, D), w, y.reshape(1, T), z_loss_weight=0.5, chunk_tokens=8,
                                   return_z_loss=True)
    lse = torch.logsumexp(h @ w.t(), -1)[y != IGNORE]
    torch.testing.assert_close(z, lse.square().mean().detach())
    assert not z.requires_grad
    torch.testing.assert_close(loss, cross_entropy(h @ w.t(), y) + 0.5 * z)
    # Unweighted: z is still reported, the loss is plain CE.
    loss0, z0 = linear_cross_entropy(h, w, y, chunk_tokens=8, return_z_loss=True)
    torch.testing.assert_close(z0, z)
    torch.testing.assert_close(loss0, cross_entropy(h @ w.t(), y))


def test_without_grad_and_partial_grads():
    h, w, y = _inputs(torch.float64)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y, chunk_tokens=5)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _plain(h, w, y).detach())
    # Only the weight (frozen input), only the input (frozen head).
    (gw,) = torch.autograd.grad(linear_cross_entropy(h.detach(), w, y, chunk_tokens=5), (w,))
    torch.testing.assert_close(gw, torch.autograd.grad(_plain(h.detach(), w, y), (w,))[0])
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, w.detach(), y, chunk_tokens=5), (h,))
    torch.testing.assert_close(gh, torch.autograd.grad(_plain(h, w.detach(), y), (h,))[0])


def test_mean_counts_ignored_tokens_over_the_whole_call():
    # A chunk of only ignored tokens, and chunks of unequal valid counts: the mean is over all
    # valid tokens of the call, not a mean of chunk means.
    h, w, y = _inputs(torch.float64, ignore_every=0)
    y[:10] = IGNORE
    y[20:23] = IGNORE
    loss = linear_cross_entropy(h, w, y, chunk_tokens=10)
    torch.testing.assert_close(loss, _plain(h, w, y))
    # Every token ignored: NaN, as F.cross_entropy gives; the gradients are zeros.
    y_all = torch.full_like(y, IGNORE)
    loss = linear_cross_entropy(h, w, y_all, chunk_tokens=10)
    assert torch.isnan(loss) and torch.isnan(_plain(h, w, y_all))
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert not gh.any() and not gw.any()


def test_bf16_autocast_with_fp32_master_weight():
    """Under bf16 autocast both paths run the GEMMs in bf16 and the softmax in fp32: the loss
    agrees to bf16-GEMM noise, the weight gradient comes back fp32 (accumulated in fp32)."""
    g = torch.Generator().manual_seed(1)
    n, d, v = 96, 32, 200
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (0.2 * torch.randn(v, d, generator=g)).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, y, chunk_tokens=40)
        ref = cross_entropy(torch.nn.functional.linear(h, w), y)
    gh, gw = torch.autograd.grad(loss, (h, w))
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert loss.dtype == torch.float32 and gw.dtype == torch.float32 and gh.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    # The same bf16 products; the plain path rounds the whole weight gradient to bf16 once, the
    # fused one each chunk's: both within bf16 rounding of the fp32 truth.
    truth = torch.autograd.grad(_plain(h, w, y), (h, w))
    for got, want in ((gh, truth[0]), (gw, truth[1]), (rh, truth[0]), (rw, truth[1])):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op returns (what a [T, V] buffer would be)."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel, self.shape = t.numel(), tuple(t.shape)
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_never_allocates_full_logits(autocast):
    n, d, v, chunk = 256, 16, 300, 48  # one chunk of logits (48 x 300) < weight (300 x 16) < [T, V]
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    y = torch.randint(0, v, (n,))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with _MaxNumel() as seen:
        with ctx:
            loss = linear_cross_entropy(h, w, y, chunk_tokens=chunk)
        loss.backward()
    assert seen.max_numel <= max(chunk * v, v * d, n * d), seen.shape
    assert seen.max_numel < n * v
    # The check can fail: the plain loss makes [T, V] tensors.
    with _MaxNumel() as plain:
        with ctx:
            ref = cross_entropy(torch.nn.functional.linear(h, w), y)
        ref.backward()
    assert plain.max_numel == n * v


def test_bad_inputs_name_the_fix():
    h, w, y = _inputs(torch.float32)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="chunk_tokens must be a positive int"):
            linear_cross_entropy(h, w, y, chunk_tokens=bad)
    with pytest.raises(ValueError, match="labels .* must be h's leading shape"):
        linear_cross_entropy(h, w, y[:-1])
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, w[:, :-1], y)
    with pytest.raises(ConfigError, match="model.loss_chunk_tokens must be positive"):
        ModelConfig(loss_chunk_tokens=0).validate()


def test_default_chunk_by_bytes():
    assert default_chunk_tokens(100352) == 5120  # ~1 GiB of bf16 logits (the Triton path)
    assert default_chunk_tokens(100352, logit_bytes(torch.bfloat16, triton=False)) == 1536  # + their fp32 copy
    assert logit_bytes(torch.float32, triton=False) == 4 and logit_bytes(torch.float16, triton=True) == 2
    assert default_chunk_tokens(4096) == 131072
    assert default_chunk_tokens(10**9) == 256  # at least 256 tokens


def test_chunks_are_balanced_and_cover_every_token():
    assert chunk_bounds(16384, 5120) == [(0, 4096), (4096, 8192), (8192, 12288), (12288, 16384)]
    assert chunk_bounds(16384, 16384) == [(0, 16384)]
    assert chunk_bounds(100, 60) == [(0, 60), (60, 100)]  # the aligned size capped at chunk_tokens
    assert chunk_bounds(0, 8) == []
    for tokens in (1, 7, 127, 128, 129, 1000, 16384, 16385):
        for chunk in (1, 5, 128, 300, 2560, 5120):
            bounds = chunk_bounds(tokens, chunk)
            assert bounds[0][0] == 0 and bounds[-1][1] == tokens
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert all(0 < end - start <= chunk for start, end in bounds)
            assert len(bounds) == -(-tokens // chunk)  # the fewest chunks


def test_lm_head_keeps_the_linear_name_and_logits():
    head = LMHead(D, V, chunk_tokens=8)
    assert list(dict(head.named_parameters())) == ["weight"] and head.gemm is DEFAULT_GEMM
    h, _, y = _inputs(torch.float32)
    h = h.detach()
    torch.testing.assert_close(head(h), h @ head.weight.t())
    plain = LMHead(D, V, fused=False)
    plain.load_state_dict(head.state_dict())
    torch.testing.assert_close(head(h, y), plain(h, y))
    torch.testing.assert_close(plain(h, y), cross_entropy(h @ head.weight.t(), y))


# ---- whole tiny models through the trainer, fused on and off ------------------------------------

def _tiny(moe: bool, **kw) -> ModelConfig:
    return ModelConfig(
        d_model=32, n_layers=2, vocab_size=96, mlp_hidden=64, sliding_window=8,
        attention=AttentionConfig(n_heads=2, n_kv_heads=1, rope_theta=10_000.0),
        moe=MoEConfig(num_experts=4, expert_hidden=16, dense_layers=[0], router=RouterConfig(top_k=2)) if moe else None,
        **kw,
    )


class _Data:
    def __init__(self, vocab):
        self.gen = torch.Generator().manual_seed(5)
        self.vocab = vocab
        self.local_batch_size = 4

    def next_batch(self):
        return torch.randint(0, self.vocab, (4, 17), generator=self.gen)

    def val_batches(self, batch_size, max_batches):
        g = torch.Generator().manual_seed(9)
        return [torch.randint(0, self.vocab, (batch_size, 17), generator=g) for _ in range(max_batches)]

    def state_dict(self):
        return {}


def _trainer(cfg: ModelConfig, loss_fn, precision=None):
    torch.manual_seed(0)
    model = cfg.build()
    # eps well above the tiny model's smallest gradients: Adam's step is then smooth in the gradient,
    # so the fp32 rounding differences between the losses stay that small after a step (with the
    # default 1e-8 a near-zero gradient's sign decides a whole lr-sized update, and whether that
    # happens hangs on the initial weights: torch 2.11 and 2.13 draw them differently).
    optimizer = OptimizerConfig(lr=1e-2, eps=1e-3).build(model)
    scheduler = SchedulerConfig(warmup_steps=0).build(optimizer, 10)
    grads = []
    tcfg = TrainerConfig(steps=10, micro_batch_size=2, run_dir="", eval_batches=2, grad_clip=0.0)
    trainer = Trainer(tcfg, model, loss_fn, optimizer, scheduler, _Data(cfg.vocab_size), 1.0, torch.device("cpu"),
                      precision=precision,
                      pre_step_hook=lambda parts: grads.append({n: p.grad.clone() for n, p in parts[0].named_parameters()}))
    return trainer, grads


@pytest.mark.parametrize("moe", [False, True])
def test_train_step_fused_on_and_off(moe):
    """Two optimizer steps (2 micro-batches each): the model's own loss, fused (default) and plain,
    and the old loss_fn over logits give the same losses, gradients and parameters in fp32."""
    runs = {
        "fused": _trainer(_tiny(moe, loss_chunk_tokens=5), None),
        "plain": _trainer(_tiny(moe, fused_loss=False), None),
        "loss_fn": _trainer(_tiny(moe), cross_entropy_loss),
    }
    assert runs["fused"][0].model.lm_head.fused and not runs["plain"][0].model.lm_head.fused
    out = {}
    for name, (trainer, grads) in runs.items():
        losses = [trainer.train_step(trainer.data.next_batch())[0] for _ in range(2)]
        out[name] = (torch.stack(losses), grads, dict(trainer.model.named_parameters()), trainer.evaluate())
    ref_losses, ref_grads, ref_params, ref_eval = out["plain"]
    for name in ("fused", "loss_fn"):
        losses, grads, params, eval_loss = out[name]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        assert eval_loss == pytest.approx(ref_eval, rel=1e-5)
        for step in range(2):
            for k, g in grads[step].items():
                torch.testing.assert_close(g, ref_grads[step][k], rtol=1e-4, atol=1e-6,
                                           msg=lambda m, k=k: f"{name} step {step} grad {k}: {m}")
        for k, p in params.items():
            torch.testing.assert_close(p, ref_params[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("micro_batch_size", [4, 2])
def test_train_step_prescaled_loss_grads_on_and_off(micro_batch_size):
    """model.fused_loss_prescale: one micro-batch (weight 1) or two (weight 1/2, a power of two)
    give the same bits on and off, gradients and parameters over two steps, the MoE model in bf16."""
    precision = PrecisionPolicy("cpu", torch.bfloat16, DEFAULT_GEMM)
    out = {}
    for on in (True, False):
        trainer, grads = _trainer(_tiny(True, loss_chunk_tokens=16, fused_loss_prescale=on), None, precision)
        trainer.cfg.micro_batch_size = micro_batch_size
        losses = [trainer.train_step(trainer.data.next_batch())[0] for _ in range(2)]
        out[on] = (torch.stack(losses), grads, {k: p.detach().clone() for k, p in trainer.model.named_parameters()})
    assert torch.equal(out[True][0], out[False][0])
    for step in range(2):
        for k, g in out[False][1][step].items():
            assert torch.equal(out[True][1][step][k], g), (step, k)
    for k, p in out[False][2].items():
        assert torch.equal(out[True][2][k], p), k


def test_train_step_bf16_autocast_fused_on_and_off():
    """bf16 autocast on the CPU (fp32 master weights): the fused and plain steps agree to bf16 noise."""
    precision = PrecisionPolicy("cpu", torch.bfloat16, DEFAULT_GEMM)
    fused, fused_grads = _trainer(_tiny(False, loss_chunk_tokens=16), None, precision)
    plain, plain_grads = _trainer(_tiny(False, fused_loss=False), None, precision)
    batch = fused.data.next_batch()
    loss_f, _ = fused.train_step(batch)
    loss_p, _ = plain.train_step(batch)
    torch.testing.assert_close(loss_f, loss_p, rtol=2e-3, atol=2e-3)
    for k, g in plain_grads[0].items():
        torch.testing.assert_close(fused_grads[0][k], g, rtol=5e-2, atol=5e-2 * g.abs().max().item(),
                                   msg=lambda m, k=k: f"grad {k}: {m}")


def test_forward_without_labels_gives_logits_either_way():
    fused = _tiny(False).build()
    plain = _tiny(False, fused_loss=False).build()
    plain.load_state_dict(copy.deepcopy(fused.state_dict()))
    ids = torch.randint(0, 96, (2, 9))
    torch.testing.assert_close(fused(ids), plain(ids))
    assert fused(ids).shape == (2, 9, 96)
    torch.testing.assert_close(fused(ids[:, :-1], ids[:, 1:]), cross_entropy_loss(plain(ids[:, :-1]), ids[:, 1:]))


def test_mm_into_overwrites_then_adds():
    """grad_W's first chunk is written into an uninitialised buffer (NaN here) and later chunks add
    to it, in the operands' dtype or a wider one (the CPU's fallback for an fp32 epilogue)."""
    from moetron.core.layers.loss import _mm_into

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        a, b, c = (torch.randn(n, m, generator=g).to(dtype) for n, m in ((6, 5), (5, 4), (6, 5)))
        for out_dtype in {dtype, torch.float32}:
            out = torch.full((6, 4), float("nan"), dtype=out_dtype)
            _mm_into(out, a, b)
            torch.testing.assert_close(out, (a @ b).to(out_dtype))
            _mm_into(out, c, b, accumulate=True)
            torch.testing.assert_close(out, (a @ b).to(out_dtype) + (c @ b).to(out_dtype),
                                       **({"rtol": 2e-2, "atol": 2e-2} if out_dtype != torch.float32 else {}))
