"""The ``precision`` config section: what a run computes in, resolved into a PrecisionPolicy."""

from __future__ import annotations

import dataclasses

import torch

from ..config import Config, ConfigError, StrEnum
from ..distributed import is_main
from .gemm import Fp8Wgrad, gemm_backend
from .policy import GemmModule, PrecisionPolicy

__all__ = ["Bf16Experts", "Fp8Experts", "Fp8Wgrad", "GemmModule", "PrecisionBackend", "PrecisionConfig", "PrecisionRecipe",
           "InputOnce", "Residual", "AUTO_COPIES", "check_embedding_copy", "copies_auto_on", "split_copies_held", "copies_off_overrides", "check_expert_copies", "check_quantized_copies", "input_once_on", "residual_on",
           "takes_expert_copies"]


class PrecisionRecipe(StrEnum):
    auto = "auto"
    """bf16 on GPU, fp32 on the CPU."""
    fp32 = "fp32"
    """Everything in fp32 (bit-exact reproducibility on the CPU)."""
    bf16 = "bf16"
    """bf16 autocast for the GEMMs with fp32 master weights; norms, softmax, router and loss in fp32."""
    mxfp8 = "mxfp8"
    """bf16 autocast, and the GEMMs of ``modules`` in MXFP8 (E4M3 + E8M0 per 32 along each GEMM's
    reduction dim): native on SM100+ (core.precision.native_mx), emulated elsewhere
    (core.precision.emulated: exact MX operands through bf16 GEMMs)."""
    fp8_blockwise = "fp8_blockwise"
    """bf16 autocast, and the GEMMs of ``modules`` in FP8 with 1x128 activation / gradient tiles and
    128x128 weight tiles (DeepSeek-V3): native on SM90+ (F.scaled_mm and a Triton grouped GEMM,
    core.precision.fp8_gemm), emulated elsewhere. Not MXFP8."""
    fp8_rowwise = "fp8_rowwise"
    """bf16 autocast, and the GEMMs of ``modules`` in FP8 with one power-of-two fp32 scale per row of
    each operand along its GEMM's reduction dim (the wgrad's per expert along its tokens): native on
    SM90 (torch._scaled_mm and torch's CUTLASS grouped kernel torch._scaled_grouped_mm,
    core.precision.fp8_rowwise), emulated elsewhere. Coarser scaling than fp8_blockwise, faster GEMMs.
    Neither fp8_blockwise nor MXFP8."""


class WeightCopies(StrEnum):
    none = "none"
    """The expert GEMMs cast the fp32 master weights to bf16 in forward and again in backward; no copy held."""
    step = "step"
    """Each expert weight's bf16 copy is made at its first use in a step and held until the
    optimizer step (one cast per step)."""
    optimizer = "optimizer"
    """Persistent bf16 copies written by the optimizer step itself in the same pass as the update
    (core.adamw.PrecisionAwareAdamW's compute_copies: optimizer.impl=auto on CUDA, or triton); no
    cast at all."""

    @classmethod
    def _missing_(cls, value):
        # The switch was first a bool (true = step): old commands and reports keep their meaning.
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            return cls.step if value is True or str(value).lower() == "true" else cls.none
        return None


class Fp8Experts(StrEnum):
    auto = "auto"
    """``gluon`` where it runs (the native fp8_blockwise backend on an SM90 GPU, Gluon importable), else
    ``triton``: the Gluon kernels measured faster than the Triton ones at every shape and step measured
    (the H100, session 36 call 3, each pair in one run: grouped fwd+bwd 0.83 / 1.12 / 1.18x bf16 against
    0.75 / 0.92 / 1.00x, olmoe3-4l-8e's step 1.101x against 1.051x; OLMoE-8L's step 0.970x (session 36)
    against 0.859x with the Triton experts in session 35, not one run; docs/performance.md).
    PrecisionConfig.resolved_fp8_experts is the one rule (the build and the planner)."""
    triton = "triton"
    """core/precision/fp8_triton.py: grouped Triton kernels that find each row tile's expert from the
    offsets on the device (no host sync, any number of experts)."""
    cublas = "cublas"
    """core/precision/fp8_cublas.py: torch's blockwise scaled_mm (cuBLAS) once per expert, the group
    sizes read on the host (one sync per GEMM, about 55 us of CPU per expert): 1.25-1.67x the bf16
    grouped GEMM per pass (operands quantized beforehand, session 6) and 1.27x fwd+bwd with
    quantization (session 7), with 8 experts of 8192 rows on the H200; CPU-bound with 64 small
    experts (docs/performance.md)."""
    gluon = "gluon"
    """core/precision/fp8_gluon.py: the grouped GEMMs written in Gluon, warp-specialized by hand (a TMA
    producer, two wgmma consumers: one's fp32 promotion overlapping the other's MMA), persistent, TMA
    stores, no host sync. On the H100 (sessions 36-37, docs/performance.md): forward / dgrad 1.47-1.66x
    bf16 ``_grouped_mm`` per GEMM, the wgrad (its scales staged in shared memory) 1.14-1.34x; whole steps
    1.101x bf16 on olmoe3-4l-8e, 0.970x on OLMoE-8L (with the optimizer's bf16 expert copies 1.123x and
    1.00-1.02x). SM90 only: on other GPUs and the CPU the ``triton`` kernels run (``auto``)."""


class Bf16Experts(StrEnum):
    grouped_mm = "grouped_mm"
    """torch._grouped_mm: every local expert's GEMM in one kernel, the offsets on the device (no host sync)."""
    cublas = "cublas"
    """One cuBLAS GEMM (torch.mm) per local expert, written in place into the grouped output, the
    group sizes read on the host (one sync in each expert op's forward and one in its backward, shared
    by the dgrad and the wgrad):
    cuBLAS's dense kernels instead of the grouped one, for layers with few experts and many rows
    each; with many small experts the per-call CPU cost is the limit (core/precision/grouping.py)."""


class PrecisionBackend(StrEnum):
    auto = "auto"
    """native where the GPU has the recipe's GEMMs, else emulated (with a note at start-up)."""
    native = "native"
    """The hardware's scaled GEMMs (mxfp8: SM100+; fp8_blockwise: SM90+); an error elsewhere."""
    emulated = "emulated"
    """Exact quantized operands dequantized into bf16 GEMMs: the recipe's numerics on any device."""


_LOW_PRECISION = (PrecisionRecipe.mxfp8, PrecisionRecipe.fp8_blockwise, PrecisionRecipe.fp8_rowwise)
_NATIVE_SM = {PrecisionRecipe.mxfp8: 10, PrecisionRecipe.fp8_blockwise: 9, PrecisionRecipe.fp8_rowwise: 9}
# torch's rowwise FP8 grouped kernel (torch._scaled_grouped_mm) is built for SM90 only
_NATIVE_SM_MAX = {PrecisionRecipe.fp8_rowwise: 9}
# the block a width must divide into: MX's 32-element scale blocks, FP8 blockwise's 128x128 weight tiles
_WIDTH_BLOCK = {PrecisionRecipe.mxfp8: 32, PrecisionRecipe.fp8_blockwise: 128}
_NATIVE_GPU = {PrecisionRecipe.mxfp8: "SM100+ (Blackwell)", PrecisionRecipe.fp8_blockwise: "SM90+ (Hopper)",
               PrecisionRecipe.fp8_rowwise: "SM90 (Hopper)"}


def _capability_major(device_type: str) -> int | None:
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()[0]


def takes_expert_copies(recipe: PrecisionRecipe | str, backend: PrecisionBackend | str) -> bool:
    """Whether a resolved recipe and backend take precision.expert_weight_copies=optimizer with
    expert_grads_bf16 (the experts computing on the optimizer's bf16 weight copies): the bf16
    recipe, fp8_rowwise, fp8_blockwise (native or emulated), and mxfp8 on the emulated backend. The
    native mxfp8 GEMMs do not. The one rule the config, the build and the planner apply."""
    recipe = PrecisionRecipe(recipe)
    if recipe in (PrecisionRecipe.bf16, PrecisionRecipe.fp8_rowwise, PrecisionRecipe.fp8_blockwise):
        return True
    return recipe in _LOW_PRECISION and PrecisionBackend(backend) == PrecisionBackend.emulated


