"""The MoE layer: router -> dispatch -> grouped-GEMM experts -> combine (+ shared experts).

Legend: B sequences, S sequence length, T = B*S tokens, D model dim, E experts, K experts per token.

Besides its output the layer keeps, on the device and without host syncs:
- ``aux_losses``: this forward's load-balancing and z losses (already weighted), for the model to
  add to the LM loss;
- running per-expert counts, dropped slots and routing entropy, which the trainer turns into the
  expert-bias update after each optimizer step and into load diagnostics at log steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..layers.mlp import SwiGLU
from .config import MoEConfig
from .dispatcher import LocalDispatcher, TokenDispatcher
from .experts import GroupedExperts
from .router import Router, load_balance_loss, z_loss


class MoELayer(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, device=None):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.router = Router(d_model, cfg.num_experts, cfg.router, device)
        self.experts = GroupedExperts(cfg.num_experts, d_model, cfg.expert_hidden, cfg.experts_backend, device)
        self.shared = SwiGLU(d_model, cfg.shared_width(), device) if cfg.num_shared_experts else None
        self.dispatcher: TokenDispatcher = LocalDispatcher(cfg.num_experts)
        # The group whose tokens the global-batch loss and the expert-bias update balance over
        # (the data-parallel ranks that see the same experts); set by the parallel layer.
        self.balance_group: dist.ProcessGroup | None = None
        self.aux_losses: dict[str, torch.Tensor] = {}
        E = cfg.num_experts
        # Running statistics (not saved in checkpoints).
        self.register_buffer("step_tokens_E", torch.zeros(E, device=device), persistent=False)
        self.register_buffer("log_tokens_E", torch.zeros(E, device=device), persistent=False)
        self.register_buffer("log_dropped", torch.zeros((), device=device), persistent=False)
        self.register_buffer("log_entropy_sum", torch.zeros((), device=device), persistent=False)
        self.register_buffer("log_token_count", torch.zeros((), device=device), persistent=False)

    def set_dispatcher(self, dispatcher: TokenDispatcher) -> None:
        """Swap in another dispatcher (expert parallel); its local experts must match the weights."""
        self.dispatcher = dispatcher

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        routing = self.router(x_TD)
        # Move the rows in the compute dtype: half the bytes through scatter, dispatch and combine.
        if torch.is_autocast_enabled(x_TD.device.type):
            x_TD = x_TD.to(torch.get_autocast_dtype(x_TD.device.type))
        capacity = self.cfg.capacity(B * S)
        dispatched = self.dispatcher.dispatch(x_TD, routing.topk_ids_TK, self.num_experts, capacity)
        y_RD = self.experts(dispatched.x_RD, dispatched.offsets_E)
        out_TD = self.dispatcher.combine(y_RD, routing.topk_weights_TK, dispatched)
        if self.shared is not None:
            out_TD = out_TD + self.shared(x_TD)
        self._losses_and_stats(routing, dispatched.tokens_per_expert_E, dispatched.kept_per_expert_E, B)
        return out_TD.view(B, S, D)

    def _losses_and_stats(self, routing, tokens_per_expert_E, kept_per_expert_E, num_sequences: int) -> None:
        rcfg = self.cfg.router
        losses = {}
        if self.training and rcfg.lb_loss_weight > 0:
            losses["lb_loss"] = rcfg.lb_loss_weight * load_balance_loss(
                routing.probs_TE, routing.topk_ids_TK, tokens_per_expert_E, rcfg.lb_granularity,
                num_sequences, self.balance_group,
            )
        if self.training and rcfg.z_loss_weight > 0:
            losses["z_loss"] = rcfg.z_loss_weight * z_loss(routing.logits_TE)
        self.aux_losses = losses
        if self.training:
            with torch.no_grad():
                counts_E = tokens_per_expert_E.float()
                self.step_tokens_E += counts_E
                self.log_tokens_E += counts_E
                self.log_dropped += (tokens_per_expert_E - kept_per_expert_E).sum()
                # entr(p) = -p log p, 0 at p = 0: one elementwise pass over [T, E].
                self.log_entropy_sum += torch.special.entr(routing.probs_TE).sum()
                self.log_token_count += routing.probs_TE.shape[0]

    # ---- after each optimizer step ----------------------------------------------------------
    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing: nudge each expert's bias toward the mean load of this step,
        using the counts of every rank in the balance group. Resets the step's counts."""
        counts_E = self.step_tokens_E
        if self.router.expert_bias is not None:
            if self.balance_group is not None and dist.get_world_size(self.balance_group) > 1:
                counts_E = counts_E.clone()
                dist.all_reduce(counts_E, group=self.balance_group)
            error_E = counts_E.mean() - counts_E
            self.router.expert_bias += self.cfg.router.bias_update_rate * error_E.sign()
        self.step_tokens_E.zero_()

    @torch.no_grad()
    def pop_load_stats(self) -> dict[str, torch.Tensor]:
        """Counts since the last call, summed over the balance group; resets them (one collective)."""
        packed = torch.cat([self.log_tokens_E, self.log_dropped[None], self.log_entropy_sum[None],
                            self.log_token_count[None]])
        if self.balance_group is not None and dist.get_world_size(self.balance_group) > 1:
            dist.all_reduce(packed, group=self.balance_group)
        E = self.num_experts
        for buf in (self.log_tokens_E, self.log_dropped, self.log_entropy_sum, self.log_token_count):
            buf.zero_()
        stats = {"tokens_per_expert": packed[:E], "dropped": packed[E], "entropy": packed[E + 1] / packed[E + 2].clamp_min(1)}
        if self.router.expert_bias is not None:
            stats["expert_bias"] = self.router.expert_bias.clone()
        return stats

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        for w in (self.router.weight, self.experts.w_gate_up, self.experts.w_down):
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
        if self.router.expert_bias is not None:
            self.router.expert_bias.zero_()
