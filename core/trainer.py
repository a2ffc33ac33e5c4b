"""The training loop: gradient accumulation, clipping, LR schedule, evaluation, logging, checkpoints.

The Trainer is model-agnostic: it takes a built model (plain or FSDP2-wrapped), a loss
function over (logits, labels) or None when the model computes its own loss from labels
(``model(inputs, labels) -> mean loss``: the fused LM-head loss never makes full logits), the model's training FLOPs per token, a data source with
``next_batch()/val_batches()/state_dict()``, and a Checkpointer. Host syncs happen only on logging
and evaluation steps (the loss and grad norm stay on the device in between).

Legend: B micro-batch, S sequence, V vocab.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .config import Config, ConfigError, StrEnum
from .precision import PrecisionPolicy
from .distributed import StepWatchdog, is_main
from .metrics import MetricsLog, mfu, model_tflops_per_device, peak_tflops
from .grad import DTensor, clip_grad_norm_
from .moe.layer import MoELayer, moe_layers
from .layers.loss import loss_weight
from .optim import check_split_master
from .moe.metrics import AUX_LOSSES, LoadLog, StarvedExpertWatch, summarize
from .tracking import Tracker


class NonFinite(StrEnum):
    stop = "stop"
    """Stop with an error naming the first step whose loss or grad norm was NaN/inf (checked at
    log steps and before every save; no host sync per step). Nothing is saved after it."""
    skip = "skip"
    """Skip the update of such a step (gradients dropped; data, schedule and step count move on).
    Costs one host sync per step; a state that is itself non-finite still stops the run."""


class NonFiniteError(RuntimeError):
    """Training produced a NaN/inf loss, grad norm or parameter: the message names the step."""


# "No non-finite step since the last check" in the device-side flag (steps are far below it).
_NO_STEP = 2**62


class GradSync(StrEnum):
    micro_batch = "micro_batch"
    """Reduce (FSDP2: reduce-scatter) the gradients after every micro-batch's backward: only the
    sharded gradients stay between micro-batches (least memory, one collective per micro-batch)."""
    step = "step"
    """Reduce once per optimizer step, after the last micro-batch: the unsharded gradients are
    accumulated locally in between (one collective per step, full-size gradients held)."""


def use_deterministic(on: bool) -> None:
    """Turn the process's deterministic kernels on or off (trainer.deterministic): torch's deterministic
    algorithms (an op without one raises, naming it; inductor then compiles in its deterministic mode: no
    benchmark-driven choices), with CUBLAS_WORKSPACE_CONFIG=:4096:8 set where unset (cuBLAS reads it when it
    makes its first handle: before the first GPU matmul of the process, as the Trainer's construction is).
    torch's fill of uninitialized memory (every torch.empty written with NaN while deterministic algorithms are on)
    is turned off with them: it makes reads of memory never written repeat, which no op of the step does (OLMoE-8L
    ends at the same loss bit for bit with and without it, session 53; tests/core/test_determinism.py's GPU test
    compares them), and its fill kernels took 15 ms of OLMoE-8L's deterministic step (H100: 0.858x the default's
    tokens/s with it, 0.907-0.914x without, sessions 53-54; docs/performance.md). Turning them off restores torch's
    default (the fill on)."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)
    torch.utils.deterministic.fill_uninitialized_memory = not on


