"""Pipeline parallelism: the model cut into stages of consecutive blocks, run under a
``torch.distributed.pipelining`` schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble).

- ``split_stages(model, num_stages, block_costs, head_cost)``: where to cut (``parallel.pp_split``:
  by training FLOPs per token with the LM head on the last stage, the default, or by block count),
  and stage modules that keep the model's attribute names
  (``embed`` / ``blocks`` (a ModuleDict with the original keys) / ``norm`` / ``lm_head``), so a
  stage's parameter names equal the full model's ("blocks.3.attention.q_proj.weight") and DCP
  checkpoints load across pipeline layouts.
- The LM loss: ``state.loss_fn(logits, labels)`` over the last stage's logits, or, when
  ``state.loss_fn`` is None, the model's own LM head (core.layers.LMHead: ``lm_head(h, labels)``,
  fused and chunked by default) over the last stage's normed hidden, so that no stage output or
  loss input is a [B, S, V] tensor.
- MoE auxiliary losses need nothing here: each MoE layer attaches its own to its output
  (core.moe.aux_loss); the step sets their weight to the LM loss' micro-batch weight, 1 / M.
- ``PipelineParallel``: the strategy (order 10); sets ``state.step_fn``, ``state.eval_fn``,
  ``state.grad_norm_groups`` and ``state.pipeline``.

Parameters are not copied: stages hold the model's own modules, so once the caller drops the full
model only this rank's stages stay alive.

Files: stages.py (the cut and the stage modules), runtime.py (PipelineStep and torch's schedules),
this module (the strategy).

Legend: B batch (the rank's), M micro-batches, S sequence, D model dim, V vocab.
"""

from __future__ import annotations

import functools

import torch

from moetron.core.config import ConfigError
from moetron.core.distributed import is_main
from moetron.core.layers import LMHead

from ..config import PipelineSchedule, PipelineSplit
from ..model import require_parts
from ..registry import ParallelState, ParallelStrategy, PipelineLayout, register_strategy
from .runtime import PipelineStep, make_schedule, n_microbatches
from .stages import PipelineStageModule, balanced_split, split_stages, stage_ids_of_rank

__all__ = ["PipelineParallel", "PipelineStageModule", "PipelineStep", "balanced_split", "split_stages",
           "stage_ids_of_rank"]


