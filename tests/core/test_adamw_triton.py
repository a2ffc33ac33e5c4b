"""The Triton AdamW kernel (core/adamw_triton.py) and PrecisionAwareAdamW(kernel='triton').

Under TRITON_INTERPRET=1 on the CPU (a subprocess: the variable must be set before triton is
imported) and on the GPU:
- the kernel is its documented formula bit for bit: a torch reference in the same order (each fma
  emulated in float64, exact but for a double rounding that these data never hit; division and
  sqrt correctly rounded through float64), fp32 and bf16
  moments, fp32 and bf16 gradients, weight decay on and off, both forms of lerp, sizes that are not
  multiples of BLOCK, several steps, the bf16 weight copy;
- through the optimizer, against its foreach path (torch.optim.AdamW bit for bit,
  tests/core/test_optim_state.py), 10 steps, two decay groups, a parameter that skips steps, a
  non-contiguous one (which takes the foreach path). Tolerances, from where the two differ: torch's
  CPU addcmul and addcdiv round in another order (fma(s*g, g, v), p + (s*m)/d), so
  fp32 state: exp_avg bit-equal on the CPU (the same lerp), exp_avg_sq within 2^-20 of the
  tensor's largest entry (measured 1.3e-7), p within 1 ulp of p plus 1e-5 * lr * steps
  (measured 9.5e-7 * lr * steps);
  bf16 state: the few fp32 ulps move an exp_avg_sq across a bf16 rounding boundary now and then
  (then 1 bf16 ulp, 2^-8, apart), so moments within 2^-7 of the tensor's largest entry with at most
  2% of entries differing, p within 2^-8 * lr * steps (measured 7e-4 * lr * steps).
On the GPU also against torch.optim.AdamW(fused=True) and (foreach=True), fp32 state, with the same
tolerances and exp_avg among the toleranced (fused computes the moments and the decay in double and
rounds once: its p may drift an ulp per step, so p within `steps` ulps there), and without a host
sync.
"""

import os

import pytest
import torch
from torch import nn

from moetron.core.adamw import PrecisionAwareAdamW
from moetron.core.config import ConfigError
from moetron.core.optim import OptimizerConfig
from tests.interpreted import run_interpreted

SIZES = [1, 1000, 3 * 1024 + 7]  # below, around and past whole BLOCKs


def _f32(x: float, device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=device)


def _fma(a, b, c):
    """fp32 fma: the product is exact in float64, the sum rounds once to float64, then to fp32."""
    return (a.double() * b.double() + c.double()).float()


def _div(a, b):
    """fp32 a / b rounded once (in float64 and back: exact, 53 >= 2 * 24 + 2; CUDA divides by a
    scalar through its reciprocal)."""
    return (a.double() / b.double()).float()


def _sqrt(a):
    """fp32 sqrt rounded once, as _div (torch's CPU sqrt goes through MKL, not correctly rounded)."""
    return a.double().sqrt().float()


