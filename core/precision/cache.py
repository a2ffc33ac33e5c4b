"""Quantized weights made once per optimizer step and reused by every micro-batch.

An entry is keyed on the weight's storage owner (the parameter, also when the GEMM receives a
view of it: an expert's slice, an expert-parallel local shard), the view's geometry and a tag
(which quantization: forward, dgrad); it is valid while the tensor's ``_version`` (bumped by every
in-place update, the optimizer's included) and the cache's generation (bumped by
``invalidate()``, which PrecisionPolicy.after_optimizer_step calls) are both unchanged. Either
one alone would do on one device; both together also cover FSDP2, whose all-gather refills an
unsharded parameter without going through autograd's version counter.

Entries hold only weak references to the weights: a freed parameter drops its entries.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["WeightCache", "outside_graph"]


class WeightCache:
    def __init__(self) -> None:
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Values someone else keeps current (the optimizer's bf16 copies): valid while the weight's
        # _version is the one they were pinned at; invalidate() leaves them.
        self._pinned: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.generation = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _key(w: torch.Tensor, tag: str) -> tuple:
        return (tag, tuple(w.shape), w.stride(), w.storage_offset(), w.dtype)

    def pin(self, w: torch.Tensor, tag: str, value: Any) -> None:
        """Serve ``value`` for ``w`` (and the same view of it) under ``tag`` while w is not written
        again (its _version is unchanged); the owner of ``value`` re-pins it after each rewrite."""
        owner = w if w._base is None else w._base
        slots = self._pinned.get(owner)
        if slots is None:
            slots = self._pinned[owner] = {}
        slots[self._key(w, tag)] = (w._version, value)

    def invalidate(self) -> None:
        """Forget every entry (after the optimizer step: the weights changed)."""
        self.generation += 1
        self._entries = WeakIdKeyDictionary()

    def get(self, w: torch.Tensor, tag: str, make: Callable[[torch.Tensor], Any]) -> Any:
        """``make(w)``, computed once while ``w`` is unchanged (see the module docstring)."""
        if torch.compiler.is_compiling():  # a traced graph cannot keep Python state: quantize
            return make(w)
        owner = w if w._base is None else w._base
        key = self._key(w, tag)
        pinned = self._pinned.get(owner)
        if pinned is not None:
            hit = pinned.get(key)
            if hit is not None and hit[0] == w._version:
                self.hits += 1
                return hit[1]
        stamp = (w._version, self.generation)
        slots = self._entries.get(owner)
        if slots is None:
            slots = self._entries[owner] = {}
        hit = slots.get(key)
        if hit is not None and hit[0] == stamp:
            self.hits += 1
            return hit[1]
        self.misses += 1
        with torch.no_grad():
            value = make(w.detach())
        slots[key] = (stamp, value)
        return value


@torch.compiler.disable
def outside_graph(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run eagerly even where a compiled region calls it (a graph break there), so
    a WeightCache inside ``fn`` is served (precision.quantize_weights_once). Autograd records it
    as usual; its backward runs eagerly too."""
    return fn(*args)
