"""tools/profile_step.py: the kernel classifier on real kernel names, the GPU path's event handling on
hand-made profiler events, and the whole tool on the CPU (table, JSON, trace; categories sum to the total)."""

import glob
import inspect
import json
import os
import re

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

import profile_step
from moetron.core.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Names as the profiler reports them on an H200 (CUDA kernels) and on the CPU (aten ops).
NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off":
        "gemm",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNN": "gemm",
    "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
    "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >>>>": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>": "gemm",
    "aten::mm": "gemm",
    "aten::addmm": "gemm",
    "aten::_grouped_mm": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "flash_fwd_kernel": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)": "attention",
    "triton_tem_fused_flex_attention_0": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, ADAM_MODE::ADAMW>>":
        "optimizer",
    "aten::_fused_adamw_": "optimizer",
    "aten::_foreach_norm": "optimizer",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, "
    "std::array<char*, 1ul> >(int, at::native::FillFunctor<int>, std::array<char*, 1ul>)": "fill_int32",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >":
        "fill",
    "Memset (Device)": "fill",
    "aten::fill_": "fill",
    "aten::zero_": "fill",
    "triton_poi_fused__to_copy_0": "cast_copy",
    # fp8_rowwise's quantization traced into the graph, named after the GEMM it feeds (session 11's
    # profile counted 75 ms of these as GEMM): never the GEMM itself
    "triton_poi_fused__scaled_grouped_mm__to_copy_arange_bitwise_and_clamp_clamp_max_clamp_min_clone_div_8": "cast_copy",
    "triton_red_fused__scaled_mm__to_copy_abs_add_amax_clamp_clone_div_eq_frexp_full_like_gt_ldexp_mul_3": "cast_copy",
    "triton_poi_fused__to_copy_clone_transpose_3": "cast_copy",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>": "cast_copy",
    "Memcpy DtoD (Device -> Device)": "cast_copy",
    "aten::copy_": "cast_copy",
    "aten::to": "cast_copy",
    "triton_poi_fused_add_mul_silu_3": "fused_pointwise",
    "triton_per_fused__to_copy_add_sum_5": "fused_pointwise",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_2": "norm",
    "aten::rsqrt": "norm",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": "loss",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>": "loss",
    "aten::log_softmax": "loss",
    "void at::native::(anonymous namespace)::sum_and_scatter<float, long>(long const*, float*, long, long const*)":
        "embedding",
    "void at::native::(anonymous namespace)::compute_grad_weight<float, long>(long const*, float const*)": "embedding",
    "_embedding_grad_kernel": "embedding",
    "_route_count_kernel": "routing",
    "_combine_rows_backward_kernel": "routing",
    "moetron::scatter_rows": "routing",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": "routing",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": "communication",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul> >": "elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::BinaryFunctor<float, float, float, "
    "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul>, 4, TrivialOffsetCalculator<2, "
    "unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<2>, "
    "at::native::memory::StoreWithCast<1> >": "elementwise",
    "aten::mul": "elementwise",
    "aten::silu_backward": "elementwise",
    "void at::native::(anonymous namespace)::indexing_backward_kernel<c10::BFloat16, 4>": "other",
    "aten::embedding_dense_backward": "other",
    # cuDNN's attention backward helpers (session 55's profiles; "other" before)
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*, void*, void*, "
    "unsigned int)": "attention",
    "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int, unsigned int)": "attention",
    "void cudnn::fusion::fmha_reduce_head<true>(void const*, void*, unsigned int, unsigned int)": "attention",  # fmha
}


@pytest.mark.parametrize("name", list(NAMES))
def test_classify_real_kernel_names(name):
    assert profile_step.classify(name) == NAMES[name]


def test_every_category_has_a_case_and_other_catches_all():
    assert set(NAMES.values()) == set(profile_step.CATEGORIES)
    assert profile_step.RULES[-1] == ("other", "")


