#!/usr/bin/env python
"""Where a training step's kernel time goes: torch.profiler over the step tools/bench_train.py
measures, every kernel put in one category (GEMM, attention, optimizer, casts and copies, fills,
loss, routing, the embedding's backward, norm, fused pointwise, ...), printed as a table per
category and the top kernels.

    python tools/profile_step.py --preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 \
        --seq-len 4096 --batch 4 --compile
    python tools/profile_step.py --preset tiny-moe --seq-len 256 --batch 2 --real-text --trace runs/bench/step.json

The profiler skips --wait steps (compilation happens there), runs --warmup steps untimed and records
--active steps; every figure is per active step. On a GPU the kernels are the CUDA kernels, memsets
and memcpys (their device time); on the CPU they are the CPU ops (their self time), so the tool runs
anywhere. A category's share is of the summed kernel time (streams that overlap count twice);
"busy" is that sum over the step's wall time; on a GPU, "GPU idle" is the step's time with no kernel
running (before its first kernel, between kernels, after its last), the between-kernel gaps listed
by the kernel each one waited for and where that was launched (a host-bound stretch, or a sync,
shows there; with --stack also the innermost line of this project's code on the launching op's
Python stack). This tool synchronizes after every step, so that a step's kernels end inside its
window; each step therefore begins with the host launching its first kernels against an empty queue.
On olmoe3-4l-8e that start is about 2.5 ms of the idle (a chrome trace, session 41), idle that an
unsynchronized step does not have (its host runs far ahead). Whether it does is the idle table's host line:
when the host returned from launching the step's last kernel against when the GPU finished, GPU-bound where
the host was done more than a tenth of the step earlier (HOST_AHEAD). A GEMM table gives the step's GEMMs by
op and operand shapes (record_shapes): calls, ms and achieved TFLOP/s (2MKN from the shapes; each
grouped form counted as torch._grouped_mm runs it), so a GEMM family below its rate shows; on a GPU the card's SM
clock and power over the active steps are sampled beside it (tools/clocks.py: a power-capped clock lowers every
GEMM's rate). The headline is the share of kernel time that is
neither GEMM nor attention. Overrides are --model.*, --memory.*, --optimizer.*, --precision.* (e.g.
--optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer) and (with --real-text) --data.*.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import re
import sys
from typing import Iterable

import torch
from torch.autograd import DeviceType

from moetron.core.metrics import run_environment

from cli import run_cli, write_report  # tools/cli.py
from clocks import ClockSampler  # tools/clocks.py
from step_builder import add_step_arguments, build_trainer, step_configs, token_stream

# Inductor names a generated kernel triton_{poi,red,per,tem}_fused_<aten ops>_<n>; one made of
# layout ops and casts only is a copy (the per-use fp32 -> bf16 cast-and-transpose of the weights).
_INDUCTOR_COPY = r"^triton_\w+_fused(?:_(?:_to_copy|clone|copy|transpose|permute|view|_unsafe_view|t|expand|cat))+_\d+$"

# (category, pattern): the first pattern found in a kernel's (or CPU op's) name wins, so the order
# matters: attention before gemm (cutlass FMHA), the inductor rules before the generic copy and fill.
RULES: list[tuple[str, str]] = [
    ("communication", r"nccl|c10d::|all_gather|allgather|reduce_scatter|all_reduce|allreduce|all_to_all|alltoall"),
    # cuDNN's fused attention backward also runs helper passes as kernels of their own: D = rowsum(dO * O)
    # before it and the fp32 dQ accumulator's conversion after it (its sum of dK and dV over a query group's
    # heads, fmha_reduce_head, says fmha).
    ("attention", r"flash|fmha|efficient_attention|flex_attention|scaled_dot_product|_attention|"
                  r"cudnn::fusion::(?:compute_dot_do_o|convert_dq_to_16bits)"),
    ("optimizer", r"multi_tensor_apply|[Ff]used[_]?[Aa]dam|_foreach_|linalg_vector_norm|_adamw(?:_mx_pair|_q8)?_kernel|"
                  r"^_sum_of_squares_kernel$"),  # the last: core/grad_norm_triton.py (the clipping norm)
    # moetron's routing kernels (core/moe/kernels/routing.py) and custom ops, and the router's top-k.
    ("routing", r"_(?:route|scatter_rows|zero_unwritten_rows|combine_rows)\w*_kernel|^moetron::|topk|TopK|[Ss]ort"),
    # The loss kernels, moetron's fused one (core/layers/cross_entropy_triton.py) included.
    ("loss", r"log_softmax|LogSoftMax|nll_loss|cross_entropy|logsumexp|^_ce_\w*_kernel$"),
    # The token embedding's weight gradient: torch's (sort, segment sums) and moetron's Triton pass
    # (core/layers/embedding_triton.py); its zero-fill and sort through ENCLOSING below.
    ("embedding", r"sum_and_scatter|compute_grad_weight|krn_partial|partials_per_segment|num_of_partial_segments|"
                  r"embedding_backward|^_embedding_\w*_kernel$"),
    # Inductor kernels fused into a scaled GEMM's operands (fp8_rowwise's quantization traced into the
    # graph: their names list the GEMM they feed, e.g. triton_poi_fused__scaled_grouped_mm__to_copy_...).
    ("cast_copy", r"^triton_(?:poi|red|per)_fused_\w*_scaled_(?:grouped_)?mm"),
    # GEMMs, moetron's FP8 grouped ones (core/precision/fp8_triton.py, fp8_gluon.py) included.
    ("gemm", r"[Gg]emm|gemv|cutlass|cublas|xmma|nvjet|_grouped_mm|splitKreduce|^_fp8_grouped_gemm_\w*_kernel$|"
             r"^_gluon_\w*_kernel$|"
             r"^aten::(?:mm|addmm|bmm|baddbmm|addbmm|matmul|linear|dot)$|^triton_tem_fused_\w*mm"),
    ("cast_copy", _INDUCTOR_COPY),
    # Norms: torch's, inductor's reductions, and moetron's eager RMSNorm (core/layers/norm_triton.py).
    ("norm", r"rms_norm|layer_norm|RowwiseMoments|rsqrt|^_rmsnorm_(?:fwd|bwd)_kernel$"),
    # inductor's fused kernels, the experts' SwiGLU and the eager RoPE (core/layers/rope_triton.py)
    ("fused_pointwise", r"^triton_(?:poi|red|per)_|^_swiglu_(?:fwd|bwd)_kernel$|^_rope_kernel$"),
    ("fill_int32", r"FillFunctor<int>"),
    ("fill", r"fill|FillFunctor|zero_|zeros|Memset|memset"),
    ("cast_copy", r"copy|^aten::to$|contiguous|clone|transpose|cast_transpose|\bcast_|Memcpy|memcpy|CatArray|"
                  r"^aten::cat$|"
                  # moetron's quantization kernels (core/precision/blockwise_triton.py, mx_triton.py)
                  r"^_(?:fp8|mx)_(?:(?:de)?quantize\w*|rows_and_cols)_kernel$|"
                  # fp8_rowwise's (core/precision/fp8_rowwise_triton.py)
                  r"^_(?:chunk_amax|group_cols_amax|quantize_cols|quantize_rows|quantize_rows_chunks|quantize_stacked_cols)_kernel$"),
    ("elementwise", r"elementwise_kernel|reduce_kernel|^aten::(?:add|sub|rsub|mul|div|neg|exp|log|pow|mean|sum|"
                    r"where|silu|sigmoid|gelu|tanh|softmax|_softmax|clamp|abs|sqrt|maximum|minimum|eq|ne|lt|gt|"
                    r"ge|le)(?:_backward(?:_data)?)?_?$"),
    ("other", r""),
]
# (category, pattern of an enclosing op or range): a kernel launched inside one is that category unless
# its name says GEMM or attention: the unfused optimizer's lerp/addcdiv/sqrt, the chunked fused loss's
# exp/sum/casts (its matmuls stay gemm), the embedding backward's zero-fill and sort, whatever an attention
# backend's op launches (its fills and helper passes, and any copy the backend makes of its inputs: that backend's
# cost). Only the backends' ops: a copy the dispatcher (aten::scaled_dot_product_attention) makes before it
# picks one stays a copy. Routing has none, so the int32 fills inside it stay visible.
ENCLOSING: list[tuple[str, str]] = [
    ("attention", r"^aten::_(?:scaled_dot_product_)?(?:cudnn|flash|efficient)_attention(?:_forward|_backward)?$"),
    ("optimizer", r"^Optimizer\.(?:step|zero_grad)#"),
    ("loss", r"CrossEntropy|^aten::cross_entropy_loss$"),
    ("embedding", r"EmbeddingBackward|^aten::embedding_(?:dense_)?backward$"),
]
CATEGORIES: list[str] = list(dict.fromkeys(c for c, _ in RULES))
_COMPILED = [(c, re.compile(p)) for c, p in RULES]
_ENCLOSING = [(c, re.compile(p)) for c, p in ENCLOSING]
# Neither of these counts against the target (non-GEMM, non-attention time <= 15%).
COMPUTE = ("gemm", "attention")


def classify(name: str, input_dtypes: Iterable[str] | None = None, enclosing: Iterable[str] = ()) -> str:
    """The category of a kernel or CPU op ``name``: the first matching rule of RULES; unless that is
    gemm or attention, the first ENCLOSING rule matching one of the ``enclosing`` op names
    (innermost first) overrides it. A fill whose name does not give its dtype is ``fill_int32``
    when its op record's inputs (``input_dtypes``, as the profiler writes them: 'int' is int32,
    'long int' int64) say so."""
    category = next(c for c, pattern in _COMPILED if pattern.search(name))
    if category not in COMPUTE:
        outer = (c for op in enclosing for c, pattern in _ENCLOSING if pattern.search(op))
        category = next(outer, category)
    if category == "fill" and input_dtypes and "int" in input_dtypes:
        return "fill_int32"
    return category


def _enclosing(op) -> list[str]:
    """Names of the CPU ops and ranges around ``op`` (a profiler event), innermost first, ``op`` included;
    not the Python frames --stack records (with_stack: ``is_python_function`` events), so categories
    and sites read the same with it."""
    names = []
    while op is not None:
        if not getattr(op, "is_python_function", False):
            names.append(op.name)
        op = op.cpu_parent
    return names


# CPU-side records that are no op: CUDA runtime/driver calls and CUPTI overhead records. On torch <= 2.11
# an unlinked one takes the kernels of whichever op shares its correlation id (pytorch #124388, #193392).
_NOT_AN_OP = re.compile(r"^cu(?:da)?[A-Z]|^(?:Activity Buffer Request|Lazy Function Loading)$")


def _launching_ops(events, annotation) -> dict:
    """(kernel name, duration) -> the CPU op or range that launched it, read off the ops' ``kernels``
    lists (torch <= 2.11, whose events carry no linked_correlation_id). Those lists are used for this
    look-up only, never for time: one kernel can sit in several lists (an unlinked runtime or CUPTI
    overhead record with the op's correlation id lists the op's kernels again). The first list wins,
    in this order: real ops first (not a runtime or overhead record; activity_type cpu_op or
    user_annotation where torch gives it), innermost first (an op before a range around it), then in
    event order."""
    def real(op) -> bool:
        kind = getattr(op, "activity_type", None)
        return (kind in ("cpu_op", "user_annotation") if kind else True) and not _NOT_AN_OP.search(op.name)

    ops = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async and e.kernels]
    found: dict = {}
    for op in sorted(ops, key=lambda e: (not real(e), -len(_enclosing(e)))):  # stable: event order
        for k in op.kernels:
            if not (annotation(op) and k.name == op.name):  # the range's own device-side mirror
                found.setdefault((k.name, k.duration), op)
    return found


def _annotation(e) -> bool:
    """A record_function range (ProfilerStep#, Optimizer.step#), on either side."""
    return getattr(e, "is_user_annotation", False) or "annotation" in (getattr(e, "activity_type", None) or "")


def device_kernels(events) -> list[tuple]:
    """(device event, the CPU op that launched it or None) for every kernel, memset and memcpy
    recorded on the GPU, each device event once; a range's device-side mirror is no kernel (by its
    flag, or by its name on older torch). On torch <= 2.11, whose events carry no
    linked_correlation_id, the launching op is found through the ops' kernel lists (_launching_ops)."""
    linked = bool(events) and hasattr(events[0], "linked_correlation_id")
    if linked:
        ops = {e.id: e for e in events if e.device_type == DeviceType.CPU and e.linked_correlation_id == 0}
    else:
        ops = _launching_ops(events, _annotation)
    ranges = {e.name for e in events if e.device_type == DeviceType.CPU and _annotation(e)}
    out = []
    for e in events:
        if e.device_type != DeviceType.CUDA or _annotation(e) or e.name in ranges:
            continue
        out.append((e, ops.get(e.linked_correlation_id if linked else (e.name, e.time_range.elapsed_us()))))
    return out


def kernel_times(events, on_device: bool) -> list[tuple[str, float, str]]:
    """(name, microseconds, category) of every kernel recorded: device activity on a GPU, each device
    event once (classified with its launching op's dtypes and enclosing ranges), the CPU ops' self
    time otherwise."""
    if on_device:
        return [(e.name, e.time_range.elapsed_us(),
                 classify(e.name, getattr(op, "input_dtypes", None) if op is not None else None, _enclosing(op)))
                for e, op in device_kernels(events)]
    return [(e.name, e.self_cpu_time_total,
             classify(e.name, getattr(e, "input_dtypes", None), _enclosing(e.cpu_parent)))
            for e in events if e.device_type == DeviceType.CPU and not _annotation(e) and not e.is_async
            and not e.name.startswith(("ProfilerStep", "[")) and not getattr(e, "is_python_function", False)]


# The project's source root (tools/..): frames under it are this project's code.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


_FRAME = re.compile(r"^(.*)\((\d+)\): (.*)$")


@functools.lru_cache(maxsize=4096)
def _project_file(path: str) -> str | None:
    """A recorded frame's file as a path under the project's root, or None outside it. The profiler
    names a file by its path with the longest sys.path entry cut off ('core/adamw.py' where the
    root is on sys.path, as under tools/ and pytest), else absolute; installed packages (a
    site-packages under the root, e.g. a .venv) are not the project's."""
    root = os.path.realpath(_ROOT)
    full = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
    rel = os.path.relpath(full, root)
    if rel.startswith(os.pardir) or {"site-packages", "dist-packages"} & set(rel.split(os.sep)):
        return None
    return rel if os.path.isfile(full) else None


def _project_frame(op) -> str | None:
    """The innermost frame of this project's code on ``op``'s Python stack (recorded with --stack:
    torch.profiler's with_stack, whose frames are Python-function events around the op, named
    'path(line): function'), as 'core/layers/loss.py(153): forward', or None."""
    while op is not None:
        if getattr(op, "is_python_function", False):
            m = _FRAME.match(op.name)
            rel = _project_file(m.group(1)) if m else None
            if rel is not None:
                return f"{rel}({m.group(2)}): {m.group(3)}"
        op = op.cpu_parent
    return None


def stack_frames_note(events) -> tuple[int, str | None]:
    """(how many Python frames --stack recorded, a note when none): some builds record none (torch
    2.11 with Python 3.12 on the GPU machine: no Python-function events and an empty
    ``FunctionEvent.stack``, with with_stack=True alone in session 30 and with stack_config's verbose
    config too in session 31), and the idle table then names ops only."""
    frames = sum(1 for e in events if getattr(e, "is_python_function", False))
    if frames:
        return frames, None
    return 0, (f"--stack: torch {torch.__version__} on Python {sys.version.split()[0]} recorded no Python frames "
               f"(with_stack gave no Python-function events), so the idle table names the launching ops only")


def _launch_site(op) -> str:
    """Where a kernel was launched from, for the idle table: its launching op and the outermost range
    around it below the profiler's step (e.g. 'aten::mm in Optimizer.step#...'), or 'unknown'; with
    a recorded stack, then ' at ' the innermost line of this project's code (_project_frame)."""
    if op is None:
        return "unknown"
    names = [n for n in _enclosing(op) if not n.startswith("ProfilerStep")]
    site = names[0] if len(names) == 1 else f"{names[0]} in {names[-1]}"
    frame = _project_frame(op)
    return site if frame is None else f"{site} at {frame}"


HOST_AHEAD = 0.1
"""A step whose host was done launching more than this share of the step before its GPU finished is
printed as GPU-bound."""


def idle_time(events, steps: int, top: int = 10) -> dict:
    """Where the GPU has no kernel running inside the profiler's step windows (the CPU's ProfilerStep#
    ranges; each step synchronizes before the next, so its kernels end inside its window), per step:
    the idle milliseconds before the step's first kernel, between kernels (any stream: the kernels'
    union) and after its last one, and the ``top`` launch sites that the between-kernel gaps wait
    for, each gap put on the kernel that ends it (its category and _launch_site): a gap there is
    the GPU waiting for the host to launch that kernel (or for a host sync before it).

    Also, over the windows whose kernels have known launching ops, per step: ``host_done_ms``, when the
    host returned from launching the step's last kernel, and ``gpu_done_ms``, when the GPU finished the
    step's kernels (both from the window's start). Their difference is how far ahead the host ran at
    the end of the step: a GPU-bound step's host is done long before its GPU (session 41's trace: 60 of
    287 ms); a host-bound one's GPU finishes a launch behind it. The profiler slows the host, so a
    profiled host that is ahead is ahead unprofiled too."""
    windows = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == DeviceType.CPU and e.name.startswith("ProfilerStep"))
    kernels = sorted(((e.time_range.start, e.time_range.end), op, e.name) for e, op in device_kernels(events))
    before = between = after = 0.0
    sites: dict = collections.defaultdict(lambda: [0.0, 0])
    host_done, gpu_done = [], []
    for w0, w1 in windows:
        inside = [k for k in kernels if w0 <= k[0][0] < w1]
        if not inside:
            before += w1 - w0
            continue
        launched = [op.time_range.end for _, op, _ in inside if op is not None]
        if launched:
            host_done.append(max(launched) - w0)
            gpu_done.append(max(end for (_, end), _, _ in inside) - w0)
        before += max(inside[0][0][0] - w0, 0)
        reach = inside[0][0][1]
        for (start, end), op, name in inside[1:]:
            if start > reach:
                gap = start - reach
                between += gap
                key = (classify(name, getattr(op, "input_dtypes", None) if op is not None else None,
                                _enclosing(op)), _launch_site(op))
                sites[key][0] += gap
                sites[key][1] += 1
            reach = max(reach, end)
        after += max(w1 - reach, 0)
    n = max(steps, 1)
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return {"before_ms": before / 1e3 / n, "between_ms": between / 1e3 / n, "after_ms": after / 1e3 / n,
            "idle_ms": (before + between + after) / 1e3 / n,
            "host_done_ms": sum(host_done) / 1e3 / len(host_done) if host_done else None,
            "gpu_done_ms": sum(gpu_done) / 1e3 / len(gpu_done) if gpu_done else None,
            "sites": [{"category": c, "site": site, "ms_per_step": us / 1e3 / n, "gaps_per_step": k / n}
                      for (c, site), (us, k) in ranked]}


