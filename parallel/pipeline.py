"""Pipeline parallelism: the model cut into stages of consecutive blocks, run under a
``torch.distributed.pipelining`` schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble).

- ``split_stages(model, num_stages, block_costs, head_cost)``: where to cut (``parallel.pp_split``:
  by training FLOPs per token with the LM head on the last stage, the default, or by block count),
  and stage modules that keep the model's attribute names
  (``embed`` / ``blocks`` (a ModuleDict with the original keys) / ``norm`` / ``lm_head``), so a
  stage's parameter names equal the full model's ("blocks.3.attention.q_proj.weight") and DCP
  checkpoints load across pipeline layouts.
- MoE auxiliary losses: each stage adds the sum of its MoE layers' aux losses to the total loss
  through an identity on its output whose backward also feeds gradient ``scale`` into the aux
  losses (Megatron's MoEAuxLossAutoScaler), ``scale`` = the LM loss' weight per micro-batch.
- ``PipelineParallel``: the strategy (order 10); sets ``state.step_fn``, ``extras["eval_fn"]`` and
  ``extras["grad_norm_groups"]``.

Parameters are not copied: stages hold the model's own modules, so once the caller drops the full
model only this rank's stages stay alive.

Legend: B batch (the rank's), M micro-batches, S sequence, D model dim, V vocab.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from moetron.core.config import ConfigError
from moetron.core.distributed import is_main
from moetron.core.moe.layer import MoELayer

from .config import PipelineSchedule, PipelineSplit
from .registry import ParallelState, ParallelStrategy, register_strategy

__all__ = ["PipelineStageModule", "split_stages", "stage_ids_of_rank", "PipelineStep", "PipelineParallel"]

AUX_NAMES = ("lb_loss", "z_loss")
"""The MoE aux losses summed over stages for logging (PipelineStep.last_aux_losses)."""


class _AuxLossScaler(torch.autograd.Function):
    """Identity on ``h``; its backward also sends gradient ``scale`` into ``aux``, so ``aux`` joins
    the loss without travelling through the pipeline (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return h.clone()  # not a view: zero-bubble schedules detach_() stage outputs in place

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_h, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class PipelineStageModule(nn.Module):
    """One pipeline stage: optional ``embed``, ``blocks`` (ModuleDict, original keys), optional
    ``norm`` and ``lm_head`` (absent parts are None and own no parameters).

    forward: token ids [B, S] (first stage) or hidden [B, S, D] -> hidden [B, S, D], or logits
    [B, S, V] on the last stage. In training, the sum of this stage's MoE aux losses is attached
    to the output with weight ``aux_scale`` (set by the pipeline to the LM loss' micro-batch
    weight) and each layer's values are summed into ``aux_record`` for logging.
    """

    def __init__(self, stage_index: int, num_stages: int, embed: nn.Module | None, blocks: dict[str, nn.Module],
                 norm: nn.Module | None, lm_head: nn.Module | None):
        super().__init__()
        self.stage_index, self.num_stages = stage_index, num_stages
        self.embed = embed
        self.blocks = nn.ModuleDict(blocks)
        self.norm = norm
        self.lm_head = lm_head
        self.aux_scale = 1.0
        # (block key, MoE layer) pairs: the layers whose aux losses this stage owns.
        self.moe_layers = [(key, m) for key, block in self.blocks.items() for m in block.modules()
                           if isinstance(m, MoELayer)]
        self.aux_record: dict[tuple[str, str], torch.Tensor] = {}
        """(block key, aux name) -> sum over this step's forwards of the (weighted) aux loss."""
        self.aux_forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h_BSD = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h_BSD = block(h_BSD)
        if self.training and self.moe_layers:
            aux_total = None
            for key, layer in self.moe_layers:
                for name, value in layer.aux_losses.items():
                    aux_total = value if aux_total is None else aux_total + value
                    slot = (key, name)
                    prev = self.aux_record.get(slot)
                    self.aux_record[slot] = value.detach() if prev is None else prev + value.detach()
            self.aux_forwards += 1
            if aux_total is not None and aux_total.requires_grad and torch.is_grad_enabled():
                h_BSD = _AuxLossScaler.apply(h_BSD, aux_total, self.aux_scale)
        if self.norm is not None:
            h_BSD = self.norm(h_BSD)
        if self.lm_head is not None:
            h_BSD = self.lm_head(h_BSD)
        return h_BSD

    def reset_aux_record(self) -> None:
        self.aux_record, self.aux_forwards = {}, 0


def _check_model(model: nn.Module) -> None:
    missing = [a for a in ("embed", "blocks", "norm", "lm_head") if not hasattr(model, a)]
    if missing or not isinstance(model.blocks, nn.ModuleDict):
        raise ConfigError(
            f"pipeline parallelism needs a model with embed, blocks (an nn.ModuleDict), norm and lm_head; "
            f"{type(model).__name__} lacks {missing or ['a ModuleDict of blocks']}"
        )


def balanced_split(block_costs: list[float], num_stages: int, last_extra: float = 0.0) -> list[int]:
    """Blocks per stage for consecutive stages of at least one block each that minimize the largest
    stage cost, the last stage carrying ``last_extra`` on top of its blocks; among those cuts, the
    one with the most even stages (least sum of squared stage costs). Two dynamic programs over the
    cut points, O(stages x blocks^2)."""
    n = len(block_costs)
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, j: int, i: int) -> float:  # blocks[j:i] as stage s (1-based)
        return prefix[i] - prefix[j] + (last_extra if s == num_stages else 0.0)

    def solve(combine, limit: float) -> tuple[float, list[int]]:
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0.0
        for s in range(1, num_stages + 1):
            for i in range(s, n + 1):
                for j in range(s - 1, i):
                    c = stage_cost(s, j, i)
                    if c > limit or best[s - 1][j] == inf:
                        continue
                    total = combine(best[s - 1][j], c)
                    if total <= best[s][i]:  # ties: the latest cut, so earlier stages take more
                        best[s][i], cut[s][i] = total, j
        counts, i = [], n
        for s in range(num_stages, 0, -1):
            counts.append(i - cut[s][i])
            i = cut[s][i]
        return best[num_stages][n], counts[::-1]

    worst, _ = solve(max, float("inf"))
    _, counts = solve(lambda acc, c: acc + c * c, worst * (1 + 1e-9))
    return counts


