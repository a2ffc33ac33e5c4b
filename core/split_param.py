"""The stand-in class of a parameter whose fp32 master the optimizer holds split (optimizer.split_master).

Between steps such a parameter owns no storage (core.adamw.PrecisionAwareAdamW frees it: the master
lives as its bf16 compute copy plus an int16 rest), so a read of its values would read freed memory: a
segfault on the CPU, an illegal address or silent garbage on a GPU. While its storage is freed the
optimizer gives the parameter the class ``freed_class(type(p))``, whose ``__torch_function__`` raises one
clear error (naming the way to read it) on anything that reads or writes its values, and lets through
what reads only its metadata: shape, dtype, device, its (empty) storage, its gradient (the optimizer, clipping and
``zero_grad`` touch those every step), ``*_like`` factories. The parameter stays the same object (the
optimizer's state, the copies and the modules key on it), an ``nn.Parameter`` of its shape, dtype and
device; ``masters_materialized`` gives it its class back with its storage. The training step never
reads it (the model computes on the copy), so a compiled forward sees no difference.
"""

from __future__ import annotations

import torch

__all__ = ["SplitMasterError", "freed_class", "original_class"]


class SplitMasterError(RuntimeError):
    """A read of a parameter whose fp32 master is held split (its storage freed) between steps."""


# What reads only a tensor's metadata, or its gradient (a tensor of its own), never its values.
_META_ATTRS = ("shape", "dtype", "device", "grad", "_grad", "requires_grad", "is_leaf", "ndim", "layout", "is_cuda",
               "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "grad_fn", "names", "itemsize",
               "nbytes", "_version", "_post_accumulate_grad_hooks", "_backward_hooks")
_META_METHODS = ("size", "dim", "numel", "nelement", "stride", "is_contiguous", "element_size", "is_floating_point",
                 "is_complex", "get_device", "requires_grad_", "__len__", "register_hook",
                 "register_post_accumulate_grad_hook", "untyped_storage", "data_ptr")
_META_FUNCTIONS = (torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like)


def _metadata_functions() -> frozenset:
    out = set(_META_FUNCTIONS)
    for name in _META_ATTRS:
        attr = getattr(torch._C.TensorBase, name, None)
        for accessor in ("__get__", "__set__", "__delete__"):
            if attr is not None and hasattr(attr, accessor):
                out.add(getattr(attr, accessor))
    out.update(getattr(torch.Tensor, name) for name in _META_METHODS if hasattr(torch.Tensor, name))
    return frozenset(out)


_METADATA = _metadata_functions()


def _message(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    return (f"moetron: {name} reads a parameter whose fp32 master the optimizer holds split between steps "
            f"(optimizer.split_master): its storage is freed, the master lives as its bf16 copy and an int16 rest. "
            f"Read the weights inside `with trainer.masters_materialized():` (Trainer.fit() returns with them held; "
            f"checkpoints save them whole), or train with --optimizer.split_master=false")


class _FreedMixin:
    """The guard (see the module docstring); mixed in before the parameter's own class."""

    __slots__ = ()

    def __hash__(self) -> int:  # torch's Tensor.__hash__ is id-based too; this one skips __torch_function__
        return id(self)

    def __repr__(self) -> str:
        return (f"<{original_class(type(self)).__name__} {tuple(self.shape)} {self.dtype} on {self.device}: fp32 "
                f"master held split by the optimizer (optimizer.split_master); read it inside "
                f"trainer.masters_materialized()>")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in _METADATA:
            for arg in (*args, *(kwargs or {}).values()):
                if isinstance(arg, _FreedMixin) or (isinstance(arg, (list, tuple))
                                                     and any(isinstance(a, _FreedMixin) for a in arg)):
                    raise SplitMasterError(_message(func))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


_CLASSES: dict[type, type] = {}


def freed_class(cls: type) -> type:
    """The guarded stand-in of ``cls`` (a torch.Tensor subclass: nn.Parameter, or Tensor itself), made once."""
    if issubclass(cls, _FreedMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Split{cls.__name__}", (_FreedMixin, cls), {"__slots__": (), "_moetron_original": cls})
    return _CLASSES[cls]


def original_class(cls: type) -> type:
    """The class ``freed_class`` guarded (``cls`` itself where it is not a stand-in)."""
    return getattr(cls, "_moetron_original", cls) if issubclass(cls, _FreedMixin) else cls
