"""MoE configuration: router, experts, capacity, load balancing; parameter counts before building."""

from __future__ import annotations

import dataclasses
import math

from ..config import Config, ConfigError, StrEnum


class RouterScore(StrEnum):
    softmax = "softmax"
    """Softmax over all experts' logits (OLMoE, Mixtral, Switch)."""
    sigmoid = "sigmoid"
    """Independent sigmoid per expert (DeepSeek-V3); usually with renormalize=true."""


class LoadBalanceGranularity(StrEnum):
    micro_batch = "micro_batch"
    """Switch loss E * sum_e f_e * P_e over the tokens of this rank's micro-batch."""
    global_batch = "global_batch"
    """f_e (the routed fractions) summed over every rank of the load-balance group before the
    loss, so experts are balanced over the global batch, not each micro-batch; P_e stays local."""
    sequence = "sequence"
    """f_e and P_e per sequence, the loss averaged over sequences (DeepSeek-V3's sequence-wise loss)."""


class ExpertsBackend(StrEnum):
    auto = "auto"
    """grouped_mm on CUDA, loop elsewhere."""
    grouped_mm = "grouped_mm"
    """torch._grouped_mm: every local expert's GEMM in one kernel, offsets on the device (no sync)."""
    loop = "loop"
    """A Python loop over experts reading the offsets on the host: the CPU path and a reference."""


@dataclasses.dataclass
class RouterConfig(Config):
    kind: str = "topk"
    """Router class, by its registered name (core.moe.router.ROUTERS; "topk": token-choice top-k)."""
    score: RouterScore = RouterScore.softmax
    """Score function over the router logits (see RouterScore)."""
    top_k: int = 4
    """Experts per token."""
    renormalize: bool = True
    """Rescale each token's top-k weights to sum to 1."""
    scale: float = 1.0
    """Multiplies the routed output (DeepSeek's routed_scaling_factor)."""
    n_groups: int | None = None
    """Group-limited routing: experts split into this many equal groups ..."""
    topk_groups: int | None = None
    """... and each token picks its top-k among the experts of its best topk_groups groups."""
    expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for selection only, moved
    after each optimizer step towards balance from the global per-expert counts (never by gradients)."""
    bias_update_rate: float = 1e-3
    """Step of the expert-bias update: bias_e += rate * sign(mean load - load_e)."""
    lb_loss_weight: float = 0.01
    """Weight of the Switch load-balancing loss; 0 turns it off."""
    lb_granularity: LoadBalanceGranularity = LoadBalanceGranularity.micro_batch
    """Over which tokens the routed fractions are counted (see LoadBalanceGranularity)."""
    z_loss_weight: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)^2); 0 turns it off."""

    def validate_for(self, num_experts: int) -> None:
        from .router import ROUTERS  # the registry lives beside the routers (they import this module)

        ROUTERS.lookup(self.kind, "model.moe.router.kind")
        if self.top_k <= 0:
            raise ConfigError(f"model.moe.router.top_k must be positive, got {self.top_k}")
        if self.top_k > num_experts:
            raise ConfigError(
                f"model.moe.router.top_k={self.top_k} exceeds model.moe.num_experts={num_experts}: "
                f"pick top_k <= num_experts"
            )
        if (self.n_groups is None) != (self.topk_groups is None):
            raise ConfigError("model.moe.router.n_groups and topk_groups must be set together (or neither)")
        if self.n_groups is not None:
            if self.n_groups <= 0 or num_experts % self.n_groups:
                raise ConfigError(
                    f"model.moe.num_experts={num_experts} does not split into n_groups={self.n_groups} equal "
                    f"groups: choose n_groups among the divisors of {num_experts}"
                )
            if not 0 < self.topk_groups <= self.n_groups:
                raise ConfigError(f"model.moe.router.topk_groups must be in [1, n_groups={self.n_groups}]")
            if self.topk_groups * (num_experts // self.n_groups) < self.top_k:
                raise ConfigError(
                    f"topk_groups={self.topk_groups} groups of {num_experts // self.n_groups} experts hold fewer "
                    f"than top_k={self.top_k} experts: raise topk_groups"
                )
        for name in ("lb_loss_weight", "z_loss_weight", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.moe.router.{name} must be >= 0")
        if self.scale <= 0:
            raise ConfigError(f"model.moe.router.scale must be positive, got {self.scale}")


@dataclasses.dataclass
class MoEConfig(Config):
    num_experts: int = 8
    """Routed experts per MoE layer."""
    expert_hidden: int = 1024
    """SwiGLU hidden width of each routed expert."""
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
    """Scores, top-k, balancing."""
    num_shared_experts: int = 0
    """Experts every token goes through (one SwiGLU of width num_shared_experts * shared_expert_hidden)."""
    shared_expert_hidden: int | None = None
    """Hidden width of each shared expert; None means expert_hidden."""
    capacity_factor: float | None = None
    """None = dropless (the default). Else each expert takes at most
    ceil(capacity_factor * tokens * top_k / num_experts) slots per micro-batch; the drop policy keeps
    the earliest slots in token order (token t before t+1, then k order) and drops the rest: a
    dropped slot contributes nothing (the token keeps its residual and its other experts)."""
    dense_layers: list[int] = dataclasses.field(default_factory=list)
    """Layer indices that keep a dense SwiGLU MLP (width model.mlp_hidden), e.g. [0]."""
    experts_backend: ExpertsBackend = ExpertsBackend.auto
    """How the local experts' GEMMs run (see ExpertsBackend)."""
    weights_before_down: bool = False
    """Apply each slot's combine weight to its expert row before the down projection (the same sum,
    by linearity; bf16 rounding differs) instead of to the expert outputs in the combine: the combine
    then sums unweighted rows and keeps no [rows, D] copy of the expert outputs for the weights'
    gradient (32 KiB per token per layer on OLMoE-1B-7B). Local dispatch only (no expert parallel)."""

    def shared_width(self) -> int:
        return self.num_shared_experts * (self.shared_expert_hidden or self.expert_hidden)

    def validate_for(self, n_layers: int) -> None:
        if self.num_experts <= 0:
            raise ConfigError(f"model.moe.num_experts must be positive, got {self.num_experts}")
        if self.expert_hidden <= 0:
            raise ConfigError(f"model.moe.expert_hidden must be positive, got {self.expert_hidden}")
        if self.num_shared_experts < 0:
            raise ConfigError("model.moe.num_shared_experts must be >= 0")
        self.router.validate_for(self.num_experts)
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(f"model.moe.capacity_factor must be positive or null, got {self.capacity_factor}")
        bad = [i for i in self.dense_layers if not 0 <= i < n_layers]
        if bad:
            raise ConfigError(f"model.moe.dense_layers {bad} are not layers of a {n_layers}-layer model")

    def capacity(self, num_tokens: int) -> int | None:
        """Slots each expert may take for a micro-batch of num_tokens tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.router.top_k / self.num_experts))

    def num_params(self, d_model: int) -> int:
        routed = self.num_experts * 3 * d_model * self.expert_hidden
        return routed + 3 * d_model * self.shared_width() + self.num_experts * d_model

    def num_active_params(self, d_model: int) -> int:
        routed = self.router.top_k * 3 * d_model * self.expert_hidden
        return routed + 3 * d_model * self.shared_width() + self.num_experts * d_model
