"""Expert groups for low-precision grouped GEMMs: padding each group's rows to a multiple of a
quantization block (on the device, no host sync), and bf16 grouped GEMMs that run anywhere (one
kernel, or one GEMM per group).

A weight-gradient GEMM reduces over tokens, so its operands are quantized in blocks along the
rows; a block must not hold rows of two experts. ``pad_groups`` moves each group to a start that
is a multiple of ``multiple`` and zero-fills the gap: zero rows add nothing to any dot product,
and a block's scale then comes from one expert's rows only. The padded buffer has a static size
(R + E x (multiple - 1), rounded up), so nothing waits for the counts to reach the host.

Legend: R rows, C columns, E groups, P padded rows, I / O a GEMM's input / output dims.
"""

from __future__ import annotations

import torch

__all__ = ["gather_rows", "grouped_mm_2d2d", "grouped_mm_2d3d", "host_ends", "host_sizes", "padded_host_ends", "pad_groups",
           "pad_rows", "padded_rows", "padded_source_rows"]


def pad_rows(x_RC: torch.Tensor, multiple: int) -> torch.Tensor:
    """x with zero rows appended up to a multiple of ``multiple`` rows (x itself when it is one): a
    dense linear's tokens as whole quantization blocks or aligned GEMM rows."""
    pad = -x_RC.shape[0] % multiple
    return torch.nn.functional.pad(x_RC, (0, 0, 0, pad)) if pad else x_RC