# The category of every moetron Triton kernel, by the file (or folder) that defines it.
TRITON_KERNEL_CATEGORIES = {
    "core/adamw_triton.py": "optimizer",
    "core/grad_norm_triton.py": "optimizer",  # the clipping norm's squares
    "core/moe/kernels/": "routing",
    "core/layers/cross_entropy_triton.py": "loss",
    "core/layers/embedding_triton.py": "embedding",
    "core/layers/norm_triton.py": "norm",
    "core/layers/rope_triton.py": "fused_pointwise",  # the eager RoPE, as inductor's fused one
    "core/precision/fp8_triton.py": "gemm",
    "core/precision/fp8_gluon.py": "gemm",  # with its row-tile table
    "core/precision/blockwise_triton.py": "cast_copy",  # quantization
    "core/precision/mx_triton.py": "cast_copy",  # quantization
    "core/precision/fp8_rowwise_triton.py": "cast_copy",  # quantization
    "core/precision/swiglu_triton.py": "fused_pointwise",  # the experts' SwiGLU, one pass each way
}


def test_moetron_triton_kernels_have_their_category():
    """Every @triton.jit (or @gluon.jit) kernel of moetron is named by a rule and has an expected
    category here, so a new kernel (or kernel file) shows up here first (helpers a kernel calls, like
    round_to_e4m3, are inlined and never launched)."""
    kernels = {}
    for path in glob.glob(os.path.join(ROOT, "core", "**", "*.py"), recursive=True):
        for name in re.findall(r"@(?:triton|gluon)\.jit\s*\n\s*def (\w+_kernel)\(", open(path).read()):
            kernels[name] = os.path.relpath(path, ROOT).replace(os.sep, "/")
    for name in ("_route_count_kernel", "_mx_quantize_kernel", "_fp8_grouped_gemm_rows_kernel",
                 "_fp8_grouped_gemm_k_kernel", "_adamw_kernel", "_gluon_rows_kernel", "_gluon_tile_table_kernel"):
        assert name in kernels, name
    for name, path in sorted(kernels.items()):
        where = [k for k in TRITON_KERNEL_CATEGORIES if path == k or (k.endswith("/") and path.startswith(k))]
        assert where, f"{name} ({path}): give its file an expected category in TRITON_KERNEL_CATEGORIES"
        assert profile_step.classify(name) == TRITON_KERNEL_CATEGORIES[where[0]], (name, path)


def test_op_record_decides_fill_dtype_and_optimizer_range():
    assert profile_step.classify("Memset (Device)", ["int", "Scalar"]) == "fill_int32"
    assert profile_step.classify("aten::fill_", ["int", "Scalar"]) == "fill_int32"
    assert profile_step.classify("aten::fill_", ["long int", "Scalar"]) == "fill"
    assert profile_step.classify("aten::copy_", ["int", "int"]) == "cast_copy"  # only fills are split
    opt = ["aten::lerp_", "Optimizer.step#AdamW.step", "ProfilerStep*"]
    assert profile_step.classify("aten::lerp_", enclosing=opt) == "optimizer"
    assert profile_step.classify("aten::lerp_", enclosing=["aten::lerp_", "ProfilerStep*"]) == "other"
    fused_loss = ["_LinearCrossEntropyBackward", "autograd::engine::evaluate_function: _LinearCrossEntropyBackward"]
    assert profile_step.classify("aten::exp_", enclosing=fused_loss) == "loss"
    assert profile_step.classify("aten::mm", enclosing=fused_loss) == "gemm"  # its matmuls stay GEMMs
    # The embedding's backward, torch's or moetron's: its zero-fill and sort count as the embedding's.
    for node in ("EmbeddingBackward0", "_GatherEmbeddingBackward"):
        embedding = [f"autograd::engine::evaluate_function: {node}", "ProfilerStep*"]
        assert profile_step.classify("Memset (Device)", enclosing=embedding) == "embedding"
        assert profile_step.classify("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel",
                                     enclosing=embedding) == "embedding"
    assert profile_step.classify("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel") == "routing"
    # What an attention backend launches inside its own op is attention (cuDNN's workspace fills and
    # its helper passes); a layout copy the dispatcher makes before calling the backend is not.
    for backend in ("aten::_cudnn_attention_forward", "aten::_scaled_dot_product_cudnn_attention_backward",
                    "aten::_flash_attention_backward", "aten::_scaled_dot_product_efficient_attention"):
        inside = ["aten::fill_", "aten::zero_", backend, "aten::scaled_dot_product_attention", "ProfilerStep*"]
        assert profile_step.classify("Memset (Device)", enclosing=inside) == "attention", backend
    dispatcher = ["aten::copy_", "aten::contiguous", "aten::scaled_dot_product_attention", "ProfilerStep*"]
    assert profile_step.classify("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda",
                                 enclosing=dispatcher) == "cast_copy"


