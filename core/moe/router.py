"""The router: a linear gate in fp32, softmax or sigmoid scores, (group-limited) top-k, an optional
selection-only expert bias, and the auxiliary losses.

Legend: T tokens, D model dim, E experts, K experts per token, B sequences, G expert groups.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..registry import Registry
from .config import LoadBalanceGranularity, RouterConfig, RouterScore


class RouterOutput(NamedTuple):
    topk_ids_TK: torch.Tensor
    """int64 [T, K] chosen experts."""
    topk_weights_TK: torch.Tensor
    """fp32 [T, K] combine weights (after renormalization and scale)."""
    probs_TE: torch.Tensor
    """fp32 [T, E] per-token distribution over experts (softmax, or sigmoid normalized to sum 1)."""
    logits_TE: torch.Tensor
    """fp32 [T, E] raw router logits."""


def _softmax_scores(logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores_TE = logits_TE.softmax(dim=-1)
    return scores_TE, scores_TE


def _sigmoid_scores(logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores_TE = logits_TE.sigmoid()
    return scores_TE, scores_TE / scores_TE.sum(dim=-1, keepdim=True)


SCORE_FUNCTIONS = {RouterScore.softmax: _softmax_scores, RouterScore.sigmoid: _sigmoid_scores}
"""logits [T, E] -> (scores [T, E] the top-k weights come from, probs [T, E] summing to 1 per token)."""

ROUTERS: Registry[type[nn.Module]] = Registry("router")
"""Router classes by ``model.moe.router.kind``; add one with register_router."""


def register_router(name: str):
    """Class decorator: make a router selectable as ``model.moe.router.kind=name``. The class is
    built as ``cls(d_model, num_experts, cfg: RouterConfig, device)`` and its forward maps
    x_TD [T, D] to a RouterOutput."""
    return lambda cls: ROUTERS.add(name, cls)


@register_router("topk")
class Router(nn.Module):
    """Token-choice top-k: x_TD [T, D] -> RouterOutput (see there for shapes)."""

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig, device=None):
        super().__init__()
        self.cfg = cfg
        self.num_experts = num_experts
        self._scores = SCORE_FUNCTIONS[RouterScore(cfg.score)]
        # Kept in fp32 and applied in fp32 whatever the autocast: routing decisions are sensitive.
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, device=device))
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device))
        else:
            self.expert_bias = None

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        dtype = torch.promote_types(x_TD.dtype, torch.float32)  # at least fp32, whatever the autocast
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = x_TD.to(dtype) @ self.weight.to(dtype).t()
        scores_TE, probs_TE = self._scores(logits_TE)
        # The bias steers only which experts are chosen; the weights come from the unbiased scores.
        select_TE = scores_TE.detach()
        if self.expert_bias is not None:
            select_TE = select_TE + self.expert_bias
        if self.cfg.n_groups is not None:
            select_TE = self._limit_to_groups(select_TE)
        topk_ids_TK = select_TE.topk(self.cfg.top_k, dim=-1).indices
        topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
        if self.cfg.renormalize:
            topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(dim=-1, keepdim=True)
        if self.cfg.scale != 1.0:
            topk_weights_TK = topk_weights_TK * self.cfg.scale
        return RouterOutput(topk_ids_TK, topk_weights_TK, probs_TE, logits_TE)

    def _limit_to_groups(self, select_TE: torch.Tensor) -> torch.Tensor:
        """Mask out every expert outside each token's best topk_groups groups (by the group's max)."""
        T, E = select_TE.shape
        G = self.cfg.n_groups
        group_score_TG = select_TE.view(T, G, E // G).amax(dim=-1)
        best_groups = group_score_TG.topk(self.cfg.topk_groups, dim=-1).indices
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, best_groups, True)
        keep_TE = keep_TG.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
        return select_TE.masked_fill(~keep_TE, float("-inf"))


def load_balance_loss(
    probs_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    granularity: LoadBalanceGranularity,
    num_sequences: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Switch loss E * sum_e f_e * P_e, f_e the fraction of routed slots on e, P_e the mean prob.

    It is 1 when routing is uniform and E (its maximum) when every token goes to one expert.
    tokens_per_expert_E counts this micro-batch's slots before any capacity dropping.
    """
    T, E = probs_TE.shape
    K = topk_ids_TK.shape[1]
    if granularity == LoadBalanceGranularity.sequence:
        B = num_sequences
        counts_BE = torch.zeros(B, E, device=probs_TE.device, dtype=torch.float32)
        counts_BE.scatter_add_(1, topk_ids_TK.reshape(B, -1), torch.ones_like(topk_ids_TK, dtype=torch.float32).reshape(B, -1))
        f_BE = counts_BE / (T // B * K)
        P_BE = probs_TE.reshape(B, T // B, E).mean(dim=1)
        return E * (f_BE * P_BE).sum(dim=-1).mean()
    counts_E = tokens_per_expert_E.float()
    total = T * K
    if granularity == LoadBalanceGranularity.global_batch and group is not None and dist.get_world_size(group) > 1:
        # A device collective, no host sync: every rank of the group sees the global routed fractions.
        counts_E = counts_E.clone()
        dist.all_reduce(counts_E, group=group)
        total *= dist.get_world_size(group)
    f_E = counts_E / total
    P_E = probs_TE.mean(dim=0)
    return E * (f_E * P_E).sum()


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()
