"""The planner's hardware table and efficiency constants: what tools/plan.py assumes a GPU does,
each with its source (a datasheet, a measurement in docs/performance.md, or an assumption)."""

from __future__ import annotations

__all__ = ['GiB', 'GPU', 'GPUS', 'gpu_of', 'GPUS_PER_NODE', 'RESERVED_GIB', 'EXPERT_GEMM_MEASURED', 'EFF_FP8_GEMM', 'EFF_FP8_EXPERT', 'EFF_FP8_GLUON_EXPERT', 'EFF_FP8_CUBLAS_EXPERT', 'CUBLAS_CALL_S', 'BF16_CUBLAS_MEASURED', 'BF16_CUBLAS_CALL_S', 'EFF_ATTN', 'DETERMINISTIC_ATTN', 'EFF_COMM', 'EFF_PCIE', 'HOST_GBPS', 'HBM_TRAFFIC', 'RESIDUAL_SAVED_BYTES', 'EAGER_NORM_SAVED_BYTES', 'EAGER_ROPE_SAVED_BYTES', 'OPTIMIZER_BYTES', 'STATE_BYTES', 'RECOMPUTE_FORWARD', 'HOST_OPTIMIZER_BYTES', 'QUANT_BYTES', 'QUANT_ROWS_BYTES', 'WEIGHT_QUANT_BYTES', 'MX_EMULATED_BYTES', 'EFF_MX_QUANT', 'EFF_MX_FUSED', 'FP8_SAVED', 'FP8_WEIGHT_CACHED', 'FP8_ROWWISE_MEASURED', 'EFF_FP8_ROWWISE_GEMM', 'ROWWISE_QUANT_BYTES', 'EFF_ROWWISE_ROWS', 'EFF_ROWWISE_COLS', 'LOW_PRECISION']

import dataclasses

from moetron.core.precision import PrecisionRecipe

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class GPU:
    hbm_gib: float
    """Memory the device reports (about the datasheet's GB)."""
    hbm_tbps: float
    """HBM bandwidth, TB/s."""
    bf16_tflops: float
    """Dense (no sparsity) bf16 tensor-core TFLOP/s."""
    fp8_tflops: float
    """Dense fp8 tensor-core TFLOP/s."""
    nvlink_gbps: float
    """NVLink GB/s per GPU, one direction."""
    internode_gbps: float
    """Scale-out network GB/s per GPU, one direction (one NIC per GPU)."""
    sm: int = 9
    """Compute capability major (9 Hopper, 10 Blackwell): which precision recipes run natively."""
    pcie_gbps: float = 64.0
    """Host link GB/s per GPU, one direction (PCIe Gen5 x16: 64; Gen6 x16: 128)."""
    gemm_eff: float = 712 / 989
    """bf16 GEMM efficiency inside a training step: achieved / ``bf16_tflops`` of the step's dense linears,
    as tools/profile_step.py's GEMM table measures them (not an isolated GEMM's peak, ~800 TFLOP/s on both
    Hoppers here: in a step the clocks sit lower: session 57's H100 held olmoe3-4l-8e's step at its 700 W limit
    at 1,491 MHz of 1,980, where the peak is 806 TFLOP/s, so a card of another power limit needs its own
    figure; held for 5 s alone, olmoe3's dense GEMMs ran 669-687 TFLOP/s at 1,336-1,376 MHz and 698 W on
    session 58's H100, against 759-763 in a 10-call burst: tools/bench_gemm_clock.py). The H100's 712
    TFLOP/s: olmoe3-4l-8e's dense GEMMs, 702-717 in sessions 34-40's profiles
    (docs/bench/session40/call4/profile_S2_best_top40.json: 137.5 ms at 702), OLMoE-8L's 769-779 (its LM
    head's wide GEMMs). The H200's 695: its GEMMs took 232-235 ms of olmoe3-4l-8e's bf16 step (sessions 16
    and 26) where the H100's took 227.9 (session 31, the same code), 0.976x. Blackwell: the H100's share,
    assumed (never run here)."""
    hbm_eff: float = 0.80
    """Achieved / datasheet HBM bandwidth of the step's streaming kernels (the optimizer's and the
    elementwise traffic's counted bytes; see ``stream_bps``): the Triton AdamW step with its grad norm in
    tools/profile_step.py's profiles against the bytes OPTIMIZER_BYTES counts, 1.13-1.16x that count's time
    at the datasheet rate on the H100 (20.5 / 28.5 ms a step on olmoe3-4l-8e / OLMoE-8L: sessions 40 and
    41) and 1.24-1.27x on the H200 (15.2-15.6 / 21.3-22.3 ms, sessions 10-29). Blackwell: the H200's,
    assumed."""

    @property
    def stream_bps(self) -> float:
        """Bytes/s the step's streaming kernels achieve: hbm_tbps x hbm_eff."""
        return self.hbm_tbps * 1e12 * self.hbm_eff