def reference_step(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    """core.adamw_triton's formula in torch ops, in place."""
    dev = p.device
    g = g.float()
    m32, v32 = m.float(), v.float()
    p.mul_(_f32(1 - lr * weight_decay, dev))
    weight = _f32(1 - beta1, dev)
    if weight.abs() < 0.5:
        m32 = _fma(weight.expand_as(g), g - m32, m32)
    else:
        m32 = _fma(-(g - m32), (1 - weight).expand_as(g), g)
    v32 = _fma(_f32(1 - beta2, dev).expand_as(g), g * g, v32 * _f32(beta2, dev))
    bc2_sqrt = torch.full_like(v32, (1 - beta2**step) ** 0.5)
    denom = _div(_sqrt(v32), bc2_sqrt) + _f32(eps, dev)
    step_size = _f32((lr / (1 - beta1**step)) * -1, dev).expand_as(g)
    p.copy_(_fma(step_size, _div(m32, denom), p))
    m.copy_(m32)
    v.copy_(v32)


def check_formula(device: str) -> None:
    from moetron.core.adamw_triton import adamw_update_

    cases = [(sd, gd, wd, b1) for sd in (torch.float32, torch.bfloat16) for gd in (torch.float32, torch.bfloat16)
             for wd in (0.0, 0.1) for b1 in (0.9,)] + [(torch.bfloat16, torch.float32, 0.1, 0.3)]  # lerp's other form
    for state_dtype, grad_dtype, wd, beta1 in cases:
        hyper = dict(lr=1e-2, beta1=beta1, beta2=0.95, eps=1e-8, weight_decay=wd)
        gen = torch.Generator().manual_seed(0)
        for n in SIZES:
            p = torch.randn(n, generator=gen).to(device)
            mine = [p.clone(), *(torch.zeros(n, dtype=state_dtype, device=device) for _ in range(2))]
            ref = [t.clone() for t in mine]
            copy = torch.empty(n, dtype=torch.bfloat16, device=device)
            for step in range(1, 6):
                scale = 10.0 ** (step - 4)  # gradients from 1e-3 to 10
                g = (torch.randn(n, generator=gen) * scale).to(device, grad_dtype)
                adamw_update_(*mine[:1], g, *mine[1:], step=step, out_bf16=copy, **hyper)
                reference_step(*ref[:1], g, *ref[1:], step=step, **hyper)
                what = f"{state_dtype} moments, {grad_dtype} grad, wd {wd}, beta1 {beta1}, n {n}, step {step}"
                for name, got, want in zip(("p", "exp_avg", "exp_avg_sq"), mine, ref):
                    assert got.dtype == want.dtype and torch.equal(got, want), f"{name}: {what}"
                assert torch.equal(copy, mine[0].to(torch.bfloat16)), f"bf16 copy: {what}"


def mx_qdq_reference(w: torch.Tensor, axis: int, scale_mode: str) -> torch.Tensor:
    """w quantized to MX along ``axis`` and dequantized to bf16 by the torch reference (core.precision.mx)."""
    from moetron.core.precision.mx import dequantize_mx, quantize_mx

    data, scale = quantize_mx(w, 32, axis, scale_mode)
    return dequantize_mx(data, scale, 32, axis).to(torch.bfloat16)


def check_mx_pair(device: str) -> None:
    """adamw_update_mx_pair_: p and the moments bit for bit adamw_update_'s; its two outputs the torch
    reference's MX quantize-dequantize of bf16(p) along I and along O. Shapes with a partial column
    tile and several experts; gradients from 1e-3 to 10 and a weight of wide range (2^-40 .. 2^20,
    exact zeros in a whole block), both scale modes, fp32 and bf16 moments and gradients, a clip scale;
    the tiles handed out in both orders (mx_triton.GRID_COLS_FIRST), several tiles along each axis."""
    from moetron.core.adamw_triton import adamw_update_, adamw_update_mx_pair_
    from moetron.core.precision import mx_triton

    gen = torch.Generator().manual_seed(0)
    saved = mx_triton.GRID_COLS_FIRST
    try:
        for cols_first in (False, True):
            mx_triton.GRID_COLS_FIRST = cols_first
            _check_mx_pair_cases(device, gen, adamw_update_, adamw_update_mx_pair_, f"cols_first={cols_first}")
    finally:
        mx_triton.GRID_COLS_FIRST = saved
    with pytest.raises(ValueError, match="multiples of 32"):
        p = torch.zeros(48, 64, device=device)
        adamw_update_mx_pair_(p, p, p, p, rows=p.bfloat16(), cols=p.bfloat16(), scale_mode="rceil", step=1, lr=1e-3,
                              beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


def _check_mx_pair_cases(device, gen, adamw_update_, adamw_update_mx_pair_, order: str) -> None:
    for shape, state_dtype, grad_dtype, mode in (((3, 64, 96), torch.bfloat16, torch.bfloat16, "rceil"),
                                                 ((96, 256), torch.float32, torch.float32, "floor"),
                                                 ((2, 32, 160), torch.bfloat16, torch.float32, "floor")):
        hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        p = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-40, 20, shape, generator=gen).float())
        p.view(-1, shape[-1])[:32, :32] = 0.0  # a zero block both ways
        mine = [p.to(device), *(torch.zeros(shape, dtype=state_dtype, device=device) for _ in range(2))]
        ref = [t.clone() for t in mine]
        rows = torch.empty(shape, dtype=torch.bfloat16, device=device)
        cols = torch.empty_like(rows)
        for step in range(1, 4):
            g = (torch.randn(shape, generator=gen) * 10.0 ** (step - 3)).to(device, grad_dtype)
            scale = torch.tensor(0.5 if step == 2 else 1.0, device=device)
            adamw_update_mx_pair_(mine[0], g, *mine[1:], rows=rows, cols=cols, scale_mode=mode, step=step,
                                  grad_scale=scale, **hyper)
            adamw_update_(ref[0], g, *ref[1:], step=step, grad_scale=scale, **hyper)
            what = f"{shape} {state_dtype} moments, {grad_dtype} grad, {mode}, step {step}, {order}"
            for name, got, want in zip(("p", "exp_avg", "exp_avg_sq"), mine, ref):
                assert torch.equal(got, want), f"{name}: {what}"
            w = mine[0].cpu().to(torch.bfloat16)
            assert torch.equal(rows.cpu().view(torch.int16), mx_qdq_reference(w, -1, mode).view(torch.int16)), what
            assert torch.equal(cols.cpu().view(torch.int16), mx_qdq_reference(w, -2, mode).view(torch.int16)), what


