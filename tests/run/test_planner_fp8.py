"""The planner's fp8_blockwise memory terms (run/planner/memory.py) against what the native code holds:
its weight cache, its saved wgrad operands and its grouped wgrad's output, counted on the CPU (the
Triton kernels under TRITON_INTERPRET=1), and the moe-1t slice figures they give against the measured ones (H200 bf16, H100 fp8)."""

import pytest

from moetron.core.memory import MemoryConfig
from moetron.core.optim import OptimizerConfig
from moetron.core.precision import PrecisionConfig
from moetron.core.precision.grouping import padded_rows
from moetron.models import ModelConfig
from moetron.parallel.config import ParallelConfig
from moetron.run.planner.hardware import FP8_SAVED, GPUS, GiB
from moetron.run.planner.model import gate_up_wgrad_transient, plan_slice, slice_layers, switches
from tests.interpreted import run_interpreted


def _fp8_switches(cfg: ModelConfig, compiled: bool):
    return switches(cfg, ParallelConfig(), PrecisionConfig(recipe="fp8_blockwise"), OptimizerConfig(), GPUS["h200"],
                    compiled)


def check_fp8_expert_bytes() -> None:
    """One gate|up-shaped grouped GEMM (E experts [2F, D], ragged rows) forward and backward on the
    CPU: its saved wgrad operand (of P padded rows), the tensors of the weight's shape its wgrad makes and what its weight cache keeps after the step, per element,
    equal the planner's terms (a mismatch names the term)."""
    import gc
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import moetron.core.precision.fp8_triton  # noqa: F401  (registers the pipelined kernels' custom ops)
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    aten = torch.ops.aten
    wgrad_op = torch.ops.moetron.fp8_pipelined_k.default  # allocates the wgrad's output (bf16 weights: bf16)
    ALLOCATING = (aten.empty.memory_format, aten.empty_strided.default, aten._to_copy.default, aten.clone.default,
                  wgrad_op)

    class Made(TorchDispatchMode):
        """Every tensor an op makes while active: (shape, dtype, bytes of its storage if the op
        allocates one, a weak reference)."""

        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    nbytes = t.untyped_storage().nbytes() if func in ALLOCATING else 0
                    self.made.append((func, tuple(t.shape), t.dtype, nbytes, weakref.ref(t)))
            return out

        def bytes(self, shape, dtype, func) -> int:
            return sum(n for f, s, d, n, _ in self.made if s == tuple(shape) and d == dtype and f == func)

    cfg = ModelConfig.preset("moe-1t")
    E, D, F, R = 2, 128, 128, 384
    P = padded_rows(R, E, 128)  # the wgrad operands' static rows: any split padded to 128s per expert
    offsets = torch.tensor([128, R], dtype=torch.int32)
    gemm = Fp8BlockwiseGemm("triton")
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(E, 2 * F, D).bfloat16())
    x = torch.randn(R, D).bfloat16().requires_grad_()
    dy = torch.randn(R, 2 * F).bfloat16()
    saved = []
    with Made() as forward, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = gemm.grouped_mm(x, w, offsets)
    # x's wgrad operand (e4m3 x^T and its 1x128 scales), beside the weight and int32 offsets / rows; the
    # backward quantizes dh along the tokens through the same _quantize call: the planner's dh_tokens
    operand = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
               if t.dtype in (torch.float8_e4m3fn, torch.float32)}
    assert sum(operand.values()) == FP8_SAVED * P * D, "saved wgrad operand"
    with Made() as backward:
        y.backward(dy)
    compiled, eager = _fp8_switches(cfg, compiled=True), _fp8_switches(cfg, compiled=False)
    # the wgrad kernel's bf16 [E, 2F, D], the gradient itself (the kernel stores the weight's dtype:
    # no fp32 output and cast, 6 B, as before session 37)
    wgrad = (backward.bytes(w.shape, torch.bfloat16, wgrad_op) + backward.bytes(w.shape, torch.float32, wgrad_op)
             + backward.bytes(w.shape, torch.bfloat16, aten._to_copy.default))
    assert wgrad == 2 * w.numel(), "wgrad output"
    terms = gate_up_wgrad_transient(cfg, 3, compiled, 8192, 16)
    R1, F1, D1 = 8192 * cfg.moe.router.top_k, cfg.moe.expert_hidden, cfg.d_model
    assert terms["dh_tokens"] == FP8_SAVED * padded_rows(R1, 16, 128) * 2 * F1 and terms["wgrad"] == wgrad / w.numel() * 16 * 2 * F1 * D1
    # what outlives the step (the graph freed): the weight cache, e4m3 w and w^T and the 128 x 128 tiles' scales
    del y, saved
    gc.collect()
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in (r() for *_, r in forward.made) if t is not None}
    assert sum(kept.values()) == eager.weight_cache("experts") * w.numel(), "weight cache"
    assert compiled.weight_cache("experts") == 0.0  # a traced graph bypasses the cache (quantizes in place)


def test_fp8_expert_terms_are_the_bytes_the_code_allocates():
    run_interpreted("tests.run.test_planner_fp8", "check_fp8_expert_bytes()")


