"""Memory switches: activation recompute (the ``memory`` config section).

``memory.recompute``:

- ``none``: every activation autograd needs is kept from forward to backward;
- ``full``: whole transformer blocks are recomputed in backward (every ``recompute_every``-th
  block, from the first: Megatron's uniform method with one block per chunk), so a block keeps only
  its input;
- ``selective``: only the modules named in ``recompute_modules`` are (cheap ones first: ``norm``,
  ``swiglu`` (the silu(gate) * up product of dense, shared and routed experts), ``router``, then
  ``attention``, ``mlp`` (dense and shared-expert SwiGLUs), ``experts`` (the routed grouped GEMMs)).

Recompute uses torch.utils.checkpoint's non-reentrant form: the same ops run again on the same
inputs with the same RNG state, so losses and gradients are bit-identical to the run without it
(tests/core/test_memory.py). It is applied to the built model before torch.compile and the parallel
strategies; parameter names are unchanged (the module's forward is wrapped, not the module), so
checkpoints, FSDP2 units and pipeline cuts see the same model. A recomputed MoE layer runs its
dispatch again in backward: under expert parallelism a full-block recompute repeats the
all-to-all (selective ``experts`` does not: it recomputes the GEMMs on the received rows); its load
statistics are recorded once (core.moe.layer skips recording inside backward).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import Config, ConfigError, StrEnum


class Recompute(StrEnum):
    none = "none"
    """Keep every activation (fastest, most memory)."""
    full = "full"
    """Recompute whole blocks (every memory.recompute_every-th)."""
    selective = "selective"
    """Recompute only memory.recompute_modules."""


def recomputed(fn: Callable) -> Callable:
    """``fn`` whose activations are recomputed in backward instead of kept (same results)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return run


def _modules_of_kind() -> dict[str, Callable[[nn.Module], bool]]:
    from .layers.attention import Attention
    from .layers.mlp import SwiGLU
    from .layers.norm import RMSNorm
    from .moe.experts import GroupedExperts
    from .moe.router import ROUTERS

    routers = tuple(ROUTERS.values())
    return {
        "norm": lambda m: isinstance(m, RMSNorm),
        "router": lambda m: isinstance(m, routers),
        "attention": lambda m: isinstance(m, Attention),
        "mlp": lambda m: isinstance(m, SwiGLU),
        "experts": lambda m: isinstance(m, GroupedExperts),
    }


SELECTIVE_MODULES = ("norm", "swiglu", "router", "attention", "mlp", "experts")
"""What memory.recompute_modules may name, cheapest to recompute first."""


@dataclasses.dataclass
class MemoryConfig(Config):
    recompute: Recompute = Recompute.none
    """Activation recompute (see Recompute)."""
    recompute_every: int = 1
    """full: recompute every N-th block (blocks 0, N, 2N, ...); 1 = every block."""
    recompute_modules: list[str] = dataclasses.field(default_factory=list)
    """selective: which modules to recompute (any of SELECTIVE_MODULES)."""

    def validate(self) -> None:
        if self.recompute_every < 1:
            raise ConfigError(f"memory.recompute_every must be >= 1, got {self.recompute_every}")
        bad = [m for m in self.recompute_modules if m not in SELECTIVE_MODULES]
        if bad:
            raise ConfigError(f"memory.recompute_modules {bad} are not recomputable modules: choose among "
                              f"{list(SELECTIVE_MODULES)}")
        if self.recompute == Recompute.selective and not self.recompute_modules:
            raise ConfigError("memory.recompute=selective needs memory.recompute_modules, e.g. "
                              "--memory.recompute_modules=[norm,swiglu,attention]")
        if self.recompute != Recompute.selective and self.recompute_modules:
            raise ConfigError(f"memory.recompute_modules is only read with memory.recompute=selective "
                              f"(got recompute={self.recompute}): set recompute=selective or drop the list")
        if self.recompute != Recompute.full and self.recompute_every != 1:
            raise ConfigError("memory.recompute_every is only read with memory.recompute=full")

    def apply(self, model: nn.Module) -> int:
        """Install recompute on a built model (before compile and the parallel strategies); returns
        how many forwards were wrapped. ``model`` needs ``blocks`` (an nn.ModuleDict) for ``full``."""
        self.validate()
        if self.recompute == Recompute.none:
            return 0
        targets: list[tuple[nn.Module, str]] = []
        if self.recompute == Recompute.full:
            blocks = getattr(model, "blocks", None)
            if not isinstance(blocks, nn.ModuleDict):
                raise ConfigError(f"memory.recompute=full needs a model with blocks (an nn.ModuleDict); "
                                  f"{type(model).__name__} has none")
            targets = [(b, "forward") for i, b in enumerate(blocks.values()) if i % self.recompute_every == 0]
        else:
            kinds = _modules_of_kind()
            for module in model.modules():
                if "swiglu" in self.recompute_modules and hasattr(module, "act"):
                    targets.append((module, "act"))
                if any(kinds[k](module) for k in self.recompute_modules if k in kinds):
                    targets.append((module, "forward"))
        for module, attr in targets:
            setattr(module, attr, recomputed(getattr(module, attr)))
        return len(targets)