def check_optimizer_mx_pairs(device: str) -> None:
    """PrecisionAwareAdamW(kernel='triton') with mx_cols against the same optimizer with plain copies:
    the same parameters bit for bit, and its copies the reference's MX quantize-dequantize of the
    plain copies along I and O (a clip scale deferred into the step, two steps)."""
    gen = torch.Generator().manual_seed(3)
    shape = (2, 64, 96)
    runs = []
    for mx in (False, True):
        p = nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(device))
        copy, cols = torch.empty_like(p, dtype=torch.bfloat16), torch.empty_like(p, dtype=torch.bfloat16)
        opt = PrecisionAwareAdamW([p], lr=1e-2, kernel="triton", state_dtype=torch.bfloat16)
        opt.add_compute_copies({p: copy}, mx_cols={p: cols} if mx else None, mx_scale_mode="floor")
        runs.append((p, copy, cols, opt))
    for step in range(2):
        g = torch.randn(shape, generator=gen).to(device)
        for p, _, _, opt in runs:
            p.grad = g.clone()
            opt.defer_grad_scale(torch.tensor(0.5, device=device))
            opt.step()
    (p0, plain, _, _), (p1, rows, cols, _) = runs
    assert torch.equal(p0, p1)
    assert torch.equal(rows.cpu(), mx_qdq_reference(plain.cpu(), -1, "floor"))
    assert torch.equal(cols.cpu(), mx_qdq_reference(plain.cpu(), -2, "floor"))


SHAPES = [(3001,), (7, 5), (1024,), (2, 1500), (5, 7)]


def _params(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES[:-1]]
    return ps + [nn.Parameter(torch.randn(7, 5, generator=gen).to(device).t())]  # not contiguous


def _groups(ps):
    return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]


