"""core/grad_norm_triton.py (optimizer.triton_grad_norm): the clipping norm's squared sums in Triton,
interpreted on the CPU, against float64 and core/grad.py's foreach path."""

import math

import pytest
import torch

from tests.interpreted import run_interpreted


def _grads(device: str) -> list[torch.Tensor]:
    """Gradients of several sizes: more than one program (64 Ki elements a program), a partial last
    program, one element, an empty one, a bf16 one; values spread over six decades."""
    g = torch.Generator().manual_seed(0)
    sizes = (2 * 65536 + 17, 4096, 1, 0, 70_000)
    out = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g) for n in sizes]
    out[-1] = out[-1].bfloat16()
    return [t.to(device) for t in out]


def check(device: str) -> None:
    from moetron.core import grad_norm_triton as gn
    from moetron.core.grad import _sum_of_squares, clip_grad_norm_

    grads = _grads(device)
    assert gn.supported(grads)
    total = gn.sum_of_squares_(grads)
    want = sum(t.double().square().sum() for t in grads).item()
    assert total.dtype == torch.float32 and total.dim() == 0
    assert abs(total.item() - want) <= 1e-6 * want, (total.item(), want)
    assert torch.equal(gn.sum_of_squares_(grads), total)  # deterministic
    # the same values held in fp32 instead of bf16: the same bits (the same squares, programs, order)
    widened = [t.float() for t in grads]
    assert torch.equal(gn.sum_of_squares_(widened), total)
    # core/grad.py's switch: this path where it takes the tensors, torch's foreach elsewhere
    assert torch.equal(_sum_of_squares(grads, triton=True), total)
    assert not gn.supported([grads[0], grads[1].t() if grads[1].dim() > 1 else grads[1][::2]])  # not contiguous
    # torch's foreach path (per-tensor fp32 norms; the CPU's sums them sequentially: 7e-6 off here)
    foreach = _sum_of_squares(grads)
    assert abs(foreach.item() - want) <= 1e-4 * want
    # clipping: the gradients scaled by max_norm / (norm + 1e-6) from the float64 norm, to their rounding
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(params, grads):
        p.grad = t.clone()
    norm = clip_grad_norm_(params, 1.0, triton=True)
    assert math.isclose(norm.item(), math.sqrt(want), rel_tol=1e-6)
    coef = 1.0 / (math.sqrt(want) + 1e-6)
    for p, t in zip(params, grads):
        rtol = 2 ** -8 if t.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(p.grad.double(), t.double() * coef, rtol=rtol, atol=0)


def test_interpreted_matches_float64_and_the_foreach_path():
    run_interpreted("tests.core.test_grad_norm_triton", "check('cpu')")


def test_cpu_without_the_interpreter_takes_the_foreach_path():
    from moetron.core import grad_norm_triton as gn
    from moetron.core.grad import _sum_of_squares

    grads = _grads("cpu")
    if gn.supported(grads):  # TRITON_INTERPRET=1 in this process
        pytest.skip("the interpreter is on here: the Triton path runs (test_interpreted_...)")
    assert torch.equal(_sum_of_squares(grads, triton=True), _sum_of_squares(grads))


def test_the_switch_reaches_the_trainer():
    """optimizer.triton_grad_norm reaches the Trainer through tools/step_builder.py (bench_train,
    profile_step) and run/build.py (pretrain), the two places that build one; on this CPU (no
    interpreter) its step takes torch's path: the same norm as without the switch."""
    import inspect

    from step_builder import RandomTokens, build_trainer

    from moetron.core.memory import MemoryConfig
    from moetron.core.optim import OptimizerConfig
    from moetron.models import ModelConfig
    from moetron.run import build

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=1"])
    norms = []
    for on in (False, True):
        data = RandomTokens(cfg.vocab_size, 2, 16, torch.device("cpu"))
        trainer = build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=16,
                                optimizer=OptimizerConfig(triton_grad_norm=on))
        assert trainer.triton_grad_norm is on
        norms.append(trainer.train_step(data.next_batch())[1])
    assert torch.equal(*norms)
    assert "triton_grad_norm=cfg.optimizer.triton_grad_norm" in inspect.getsource(build)


@pytest.mark.parametrize("dtype", ["*fp32", "*bf16"])
def test_kernel_compiles_for_sm90_with_16_byte_loads(dtype):
    """On Hopper each thread reads its gradients in 16-byte loads (4 a step for fp32, 2 for bf16: 16
    elements), every step's loads issued up front (the steps unrolled), without spills."""
    import triton

    from moetron.core import grad_norm_triton as gn
    from tests.core.test_precision_fp8 import _compile_sm90, assert_no_spills

    compiled = _compile_sm90(gn._sum_of_squares_kernel, triton.Config({}, num_warps=8, num_stages=1),
                             dict(x_ptr=dtype, out_ptr="*fp32", N=1 << 20), dict(BLOCK=gn.BLOCK, ITERS=gn.ITERS))
    ptx = compiled.asm["ptx"]
    per_step = gn.BLOCK // (8 * 32) * (4 if dtype == "*fp32" else 2) // 16  # 16-byte loads a thread a step
    assert ptx.count("ld.global.v4") == per_step * gn.ITERS == ptx.count("ld.global"), ptx.count("ld.global.v4")
    assert_no_spills(compiled, dtype)


@pytest.mark.gpu
def test_gpu_matches_float64_and_the_foreach_path():
    check("cuda")
