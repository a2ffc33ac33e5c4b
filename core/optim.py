"""AdamW with decoupled weight decay groups (moments in fp32, bf16 or 8 bits), and LR schedules (linear
warmup, then cosine / WSD)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.tensor import DTensor
from torch import nn

from .adamw import MIN_ONE_MINUS_BETA, AdamWKernel, PrecisionAwareAdamW, triton_usable
from .config import Config, ConfigError, StrEnum
from .moments_q8 import CODE_NAMES


def check_split_master(on: bool, has_copies: bool) -> None:
    """ConfigError where optimizer.split_master is on and the run has no weight the model computes on
    through the optimizer's bf16 copies (``has_copies``), naming the switches that make them: the rule
    the trainer (on the copies attached) and the planner (on the configs) both apply."""
    if on and not has_copies:
        raise ConfigError("optimizer.split_master=true holds split the masters of the weights the model computes on "
                          "through the optimizer's bf16 copies, and this run has none: set "
                          "precision.dense_weight_copies=true, precision.head_weight_copy=true, precision.embedding_weight_copy=true or "
                          "precision.expert_weight_copies=optimizer with expert_grads_bf16=true, or drop split_master")


class StateDtype(StrEnum):
    fp32 = "fp32"
    """Adam moments in fp32 (8 bytes per parameter): torch.optim.AdamW, fused on the GPU."""
    bf16 = "bf16"
    """Adam moments stored in bf16 (4 bytes per parameter, 4 saved), fp32 master weights and update
    math (core.adamw.PrecisionAwareAdamW); round-to-nearest, so each 1 - beta must be at least 2^-8
    (beta2 <= 0.996: 0.95 is fine, 0.999 would freeze exp_avg_sq)."""
    q8 = "q8"
    """Adam moments in 8 bits (2 bytes per parameter and a scale a block of 256: 6 saved against fp32, 2
    against bf16): block-wise dynamic quantization (core.moments_q8, the scheme of Dettmers et al.'s 8-bit
    optimizers), fp32 master weights and update math, the parameter updated from the unrounded moments
    (core.adamw.PrecisionAwareAdamW; on the GPU one Triton pass, 14 bytes an element with split masters where
    bf16 moves 18). Changes the optimizer's numerics: a moment keeps about 2 significant digits near its
    block's largest and fewer below. Not with precision.quantized_expert_copies. Its kernel is bound by its
    instructions (1.5x bf16's time on an H100): fp8 codes the same bytes in hardware."""
    fp8 = "fp8"
    """Adam moments in 8 bits as E4M3 under a power-of-two scale a block of 256 (core.moments_q8's fp8 code: the
    first moment, the second moment's root floored at E4M3's smallest subnormal), fp32 master weights and
    update math, the parameter updated from the unrounded moments. The same 2 bytes a parameter as q8 (its
    scales 1 byte a block), coded and decoded by the GPU's conversion instructions. The first moment is within
    6.25% of its value down to 2^-6 of its block's scale (coarser than q8 near a block's largest, finer far below
    it); the root within one E4M3 step (12.5%) a step, unbiased. Not with precision.quantized_expert_copies. Its
    kernel's time is not yet measured on a GPU."""


EIGHT_BIT_STATES = {name: dtype for dtype, name in CODE_NAMES.items()}
"""The 8-bit optimizer.state_dtype values and their codes' dtypes (core.moments_q8.CODE_NAMES)."""
assert set(EIGHT_BIT_STATES) <= set(StateDtype), "core.moments_q8.CODE_NAMES names a code StateDtype lacks"


class OptimizerImpl(StrEnum):
    auto = "auto"
    """On CUDA parameters PrecisionAwareAdamW with the Triton kernel (either state_dtype: measured
    25.2 ms vs torch's fused AdamW 30.4 ms for 3.77B fp32 parameters on one H200, at 1.03x its HBM
    floor; docs/performance.md), unless optimizer.fused is set; on the CPU torch.optim.AdamW for
    fp32 state and PrecisionAwareAdamW's foreach ops for bf16."""
    torch = "torch"
    """fp32 state: torch.optim.AdamW (fused on the GPU, see fused); bf16: PrecisionAwareAdamW's
    foreach ops (about ten passes over the state per step)."""
    triton = "triton"
    """PrecisionAwareAdamW with core.adamw_triton's kernel for either state_dtype: one read and one
    write of each tensor per step (28 bytes per parameter fp32, 20 bf16). CUDA parameters, or the
    CPU under TRITON_INTERPRET=1."""


@dataclasses.dataclass
class OptimizerConfig(Config):
    AUTO_NONE = frozenset({"split_master"})  # its None is auto (with_auto_split)
    lr: float = 3e-4
    """Peak learning rate (reached at the end of warmup)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Applied to weight matrices only; never to norms or the input embedding."""
    fused: bool | None = None
    """torch's fused AdamW kernel (state_dtype=fp32): None lets optimizer.impl choose (auto: the Triton
    kernel on GPU, torch's unfused AdamW on CPU); true or false with impl auto or torch selects torch's
    AdamW, fused or not."""
    state_dtype: StateDtype = StateDtype.fp32
    """Storage dtype of the Adam moments exp_avg and exp_avg_sq (see StateDtype); parameters stay fp32."""
    impl: OptimizerImpl = OptimizerImpl.auto
    """Which AdamW runs the step (see OptimizerImpl); the maths is torch's either way."""
    overlap: bool = False
    """The step on a side CUDA stream, unit by unit in forward order (embedding, blocks, final norm,
    LM head), each unit's next forward waiting for its own update only (core/overlap.py): the
    memory-bound updates overlap the compute-bound forward; bit-identical results, global-norm
    clipping exact. One unsharded GPU (no FSDP2, expert or pipeline parallel) and this package's
    AdamW (not impl=torch / fused). Off by default until measured on the GPU (docs/performance.md)."""
    triton_grad_norm: bool = False
    """The clipping norm's squared sums through one Triton reduction a gradient (core/grad_norm_triton.py:
    each gradient read once at the streaming rate, fp32 partials summed in a fixed order) instead of
    torch's _foreach_norm; the same bf16 / fp32 independence, other rounding. CUDA (torch's path
    elsewhere). On the H100 (session 34) 1.12x torch's alone over OLMoE-8L's 3.77B gradients (5.22
    against 5.86 ms), within noise in whole steps of both #13 shapes: off by default."""
    split_master: bool | None = None
    """Hold the fp32 master of every weight the model computes on through the optimizer's bf16 copy
    (precision.dense_weight_copies, head_weight_copy, embedding_weight_copy, expert_weight_copies=optimizer
    with expert_grads_bf16) split in two: that copy, the master rounded to nearest even, and an int16 rest
    (core.adamw.split_fp32). The step reads and writes 8 bytes of master an element instead of 10, and
    each such weight keeps 4 bytes (copy and rest) instead of 6 (fp32 and copy): its fp32 storage is
    freed between steps and rebuilt only to save, load or check it, and once fit() returns (Trainer.fit).
    The same updates bit for bit, but at a bf16 rounding tie (the master's low 16 bits exactly 0x8000,
    about one element in 65,536), where the master kept moves one fp32 ulp toward its rounding. This
    package's AdamW (PrecisionAwareAdamW), one unsharded GPU as the copies are; a save or load holds the
    fp32 masters again for its duration (4 bytes an element).
    ``auto`` (None, the default since session 52): on where the precision switches' ``auto`` turns the
    copies on (core.precision.config.copies_auto_on) and the run holds copies it can split
    (core.precision.config.split_copies_held); off elsewhere (with_auto_split). Measured with the default
    copies (H100, compiled, 16,384 tokens a step, docs/performance.md): +0.6% on olmoe3-4l-8e and +1.0% on
    OLMoE-8L (session 52, beside split_master=false in one run), for 4.1 / 6.6 GiB less peak, below the
    copies-off peak; the GPU proxy at three seeds within 1% of the copies alone (session 51). Between steps a split parameter holds no storage
    and has a guarded stand-in class (core.split_param): its shape, dtype, device and gradient read as
    before, and a read of its values outside the trainer's blocks (a loop of one's own around train_step)
    raises SplitMasterError naming ``trainer.masters_materialized()`` instead of reading freed memory. The
    trainer's own reads are inside that block (save, load, the finiteness check, on_step_end), and fit()
    returns with the masters joined."""

    def with_auto_split(self, on: bool) -> "OptimizerConfig":
        """This config with split_master left at ``auto`` (None) resolved to ``on`` (the run's answer:
        copies_auto_on and split_copies_held); a value given is kept."""
        return self if self.split_master is not None else dataclasses.replace(self, split_master=on)

    def validate(self) -> None:
        # math.isfinite first: nan fails every comparison, so "nan <= 0" alone would let it through.
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ConfigError(f"optimizer.lr must be a positive finite number, got {self.lr}: e.g. --optimizer.lr=3e-4")
        if not math.isfinite(self.eps) or self.eps <= 0:
            raise ConfigError(
                f"optimizer.eps must be a positive finite number (it keeps Adam's update denominator away from "
                f"zero), got {self.eps}: e.g. --optimizer.eps=1e-8"
            )
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.overlap and (self.impl == OptimizerImpl.torch or self.fused is not None):
            raise ConfigError("optimizer.overlap=true steps this package's AdamW unit by unit: leave optimizer.impl "
                              "auto or triton and optimizer.fused unset, or drop optimizer.overlap")
        if self.impl == OptimizerImpl.triton and self.fused:
            raise ConfigError("optimizer.fused=true is torch's fused AdamW: with optimizer.impl=triton leave "
                              "optimizer.fused unset")
        if self.state_dtype in EIGHT_BIT_STATES and self.fused:
            raise ConfigError("optimizer.fused=true is torch's fused AdamW, which keeps fp32 moments: with "
                              f"optimizer.state_dtype={self.state_dtype} leave optimizer.fused unset")
        if self.state_dtype == StateDtype.bf16:
            if self.fused:
                raise ConfigError("optimizer.fused=true is torch's fused AdamW, which keeps fp32 moments: with "
                                  "optimizer.state_dtype=bf16 leave optimizer.fused unset (foreach kernels are used)")
            floor = MIN_ONE_MINUS_BETA[torch.bfloat16]
            for name in ("beta1", "beta2"):
                if 1 - getattr(self, name) < floor:
                    raise ConfigError(
                        f"optimizer.{name}={getattr(self, name)} with optimizer.state_dtype=bf16: a bf16 moment "
                        f"rounded to nearest cannot register a per-step decay 1 - {name} below 2^-8 (it would stop "
                        f"decaying): "
                        f"set optimizer.{name} <= {1 - floor:.4f} (e.g. beta2=0.95) or optimizer.state_dtype=fp32"
                    )

    def writes_copies(self, on_gpu: bool, all_fp32: bool = True) -> bool:
        """Whether build() makes this package's AdamW (PrecisionAwareAdamW: bf16 moments, or impl triton, or
        auto on a GPU over fp32 parameters without ``fused``), the optimizer that writes the precision
        switches' bf16 weight copies, rather than torch.optim.AdamW. One rule for build and for what
        precision's ``auto`` copies ask of the optimizer (core.precision.config.copies_auto_on)."""
        torch_adamw = self.impl == OptimizerImpl.torch or (
            self.impl == OptimizerImpl.auto and not self.overlap and (not on_gpu or self.fused is not None or not all_fp32))
        return not (self.state_dtype == StateDtype.fp32 and torch_adamw)

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s trainable parameters in two decay groups (more where DTensors
        meet plain tensors): torch.optim.AdamW or PrecisionAwareAdamW, as OptimizerImpl says."""
        self.validate()
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        decay, no_decay = [], []
        for p in model.parameters():
            if not p.requires_grad:
                continue
            (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
        groups = []
        for params, wd in ((decay, self.weight_decay), (no_decay, 0.0)):
            # The fused and foreach kernels take one kind of tensor per call: where DTensors (expert
            # parallel without FSDP) meet plain tensors, each kind gets its own group.
            dt = [p for p in params if isinstance(p, DTensor)]
            plain = [p for p in params if not isinstance(p, DTensor)]
            groups += [{"params": ps, "weight_decay": wd} for ps in ((dt, plain) if dt and plain else (params,))]
        betas = (self.beta1, self.beta2)
        on_gpu = any(p.is_cuda for p in model.parameters())
        all_fp32 = all(p.dtype == torch.float32 for g in groups for p in g["params"])
        if not self.writes_copies(on_gpu, all_fp32):
            if self.split_master:
                raise ConfigError("optimizer.split_master=true is held by this package's AdamW, and this run builds "
                                  "torch.optim.AdamW (optimizer.state_dtype=fp32 with impl=torch or fused, or auto on "
                                  "the CPU): set optimizer.state_dtype=bf16 or optimizer.impl=triton, or drop "
                                  "split_master")
            fused = on_gpu if self.fused is None else self.fused
            return torch.optim.AdamW(groups, lr=self.lr, betas=betas, eps=self.eps, fused=fused or None)
        bad = sorted({str(p.dtype) for g in groups for p in g["params"]
                      if not p.is_floating_point() or torch.finfo(p.dtype).bits < 32
                      or (self.impl == OptimizerImpl.triton and p.dtype != torch.float32)})
        if bad:
            raise ConfigError(
                f"optimizer.state_dtype={self.state_dtype} with optimizer.impl={self.impl} keeps the parameters as "
                f"fp32 master weights, but some are {bad}: build the model in fp32 (bf16 compute comes from "
                f"precision.recipe), or use state_dtype=fp32 with impl=torch"
            )
        if self.impl == OptimizerImpl.triton:
            why = triton_usable(torch.device("cuda" if on_gpu else "cpu"))
            if why:
                raise ConfigError(f"optimizer.impl=triton: {why}; use optimizer.impl=auto or torch")
        kernel = {OptimizerImpl.torch: AdamWKernel.foreach, OptimizerImpl.triton: AdamWKernel.triton,
                  OptimizerImpl.auto: AdamWKernel.auto}[self.impl]
        state_dtype = {StateDtype.fp32: torch.float32, StateDtype.bf16: torch.bfloat16,
                       **EIGHT_BIT_STATES}[self.state_dtype]
        return PrecisionAwareAdamW(groups, lr=self.lr, betas=betas, eps=self.eps, state_dtype=state_dtype,
                                   kernel=kernel, split_master=bool(self.split_master))


class ScheduleKind(StrEnum):
    cosine = "cosine"
    """Linear warmup, then cosine decay to min_lr_ratio * lr at the last step."""
    wsd = "wsd"
    """Warmup-stable-decay: linear warmup, constant, then linear decay over the last decay_fraction."""
    constant = "constant"
    """Linear warmup, then constant."""


class LRSchedule:
    """Multiplier of the peak LR at a step; a picklable callable (LambdaLR saves its state)."""

    def __init__(self, kind: ScheduleKind, warmup: int, total: int, min_ratio: float, decay_fraction: float):
        self.kind, self.warmup, self.total = kind, warmup, total
        self.min_ratio, self.decay_fraction = min_ratio, decay_fraction

    def __call__(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == ScheduleKind.constant:
            return 1.0
        if self.kind == ScheduleKind.cosine:
            span = max(1, self.total - self.warmup)
            progress = min(1.0, (step - self.warmup) / span)
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        decay_steps = max(1, round(self.decay_fraction * self.total))
        decay_start = self.total - decay_steps
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / decay_steps)
        return 1.0 - (1.0 - self.min_ratio) * progress


@dataclasses.dataclass
class SchedulerConfig(Config):
    kind: ScheduleKind = ScheduleKind.cosine
    """Shape after warmup (see ScheduleKind)."""
    warmup_steps: int = 20
    """Linear warmup from lr/warmup_steps to lr."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak (cosine and WSD)."""
    decay_fraction: float = 0.2
    """WSD only: the share of all steps spent in the final linear decay."""

    def validate(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"scheduler.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"scheduler.decay_fraction must be in (0, 1], got {self.decay_fraction}")

    def build(self, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        self.validate()
        fn = LRSchedule(self.kind, self.warmup_steps, total_steps, self.min_lr_ratio, self.decay_fraction)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