def _drive(pairs, steps, device, seed=1):
    """Step every optimizer with the same gradients (scales 1e-3 to 10; one parameter skips every
    third step)."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=gen) * 10.0 ** ((step + i) % 5 - 3)
                 for i, p in enumerate(pairs[0][1])]
        for opt, ps in pairs:
            for i, (p, g) in enumerate(zip(ps, grads)):
                p.grad = None if (i == 2 and step % 3 == 2) else g.to(device).as_strided(p.shape, p.stride()).clone()
            opt.step()


def assert_close_to(opt, ps, ref_state, ref_ps, state_dtype, lr, steps, exact_exp_avg, what, p_ulps=1):
    for i, (p, q) in enumerate(zip(ps, ref_ps)):
        tag = f"{what}, param {i} {tuple(p.shape)}"
        if state_dtype == torch.float32:
            assert ((p - q).abs() <= p_ulps * 2**-23 * q.abs() + 1e-5 * lr * steps).all(), tag
        else:
            assert ((p - q).abs() <= 2**-8 * lr * steps).all(), tag
        for key in ("exp_avg", "exp_avg_sq"):
            got, want = opt.state[p][key], ref_state[q][key]
            # the step counts compared on the CPU: ours live there, torch's fused AdamW keeps them on the GPU
            assert got.dtype == state_dtype and torch.equal(opt.state[p]["step"].cpu(), ref_state[q]["step"].cpu()), tag
            if key == "exp_avg" and exact_exp_avg:
                assert torch.equal(got, want.to(state_dtype)), f"{key}: {tag}"
                continue
            got, want = got.float(), want.float()
            scale = want.abs().max()
            if state_dtype == torch.float32:
                assert ((got - want).abs() <= 2**-20 * scale).all(), f"{key}: {tag}"
            else:
                assert ((got - want).abs() <= 2**-7 * scale).all(), f"{key}: {tag}"
                assert (got != want).float().mean() <= 0.02, f"{key}: {tag}"


def check_optimizer(device: str) -> None:
    lr, steps = 1e-2, 10
    for state_dtype in (torch.float32, torch.bfloat16):
        mine, ref = _params(device), _params(device)
        copies = {p: torch.empty_like(p, dtype=torch.bfloat16) for p in mine[::2]}  # incl. the strided one
        kw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, state_dtype=state_dtype)
        opt = PrecisionAwareAdamW(_groups(mine), kernel="triton", compute_copies=copies, **kw)
        ref_opt = PrecisionAwareAdamW(_groups(ref), kernel="foreach", **kw)
        _drive([(opt, mine), (ref_opt, ref)], steps, device)
        assert_close_to(opt, mine, ref_opt.state, ref, state_dtype, lr, steps, device == "cpu",
                        f"{state_dtype} vs foreach")
        assert torch.equal(mine[-1], ref[-1])  # the non-contiguous parameter took the foreach path
        assert all(torch.equal(c, p.to(torch.bfloat16)) for p, c in copies.items())


def check_interpreted() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_formula("cpu")
    check_mx_pair("cpu")
    check_optimizer_mx_pairs("cpu")
    check_optimizer("cpu")
    cfg = OptimizerConfig(impl="triton", state_dtype="bf16")
    assert PrecisionAwareAdamW is type(cfg.build(nn.Linear(4, 4)))


def test_triton_adamw_interpreted():
    run_interpreted("tests.core.test_adamw_triton", "check_interpreted()")


def test_impl_choices_and_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = nn.Linear(4, 4)
    assert type(OptimizerConfig().build(model)) is torch.optim.AdamW
    assert type(OptimizerConfig(impl="torch").build(model)) is torch.optim.AdamW
    for impl, kernel in (("auto", "auto"), ("torch", "foreach")):
        opt = OptimizerConfig(impl=impl, state_dtype="bf16").build(model)
        assert isinstance(opt, PrecisionAwareAdamW) and opt.kernel == kernel
    with pytest.raises(ConfigError, match="optimizer.impl=triton: .*TRITON_INTERPRET=1"):
        OptimizerConfig(impl="triton").build(model)
    with pytest.raises(ConfigError, match="with optimizer.impl=triton leave optimizer.fused unset"):
        OptimizerConfig(impl="triton", fused=True).build(model)
    with pytest.raises(ConfigError, match=r"fp32 master weights, but some are \['torch.float64'\]"):
        OptimizerConfig(impl="triton").build(nn.Linear(4, 4).double())
    with pytest.raises(ConfigError, match="impl"):
        OptimizerConfig().apply_overrides(["impl=cuda"])
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="kernel='triton'.*TRITON_INTERPRET=1"):
        PrecisionAwareAdamW([p], kernel="triton").step()
    with pytest.raises(ValueError, match="compute copy must be bf16"):
        PrecisionAwareAdamW([p], compute_copies={p: torch.empty(3)})


@pytest.mark.gpu
def test_triton_adamw_on_gpu():
    check_formula("cuda")
    check_mx_pair("cuda")
    check_optimizer_mx_pairs("cuda")
    check_optimizer("cuda")
    lr, steps = 1e-2, 10
    for fused in (True, False):  # torch's fused kernel, and its foreach one
        mine, ref = _params("cuda"), _params("cuda")
        opt = PrecisionAwareAdamW(_groups(mine), lr=lr, betas=(0.9, 0.95), state_dtype=torch.float32,
                                  kernel="triton")
        kw = dict(fused=True) if fused else dict(foreach=True)
        ref_opt = torch.optim.AdamW(_groups(ref), lr=lr, betas=(0.9, 0.95), **kw)
        _drive([(opt, mine), (ref_opt, ref)], steps, "cuda")
        # fused decays in double (p - lr * wd * p), foreach by the fp32 factor 1 - lr * wd: an ulp of
        # p apart per step
        assert_close_to(opt, mine, ref_opt.state, ref, torch.float32, lr, steps, False,
                        "fp32 vs torch " + ("fused" if fused else "foreach"), p_ulps=steps if fused else 1)
    # the step has no host sync (the step counts live on the CPU)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