# torch >= 2.12's events link each kernel to its op (linked_correlation_id); torch <= 2.11 has no
# such field (the profile then goes through the ops' kernel lists, the "older torch" tests).
_LINKS = "linked_correlation_id" in inspect.signature(FunctionEvent.__init__).parameters


def _event(id, name, start, end, device=DeviceType.CPU, linked=0, **kw):
    if _LINKS:
        kw["linked_correlation_id"] = linked
    return FunctionEvent(id=id, name=name, thread=0, start_us=start, end_us=end, device_type=device,
                         use_device="cuda", **kw)


@pytest.mark.skipif(not _LINKS, reason="this torch's profiler events carry no linked_correlation_id")
def test_gpu_kernels_take_their_launching_op_record():
    """CUDA events (hand-made, as _parse_kineto_results makes them): a memset under an int32
    aten::zero_, a kernel under the optimizer step; the device-side step annotation is not a kernel."""
    step = _event(1, "Optimizer.step#AdamW.step", 0, 100, is_user_annotation=True)
    zero = _event(2, "aten::zero_", 10, 20)
    zero.input_dtypes = ["int"]  # set after, as older torch's FunctionEvent takes no input_dtypes
    foreach = _event(3, "aten::_foreach_mul_", 30, 40)
    foreach.set_cpu_parent(step)
    events = [step, zero, foreach,
              _event(4, "Memset (Device)", 50, 53, DeviceType.CUDA, linked=2),
              _event(5, "void at::native::vectorized_elementwise_kernel<4, Mul>", 60, 70, DeviceType.CUDA, linked=3),
              _event(6, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 70, 90, DeviceType.CUDA, linked=99),
              _event(7, "ProfilerStep#4", 0, 100, DeviceType.CUDA, is_user_annotation=True)]
    assert profile_step.kernel_times(events, on_device=True) == [
        ("Memset (Device)", 3, "fill_int32"),
        ("void at::native::vectorized_elementwise_kernel<4, Mul>", 10, "optimizer"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 20, "gemm"),
    ]


def _old_torch(*events):
    """The events as torch <= 2.11 makes them: no linked_correlation_id on a FunctionEvent."""
    for e in events:
        if _LINKS:
            del e.linked_correlation_id
    return list(events)


def test_gpu_kernels_under_their_ops_on_older_torch():
    """torch <= 2.11's events carry no linked_correlation_id: the time is the device events', each
    kernel's launching op is found through the ops' kernel lists."""
    step = _event(1, "Optimizer.step#AdamW.step", 0, 100, is_user_annotation=True)
    zero = _event(2, "aten::zero_", 10, 20)
    zero.input_dtypes = ["int"]
    foreach = _event(3, "aten::_foreach_mul_", 30, 40)
    foreach.set_cpu_parent(step)
    mm = _event(4, "aten::mm", 41, 45)
    memset = _event(5, "Memset (Device)", 50, 53, DeviceType.CUDA)
    mul = _event(6, "void at::native::vectorized_elementwise_kernel<4, Mul>", 60, 70, DeviceType.CUDA)
    gemm = _event(7, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 70, 90, DeviceType.CUDA)
    mirror = _event(8, "Optimizer.step#AdamW.step", 30, 70, DeviceType.CUDA)  # not flagged on old torch
    for op, kernel in ((zero, memset), (foreach, mul), (mm, gemm), (step, mirror)):
        op.append_kernel(kernel.name, 0, kernel.time_range.elapsed_us())
    events = _old_torch(step, zero, foreach, mm, memset, mul, gemm, mirror)
    assert profile_step.kernel_times(events, on_device=True) == [
        ("Memset (Device)", 3, "fill_int32"),
        ("void at::native::vectorized_elementwise_kernel<4, Mul>", 10, "optimizer"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 20, "gemm"),
    ]


