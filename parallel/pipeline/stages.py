"""Where to cut a model into pipeline stages, and the stage modules.

``split_stages(model, num_stages, block_costs, head_cost)`` cuts consecutive blocks (by block count,
or balanced by a cost per block with the LM head on the last stage) into ``PipelineStageModule``s
that keep the model's attribute names (``embed`` / ``blocks`` (a ModuleDict with the original keys)
/ ``norm`` / ``lm_head``), so a stage's parameter names equal the full model's
("blocks.3.attention.q_proj.weight") and DCP checkpoints load across pipeline layouts. Parameters
are not copied: stages hold the model's own modules.

Legend: B batch, S sequence, D model dim, V vocab.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from moetron.core.config import ConfigError
from moetron.core.layers.rope import prefill_ropes, rope_modules

from ..model import require_parts

__all__ = ["PipelineStageModule", "balanced_split", "split_stages", "stage_ids_of_rank"]


class PipelineStageModule(nn.Module):
    """One pipeline stage: optional ``embed``, ``blocks`` (ModuleDict, original keys), optional
    ``norm`` and ``lm_head`` (absent parts are None and own no parameters).

    forward: token ids [B, S] (first stage) or hidden [B, S, D] -> hidden [B, S, D], or on the
    last stage logits [B, S, V]; with ``head_loss`` the last stage stops at the final norm
    (hidden [B, S, D]) and the schedule's loss is ``lm_head(hidden, labels)`` (head_loss_fn).

    ``autocast`` (the run's PrecisionPolicy.autocast; none by default) is entered inside forward and
    head_loss_fn, around the forward computation only: torch's schedules run each micro-batch's
    backward inside ``step()``, and a backward run under autocast also casts the backward's own
    matmuls (the autograd engine carries the caller's autocast state), so the fp32 router and the
    fp32 parts of the norms and the loss would get bf16 gradients; the plain training loop runs its
    backward outside autocast, and the pipeline must equal it.
    """

    def __init__(self, stage_index: int, num_stages: int, embed: nn.Module | None, blocks: dict[str, nn.Module],
                 norm: nn.Module | None, lm_head: nn.Module | None, head_loss: bool = False):
        super().__init__()
        self.stage_index, self.num_stages, self.head_loss = stage_index, num_stages, head_loss
        self.embed = embed
        self.blocks = nn.ModuleDict(blocks)
        self.norm = norm
        self.lm_head = lm_head
        self.autocast: Callable[[], ContextManager] = contextlib.nullcontext
        self._ropes = rope_modules(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The RoPE tables are filled outside the (compiled) blocks, as the model's forward does.
        prefill_ropes(self._ropes, x.shape[1], x.device)
        with self.autocast():
            h_BSD = self.embed(x) if self.embed is not None else x
            for block in self.blocks.values():
                h_BSD = block(h_BSD)
            if self.norm is not None:
                h_BSD = self.norm(h_BSD)
            if self.lm_head is not None and not self.head_loss:
                return self.lm_head(h_BSD)
            return h_BSD

    def head_loss_fn(self, h_BSD: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """The last stage's loss from its output (head_loss): the LM head's mean loss over the
        labels, run as a module call (its hooks fire, as they would inside forward).

        Under FSDP2 the stage (the root unit, holding the head) has resharded after its forward:
        the head's parameters are gathered again here (the gather the backward would have made
        anyway) and stay so through the backward, whose post-backward reduces their gradients and
        reshards; without grad (evaluation) they are resharded right after."""
        fsdp = isinstance(self, FSDPModule)
        if fsdp:
            self.unshard()
        with self.autocast():  # as the model's forward computes its loss (under the run's autocast)
            loss = self.lm_head(h_BSD, labels_BS)
        if fsdp and not (torch.is_grad_enabled() and loss.requires_grad):
            self.reshard()
        return loss


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
                 head_cost: float = 0.0, head_loss: bool = False) -> list[PipelineStageModule]:
    """Cut ``model`` into ``num_stages`` stages of consecutive blocks; the first stage also holds
    ``embed``, the last ``norm`` and ``lm_head``. Without ``block_costs`` the stages get equal block
    counts (earlier stages take the remainder); with them (one per block, e.g. FLOPs per token) the
    cut minimizes the largest stage cost, the last stage counting ``head_cost`` too. The stages
    share the model's modules (nothing is copied). ``head_loss``: the last stage returns the normed
    hidden and its LM head computes the loss (PipelineStageModule.head_loss_fn)."""
    require_parts(model, "pipeline parallelism", ("embed", "blocks", "norm", "lm_head"))
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
            head_loss=head_loss,
        ))
        start = end
    return stages


def stage_ids_of_rank(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Looped assignment: rank r runs stages r, r + pp, r + 2 pp, ..."""
    return [pp_rank + v * pp for v in range(stages_per_rank)]