# Sources: NVIDIA datasheets; the datasheets quote sparse tensor FLOP/s, halved here to dense.
GPUS: dict[str, GPU] = {
    # H100 SXM5 datasheet: 80 GB HBM3 (nvidia-smi 81,559 MiB = 79.6 GiB), 3.35 TB/s, bf16 1,979 /
    # fp8 3,958 TFLOP/s sparse, NVLink 900 GB/s (bidirectional); DGX H100: ConnectX-7 400 Gb/s per GPU;
    # PCIe Gen5 x16 host link.
    "h100": GPU(79.6, 3.35, 989.0, 1979.0, 450.0, 50.0, sm=9, pcie_gbps=64.0, gemm_eff=712 / 989, hbm_eff=0.87),
    # H200 SXM datasheet: 141 GB HBM3e (nvidia-smi 143,771 MiB = 140.4 GiB, docs/performance.md),
    # 4.8 TB/s, bf16 1,979 / fp8 3,958 sparse, NVLink 900 GB/s; ConnectX-7 400 Gb/s per GPU; PCIe Gen5 x16.
    "h200": GPU(140.4, 4.8, 989.0, 1979.0, 450.0, 50.0, sm=9, pcie_gbps=64.0, gemm_eff=695 / 989, hbm_eff=0.80),
    # HGX B200 datasheet (8 GPUs): 1,440 GB HBM3e, 64 TB/s, BF16 36 PF / FP8 72 PF sparse, NVLink 5
    # 1.8 TB/s per GPU (bidirectional); DGX B200: ConnectX-7 400 Gb/s per GPU; PCIe Gen5 x16.
    "b200": GPU(180.0, 8.0, 2250.0, 4500.0, 900.0, 50.0, sm=10, pcie_gbps=64.0),
    # HGX B300 datasheet (8 GPUs): 2.3 TB HBM3e (288 GB each), 64 TB/s, BF16 36 PF / FP8 72 PF
    # sparse, NVLink 5 1.8 TB/s per GPU; ConnectX-8 SuperNIC 800 Gb/s per GPU; PCIe Gen6 x16.
    "b300": GPU(288.0, 8.0, 2250.0, 4500.0, 900.0, 100.0, sm=10, pcie_gbps=128.0),
}
GPUS_PER_NODE = 8


def gpu_of(device_name: str | None) -> str | None:
    """The GPUS key of a device as torch.cuda.get_device_name() names it (what the benchmarks record as
    their report's ``device``: "NVIDIA H100 80GB HBM3" -> "h100"; the table's figures are the SXM parts'),
    or None for another device or none."""
    name = (device_name or "").lower()
    return next((key for key in GPUS if key in name), None)


RESERVED_GIB = 3.0
"""Not for tensors: CUDA context, NCCL buffers, allocator fragmentation (a rank 'fits' below HBM - this)."""

