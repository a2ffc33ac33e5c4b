"""One module over a model's pipeline parts, named as in the full model, for saving and loading."""

from __future__ import annotations

from torch import nn

from .layout import CheckpointError

__all__ = ["as_one_module"]


def as_one_module(model: nn.Module | list[nn.Module] | tuple[nn.Module, ...]) -> nn.Module:
    """``model``, or one module over a list of model parts (pipeline stages) that keeps their
    parameter names: parts' children of the same name are merged recursively (their ModuleDicts of
    blocks union), so ``blocks.3.mlp...`` is named as in the full model. Parts and merged
    containers must not own tensors directly (a stage's parameters live in its submodules)."""
    if isinstance(model, nn.Module):
        return model
    parts = list(model)
    if not parts:
        raise CheckpointError("Checkpointer got an empty list of model parts")
    return _merge_modules(parts, "")


def _merge_modules(mods: list[nn.Module], prefix: str) -> nn.Module:
    unique: list[nn.Module] = []
    for m in mods:
        if not any(m is u for u in unique):
            unique.append(m)
    if len(unique) == 1:
        return unique[0]
    for m in unique:
        if next(m.named_parameters(recurse=False), None) is not None or next(m.named_buffers(recurse=False), None) is not None:
            raise CheckpointError(
                f"cannot merge model parts at {prefix or '<root>'!r}: a {type(m).__name__} there owns tensors "
                "directly; model parts must keep disjoint submodules"
            )
    children: dict[str, list[nn.Module]] = {}
    for m in unique:
        for name, child in m.named_children():
            children.setdefault(name, []).append(child)
    merged = nn.Module()
    for name, group in children.items():
        merged.add_module(name, _merge_modules(group, f"{prefix}{name}."))
    return merged