def breakdown(kernels: list[tuple[str, float, str]], steps: int, step_ms: float, top: int = 20) -> dict:
    """Per-category and top-``top`` kernel figures per step from ``kernel_times`` over ``steps`` steps."""
    total_us = sum(us for _, us, _ in kernels)
    share = (lambda us: us / total_us) if total_us > 0 else (lambda us: 0.0)
    per_cat_us, per_cat_n = collections.Counter(), collections.Counter()
    per_name = collections.defaultdict(lambda: [0.0, 0])
    for name, us, category in kernels:
        per_cat_us[category] += us
        per_cat_n[category] += 1
        per_name[(name, category)][0] += us
        per_name[(name, category)][1] += 1
    categories = [{"category": c, "ms_per_step": per_cat_us[c] / 1e3 / steps, "share": share(per_cat_us[c]),
                   "kernels_per_step": per_cat_n[c] / steps} for c in CATEGORIES]
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    top_kernels = [{"name": name, "category": c, "ms_per_step": us / 1e3 / steps, "share": share(us),
                    "calls_per_step": n / steps} for (name, c), (us, n) in ranked]
    kernel_ms = total_us / 1e3 / steps
    return {
        "active_steps": steps,
        "step_ms": step_ms,
        "kernel_ms_per_step": kernel_ms,
        "busy": kernel_ms / step_ms if step_ms > 0 else None,
        "non_gemm_attention_share": 1.0 - sum(share(per_cat_us[c]) for c in COMPUTE) if total_us > 0 else None,
        "categories": categories,
        "top_kernels": top_kernels,
    }