# ---- efficiency constants (docs/performance.md "planner vs measurement" says which rows fixed them) --
EXPERT_GEMM_MEASURED = {  # shape: (rows per expert, d_model, expert_hidden, grouped rate / dense rate)
    "olmoe": (2048, 2048, 1024, 626 / 712),
    "olmo3-moe-8e": (8192, 4096, 4096, 700 / 712),
}
"""Routed-expert grouped GEMMs (torch._grouped_mm, bf16) inside a training step, as a share of the dense
linears' in-step rate (GPU.gemm_eff): tools/profile_step.py's GEMM table on the H100, compiled, 16,384
tokens a step, uniform routing. OLMoE-8L's 64 narrow experts 623-629 TFLOP/s (sessions 37 and 41:
docs/bench/session41/call2/profile_S1_best_top40.json), olmoe3-4l-8e's 8 wide ones 693-705 (sessions
34-40). The planner runs a layer's local experts at the dense rate x this share, linear in the log of a
local expert's rows x d_model x expert_hidden between the shapes, the nearest end's share outside them
(timing.expert_gemm_share), as for BF16_CUBLAS_MEASURED. Until session 41 one EFF_EXPERT of 0.47 (465
TFLOP/s: tools/bench_moe.py's whole MoE layers) ran every expert GEMM 26-34% slower than measured in the
step, and an isolated GEMM's 800 TFLOP/s ran the dense linears 12% faster: the two errors cancelled on
olmoe3-4l-8e and left wide experts (the moe-1t slice) planned slow."""
EFF_FP8_GEMM = 1080 / 1979
"""Dense fp8 blockwise GEMMs (F.scaled_mm BlockWise1x128 / 128x128): 1000-1160 TFLOP/s measured on
the H200 (this session's fp8 GEMM measurement), 1080 of the 1979 fp8 peak. Used for every native fp8 recipe."""
EFF_FP8_EXPERT = 562 / 1979
"""Grouped fp8 expert GEMMs of fp8_blockwise (core/precision/fp8_triton.py's pipelined kernels, the
default since session 6): 562 TFLOP/s fwd+bwd measured on the H200 at bench_gemm_fp8's wider
olmo3-moe-3.2b shape with session 7's quantization kernels (467 at the olmoe shape, 587 at
olmo3-moe-8e; session 6's quantization: 510 / 386; the masked kernels of session 4: 441 / 322),
activation quantization included (so the planner's separate quantization term counts it a second
time). ``precision.fp8_experts=cublas``: EFF_FP8_CUBLAS_EXPERT and CUBLAS_CALL_S."""
EFF_FP8_GLUON_EXPERT = 772 / 1979
"""Grouped fp8 expert GEMMs under ``precision.fp8_experts=gluon`` (core/precision/fp8_gluon.py, the default
on SM90 since session 37), their kernels alone: the planner counts the activations' quantization in a
term of its own (QUANT_BYTES). Measured at the same olmo3-moe-3.2b shape as EFF_FP8_EXPERT, weights
cached the same way, on one H100 (session 40 call 7): 703 TFLOP/s fwd+bwd with the quantization
(``tools/bench_gemm_fp8.py --skip-check --iters 10 --loop 10 --shapes olmoe olmo3-moe-3.2b olmo3-moe-8e
--no-dense --backends "fp8_blockwise gluon"``: 703.3 / 703.8; olmoe 665-673, olmo3-moe-8e 813), of which
the kernels are 15.929 of 17.473 ms of GPU time at the gate|up GEMM (the same call with ``--profile``:
docs/bench/session40/call7/grouped_loop10_profile.json; the 1x128 quantization the other 1.537): 703 x
17.473 / 15.929 = 772. Until session 41 the plan used the 703 and counted the quantization twice (H100
fp8 step rows of sessions 34-40 +6.0% on average; +3.6% now)."""
EFF_FP8_CUBLAS_EXPERT = 803 / 1979
"""Grouped fp8 expert GEMMs under ``precision.fp8_experts=cublas`` (core/precision/fp8_cublas.py,
one cuBLAS blockwise GEMM per expert) while the GPU is the limit: 803 TFLOP/s fwd+bwd measured on
the H200 with 8 experts of 8192 rows (bench_gemm_fp8's olmo3-moe-8e shape; 724 with session 6's
quantization kernels), quantization included like EFF_FP8_EXPERT."""
CUBLAS_CALL_S = 55e-6
"""CPU seconds per cuBLAS call of fp8_cublas.py's per-expert loop: 64 calls took 3.5 ms whatever
their size (bench_fp8_variants' experiment at the olmoe shape, H200 machine), the floor of a layer's
expert GEMMs when the experts are many and small."""
BF16_CUBLAS_MEASURED = {  # shape: (rows per expert, d_model, expert_hidden, ms grouped, ms cuBLAS)
    "olmoe": (2048, 2048, 1024, 7.570, 11.057),
    "olmo3-moe-3.2b": (1024, 4096, 4096, 33.496, 32.951),
    "olmo3-moe-8e": (8192, 4096, 4096, 31.371, 29.906),
}
"""``precision.bf16_experts=cublas`` (one torch.mm per local expert, core/precision/grouping.py) against
torch._grouped_mm, both GEMMs of a layer fwd+bwd, eager, measured on the H200 (session 9, torch 2.11:
``tools/bench_gemm_fp8.py --skip-check --iters 10 --shapes olmoe olmo3-moe-3.2b olmo3-moe-8e --no-dense
--backends 'bf16 cublas'``, docs/bench/session9/call1_gemm.json): 0.68x, 1.02x, 1.05x the grouped rate.
The planner runs the experts at the bf16 grouped rate (timing.expert_gemm_share) x that ratio
(timing.cublas_bf16_speedup: linear in the log of a local expert's rows x d_model x expert_hidden
between these shapes, the end ratio outside). The
ratio follows the GEMM's size, not the rows alone: olmoe's 2048-row experts lose, olmo3-moe-3.2b's
1024-row ones do not. olmoe's row may be the CPU's limit rather than the GPU's (its 384 calls, each
with its group sizes read on the host, took 28.8 us apiece)."""
BF16_CUBLAS_CALL_S = 115e-6
"""Seconds per torch.mm call of the bf16 per-expert loop in a compiled step, the floor of the experts'
time (6 calls per local expert per MoE layer). Fitted to OLMoE-8L (64 experts, 8 layers: 3072 calls
per step) on the H200, session 9 (tools/bench_train.py, docs/bench/session9/call1_s1.json): b16c
453.5 ms against b16 184.7 ms, so the calls take 453.5 - 184.7 + 85.2 ms (the planned grouped
expert GEMMs they replace) = 354 ms, 115 us each. That is CPU time the host syncs expose (the group
sizes are read 4 times per MoE layer, draining the GPU's queue, so the CPU no longer runs ahead of
the GPU), not only the mm's launch: the same loop took at most 28.8 us per call in the eager GEMM
benchmark. olmoe3-4l-8e (8 experts, docs/bench/session9/call1_s2.json: 304.0 ms against 303.3) stays
GPU-bound under it. Measured on compiled steps only; eager steps use the same figure."""
EFF_ATTN = 0.80
"""Attention scores as counted (12 x width x context, no causal halving): the causal kernels do half
of it, at about 40% of peak. Fitted in session 41 to the attention kernels of tools/profile_step.py's
profiles (cuDNN's Hopper kernels, S 4096): 15.7-17.4 ms a step on the H100 (OLMoE-8L and olmoe3-4l-8e,
sessions 37-41), 16.6-18.1 on the H200 (sessions 10-29), 16.7 planned; the H200's per-kernel table of
session 18 (tools/bench_attention.py) agrees. Was 0.70, assumed. Those profiles counted cuDNN's two backward
helper passes (D = rowsum(dO * O), the dQ conversion; about 1.3 ms a step on either shape) outside attention,
so the fits put them in HBM_TRAFFIC's remainder; since session 55 profile_step counts them as attention
(17.4-19.1 ms a step, docs/performance.md). The planned step is the same sum either way."""
DETERMINISTIC_ATTN = 2.37
"""trainer.deterministic: attention's kernel time against the default's. torch's SDPA then leaves cuDNN's
Hopper kernels (their backward is not deterministic) for FlashAttention-2's, with its deterministic
backward: 16.1 -> 38.1 ms a step (forward 3.9 -> 7.4, backward 12.2 -> 28.8 and its extra passes), OLMoE-8L
compiled at S 4096, head dim 128, on the H100 (session 53's profiles, tools/profile_step.py). [measured]
on that shape; the switch's other cost, torch's fill of uninitialized memory, is off (core/trainer.py).
olmoe3-4l-8e's grouped-query attention (32 query heads over 8 KV heads) measures 1.87 (19.6 -> 36.6 ms, H200,
session 56); the planner keeps 2.37 and plans that row's step within 2.8% (tools/plan.py --validate)."""
EFF_COMM = 0.73
"""Achieved / link bandwidth of NCCL collectives at large sizes: 330 of 450 GB/s (2 x H200, docs)."""
EFF_PCIE = 0.8
"""Achieved / link bandwidth of pinned host<->device copies (about 51 of 64 GB/s on PCIe Gen5). Assumed."""
HOST_GBPS = 50.0
"""Host memory bandwidth the CPU optimizer step achieves (torch's AdamW on CPU tensors). Assumed."""
HBM_TRAFFIC = {"eager": 11.3, "compiled": 3.6}
"""Elementwise HBM bytes moved per step / reference saved-activation bytes (reference_activation_bytes:
the eager count of the code these were fitted on), at the streaming rate (GPU.stream_bps). Refitted in
session 41 with the in-step GEMM rates (GPU.gemm_eff, EXPERT_GEMM_MEASURED) and the streaming rate: the
kernel time left beside the GEMMs, attention and the optimizer in tools/profile_step.py's profiles
(GPU idle included, the experts' recast taken off) gives 2.95-3.19 on the H100 (OLMoE-8L b16 and best,
olmoe3-4l-8e best: sessions 37, 40, 41) and 3.63-3.98 on the H200 (OLMoE-8L b16 session 29, olmoe3-4l-8e
b16 session 16): compiled 3.6 sits between them, so the H100's elementwise kernels are planned 13-22%
long and the H200's 1-10% short (1-3% of a step). eager: the six eager rows of sessions 39-40 (H100)
centred. Before: 4.4 / 13.0, fitted to session 5's OLMoE-8L rows on the H200 beside the isolated GEMM
rate and EFF_EXPERT 0.47."""
RESIDUAL_SAVED_BYTES = 20.0
"""Elementwise HBM bytes a step moves less per token, per block and per model-width element with
precision.bf16_residual (the stream and its gradient 2 B an element instead of 4: about ten touches
of it a block, the residual adds, the norms' reads and their backward, after inductor's fusion), at
the streaming rate (GPU.stream_bps). Fitted to the H100's compiled same-run pairs of session 46
(docs/performance.md): olmoe3-4l-8e 1.6-1.9 ms and OLMoE-8L 1.3-2.1 ms faster, both 268M stream
elements a step (D x blocks x tokens: 4096 x 4 and 2048 x 8, x 16,384), 1.85 ms x 2.91 TB/s / 268M
= 20 B. The eager olmoe3-4l-8e pair's 9.7 ms (autocast's casts of the fp32 stream for each linear
gone too) is one row, not fitted: eager plans take the compiled term."""
EAGER_NORM_SAVED_BYTES = 130.0
"""Elementwise HBM bytes an eager step moves less per normed element (a token's width through one
RMSNorm: each block's two and its q / k norms) with model.triton_rmsnorm: one Triton pass forward and
one backward instead of torch's fp32 kernels (the cast, pow, mean, rsqrt, two multiplies and their
backward), at the streaming rate. Fitted to session 43's same-run eager pairs on the H100 (the best row
without the kernel twice, with it once: olmoe3-4l-8e 369.3 -> 328.0 ms, 872M normed elements a step,
138 B; OLMoE-8L 276.7 -> 231.3 ms, 1.07G elements, 123 B). Compiled steps trace torch's norm."""
EAGER_ROPE_SAVED_BYTES = 134.0
"""As EAGER_NORM_SAVED_BYTES, per roped element (q and k: A + G a token and block) with model.triton_rope
(one Triton pass each way instead of torch's fp32 cast, slices, negation, concatenation, products, sum
and cast back). Fitted to session 44's
same-run eager pairs with the norm on (olmoe3-4l-8e 322.8 -> 306.7 ms, 336M roped elements a step, 139 B;
OLMoE-8L 227.1 -> 203.4 ms, 537M, 129 B)."""
STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "q8": 2.0 + 8.0 / 256, "fp8": 2.0 + 2.0 / 256}
"""Adam moments' bytes per local parameter by optimizer.state_dtype: two fp32, two bf16, or two bytes and two
scales a block of 256, fp32 (q8) or E8M0 bytes (fp8) (core/moments_q8.py; its 1-D parameters' fp32 moments, a
few thousand elements a layer, not counted)."""
OPTIMIZER_BYTES = {("fp32", "triton"): 32.0, ("bf16", "triton"): 24.0, ("q8", "triton"): 34.0, ("fp8", "triton"): 20.0,
                   ("fp32", "torch"): 32.0 * 1.2, ("bf16", "torch"): 112.0, ("q8", "torch"): 600.0,
                   ("fp8", "torch"): 600.0}
