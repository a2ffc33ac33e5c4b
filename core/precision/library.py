"""The moetron operator library's lean registration: a Python function made an operator
(``torch.ops.moetron.<name>``) through ``torch.library.Library`` define / impl, with its fake (meta)
implementation for torch.compile, instead of ``torch.library.custom_op``.

Why: the FP8 grouped GEMMs run behind operators so that torch.compile treats them as opaque (it cannot
trace Gluon launches or TMA descriptor checks), and at a compiled step's run time every call pays the
operator's dispatch. custom_op's wrapper (its autograd key, aliasing checks and Dynamo-disabled frame)
cost about 90 us of host time a call on the H100 against about 0 for a Library op (session 38,
docs/bench/session37/host_probe.py: the Gluon rows op 230.6 us whole, its body 138.4 called directly,
137.3 behind a Library op); a step of OLMoE-8L runs 48 such GEMMs, and its FP8 step is partly bound by
the host. An operator defined here has no autograd formula: it is called inside an
autograd.Function's forward or backward (as every FP8 GEMM op is), never differentiated itself.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["define_op"]

LIB = torch.library.Library("moetron", "FRAGMENT")  # kept alive with this module: its registrations live as long


def define_op(fn: Callable, fake: Callable) -> torch._ops.OpOverloadPacket:
    """``torch.ops.moetron.<fn.__name__>``: ``fn`` (its schema inferred from its annotations, nothing
    mutated) as the CPU and CUDA implementation, ``fake`` (the same arguments -> outputs of the right
    shape, dtype and device, uninitialized) for torch.compile's fake tensors."""
    name = fn.__name__
    LIB.define(name + torch.library.infer_schema(fn, mutates_args=()))
    for key in ("CPU", "CUDA"):
        LIB.impl(name, fn, key)
    torch.library.register_fake(f"moetron::{name}", fake, lib=LIB)
    return getattr(torch.ops.moetron, name)