# The ops whose kernels are GEMMs, and where their two operands sit among the recorded input shapes.
_GEMM_OPERANDS = {"aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::addmm": (1, 2), "aten::baddbmm": (1, 2),
                  "aten::_grouped_mm": (0, 1), "aten::_scaled_mm": (0, 1), "aten::_scaled_grouped_mm": (0, 1)}


def _operands(name: str, shapes) -> tuple | None:
    """The two operand shapes of GEMM op ``name`` among its recorded input shapes (record_shapes), or
    None (not a GEMM op, shapes missing)."""
    where = _GEMM_OPERANDS.get(name)
    if where is None or not shapes or len(shapes) <= max(where):
        return None
    return tuple(tuple(shapes[i]) for i in where)


def gemm_flops(name: str, shapes) -> float | None:
    """FLOPs of one call of GEMM op ``name`` from its recorded input shapes, or None: _mm_flops of its
    two operands."""
    operands = _operands(name, shapes)
    return None if operands is None else _mm_flops(*operands)


def _mm_flops(a, b) -> float | None:
    """a [M, K] @ b [K, N]: 2MKN; batched [B, M, K] @ [B, K, N]: 2BMKN; grouped (torch._grouped_mm,
    groups by offsets): 2-D x 3-D [M, K] @ [G, K, N] (each row meets one group) 2MKN, 2-D x 2-D
    [M, T] @ [T, N] (groups along T, the weight gradient) 2MTN, 3-D x 2-D [G, M, K] @ [K, N] 2MKN.
    Rows past the last offset count too (the routed rows fill the operand)."""
    a, b = list(a), list(b)
    if len(a) == 2 and len(b) == 2:
        return 2.0 * a[0] * a[1] * b[1]
    if len(a) == 2 and len(b) == 3:
        return 2.0 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 3:
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 3 and len(b) == 2:
        return 2.0 * a[1] * a[2] * b[1]
    return None