def padded_rows(rows: int, groups: int, multiple: int) -> int:
    """Static size of pad_groups' output: enough for any split of ``rows`` into ``groups``."""
    n = rows + groups * (multiple - 1)
    return -(-n // multiple) * multiple


def pad_groups(x_RC: torch.Tensor, offsets_E: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x_RC [R, C] in groups [offsets_E[e-1], offsets_E[e]) -> (x_PC [P, C], padded_offsets_E int32):
    group e's rows start at padded_offsets_E[e-1], a multiple of ``multiple``, followed by zero rows
    up to the next multiple. Rows past offsets_E[-1] are dropped. No host sync."""
    src_P, padded_offsets_E = padded_source_rows(offsets_E, x_RC.shape[0], multiple)
    return gather_rows(x_RC, src_P), padded_offsets_E


def padded_source_rows(offsets_E: torch.Tensor, rows: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pad_groups as an index: (src_P int32 [P], padded_offsets_E int32) with src_P[p] the row of x
    that row p of pad_groups(x, offsets_E, multiple) holds, -1 for a zero row. A kernel that reads
    x[src_P] makes the padded operand without the padded copy. No host sync."""
    E = offsets_E.numel()
    P = padded_rows(rows, E, multiple)
    offsets_E = offsets_E.to(torch.int64)
    sizes_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    padded_sizes_E = (sizes_E + multiple - 1) // multiple * multiple
    padded_offsets_E = torch.cumsum(padded_sizes_E, 0)
    p_P = torch.arange(P, device=offsets_E.device)
    group_P = torch.searchsorted(padded_offsets_E, p_P, right=True).clamp_max(E - 1)
    within_P = p_P - (padded_offsets_E - padded_sizes_E)[group_P]
    src_P = (offsets_E - sizes_E)[group_P] + within_P
    src_P = torch.where((within_P < sizes_E[group_P]) & (p_P < padded_offsets_E[-1]), src_P, -1)
    return src_P.to(torch.int32), padded_offsets_E.to(torch.int32)


def gather_rows(x_RC: torch.Tensor, src_P: torch.Tensor) -> torch.Tensor:
    """x[src_P] with zero rows where src_P < 0 (the torch reference of a gathering kernel)."""
    rows = x_RC[src_P.clamp_min(0).long()]
    return torch.where((src_P >= 0)[:, None], rows, torch.zeros((), dtype=x_RC.dtype, device=x_RC.device))


Offsets = torch.Tensor | list[int]
"""A per-group loop's groups: the inclusive cumsum on the device, or already read to the host (a
caller with several loops over the same groups reads it once: host_ends)."""


def host_ends(offsets_E: Offsets) -> list[int]:
    """The inclusive cumsum on the host: the one device -> host sync of per-group loops (none when
    it is a list already)."""
    return offsets_E if isinstance(offsets_E, list) else offsets_E.tolist()


def padded_host_ends(ends: list[int], multiple: int) -> list[int]:
    """padded_source_rows' padded_offsets_E from the host ends (each group rounded up to a whole
    ``multiple``), made on the host: no second sync for a loop over the padded groups."""
    out, total, start = [], 0, 0
    for end in ends:
        total += -(-(end - start) // multiple) * multiple
        out.append(total)
        start = end
    return out


def host_sizes(offsets_E: Offsets, rows: int) -> list[int]:
    """Each group's rows, then the rows past the last group (rows: the tensor's row count)."""
    ends = host_ends(offsets_E)
    return [end - start for start, end in zip([0] + ends[:-1], ends)] + [rows - ends[-1]]


def grouped_mm_2d3d(a_RK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: Offsets,
                    per_expert: bool = False) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ b[e] -> [R, N] in a's dtype (fp32 accumulation).
    torch._grouped_mm on CUDA (one kernel, no sync); with ``per_expert`` (precision.bf16_experts=cublas),
    and always on the CPU, one ``torch.mm`` per group written in place into the output (cuBLAS on
    CUDA; the group sizes read on the host: a sync, unless offsets_E is a host list already; the
    views made by one split each). Rows past offsets_E[-1] are zero on the loop (unspecified on the
    one kernel). Not differentiable: the callers are autograd Functions and custom ops."""
    if a_RK.is_cuda and not per_expert:
        return torch._grouped_mm(a_RK, b_EKN, offs=offsets_E.to(torch.int32))
    return _loop_2d3d(a_RK, b_EKN, offsets_E)


# The loops below read the group sizes on the host and split by them: traced, torch.compile would
# specialize on every step's routing and recompile (it did, every step on the CPU, until its cache
# limit). They run eagerly wherever a compiled region calls them (one graph break, no recompiles).
@torch.compiler.disable
def _loop_2d3d(a_RK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: Offsets) -> torch.Tensor:
    """grouped_mm_2d3d's loop (eager under torch.compile)."""
    sizes = host_sizes(offsets_E, a_RK.shape[0])
    out_RN = a_RK.new_empty(a_RK.shape[0], b_EKN.shape[-1])
    a_parts, out_parts = a_RK.split(sizes), out_RN.split(sizes)
    for e, (n, b_KN) in enumerate(zip(sizes, b_EKN.unbind(0))):
        if n:
            torch.mm(a_parts[e], b_KN, out=out_parts[e])
    out_parts[-1].zero_()
    return out_RN


def grouped_mm_2d2d(a_MR: torch.Tensor, b_RN: torch.Tensor, offsets_E: Offsets,
                    per_expert: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[e] = a[:, rows of e] @ b[rows of e] -> [E, M, N] (the weight gradient: a reduction over each
    group's rows; an empty group gives zeros). torch._grouped_mm on CUDA; with ``per_expert``, and
    always on the CPU, one ``torch.mm`` per group into its slice of the output (as grouped_mm_2d3d).
    ``out_dtype`` (the loop only; e.g. fp32 for bf16 operands): each group's GEMM writes its fp32
    sums in that dtype instead of rounding them to a's (cuBLAS's bf16 GEMM with an fp32 output on
    CUDA; the operands widened first on the CPU: exact products, the same sums), so no cast pass
    follows; the one kernel ignores it (its output is cast by the caller)."""
    if a_MR.is_cuda and not per_expert:
        return torch._grouped_mm(a_MR, b_RN, offs=offsets_E.to(torch.int32))
    return _loop_2d2d(a_MR, b_RN, offsets_E, out_dtype)


@torch.compiler.disable
def _loop_2d2d(a_MR: torch.Tensor, b_RN: torch.Tensor, offsets_E: Offsets,
               out_dtype: torch.dtype | None) -> torch.Tensor:
    """grouped_mm_2d2d's loop (eager under torch.compile, as _loop_2d3d)."""
    sizes = host_sizes(offsets_E, b_RN.shape[0])
    dt = out_dtype or a_MR.dtype
    widen = dt != a_MR.dtype
    out_EMN = a_MR.new_empty(len(sizes) - 1, a_MR.shape[0], b_RN.shape[1], dtype=dt)
    a_parts, b_parts = a_MR.split(sizes, dim=1), b_RN.split(sizes)
    for e, out_MN in enumerate(out_EMN.unbind(0)):
        a_Mn, b_nN = a_parts[e], b_parts[e]
        if not sizes[e]:
            out_MN.zero_()
        elif not widen:
            torch.mm(a_Mn, b_nN, out=out_MN)
        elif a_MR.is_cuda:
            torch.mm(a_Mn, b_nN, out_dtype=dt, out=out_MN)
        else:
            torch.mm(a_Mn.to(dt), b_nN.to(dt), out=out_MN)
    return out_EMN
