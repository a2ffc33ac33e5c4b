"""The MoE layer: router -> dispatch -> grouped-GEMM experts -> combine (+ shared experts).

Legend: B sequences, S sequence length, T = B*S tokens, D model dim, E experts (all of them),
K experts per token, R rows of this rank's expert buffer, L this rank's experts (E without ep).

The layer trains its own auxiliary losses (load balancing, router z-loss): in training they are
attached to its combine weights, upstream of its output (core.moe.aux_loss: identity forward,
their gradient injected in backward at the step's micro-batch weight), so no caller collects or
weights them. Besides, it keeps on the
device, without host syncs, running per-expert counts, dropped slots, routing entropy and the
weighted aux-loss values, which the trainer reads at log steps (pop_load_stats) and turns into the
expert-bias update after each optimizer step (update_expert_bias).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..layers.mlp import SwiGLU
from ..config import ConfigError
from ..precision.gemm import compute_dtype
from .config import MoEConfig
from .aux_loss import attach_aux_loss, current_aux_loss_scale
from .dispatcher import TokenDispatcher
from .metrics import AUX_LOSSES
from .router import load_balance_loss, z_loss
from .spec import MoESpec


def _replaying() -> bool:
    """True when an eager activation recompute replays this forward inside backward. Compiled
    graphs recompute only pure ops (never the statistics' in-place updates), so there it is False."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class MoELayer(nn.Module):
    """Routed experts, plus shared experts if configured, on D-wide tokens.

    ``cfg`` (MoEConfig) sizes it; ``layer_index`` is the block it sits in (the key moe_layers()
    and every log use); ``spec`` (MoESpec) builds its router, experts and dispatcher (default: from
    cfg). Parameters: router.weight [E, D] (fp32 routing), experts.w_gate_up [E, 2F, D] and
    experts.w_down [E, D, F] (F = cfg.expert_hidden), shared: a SwiGLU of width
    num_shared_experts x shared_expert_hidden. forward: x_BSD [B, S, D] -> [B, S, D].
    """

    def __init__(self, d_model: int, cfg: MoEConfig, device=None, *, layer_index: int = 0, spec: MoESpec | None = None):
        super().__init__()
        spec = spec or MoESpec.from_config(cfg)
        self.cfg = cfg
        # The block index this layer sits in, given at build time: the one id every component
        # (trainer metrics, load logs, strategies) uses for it; see moe_layers().
        self.layer_index = layer_index
        self.num_experts = cfg.num_experts
        self.router = spec.router(d_model, cfg.num_experts, cfg.router, device)
        self.experts = spec.experts(cfg.num_experts, d_model, cfg.expert_hidden, cfg.experts_backend, device)
        self.shared = SwiGLU(d_model, cfg.shared_width(), device) if cfg.num_shared_experts else None
        self.dispatcher: TokenDispatcher = spec.dispatcher(cfg.num_experts)
        # The group whose tokens the global-batch loss and the expert-bias update balance over
        # (the data-parallel ranks that see the same experts); set by the parallel layer.
        self.balance_group: dist.ProcessGroup | None = None
        rcfg = cfg.router
        # The aux losses this layer trains, in a fixed order (their running sums share one buffer).
        weights = {"lb_loss": rcfg.lb_loss_weight, "z_loss": rcfg.z_loss_weight}
        self.aux_names = tuple(name for name in AUX_LOSSES if weights[name] > 0)
        E = cfg.num_experts
        # Running statistics (not saved in checkpoints).
        self.register_buffer("step_tokens_E", torch.zeros(E, device=device), persistent=False)
        self.register_buffer("log_tokens_E", torch.zeros(E, device=device), persistent=False)
        self.register_buffer("log_dropped", torch.zeros((), device=device), persistent=False)
        self.register_buffer("log_entropy_sum", torch.zeros((), device=device), persistent=False)
        self.register_buffer("log_token_count", torch.zeros((), device=device), persistent=False)
        self.register_buffer("log_aux", torch.zeros(len(self.aux_names), device=device), persistent=False)

    def set_dispatcher(self, dispatcher: TokenDispatcher) -> None:
        """Swap in another dispatcher (expert parallel); its local experts must match the weights."""
        if self.cfg.weights_before_down and type(dispatcher).row_weights is TokenDispatcher.row_weights:
            raise ConfigError(f"model.moe.weights_before_down needs a dispatcher that places the combine weights on "
                              f"its rows, and {type(dispatcher).__name__} does not (expert parallel): set "
                              f"model.moe.weights_before_down=false, or parallel.ep=1")
        self.dispatcher = dispatcher

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """x_BSD [B, S, D] -> [B, S, D]: the routed experts' weighted sum (+ the shared experts).

        In training the aux losses ride on the combine weights, so on the returned tensor's graph
        (see the module docstring).
        """
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        routing = self.router(x_TD)
        # Move the rows in the compute dtype: half the bytes through scatter, dispatch and combine.
        x_TD = x_TD.to(compute_dtype(x_TD))
        capacity = self.cfg.capacity(B * S)
        dispatched = self.dispatcher.dispatch(x_TD, routing.topk_ids_TK, self.num_experts, capacity)
        weights_TK = routing.topk_weights_TK
        if self.training:
            aux = self._aux_losses(routing, dispatched.tokens_per_expert_E, B)
            scale = current_aux_loss_scale()  # read once: the weight trained and the weight logged
            if not _replaying():  # a recompute (core/memory.py) runs this forward again: count once
                self._record(routing, dispatched.tokens_per_expert_E, dispatched.kept_per_expert_E, aux, scale)
            if aux and torch.is_grad_enabled():
                # On the [T, K] combine weights, whose gradient every backward computes: an
                # identity on a small tensor rather than on the [T, D] output.
                weights_TK = attach_aux_loss(weights_TK, sum(aux), scale)
        if self.cfg.weights_before_down:
            # The weights scale each row before the down projection; the combine sums plain rows.
            y_RD = self.experts(dispatched.x_RD, dispatched.offsets_L, self.dispatcher.row_weights(weights_TK, dispatched))
            out_TD = self.dispatcher.combine(y_RD, None, dispatched)
        else:
            y_RD = self.experts(dispatched.x_RD, dispatched.offsets_L)
            out_TD = self.dispatcher.combine(y_RD, weights_TK, dispatched)
        if self.shared is not None:
            out_TD = out_TD + self.shared(x_TD)
        return out_TD.view(B, S, D)

    def _aux_losses(self, routing, tokens_per_expert_E, num_sequences: int) -> list[torch.Tensor]:
        """This forward's weighted aux losses, in the order of self.aux_names."""
        rcfg = self.cfg.router
        losses = []
        for name in self.aux_names:
            if name == "lb_loss":
                losses.append(rcfg.lb_loss_weight * load_balance_loss(
                    routing.probs_TE, routing.topk_ids_TK, tokens_per_expert_E, rcfg.lb_granularity,
                    num_sequences, self.balance_group,
                ))
            else:
                losses.append(rcfg.z_loss_weight * z_loss(routing.logits_TE))
        return losses

    @torch.no_grad()
    def _record(self, routing, tokens_per_expert_E, kept_per_expert_E, aux: list[torch.Tensor], scale: float) -> None:
        # In place (add_), never `buffer += x`: that rebinds the attribute through Module.__setattr__,
        # a side effect torch.compile refuses inside activation checkpointing (the whole block then
        # ran eagerly under memory.recompute=full).
        counts_E = tokens_per_expert_E.float()
        self.step_tokens_E.add_(counts_E)
        self.log_tokens_E.add_(counts_E)
        self.log_dropped.add_((tokens_per_expert_E - kept_per_expert_E).sum())
        # entr(p) = -p log p, 0 at p = 0: one elementwise pass over [T, E].
        self.log_entropy_sum.add_(torch.special.entr(routing.probs_TE).sum())
        self.log_token_count.add_(routing.probs_TE.shape[0])
        if aux:
            # Weighted as the loss trains them: summed over a step's micro-batches, the step's mean.
            self.log_aux.add_(torch.stack(aux).detach().float() * scale)

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
            self.router.expert_bias.add_(error_E.sign(), alpha=self.cfg.router.bias_update_rate)  # in place, as _record
        self.step_tokens_E.zero_()

    @torch.no_grad()
    def pop_load_stats(self) -> dict[str, torch.Tensor]:
        """Counts and aux-loss sums since the last call over the balance group; resets them (one
        collective, no host sync).

        Returns tokens_per_expert [E] (summed over the group), dropped, entropy (mean per token),
        one entry per aux loss (its per-step weighted value summed over the steps since the last
        call, averaged over the group's ranks) and expert_bias [E] when the router has one.
        """
        packed = torch.cat([self.log_tokens_E, self.log_dropped[None], self.log_entropy_sum[None],
                            self.log_token_count[None], self.log_aux])
        ranks = 1
        if self.balance_group is not None and dist.get_world_size(self.balance_group) > 1:
            dist.all_reduce(packed, group=self.balance_group)
            ranks = dist.get_world_size(self.balance_group)
        E = self.num_experts
        for buf in (self.log_tokens_E, self.log_dropped, self.log_entropy_sum, self.log_token_count, self.log_aux):
            buf.zero_()
        stats = {"tokens_per_expert": packed[:E], "dropped": packed[E], "entropy": packed[E + 1] / packed[E + 2].clamp_min(1)}
        for j, name in enumerate(self.aux_names):
            stats[name] = packed[E + 3 + j] / ranks
        if self.router.expert_bias is not None:
            stats["expert_bias"] = self.router.expert_bias.clone()
        return stats

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        for w in (self.router.weight, self.experts.w_gate_up, self.experts.w_down):
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
        if self.router.expert_bias is not None:
            self.router.expert_bias.zero_()


def moe_layers(modules: nn.Module | list[nn.Module] | tuple[nn.Module, ...]) -> dict[int, MoELayer]:
    """Every MoE layer inside ``modules`` (a model, a block, or a rank's pipeline stages, in any
    wrappers: FSDP2, compile), keyed by the layer index it was built with, in index order.

    The one answer to "which layers are MoE layers": the trainer, the strategies and the tools
    all call it. Two layers built with the same index are an error (their metrics would merge).
    """
    parts = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    found: dict[int, MoELayer] = {}
    for part in parts:
        for module in part.modules():
            if isinstance(module, MoELayer):
                other = found.setdefault(module.layer_index, module)
                if other is not module:
                    raise ValueError(f"two MoE layers were built with layer_index={module.layer_index}: "
                                     f"give each its block's index")
    return dict(sorted(found.items()))