def test_older_torch_counts_each_device_event_once():
    """On the H200 (torch 2.11) the optimizer's multi_tensor_apply kernels were counted ~16 times
    each from the ops' kernel lists: a kernel also listed under a parent op, under an unlinked runtime
    or CUPTI overhead record sharing the op's correlation id, or as a legacy self-entry. Only the
    device events count, once each, and the real op (not the runtime record) classifies them."""
    adam = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>")
    step = _event(1, "Optimizer.step#AdamW.step", 0, 100, is_user_annotation=True)
    sync = _event(2, "cudaStreamSynchronize", 1, 2)  # unlinked runtime call, its CUPTI id colliding
    fused = _event(3, "aten::_fused_adamw_", 10, 40)
    fused.set_cpu_parent(step)
    overhead = _event(3, "Activity Buffer Request", 12, 13)  # inherits the op's correlation id
    overhead.set_cpu_parent(fused)
    fill = _event(4, "aten::fill_", 41, 42)
    kernels = [_event(10 + i, adam, 50 + 10 * i, 57 + 10 * i, DeviceType.CUDA) for i in range(3)]
    memset = _event(20, "Memset (Device)", 90, 92, DeviceType.CUDA)
    for op in (sync, fused, overhead, step):
        for k in kernels:
            op.append_kernel(k.name, 0, k.time_range.elapsed_us())
    fill.append_kernel("aten::fill_", 0, 5.0)  # is_legacy: the op's own CUDA time, not a device event
    fill.append_kernel(memset.name, 0, memset.time_range.elapsed_us())
    fill.append_kernel(memset.name, 0, memset.time_range.elapsed_us())  # listed twice
    events = _old_torch(step, sync, fused, overhead, fill, *kernels, memset)
    out = profile_step.kernel_times(events, on_device=True)
    assert out == [(adam, 7, "optimizer")] * 3 + [("Memset (Device)", 2, "fill")]
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    assert sum(us for _, us, _ in out) == sum(e.time_range.elapsed_us() for e in device) == 23
    row = profile_step.breakdown(out, steps=1, step_ms=1.0)
    cats = {c["category"]: c for c in row["categories"]}
    assert cats["optimizer"]["kernels_per_step"] == 3 and cats["optimizer"]["ms_per_step"] == pytest.approx(0.021)
    assert row["kernel_ms_per_step"] == pytest.approx(0.023)
    # the launching op is the innermost real one: not the runtime record, not the range around it
    ops = profile_step._launching_ops(events, lambda e: e.is_user_annotation)
    assert ops[(adam, 7)] is fused


def test_gemm_flops_from_the_recorded_shapes():
    """Dense, batched and each grouped form, the operands found where each op records them."""
    assert profile_step.gemm_flops("aten::mm", [[64, 32], [32, 16]]) == 2 * 64 * 32 * 16
    assert profile_step.gemm_flops("aten::addmm", [[16], [64, 32], [32, 16], [], []]) == 2 * 64 * 32 * 16
    assert profile_step.gemm_flops("aten::bmm", [[4, 64, 32], [4, 32, 16]]) == 2 * 4 * 64 * 32 * 16
    # grouped: routed rows through each expert's weight; the weight gradient grouped along the tokens
    assert profile_step.gemm_flops("aten::_grouped_mm", [[64, 32], [4, 32, 16], [4], [], []]) == 2 * 64 * 32 * 16
    assert profile_step.gemm_flops("aten::_grouped_mm", [[32, 64], [64, 16], [4], [], []]) == 2 * 32 * 64 * 16
    assert profile_step.gemm_flops("aten::_grouped_mm", [[4, 8, 32], [32, 64], [4]]) == 2 * 8 * 32 * 64
    assert profile_step.gemm_flops("aten::add", [[4], [4]]) is None
    assert profile_step.gemm_flops("aten::mm", []) is None


def test_gemm_table_on_a_profile_the_cpu_recorded():
    """torch.profiler's own CPU records: two calls of one mm shape as one row, a grouped GEMM once
    (not the per-group mm ops its CPU fallback runs inside it), each with its FLOP rate."""
    from torch.profiler import ProfilerActivity, profile

    a, w = torch.randn(64, 32), torch.randn(4, 32, 16)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            torch.mm(a, w[0])
        grouped = hasattr(torch, "_grouped_mm")
        if grouped:
            torch._grouped_mm(a.bfloat16(), w.bfloat16(), offs=offs)
    rows = {(r["op"], str(r["operands"])): r for r in profile_step.gemm_table(prof.events(), False, steps=1)}
    mm = rows[("aten::mm", str([[64, 32], [32, 16]]))]
    assert mm["calls_per_step"] == 2
    assert mm["tflops"] == pytest.approx(2 * (2 * 64 * 32 * 16) / (mm["ms_per_step"] * 1e-3) / 1e12)
    if grouped:
        assert rows[("aten::_grouped_mm", str([[64, 32], [4, 32, 16]]))]["calls_per_step"] == 1
        assert not any(op == "aten::mm" and operands != str([[64, 32], [32, 16]]) for op, operands in rows)
        # Past ``top`` the rest is one row, so the table sums to all the GEMMs' time.
        every = profile_step.gemm_table(prof.events(), False, steps=1)
        head, rest = profile_step.gemm_table(prof.events(), False, steps=1, top=1)
        assert head == every[0] and rest["op"] == "the other shapes" and rest["shapes"] == len(every) - 1
        assert rest["ms_per_step"] == pytest.approx(sum(r["ms_per_step"] for r in every[1:]))
        assert rest["calls_per_step"] == sum(r["calls_per_step"] for r in every[1:])
        assert rest["tflops"] == pytest.approx(every[1]["tflops"]) if len(every) == 2 else rest["tflops"] > 0