def check_expert_copies(recipe: PrecisionRecipe | str, backend: PrecisionBackend | str, copies: bool) -> None:
    """ConfigError where ``copies`` (precision.expert_weight_copies=optimizer) meet a recipe and
    backend that do not take them (takes_expert_copies), naming the fix."""
    if copies and not takes_expert_copies(recipe, backend):
        raise ConfigError(f"precision.expert_weight_copies=optimizer with precision.recipe={PrecisionRecipe(recipe)} "
                          f"on precision.backend={PrecisionBackend(backend)}: the native mxfp8 GEMMs do not take the "
                          f"optimizer's bf16 expert copies (bf16, fp8_rowwise, fp8_blockwise and the emulated backend "
                          f"do): add --precision.backend=emulated, or drop expert_weight_copies and expert_grads_bf16")


def _require_bf16(recipe: PrecisionRecipe | str, switch: str, what: str) -> None:
    """ConfigError unless ``recipe`` is bf16 (or auto, until resolved: fp32 on the CPU): precision.``switch``
    ``what`` (what it does, naming the bf16 machinery it needs)."""
    recipe = PrecisionRecipe(recipe)
    if recipe not in (PrecisionRecipe.bf16, PrecisionRecipe.auto):
        raise ConfigError(f"precision.{switch}=true {what}, a bf16-recipe option, and this run has "
                          f"precision.recipe={recipe}: use --precision.recipe=bf16, or drop {switch}")


AUTO_COPIES = ("expert_weight_copies", "expert_grads_bf16", "dense_weight_copies", "head_weight_copy")
"""The precision switches whose ``auto`` (None) copies_auto_on resolves: the optimizer's bf16 copies of the
weights the model computes on, and their bf16 gradients, which give the same values as casting at each use
where that rule holds. Measured together against all four off (H100, session 50, two runs, docs/performance.md):
+3.7-3.8% tokens/s on olmoe3-4l-8e and +10.8% on OLMoE-8L, for 2.6 / 5.5 GiB more peak."""


_COPIES_OFF_TEXT = {"expert_weight_copies": "none", "expert_grads_bf16": "false", "dense_weight_copies": "false",
                    "head_weight_copy": "false"}
"""The command-line value that turns each AUTO_COPIES switch off."""


def copies_off_overrides() -> list[str]:
    """The command-line overrides that turn every AUTO_COPIES switch off (named where memory runs short: the
    build's start-up line, the trainer's out-of-memory note, tools/plan.py, its CHANGED_DEFAULTS)."""
    return [f"--precision.{name}={_COPIES_OFF_TEXT[name]}" for name in AUTO_COPIES]


def copies_auto_on(recipe: PrecisionRecipe | str, device_type: str, *, one_rank: bool, micro_batches: int,
                   optimizer_writes_copies: bool, overlap: bool = False) -> bool:
    """What ``auto`` means for AUTO_COPIES (the build, bench_train and the planner all ask here): on where
    the copies give the same values as the casts they replace (the same bits with one micro-batch a step,
    but for the clipping norm, summed over bf16 gradients in another order: a few ulps apart where clipping
    scales the update; tests/core/test_dense_copies.py) and are measured faster, i.e. the (resolved)
    bf16 ``recipe`` on a CUDA device, one rank (``one_rank``: an unsharded model, whose fp32 weights are the
    copies' masters), one micro-batch a step (bf16 gradients would be summed in bf16 across more), the
    optimizer being this package's AdamW, which writes the copies (``optimizer_writes_copies``:
    OptimizerConfig.writes_copies), and no optimizer.overlap (``overlap``: not measured with them). Off
    elsewhere: the layouts and recipes where ``true`` is refused, or not measured."""
    return (PrecisionRecipe(recipe) == PrecisionRecipe.bf16 and device_type == "cuda" and one_rank
            and micro_batches == 1 and optimizer_writes_copies and not overlap)


def split_copies_held(precision: "PrecisionConfig", recipe: PrecisionRecipe | str, backend: PrecisionBackend | str,
                      fused_loss: bool) -> bool:
    """Whether a run of ``precision`` (its copy switches resolved: with_auto_copies), the resolved ``recipe``
    and ``backend`` and the model's ``fused_loss`` computes some weight on an optimizer-written bf16 copy that
    optimizer.split_master can hold the master of: the dense linears' copies, the LM head's (the fused loss
    computes on it), the embedding's, or the experts' copies with their bf16 gradients (not quantized). The
    one rule for split_master's ``auto`` (run/build.py) and its refusal (the planner, check_split_master)."""
    experts = (str(precision.expert_weight_copies) == "optimizer" and takes_expert_copies(recipe, backend)
               and bool(precision.expert_grads_bf16) and not precision.quantized_expert_copies)
    return (bool(precision.dense_weight_copies) or (bool(precision.head_weight_copy) and fused_loss) or experts
            or bool(precision.embedding_weight_copy))


def check_bf16_copies(recipe: PrecisionRecipe | str, copies: bool, sharded: bool = False,
                      switch: str = "dense_weight_copies") -> None:
    """ConfigError where ``copies`` (precision.dense_weight_copies, or the ``switch`` head_weight_copy)
    meet a recipe other than bf16 or a ``sharded`` layout (FSDP2, expert or pipeline parallelism: the
    weights are not one GPU's fp32 parameters), naming the fix. The one rule the config, the build
    and the planner apply to both."""
    if not copies:
        return
    who = {"head_weight_copy": "the LM head compute", "embedding_weight_copy": "the token embedding gather its rows"
           }.get(switch, "the dense linears compute")
    _require_bf16(recipe, switch, f"has {who} on the optimizer's bf16 weight copies")
    if sharded:
        raise ConfigError(f"precision.{switch}=true is for one unsharded GPU (its fp32 weights are the copies' "
                          f"masters): no FSDP2, expert or pipeline parallelism; drop it for this layout")


def check_embedding_copy(recipe: PrecisionRecipe | str, on: bool, residual: "Residual | bool | str",
                         sharded: bool = False) -> None:
    """ConfigError where precision.embedding_weight_copy meets what check_bf16_copies refuses (a recipe
    other than bf16, a ``sharded`` layout) or, the recipe known (not auto), a residual stream that is not
    bf16: the copy's rows are bf16, the same bits as the fp32 rows cast only where the stream casts them
    (precision.bf16_residual). The config's, the build's and the planner's one rule."""
    if not on:
        return
    check_bf16_copies(recipe, True, sharded=sharded, switch="embedding_weight_copy")
    if PrecisionRecipe(recipe) != PrecisionRecipe.auto and not residual_on(recipe, residual):
        raise ConfigError("precision.embedding_weight_copy=true gathers the embedding's rows in bf16, and this run "
                          "keeps the residual stream in fp32 (precision.bf16_residual=false), so its rows would be "
                          "rounded where they are not now: set --precision.bf16_residual=auto (or true), or drop "
                          "embedding_weight_copy")


def check_save_product(recipe: PrecisionRecipe | str, on: bool) -> None:
    """ConfigError where precision.save_swiglu_product meets a recipe other than bf16, whose experts
    compose their own SwiGLU. The config, the build and the planner's one rule."""
    if on:
        _require_bf16(recipe, "save_swiglu_product", "keeps the product in the bf16 experts' fused SwiGLU-down op")


def check_fused_input(recipe: PrecisionRecipe | str, on: bool) -> None:
    """ConfigError where precision.fused_shared_input meets a recipe other than bf16 (the low-precision
    recipes share their input through quantize_input_once). The config's and the build's one rule."""
    if on:
        _require_bf16(recipe, "fused_shared_input", "runs the linears of one input as one bf16 GEMM")


def check_emulated_saves(recipe: PrecisionRecipe | str, backend: PrecisionBackend | str, x_bf16: bool) -> None:
    """ConfigError where precision.emulated_save_x_bf16 meets a recipe and backend other than mxfp8 /
    fp8_blockwise on the emulated backend (the only GEMMs it changes; auto may still resolve to it),
    naming the fix. The one rule the config, the build and the planner apply."""
    recipe, backend = PrecisionRecipe(recipe), PrecisionBackend(backend)
    if x_bf16 and not (recipe in (PrecisionRecipe.mxfp8, PrecisionRecipe.fp8_blockwise)
                       and backend in (PrecisionBackend.emulated, PrecisionBackend.auto)):
        raise ConfigError(f"precision.emulated_save_x_bf16: an option of mxfp8 / fp8_blockwise on the emulated backend, "
                          f"and this run has precision.recipe={recipe} on precision.backend={backend}: use "
                          f"--precision.recipe=mxfp8 (or fp8_blockwise) --precision.backend=emulated, or drop it")


