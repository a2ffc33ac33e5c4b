"""Routing kernels: reference vs naive loops, Triton (interpreted on CPU) vs reference, GPU checks.

The Triton kernels run on the CPU under TRITON_INTERPRET=1, which must be set before triton.jit
decorates them; so one subprocess (this file run as a script) computes every Triton case, and the
tests compare its saved results with the reference computed here. GPU tests are marked `gpu`.

Shape legend: T tokens, K top-k, E experts, D model dim, R buffer rows.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import pytest
import torch

from moetron.core.moe.kernels import RoutingPlan, combine_rows, reference, route, scatter_rows, use_backend


class Case(NamedTuple):
    T: int
    K: int
    E: int
    capacity: int | None
    ids: str  # "random" | "one_expert" (all slots on one expert, the others empty) | "skewed"
    id_dtype: torch.dtype = torch.int64
    D: int = 24
    dtype: torch.dtype = torch.float32

    @property
    def name(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        ids = str(self.id_dtype).removeprefix("torch.")
        return f"T{self.T}-K{self.K}-E{self.E}-cap{self.capacity}-{self.ids}-{ids}-D{self.D}-{dt}"


CASES = [
    Case(37, 2, 3, None, "random"),
    Case(37, 2, 3, 5, "random", torch.int32),
    Case(67, 8, 64, None, "random", torch.int32),
    Case(67, 8, 64, 3, "skewed"),
    Case(67, 4, 8, None, "one_expert"),
    Case(67, 4, 8, 17, "one_expert", torch.int32),
    Case(64, 1, 1, None, "random"),
    Case(64, 1, 1, 10, "random", torch.int32),
    Case(50, 8, 8, 0, "random"),  # capacity 0 drops everything
    Case(50, 4, 64, None, "skewed", D=40, dtype=torch.bfloat16),
    Case(50, 4, 8, 6, "random", torch.int32, D=40, dtype=torch.bfloat16),
    Case(1, 2, 3, None, "random", D=8),
    Case(0, 2, 3, None, "random"),
    Case(130, 8, 256, 2, "skewed", D=8),  # T*K > 1024 (33 route blocks of 32 slots at E 256)
    Case(41, 3, 5, None, "random"),  # K not a power of two
    Case(45, 6, 16, 4, "skewed", torch.int32, D=40, dtype=torch.bfloat16),
]


def make_ids(case: Case, gen: torch.Generator) -> torch.Tensor:
    """Distinct experts per token (like top-k), drawn to give the pattern the case names."""
    T, K, E = case.T, case.K, case.E
    if case.ids == "one_expert":
        assert K == 1 or E >= K
        # Slot k of every token goes to expert k: with K=4 of E=8, experts 4..7 stay empty.
        ids = torch.arange(K).expand(T, K).clone()
    else:
        scores = torch.rand(T, E, generator=gen)
        if case.ids == "skewed":  # a few hot experts, many cold or empty ones
            scores = scores * torch.linspace(4.0, 0.0, E) ** 3
        ids = scores.topk(min(K, E), dim=-1).indices
        if K > E:
            ids = torch.randint(0, E, (T, K), generator=gen)
    return ids.to(case.id_dtype)


def run_case(case: Case, seed: int, device: str = "cpu") -> dict[str, torch.Tensor | int]:
    """Route, scatter and combine forward and backward with the current backend; return everything.

    Inputs are drawn on the CPU from ``seed`` and moved to ``device``, so every device and backend
    sees the same data."""
    gen = torch.Generator().manual_seed(seed)
    ids_TK = make_ids(case, gen).to(device)
    plan = route(ids_TK, case.E, case.capacity)
    R = plan.num_rows
    x_TD = torch.randn(case.T, case.D, generator=gen).to(device, case.dtype).requires_grad_()
    y_RD = torch.randn(R, case.D, generator=gen).to(device, case.dtype).requires_grad_()
    w_TK = torch.rand(case.T, case.K, generator=gen).to(device).requires_grad_()
    grad_RD = torch.randn(R, case.D, generator=gen).to(device, case.dtype)
    grad_TD = torch.randn(case.T, case.D, generator=gen).to(device, case.dtype)

    x_RD = scatter_rows(x_TD, plan.dest_row_TK, R)
    x_RD.backward(grad_RD)
    out_TD = combine_rows(y_RD, plan.dest_row_TK, w_TK)
    out_TD.backward(grad_TD)
    out1_TD = combine_rows(y_RD.detach(), plan.dest_row_TK)  # unweighted form
    return {
        "tokens_per_expert_E": plan.tokens_per_expert_E,
        "kept_per_expert_E": plan.kept_per_expert_E,
        "offsets_E": plan.offsets_E,
        "dest_row_TK": plan.dest_row_TK,
        "num_rows": R,
        "x_RD": x_RD.detach(),
        "out_TD": out_TD.detach(),
        "out1_TD": out1_TD,
        "grad_x_TD": x_TD.grad,
        "grad_y_RD": y_RD.grad,
        "grad_w_TK": w_TK.grad,
    }


# ---------------------------------------------------------------------------------------------
# naive oracles: loops over slots, independent of the code under test
# ---------------------------------------------------------------------------------------------


def naive_route(ids_TK: torch.Tensor, E: int, capacity: int | None):
    T, K = ids_TK.shape
    ids = ids_TK.tolist()
    tokens_per_expert = [0] * E
    for t in range(T):
        for k in range(K):
            tokens_per_expert[ids[t][k]] += 1
    kept = [c if capacity is None else min(c, capacity) for c in tokens_per_expert]
    offsets, total = [], 0
    for c in kept:
        total += c
        offsets.append(total)
    dest = [[-1] * K for _ in range(T)]
    seen = [0] * E
    for t in range(T):  # flat order t*K + k: earlier tokens take the rows first
        for k in range(K):
            e = ids[t][k]
            if capacity is None or seen[e] < capacity:
                dest[t][k] = offsets[e] - kept[e] + seen[e]
            seen[e] += 1
    num_rows = T * K if capacity is None else min(T * K, E * capacity)
    i32 = torch.int32
    return (
        torch.tensor(tokens_per_expert, dtype=i32),
        torch.tensor(kept, dtype=i32),
        torch.tensor(offsets, dtype=i32),
        torch.tensor(dest, dtype=i32).view(T, K),
        num_rows,
    )


def naive_scatter(x_TD, dest_TK, R):
    out = torch.zeros(R, x_TD.shape[1], dtype=x_TD.dtype)
    for t in range(dest_TK.shape[0]):
        for k in range(dest_TK.shape[1]):
            if dest_TK[t, k] >= 0:
                out[dest_TK[t, k]] = x_TD[t]
    return out


def naive_combine(y_RD, dest_TK, w_TK):
    out = torch.zeros(dest_TK.shape[0], y_RD.shape[1], dtype=torch.float64)
    for t in range(dest_TK.shape[0]):
        for k in range(dest_TK.shape[1]):
            if dest_TK[t, k] >= 0:
                out[t] += float(w_TK[t, k]) * y_RD[dest_TK[t, k]].double()
    return out


# ---------------------------------------------------------------------------------------------
# (a) the reference against the naive loops
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_route_matches_naive(case):
    ids_TK = make_ids(case, torch.Generator().manual_seed(1))
    plan = reference.route(ids_TK, case.E, case.capacity)
    expected = naive_route(ids_TK, case.E, case.capacity)
    assert isinstance(plan, RoutingPlan)
    for got, want in zip(plan, expected):
        if isinstance(want, int):
            assert got == want
        else:
            assert got.dtype == torch.int32 and torch.equal(got, want)
    # Kept rows tile [0, offsets[-1]) exactly once: the layout is compact.
    if case.T:
        kept_rows = plan.dest_row_TK[plan.dest_row_TK >= 0].sort().values
        assert torch.equal(kept_rows, torch.arange(int(plan.offsets_E[-1]), dtype=torch.int32))
        assert int(plan.offsets_E[-1]) <= plan.num_rows


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_rows_match_naive(case):
    gen = torch.Generator().manual_seed(2)
    ids_TK = make_ids(case, gen)
    plan = reference.route(ids_TK, case.E, case.capacity)
    x_TD = torch.randn(case.T, case.D, generator=gen).to(case.dtype)
    y_RD = torch.randn(plan.num_rows, case.D, generator=gen).to(case.dtype)
    w_TK = torch.rand(case.T, case.K, generator=gen)
    x_RD = reference.scatter_rows(x_TD, plan.dest_row_TK, plan.num_rows)
    assert torch.equal(x_RD, naive_scatter(x_TD, plan.dest_row_TK, plan.num_rows))
    out_TD = reference.combine_rows(y_RD, plan.dest_row_TK, w_TK)
    assert out_TD.dtype == case.dtype
    tol = dict(rtol=1e-2, atol=1e-2) if case.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_TD.double(), naive_combine(y_RD, plan.dest_row_TK, w_TK), **tol)


@pytest.mark.parametrize("capacity", [None, 3])
def test_reference_gradcheck(capacity):
    gen = torch.Generator().manual_seed(3)
    T, K, E, D = 13, 3, 4, 5
    ids_TK = make_ids(Case(T, K, E, capacity, "random"), gen)
    with use_backend("torch"):
        plan = route(ids_TK, E, capacity)
        x_TD = torch.randn(T, D, dtype=torch.float64, generator=gen, requires_grad=True)
        y_RD = torch.randn(plan.num_rows, D, dtype=torch.float64, generator=gen, requires_grad=True)
        w_TK = torch.rand(T, K, dtype=torch.float64, generator=gen, requires_grad=True)
        dest = plan.dest_row_TK
        assert torch.autograd.gradcheck(lambda x: scatter_rows(x, dest, plan.num_rows), (x_TD,))
        assert torch.autograd.gradcheck(lambda y, w: combine_rows(y, dest, w), (y_RD, w_TK))
        assert torch.autograd.gradcheck(lambda y: combine_rows(y, dest), (y_RD,))


def test_unweighted_combine_does_not_keep_y():
    """Only the weight gradient reads y: the unweighted combine must not hold the [R, D] rows for backward."""
    ids_TK = make_ids(Case(16, 2, 4, None, "random"), torch.Generator().manual_seed(5))

    def saved_while(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn()
        return saved

    with use_backend("torch"):
        plan = route(ids_TK, 4)
        y_RD = torch.randn(plan.num_rows, 8, requires_grad=True) * 2.0
        w_TK = torch.rand(16, 2, requires_grad=True)
        unweighted = saved_while(lambda: combine_rows(y_RD, plan.dest_row_TK))
        weighted = saved_while(lambda: combine_rows(y_RD, plan.dest_row_TK, w_TK))
    assert any(t is y_RD for t in weighted)  # the hook sees y where it is needed
    assert not any(t is y_RD for t in unweighted)


def test_ops_opcheck_and_compile():
    """custom_op registrations (fake impls, autograd) hold, and compile traces without breaks."""
    gen = torch.Generator().manual_seed(4)
    T, K, E, D = 16, 2, 4, 8
    ids_TK = make_ids(Case(T, K, E, 5, "random"), gen)
    x_TD = torch.randn(T, D, generator=gen, requires_grad=True)
    w_TK = torch.rand(T, K, generator=gen, requires_grad=True)
    with use_backend("torch"):
        plan = route(ids_TK, E, 5)
        y_RD = torch.randn(plan.num_rows, D, generator=gen, requires_grad=True)
        ops = torch.ops.moetron
        torch.library.opcheck(ops.route, (ids_TK, E, 5, False))
        torch.library.opcheck(ops.scatter_rows, (x_TD, plan.dest_row_TK, plan.num_rows, False))
        torch.library.opcheck(ops.combine_rows, (y_RD, plan.dest_row_TK, w_TK, False))

        def step(ids, x, w):
            p = route(ids, E, 5)
            x_RD = scatter_rows(x, p.dest_row_TK, p.num_rows)
            return combine_rows(x_RD * 2.0, p.dest_row_TK, w)

        eager = step(ids_TK, x_TD, w_TK)
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(ids_TK, x_TD, w_TK)
        torch.testing.assert_close(compiled, eager)


def test_triton_backend_on_cpu_needs_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter is on")
    with use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        route(torch.zeros(4, 2, dtype=torch.int64), 3)


# ---------------------------------------------------------------------------------------------
# (b) Triton under the interpreter against the reference
# ---------------------------------------------------------------------------------------------


def _seed(i: int) -> int:
    return 1000 + i


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton") / "results.pt"
    from tests.processes import run_python  # here: this file also runs as a script, without tests/ on its path

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = run_python([os.path.abspath(__file__), str(path)], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(path)


def _assert_results_match(got: dict, want: dict, exact_floats: bool):
    for key, value in want.items():
        if isinstance(value, int):
            assert got[key] == value, key
        elif key == "grad_w_TK":  # fp32 dots over D (up to a few thousand) in another order
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-4, msg=key)
        elif not exact_floats:
            torch.testing.assert_close(got[key], value, msg=key)
        else:
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), key


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c.name for c in CASES])
def test_triton_interpreted_matches_reference(triton_results, i):
    with use_backend("torch"):
        want = run_case(CASES[i], _seed(i))
    # The interpreter casts fp32 -> bf16 by truncation where the GPU rounds to nearest even, so
    # bf16 outputs are within an ulp there; fp32 ones, and all of them on the GPU, are bit-exact.
    _assert_results_match(triton_results[i], want, exact_floats=CASES[i].dtype != torch.bfloat16)


# Holes anywhere, not only a plan's tail: (R, D, dtype) over several of the kernel's row windows, one window
# without holes, and a D that is not a multiple of the column block.
HOLE_CASES = [(1000, 24, torch.float32), (700, 2100, torch.bfloat16), (3, 5, torch.float32)]


def holes_case(R: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dest_row_TK, the rows it leaves unwritten): a random subset of R rows written, in random slots,
    with some dropped slots (-1); rows 256-511 (the kernel's second window) all written."""
    gen = torch.Generator().manual_seed(seed)
    written = torch.rand(R, generator=gen) < 0.7
    written[256:512] = True
    rows = torch.nonzero(written).view(-1)
    rows = rows[torch.randperm(rows.numel(), generator=gen)]
    dest = torch.cat([rows, torch.full((rows.numel() % 3 + 3,), -1)]).to(torch.int32)
    return dest.view(-1, 1), ~written