def test_gemm_table_on_the_gpu_counts_an_op_once_over_its_kernels():
    """On a GPU (events as torch <= 2.11 makes them): a GEMM op's kernels, a split-K reduction
    included, add their time to one call of its shapes."""
    mm = _event(1, "aten::mm", 0, 5, input_shapes=[[4096, 2048], [2048, 1024]])
    gemm = _event(2, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 10, 30, DeviceType.CUDA)
    reduce = _event(3, "splitKreduce_kernel", 30, 32, DeviceType.CUDA)
    for kernel in (gemm, reduce):
        mm.append_kernel(kernel.name, 0, kernel.time_range.elapsed_us())
    (row,) = profile_step.gemm_table(_old_torch(mm, gemm, reduce), True, steps=1)
    assert row["op"] == "aten::mm" and row["operands"] == [[4096, 2048], [2048, 1024]]
    assert row["calls_per_step"] == 1 and row["ms_per_step"] == pytest.approx(0.022)
    assert row["tflops"] == pytest.approx(2 * 4096 * 2048 * 1024 / 22e-6 / 1e12)


def _idle_events(old_torch: bool):
    """Two 100-us steps: in the first, kernels at 10-30 (a GEMM), 40-50 (the optimizer's, launched
    inside its range) and, on a second stream, 45-60 (overlapping it: no gap); in the second, one
    kernel at 150-170 launched by an unknown op, then nothing until the window ends."""
    step_a = _event(1, "ProfilerStep#1", 0, 100, is_user_annotation=True)
    step_b = _event(2, "ProfilerStep#2", 100, 200, is_user_annotation=True)
    opt = _event(3, "Optimizer.step#AdamW.step", 32, 44, is_user_annotation=True)
    opt.set_cpu_parent(step_a)
    mm = _event(4, "aten::mm", 2, 5)
    mm.set_cpu_parent(step_a)
    mul = _event(5, "aten::_foreach_mul_", 33, 36)
    mul.set_cpu_parent(opt)
    add = _event(6, "aten::add", 37, 38)
    add.set_cpu_parent(step_a)
    gemm = _event(10, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 10, 30, DeviceType.CUDA, linked=4)
    foreach = _event(11, "void at::native::multi_tensor_apply_kernel<Mul>", 40, 50, DeviceType.CUDA, linked=5)
    elementwise = _event(12, "void at::native::vectorized_elementwise_kernel<4, Add>", 45, 60, DeviceType.CUDA, linked=6)
    orphan = _event(13, "void at::native::vectorized_elementwise_kernel<4, Add>", 150, 170, DeviceType.CUDA, linked=99)
    mirror = _event(14, "ProfilerStep#1", 0, 100, DeviceType.CUDA, is_user_annotation=True)
    events = [step_a, step_b, opt, mm, mul, add, gemm, foreach, elementwise, orphan, mirror]
    if old_torch:
        for op, kernel in ((mm, gemm), (mul, foreach), (add, elementwise)):
            op.append_kernel(kernel.name, 0, kernel.time_range.elapsed_us())
        events = _old_torch(*events)
    return events