def _moe_1t_slice(recipe: str | None, compiled: bool = True) -> dict:
    cfg = ModelConfig.moe_1t()
    layers, _ = slice_layers(cfg, 8, 8, 2)
    return plan_slice(cfg, layers, ep=8, seq_len=8192, memory=MemoryConfig(recompute="none"), compiled=compiled,
                      gpu="h200", precision=None if recipe is None else PrecisionConfig(recipe=recipe))


def test_fp8_slice_peaks_within_target_of_the_measured():
    """tools/bench_slice.py on one H200 (torch 2.11, compiled, recompute none): bf16 31.2 GiB. fp8_blockwise
    measured 36.8 GiB before session 37, its peak at the top block's gate|up wgrad (the fp32 output and
    its bf16 cast held together); since its kernels store the bf16 gradient themselves (2 B an element:
    check_fp8_expert_bytes counts the allocations) the plan puts it at 31.1 GiB, the SwiGLU-down
    backward's, the wgrad's 0.4 GiB below; measured 31.56 GiB (one H100, session 38 call 1, same command:
    docs/bench/session38/call1/slice_fp8.json), the plan 1.4% under it. bf16 plans 31.09 GiB since session 46
    (the slice's bf16 stream in the compiled norms' term, precision.bf16_residual: 31.28 before), 0.3% under."""
    bf16, fp8 = _moe_1t_slice(None), _moe_1t_slice("fp8_blockwise")
    assert bf16["peak_gib"] == pytest.approx(31.09, abs=0.01) and "SwiGLU-down" in bf16["peak_at"]
    assert fp8["peak_gib"] == pytest.approx(31.11, abs=0.01) and "SwiGLU-down" in fp8["peak_at"]
    assert abs(bf16["peak_gib"] / 31.2 - 1) <= 0.10 and abs(fp8["peak_gib"] / 31.56 - 1) <= 0.10
    cfg = ModelConfig.moe_1t()
    T, L, D, F, S = 8192, 16, cfg.d_model, cfg.moe.expert_hidden, cfg.moe.shared_width()
    R = T * cfg.moe.router.top_k
    # dh along the tokens, dx, the bf16 wgrad (stored by the kernel), w_down's and the shared expert's grads
    by_hand = FP8_SAVED * padded_rows(R, L, 128) * 2 * F + 2 * R * D + 2 * L * 2 * F * D + 2 * (L * D * F + 3 * D * S)
    layers, _ = slice_layers(cfg, 8, 8, 2)
    assert sum(gate_up_wgrad_transient(cfg, max(layers), _fp8_switches(cfg, compiled=True), T, L).values()) == \
        pytest.approx(by_hand)
    assert fp8["weight_cache_gib"] == bf16["weight_cache_gib"] == 0.0  # compiled: no cache
    assert fp8["peak_gib"] == pytest.approx(fp8["weights_gib"] + fp8["grads_gib"] + fp8["io_gib"]
                                            + fp8["held_at_peak_gib"] + fp8["backward_transient_gib"])
    eager = _moe_1t_slice("fp8_blockwise", compiled=False)  # bench_slice never steps: the cache holds every weight
    A, G = cfg.attention.n_heads * cfg.attention.head_dim, cfg.attention.kv_heads() * cfg.attention.head_dim
    linears = 2 * (D * (2 * A + 2 * G) + 3 * D * S + L * 3 * D * F)  # q, k, v, o, the shared and local experts
    assert eager["weight_cache_gib"] * GiB == pytest.approx((2 + 4 / 128**2) * linears)


def test_the_gluon_experts_plan_at_their_own_measured_rate():
    """fp8_blockwise resolves its experts to Gluon on an SM90 GPU (PrecisionConfig.resolved_fp8_experts), and
    the planner runs them at EFF_FP8_GLUON_EXPERT (measured, session 40) rather than the Triton kernels'
    EFF_FP8_EXPERT; on an SM100 GPU, where Gluon's wgmma kernels do not run, at the Triton rate; the dense
    linears keep EFF_FP8_GEMM either way."""
    from moetron.run.planner import hardware as hw
    from moetron.run.planner.timing import gemm_rate

    cfg = ModelConfig.olmoe_1b_7b()
    for gpu, experts, eff in (("h100", "gluon", hw.EFF_FP8_GLUON_EXPERT), ("h200", "gluon", hw.EFF_FP8_GLUON_EXPERT),
                              ("b200", "triton", hw.EFF_FP8_EXPERT)):
        sw = switches(cfg, ParallelConfig(), PrecisionConfig(recipe="fp8_blockwise"), OptimizerConfig(), GPUS[gpu], True)
        assert sw.fp8_experts == experts
        assert gemm_rate(GPUS[gpu], sw, "experts", True) == pytest.approx(GPUS[gpu].fp8_tflops * 1e12 * eff)
        assert gemm_rate(GPUS[gpu], sw, "attention", False) == pytest.approx(GPUS[gpu].fp8_tflops * 1e12 * hw.EFF_FP8_GEMM)
    triton = switches(cfg, ParallelConfig(), PrecisionConfig(recipe="fp8_blockwise", fp8_experts="triton"),
                      OptimizerConfig(), GPUS["h100"], True)
    assert gemm_rate(GPUS["h100"], triton, "experts", True) == pytest.approx(GPUS["h100"].fp8_tflops * 1e12 * hw.EFF_FP8_EXPERT)