def check_quantized_copies(recipe: PrecisionRecipe | str, backend: PrecisionBackend | str, quantized: bool,
                           optimizer_copies: bool, modules) -> None:
    """ConfigError where precision.quantized_expert_copies meets anything but mxfp8 on the emulated
    backend (auto may resolve to it) with the optimizer's expert copies holding the gradients
    (expert_weight_copies=optimizer, expert_grads_bf16=true) and the experts among the low-precision
    ``modules``, naming the fix. The one rule the config, the build and the planner apply."""
    if not quantized:
        return
    recipe, backend = PrecisionRecipe(recipe), PrecisionBackend(backend)
    if recipe != PrecisionRecipe.mxfp8 or backend not in (PrecisionBackend.emulated, PrecisionBackend.auto):
        raise ConfigError(f"precision.quantized_expert_copies: an option of mxfp8 on the emulated backend, and this run "
                          f"has precision.recipe={recipe} on precision.backend={backend}: use --precision.recipe=mxfp8 "
                          f"--precision.backend=emulated, or drop it")
    if not optimizer_copies:
        raise ConfigError("precision.quantized_expert_copies has the optimizer write the expert copies quantized: it "
                          "needs --precision.expert_weight_copies=optimizer --precision.expert_grads_bf16=true")
    if GemmModule.experts not in {GemmModule(m) for m in modules}:
        raise ConfigError("precision.quantized_expert_copies quantizes the experts' weights for their mxfp8 GEMMs, "
                          f"but precision.modules={[str(m) for m in modules]} leaves the experts in bf16: add experts "
                          "to --precision.modules, or drop quantized_expert_copies")


def takes_input_once(recipe: PrecisionRecipe | str, backend: PrecisionBackend | str) -> bool:
    """Whether a recipe and backend take precision.quantize_input_once (their linears' ``linears``
    share one quantization of the input): fp8_rowwise and fp8_blockwise (either backend), and mxfp8 on
    the emulated backend (auto may resolve to it). The native mxfp8 linears do not (not built)."""
    recipe, backend = PrecisionRecipe(recipe), PrecisionBackend(backend)
    if recipe in (PrecisionRecipe.fp8_rowwise, PrecisionRecipe.fp8_blockwise):
        return True
    return recipe == PrecisionRecipe.mxfp8 and backend in (PrecisionBackend.emulated, PrecisionBackend.auto)


class InputOnce(StrEnum):
    """precision.quantize_input_once: whether linears that read one input quantize it once for all of
    them (see PrecisionConfig.quantize_input_once). ``true`` / ``false`` as for a bool."""

    auto = "auto"
    """On where the recipe and backend take it (takes_input_once), off elsewhere (bf16 among them)."""
    on = "true"
    """On; a ConfigError where the recipe and backend do not take it."""
    off = "false"
    """Off: each linear quantizes its input itself."""

    @classmethod
    def _missing_(cls, value):
        return cls._bool_member(value, cls.on, cls.off)


def check_input_once(recipe: PrecisionRecipe | str, backend: PrecisionBackend | str, value: InputOnce | bool | str) -> None:
    """ConfigError where precision.quantize_input_once=true meets a recipe and backend that do not take it
    (takes_input_once), naming the fix. The one rule the config, the build and the planner apply."""
    if InputOnce(value) == InputOnce.on and not takes_input_once(recipe, backend):
        raise ConfigError(f"precision.quantize_input_once: an option of fp8_rowwise and fp8_blockwise, and of mxfp8 on "
                          f"the emulated backend (bf16 has no input to quantize; the native mxfp8 linears quantize per "
                          f"linear), and this run has precision.recipe={PrecisionRecipe(recipe)} "
                          f"on precision.backend={PrecisionBackend(backend)}: use --precision.recipe=fp8_rowwise or "
                          f"fp8_blockwise, or --precision.backend=emulated, or drop it (auto turns it on where the recipe "
                          f"takes it)")


def input_once_on(recipe: PrecisionRecipe | str, backend: PrecisionBackend | str, value: InputOnce | bool | str) -> bool:
    """precision.quantize_input_once resolved for a run's recipe and (resolved) backend: the one place
    ``auto`` becomes on or off (the build and the planner both ask here). ConfigError as check_input_once."""
    check_input_once(recipe, backend, value)
    value = InputOnce(value)
    return value == InputOnce.on or (value == InputOnce.auto and takes_input_once(recipe, backend))


class Residual(StrEnum):
    """precision.bf16_residual: the residual stream's dtype between the blocks (see
    PrecisionConfig.bf16_residual). ``true`` / ``false`` as for a bool."""

    auto = "auto"
    """On with the bf16 recipe (measured there, session 46); off with fp32 (no compute dtype) and with the
    low-precision recipes (not measured with them: ``true`` asks for it)."""
    on = "true"
    """The stream in the compute dtype (bf16); a ConfigError on an fp32 run."""
    off = "false"
    """The stream in the embedding's dtype (fp32 master weights; bf16 where FSDP2 gathers bf16)."""

    @classmethod
    def _missing_(cls, value):
        return cls._bool_member(value, cls.on, cls.off)


def residual_on(recipe: PrecisionRecipe | str, value: Residual | bool | str) -> bool:
    """precision.bf16_residual resolved for a run's recipe (resolved: not auto): the one place ``auto``
    becomes on or off (the build and the planner both ask here). ConfigError for ``true`` on fp32."""
    value, recipe = Residual(value), PrecisionRecipe(recipe)
    if recipe == PrecisionRecipe.fp32:
        if value == Residual.on:
            raise ConfigError("precision.bf16_residual=true keeps the residual stream in the compute dtype, and this "
                              "run computes in fp32 (precision.recipe=fp32, or auto on the CPU): use "
                              "--precision.recipe=bf16, or drop bf16_residual (auto turns it on with bf16)")
        return False
    return value == Residual.on or (value == Residual.auto and recipe == PrecisionRecipe.bf16)