@pytest.mark.parametrize("old_torch", [False, True] if _LINKS else [True])
def test_idle_time_splits_the_windows_and_names_what_each_gap_waited_for(old_torch):
    idle = profile_step.idle_time(_idle_events(old_torch), steps=2)
    # step 1: 10 us before its first kernel, one 10-us gap (30 -> 40), 40 us after 60; step 2: 50 before, 30 after
    assert idle["before_ms"] == pytest.approx((10 + 50) / 1e3 / 2)
    assert idle["between_ms"] == pytest.approx(10 / 1e3 / 2)
    assert idle["after_ms"] == pytest.approx((40 + 30) / 1e3 / 2)
    # idle + busy = the windows' 200 us: kernels 20 + 20 (the union of 40-50 and 45-60) + 20, idle 140
    assert idle["idle_ms"] == pytest.approx(140 / 1e3 / 2)
    (site,) = idle["sites"]
    assert site == {"category": "optimizer", "site": "aten::_foreach_mul_ in Optimizer.step#AdamW.step",
                    "ms_per_step": pytest.approx(0.005), "gaps_per_step": 0.5}
    # the host's last launch (aten::add, returned at 38) against the GPU's last end (60), in step 1 only: step 2's
    # one kernel has no known launching op
    assert idle["host_done_ms"] == pytest.approx(0.038) and idle["gpu_done_ms"] == pytest.approx(0.060)


@pytest.mark.parametrize("old_torch", [False, True] if _LINKS else [True])
def test_idle_site_names_the_project_line_on_a_recorded_stack(old_torch):
    """--stack (with_stack): the frames are Python-function events around the launching op (Kineto;
    ``FunctionEvent.stack`` stays empty). The gap's site ends with the innermost frame of this
    project's code; torch's own frames are passed over, and no frame names a range."""
    events = _idle_events(old_torch)
    opt = next(e for e in events if e.name == "Optimizer.step#AdamW.step" and e.device_type == DeviceType.CPU)
    mul = next(e for e in events if e.name == "aten::_foreach_mul_")
    torch_frame = "/usr/lib/python3/site-packages/torch/utils/_foreach_utils.py(40): f"

    def frames_under_opt(*names):  # innermost first: mul's parent, then outward up to the optimizer's range
        frames = [_event(20 + i, name, 33, 36, is_python_function=True) for i, name in enumerate(names)]
        for inner, outer in zip(frames, frames[1:] + [opt]):
            inner.set_cpu_parent(outer)
        mul.set_cpu_parent(frames[0])

    frames_under_opt(torch_frame, profile_step._ROOT + "core/adamw.py(390): _chunk",
                     profile_step._ROOT + "core/trainer.py(300): train_step")
    (site,) = profile_step.idle_time(events, steps=2)["sites"]
    assert site["site"] == "aten::_foreach_mul_ in Optimizer.step#AdamW.step at core/adamw.py(390): _chunk"
    assert site == {"category": "optimizer", "ms_per_step": pytest.approx(0.005), "gaps_per_step": 0.5,
                    "site": "aten::_foreach_mul_ in Optimizer.step#AdamW.step at core/adamw.py(390): _chunk"}
    frames_under_opt(torch_frame, "/usr/lib/python3/site-packages/torch/optim/optimizer.py(490): wrapper")
    (site,) = profile_step.idle_time(events, steps=2)["sites"]
    assert site["site"] == "aten::_foreach_mul_ in Optimizer.step#AdamW.step"  # no project frame
    # as the profiler names them where the root is on sys.path: relative; torch's own stay out
    frames_under_opt("torch/optim/optimizer.py(490): wrapper", "core/adamw.py(390): _chunk")
    (site,) = profile_step.idle_time(events, steps=2)["sites"]
    assert site["site"] == "aten::_foreach_mul_ in Optimizer.step#AdamW.step at core/adamw.py(390): _chunk"


def test_stack_config_only_with_stack():
    assert profile_step.stack_config(False) == {}
    from torch._C._profiler import _ExperimentalConfig

    assert set(profile_step.stack_config(True)) == {"experimental_config"}
    assert isinstance(profile_step.stack_config(True)["experimental_config"], _ExperimentalConfig)


def test_stack_frames_note_says_when_none_were_recorded():
    events = _idle_events(old_torch=not _LINKS)
    frames, note = profile_step.stack_frames_note(events)
    assert frames == 0 and "recorded no Python frames" in note and torch.__version__ in note
    events.append(_event(99, "core/adamw.py(390): _chunk", 33, 36, is_python_function=True))
    assert profile_step.stack_frames_note(events) == (1, None)