"""HBM bytes per local parameter per optimizer step, counted from the code, by (state_dtype, kernel):
the Triton AdamW (optimizer.impl auto on GPUs, core/adamw_triton.py: reads p, g, m, v, writes p, m, v:
28 fp32, 20 bf16; at GPU.stream_bps, which is fitted to it in a step) + the grad-norm pass (4); torch's
fused AdamW (impl=torch, fp32: the same 28 + 4, measured at 1.24x its floor, hence x 1.2); core/adamw.py's
foreach ops (impl=torch, bf16: upcast m and v to fp32, decay, lerp, mul, addcmul, write back, sqrt,
div, add, addcdiv: 108) + 4. q8: the Triton kernel moves 16 + 16/256 bytes (p, g, the moments' bytes and
scales), but is bound by its instructions, not HBM: measured 1.50x bf16's time over OLMoE-8L's 3.77B parameters on
an H100 (37.4 against 25.0 ms, session 59, tools/bench_optim.py), so it counts as 20 x 1.5 = 30 bytes at the
streaming rate, + 4 [measured]; its torch reference (impl=torch, core.adamw._update_8bit: the codes widened, decoded
and encoded op by op, about 500 bytes an element on top of the fp32 foreach step's; assumed, not measured: it is
the CPU's path, not meant for GPUs). fp8: the same kernel in fp8's code moves 16 + 4/256 bytes and codes them by
the GPU's conversions (140 SASS instructions an element at its 4 rows a program against bf16's 107, counted
statically, docs/bench/session60/sass_count.py), so 16 + 4 [assumed: HBM-bound as bf16's, not yet measured]; its
torch reference as q8's [assumed]."""
RECOMPUTE_FORWARD = {"eager": 1.0 / 3.0, "compiled": 1.0 / 3.0}
"""Extra step time of a fully recomputed block, as a share of its forward + backward: the one extra
forward (1/3, counted), eager and compiled. (Until 2026-12-01 compiled full recompute graph-broke
and ran the block eagerly, so that day's 'compiled' full / every-2nd rows are eager rows; a 0.65
fitted to them is gone with the fix. Not yet re-measured.)"""
HOST_OPTIMIZER_BYTES = {"fp32": 88.0, "bf16": 112.0, "q8": 600.0, "fp8": 600.0}
"""Host bytes per parameter of the CPU optimizer step under fsdp_offload (torch's AdamW on CPU runs
op by op: no fused kernel): counted from its ops as above (q8, fp8: assumed, as OPTIMIZER_BYTES' torch q8)."""
QUANT_BYTES = {"emulated": 32.0, "native": 8.0}
"""HBM bytes per element of a low-precision GEMM's input plus output, per training step of a token,
at the datasheet HBM rate: the forward quantizes x along its reduction dim and again along the
tokens (saved), the backward dy along O and along the tokens. native: the fused 1x128 kernel
(core/precision/blockwise_triton.py) reads 2 and writes 1 + 1 B per element at 2.3-2.4 TB/s on the
H200 (tools/bench_quantize.py, session 7), the time of 8 B at the 4.8 TB/s datasheet rate (24
before: assumed for unfused ops). emulated: fp8_blockwise emulated (torch ops, each dequantized
into bf16), assumed, not measured; mxfp8 emulated has its own count (MX_EMULATED_BYTES)."""
QUANT_ROWS_BYTES = 4.5
"""QUANT_BYTES of native fp8_blockwise under precision.fp8_wgrad=false: the rows output alone (read
2, write 1 B per element) at 3.0-3.6 TB/s on the H200 (tools/bench_quantize.py, session 7), the
time of 4.5 B at the 4.8 TB/s datasheet rate."""
WEIGHT_QUANT_BYTES = {"emulated": 16.0, "native": 7.0}
"""HBM bytes per low-precision weight element per quantization at the datasheet HBM rate
(fp8_blockwise emulated: its bf16 dequantized copy; native mxfp8: fp8 w and w^T): once per step in
eager (the weight cache), twice per micro-batch compiled (the cache is bypassed inside a traced
graph), once per step again for the experts under precision.quantize_weights_once. Assumed. mxfp8
emulated: MX_EMULATED_BYTES["weight"]; native fp8_blockwise: its kernel's bytes (timing.py:
weight_quant_bytes)."""
MX_EMULATED_BYTES = {
    "input_fused": 2 + 2 + 1 + 1 / 32, "input_two_pass": 2 + 2 + 2 + 1 + 1 / 32, "input_dequant": 1 + 1 / 32 + 2,
    "grad_fused": 2 + 2 + 2, "grad_two_pass": 2 + 2 + 2 + 2, "weight": 4 + 2, "weight_pair": 4 + 2 + 2,
}
"""HBM bytes per element that mxfp8 emulated's quantization kernels move (core/precision/emulated.py,
mx_triton.py) [code]. A GEMM's input x, forward: its bf16 rows for the GEMM and its columns' e4m3 +
E8M0 payload (saved for the wgrad): read 2, write 2 + 1 + 1/32 from one read (input_fused,
mx_rows_and_cols_triton, the default) or two (input_two_pass, MOETRON_MX_FUSED=0); backward: the
payload back to bf16 (input_dequant, _mx_dequantize_kernel). Its output gradient dy, backward: bf16
rows for the dgrad and bf16 columns for the wgrad (grad_fused / grad_two_pass). A weight: each
orientation (along I for the forward, along O for the dgrad) read from the fp32 master and written
in bf16, a pass of its own (weight; 2 B less read from the experts' bf16 copies under
precision.expert_weight_copies=optimizer): two per micro-batch compiled (three for a recomputed block),
two per step from the eager WeightCache, or, fused, one pass per step making both (weight_pair:
emulated._weight's one cache entry for both orientations, where the cache serves: eager and
quantize_weights_once; not run on a GPU yet, so the fused rate is the activations'). The grouped wgrad's padding rows (P - R, under 1% at 64
experts of 2048 rows) are not counted."""
EFF_MX_QUANT = 3.18 / 4.8
"""Achieved / datasheet HBM bandwidth of mxfp8 emulated's separate passes (_mx_quantize_kernel with
the lean arithmetic, _mx_dequantize_kernel): the weights' quantization, the payload's dequantize,
and the activations' two passes under MOETRON_MX_FUSED=0. Measured on the H200 (session 9, call 6,
docs/bench/session9/call6_prof_s1_mx.json: OLMoE-8L compiled, lean, two passes): 36.0 ms of quantize
(288 calls) and 3.77 ms of dequantize (48) per step for the 113.4 + 13.0 GB that MX_EMULATED_BYTES
counts, 3.18 TB/s (3.15 and 3.43 apart). Not the step rows: they are checks (docs/planner.md)."""
EFF_MX_FUSED = 3.86 / 4.8
"""The same for mx_rows_and_cols_triton (an input's or a gradient's two quantizations from one read,
the default): fitted to session 9's call 7 pair on the H200 (one machine, OLMoE-8L compiled, lean):
docs/bench/session9/call7_s1.json's fused 218.7 ms against call7_s1u.json's two passes 227.8, so
the activations' passes, 73.2 GB in 23.0 ms at EFF_MX_QUANT, take 13.9 ms as 53.8 GB: 3.86 TB/s."""
FP8_SAVED = 1 + 1 / 32
"""Bytes per element of a GEMM input saved as fp8: MXFP8 (an E8M0 per 32) and 1x128 blockwise (an
fp32 per 128) both come to 1 + 1/32."""
FP8_WEIGHT_CACHED = 2 + 4 / 128**2
"""Bytes per weight element of fp8_blockwise's native weight quantization (core/precision/fp8_gemm.py
_weights: e4m3 w and e4m3 w^T, one fp32 scale per 128 x 128 tile), what its WeightCache holds
through an eager step and what a compiled step makes again in each forward and backward."""
FP8_ROWWISE_MEASURED = {  # shape: (rows per expert, d_model, expert_hidden, x bf16 with promotion, with fast_accum)
    "olmoe": (2048, 2048, 1024, (1.29 + 1.28 + 1.40) / 3, (1.59 + 1.59 + 1.85) / 3),
    "olmo3-moe-3.2b": (1024, 4096, 4096, (1.53 + 1.51 + 1.28) / 3, (1.88 + 1.77 + 1.63) / 3),
    "olmo3-moe-8e": (8192, 4096, 4096, (1.42 + 1.56 + 1.47) / 3, (2.21 + 1.95 + 1.94) / 3),
}
"""fp8_rowwise's grouped expert GEMMs (torch._scaled_grouped_mm, rowwise scales) over bf16
torch._grouped_mm, the mean of the forward, dgrad and wgrad passes, operands quantized beforehand,
uniform groups, 16,384 tokens, on the H200 (session 11's probe, docs/bench/session11/call3_probe.json;
the table in docs/precision.md, "fp8_rowwise"). The planner runs these experts at the bf16 grouped
rate (timing.expert_gemm_share) x that ratio (timing.fp8_rowwise_speedup: linear in the log of a local
expert's rows x d_model x expert_hidden between the shapes, as for BF16_CUBLAS_MEASURED); their
quantization is a separate term."""
EFF_FP8_ROWWISE_GEMM = {True: 1422 / 1979, False: 1080 / 1979}
"""Dense fp8_rowwise linears (torch._scaled_mm, rowwise scales), by precision.fp8_fast_accum. True:
measured in a whole step on the H200, session 15 (docs/bench/session15/call3_prof_s2_fused.json,
olmoe3-4l-8e compiled): the 84 cuBLAS FP8 GEMMs of the attention, shared-expert and dense-MLP linears
(forward, dgrad and wgrad; 56.1 TFLOP a step by the planner's count) took 39.43 ms, 1422 TFLOP/s.
False (fp32 promotion): not measured; fp8_blockwise's dense rate (EFF_FP8_GEMM) assumed."""
ROWWISE_QUANT_BYTES = {"rows": 3.0, "cols": 3.0, "chunks": 2.0}
"""HBM bytes per element of fp8_rowwise's quantization passes [code] (core/precision/fp8_rowwise.py,
fp8_rowwise_triton.py): ``rows``, an operand's e4m3 rows (read 2, write 1; and its per-16-row column
maxima in the same read where the fused kernel serves: grouped operands up to 4096 columns with
precision.fp8_fused_amax, fp8_rowwise_triton.rows_chunks_fits); ``cols``, its columns along the
tokens for the wgrad (read 2, write 1 transposed); ``chunks``, the column maxima in a read of their own
(the two-kernel path). A weight's pass reads its master (4 B, or 2 from the experts' bf16 copies)."""
EFF_ROWWISE_ROWS = 2.8 / 4.8
"""Achieved / datasheet HBM rate of fp8_rowwise's row quantization (with the column maxima where
fused): 2.55-3.18 TB/s on the H200 (tools/bench_quantize.py --rowwise, session 15 call 3: OLMoE's
[132032, 2048] 0.277-0.293 ms, olmoe3's [65664, 4096] 0.342 ms); also used for the maxima-only pass."""
EFF_ROWWISE_COLS = 1.1 / 4.8
"""The same for the columns' pass (fp8_rowwise_triton.quantize_cols, a gather by expert-sorted rows
and a transposed e4m3 store): the grouped operand's rows + columns took 0.866 ms (OLMoE) and 1.351 ms
(olmoe3) in the same sweep, so the columns' pass, 3 B over 270M and 269M elements, ran at 1.42 and
0.80 TB/s; their mean. The dense linears' stacked columns (quantize_stacked_cols) assumed the same."""
LOW_PRECISION = (PrecisionRecipe.mxfp8, PrecisionRecipe.fp8_blockwise, PrecisionRecipe.fp8_rowwise)
