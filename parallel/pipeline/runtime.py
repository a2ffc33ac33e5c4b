"""Running one step through the stages: micro-batches under a ``torch.distributed.pipelining``
schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble), or one after another in this
process when every stage is local. MoE auxiliary losses need nothing here: each MoE layer attaches
its own to its output (core.moe.aux_loss); the step sets their weight to the LM loss'
micro-batch weight, 1 / M.

Legend: B batch (the rank's), M micro-batches, S sequence, D model dim, V vocab.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist

from moetron.core.config import ConfigError
from moetron.core.layers.loss import loss_weight

from ..config import PipelineSchedule
from .stages import PipelineStageModule

__all__ = ["PipelineStep", "make_schedule", "n_microbatches"]


class PipelineStep:
    """``step(batch [B, S+1]) -> mean LM loss`` over the rank's batch, forward and backward through
    the pipeline; the loss is on every pipeline rank. With ``train=False`` it is forward-only
    (evaluation) and returns the mean loss likewise. MoE aux losses are weighted 1 / M, as the
    LM loss of each micro-batch is.
    """

    def __init__(self, stages: list[PipelineStageModule], n_microbatches: int, loss_fn: Callable,
                 make_schedule: Callable | None, group: dist.ProcessGroup | None, device: torch.device,
                 train: bool = True):
        self.stages, self.n_microbatches, self.loss_fn = stages, n_microbatches, loss_fn
        self.make_schedule, self.group, self.device = make_schedule, group, device
        self.train = train
        self.holds_first = any(s.stage_index == 0 for s in stages)
        self.holds_last = any(s.stage_index == s.num_stages - 1 for s in stages)
        self._schedules: dict[tuple[int, int], Any] = {}

    def _schedule(self, micro_batch: int, seq: int) -> Any:
        """torch's schedule for micro-batches of [micro_batch, seq] tokens, built on first use with
        static stage shapes: torch then runs no shape-inference forward (which would feed the MoE
        layers uninitialized or meta tensors and pollute their load statistics)."""
        key = (micro_batch, seq)
        if key not in self._schedules:
            self._schedules[key] = self.make_schedule(micro_batch, seq, self.train)
        return self._schedules[key]

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        B = batch.shape[0]
        if B % self.n_microbatches:
            raise ConfigError(
                f"each rank's {'training' if self.train else 'evaluation'} batch of {B} sequences does not split "
                f"into parallel.pp_microbatches={self.n_microbatches} micro-batches: make the per-rank batch "
                f"(data global batch size / data-parallel ranks{'' if self.train else ', or trainer.eval_batch_size'}) "
                f"a multiple of {self.n_microbatches}, or change parallel.pp_microbatches"
            )
        inputs_BS, labels_BS = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        # No autocast here: each stage enters it around its own forward (PipelineStageModule), so
        # the backward that the schedule runs inside step() is outside it, as the plain loop's is.
        # Each micro-batch's loss is divided by their number (the loss_fn): the aux losses get that
        # weight, and the head's fused loss computes its gradients at it (model.fused_loss_prescale).
        with loss_weight(1.0 / self.n_microbatches):
            if self.make_schedule is not None:
                loss_sum = self._run_schedule(inputs_BS, labels_BS)
            else:
                loss_sum = self._run_local(inputs_BS, labels_BS)
        return self._share(loss_sum)

    def _run_schedule(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        schedule = self._schedule(inputs_BS.shape[0] // self.n_microbatches, inputs_BS.shape[1])
        args = (inputs_BS,) if self.holds_first else ()
        if self.train:
            losses: list[torch.Tensor] = []
            kwargs: dict[str, Any] = {"target": labels_BS if self.holds_last else None, "losses": losses}
            if "return_outputs" in inspect.signature(schedule.step).parameters:
                kwargs["return_outputs"] = False  # only the losses are needed
            schedule.step(*args, **kwargs)
            if self.holds_last:
                return torch.stack([l.detach().float() for l in losses]).sum()
        else:
            # Forward-only: the schedule has no loss_fn, so it runs no backward on any torch
            # version; the last stage gets its merged outputs (logits, or normed hidden) back.
            out_BS = schedule.step(*args)
            if self.holds_last:
                return self.loss_fn(out_BS, labels_BS).detach().float() * self.n_microbatches
        return torch.zeros((), device=self.device)

    def _run_local(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """All stages on this process (pp == 1): micro-batches one after another, as any schedule
        runs them with one rank."""
        loss_sum = torch.zeros((), device=self.device)
        for x, y in zip(inputs_BS.chunk(self.n_microbatches), labels_BS.chunk(self.n_microbatches)):
            h = x
            for stage in self.stages:
                h = stage(h)
            loss = self.loss_fn(h, y)
            if self.train:
                loss.backward()
            loss_sum += loss.detach().float()
        return loss_sum

    def _share(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The loss on every pipeline rank (only the last stage has it): one fp32 all-reduce."""
        loss_sum = loss_sum.to(torch.float32)
        if self.group is not None:
            dist.all_reduce(loss_sum, group=self.group)
        return loss_sum


def n_microbatches(cfg, num_stages: int) -> int:
    return cfg.pp_microbatches if cfg.pp_microbatches is not None else 2 * num_stages


_SCHEDULES = {
    PipelineSchedule.gpipe: "ScheduleGPipe",
    PipelineSchedule.one_f_one_b: "Schedule1F1B",
    PipelineSchedule.interleaved_1f1b: "ScheduleInterleaved1F1B",
    PipelineSchedule.zero_bubble: "ScheduleInterleavedZeroBubble",
}


def make_schedule(stages: list[PipelineStageModule], num_stages: int, n_micro: int, loss_fn: Callable,
                   device: torch.device, group: dist.ProcessGroup | None, kind: PipelineSchedule,
                   d_model: int, hidden_dtype: torch.dtype, logits_dtype: torch.dtype, micro_batch: int, seq: int,
                   train: bool) -> Any:
    """PipelineStage objects with static shapes (meta tensors) and torch's schedule over them.

    The residual stream crosses stages in ``hidden_dtype`` (PrecisionPolicy.boundary_dtype),
    logits leave the last stage in ``logits_dtype`` (with head_loss, the normed hidden leaves it
    in ``hidden_dtype``: RMSNorm keeps its input's dtype).
    """
    from torch.distributed import pipelining

    pipe_stages = []
    for s in stages:
        if s.embed is not None:
            x = torch.empty(micro_batch, seq, dtype=torch.long, device="meta")
        else:
            x = torch.empty(micro_batch, seq, d_model, dtype=hidden_dtype, device="meta", requires_grad=train)
        if s.lm_head is not None and not s.head_loss:
            y = torch.empty(micro_batch, seq, s.lm_head.weight.shape[0], dtype=logits_dtype, device="meta",
                            requires_grad=train)
        else:
            y = torch.empty(micro_batch, seq, d_model, dtype=hidden_dtype, device="meta", requires_grad=train)
        pipe_stages.append(pipelining.PipelineStage(s, s.stage_index, num_stages, device, input_args=x,
                                                    output_args=y, group=group))
    schedule_cls = getattr(pipelining, _SCHEDULES[kind])
    single = kind in (PipelineSchedule.gpipe, PipelineSchedule.one_f_one_b)
    return schedule_cls(pipe_stages[0] if single else pipe_stages, n_microbatches=n_micro,
                        loss_fn=loss_fn if train else None, scale_grads=False)
