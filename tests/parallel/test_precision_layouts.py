"""The low-precision recipes under the parallel layouts, against the same recipe in one process.

tests/parallel/test_equivalence.py holds every layout to the single process bit for bit in fp32 and
float64. Under bf16 autocast the single process itself computes differently once FSDP2 is on: FSDP2
gathers the parameters in bf16 (PrecisionPolicy.fsdp_mp_policy), so the residual stream is bf16 and
the FP8 recipes quantize bf16 weights. So the reference here is the single process with FSDP2 on
(``--parallel.strategies=[data]`` on one rank), the same recipe, the same micro-batches; the layouts
run on the CPU with gloo, the low-precision recipes through their emulated backends (the same
quantized operands as on the GPU, dequantized into bf16 GEMMs). Checked:

- the run builds and trains, with the recipe's GEMM backend installed in every stage's attention,
  MLP and expert modules (not silently bf16), and its label says emulated;
- each parameter's first-step gradient against the reference's, relative to its norm, within the
  layout's tolerance (FSDP2 over 2 ranks: identical; with expert parallelism: within bf16 rounding
  of the expert gradients, measured 0.24%; with the pipeline too: the same. The pipeline used to
  run its backward under autocast, which gave the fp32 router and norm gradients bf16 matmuls:
  1% off at block 0 in bf16, 8.7% in FP8; this test found it);
- the first step's loss (rel 1e-3), the loss after 3 steps (1%) and how much it fell (20%: weights
  that stopped reaching the GEMMs, a stale quantized copy, would learn slower).

The bf16 recipe runs beside them as the control. The model is the smallest the recipes take: every
GEMM width a multiple of 128 (fp8_blockwise's tiles), so d_model 128 with four heads of 32 and as
many KV heads (grouped-query attention, orthogonal to the recipes, is tested in tests/core/); its
worst expert-parallel gradient error is 0.24%, as at d_model 256, and it runs in about 2/3 the time.
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed import full_gradients, run_distributed, train_losses

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

STEPS = 3
MODEL = [
    "--model.d_model=128", "--model.n_layers=4", "--model.vocab_size=512", "--model.mlp_hidden=128",
    "--model.attention.n_heads=4", "--model.attention.n_kv_heads=4", "--model.sliding_window=8",
    "--model.moe.num_experts=4", "--model.moe.expert_hidden=128", "--model.moe.router.top_k=2",
    "--model.moe.router.lb_granularity=micro_batch", "--data.seq_len=32", "--data.global_batch_size=8",
    "--data.corpus_vocab_size=512", "--data.corpus_max_bytes=300000", f"--trainer.steps={STEPS}",
    "--scheduler.warmup_steps=1", "--trainer.device=cpu", "--trainer.eval_batches=0", "--trainer.log_interval=1",
    "--optimizer.lr=1e-3",
]

RECIPES = {
    "bf16": ["--precision.recipe=bf16"],
    "fp8_rowwise": ["--precision.recipe=fp8_rowwise", "--precision.backend=emulated"],
    "fp8_blockwise": ["--precision.recipe=fp8_blockwise", "--precision.backend=emulated"],
    "mxfp8": ["--precision.recipe=mxfp8", "--precision.backend=emulated"],
}

# The GEMM backend each recipe installs (emulated on the CPU).
BACKEND = {"bf16": "TorchGemm", "fp8_rowwise": "Fp8RowwiseGemm", "fp8_blockwise": "EmulatedGemm", "mxfp8": "EmulatedGemm"}

# name: (world size, overrides, sequences per micro-batch on each rank, gradient tolerance): FSDP2,
# then expert parallelism over it, then the pipeline and expert parallelism over FSDP2 together.
LAYOUTS = {
    # The pipeline's runtime on one rank (pp=1: its micro-batch loop, its loss and aux-loss weights,
    # its autocast placement) against the plain loop over the same micro-batches: equal.
    "pipeline,pp=1": (1, ["--parallel.strategies=[pipeline,data]", "--parallel.pp_microbatches=4"], 2, 1e-6),
    "dp_shard=2": (2, ["--parallel.dp_shard=2"], 4, 1e-6),
    "ep=2,dp_shard=2": (2, ["--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.ep_dispatch=synced"], 4, 5e-3),
    "pp=2,ep=2,dp_shard=2": (4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                                 "--parallel.ep_dispatch=synced", "--parallel.pp_microbatches=2"], 2, 5e-3),
}

def _run(rank, world, args, out, data_dir, device="cpu"):
    os.environ["MOETRON_DATA_DIR"] = data_dir
    import pretrain  # tools/pretrain.py (tests/conftest.py puts tools/ on the path)

    from moetron.core.layers.attention import Attention
    from moetron.core.layers.mlp import SwiGLU
    from moetron.core.moe.experts import GroupedExperts

    on_gpu = device == "cuda"
    cfg, _ = pretrain.parse_args(["--preset", "tiny-moe", *MODEL, f"--trainer.run_dir={out}/run", *args,
                                  *(["--trainer.device=cuda", "--model.init_on_cpu=true"] if on_gpu else [])])
    grads = {}

    def capture(parts):  # the first step's gradients (before clipping)
        if not grads:
            grads.update({n: g.float() for n, g in full_gradients(parts, world).items()})

    trainer, state = pretrain.build(cfg, torch.device("cuda", rank) if on_gpu else torch.device("cpu"), world,
                                    pre_step_hook=capture)
    backends = set()
    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, (Attention, SwiGLU, GroupedExperts)):
                gemms = [module.gemm] if isinstance(module, GroupedExperts) else [
                    m.gemm for m in module.modules() if hasattr(m, "gemm")]
                backends.update(type(g).__name__ for g in gemms)
    losses, norms = train_losses(trainer, STEPS, world)
    gathered = [None] * world if dist.is_initialized() and world > 1 else [backends]
    if len(gathered) > 1:
        dist.all_gather_object(gathered, backends)
    if rank == 0:
        torch.save({"losses": losses, "grads": grads, "grad_norms": norms, "applied": state.applied,
                    "backends": sorted(set().union(*gathered)), "label": trainer.precision.label},
                   os.path.join(out, "result.pt"))


def worst_gradient_error(got: dict, reference: dict) -> tuple[float, str]:
    """The largest first-step gradient error of ``got`` against ``reference``, each parameter's
    relative to the norm of its reference gradient, and that parameter's name."""
    errors = {n: float((got["grads"][n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in reference["grads"].items()}
    worst = max(errors, key=errors.get)
    return errors[worst], worst


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_dir):
    cache = {}

    def get(recipe: str, micro: int):
        if (recipe, micro) not in cache:
            out = str(tmp_path_factory.mktemp(f"single_{recipe}_micro{micro}"))
            run_distributed(_run, 1, [f"--trainer.micro_batch_size={micro}", "--parallel.strategies=[data]", *RECIPES[recipe]], out, data_dir,
                            timeout_s=300)
            cache[recipe, micro] = torch.load(os.path.join(out, "result.pt"))
        return cache[recipe, micro]

    return get


# Every recipe under every layout but two: expert parallelism over FSDP2 alone is the bf16 control's;
# the FP8 recipes meet it inside pp=2,ep=2,dp_shard=2 (the same tolerance). The pp=1 pipeline's exact
# check runs bf16 and mxfp8 (the emulated backend fp8_blockwise shares, EmulatedGemm); fp8_rowwise and
# fp8_blockwise meet the pipeline's runtime inside pp=2,ep=2,dp_shard=2. CI's time favours both cuts.
CASES = [(recipe, layout) for recipe in RECIPES for layout in LAYOUTS
         if recipe == "bf16" or (layout != "ep=2,dp_shard=2"
                                 and (layout != "pipeline,pp=1" or recipe == "mxfp8"))]


@pytest.mark.parametrize("recipe,layout", CASES)
def test_recipe_under_layout(recipe, layout, references, tmp_path, data_dir):
    world, args, micro, tolerance = LAYOUTS[layout]
    reference = references(recipe, micro)
    run_distributed(_run, world, [*args, *RECIPES[recipe]], str(tmp_path), data_dir, timeout_s=300)
    got = torch.load(os.path.join(tmp_path, "result.pt"))
    # The layout really ran, with the recipe's backend in every stage's GEMM modules.
    assert reference["applied"] == ["data"] and "data" in got["applied"]
    assert ("pipeline" in got["applied"]) == layout.startswith(("pipeline", "pp=")), got["applied"]
    assert ("expert" in got["applied"]) == ("--parallel.ep=2" in args), got["applied"]
    assert got["backends"] == reference["backends"] == [BACKEND[recipe]], (got["backends"], reference["backends"])
    assert got["label"] == reference["label"] and ("emulated" in got["label"]) == (recipe != "bf16"), got["label"]
    assert reference["grads"] and set(got["grads"]) == set(reference["grads"]), set(got["grads"]) ^ set(reference["grads"])
    error, worst = worst_gradient_error(got, reference)
    print(f"{recipe} {layout}: worst step-1 gradient {worst} off by {error:.2e}")  # shown with -s
    assert error <= tolerance, f"{recipe} {layout}: step-1 gradient of {worst} off by {error:.2e} (> {tolerance})"
    losses, ref = got["losses"], reference["losses"]
    assert len(losses) == len(ref) == STEPS
    assert losses[0] == pytest.approx(ref[0], rel=1e-3), (losses, ref)
    assert losses[-1] == pytest.approx(ref[-1], rel=1e-2), (losses, ref)
    assert ref[0] - ref[-1] > 0.05, ref
    assert losses[0] - losses[-1] == pytest.approx(ref[0] - ref[-1], rel=0.2), (losses, ref)


def _plain_and_pipeline(tmp_path, data_dir, extra, device="cpu", backend="gloo"):
    """The first-step gradients and losses of the plain loop and of the pipeline's runtime on one
    rank (LAYOUTS["pipeline,pp=1"]), over the same micro-batches, bf16 autocast plus ``extra``."""
    world, args, micro, _ = LAYOUTS["pipeline,pp=1"]
    runs = {}
    for name, overrides in {"plain": [f"--trainer.micro_batch_size={micro}", "--parallel.strategies=[data]"],
                            "pipeline": args}.items():
        out = tmp_path / name
        out.mkdir()
        run_distributed(_run, world, [*overrides, *RECIPES["bf16"], *extra], str(out), data_dir, device,
                        backend=backend, timeout_s=600)
        runs[name] = torch.load(out / "result.pt")
    got, reference = runs["pipeline"], runs["plain"]
    assert "pipeline" in got["applied"] and "pipeline" not in reference["applied"]
    return (*worst_gradient_error(got, reference), got["losses"], reference["losses"])


@pytest.mark.parametrize("recompute", [["--memory.recompute=full"],
                                       ["--memory.recompute=selective", "--memory.recompute_modules=[norm,swiglu,attention]"]],
                         ids=["full", "selective"])
def test_pipeline_recompute_equals_plain_bf16(recompute, tmp_path, data_dir):
    """Recomputed activations under the pipeline: the recompute in backward re-enters the autocast
    its forward ran under (now the stage's own, not the step's), so the pipeline still equals the
    plain loop with the same recompute, exactly."""
    error, worst, losses, ref = _plain_and_pipeline(tmp_path, data_dir, recompute)
    assert error <= 1e-6, f"step-1 gradient of {worst} off by {error:.2e}"
    assert losses == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pipeline_runtime_on_gpu_bf16(tmp_path, data_dir):
    """The pipeline's runtime (one rank, NCCL, bf16 autocast on the GPU's kernels) against the plain
    loop over the same micro-batches: the backward runs outside autocast in both (it used to run
    inside it under the pipeline, 1% off at block 0 on the CPU)."""
    error, worst, losses, ref = _plain_and_pipeline(tmp_path, data_dir, [], "cuda", "nccl")
    # The same kernels on the same micro-batches; what may differ is the order of atomic adds in the
    # routing kernels' backward (bf16 rounding of that): far below the 1% the autocast placement made.
    print(f"bf16 pipeline,pp=1 on the GPU: worst step-1 gradient {worst} off by {error:.2e}")  # shown with -s
    assert error <= 1e-3, f"step-1 gradient of {worst} off by {error:.2e}"
    assert losses == pytest.approx(ref, rel=1e-3)