def split_stages(model: nn.Module, num_stages: int, block_costs: list[float] | None = None,
                 head_cost: float = 0.0) -> list[PipelineStageModule]:
    """Cut ``model`` into ``num_stages`` stages of consecutive blocks; the first stage also holds
    ``embed``, the last ``norm`` and ``lm_head``. Without ``block_costs`` the stages get equal block
    counts (earlier stages take the remainder); with them (one per block, e.g. FLOPs per token) the
    cut minimizes the largest stage cost, the last stage counting ``head_cost`` too. The stages
    share the model's modules (nothing is copied)."""
    _check_model(model)
    keys = list(model.blocks.keys())
    if not 1 <= num_stages <= len(keys):
        raise ConfigError(
            f"cannot split a model of {len(keys)} layers into {num_stages} pipeline stages: every stage "
            f"needs at least one block; use at most {len(keys)} stages"
        )
    if block_costs is None:
        base, extra = divmod(len(keys), num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    else:
        if len(block_costs) != len(keys):
            raise ValueError(f"block_costs has {len(block_costs)} entries for {len(keys)} blocks")
        counts = balanced_split(list(block_costs), num_stages, head_cost)
    stages, start = [], 0
    for i in range(num_stages):
        end = start + counts[i]
        last = i == num_stages - 1
        stages.append(PipelineStageModule(
            i, num_stages,
            model.embed if i == 0 else None,
            {k: model.blocks[k] for k in keys[start:end]},
            model.norm if last else None,
            model.lm_head if last else None,
        ))
        start = end
    return stages


def stage_ids_of_rank(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Looped assignment: rank r runs stages r, r + pp, r + 2 pp, ..."""
    return [pp_rank + v * pp for v in range(stages_per_rank)]


class PipelineStep:
    """``step(batch [B, S+1]) -> mean LM loss`` over the rank's batch, forward and backward through
    the pipeline; the loss is on every pipeline rank. With ``train=False`` it is forward-only
    (evaluation) and returns the mean loss likewise.

    After each training call, ``last_aux_losses`` holds the MoE aux losses (summed over every
    stage's layers, averaged over the micro-batches; detached) by name, and each local MoE layer's
    ``aux_losses`` is replaced by its mean over the micro-batches (so a trainer that reads the
    layers logs this step's values, not the last micro-batch's).
    """

    def __init__(self, stages: list[PipelineStageModule], n_microbatches: int, loss_fn: Callable,
                 make_schedule: Callable | None, group: dist.ProcessGroup | None, device: torch.device,
                 autocast_dtype: torch.dtype | None, extras: dict[str, Any], train: bool = True):
        self.stages, self.n_microbatches, self.loss_fn = stages, n_microbatches, loss_fn
        self.make_schedule, self.group, self.device = make_schedule, group, device
        self.autocast_dtype, self.extras, self.train = autocast_dtype, extras, train
        self.holds_first = any(s.stage_index == 0 for s in stages)
        self.holds_last = any(s.stage_index == s.num_stages - 1 for s in stages)
        self.last_aux_losses: dict[str, torch.Tensor] = {}
        self._aux_names: list[str] | None = None
        self._schedules: dict[tuple[int, int], Any] = {}

    def _schedule(self, micro_batch: int, seq: int) -> Any:
        """torch's schedule for micro-batches of [micro_batch, seq] tokens, built on first use with
        static stage shapes: torch then runs no shape-inference forward (which would feed the MoE
        layers uninitialized or meta tensors and pollute their load statistics)."""
        key = (micro_batch, seq)
        if key not in self._schedules:
            self._schedules[key] = self.make_schedule(micro_batch, seq, self.extras, self.train)
        return self._schedules[key]

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

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
        for stage in self.stages:
            stage.reset_aux_record()
        with self._autocast():
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
            # version; the last stage gets the merged logits back.
            logits_BSV = schedule.step(*args)
            if self.holds_last:
                return self.loss_fn(logits_BSV, labels_BS).detach().float() * self.n_microbatches
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
        """One all-reduce over the pipeline ranks: the loss (only the last stage has it) and the
        aux-loss totals for logging."""
        vec = torch.zeros(1 + 2 * len(AUX_NAMES), device=self.device, dtype=torch.float32)
        vec[0] = loss_sum
        if self.train:
            for stage in self.stages:
                n = max(stage.aux_forwards, 1)
                by_block: dict[str, dict[str, torch.Tensor]] = {}
                for (key, name), total in stage.aux_record.items():
                    mean = total / n
                    by_block.setdefault(key, {})[name] = mean
                    if name in AUX_NAMES:
                        j = 1 + 2 * AUX_NAMES.index(name)
                        vec[j] += mean.float()
                        vec[j + 1] = 1.0
                for key, layer in stage.moe_layers:
                    if key in by_block:
                        layer.aux_losses = by_block[key]
        if self.group is not None:
            dist.all_reduce(vec, group=self.group)
        if self.train:
            if self._aux_names is None:  # which aux losses exist anywhere: read once (a host sync)
                self._aux_names = [name for j, name in enumerate(AUX_NAMES) if bool(vec[2 + 2 * j] > 0)]
            self.last_aux_losses = {name: vec[1 + 2 * AUX_NAMES.index(name)] for name in self._aux_names}
        return vec[0]


def _n_microbatches(cfg, num_stages: int) -> int:
    return cfg.pp_microbatches if cfg.pp_microbatches is not None else 2 * num_stages


_SCHEDULES = {
    PipelineSchedule.gpipe: "ScheduleGPipe",
    PipelineSchedule.one_f_one_b: "Schedule1F1B",
    PipelineSchedule.interleaved_1f1b: "ScheduleInterleaved1F1B",
    PipelineSchedule.zero_bubble: "ScheduleInterleavedZeroBubble",
}


def _make_schedule(stages: list[PipelineStageModule], num_stages: int, n_micro: int, loss_fn: Callable,
                   device: torch.device, group: dist.ProcessGroup | None, kind: PipelineSchedule,
                   autocast_dtype: torch.dtype | None, d_model: int, embed_dtype: torch.dtype, micro_batch: int, seq: int, extras: dict[str, Any],
                   train: bool) -> Any:
    """PipelineStage objects with static shapes (meta tensors) and torch's schedule over them.

    The residual stream crosses stages in ``extras["pp_activation_dtype"]`` when a later strategy
    sets it (e.g. FSDP2 mixed precision with bf16 parameters), else in the embedding weight's
    dtype; logits leave the last stage in the autocast dtype when autocast is on.
    """
    from torch.distributed import pipelining

    hidden_dtype = extras.get("pp_activation_dtype") or embed_dtype
    logits_dtype = autocast_dtype or hidden_dtype
    pipe_stages = []
    for s in stages:
        if s.embed is not None:
            x = torch.empty(micro_batch, seq, dtype=torch.long, device="meta")
        else:
            x = torch.empty(micro_batch, seq, d_model, dtype=hidden_dtype, device="meta", requires_grad=train)
        if s.lm_head is not None:
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


@register_strategy
class PipelineParallel(ParallelStrategy):
    """Split the model into ``pp x pp_stages_per_rank`` stages and run them under
    ``parallel.pp_schedule`` with ``parallel.pp_microbatches`` micro-batches.

    Reads ``state.extras["loss_fn"]`` (loss(logits [b, S, V], labels [b, S]) -> mean, required),
    ``state.extras["autocast_dtype"]`` (optional) and ``state.extras["local_batch_size"]``
    (optional: checked against the micro-batch count up front). Sets ``state.model_parts`` (this
    rank's stages), ``state.step_fn`` (a PipelineStep), ``state.extras["eval_fn"]``,
    ``state.extras["grad_norm_groups"]`` and ``state.extras["pipeline"]`` (a dict describing the
    split). With pp == 1 (``parallel.strategies=["pipeline"]``) the stages run in this process
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
        _check_model(model)
        n_layers = len(model.blocks)
        num_stages = cfg.pp * cfg.pp_stages_per_rank
        if num_stages > n_layers:
            raise ConfigError(
                f"parallel.pp={cfg.pp} x stages_per_rank={cfg.pp_stages_per_rank} = {num_stages} stages but the "
                f"model has {n_layers} layers: every stage needs at least one block; lower parallel.pp or "
                f"parallel.pp_stages_per_rank so that their product is <= {n_layers}"
            )
        if "loss_fn" not in state.extras:
            raise ConfigError("the pipeline strategy needs state.extras['loss_fn'] (the LM loss over logits, labels)")
        n_micro = _n_microbatches(cfg, num_stages)
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
        local = state.extras.get("local_batch_size")
        if local is not None and local % n_micro:
            raise ConfigError(
                f"each rank's batch of {local} sequences (data global batch size / data-parallel ranks) does not "
                f"split into parallel.pp_microbatches={n_micro} micro-batches: choose a global batch size whose "
                f"per-rank share is a multiple of {n_micro}, or change parallel.pp_microbatches"
            )

    def apply(self, state: ParallelState) -> None:
        cfg = state.cfg
        num_stages = cfg.pp * cfg.pp_stages_per_rank
        n_micro = _n_microbatches(cfg, num_stages)
        device = torch.device(state.device) if state.device is not None else torch.device("cpu")
        pp_rank = state.mesh.pp_rank if cfg.pp > 1 else 0
        model = state.model_parts[0]
        d_model, embed_dtype = model.embed.weight.shape[-1], model.embed.weight.dtype
        if cfg.pp_split == PipelineSplit.flops:
            # Without the run's sequence length (a strategy applied outside pretrain), a sliding
            # layer's window is its context and a full layer's is taken as 4096.
            mcfg, seq = state.model_cfg, state.extras.get("seq_len", 4096)
            costs = [mcfg.block_flops_per_token(i, seq) for i in range(mcfg.n_layers)]
            all_stages = split_stages(model, num_stages, costs, head_cost=6.0 * mcfg.d_model * mcfg.vocab_size)
        else:
            all_stages = split_stages(model, num_stages)
        if is_main():
            print("pipeline stages (blocks): " + " | ".join(",".join(s.blocks.keys()) for s in all_stages), flush=True)
        del model
        stages = [all_stages[i] for i in stage_ids_of_rank(pp_rank, cfg.pp, cfg.pp_stages_per_rank)]
        del all_stages  # other ranks' stages (and the full model, once the caller drops it) can go
        for stage in stages:
            stage.aux_scale = 1.0 / n_micro  # the LM loss of each micro-batch is weighted 1 / M

        base_loss = state.extras["loss_fn"]

        def loss_fn(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
            # Every micro-batch holds B/M x S tokens, so the mean over the batch is the sum of
            # the micro-batch means / M: scale here and keep torch from rescaling the gradients.
            return base_loss(logits_BSV, labels_BS) / n_micro

        group = state.mesh.group("pp") if cfg.pp > 1 else None
        autocast_dtype = state.extras.get("autocast_dtype")
        make_schedule = None
        if cfg.pp > 1:
            make_schedule = functools.partial(_make_schedule, stages, num_stages, n_micro, loss_fn, device, group,
                                              cfg.pp_schedule, autocast_dtype, d_model, embed_dtype)

        state.model_parts = list(stages)
        state.step_fn = PipelineStep(stages, n_micro, loss_fn, make_schedule, group, device, autocast_dtype,
                                     state.extras, train=True)
        state.extras["eval_fn"] = PipelineStep(stages, n_micro, loss_fn, make_schedule, group, device,
                                               autocast_dtype, state.extras, train=False)
        state.extras["grad_norm_groups"] = (group,) if group is not None else ()
        state.extras["pipeline"] = {
            "num_stages": num_stages,
            "stage_ids": [s.stage_index for s in stages],
            "blocks": [list(s.blocks.keys()) for s in stages],
            "n_microbatches": n_micro,
            "schedule": str(cfg.pp_schedule),
        }