@dataclasses.dataclass
class TrainerConfig(Config):
    steps: int = 200
    """Total optimizer steps of the run (the LR schedule spans them)."""
    stop_at_step: int | None = None
    """Stop (after checkpointing) once this step is done, as if interrupted; resume continues."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward on each rank; None = the rank's whole share of the batch."""
    grad_sync: GradSync = GradSync.micro_batch
    """When gradient accumulation reduces gradients over the data-parallel ranks (see GradSync);
    no effect without FSDP2, one micro-batch, or under a pipeline schedule."""
    grad_clip: float = 1.0
    """Max global grad norm; 0 disables clipping (the norm is still computed and logged)."""
    on_nonfinite: NonFinite = NonFinite.stop
    """What a NaN/inf loss or grad norm does: stop the run (default) or skip that step (see NonFinite)."""
    device: str = "auto"
    """'auto', 'cpu' or 'cuda' (or 'cuda:N')."""
    seed: int = 0
    """Seeds model init and every RNG."""
    log_interval: int = 10
    """Steps between console/JSONL log lines (each costs one host sync)."""
    eval_interval: int = 50
    """Steps between held-out evaluations; 0 = only at the end."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    eval_batch_size: int | None = None
    """Sequences per held-out batch over all ranks; None = the training global batch size."""
    run_dir: str = "runs/default"
    """Where metrics.jsonl and the resolved config are written."""
    peak_tflops: float | None = None
    """Device peak for MFU; None detects known GPUs (and reports no MFU on the CPU)."""
    compile: bool = False
    """torch.compile each block and the final norm (Transformer.compile_modules)."""
    cuda_graph: bool = False
    """Capture each step's forward and backward in one CUDA graph after two ordinary steps and replay
    it (core/cuda_graph.py): the host launches one graph a step instead of every kernel. One GPU,
    no pipeline, no optimizer.overlap, a fixed batch shape, a step without host syncs."""
    deterministic: bool = False
    """Bit-reproducible steps: the same configuration, seed and data give the same losses and weights run after
    run (use_deterministic: torch.use_deterministic_algorithms, which also puts inductor in its deterministic
    mode, and CUBLAS_WORKSPACE_CONFIG=:4096:8). For A/B checks of a change, whose difference is otherwise drowned
    in the run-to-run noise of nondeterministic kernels (session 51: the GPU proxy's same configuration and seed
    1.4% apart at step 200). Measured (sessions 52-54, H100, OLMoE-8L compiled, docs/performance.md): two runs'
    losses equal bit for bit, at 0.907-0.914x the default's tokens/s (the rest: attention leaves cuDNN's kernels, whose
    backward is not deterministic, for FlashAttention-2's deterministic one, 16 -> 38 ms a step; torch's fill of
    uninitialized memory, 15 ms, is off); for checks, not production runs. An op without a deterministic kernel
    raises torch's error naming it. Not covered: collectives across ranks. The Triton fp8 GEMMs' autotuned tile
    does not matter (each output element sums its K-blocks in the same order whatever the tile: every config gives
    the same bits in test_pipelined_configs_give_the_same_bits_on_gpu, passed on the H100 in session 54)."""
    collective_timeout_s: float = 1800.0
    """Seconds a collective may wait for the other ranks before it fails (the process group's
    timeout); a watchdog also ends this rank, naming it and its step, when no training step
    completes within this time (a hung or dead peer)."""
    starved_expert_share: float = 0.1
    """An expert is starved at a log step when it got less than this x the fair share (1/E) of its
    layer's tokens; 0 turns the starved-expert alert off."""
    starved_expert_log_steps: int = 3
    """Consecutive log steps an expert must stay starved before the console alerts, naming its layer."""

    def validate(self) -> None:
        if self.steps <= 0:
            raise ConfigError(f"trainer.steps must be positive, got {self.steps}")
        if self.stop_at_step is not None and not 0 < self.stop_at_step <= self.steps:
            raise ConfigError(f"trainer.stop_at_step must be in [1, trainer.steps={self.steps}], got {self.stop_at_step}")
        if self.micro_batch_size is not None and self.micro_batch_size <= 0:
            raise ConfigError(f"trainer.micro_batch_size must be positive, got {self.micro_batch_size}")
        if self.log_interval <= 0:
            raise ConfigError(f"trainer.log_interval must be positive, got {self.log_interval}")
        if self.eval_interval < 0 or self.eval_batches < 0:
            raise ConfigError("trainer.eval_interval and trainer.eval_batches must be >= 0")
        if self.eval_batch_size is not None and self.eval_batch_size <= 0:
            raise ConfigError(f"trainer.eval_batch_size must be positive (or null: the training global batch "
                              f"size), got {self.eval_batch_size}")
        if not self.grad_clip >= 0 or math.isinf(self.grad_clip):  # also refuses NaN
            raise ConfigError(f"trainer.grad_clip must be a finite number >= 0 (0 disables clipping), "
                              f"got {self.grad_clip}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"trainer.collective_timeout_s must be positive, got {self.collective_timeout_s}")
        if not 0 <= self.starved_expert_share <= 1:
            raise ConfigError(f"trainer.starved_expert_share must be in [0, 1] (a fraction of the fair share; "
                              f"0 = no alert), got {self.starved_expert_share}")
        if self.starved_expert_log_steps <= 0:
            raise ConfigError(f"trainer.starved_expert_log_steps must be positive, got {self.starved_expert_log_steps}")


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        model: nn.Module | list[nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        data: Any,
        flops_per_token: float,
        device: torch.device,
        checkpointer: Any = None,
        run_metadata: dict[str, Any] | None = None,
        world_size: int = 1,
        on_step_end: Callable[[int, dict], None] | None = None,
        step_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        eval_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        grad_norm_groups: tuple = (),
        pre_step_hook: Callable[[list[nn.Module]], None] | None = None,
        precision: PrecisionPolicy | None = None,
        grad_sync: Callable[[bool], None] | None = None,
        tracker: Tracker | None = None,
        overlap_optimizer: bool = False,
        triton_grad_norm: bool = False,
    ):
        """``model``: the model, or the list of modules this rank runs (pipeline stages).
        ``loss_fn(logits, labels) -> mean loss`` over ``model(inputs)``'s logits, or None: the model
        takes the labels and returns the mean loss itself (``model(inputs, labels)``, e.g. a
        moetron Transformer, whose LM head then fuses the loss with its GEMM).
        ``step_fn(batch) -> loss`` replaces the built-in forward/backward over micro-batches (the
        pipeline schedule supplies one); ``eval_fn(batch) -> loss`` likewise for evaluation.
        ``grad_norm_groups``: groups across which the model is split (pipeline stages): the squared
        grad norm is summed over them and the MoE load statistics gathered from them.
        ``pre_step_hook(model_parts)`` sees the gradients before clipping (tests compare layouts).
        ``precision``: the run's PrecisionPolicy (its autocast wraps every forward; default fp32).
        ``grad_sync(enabled)``: the data strategy's switch for reducing gradients in a backward
        (ParallelState.grad_sync); with ``cfg.grad_sync=step`` only the last micro-batch reduces.
        ``tracker``: also sends every log record and MoE load summary to TensorBoard / W&B.
        ``overlap_optimizer`` (optimizer.overlap): the optimizer step on a side stream, overlapped
        with the next forward unit by unit (core/overlap.py; one unsharded GPU).
        ``triton_grad_norm`` (optimizer.triton_grad_norm): the clipping norm through
        core/grad_norm_triton.py."""
        cfg.validate()
        self.cfg = cfg
        if cfg.deterministic:
            use_deterministic(True)
        self.model_parts = list(model) if isinstance(model, (list, tuple)) else [model]
        self.model = self.model_parts[0]
        # Wrapping (FSDP2, compile) is done before the Trainer is built: the set is fixed.
        self.params = [p for part in self.model_parts for p in part.parameters()]
        self.step_fn, self.eval_fn, self.grad_norm_groups = step_fn, eval_fn, tuple(grad_norm_groups)
        self.pre_step_hook = pre_step_hook
        # MoE layers by block index, found in whatever wrappers (FSDP2, stages) hold them.
        self.moe_layers: dict[int, MoELayer] = moe_layers(self.model_parts)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.flops_per_token = flops_per_token
        self.device = device
        self.checkpointer = checkpointer
        self.run_metadata = run_metadata or {}
        self.world_size = world_size
        self.on_step_end = on_step_end
        self.step = 0
        self.precision = precision or PrecisionPolicy.full(device.type)
        self.precision.attach_optimizer(optimizer, self.model_parts)  # e.g. bf16 weight copies the step writes
        if getattr(optimizer, "split_master", False):
            check_split_master(True, bool(optimizer.split_parameters()))
        # Where the optimizer holds masters split (optimizer.split_master), what reads or sets the
        # parameters outside the step does so inside this block (nothing to do otherwise).
        self.masters_materialized = getattr(optimizer, "masters_materialized", contextlib.nullcontext)
        # fit() returns with the split masters joined (so the model read after training holds its fp32 weights),
        # until the next step splits them again: _hold_masters / _release_masters.
        self._masters_held: contextlib.ExitStack | None = None
        # What holds the gradients: the parameters, and tensors computing in some parameters' place
        # whose .grad is theirs (precision.expert_grads_bf16, dense_weight_copies: the optimizer's bf16 copies).
        self._grad_holders = list(getattr(optimizer, "gradient_holders", list)())
        self.grad_tensors = self.params + self._grad_holders
        self.grad_sync = grad_sync
        self.peak = peak_tflops(device, cfg.peak_tflops)
        self.log = MetricsLog(os.path.join(cfg.run_dir, "metrics.jsonl") if is_main() and cfg.run_dir else None)
        self.history: list[dict[str, Any]] = []
        self.load_log = LoadLog(os.path.join(cfg.run_dir, "moe_load.npz") if is_main() and cfg.run_dir else None)
        self.tracker = tracker
        self.starved_watch = StarvedExpertWatch(cfg.starved_expert_share, cfg.starved_expert_log_steps)
        # The first step since the last check whose loss or grad norm was not finite (_NO_STEP:
        # none): updated on the device every step, read only where the loop syncs anyway.
        self.first_nonfinite = torch.full((), _NO_STEP, dtype=torch.long, device=device)
        self.skipped_steps = 0  # on_nonfinite=skip: updates dropped so far in this process
        self.overlap = self._overlap() if overlap_optimizer else None
        self.triton_grad_norm = triton_grad_norm
        self.step_graph = self._step_graph() if cfg.cuda_graph else None

    def _step_graph(self):
        """trainer.cuda_graph's StepGraph over this trainer's forward and backward; ConfigError where
        the step has collectives, a pipeline schedule or a side stream of its own."""
        from .cuda_graph import StepGraph

        ranks = self.world_size > 1 or (dist.is_initialized() and dist.get_world_size() > 1)
        sharded = any(isinstance(p, DTensor) for p in self.params)
        if ranks or sharded or self.step_fn is not None or len(self.model_parts) > 1:
            raise ConfigError("trainer.cuda_graph=true captures one GPU's whole step, and this run has several ranks "
                              "or stages (FSDP2, expert or pipeline parallel), whose collectives and schedules the "
                              "capture does not take: set trainer.cuda_graph=false")
        if self.overlap is not None:
            raise ConfigError("trainer.cuda_graph=true and optimizer.overlap=true do not combine: the overlap's "
                              "forward waits on a side stream's events outside the graph; drop one of them")
        return StepGraph(self._forward_backward, self.grad_tensors, self.model_parts,
                         lambda: self.precision.after_optimizer_step(self.model_parts), self.device)

    def _overlap(self):
        """optimizer.overlap's OptimizerOverlap over the model's forward units; ConfigError where the
        layout reads the parameters outside their forwards (FSDP2, expert or pipeline parallel)."""
        from .overlap import OptimizerOverlap, forward_units

        if self.step_fn is not None or len(self.model_parts) > 1 or any(isinstance(p, DTensor) for p in self.params):
            raise ConfigError("optimizer.overlap=true overlaps the optimizer step with the next forward on one "
                              "unsharded GPU; this run shards or pipelines the model (FSDP2, expert or pipeline "
                              "parallel), whose own streams read the parameters: drop optimizer.overlap")
        return OptimizerOverlap(self.optimizer, forward_units(self.model), self.device)

    def wait_optimizer(self) -> None:
        """Make the current stream wait for an overlapped optimizer step still in flight (before
        reading the parameters outside a forward); nothing without optimizer.overlap."""
        if self.overlap is not None:
            self.overlap.wait_all()

    # ---- state ------------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler, "data": self.data}

    def save(self) -> str | None:
        if self.checkpointer is None:
            return None
        self.wait_optimizer()
        meta = dict(self.run_metadata, step=self.step, world_size=self.world_size, torch=torch.__version__)
        with self.masters_materialized():
            return self.checkpointer.save(self.step, self._ckpt_model(), self.optimizer, self._extra_state(), meta)

    def load(self, path: str) -> None:
        self.wait_optimizer()
        with self.masters_materialized():
            meta = self.checkpointer.load(path, self._ckpt_model(), self.optimizer, self._extra_state())
            self._refresh_copies()
        self.step = int(meta["step"])
        # The steps after the checkpoint are trained again: their old log rows go, the earlier
        # load records are kept (both files then read as one uninterrupted run).
        dropped = self.log.truncate_after(self.step)
        self.load_log.resume(self.step)
        if is_main():
            note = f" (dropped {dropped} metrics.jsonl rows of later steps, trained again now)" if dropped else ""
            print(f"resumed from {path} at step {self.step}{note}", flush=True)

    def init_weights(self, path: str) -> None:
        """The model's weights from the checkpoint at ``path`` (checkpoint.init_from: a converted or
        upcycled checkpoint, or another run's), nothing else: the optimizer and the step start fresh."""
        self.wait_optimizer()
        with self.masters_materialized():
            self.checkpointer.load(path, self._ckpt_model(), None, {}, model_only=True)
            self._refresh_copies()

    def _refresh_copies(self) -> None:
        # The optimizer's compute copies of the weights (precision.*_copies) still hold the weights
        # before a load: rewrite them from the loaded ones (and re-split split masters).
        refresh = getattr(self.optimizer, "refresh_compute_copies", None)
        if refresh is not None:
            refresh()

    def _ckpt_model(self):
        return self.model_parts if len(self.model_parts) > 1 else self.model

    # ---- one step ---------------------------------------------------------------------------
    def _micro_batches(self, batch: torch.Tensor) -> list[torch.Tensor]:
        size = self.cfg.micro_batch_size or batch.shape[0]
        if batch.shape[0] % size:
            raise ConfigError(
                f"each rank's batch of {batch.shape[0]} sequences does not split into micro-batches of "
                f"{size}: set trainer.micro_batch_size to a divisor of {batch.shape[0]}"
            )
        return list(batch.split(size))

    def train_step(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's batch [B_local, S+1]; returns (loss, grad_norm) on device."""
        self._release_masters()  # after a fit(): the split masters held joined since
        for part in self.model_parts:
            part.train()
        if self.step_fn is not None:
            return self._optimizer_step(self.step_fn(batch.to(self.device, non_blocking=True)))
        if self.step_graph is not None:
            return self._optimizer_step(self.step_graph(batch))
        return self._optimizer_step(self._forward_backward(batch.to(self.device, non_blocking=True)))

    def _forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``batch`` (on the device); the summed
        token-weighted loss. The gradients are accumulated on the grad tensors."""
        micro = self._micro_batches(batch)
        if len(micro) > 1 and self._grad_holders:
            raise ConfigError(f"precision.expert_grads_bf16, dense_weight_copies, head_grads_bf16 or embedding_weight_copy keeps weight "
                              f"gradients in bf16 on the optimizer's copies, and this step accumulates {len(micro)} "
                              f"micro-batches, which would sum them in bf16: use one micro-batch per step "
                              f"(trainer.micro_batch_size = the batch) or set them false")
        total_tokens = batch.shape[0] * (batch.shape[1] - 1)
        loss_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro):
            inputs_BS, labels_BS = mb[:, :-1], mb[:, 1:]
            if self.grad_sync is not None and self.cfg.grad_sync == GradSync.step:
                self.grad_sync(i == len(micro) - 1)  # only the last backward reduces
            # Each micro-batch's mean loss is weighted by its share of the rank's tokens, so the
            # accumulated gradient is that of the mean over the whole batch; the MoE layers' aux
            # losses (per-token means too, attached to their outputs) get the same weight, and the
            # fused LM loss may compute its gradients at it (model.fused_loss_prescale).
            share = labels_BS.numel() / total_tokens
            with loss_weight(share):
                loss = self._loss(inputs_BS, labels_BS) * share
                loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    def _loss(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """The mean loss of one micro-batch: the model's own (loss_fn None), else loss_fn over its
        logits; the forward under the run's autocast, the loss_fn outside it (fp32 as before)."""
        if self.loss_fn is None:
            with self.precision.autocast():
                return self.model(inputs_BS, labels_BS)
        with self.precision.autocast():
            logits_BSV = self.model(inputs_BS)
        return self.loss_fn(logits_BSV, labels_BS)

    def _optimizer_step(self, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pre_step_hook is not None:
            self.pre_step_hook(self.model_parts)
        # Without clipping the norm is still measured (logged, and checked for NaN/inf): an
        # infinite max_norm measures without touching the gradients.
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        # An optimizer that can fold the clip coefficient into its step saves a pass over the gradients.
        defer = self.optimizer if hasattr(self.optimizer, "defer_grad_scale") else None
        grad_norm = clip_grad_norm_(self.grad_tensors, max_norm, self.grad_norm_groups, defer_to=defer,
                                    triton=self.triton_grad_norm)
        bad = ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
        if self.cfg.on_nonfinite == NonFinite.skip and self._any_rank(bad):
            self.skipped_steps += 1
            if is_main():
                print(f"step {self.step + 1}: non-finite loss or grad norm, update skipped "
                      f"(trainer.on_nonfinite=skip)", flush=True)
        else:
            if self.overlap is not None:  # on a side stream: the next forward waits unit by unit
                self.overlap.step([t.grad for t in self.grad_tensors if t.grad is not None])
            else:
                self.optimizer.step()
            self.precision.after_optimizer_step()  # backends holding weights quantized per step drop them
        self.optimizer.zero_grad(set_to_none=True)
        # No sync: the flag is read at the next log step or save (stop mode).
        self.first_nonfinite = torch.minimum(self.first_nonfinite, torch.where(bad, self.step + 1, _NO_STEP))
        self.scheduler.step()
        for layer in self.moe_layers.values():
            layer.update_expert_bias()  # aux-loss-free balancing from this step's global counts
        return loss_sum, grad_norm

    # ---- non-finite values -------------------------------------------------------------------
    @staticmethod
    def _any_rank(flag: torch.Tensor) -> bool:
        """Whether ``flag`` (a 0-dim bool) is set on any rank; one host sync."""
        flag = flag.to(torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _check_finite(self, before_save: bool = False) -> None:
        """Raise NonFiniteError if a step since the last check had a NaN/inf loss or grad norm
        (stop mode), or, before a save, if any parameter is NaN/inf: such a state is never saved."""
        first = self.first_nonfinite.clone()
        if dist.is_initialized():
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        first = int(first.item())
        if first != _NO_STEP and self.cfg.on_nonfinite == NonFinite.stop:
            raise NonFiniteError(
                f"step {first} had a non-finite (NaN/inf) loss or grad norm: training stopped at step "
                f"{self.step} without saving it (any earlier checkpoint is intact); lower optimizer.lr "
                f"or model.init_std, check the norm eps and the data, or set trainer.on_nonfinite=skip"
            )
        self.first_nonfinite.fill_(_NO_STEP)
        if before_save:
            self.wait_optimizer()
            local = [p.to_local() if isinstance(p, DTensor) else p for p in self.params]
            finite = torch.stack([torch.isfinite(t).all() for t in local]).all() if local else torch.ones((), dtype=torch.bool)
            if self._any_rank(~finite.to(self.device)):
                raise NonFiniteError(
                    f"the parameters are NaN/inf after step {self.step}: not saving them (the checkpoints "
                    f"before it are intact); lower optimizer.lr or model.init_std, or check the norm eps"
                )

    @torch.no_grad()
    def evaluate(self) -> float:
        if self.cfg.eval_batches == 0:
            return math.nan
        for part in self.model_parts:
            part.eval()
        batches = self.data.val_batches(self._eval_batch_size(), max_batches=self.cfg.eval_batches)
        total = torch.zeros(2, device=self.device, dtype=torch.float64)
        for batch in batches:
            batch = batch.to(self.device)
            n = batch[:, 1:].numel()
            if self.eval_fn is not None:
                loss = self.eval_fn(batch)
            else:
                loss = self._loss(batch[:, :-1], batch[:, 1:])
            total[0] += loss.double() * n
            total[1] += n
        if dist.is_initialized():
            dist.all_reduce(total)
        for part in self.model_parts:
            part.train()
        return (total[0] / total[1].clamp(min=1)).item()

    # ---- the loop ---------------------------------------------------------------------------
    def _eval_plan(self) -> bool:
        """Check the held-out data and eval sizes before the first step (an error there must not
        cost the run at its end); False when there is nothing to evaluate (said once)."""
        if self.cfg.eval_batches == 0:
            return False
        if getattr(self.data, "val_dataset", True) is None:
            if is_main():
                print("no held-out data (data.val_paths is empty): held-out evaluation is off", flush=True)
            return False
        self.data.val_batches(self._eval_batch_size(), max_batches=1)  # raises naming what to change
        return True

    def _eval_batch_size(self) -> int:
        return self.cfg.eval_batch_size or self.data.local_batch_size * self.world_size

    def fit(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        last_step = cfg.stop_at_step or cfg.steps
        self.eval_enabled = self._eval_plan()
        if is_main():
            print(f"training steps {self.step + 1}..{last_step} of {cfg.steps}", flush=True)
            if cfg.deterministic:
                print("trainer.deterministic: torch's deterministic algorithms are on (bit-reproducible steps, slower: "
                      "for A/B checks; docs/training.md)", flush=True)
        watchdog = StepWatchdog(cfg.collective_timeout_s, self.step)
        watchdog.start()
        try:
            self._loop(last_step, watchdog)
        finally:
            watchdog.stop()
        self._hold_masters()
        return self.history

    def _hold_masters(self) -> None:
        """Hold the optimizer's split masters (optimizer.split_master) joined until the next train_step, so that
        what reads the model after fit() (an export, an evaluation, a test) sees its fp32 weights; 4 bytes an
        element of split master meanwhile. Nothing where no master is split."""
        if self._masters_held is None and getattr(self.optimizer, "split_parameters", list)():
            self.wait_optimizer()
            held = contextlib.ExitStack()
            try:
                held.enter_context(self.masters_materialized())
            except torch.OutOfMemoryError:  # the training is done and saved: say how to read them instead
                if is_main():
                    print("the split fp32 masters (optimizer.split_master) stay split after fit(): no memory to join "
                          "them; read the weights inside trainer.masters_materialized()", flush=True)
                return
            self._masters_held = held

    def _release_masters(self) -> None:
        """Split the masters _hold_masters joined again (a value set in the parameters meanwhile is kept, the
        copies rewritten from it) and free their fp32 storage."""
        if self._masters_held is not None:
            held, self._masters_held = self._masters_held, None
            held.close()

    def _note_copies(self, error: BaseException) -> None:
        """Name the optimizer's bf16 weight copies on an out-of-memory ``error`` where they are held: on one GPU
        the precision switches' ``auto`` turns them on (precision.AUTO_COPIES), for memory the default before
        session 50 did not hold."""
        from .precision.config import copies_off_overrides

        copies = getattr(self.optimizer, "compute_copies", None) or {}
        # a copy whose master is held split (optimizer.split_master) is that master: turning it off frees nothing
        split = {id(p) for p in getattr(self.optimizer, "split_parameters", list)()}
        held = sum(c.numel() * c.element_size() for p, c in copies.items() if id(p) not in split)
        if held:
            error.add_note(
                f"moetron: the optimizer's bf16 weight copies hold {held / 2**30:.2f} GiB on this rank (precision."
                f"expert_weight_copies / expert_grads_bf16 / dense_weight_copies / head_weight_copy; auto turns them on "
                f"for one GPU with one micro-batch a step). {' '.join(copies_off_overrides())} frees them; "
                f"tools/plan.py gives the peak with and without them")

    def _loop(self, last_step: int, watchdog: StepWatchdog) -> None:
        cfg = self.cfg
        t_last, tokens_since = time.perf_counter(), 0
        loss_acc = torch.zeros((), device=self.device)
        steps_since = 0
        while self.step < last_step:
            batch = self.data.next_batch()
            try:
                loss, grad_norm = self.train_step(batch)
            except torch.OutOfMemoryError as e:
                self._note_copies(e)
                raise
            self.step += 1
            loss_acc += loss
            steps_since += 1
            tokens_since += batch.shape[0] * (batch.shape[1] - 1) * self.world_size
            record = None
            if self.step % cfg.log_interval == 0 or self.step in (1, last_step):
                loss_mean = loss_acc / steps_since
                if dist.is_initialized():
                    dist.all_reduce(loss_mean)
                    loss_mean /= dist.get_world_size()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                dt = time.perf_counter() - t_last
                tflops = model_tflops_per_device(self.flops_per_token, tokens_since, dt, self.world_size)
                record = {
                    "step": self.step,
                    "loss": loss_mean.item(),
                    "lr": self.scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": tokens_since / dt,
                    "tflops_per_device": tflops,
                    "mfu": mfu(tflops, self.peak),
                }
                if cfg.on_nonfinite == NonFinite.skip:
                    record["skipped_steps"] = self.skipped_steps
                record.update(self._pop_moe_metrics(steps_since))
                if hasattr(self.data, "metrics"):  # consumed samples, epoch, each mixture source's share (host values)
                    record.update(self.data.metrics())
                loss_acc.zero_()
                steps_since = 0
                try:
                    self._check_finite()  # the host has synced for the log line already
                except NonFiniteError:
                    self._emit(record)
                    raise
            # Save before evaluating: a failing evaluation must not cost the step's checkpoint.
            if self.checkpointer is not None and self.checkpointer.cfg.should_save(self.step, final=self.step == last_step):
                self.wait_optimizer()  # an overlapped step still writing the split masters: before they are joined
                with self.masters_materialized():  # once for the check and the save
                    self._check_finite(before_save=True)
                    path = self.save()
                if is_main() and path:
                    print(f"saved checkpoint {path}", flush=True)
            evaluating = (cfg.eval_interval and self.step % cfg.eval_interval == 0) or self.step == cfg.steps
            if evaluating and self.eval_enabled:
                record = record or {"step": self.step}
                record["eval_loss"] = self.evaluate()
            if record is not None:
                self._emit(record)
                t_last, tokens_since = time.perf_counter(), 0
            if self.on_step_end is not None:
                self.wait_optimizer()  # the callback may read the parameters
                with self.masters_materialized():
                    self.on_step_end(self.step, record or {})
            watchdog.beat(self.step)

    def _pop_moe_metrics(self, steps: int) -> dict[str, Any]:
        """Load diagnostics and aux-loss means per step since the last log line (all ranks' counts)."""
        stats = {i: layer.pop_load_stats() for i, layer in self.moe_layers.items()}
        for group in self.grad_norm_groups:
            # Pipeline stages hold different layers: gather every stage's stats (log steps only).
            if group is not None and dist.get_world_size(group) > 1:
                gathered = [None] * dist.get_world_size(group)
                local = {i: {k: v.cpu() for k, v in d.items()} for i, d in stats.items()}
                dist.all_gather_object(gathered, local, group=group)
                stats = {i: d for part in gathered for i, d in part.items()}
        if not stats:
            return {}
        summary = summarize(stats)
        for name in AUX_LOSSES:
            if name in summary:
                summary[name] = summary[name] / steps  # per-step means, as the loss is logged
        for line in self.starved_watch.update(self.step, summary):
            if is_main():
                print(line, flush=True)
        return self.load_log.add(self.step, summary)

    def _emit(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self.log.write(record)
        if self.tracker is not None:
            logged = self.load_log.steps and self.load_log.steps[-1] == record["step"]
            self.tracker.log(record, self.load_log.records[-1] if logged else None)
        if not is_main():
            return
        parts = [f"step {record['step']:>6}"]
        for key, fmt in (
            ("loss", "loss {:.4f}"),
            ("eval_loss", "eval {:.4f}"),
            ("lr", "lr {:.2e}"),
            ("grad_norm", "gnorm {:.3f}"),
            ("lb_loss", "lb {:.4f}"),
            ("z_loss", "z {:.4f}"),
            ("moe_max_violation", "maxvio {:.2f}"),
            ("moe_dropped_frac", "dropped {:.3f}"),
            ("tokens_per_s", "{:,.0f} tok/s"),
            ("tflops_per_device", "{:.2f} TFLOP/s/dev"),
        ):
            if key in record and record[key] is not None:
                parts.append(fmt.format(record[key]))
        if "mfu" in record and not math.isnan(record["mfu"]):
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        print(" | ".join(parts), flush=True)
