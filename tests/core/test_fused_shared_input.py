"""precision.fused_shared_input: the linears that read one input (attention's q / k / v, a dense
SwiGLU's gate / up) as one GEMM on their weights concatenated (core.precision.gemm.TorchGemm.linears).

Oracle: the same linears run one by one (F.linear each; autograd summing the input's gradients):
in float64 the outputs and every gradient agree to rounding; a bf16 training run with and without
the switch gives the same losses to bf16 rounding, eager and compiled, with and without the
optimizer's dense weight copies. Also the refusal off the bf16 recipe.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetron.core.config import ConfigError
from moetron.core.layers.linear import Linear


def test_fused_linears_match_separate_gemms_in_float64():
    """Outputs, the input's gradient and each weight's gradient against one F.linear per weight
    (GQA-like widths: q wider than k and v); leading dims kept."""
    from moetron.core.precision.gemm import TorchGemm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(o, 16, generator=g, dtype=torch.float64, requires_grad=True) for o in (16, 8, 8)]
    dys = [torch.randn(2, 5, o, generator=g, dtype=torch.float64) for o in (16, 8, 8)]
    fused = TorchGemm(fused_shared_input=True).linears(x, tuple(ws))
    assert [tuple(y.shape) for y in fused] == [(2, 5, 16), (2, 5, 8), (2, 5, 8)]
    grads = torch.autograd.grad(sum((y * dy).sum() for y, dy in zip(fused, dys)), [x, *ws])
    ref = [F.linear(x, w) for w in ws]
    ref_grads = torch.autograd.grad(sum((y * dy).sum() for y, dy in zip(ref, dys)), [x, *ws])
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    off = TorchGemm().linears(x, tuple(ws))  # the switch off: a linear each, the same values
    assert all(torch.equal(a, b) for a, b in zip(off, ref))


def _losses(fused: bool, dense: bool = False, compile: bool = False, steps: int = 3):
    from step_builder import RandomTokens, build_trainer  # tools/ (tests/conftest.py puts it on the path)

    from moetron.core.memory import MemoryConfig
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.models import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
    data = RandomTokens(cfg.vocab_size, 2, 32, torch.device("cpu"))
    trainer = build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32, compile=compile,
                            precision=PrecisionConfig(recipe="bf16", dense_weight_copies=dense,
                                                      fused_shared_input=fused),
                            optimizer=OptimizerConfig(state_dtype="bf16", impl="torch"))
    linears = [m for m in trainer.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.gemm.fused_shared_input == fused for m in linears)
    batch = data.next_batch()  # one batch, so the loss falls
    losses = [trainer.train_step(batch)[0].item() for _ in range(steps)]
    return losses, trainer


@pytest.mark.parametrize("dense", [False, True], ids=["autocast", "dense_copies"])
def test_fused_training_matches_separate_gemms(dense):
    """Three bf16 steps of a tiny MoE (a dense first layer, attention with QK-norm, a shared expert)
    with the switch and without: the same losses to bf16 rounding (each output is the same dot
    product; the wider GEMM may sum it in another order), and the loss falls. With the dense weight
    copies every copy still receives its own gradient (cat's backward)."""
    ref, _ = _losses(False, dense)
    got, trainer = _losses(True, dense)
    assert ref[-1] < ref[0]
    assert got[0] == pytest.approx(ref[0], rel=1e-6)  # the first forward: the same weights (bit-equal here)
    assert got == pytest.approx(ref, rel=2e-3)
    if dense:
        trainer.model.zero_grad(set_to_none=True)
        linears = [m for m in trainer.model.modules() if isinstance(m, Linear) and m.weight_copy is not None]
        for m in linears:
            m.weight_copy.grad = None
        batch = torch.randint(0, trainer.model.cfg.vocab_size, (2, 33))
        with trainer.precision.autocast():
            trainer.model(batch[:, :-1], batch[:, 1:]).backward()
        assert linears and all(m.weight_copy.grad is not None and m.weight_copy.grad.shape == m.weight.shape
                               for m in linears)


def test_fused_training_compiled_matches_eager():
    """Under torch.compile (inductor on the CPU) the split outputs (views of one GEMM's output) flow
    into QK-norm, RoPE and SDPA: two steps give the losses of the eager run without the switch (a
    linear each) to bf16 rounding."""
    eager, _ = _losses(False, steps=2)
    compiled, _ = _losses(True, compile=True, steps=2)
    assert compiled == pytest.approx(eager, rel=2e-3)


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8"])
def test_fused_shared_input_refused_off_bf16(recipe):
    from moetron.core.precision import PrecisionConfig

    with pytest.raises(ConfigError, match="fused_shared_input.*bf16"):
        PrecisionConfig(recipe=recipe, backend="emulated", fused_shared_input=True).validate()