def test_project_frame_on_a_stack_the_profiler_recorded():
    """The profiler's own with_stack frames (not built by hand), with the arguments --stack passes: an
    op launched by this project's code is put on its line; installed packages under the root (a
    .venv) are not the project's."""
    from torch.profiler import ProfilerActivity, profile

    from moetron.core.precision.mx import quantize_mx

    x = torch.randn(4, 64)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, **profile_step.stack_config(True)) as prof:
        quantize_mx(x)
    ops = [e for e in prof.events() if e.name.startswith("aten::") and not getattr(e, "is_python_function", False)]
    frames = {profile_step._project_frame(op) for op in ops}
    assert any(f and re.fullmatch(r"core/precision/mx\.py\(\d+\): \w+", f) for f in frames), frames
    assert profile_step._project_file(".venv/lib/python3.11/site-packages/torch/__init__.py") is None
    assert profile_step._project_file("torch/__init__.py") is None
    assert profile_step._project_file(profile_step._ROOT + "core/adamw.py") == os.path.join("core", "adamw.py")


def test_idle_time_without_kernels_is_all_before():
    step = _event(1, "ProfilerStep#1", 0, 100, is_user_annotation=True)
    idle = profile_step.idle_time([step], steps=1)
    assert idle["before_ms"] == pytest.approx(0.1) and idle["between_ms"] == 0 and idle["sites"] == []
    assert idle["host_done_ms"] is None and idle["gpu_done_ms"] is None


def test_breakdown_per_step_shares_and_headline():
    kernels = [("gemm_a", 600.0, "gemm"), ("gemm_a", 600.0, "gemm"), ("flash_fwd_kernel", 200.0, "attention"),
               ("fill", 300.0, "fill"), ("copy", 300.0, "cast_copy")]
    row = profile_step.breakdown(kernels, steps=2, step_ms=1.25, top=2)
    cats = {c["category"]: c for c in row["categories"]}
    assert list(cats) == profile_step.CATEGORIES
    assert cats["gemm"]["ms_per_step"] == pytest.approx(0.6) and cats["gemm"]["kernels_per_step"] == 1
    assert row["kernel_ms_per_step"] == pytest.approx(1.0) and row["busy"] == pytest.approx(0.8)
    assert row["non_gemm_attention_share"] == pytest.approx(0.3)
    assert [k["name"] for k in row["top_kernels"]] == ["gemm_a", "fill"]
    assert row["top_kernels"][0]["calls_per_step"] == 1 and row["top_kernels"][0]["share"] == pytest.approx(0.6)


SMALL = ["--preset", "tiny-moe", "--model.n_layers=2", "--seq-len", "32", "--batch", "2",
         "--wait", "0", "--warmup", "1", "--active", "2"]


def _check_report(path, out):
    result = json.loads(path.read_text())
    (row,) = result["rows"]
    cats = {c["category"]: c for c in row["categories"]}
    assert list(cats) == profile_step.CATEGORIES and row["active_steps"] == 2
    assert sum(c["ms_per_step"] for c in cats.values()) == pytest.approx(row["kernel_ms_per_step"])
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    for category in ("gemm", "attention", "optimizer", "routing", "loss"):
        assert cats[category]["ms_per_step"] > 0, category
    assert 0 < row["non_gemm_attention_share"] < 1 and row["step_ms"] > 0
    assert 0 < len(row["top_kernels"]) <= 20
    assert "non-GEMM, non-attention share" in out and "top " in out and "optimizer" in out
    return result


def test_cpu_run_writes_table_json_and_trace(tmp_path, capsys):
    out, trace = tmp_path / "profile.json", tmp_path / "trace.json"
    assert profile_step.main([*SMALL, "--json", str(out), "--trace", str(trace)]) == 0
    result = _check_report(out, capsys.readouterr().out)
    assert result["rows"][0]["source"] == "CPU ops (self time)" and not result["rows"][0]["real_text"]
    assert result["rows"][0]["idle"] is None  # no device timeline on the CPU
    assert result["env"]["command"].startswith("python tools/profile_step.py --preset tiny-moe")
    assert "traceEvents" in json.loads(trace.read_text())


def test_real_text_and_data_overrides(tmp_path, capsys):
    out = tmp_path / "profile.json"
    args = [*SMALL, "--model.vocab_size=512", "--real-text", f"--data.data_dir={tmp_path / 'corpus'}",
            "--data.corpus_max_bytes=300000", "--json", str(out)]
    assert profile_step.main(args) == 0
    assert _check_report(out, capsys.readouterr().out)["rows"][0]["real_text"]


