"""optimizer.overlap: the optimizer step on a side CUDA stream, overlapped with the next forward.

The step's updates are memory-bound (core/adamw_triton.py: about 20 bytes per parameter), the
forward's GEMMs compute-bound, so the two can share the GPU. The step is launched on a side stream
after the gradients and the clip coefficient are ready (the side stream waits for the main one:
global-norm clipping stays exact), unit by unit in the order the forward uses them (the
embedding, each block, the final norm and the LM head: ``units``), and records an event per unit.
Each unit's forward pre-hook makes the main stream wait for that unit's event only, so block 0
computes while the later blocks' weights are still being updated. Nothing else changes: the same
kernels update the same tensors in the same order per tensor, so the run is bit-identical to the
sequential step.

Every gradient the side stream reads is recorded on it (``Tensor.record_stream``) before the trainer
drops it, so the caching allocator does not hand its memory to the next forward early. Anything
that reads the parameters outside a forward (a checkpoint save, the finiteness check, a benchmark's
last timing mark) calls ``wait_all()`` first.

One unsharded GPU (no FSDP2, expert or pipeline parallel: their own streams and schedules read the
parameters outside these hooks), PrecisionAwareAdamW (its ``step_parts``). The pre-hooks are
excluded from torch.compile (a compiled block runs them eagerly, at its boundary). On the CPU there
is no stream: the step runs in place, part by part (the same updates).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import ConfigError

__all__ = ["OptimizerOverlap", "forward_units"]


def forward_units(model: nn.Module) -> list[nn.Module]:
    """The modules whose parameters the forward uses in turn: a model's own ``overlap_units()``
    (models.transformer.Transformer: embedding, blocks, final norm, LM head), else the model whole."""
    units = getattr(model, "overlap_units", None)
    return list(units()) if callable(units) else [model]


class OptimizerOverlap:
    """The optimizer's step over ``units`` (modules in forward order, whose parameters cover the
    optimizer's) on a side stream of ``device``; see the module docstring."""

    def __init__(self, optimizer, units: list[nn.Module], device: torch.device):
        if not hasattr(optimizer, "step_parts"):
            raise ConfigError(f"optimizer.overlap=true steps the optimizer unit by unit (core.adamw.PrecisionAwareAdamW), "
                              f"and this run's is {type(optimizer).__name__}: use optimizer.impl=auto or triton, or "
                              f"drop optimizer.overlap")
        self.optimizer = optimizer
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        seen: set[int] = set()
        self.parts: list[list[torch.Tensor]] = []
        for unit in units:
            part = [p for p in unit.parameters() if id(p) in owned and id(p) not in seen]
            seen.update(id(p) for p in part)
            self.parts.append(part)
        rest = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in seen]
        if rest:  # parameters outside every unit: one last part, waited by wait_all
            self.parts.append(rest)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events = [torch.cuda.Event() for _ in self.parts] if self.side is not None else []
        self.pending = [False] * len(self.parts)
        self._hooks = [unit.register_forward_pre_hook(self._waiter(i)) for i, unit in enumerate(units)]

    def _waiter(self, i: int) -> Callable:
        @torch.compiler.disable
        def wait_for_update(module, args):
            self.wait(i)

        return wait_for_update

    def wait(self, i: int) -> None:
        """The current stream waits for part i's update (once per step)."""
        if self.pending[i]:
            torch.cuda.current_stream().wait_event(self.events[i])
            self.pending[i] = False

    def wait_all(self) -> None:
        """The current stream waits for every update still in flight (before anything reads the
        parameters outside a forward)."""
        for i in range(len(self.parts)):
            self.wait(i)

    def step(self, grads: list[torch.Tensor]) -> None:
        """The optimizer's step (``grads``: every gradient it reads, which the caller is about to drop)."""
        if self.side is None:  # the CPU: in place, part by part all the same
            self.optimizer.step_parts(self.parts, lambda i: None)
            return
        self.wait_all()  # the previous step's updates, should a unit have had no forward since
        self.side.wait_stream(torch.cuda.current_stream())
        for g in grads:
            g.record_stream(self.side)
        with torch.cuda.stream(self.side):
            self.optimizer.step_parts(self.parts, self._recorded)

    def _recorded(self, i: int) -> None:
        self.events[i].record(self.side)
        self.pending[i] = True

    def remove(self) -> None:
        """Wait for the updates in flight and take the hooks off the units."""
        if self.side is not None:
            self.wait_all()
        for handle in self._hooks:
            handle.remove()