def run_holes(R: int, D: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    from moetron.core.moe.kernels import routing
    dest, _ = holes_case(R, seed)
    out = torch.full((R, D), 7.0, dtype=dtype)
    _, block_d, warps = routing._row_blocks(D, out.element_size())
    routing._zero_unwritten_rows(out, dest, block_d, warps)
    return out


@pytest.mark.parametrize("i", range(len(HOLE_CASES)))
def test_triton_interpreted_zeroes_exactly_the_unwritten_rows(triton_results, i):
    R, D, dtype = HOLE_CASES[i]
    _, unwritten = holes_case(R, _seed(i))
    want = torch.full((R, D), 7.0, dtype=dtype)
    want[unwritten] = 0
    assert 0 < int(unwritten.sum()) < R or R < 10
    assert torch.equal(triton_results[len(CASES) + i], want)


@pytest.mark.parametrize("kernel", ["zero bf16", "zero fp32", "count", "rank", "combine bf16", "combine fp32"])
def test_routing_kernels_compile_for_sm90_without_spills(kernel):
    """The route kernels, _zero_unwritten_rows_kernel (its hole check and nested loops) and the weighted
    combine (all K of a token tile's rows in registers at once: ptxas issues their loads before any sum) compile for
    Hopper on the CPU (ptxas ships with Triton) at OLMoE-8L's sizes (131,072 slots over 64 experts, top-8,
    D 2048), with the launch settings their wrappers pick, and need no local memory (spills) or stack."""
    import triton

    from moetron.core.moe.kernels import routing
    from tests.core.test_precision_fp8 import _compile_sm90, assert_no_spills

    R, D, E = 131072, 2048, 64
    kind, _, dtype = kernel.partition(" ")
    if dtype:  # the row kernels: the wrappers' blocks and warps for this dtype
        block_t, block_d, warps = routing._row_blocks(D, 2 if dtype == "bf16" else 4)
    if kind == "zero":
        fn, values = routing._zero_unwritten_rows_kernel, dict(out_ptr=f"*{dtype}", written_ptr="*u8", R=R, D=D)
        constexprs = dict(ROWS=routing._HOLE_SCAN_ROWS, BLOCK_R=routing._hole_rows_block(block_d), BLOCK_D=block_d)
    elif kind == "combine":
        fn = routing._combine_rows_kernel
        values = dict(y_ptr=f"*{dtype}", dest_ptr="*i32", w_ptr=f"*{dtype}", out_ptr=f"*{dtype}", T=R // 8, D=D)
        constexprs = dict(K=8, HAS_WEIGHTS=True, ACC=triton.language.float32, BLOCK_T=block_t, BLOCK_D=block_d)
    else:
        block_n, chunk, e_pad = routing._route_blocks(R, E)
        warps, constexprs = 4, dict(BLOCK_N=block_n, CHUNK=chunk, E_PAD=e_pad)
        B = triton.cdiv(R, block_n)
        if kernel == "count":
            fn, values = routing._route_count_kernel, dict(ids_ptr="*i64", counts_EB_ptr="*i32", N=R, E=E, B=B)
        else:
            fn = routing._route_rank_kernel
            values = dict(ids_ptr="*i64", first_rank_EB_ptr="*i32", first_row_E_ptr="*i32", dest_ptr="*i32", N=R,
                          E=E, B=B, capacity=3)
            constexprs["HAS_CAPACITY"] = False
    compiled = _compile_sm90(fn, triton.Config({}, num_warps=warps, num_stages=1), values, constexprs)
    assert_no_spills(compiled, kernel)


def _interpreter_main(path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    with use_backend("triton"):
        results = [run_case(case, _seed(i)) for i, case in enumerate(CASES)]
    results += [run_holes(*case, _seed(i)) for i, case in enumerate(HOLE_CASES)]
    torch.save(results, path)


# ---------------------------------------------------------------------------------------------
# (c) GPU: Triton against the reference at realistic sizes, and no host syncs
# ---------------------------------------------------------------------------------------------


GPU_CASES = CASES + [
    Case(16384, 8, 64, None, "random", D=2048, dtype=torch.bfloat16),
    Case(16384, 8, 64, 2560, "skewed", torch.int32, D=2048, dtype=torch.bfloat16),
    Case(16384, 4, 256, None, "skewed", D=1024, dtype=torch.bfloat16),
    Case(4099, 8, 128, 300, "random", D=4096, dtype=torch.bfloat16),
    Case(1000, 2, 8, None, "one_expert", D=6144, dtype=torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_triton_matches_reference(case):
    got = run_case_cuda_with(case, "triton")
    want = run_case_cuda_with(case, "torch")
    # Same fp32 arithmetic in the same order (no FMA contraction in the kernels): bit-exact,
    # except grad_w's dot over D.
    _assert_results_match(got, want, exact_floats=True)


def run_case_cuda_with(case: Case, backend: str) -> dict:
    with use_backend(backend):
        return run_case(case, 7, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_no_host_sync(backend):
    T, K, E, D = 4096, 8, 64, 1024
    ids_TK = torch.randn(T, E, device="cuda").topk(K, dim=-1).indices
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w_TK = torch.rand(T, K, device="cuda", requires_grad=True)
    grad_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)

    def step(capacity):
        plan = route(ids_TK, E, capacity)
        x_RD = scatter_rows(x_TD, plan.dest_row_TK, plan.num_rows)
        out_TD = combine_rows(x_RD * 2, plan.dest_row_TK, w_TK)
        out_TD.backward(grad_TD)

    with use_backend(backend):
        step(None)  # compile the kernels first: compilation is not a per-step cost
        step(300)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(None)
            step(300)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


if __name__ == "__main__":  # the interpreter subprocess of triton_results
    _interpreter_main(sys.argv[1])
