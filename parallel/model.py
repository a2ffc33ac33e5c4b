"""What parallel/ needs from a model, written down: strategies work on any model that has these,
never on attribute names found by trial (a model naming its MLP differently works the same)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn

from moetron.core.config import ConfigError
from moetron.core.moe.layer import MoELayer


@runtime_checkable
class ParallelModel(Protocol):
    """A decoder the strategies can split, shard and dispatch.

    - ``embed``: token ids [B, S] -> hidden [B, S, D] (the first pipeline stage holds it);
    - ``blocks``: an nn.ModuleDict of the transformer blocks keyed by layer index ("0", "1", ...):
      each is one FSDP2 unit and pipeline stages cut between them; hidden -> hidden;
    - ``norm`` and ``lm_head``: hidden -> logits [B, S, V] (the last stage holds them);
    - ``moe_layers()``: its MoE layers by layer index (core.moe.moe_layers finds them anywhere).
    """

    embed: nn.Module
    blocks: nn.ModuleDict
    norm: nn.Module
    lm_head: nn.Module

    def moe_layers(self) -> dict[int, MoELayer]: ...


class ModelShape(Protocol):
    """What strategies read from the model's config before anything is split (counts, FLOPs)."""

    n_layers: int
    d_model: int
    vocab_size: int
    moe: object | None
    """The MoE config (num_experts, router.top_k ...), None for a dense model."""

    def block_flops_per_token(self, layer: int, seq_len: int) -> float: ...


def require_parts(model: nn.Module, strategy: str, parts: tuple[str, ...]) -> None:
    """ConfigError naming what ``model`` lacks of the ParallelModel parts ``strategy`` uses."""
    missing = [a for a in parts if getattr(model, a, None) is None]
    if "blocks" in parts and "blocks" not in missing and not isinstance(model.blocks, nn.ModuleDict):
        missing.append("blocks as an nn.ModuleDict keyed by layer index")
    if missing:
        raise ConfigError(
            f"{strategy} needs a model with {', '.join(parts)} (see moetron.parallel.model.ParallelModel); "
            f"{type(model).__name__} lacks {', '.join(missing)}"
        )