def _outermost_gemm(op):
    """The outermost GEMM op around ``op`` (itself included; e.g. a grouped GEMM that loops over mm),
    or None."""
    found = None
    while op is not None:
        if op.name in _GEMM_OPERANDS:
            found = op
        op = op.cpu_parent
    return found


def gemm_table(events, on_device: bool, steps: int, top: int = 12) -> list[dict]:
    """The step's GEMMs by op and operand shapes, per step: calls, ms (on a GPU the kernels each op
    launched, split-K reductions included; on the CPU the op's total time) and achieved TFLOP/s
    (gemm_flops), slowest total first; past the ``top`` slowest, one last row "the other shapes"
    sums the rest (its "shapes" their count, its rate over those whose FLOPs are known). Shapes need
    the profile's record_shapes."""
    acc: dict = collections.defaultdict(lambda: [0.0, set()])
    if on_device:
        timed = [(e.time_range.elapsed_us(), _outermost_gemm(op)) for e, op in device_kernels(events)
                 if op is not None]
    else:
        timed = [(e.cpu_time_total, e) for e in events
                 if e.device_type == DeviceType.CPU and e.name in _GEMM_OPERANDS and _outermost_gemm(e) is e]
    for us, op in timed:
        if op is None:
            continue
        key = (op.name, _operands(op.name, getattr(op, "input_shapes", None)) or ())
        acc[key][0] += us
        acc[key][1].add(op.id)
    rows = []
    for (name, operands), (us, ids) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        flops = _mm_flops(*operands) if operands else None
        rows.append({"op": name, "operands": [list(o) for o in operands], "calls_per_step": len(ids) / steps,
                     "ms_per_step": us / 1e3 / steps,
                     "tflops": flops * len(ids) / (us * 1e-6) / 1e12 if flops and us > 0 else None})
    if len(rows) <= top:
        return rows
    rest = rows[top:]  # summed into one last row, so the table accounts for all the GEMMs' time
    rated_ms = sum(r["ms_per_step"] for r in rest if r["tflops"] is not None)
    return rows[:top] + [{
        "op": "the other shapes", "operands": [], "shapes": len(rest),
        "calls_per_step": sum(r["calls_per_step"] for r in rest), "ms_per_step": sum(r["ms_per_step"] for r in rest),
        # FLOPs over time of the shapes with a rate: each rate weighted by its time
        "tflops": sum(r["tflops"] * r["ms_per_step"] for r in rest if r["tflops"] is not None) / rated_ms
        if rated_ms > 0 else None}]