def test_bad_overrides_are_one_error():
    with pytest.raises(ConfigError, match="--trainer.steps=3"):
        profile_step.main(["--preset", "tiny", "--trainer.steps=3"])
    with pytest.raises(ConfigError, match="only apply with --real-text"):
        profile_step.main([*SMALL, "--data.seq_len=8", "--json", ""])


def test_report_prints_gemm_rows_without_shapes_and_the_rest(capsys):
    """print_report on a GPU profile's row (session 31's olmoe3-4l-8e JSON) whose GEMM table holds a
    row without recorded shapes and the summed rest: each printed, none a KeyError."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "bench", "session31", "call2",
                        "profile_S2_b16.json")
    with open(path) as f:
        row = json.load(f)["rows"][0]
    row["gemms"] = row["gemms"][:2] + [
        {"op": "aten::mm", "operands": [], "calls_per_step": 2.0, "ms_per_step": 1.5, "tflops": None},
        {"op": "the other shapes", "operands": [], "calls_per_step": 9.0, "ms_per_step": 25.4, "tflops": 610.0,
         "shapes": 7}]
    profile_step.print_report(row, "header")
    out = capsys.readouterr().out
    assert "aten::mm (shapes not recorded)" in out and "the other shapes (7 shapes)" in out
    assert "aten::mm [16384, 4096] x [4096, 4096]" in out


def test_report_says_whether_the_host_ran_ahead(capsys):
    """The idle table's host line: session 41's trace (the host done at 60 of the GPU's 286.7 ms) reads
    GPU-bound; a GPU finishing a launch after the host (within HOST_AHEAD of the step) reads host-bound;
    a profile without known launchers prints no such line."""
    row = {"source": "CUDA kernels", "active_steps": 2, "step_ms": 290.0, "kernel_ms_per_step": 280.0, "busy": 0.97,
           "categories": [], "top_kernels": [], "gemms": [], "non_gemm_attention_share": 0.3,
           "idle": {"idle_ms": 3.0, "before_ms": 2.5, "between_ms": 0.4, "after_ms": 0.1, "sites": [],
                    "host_done_ms": 60.0, "gpu_done_ms": 286.7}}
    profile_step.print_report(row, "header")
    assert "the host launched the step's last kernel at 60.0 ms, the GPU finished at 286.7 ms: the host ran " \
           "226.7 ms ahead at the end (GPU-bound; the profiler slows the host" in capsys.readouterr().out
    row["idle"].update(host_done_ms=284.0)
    profile_step.print_report(row, "header")
    assert "ran 2.7 ms ahead at the end (host-bound or synchronized; the profiler" in capsys.readouterr().out
    row["idle"].update(host_done_ms=None, gpu_done_ms=None)
    profile_step.print_report(row, "header")
    assert "the host launched" not in capsys.readouterr().out


def test_clocks_sampled_over_the_active_steps_only(monkeypatch):
    """The clock sampler is entered when the first active step starts (after the wait and warm-up steps, whose
    compiles would pull the mean toward the idle clock) and left after the last, before the profiler collects."""
    steps, events = [], []

    class Trainer:
        def train_step(self, batch):
            steps.append(batch)

    class Data:
        def next_batch(self):
            return len(steps)

    class Clocks:
        def __enter__(self):
            events.append(("enter", len(steps)))
            return self

        def __exit__(self, *exc):
            events.append(("exit", len(steps)))

    class Profiler:  # torch.profiler.profile's place: its step() after the last active step collects the trace
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append(("profiler exit", len(steps)))

        def step(self):
            events.append(("profiler step", len(steps)))

        def events(self):
            return []

    monkeypatch.setattr(profile_step.torch.profiler, "profile", Profiler)
    profile_step.profile(Trainer(), Data(), torch.device("cpu"), wait=2, warmup=1, active=2, clocks=Clocks())
    assert [e for e in events if e[0] in ("enter", "exit")] == [("enter", 3), ("exit", 5)]
    # left before the last step() (which collects the trace: seconds of an idle card), not after it
    assert events.index(("exit", 5)) < events.index(("profiler step", 5)) < events.index(("profiler exit", 5))