@dataclasses.dataclass
class PrecisionConfig(Config):
    AUTO_NONE = frozenset(AUTO_COPIES)  # their None is auto (copies_auto_on)
    recipe: PrecisionRecipe = PrecisionRecipe.auto
    """Compute precision (see PrecisionRecipe)."""
    backend: PrecisionBackend = PrecisionBackend.auto
    """How a low-precision recipe's GEMMs run (see PrecisionBackend); bf16 / fp32 ignore it."""
    mx_scale: str = "rceil"
    """MX scale rounding: ``rceil`` (NVIDIA / torchao: 2^ceil(log2(amax / 448))) or ``floor`` (the OCP
    spec: 2^(floor(log2 amax) - 8), the top of the range saturates). mxfp8 only."""
    modules: list[GemmModule] = dataclasses.field(
        default_factory=lambda: [GemmModule.experts, GemmModule.attention, GemmModule.mlp])
    """Which modules' GEMMs use a low-precision recipe: ``experts`` (the routed experts' grouped
    GEMMs), ``attention`` (q/k/v/o projections), ``mlp`` (dense SwiGLUs, the MoE layer's shared
    expert included). The LM head and the router always stay in bf16."""
    expert_weight_copies: WeightCopies | None = None
    """``auto`` (None, the default): ``optimizer`` where the copies give the values of casting
    (copies_auto_on: the bf16 recipe on one CUDA GPU, one micro-batch a step, this package's AdamW),
    ``none`` elsewhere. bf16 recipe: bf16 copies of the routed experts' weights, 2 bytes per expert parameter held
    (see WeightCopies: none, made once per step, or written by the optimizer step itself), instead
    of casting the fp32 master weights in forward and again in backward
    (core/precision/bf16_grouped.py). Ignored when the weights arrive in bf16 already (FSDP2's bf16
    all-gather). fp8_rowwise, fp8_blockwise, and mxfp8 on the emulated backend: ``optimizer`` with
    ``expert_grads_bf16=true`` (the only form they take): the expert weights are quantized from the
    optimizer's bf16 copies, and their gradients stay bf16 (core/precision/fp8_rowwise.py,
    emulated.py, fp8_gemm.py). The native mxfp8 GEMMs refuse it."""
    expert_grads_bf16: bool | None = None
    """``auto`` (None, the default): on where expert_weight_copies resolves to ``optimizer`` under
    copies_auto_on, off elsewhere. bf16 recipe with ``expert_weight_copies=optimizer``: the routed experts' weight gradients are
    the grouped GEMMs' bf16 outputs, kept on the optimizer's bf16 copies (the copies are the tensors
    the GEMMs differentiate) and read by the optimizer as the fp32 master weights' gradients: 2
    bytes per expert parameter instead of 4 and no bf16 -> fp32 cast pass over them after backward.
    With one micro-batch per step the update is bit-identical to fp32 gradients (the GEMM rounds its
    output to bf16 either way); gradient accumulation over micro-batches would sum in bf16, so it
    is refused (core/trainer.py)."""
    dense_weight_copies: bool | None = None
    """``auto`` (None, the default): on where copies_auto_on holds, off elsewhere. bf16 recipe, one GPU
    (unsharded fp32 weights): the dense linears (attention's q / k / v / o, the
    dense SwiGLUs, the shared experts; not the LM head) compute on bf16 copies of their weights that
    the optimizer's step writes (core.adamw.PrecisionAwareAdamW.add_compute_copies), their weight
    gradients kept in bf16 on the copies and read by the optimizer (as expert_grads_bf16 does for the
    experts): no fp32 -> bf16 cast of these weights in the forward (read 4 + write 2 B an element) and
    no bf16 -> fp32 cast of their gradients in the backward (read 2 + write 4 B), for 2 B an element
    more written by the optimizer and 2 B less read. The same bits as without it with one micro-batch
    per step (autocast rounds each weight and its gradient to bf16 either way;
    tests/core/test_dense_copies.py); gradient accumulation would sum the gradients in bf16 and is
    refused, as for expert_grads_bf16. Memory: the copies take the place of autograd's bf16 casts,
    which the backward keeps anyway; the dense gradients take 2 B an element instead of 4. Bound by
    the casts in olmoe3-4l-8e's measured step (about 2.7 ms of cast kernels on the H100,
    docs/performance.md, session 31). Measured with the other three switches of sessions 31-32 (H100,
    session 34): together 1.0-1.6% faster on olmoe3-4l-8e, 1.2% on OLMoE-8L, for 1.5-2.0 GiB more peak;
    ``auto`` by default since session 50 (with the other copies: +3.7-3.8% tokens/s on olmoe3-4l-8e, +10.8% on
    OLMoE-8L, for 2.6 / 5.5 GiB more peak; H100, docs/performance.md)."""
    head_weight_copy: bool | None = None
    """``auto`` (None, the default): on where copies_auto_on holds, off elsewhere. bf16 recipe, one GPU
    (unsharded fp32 weights): the fused LM loss computes on a bf16 copy of the
    head's weight that the optimizer's step writes, instead of casting the fp32 weight in every forward
    (read 4 + write 2 B an element: 2.5 GB, about 0.9 ms a step at V 100352 x D 4096 on the H100,
    session 31's profile), for 2 B an element more written by the optimizer. The gradient stays fp32
    on the master weight (the loss accumulates it over chunks in fp32), so gradient accumulation is
    allowed. The same bits as without it (the copy is the cast's rounding). Memory: the copy, 2 B x
    V x D (0.77 GiB at that shape), is held all step instead of only during the loss' forward: the
    step's peak rises by about that where it is outside the loss. Apart from dense_weight_copies, which
    leaves the head out, so each is measured on its own. Alone on olmoe3-4l-8e (H100, session 34): 0.7%
    faster, at the edge of that run's 0.4% noise; ``auto`` by default since session 50 (copies_auto_on)."""
    head_grads_bf16: bool = False
    """With head_weight_copy: the LM head's weight gradient kept in bf16 on that copy, a leaf the fused
    loss differentiates in the weight's place (as dense_weight_copies does for the other linears): the
    loss' grad_W GEMM writes 2 B an element instead of 4 when the loss runs in one chunk
    (model.loss_chunk_tokens >= the micro-batch's tokens; else it sums the chunks in fp32 and rounds
    once), and the optimizer and the clipping norm read 2 B less each: 6 B x V x D a step (about
    2.5 GB at V 100352 x D 4096; the planner counts 4 of the 6 B, 0.5 ms on the H100: docs/planner.md),
    and 2 B x V x D less held. The
    gradient is the fp32 one rounded to bf16, as autocast's unfused head would give it; gradient
    accumulation would sum it in bf16 and is refused, as for the other bf16 gradients. Measured
    with split_master and embedding_weight_copy (session 48, docs/performance.md): together 0.9-1.7% faster
    on #13's shapes; alone (session 49) 0.8 / 0.4 GiB less peak, its speed within noise. Off (one unsharded
    GPU, no accumulation)."""
    embedding_weight_copy: bool = False
    """bf16 recipe with the bf16 residual stream (bf16_residual auto or true), one GPU (unsharded fp32
    weights): the token embedding gathers its rows from a bf16 copy of its weight that the optimizer's
    step writes, a leaf whose gradient is kept in bf16 (each row summed in fp32, rounded once) and read
    by the optimizer as the weight's, as dense_weight_copies does for the linears. The rows are the same
    bits as the fp32 rows cast to the bf16 stream; the gradient is the fp32 one rounded. Moves 2 B x V x D
    less for the gradient's write, the optimizer's read and the clipping norm's read, for the copy's 2 B
    written by the optimizer (none more with optimizer.split_master, which then splits the embedding's
    master too), and no fp32 rows gathered and cast, nor their gradient widened (10 B x tokens x D compiled,
    16 eager: run/planner/switches.py EMBEDDING_COPY_ROW_BYTES);
    holds 2 B x V x D less gradient for the copy's 2 B (with split_master, 2 B x V x D less in all).
    Gradient accumulation is refused, as for the other bf16 gradients. Measured with
    split_master and head_grads_bf16 (session 48): together 0.9-1.7% faster on #13's shapes; alone (session
    49) no measurable gain and 0.8 / 0.4 GiB more peak (the copy beside the unsplit master): use it with
    split_master. Off (one unsharded GPU, no accumulation)."""
    bf16_residual: Residual = Residual.auto
    """The residual stream between the blocks in the compute dtype (bf16) instead of the embedding's fp32,
    as FSDP2's bf16 all-gather already makes it in sharded runs (the embedding's output cast once; the
    pipeline's stage boundaries carry bf16): the residual adds, the norms' reads and their gradients
    move 2 B an element instead of 4, and the blocks' linears read their input without a cast.
    Megatron-LM's default (fp32_residual_connection off) and torchtitan's (FSDP2's bf16 parameters) keep
    the stream in bf16 too. A numerics change, not the same bits: each block's sum is rounded to bf16
    (2^-9 relative). ``auto`` (the default): on with the bf16 recipe, off with fp32 and the
    low-precision recipes (Residual; ``true`` turns it on with those, not measured there; a ConfigError
    with fp32). Measured on one H100 (session 46, docs/performance.md), two same-run pairs each: compiled
    olmoe3-4l-8e 0.5-0.7% faster and 0.5 GiB less, OLMoE-8L 0.7-1.1% faster and 1.3 GiB less; eager
    olmoe3-4l-8e 3.2% faster and 1.6 GiB less (one pair); the GPU proxy's loss at three seeds +0.19%
    train / +0.17% held-out beside the runs without it (within tools/compare_runs.py's 1%); the proxy
    model's gradients against an fp32 step 5.95% (median relative) beside bf16's own 5.82%."""
    save_swiglu_product: bool = False
    """bf16 recipe: the routed experts' fused SwiGLU-down op (core/precision/bf16_grouped.py) keeps the
    product silu(gate) * up [R, F] (R = tokens x top-k) for its backward instead of recomputing it
    there: 2 B x R x F more held per MoE layer (0.5 GiB a layer on olmoe3-4l-8e at 16,384 tokens),
    and the backward's SwiGLU pass no longer writes it (the same 2 B x R x F of HBM traffic less: about
    0.18 ms a layer there on the H100). The same values either way (the recompute is the forward's
    own ops). A memory-for-time trade for runs with room; measured only together with the other
    switches (H100, session 34, docs/performance.md): off by default."""
    fused_shared_input: bool = False
    """bf16 recipe: the linears that read one input (attention's q, k and v; a dense SwiGLU's or shared
    expert's gate and up: core.layers.linear.shared_input) run as one GEMM on their weights
    concatenated at use (the parameters, the checkpoints and the HF layout stay separate): one
    [T, D] x [D, sum O] GEMM forward instead of one per weight, one K = sum O GEMM for the input's
    gradient instead of one per weight and the sum of their outputs, one for the weights' gradients.
    Wider GEMMs run nearer the tensor cores' rate (session 34's olmoe3-4l-8e profile on the H100,
    docs/bench/session34/call2/profile_S2_G.json: [16384, 4096] x [4096, 4096] at 697 TFLOP/s,
    x [4096, 20480] at 728). The concatenation is one more
    write of the bf16 weights where they are the optimizer's copies (dense_weight_copies), fused
    with the cast otherwise. The same math; each output is the same dot product, summed in the
    order the wider GEMM's kernel picks (within bf16 rounding of the separate GEMMs:
    tests/core/test_fused_shared_input.py). Measured slower on olmoe3-4l-8e (0.5%, with the other
    switches; H100, session 34) and within noise on OLMoE-8L: off by default."""
    triton_swiglu: bool = True
    """The routed experts' SwiGLU (silu(gate) * up) and its backward in one Triton pass each on CUDA
    (core/precision/swiglu_triton.py) instead of seven torch elementwise passes (eager) or inductor's
    fused kernels (compiled); the same roundings, equal to the torch path within a stated tolerance
    (tests/core/test_swiglu_triton.py). bf16 recipe: fused into the down projection's op (measured on
    the H200: +3.2% tokens/s and -1.2 GiB on olmoe3-4l-8e, docs/performance.md); the low-precision
    recipes: the op before their down projection (swiglu_rows; measured on the H200, session 17:
    +1.1% tokens/s on olmoe3-4l-8e, +0.4% on OLMoE-8L, peak unchanged). On by default; the CPU always takes the torch path; ``false``
    forces it on CUDA too."""
    quantize_weights_once: bool = False
    """Low-precision recipes under torch.compile: the routed experts' grouped GEMMs run outside the
    compiled graph (a graph break at each; inside they are custom ops and Triton kernels anyway),
    so the backend's WeightCache serves them: each expert weight is quantized once per optimizer
    step and reused by the backward and every micro-batch, instead of at every use (a traced graph
    cannot keep the cache: forward and backward of every micro-batch requantize). Eager runs cache
    anyway. Measured on the H200 (olmoe3-4l-8e, cuBLAS experts, one micro-batch): +1.8% tokens/s,
    +2.3 GiB (docs/performance.md, session 7). Off by default: it pays most with many micro-batches
    per step; the planner counts the saving and the cache held."""
    emulated_save_x_bf16: bool = False
    """mxfp8 / fp8_blockwise on the emulated backend: each GEMM input's wgrad operand (its columns along
    the tokens, quantized) kept from the forward to the backward as its bf16 quantize-dequantize, 2 B
    per element, instead of the e4m3 + scales payload, 1 + 1/32 B (Blackwell's memory): the same
    values, no dequantize pass in the backward, and the forward's fused kernel writes bf16 columns
    (core/precision/emulated.py _quantize_x). Off by default: it buys speed with memory
    (docs/precision.md has the measured trade)."""
    quantize_input_once: InputOnce = InputOnce.auto
    """fp8_rowwise, fp8_blockwise (both backends) and mxfp8 on the emulated backend: linears that read one input
    (attention's q, k and v; a dense SwiGLU's gate and up, the shared expert's too) quantize it once
    for all of them, in one autograd op (GemmBackend.linears, core.layers.linear.shared_input),
    instead of once per linear: fewer quantization passes in the forward, one saved wgrad operand
    instead of three (two), one dequantize in the backward; dx is the sum of the dgrads, accumulated
    in the GEMM (emulated), added in bf16 (fp8_rowwise) or in fp32 and rounded once (native
    fp8_blockwise, since session 38), so its last bits can differ from the
    separate linears' (autograd's bf16 adds in its own order). ``auto`` (default): on where the
    recipe and backend take it, off elsewhere (bf16; see InputOnce); ``true`` asks for it (an error
    where it cannot be had), ``false`` turns it off. Never slower where measured, always smaller:
    mxfp8 emulated OLMoE-8L -2.6 ms a step, -1.0 GiB (H200, session 26), olmoe3-4l-8e -1.6 ms, -1.5
    GiB (H100, session 28); fp8_rowwise OLMoE-8L -4.4 ms (-2.4%), -0.5 GiB, olmoe3-4l-8e -3.8 ms
    (-1.6%), -0.6 GiB (H200, session 29); native fp8_blockwise OLMoE-8L +2.6% tokens/s, -0.5 GiB,
    olmoe3-4l-8e +1.5%, -0.8 GiB (H100, session 38; docs/precision.md)."""
    quantized_expert_copies: bool = False
    """mxfp8 on the emulated backend with expert_weight_copies=optimizer and expert_grads_bf16: the
    optimizer's step writes each expert weight's copy already quantized to MX along its input dim and
    dequantized (the forward GEMM's operand, which receives the gradient) and a second bf16 copy
    quantized along its output dim (the dgrad's), in its own pass over the weight
    (core.adamw_triton.adamw_update_mx_pair_), so no GEMM quantizes an expert weight: under
    torch.compile each forward and backward otherwise quantizes every expert weight again (two reads
    and two writes of 2 B per element a step). The same values as without it, bit for bit (the same
    quantization of the same bf16 copy); +2 B per expert weight element of memory (the second copy).
    Measured on OLMoE-8L with the MX pair on 8 warps: -5.3 ms a step on the H100 (session 28), -0.7 ms
    on the H200 (session 29: within the repeats' noise; +4.5 ms there with 4 warps, session 26), +6 GiB
    either way (docs/precision.md): off by default, as it buys little for its memory on the H200."""
    bf16_experts: Bf16Experts = Bf16Experts.grouped_mm
    """How the routed experts' grouped bf16 GEMMs run (see Bf16Experts), in the bf16 recipe and in the
    emulated backends (whose GEMMs take the dequantized operands in bf16): torch's grouped kernel (no
    host sync) or one cuBLAS GEMM per expert (a host sync per expert op forward and backward; under torch.compile the
    emulated backends' grouped GEMMs then run outside the graph, a graph break at each). The same
    operands; the fp32 sums in each kernel's own order; cuBLAS writes the weight gradients in the
    weight's dtype from the fp32 sums (no bf16 rounding, no cast pass). The native low-precision backends refuse it
    (fp8_blockwise has ``fp8_experts=cublas``)."""
    fp8_experts: Fp8Experts = Fp8Experts.auto
    """fp8_blockwise recipe, native backend: how the routed experts' grouped FP8 GEMMs run (see
    Fp8Experts): the Triton kernels (no host sync), one cuBLAS GEMM per expert (a host sync per GEMM;
    faster where a layer has few experts with many rows each) or the Gluon kernels (SM90, no host sync);
    ``auto`` (default): Gluon on an SM90 GPU, Triton elsewhere."""
    fp8_wgrad: Fp8Wgrad = Fp8Wgrad.all
    """fp8_blockwise recipe (native backend) and fp8_rowwise (any backend): which weight-gradient GEMMs
    run in FP8 along the tokens (see Fp8Wgrad): ``all`` (true), ``none`` (false: every wgrad in bf16
    from the saved bf16 input and the bf16 output gradient, fp32 accumulation, as the bf16 recipe's;
    no transposed token tiles to quantize, x saved in 2 bytes per element instead of about 1) or
    ``dense`` (the dense linears in FP8, the routed experts' grouped wgrads in bf16). The forward and
    the dgrad stay FP8 either way (core/precision/fp8_gemm.py, fp8_rowwise.py). Measured on the H200,
    compiled: fp8_blockwise false -12% tokens/s on OLMoE-8L, -5% on olmoe3-4l-8e with cuBLAS experts;
    fp8_rowwise with fast accumulation and the bf16 copies, false: +6.6% on OLMoE-8L, -3.2% on
    olmoe3-4l-8e (docs/performance.md, session 14)."""

    fp8_quantize_warps: int = 4
    """fp8_blockwise recipe, native backend: the warps of the 1x128 quantization kernel that makes the
    activations' and gradients' rows and tokens operands (blockwise_triton.QUANTIZE_WARPS; 4 or 8). In
    isolation (tools/bench_quantize.py) the H200 favoured 4 by 0-3%, session 38's H100 had them 0.7%
    apart and session 39's H100 favoured 8 by 9-17%; in steps 8 is within noise (H100, session 40 call 2:
    OLMoE-8L f8gc +0.3% / +0.4%, olmoe3-4l-8e -0.1% / +0.5%), so 4."""
    fp8_gluon_group: int = 1
    """fp8_blockwise recipe with the Gluon experts (precision.fp8_experts=gluon, auto on an SM90 GPU): the
    raster of the Gluon rows kernel (forward and dgrad) in groups of this many 128-row tiles, column-major
    within a group (fp8_gluon.GluonConfig.group, set_rows_group), so the CTAs running at once share each
    weight tile across the group instead of re-reading an expert's weights from HBM for every row tile
    where they exceed L2; 1: row tile by row tile. 1 to 64. One module-level kernel config: the backend
    built last sets it for the process. Groups of 8 measured within noise in steps (H100, session 40 call
    5: olmoe3-4l-8e f8gc -0.1% / +0.2%, OLMoE-8L -0.3% / -0.4%), so 1."""
    fp8_fused_swiglu: bool = False
    """fp8_blockwise recipe, native backend (the Triton or Gluon experts, FP8 expert wgrads): the routed
    experts' SwiGLU computed inside the 1x128 quantization kernels, forward (the product quantized from
    h = [gate | up] as it is made) and backward (h's gradient quantized from the product's gradient as
    it is made), so neither the bf16 product nor h's bf16 gradient is written and read back: 12 bytes an
    element of [rows, F] less traffic a layer, two kernels fewer each way; the same bits
    (core/precision/fp8_gemm.py _Fp8GroupedSwiGLU). Off: measured slower on the H100 (session 38: its
    forward kernel level with the two it replaces, its backward 0.68-0.74x; steps 0.970x on OLMoE-8L,
    0.987x on olmoe3-4l-8e; blockwise_triton.TILE_WARPS)."""
    fp8_fast_accum: bool = False
    """fp8_rowwise recipe, native backend: the FP8 GEMMs accumulate on the tensor cores without the
    periodic promotion to fp32 (``use_fast_accum``): measured 1.6-2.2x bf16 per expert GEMM against
    1.3-1.6x with promotion on the H200 (session 11), at a less accurate sum over long reductions."""
    fp8_fused_amax: bool = True
    """fp8_rowwise recipe, on CUDA: each grouped expert GEMM operand (x, the output gradient) quantized
    along its rows by the kernel that also takes its per-expert columns' partial maxima for the FP8
    wgrad (x read once for both; fp8_rowwise_triton.quantize_rows_chunks); false: two kernels, two
    reads (the measurement's off switch). The same bits either way."""

    def with_auto_copies(self, on: bool) -> "PrecisionConfig":
        """This config with every AUTO_COPIES switch left at ``auto`` (None) resolved: ``on`` (copies_auto_on's
        answer for the run) gives ``optimizer`` / true, else ``none`` / false; expert_grads_bf16's auto is on
        only with the optimizer's expert copies. A value given is kept."""
        copies = self.expert_weight_copies
        if copies is None:
            copies = WeightCopies.optimizer if on else WeightCopies.none
        grads = self.expert_grads_bf16
        if grads is None:
            grads = on and WeightCopies(copies) == WeightCopies.optimizer
        return dataclasses.replace(
            self, expert_weight_copies=copies, expert_grads_bf16=grads,
            dense_weight_copies=on if self.dense_weight_copies is None else self.dense_weight_copies,
            head_weight_copy=on if self.head_weight_copy is None else self.head_weight_copy)

    @property
    def auto_copies(self) -> bool:
        """Whether some AUTO_COPIES switch is still ``auto`` (None): resolved by with_auto_copies."""
        return any(getattr(self, name) is None for name in AUTO_COPIES)

    def validate(self) -> None:
        if self.auto_copies:
            # Checked as the switches would stand where auto turns them on (a bf16 run on one GPU), so that a
            # switch that needs them (head_grads_bf16, split_master) is not refused before the layout is known.
            self.with_auto_copies(self.recipe in (PrecisionRecipe.bf16, PrecisionRecipe.auto)).validate()
            return
        super().validate()
        if self.mx_scale not in ("rceil", "floor"):
            raise ConfigError(f"precision.mx_scale: {self.mx_scale!r} is not one of 'rceil', 'floor'")
        if self.quantize_weights_once and self.recipe not in _LOW_PRECISION:
            raise ConfigError(f"precision.quantize_weights_once caches the low-precision recipes' quantized expert "
                              f"weights: it needs --precision.recipe=mxfp8, fp8_blockwise or fp8_rowwise, got {self.recipe} (the bf16 "
                              f"recipe's counterpart is precision.expert_weight_copies)")
        experts = Fp8Experts(self.fp8_experts)
        if experts not in (Fp8Experts.auto, Fp8Experts.triton) and self.recipe != PrecisionRecipe.fp8_blockwise:
            raise ConfigError(f"precision.fp8_experts={experts} picks how fp8_blockwise's expert GEMMs run: it needs "
                              f"--precision.recipe=fp8_blockwise, got {self.recipe}; drop it for this recipe")
        wgrad = Fp8Wgrad(self.fp8_wgrad)
        if wgrad != Fp8Wgrad.all and self.recipe not in (PrecisionRecipe.fp8_blockwise, PrecisionRecipe.fp8_rowwise):
            raise ConfigError(f"precision.fp8_wgrad={wgrad} runs some of an FP8 recipe's weight gradients in bf16: it needs "
                              f"--precision.recipe=fp8_blockwise or fp8_rowwise, got {self.recipe}; drop it for this recipe")
        if not self.fp8_fused_amax and self.recipe != PrecisionRecipe.fp8_rowwise:
            raise ConfigError(f"precision.fp8_fused_amax=false is an option of the fp8_rowwise recipe's quantization: it "
                              f"needs --precision.recipe=fp8_rowwise, got {self.recipe}; drop it for this recipe")
        if self.fp8_quantize_warps not in (4, 8):
            raise ConfigError(f"precision.fp8_quantize_warps must be 4 or 8 (the 1x128 quantization kernel's warps), "
                              f"got {self.fp8_quantize_warps}")
        if self.fp8_quantize_warps != 4 and self.recipe != PrecisionRecipe.fp8_blockwise:
            raise ConfigError(f"precision.fp8_quantize_warps sets the fp8_blockwise recipe's quantization kernel, and this "
                              f"run's recipe is {self.recipe}: drop it, or use --precision.recipe=fp8_blockwise")
        if not 1 <= self.fp8_gluon_group <= 64:
            raise ConfigError(f"precision.fp8_gluon_group must be 1 to 64 (the Gluon rows kernel's row tiles a raster "
                              f"group), got {self.fp8_gluon_group}")
        if self.fp8_gluon_group != 1 and self.recipe != PrecisionRecipe.fp8_blockwise:
            raise ConfigError(f"precision.fp8_gluon_group sets the fp8_blockwise recipe's Gluon expert GEMMs, and this "
                              f"run's recipe is {self.recipe}: drop it, or use --precision.recipe=fp8_blockwise")
        if self.fp8_fused_swiglu and self.recipe != PrecisionRecipe.fp8_blockwise:
            raise ConfigError(f"precision.fp8_fused_swiglu=true is an option of the fp8_blockwise recipe's expert GEMMs: it "
                              f"needs --precision.recipe=fp8_blockwise, got {self.recipe}; drop it for this recipe")
        if self.fp8_fast_accum and self.recipe != PrecisionRecipe.fp8_rowwise:
            raise ConfigError(f"precision.fp8_fast_accum=true is an option of the fp8_rowwise recipe's GEMMs: it needs "
                              f"--precision.recipe=fp8_rowwise, got {self.recipe}; drop it for this recipe")
        copies = WeightCopies(self.expert_weight_copies)
        optimizer_copies = copies == WeightCopies.optimizer and self.expert_grads_bf16
        if copies != WeightCopies.none and self.recipe in _LOW_PRECISION and not optimizer_copies:
            raise ConfigError(f"precision.expert_weight_copies={copies} with precision.recipe={self.recipe}: the "
                              f"low-precision recipes quantize their own weight copies; they take the optimizer's "
                              f"bf16 copies only as --precision.expert_weight_copies=optimizer "
                              f"--precision.expert_grads_bf16=true (the GEMMs differentiate the copies; fp8_rowwise, "
                              f"fp8_blockwise and mxfp8 emulated); otherwise drop expert_weight_copies")
        if self.backend != PrecisionBackend.auto and self.recipe in _LOW_PRECISION:  # known before resolving
            check_expert_copies(self.recipe, self.backend, copies == WeightCopies.optimizer)
        check_emulated_saves(self.recipe, self.backend, self.emulated_save_x_bf16)
        check_input_once(self.recipe, self.backend, self.quantize_input_once)
        if self.recipe != PrecisionRecipe.auto:  # known before resolving: its ConfigError for true on fp32
            residual_on(self.recipe, self.bf16_residual)
        check_quantized_copies(self.recipe, self.backend, self.quantized_expert_copies, optimizer_copies, self.modules)
        check_bf16_copies(self.recipe, self.dense_weight_copies)
        check_bf16_copies(self.recipe, self.head_weight_copy, switch="head_weight_copy")
        check_embedding_copy(self.recipe, self.embedding_weight_copy, self.bf16_residual)
        check_save_product(self.recipe, self.save_swiglu_product)
        check_fused_input(self.recipe, self.fused_shared_input)
        if self.head_grads_bf16 and not self.head_weight_copy:
            raise ConfigError("precision.head_grads_bf16=true keeps the LM head's gradient on the optimizer's bf16 "
                              "copy of its weight: it needs --precision.head_weight_copy=true (its auto turns it on only "
                              "for bf16 on one GPU with one micro-batch a step)")
        if self.expert_grads_bf16 and copies != WeightCopies.optimizer:
            raise ConfigError("precision.expert_grads_bf16=true keeps the experts' gradients on the optimizer's bf16 "
                              "weight copies: it needs --precision.expert_weight_copies=optimizer, got "
                              f"{self.expert_weight_copies}")

    def check_gemm_widths(self, widths: dict[str, dict[str, int]]) -> None:
        """ConfigError unless every GEMM width of ``modules`` divides into the recipe's scale blocks
        (mxfp8: 32 along each reduction dim; fp8_blockwise: 128, its weights' 128x128 tiles);
        ``widths``: ModelConfig.gemm_widths(). At start-up, not at the first GEMM of the first step."""
        block = _WIDTH_BLOCK.get(self.recipe)
        if block is None:
            return
        for module in self.modules:
            for field, width in widths.get(str(GemmModule(module)), {}).items():
                if width % block:
                    raise ConfigError(
                        f"precision.recipe={self.recipe} scales blocks of {block} along every GEMM dim of "
                        f"precision.modules, but {field} is {width} (a width of the {module} GEMMs): make it a "
                        f"multiple of {block}, or drop {module} from --precision.modules (those GEMMs then run in bf16)")

    def resolved_recipe(self, device_type: str) -> PrecisionRecipe:
        if self.recipe == PrecisionRecipe.auto:
            return PrecisionRecipe.bf16 if device_type == "cuda" else PrecisionRecipe.fp32
        return self.recipe

    def resolved_backend(self, device_type: str, capability_major: int | None = None,
                         verbose: bool = False) -> PrecisionBackend:
        """native or emulated for a low-precision recipe on this device (ConfigError where native
        cannot run); ``capability_major`` defaults to the current GPU's."""
        recipe = self.resolved_recipe(device_type)
        if recipe not in _LOW_PRECISION:
            return PrecisionBackend.native
        major = capability_major if capability_major is not None else _capability_major(device_type)
        can_native = major is not None and _NATIVE_SM[recipe] <= major <= _NATIVE_SM_MAX.get(recipe, major)
        where = "the CPU" if major is None else f"an SM{major}x GPU"
        if self.backend == PrecisionBackend.native and not can_native:
            raise ConfigError(
                f"precision.recipe={recipe} with precision.backend=native needs an {_NATIVE_GPU[recipe]} GPU, "
                f"and this run is on {where}: use --precision.backend=emulated (the same numerics through "
                f"bf16 GEMMs)" + (" or --precision.recipe=fp8_blockwise (native on Hopper)"
                                  if recipe == PrecisionRecipe.mxfp8 and major == 9 else "")
                + (" or --precision.recipe=mxfp8 (native on Blackwell)"
                   if recipe == PrecisionRecipe.fp8_rowwise and major is not None and major >= 10 else ""))
        if self.backend == PrecisionBackend.auto:
            chosen = PrecisionBackend.native if can_native else PrecisionBackend.emulated
            if verbose and not can_native and is_main():
                print(f"precision: {recipe} has no native GEMMs on {where} (they need {_NATIVE_GPU[recipe]}): "
                      f"running it emulated (exact quantized operands, bf16 GEMMs; results labelled emulated)",
                      flush=True)
            return chosen
        return self.backend

    def resolved_fp8_experts(self, device_type: str, backend: PrecisionBackend | str,
                             capability_major: int | None = None) -> Fp8Experts:
        """precision.fp8_experts with ``auto`` resolved (Fp8Experts.auto): gluon for the native
        fp8_blockwise backend on an SM90 GPU (``capability_major``, default the current GPU's) where
        Gluon imports, else triton; other values as given."""
        experts = Fp8Experts(self.fp8_experts)
        if experts != Fp8Experts.auto:
            return experts
        major = capability_major if capability_major is not None else _capability_major(device_type)
        native = (self.resolved_recipe(device_type) == PrecisionRecipe.fp8_blockwise
                  and PrecisionBackend(backend) == PrecisionBackend.native)
        if native and major == 9:
            try:
                from .fp8_gluon import AVAILABLE
            except ImportError:  # no triton at all
                AVAILABLE = False
            if AVAILABLE:
                return Fp8Experts.gluon
        return Fp8Experts.triton

    def build(self, device: torch.device | str, verbose: bool = True) -> PrecisionPolicy:
        """The policy for a run on ``device``. AUTO_COPIES still at ``auto`` build off: the caller that knows
        the run's layout resolves them first (with_auto_copies(copies_auto_on(...)): run/build.py)."""
        c = self.with_auto_copies(False) if self.auto_copies else self  # the copy switches as they build
        c.validate()
        device_type = torch.device(device).type
        recipe = self.resolved_recipe(device_type)
        per_expert = Bf16Experts(self.bf16_experts) == Bf16Experts.cublas
        check_bf16_copies(recipe, c.dense_weight_copies)  # auto resolved: fp32 on the CPU
        check_bf16_copies(recipe, c.head_weight_copy, switch="head_weight_copy")
        check_embedding_copy(recipe, self.embedding_weight_copy, self.bf16_residual)
        check_save_product(recipe, self.save_swiglu_product)
        check_fused_input(recipe, self.fused_shared_input)
        residual = torch.bfloat16 if residual_on(recipe, self.bf16_residual) else None
        if recipe == PrecisionRecipe.fp32:
            return PrecisionPolicy(device_type, None, gemm_backend("torch"))
        if recipe == PrecisionRecipe.bf16:
            from .gemm import TorchGemm

            gemm = TorchGemm(weight_copies=c.expert_weight_copies, triton_swiglu=self.triton_swiglu,
                             grads_on_copies=c.expert_grads_bf16,
                             per_expert=per_expert, dense_copies=c.dense_weight_copies,
                             head_copy=c.head_weight_copy, save_swiglu_product=self.save_swiglu_product,
                             fused_shared_input=self.fused_shared_input, head_grads=self.head_grads_bf16,
                             embedding_copy=self.embedding_weight_copy)
            return PrecisionPolicy(device_type, torch.bfloat16, gemm, residual_dtype=residual)
        backend = self.resolved_backend(device_type, verbose=verbose)
        if recipe == PrecisionRecipe.mxfp8 and backend == PrecisionBackend.native and GemmModule.experts in self.modules:
            major = _capability_major(device_type)
            if major is not None and major != 10:  # torch's MXFP8 grouped kernel: compute capability 10.x only
                raise ConfigError(f"precision.recipe=mxfp8 with backend=native: torch's MXFP8 grouped GEMM for the "
                                  f"experts runs on SM100 / SM103 (compute capability 10.x), and this GPU is "
                                  f"SM{major}x: use --precision.backend=emulated, or "
                                  f"--precision.modules=[attention,mlp] (experts then stay bf16)")
        wgrad = Fp8Wgrad(self.fp8_wgrad)
        if wgrad != Fp8Wgrad.all and backend != PrecisionBackend.native and recipe == PrecisionRecipe.fp8_blockwise:
            raise ConfigError(f"precision.fp8_wgrad={wgrad} is an option of the native fp8_blockwise GEMMs (an SM90+ GPU), "
                              f"and this run resolved precision.backend={backend}: drop fp8_wgrad, or run on a Hopper GPU")
        if per_expert and backend == PrecisionBackend.native:
            raise ConfigError(f"precision.bf16_experts=cublas runs bf16 expert GEMMs one cuBLAS GEMM per expert (the bf16 "
                              f"recipe, and the emulated backends' dequantized operands), and this run's {recipe} "
                              f"resolved precision.backend=native: use --precision.fp8_experts=cublas for fp8_blockwise, "
                              f"or --precision.backend=emulated")
        fp8_experts = self.resolved_fp8_experts(device_type, backend)
        if fp8_experts == Fp8Experts.cublas and backend != PrecisionBackend.native:
            raise ConfigError("precision.fp8_experts=cublas needs the native fp8_blockwise backend (an SM90+ GPU), and "
                              f"this run resolved precision.backend={backend}: drop fp8_experts, or run on a Hopper GPU")
        if fp8_experts == Fp8Experts.gluon:
            major = _capability_major(device_type)
            if backend != PrecisionBackend.native or (major is not None and major != 9):
                where = f"an SM{major}x GPU" if major is not None else f"precision.backend={backend}"
                raise ConfigError(f"precision.fp8_experts=gluon runs fp8_blockwise's expert GEMMs on Hopper's wgmma "
                                  f"(SM90, the native backend), and this run has {where}: use "
                                  f"--precision.fp8_experts=triton (the same GEMMs, any GPU)")
        if self.fp8_fast_accum and backend != PrecisionBackend.native:
            raise ConfigError("precision.fp8_fast_accum=true is an option of the native fp8_rowwise GEMMs (an SM90 GPU), "
                              f"and this run resolved precision.backend={backend}: drop fp8_fast_accum, or run on a Hopper GPU")
        expert_copies = WeightCopies(c.expert_weight_copies) == WeightCopies.optimizer
        check_expert_copies(recipe, backend, expert_copies)
        check_emulated_saves(recipe, backend, self.emulated_save_x_bf16)
        input_once = input_once_on(recipe, backend, self.quantize_input_once)
        check_quantized_copies(recipe, backend, self.quantized_expert_copies, expert_copies and c.expert_grads_bf16,
                               self.modules)
        if self.fp8_fused_swiglu and backend != PrecisionBackend.native:
            raise ConfigError("precision.fp8_fused_swiglu=true is an option of the native fp8_blockwise GEMMs (an SM90+ GPU), "
                              f"and this run resolved precision.backend={backend}: drop fp8_fused_swiglu, or run on a Hopper GPU")
        if self.fp8_fused_swiglu and (fp8_experts == Fp8Experts.cublas or not wgrad.experts_fp8):
            raise ConfigError(f"precision.fp8_fused_swiglu=true fuses the SwiGLU into the Triton / Gluon expert GEMMs' FP8 "
                              f"operands, and this run has precision.fp8_experts={fp8_experts}, fp8_wgrad={wgrad}: use "
                              "fp8_experts=triton or gluon with fp8_wgrad=all, or drop fp8_fused_swiglu")
        if self.fp8_quantize_warps != 4 and backend != PrecisionBackend.native:
            raise ConfigError("precision.fp8_quantize_warps sets the native fp8_blockwise GEMMs' Triton quantization (an "
                              f"SM90+ GPU), and this run resolved precision.backend={backend}: drop it, or run on a Hopper GPU")
        if self.fp8_gluon_group != 1 and fp8_experts != Fp8Experts.gluon:
            raise ConfigError(f"precision.fp8_gluon_group orders the Gluon expert GEMMs' tiles, and this run's expert "
                              f"GEMMs resolved precision.fp8_experts={fp8_experts}: drop fp8_gluon_group, or use "
                              "--precision.fp8_experts=gluon (fp8_blockwise on an SM90 GPU)")
        gemm = low_precision_gemm(recipe, backend, self.mx_scale, fp8_experts, wgrad, self.fp8_fast_accum,
                                  expert_copies=expert_copies, fp8_fused_amax=self.fp8_fused_amax,
                                  save_x_bf16=self.emulated_save_x_bf16,
                                  quantized_copies=self.quantized_expert_copies, fused_swiglu=self.fp8_fused_swiglu,
                                  quantize_warps=self.fp8_quantize_warps, gluon_group=self.fp8_gluon_group)
        gemm.quantize_weights_once = bool(self.quantize_weights_once)
        gemm.quantize_input_once = input_once
        gemm.per_expert = per_expert
        gemm.triton_swiglu = bool(self.triton_swiglu)
        return PrecisionPolicy(device_type, torch.bfloat16, gemm, modules=frozenset(GemmModule(m) for m in self.modules),
                               residual_dtype=residual)


