"""Every parallel layout against the single-process run: tiny MoE, 3 optimizer steps.

Each layout runs in separate processes through tools/pretrain.py's own composition (build()); the
losses of every step and the gathered gradients of every parameter (full tensors, by name, before
clipping) must equal the single-process run's. Three modes:

- ``cpu``: gloo on the CPU, float64, so that reductions in another order (1e-16) cannot flip a
  top-k routing decision, which would change gradients discretely; rtol 1e-7, atol 1e-10.
- ``nccl-fp64``: the same on one GPU per rank with NCCL (FSDP2 collectives, the expert all-to-all
  and pipeline send/recv on the GPU), float64 through the torch reference paths (per-expert loop,
  torch routing ops, SDPA), which have float64 kernels; the same tolerances.
- ``nccl-fp32``: one GPU per rank with NCCL on the GPU hot path (grouped GEMM, Triton routing
  kernels), fp32 with TF32 off; each tensor within 1e-3 of its largest entry (reductions in
  another order; a routing flip would be far outside that).

The GPU modes are marked ``gpu`` and ``multigpu`` and skip where fewer GPUs than ranks are visible.
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed import full_gradients, run_distributed, train_losses

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

STEPS = 3
TINY = [
    "--model.d_model=32", "--model.n_layers=4", "--model.vocab_size=512", "--model.mlp_hidden=64",
    "--model.attention.n_heads=4", "--model.attention.n_kv_heads=2", "--model.sliding_window=8",
    "--model.moe.num_experts=4", "--model.moe.expert_hidden=16", "--model.moe.router.top_k=2",
    "--model.moe.router.lb_granularity=micro_batch", "--model.moe.router.z_loss_weight=0.001",
    # The expert bias (moe-1t's balancing) moves after each step from the counts of every data-parallel
    # rank; at 0.02 a step it changes the routing of steps 2 and 3 (test_expert_bias_changes_routing),
    # so a layout whose ranks updated it from their own tokens would not match.
    "--model.moe.router.expert_bias=true", "--model.moe.router.bias_update_rate=0.02",
    "--data.seq_len=16", "--data.global_batch_size=8", "--data.corpus_vocab_size=512",
    "--data.corpus_max_bytes=300000", f"--trainer.steps={STEPS}", "--scheduler.warmup_steps=1",
    "--precision.recipe=fp32", "--trainer.device=cpu", "--trainer.eval_batches=0", "--trainer.log_interval=1",
    "--optimizer.lr=1e-2",
]

# name: (world size, layout overrides, sequences per micro-batch on each rank). The load-balance
# loss is a per-micro-batch quantity, so the single-process reference accumulates gradients over
# micro-batches of the same size (the same sequences end up together in both runs).
LAYOUTS = {
    "dp_shard=2": (2, ["--parallel.dp_shard=2"], 4),
    "ep=2": (2, ["--parallel.dp_shard=2", "--parallel.ep=2"], 4),  # auto: all_gather (top_k 2 >= ep 2)
    "ep=2,synced": (2, ["--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.ep_dispatch=synced"], 4),
    "pp=2,1f1b": (2, ["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.pp_schedule=1f1b",
                      "--parallel.pp_microbatches=4"], 2),
    "ep=2,dp_shard=4": (4, ["--parallel.dp_shard=4", "--parallel.ep=2"], 2),
    "pp=2,ep=2": (4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                      "--parallel.pp_microbatches=2"], 2),
    "dp_replicate=2,dp_shard=2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"], 2),
}


# mode: (process-group backend, device, dtype, extra overrides)
MODES = {
    "cpu": ("gloo", "cpu", torch.float64, []),
    "nccl-fp64": ("nccl", "cuda", torch.float64,
                  ["--trainer.device=cuda", "--model.attention.backend=sdpa", "--model.moe.experts_backend=loop"]),
    "nccl-fp32": ("nccl", "cuda", torch.float32, ["--trainer.device=cuda", "--model.attention.backend=sdpa"]),
}


def _run(rank, world, mode, args, out, data_dir):
    os.environ["MOETRON_DATA_DIR"] = data_dir
    import pretrain  # tools/pretrain.py (tests/conftest.py puts tools/ on the path)

    from moetron.core.moe.kernels import set_backend

    _, device, dtype, extra = MODES[mode]
    torch.set_default_dtype(dtype)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        if dtype == torch.float64:
            set_backend("torch")  # the Triton kernels accumulate in fp32
    device = torch.device(device, rank) if device == "cuda" else torch.device(device)
    cfg, _ = pretrain.parse_args(["--preset", "tiny-moe", *TINY, *extra, f"--trainer.run_dir={out}/run", *args])
    grads = []

    def capture(parts):
        grads.append(full_gradients(parts, world))

    trainer, state = pretrain.build(cfg, device, world, pre_step_hook=capture)
    losses, norms = train_losses(trainer, STEPS, world)
    if rank == 0:
        torch.save({"losses": losses, "grads": grads, "grad_norms": norms, "applied": state.applied,
                    "ep_dispatch": str(state.ep_dispatch)}, os.path.join(out, "result.pt"))


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_dir):
    cache = {}

    def get(mode: str, micro: int):
        if (mode, micro) not in cache:
            out = str(tmp_path_factory.mktemp(f"single_{mode}_micro{micro}"))
            run_distributed(_run, 1, mode, [f"--trainer.micro_batch_size={micro}"], out, data_dir,
                            backend=MODES[mode][0], timeout_s=300)
            cache[mode, micro] = torch.load(os.path.join(out, "result.pt"))
        return cache[mode, micro]

    return get


def test_expert_bias_changes_routing(references, tmp_path, data_dir):
    """What makes the bias part of the layout check: without it the single-process run's first step
    is the same and its later steps are not (the bias has changed which experts tokens pick)."""
    reference = references("cpu", 4)
    run_distributed(_run, 1, "cpu", ["--trainer.micro_batch_size=4", "--model.moe.router.expert_bias=false"],
                    str(tmp_path), data_dir, backend="gloo", timeout_s=300)
    without = torch.load(os.path.join(tmp_path, "result.pt"))
    assert without["losses"][0] == reference["losses"][0]
    assert all(a != b for a, b in zip(without["losses"][1:], reference["losses"][1:]))  # steps 2 and 3 each


def _gpu_mode(mode):
    return pytest.param(mode, marks=[pytest.mark.gpu, pytest.mark.multigpu])


@pytest.mark.parametrize("mode", ["cpu", _gpu_mode("nccl-fp64"), _gpu_mode("nccl-fp32")])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, mode, references, tmp_path, data_dir):
    world, args, micro = LAYOUTS[layout]
    backend = MODES[mode][0]
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    reference = references(mode, micro)
    run_distributed(_run, world, mode, args, str(tmp_path), data_dir, timeout_s=300, backend=backend)
    got = torch.load(os.path.join(tmp_path, "result.pt"))
    # The layout really ran (else the run would be the reference itself and could not differ).
    assert reference["applied"] == []
    assert ("pipeline" in got["applied"]) == ("--parallel.pp=2" in args), got["applied"]
    assert ("expert" in got["applied"]) == ("--parallel.ep=2" in args), got["applied"]
    if "--parallel.ep=2" in args:  # auto resolves to all_gather here (top_k 2 >= ep 2)
        assert got["ep_dispatch"] == ("synced" if "--parallel.ep_dispatch=synced" in args else "all_gather")
    assert len(got["grads"]) == len(reference["grads"]) == STEPS  # zip() below would hide a missing step
    exact = MODES[mode][2] == torch.float64
    assert got["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-9 if exact else 1e-4)
    for step, (g, r) in enumerate(zip(got["grads"], reference["grads"])):
        assert r and set(g) == set(r), (set(g) ^ set(r))
        for name in r:
            msg = lambda m, s=step, n=name: f"{mode} step {s + 1}: {n}\n{m}"  # noqa: E731
            if exact:
                torch.testing.assert_close(g[name], r[name], rtol=1e-7, atol=1e-10, msg=msg)
            else:
                scale = r[name].abs().max().item()
                torch.testing.assert_close(g[name], r[name], rtol=0, atol=1e-3 * scale + 1e-8, msg=msg)
    # the pipeline reports its loss in fp32
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-6 if exact else 1e-5)