@register_strategy
class PipelineParallel(ParallelStrategy):
    """Split the model into ``pp x pp_stages_per_rank`` stages and run them under
    ``parallel.pp_schedule`` with ``parallel.pp_microbatches`` micro-batches.

    Reads ``state.loss_fn`` (over logits; None: the LM head's own loss), ``state.precision``, ``state.seq_len`` and
    ``state.local_batch_size`` (optional: checked against the micro-batch count up front). Sets
    ``state.model_parts`` (this rank's stages), ``state.step_fn`` (a PipelineStep),
    ``state.eval_fn``, ``state.grad_norm_groups`` and ``state.pipeline`` (the split). With pp == 1 (``parallel.strategies=["pipeline"]``) the stages run in this process
    without torch's schedules (one rank: micro-batches one after another).
    """

    name = "pipeline"
    order = 10

    def enabled(self, state: ParallelState) -> bool:
        return state.cfg.pp > 1 or self.name in state.cfg.strategies

    def validate(self, state: ParallelState) -> None:
        cfg = state.cfg
        if len(state.model_parts) != 1:
            raise ConfigError(f"pipeline parallelism splits one model, got {len(state.model_parts)} model parts")
        model = state.model_parts[0]
        require_parts(model, "pipeline parallelism", ("embed", "blocks", "norm", "lm_head"))
        n_layers = len(model.blocks)
        num_stages = cfg.pp * cfg.pp_stages_per_rank
        if num_stages > n_layers:
            raise ConfigError(
                f"parallel.pp={cfg.pp} x stages_per_rank={cfg.pp_stages_per_rank} = {num_stages} stages but the "
                f"model has {n_layers} layers: every stage needs at least one block; lower parallel.pp or "
                f"parallel.pp_stages_per_rank so that their product is <= {n_layers}"
            )
        if state.loss_fn is None and not isinstance(model.lm_head, LMHead):
            raise ConfigError(
                f"the pipeline strategy needs state.loss_fn (the LM loss over logits, labels), or an LM head that "
                f"computes the loss itself (core.layers.LMHead), not {type(model.lm_head).__name__}: pass loss_fn"
            )
        n_micro = n_microbatches(cfg, num_stages)
        if cfg.pp > 1 and cfg.pp_schedule == PipelineSchedule.one_f_one_b and n_micro < num_stages:
            raise ConfigError(
                f"parallel.pp_schedule=1f1b needs parallel.pp_microbatches >= the number of stages ({num_stages}) "
                f"(torch's Schedule1F1B requires it), got {n_micro}: raise pp_microbatches or use gpipe"
            )
        multi = cfg.pp_schedule in (PipelineSchedule.interleaved_1f1b, PipelineSchedule.zero_bubble)
        if multi and cfg.pp > 1 and n_micro % cfg.pp:
            raise ConfigError(
                f"parallel.pp_schedule={cfg.pp_schedule} needs parallel.pp_microbatches to be a multiple of "
                f"parallel.pp={cfg.pp} (torch's interleaved schedules run micro-batches in rounds of pp), got {n_micro}"
            )
        local = state.local_batch_size
        if local is not None and local % n_micro:
            raise ConfigError(
                f"each rank's batch of {local} sequences (data global batch size / data-parallel ranks) does not "
                f"split into parallel.pp_microbatches={n_micro} micro-batches: choose a global batch size whose "
                f"per-rank share is a multiple of {n_micro}, or change parallel.pp_microbatches"
            )

    def apply(self, state: ParallelState) -> None:
        cfg = state.cfg
        num_stages = cfg.pp * cfg.pp_stages_per_rank
        n_micro = n_microbatches(cfg, num_stages)
        device = torch.device(state.device) if state.device is not None else torch.device("cpu")
        pp_rank = state.mesh.pp_rank if cfg.pp > 1 else 0
        model = state.model_parts[0]
        head_loss = state.loss_fn is None  # the last stage returns the normed hidden, its LM head the loss
        d_model, embed_dtype = model.embed.weight.shape[-1], model.embed.weight.dtype
        if cfg.pp_split == PipelineSplit.flops:
            # Without the run's sequence length (a strategy applied outside pretrain), a sliding
            # layer's window is its context and a full layer's is taken as 4096.
            mcfg, seq = state.model_cfg, state.seq_len or 4096
            costs = [mcfg.block_flops_per_token(i, seq) for i in range(mcfg.n_layers)]
            all_stages = split_stages(model, num_stages, costs, head_cost=6.0 * mcfg.d_model * mcfg.vocab_size,
                                      head_loss=head_loss)
        else:
            all_stages = split_stages(model, num_stages, head_loss=head_loss)
        if is_main():
            print("pipeline stages (blocks): " + " | ".join(",".join(s.blocks.keys()) for s in all_stages), flush=True)
        del model
        stages = [all_stages[i] for i in stage_ids_of_rank(pp_rank, cfg.pp, cfg.pp_stages_per_rank)]
        del all_stages  # other ranks' stages (and the full model, once the caller drops it) can go

        for stage in stages:
            stage.autocast = state.precision.autocast  # the forward only (see PipelineStageModule)
        last = [s for s in stages if s.stage_index == num_stages - 1]
        base_loss = state.loss_fn if not head_loss else (last[0].head_loss_fn if last else None)

        def loss_fn(out_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
            # Every micro-batch holds B/M x S tokens, so the mean over the batch is the sum of
            # the micro-batch means / M: scale here and keep torch from rescaling the gradients.
            # (Only the rank holding the last stage calls it.)
            return base_loss(out_BS, labels_BS) / n_micro

        group = state.mesh.group("pp") if cfg.pp > 1 else None
        precision = state.precision
        schedule_factory = None
        if cfg.pp > 1:
            # Decided now, not when the schedule is first built: whether FSDP2 will hand the blocks
            # compute-dtype parameters is known from the strategies enabled for this run.
            hidden_dtype = precision.boundary_dtype(embed_dtype, sharded="data" in state.enabled)
            logits_dtype = precision.compute_dtype or hidden_dtype
            schedule_factory = functools.partial(make_schedule, stages, num_stages, n_micro, loss_fn, device, group,
                                                 cfg.pp_schedule, d_model, hidden_dtype, logits_dtype)

        state.model_parts = list(stages)
        state.step_fn = PipelineStep(stages, n_micro, loss_fn, schedule_factory, group, device, train=True)
        state.eval_fn = PipelineStep(stages, n_micro, loss_fn, schedule_factory, group, device, train=False)
        state.grad_norm_groups = (group,) if group is not None else ()
        state.pipeline = PipelineLayout(
            num_stages=num_stages,
            stage_ids=[s.stage_index for s in stages],
            blocks=[list(s.blocks.keys()) for s in stages],
            n_microbatches=n_micro,
            schedule=str(cfg.pp_schedule),
        )