def low_precision_gemm(recipe: PrecisionRecipe | str, backend: PrecisionBackend | str, mx_scale: str = "rceil",
                       fp8_experts: Fp8Experts | str = Fp8Experts.triton, fp8_wgrad: Fp8Wgrad | bool | str = Fp8Wgrad.all,
                       fp8_fast_accum: bool = False, expert_copies: bool = False, fp8_fused_amax: bool = True,
                       save_x_bf16: bool = False, quantized_copies: bool = False, fused_swiglu: bool = False,
                       quantize_warps: int = 4, gluon_group: int = 1):
    """The GemmBackend instance of a low-precision recipe and a resolved backend (native / emulated);
    ``expert_copies``: the experts on the optimizer's bf16 weight copies (fp8_rowwise, fp8_blockwise and the emulated
    backend; precision.expert_weight_copies=optimizer); ``fp8_fused_amax``: precision.fp8_fused_amax;
    ``save_x_bf16``: precision.emulated_save_x_bf16 (mxfp8 / fp8_blockwise emulated, check_emulated_saves);
    ``quantized_copies``: precision.quantized_expert_copies (mxfp8 emulated, check_quantized_copies);
    ``fused_swiglu``: precision.fp8_fused_swiglu (native fp8_blockwise); ``quantize_warps``:
    precision.fp8_quantize_warps (native fp8_blockwise); ``gluon_group``: precision.fp8_gluon_group (the Gluon
    experts)."""
    recipe, backend, wgrad = PrecisionRecipe(recipe), PrecisionBackend(backend), Fp8Wgrad(fp8_wgrad)
    if recipe == PrecisionRecipe.fp8_rowwise:  # its own emulation: the wgrad's scales are per expert, not blocks
        from .fp8_rowwise import Fp8RowwiseGemm

        return Fp8RowwiseGemm(native=backend == PrecisionBackend.native, fast_accum=fp8_fast_accum,
                              wgrad=wgrad, expert_copies=expert_copies,
                              fused_amax=fp8_fused_amax)
    if backend == PrecisionBackend.emulated:
        from .emulated import BlockwiseFormat, EmulatedGemm, MXFormat

        return EmulatedGemm(MXFormat(mx_scale) if recipe == PrecisionRecipe.mxfp8 else BlockwiseFormat(),
                            expert_copies=expert_copies, save_x_bf16=save_x_bf16, quantized_copies=quantized_copies)
    if recipe == PrecisionRecipe.mxfp8:
        if expert_copies:
            raise ValueError("expert_copies: the native mxfp8 GEMMs do not take the optimizer's bf16 weight copies")
        from .native_mx import NativeMXGemm

        return NativeMXGemm(mx_scale)
    from .fp8_gemm import Fp8BlockwiseGemm

    return Fp8BlockwiseGemm(experts=str(Fp8Experts(fp8_experts)), wgrad=wgrad, expert_copies=expert_copies,
                            fused_swiglu=fused_swiglu, quantize_warps=quantize_warps, gluon_group=gluon_group)