def stack_config(stack: bool) -> dict:
    """The profiler's extra arguments for --stack: the verbose experimental config, without which
    some builds keep no Python frames under with_stack (pytorch/pytorch #100253 and #127951). It did
    not bring them back on the GPU machine's torch 2.11 with Python 3.12 (session 31: still none);
    torch 2.13 on the CPU records the same frames with it or without."""
    if not stack:
        return {}
    from torch._C._profiler import _ExperimentalConfig

    return {"experimental_config": _ExperimentalConfig(verbose=True)}


def profile(trainer, data, device: torch.device, wait: int, warmup: int, active: int, trace: str = "",
            stack: bool = False, clocks: ClockSampler | None = None):
    """Run wait + warmup + active train steps under torch.profiler; the recorded events (active steps
    only). ``stack``: record each op's Python stack too (with_stack; slows the host, so the step's
    idle time grows: for finding sites, not for sizing them). ``clocks``: sampled over the active steps only
    (tools/clocks.py: the card's SM clock and power, which set its GEMMs' rate)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def on_trace_ready(prof):
        if trace:
            prof.export_chrome_trace(trace)

    schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1)
    # record_shapes gives each op its input dtypes (how an int32 fill is told from a float one).
    with contextlib.ExitStack() as sampling, torch.profiler.profile(
            activities=activities, schedule=schedule, record_shapes=True, with_stack=stack,
            on_trace_ready=on_trace_ready, **stack_config(stack)) as prof:
        for i in range(wait + warmup + active):
            if i == wait + warmup and clocks is not None:
                sampling.enter_context(clocks)
            trainer.train_step(data.next_batch())
            if device.type == "cuda":
                torch.cuda.synchronize()  # the step's kernels land inside its ProfilerStep window
            if i == wait + warmup + active - 1:
                sampling.close()  # before the last step() collects the trace (seconds of an idle card)
            prof.step()
    return prof.events()


def _short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def print_report(row: dict, header: str) -> None:
    print(header)
    busy = f", busy {100 * row['busy']:.0f}%" if row["busy"] is not None else ""
    print(f"{row['source']} over {row['active_steps']} active steps: step {row['step_ms']:.1f} ms wall, "
          f"{row['kernel_ms_per_step']:.1f} ms of kernels{busy}")
    if row.get("sm_clock_mhz") is not None:
        print(f"the card over them: SM clock {row['sm_clock_mhz']:.0f} MHz (least {row['sm_clock_min_mhz']:.0f}), "
              f"power {row['power_w']:.0f} W (most {row['power_max_w']:.0f}), {row['clock_samples']} samples")
    print(f"{'category':<16} {'ms/step':>9} {'share':>7} {'kernels':>9}")
    for c in row["categories"]:
        print(f"{c['category']:<16} {c['ms_per_step']:>9.2f} {100 * c['share']:>6.1f}% {c['kernels_per_step']:>9.0f}")
    print(f"{'total':<16} {row['kernel_ms_per_step']:>9.2f} {'100.0%':>7} "
          f"{sum(c['kernels_per_step'] for c in row['categories']):>9.0f}")
    print(f"\ntop {len(row['top_kernels'])} kernels")
    print(f"{'ms/step':>9} {'share':>7} {'calls':>6}  {'category':<16} name")
    for k in row["top_kernels"]:
        print(f"{k['ms_per_step']:>9.2f} {100 * k['share']:>6.1f}% {k['calls_per_step']:>6.0f}  {k['category']:<16} "
              f"{_short(k['name'], 100)}")
    idle = row.get("idle")
    if idle is not None:
        print(f"\nGPU idle per step: {idle['idle_ms']:.2f} ms ({idle['before_ms']:.2f} before the first kernel, "
              f"{idle['between_ms']:.2f} between kernels, {idle['after_ms']:.2f} after the last)")
        if idle.get("host_done_ms") is not None:
            ahead = idle["gpu_done_ms"] - idle["host_done_ms"]
            print(f"the host launched the step's last kernel at {idle['host_done_ms']:.1f} ms, the GPU finished at "
                  f"{idle['gpu_done_ms']:.1f} ms: the host ran {ahead:.1f} ms ahead at the end "
                  f"({'GPU-bound' if ahead > HOST_AHEAD * idle['gpu_done_ms'] else 'host-bound or synchronized'}; the "
                  f"profiler slows the host: unprofiled, compare --trainer.cuda_graph=true in bench_train.py)")
        if idle["sites"]:
            print(f"{'ms/step':>9} {'gaps':>6}  {'category':<16} the kernel each gap waited for, launched from")
            for g in idle["sites"]:
                print(f"{g['ms_per_step']:>9.2f} {g['gaps_per_step']:>6.0f}  {g['category']:<16} {_short(g['site'], 160)}")
    if row.get("gemms"):
        print("\nGEMMs by op and operand shapes, per step")
        print(f"{'ms/step':>9} {'calls':>6} {'TFLOP/s':>8}  op and operands")
        for g in row["gemms"]:
            rate = f"{g['tflops']:8.4g}" if g["tflops"] is not None else f"{'-':>8}"
            operands = (" x ".join(str(o) for o in g["operands"]) if g["operands"]
                        else f"({g['shapes']} shapes)" if "shapes" in g else "(shapes not recorded)")
            print(f"{g['ms_per_step']:>9.2f} {g['calls_per_step']:>6.0f} {rate}  {g['op']} {operands}")
    if row["non_gemm_attention_share"] is not None:
        print(f"\nnon-GEMM, non-attention share of kernel time: {100 * row['non_gemm_attention_share']:.1f}% "
              f"(issue #13 target <= 15%)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    add_step_arguments(parser)
    parser.add_argument("--wait", type=int, default=2, help="steps run before the profiler starts (compilation)")
    parser.add_argument("--warmup", type=int, default=2, help="steps the profiler runs but does not record")
    parser.add_argument("--active", type=int, default=3, help="steps recorded; every figure is per active step")
    parser.add_argument("--top", type=int, default=20, help="how many kernels to list by time")
    parser.add_argument("--json", default="runs/bench/profile_step.json")
    parser.add_argument("--trace", default="", help="also write the active steps' chrome trace here")
    parser.add_argument("--stack", action="store_true",
                        help="record Python stacks: the idle table names the project line that launched each "
                             "waited-for kernel (slows the host: use it to find sites, not to size them)")
    args, overrides = parser.parse_known_args(argv)
    if args.active < 1 or args.wait < 0 or args.warmup < 0:
        parser.error("--active must be >= 1, --wait and --warmup >= 0")
    model_cfg, memory, optim_cfg, precision, data_overrides, tcfg = step_configs(args.preset, args.precision, overrides,
                                                                           args.real_text)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = token_stream(model_cfg, args.batch, args.seq_len, device, args.real_text, data_overrides)
    trainer = build_trainer(model_cfg, memory, data, device, seq_len=args.seq_len,
                            precision=precision, compile=args.compile, micro_batch=args.micro_batch,
                            optimizer=optim_cfg, trainer=tcfg)
    clocks = ClockSampler(device)
    events = profile(trainer, data, device, args.wait, args.warmup, args.active, args.trace, args.stack, clocks)
    steps = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("ProfilerStep")]
    step_ms = sum(e.time_range.elapsed_us() for e in steps) / 1e3 / max(len(steps), 1)
    on_device = device.type == "cuda"
    row = {"preset": args.preset, "overrides": overrides, "real_text": args.real_text, "compile": args.compile,
           "source": "CUDA kernels" if on_device else "CPU ops (self time)",
           **breakdown(kernel_times(events, on_device), args.active, step_ms, args.top),
           "idle": idle_time(events, args.active) if on_device else None,
           "gemms": gemm_table(events, on_device, args.active), **clocks.summary()}
    env = {**run_environment(device, 1, "tools/profile_step.py", argv),
           "preset": args.preset, "seq_len": args.seq_len, "batch": args.batch, "model": model_cfg.to_dict()}
    print_report(row, f"{env['device']} | torch {env['torch']} | {args.preset} {model_cfg.describe()} | "
                      f"seq {args.seq_len} x {args.batch}{' | compiled' if args.compile else ''}"
                      f"{' | real text' if args.real_text else ''}")
    if args.stack:
        row["stack_frames"], note = stack_frames_note(events)
        if note:
            print(note, file=sys.stderr)
    if args.trace:
        print(f"wrote {args.trace}")
    write_report(args.json, env, [row])
    return 0


if __name__ == "__main__":
    run_cli(main)
