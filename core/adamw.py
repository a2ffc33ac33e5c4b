"""AdamW whose moments (exp_avg, exp_avg_sq) are stored in a lower precision than the parameters.

The parameters stay the fp32 master weights and all update math is fp32 (the parameters' dtype):
each step upcasts a chunk of moments, updates them, writes them back rounded to nearest (bf16), and
updates the parameters from the unrounded fp32 moments, as Megatron's precision-aware optimizer and
Transformer Engine's FusedAdam(exp_avg_dtype=bf16) do. The math is torch.optim.AdamW's, operation for
operation (decoupled decay p *= 1 - lr * wd, bias correction, eps outside the square root), so with
the state kept in the parameters' dtype the foreach path's result is torch's bit for bit.

Speed (foreach path): torch._foreach_* ops over lists grouped by (device, dtype), so a chunk costs about ten kernel
launches whatever its tensor count. Memory: the fp32 copies of the moments exist for one chunk at a
time (at most ``chunk_numel`` elements, large tensors are split into flat views), so the step's peak
is not the fp32 state that the bf16 state saves.

Kernels (``kernel``, an AdamWKernel): the foreach path above, or core.adamw_triton's one-pass Triton
kernel (each tensor read and written once: 20 bytes per parameter with bf16 state, 28 with fp32,
where the foreach path makes about ten passes); ``auto`` takes Triton for CUDA tensors and foreach
elsewhere. The Triton kernel follows torch's foreach CUDA kernels operation for operation (its
docstring; on the CPU torch rounds addcmul and addcdiv in another order: a few ulps,
tests/core/test_adamw_triton.py); it also takes bf16 gradients, and can write a bf16 copy of each
updated weight in the same pass (``compute_copies``: the hook for bf16 compute weights written by
the step itself).

DTensors (FSDP2 shards, expert-parallel weights): the moments are DTensors like their parameters
(DCP reshards them), the math runs on the local tensors (to_local shares storage).

8-bit moments (``state_dtype=torch.uint8``, optimizer.state_dtype=q8; ``torch.float8_e4m3fn``, fp8): each moment
is held as one byte an element and a scale a block of 256 along the last dim (core.moments_q8: q8, block-wise
dynamic quantization under an fp32 scale; fp8, E4M3 under a power of two), 2 bytes of moments an element where
bf16 holds 4. A step widens a parameter's moments to fp32, updates them and
the parameter as above (the parameter from the unrounded fp32 moments), and quantizes them back: in the Triton
kernel's one pass (core.adamw_triton.adamw_update_q8_), or on the foreach path a block of rows at a time
(core.moments_q8's torch reference). Parameters of fewer than 2 dims (norm weights: a few thousand elements a
layer) keep fp32 moments, as 8-bit optimizers keep small tensors' state in 32 bits; their blocks would run along
the one dim that FSDP2 shards. Not with mx_cols (precision.quantized_expert_copies). A DTensor matrix's scales
are a DTensor of its placements, so none may shard its last dim.

Rounding: round-to-nearest cannot register a change smaller than half a bf16 ulp (2^-9 to 2^-8 of
the value), so a moment whose per-step decay 1 - beta is below 2^-8 would never decay (beta2 =
0.999 freezes exp_avg_sq when gradients shrink); OptimizerConfig refuses such betas with bf16 state.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from .config import StrEnum
from .split_param import freed_class, original_class

__all__ = ["AdamWKernel", "PrecisionAwareAdamW", "MIN_ONE_MINUS_BETA", "join_fp32", "split_fp32", "triton_usable"]

# Smallest 1 - beta whose decay a bf16 moment registers under round-to-nearest (see the docstring).
MIN_ONE_MINUS_BETA = {torch.bfloat16: 2.0**-8}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _scales_like(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zero scales (``dtype``) for 8-bit moments of ``p`` (core.moments_q8.scale_shape): a DTensor of p's mesh
    and placements for a DTensor p, whose blocks along the last dim then stay with their rows on every rank."""
    from .moments_q8 import scale_shape

    local = _local(p)
    scales = torch.zeros(scale_shape(local.shape), dtype=dtype, device=local.device)
    if not isinstance(p, DTensor):
        return scales
    if any(getattr(pl, "dim", None) in (p.dim() - 1, -1) for pl in p.placements):
        raise ValueError(f"8-bit moments (optimizer.state_dtype=q8 / fp8) keep a scale a block of the last dim, and "
                         f"this parameter {tuple(p.shape)} is sharded on its last dim ({p.placements}): shard another "
                         f"dim or use optimizer.state_dtype=bf16")
    shape = scale_shape(p.shape)
    return DTensor.from_local(scales, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _free(p: torch.Tensor) -> None:
    """Free a split master's fp32 storage and give the parameter its guarded stand-in class
    (core.split_param: a read between steps raises a clear error instead of reading freed memory)."""
    p.untyped_storage().resize_(0)  # (the stand-in lets storage calls through)
    p.__class__ = freed_class(type(p))


_SPLIT_CHUNK = 2**22  # elements per pass of split_fp32 / join_fp32 (their int64 temporaries: 32 MiB each)


@torch.no_grad()
def split_fp32(p: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Hold the fp32 master ``p`` split (optimizer.split_master): ``hi`` (bf16) <- p rounded to the
    nearest even bf16 (what p.to(torch.bfloat16) gives, for every non-NaN p), ``lo`` (int16) <- p - hi in
    units of p's last bit. That difference lies in [-32768, 32768]; int16 holds all of it but +32768,
    and a difference of +-32768 is a tie (p's low 16 bits exactly 0x8000), so lo is clamped to +-32767:
    at a tie the master kept (join_fp32) is p moved one fp32 ulp toward hi, which still rounds to hi.
    Everywhere else join_fp32(hi, lo) is p bit for bit. The torch reference of the Triton kernel's
    store_split (core/adamw_triton.py), in integer ops; contiguous tensors of one shape."""
    for p_c, hi_c, lo_c in zip(*(t.view(-1).split(_SPLIT_CHUNK) for t in (p, hi, lo))):
        bits = p_c.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        h = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 & 0xFFFF
        d = (bits - (h << 16) + 2**31) % 2**32 - 2**31  # the difference, wrapped as the kernel's uint32 is
        hi_c.view(torch.int16).copy_(torch.where(h >= 2**15, h - 2**16, h))
        lo_c.copy_(d.clamp(-32767, 32767))


@torch.no_grad()
def join_fp32(hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32) <- the master held split as ``hi`` and ``lo`` (split_fp32), exactly; returns out."""
    for hi_c, lo_c, out_c in zip(*(t.view(-1).split(_SPLIT_CHUNK) for t in (hi, lo, out))):
        bits = (((hi_c.view(torch.int16).to(torch.int64) & 0xFFFF) << 16) + lo_c.to(torch.int64)) % 2**32
        out_c.view(torch.int32).copy_(torch.where(bits >= 2**31, bits - 2**32, bits))
    return out


class _Row(NamedTuple):
    """One parameter's tensors for a step, all local (a DTensor's shard)."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # CPU float scalar, already incremented
    copy: torch.Tensor | None  # the bf16 compute copy to refresh, if any
    scales: tuple[torch.Tensor, torch.Tensor] | None = None  # 8-bit moments' block scales (m's, v's root's)


class AdamWKernel(StrEnum):
    auto = "auto"
    """triton for CUDA tensors with fp32 parameters, foreach for the rest (CPU, fp64)."""
    foreach = "foreach"
    """torch._foreach_* ops over chunks (about ten passes over the state): any device; the reference."""
    triton = "triton"
    """core.adamw_triton, one launch and one pass per tensor: fp32 parameters on CUDA, or on the CPU
    under TRITON_INTERPRET=1; a non-contiguous tensor still takes the foreach path."""


def triton_usable(device: torch.device) -> str | None:
    """None if the Triton kernel can run on ``device``'s tensors, else why not (for an error)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"the Triton AdamW kernel runs on CUDA tensors, or on {device.type} tensors only under "
                f"TRITON_INTERPRET=1 set before triton is imported")
    return None


def _moments_name(dtype: torch.dtype) -> str:
    """Moments of ``dtype`` as load_state_dict's error names them: 8-bit codes by their state_dtype; float moments
    by their dtype (they load into each other: torch casts them)."""
    from .moments_q8 import CODE_NAMES

    return f"8-bit ({CODE_NAMES[dtype]})" if dtype in CODE_NAMES else str(dtype)


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW semantics with ``state_dtype`` moments (default fp32, as OptimizerConfig.state_dtype's;
    bf16 halves them; torch.uint8 or torch.float8_e4m3fn: 8-bit moments, q8's or fp8's code, core.moments_q8)
    and fp32 update math.

    ``params``: tensors or param groups (``lr``, ``betas``, ``eps``, ``weight_decay`` per group),
    floating point parameters of at least fp32 (they are the master weights); ``chunk_numel``:
    elements upcast at a time by the foreach path (the step's fp32 temporaries: two moment copies,
    2 x 4 x chunk_numel bytes, 256 MiB at the default); ``kernel``: an AdamWKernel (see the module
    docstring); ``compute_copies``: {parameter: bf16 tensor of its shape (a DTensor like it, for a
    DTensor)}, each overwritten with its parameter rounded to nearest after every step (by the
    Triton kernel in its pass, by one copy on the foreach path). ``split_master``: hold the master of
    every parameter whose copy the model computes with in its place (add_compute_copies' ``replaces``)
    split, as the copy and an int16 remainder, and free the parameter's fp32 storage (see split_fp32,
    masters_materialized)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, state_dtype: torch.dtype = torch.float32,
                 chunk_numel: int = 2**25, kernel: AdamWKernel | str = AdamWKernel.auto,
                 compute_copies: dict[torch.Tensor, torch.Tensor] | None = None, split_master: bool = False):
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype, self.chunk_numel, self.kernel = state_dtype, chunk_numel, AdamWKernel(kernel)
        from .moments_q8 import CODE_DTYPES

        if state_dtype not in (torch.float32, torch.float64, torch.bfloat16, *CODE_DTYPES):
            raise ValueError(f"state_dtype must be fp32, fp64, bf16, uint8 or float8_e4m3fn (8-bit moments: q8, "
                             f"fp8), got {state_dtype}")
        self.eight_bit = state_dtype in CODE_DTYPES
        self._float_state = torch.float32 if self.eight_bit else state_dtype  # all moments but the 8-bit ones
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:
            if not p.is_floating_point() or torch.finfo(p.dtype).bits < 32 or p.is_complex():
                raise ValueError(f"PrecisionAwareAdamW keeps the parameters as master weights: they must be "
                                 f"fp32 or fp64, got {p.dtype}")
        # The gradient-clipping coefficient of the coming step (defer_grad_scale), or None.
        self._grad_scale: torch.Tensor | None = None
        self.compute_copies: dict[torch.Tensor, torch.Tensor] = {}
        self._grad_copies: dict[int, torch.Tensor] = {}  # id(parameter) -> the copy holding its gradient
        self._copy_hooks: list = []
        self._mx_cols: dict[int, tuple[torch.Tensor, str]] = {}  # id(parameter) -> (its MX dgrad operand, scale mode)
        self._parts = None  # (parts, after_part) while step_parts runs step()
        self._checked_parts = None  # the last partition step_parts validated
        self.split_master = split_master
        self._lo: dict[int, torch.Tensor] = {}  # id(parameter) -> the int16 rest of its split master
        self._materialized = 0  # depth of masters_materialized blocks: the split parameters hold their masters
        self.add_compute_copies(compute_copies or {})

    def add_compute_copies(self, copies: dict[torch.Tensor, torch.Tensor], on_written=None, grads: bool = False,
                           mx_cols: dict[torch.Tensor, torch.Tensor] | None = None, mx_scale_mode: str = "rceil",
                           replaces: bool = False) -> None:
        """More {parameter: bf16 copy} pairs to overwrite after every step; ``on_written``: called
        after each step with the list of (parameter, copy) pairs just written (a cache that serves
        the copies re-validates them there). ``grads``: the copies are leaves the model computes
        with in the parameters' place, so the backward leaves the gradient on the copy (bf16) and
        none on the parameter; the step reads it as the parameter's gradient and zero_grad clears
        it (see gradient_holders). ``mx_cols`` (precision.quantized_expert_copies): {parameter [..., O, I]:
        a second bf16 tensor of its shape}; for those parameters the copy receives bf16(p) quantized to
        MXFP8 along I and dequantized, and the second tensor the same along O (``mx_scale_mode``):
        the emulated mxfp8 GEMMs' forward and dgrad weight operands, made in the step's own pass
        (core.adamw_triton.adamw_update_mx_pair_; the torch reference on the foreach path). ``replaces``:
        the model computes with these copies and never reads the parameters themselves (the caller's
        promise); with ``split_master`` their masters are then held split and the parameters' storage
        freed (split_masters)."""
        known = {id(p) for group in self.param_groups for p in group["params"]}
        for p, copy in copies.items():
            if id(p) not in known:
                raise ValueError("compute_copies has a key that is not one of the optimizer's parameters")
            if copy.dtype != torch.bfloat16 or copy.shape != p.shape or copy.device != p.device:
                raise ValueError(f"a compute copy must be bf16 of its parameter's shape {tuple(p.shape)} on "
                                 f"{p.device}, got {copy.dtype} {tuple(copy.shape)} on {copy.device}")
        for p, cols in (mx_cols or {}).items():
            if p not in copies:
                raise ValueError("mx_cols has a parameter without a compute copy among these copies")
            if cols.dtype != torch.bfloat16 or cols.shape != p.shape or cols.device != p.device or p.dim() < 2:
                raise ValueError(f"an mx_cols tensor must be bf16 of its parameter's shape {tuple(p.shape)} (2-D "
                                 f"or more) on {p.device}, got {cols.dtype} {tuple(cols.shape)} on {cols.device}")
            if p.shape[-1] % 32 or p.shape[-2] % 32:
                raise ValueError(f"mx_cols: MX blocks of 32 must divide both of the weight's last dims, got "
                                 f"{tuple(p.shape)}")
        if mx_cols and self.eight_bit:
            raise ValueError("mx_cols (precision.quantized_expert_copies) with 8-bit moments "
                             "(optimizer.state_dtype=q8 or fp8) is not built: use state_dtype=bf16 with it, or drop "
                             "quantized_expert_copies")
        if mx_cols and mx_scale_mode not in ("rceil", "floor"):
            raise ValueError(f"mx_scale_mode must be rceil or floor, got {mx_scale_mode!r}")
        self._mx_cols.update({id(p): (cols, mx_scale_mode) for p, cols in (mx_cols or {}).items()})
        self.compute_copies.update(copies)
        if grads:
            self._grad_copies.update((id(p), copy) for p, copy in copies.items())
        if on_written is not None:
            self._copy_hooks.append((on_written, list(copies)))
        if self.split_master and replaces:
            self._split_masters([p for p in copies if id(p) not in self._mx_cols])

    @torch.no_grad()
    def _split_masters(self, params: list[torch.Tensor]) -> None:
        """Hold these parameters' masters split: the copy <- the master rounded (bf16), an int16 rest
        kept here, the parameter's fp32 storage freed (4 bytes an element; the rest takes 2). Each must
        be a plain contiguous fp32 tensor owning its storage."""
        for p in params:
            if (isinstance(p, DTensor) or p.dtype != torch.float32 or not p.is_contiguous() or p.storage_offset()
                    or p.untyped_storage().nbytes() != 4 * p.numel()):
                raise ValueError(f"split_master holds plain contiguous fp32 parameters that own their storage, "
                                 f"got a {type(p).__name__} {p.dtype} {tuple(p.shape)}")
            if id(p) in self._lo:
                continue
            lo = torch.empty(p.shape, dtype=torch.int16, device=p.device)
            split_fp32(p, self.compute_copies[p], lo)
            self._lo[id(p)] = lo
            if not self._materialized:
                _free(p)

    def split_parameters(self) -> list[torch.Tensor]:
        """The parameters whose masters are held split (optimizer.split_master)."""
        return [p for p in self.compute_copies if id(p) in self._lo]

    @contextlib.contextmanager
    def masters_materialized(self):
        """Inside, every split parameter holds its fp32 master again (allocated, join_fp32 of its copy and
        rest), for what reads or sets parameters outside the step: a checkpoint's save or load, the
        finiteness check before it, a callback. On leaving, each is split again from the parameter (so a
        value loaded into it is kept, its copy rewritten) and its storage freed. Nests; nothing without
        split masters. Costs 4 bytes an element of split master while inside. A step() inside updates the
        split masters, which leaving splits again from the parameters: only a step whose result the block
        overwrites anyway belongs there (torch.distributed.checkpoint's optimizer-state initialisation
        before a load)."""
        split = self.split_parameters()
        if self._materialized == 0:
            try:
                for p in split:
                    p.__class__ = original_class(type(p))
                    p.untyped_storage().resize_(4 * p.numel())
                    join_fp32(self.compute_copies[p], self._lo[id(p)], p.detach())
            except BaseException:  # out of memory part way: the masters stay split, none held twice
                for p in split:
                    _free(p)
                raise
        self._materialized += 1
        try:
            yield
        finally:
            self._materialized -= 1
            if self._materialized == 0:
                for p in split:
                    split_fp32(p.detach(), self.compute_copies[p], self._lo[id(p)])
                    _free(p)

    def _init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            # step on the CPU as torch's non-fused AdamW keeps it: bias corrections are host floats.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            dtype = self.state_dtype if self._held_8bit(p) else self._float_state
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            if self._held_8bit(p):
                from .moments_q8 import scale_dtype

                state["exp_avg_scales"] = _scales_like(p, scale_dtype(dtype))
                state["exp_avg_sq_scales"] = _scales_like(p, scale_dtype(dtype))
        return state

    def _held_8bit(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s moments are held in 8 bits: with 8-bit moments, those of parameters of 2+ dims."""
        return self.eight_bit and p.dim() >= 2

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts every floating-point state to its parameter's dtype on load; the moments go
        # back to state_dtype (bf16 -> fp32 -> bf16 is exact, so a resume is bit-exact). 8-bit moments load
        # only into 8-bit moments of the same code, and only they do.
        from .moments_q8 import CODE_DTYPES, scale_dtype

        params = {i: p for saved, group in zip(state_dict["param_groups"], self.param_groups)
                  for i, p in zip(saved["params"], group["params"])}
        for i, state in state_dict["state"].items():
            held, p = state.get("exp_avg"), params.get(i)
            keeps = self.state_dtype if p is not None and self._held_8bit(p) else self._float_state
            if held is not None and p is not None and held.dtype != keeps and (
                    held.dtype in CODE_DTYPES or keeps in CODE_DTYPES):
                raise ValueError(f"this optimizer state holds {_moments_name(held.dtype)} moments for a parameter of "
                                 f"shape {tuple(p.shape)}, for which this optimizer keeps {_moments_name(keeps)} ones: "
                                 f"resume with the optimizer.state_dtype it was saved with")
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            if self._held_8bit(p):  # torch cast the codes to the parameter's dtype too: back to bytes (exact)
                scales = scale_dtype(self.state_dtype)
                for key, dtype in (("exp_avg", self.state_dtype), ("exp_avg_sq", self.state_dtype),
                                   ("exp_avg_scales", scales), ("exp_avg_sq_scales", scales)):
                    if key in state:
                        state[key] = state[key].to(dtype)
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != self._float_state:
                    state[key] = state[key].to(self._float_state)

    def defer_grad_scale(self, scale: torch.Tensor) -> None:
        """Multiply the gradients by ``scale`` (a 0-dim fp32 tensor on their device: the clipping
        coefficient) inside the coming step() instead of in a pass of their own: the Triton kernel
        reads it on the device and leaves the gradients unscaled; the foreach path multiplies them
        in place first, as clipping would. The same parameters and moments bit for bit either way.
        zero_grad() forgets it."""
        self._grad_scale = scale

    @torch.no_grad()
    def refresh_compute_copies(self) -> None:
        """Rewrite every compute copy from its parameter and tell the copies' users (the
        ``on_written`` hooks): for parameters set outside step(), as a checkpoint load does, after
        which a copy would otherwise hold the weights it was made from."""
        if self._lo and not self._materialized:
            raise RuntimeError("refresh_compute_copies reads the parameters, and split masters hold none outside "
                               "masters_materialized(): call it inside that block")
        for p in self.split_parameters():
            split_fp32(p.detach(), self.compute_copies[p], self._lo[id(p)])
        pairs = [(p, c) for p, c in self.compute_copies.items() if id(p) not in self._lo]
        if pairs:
            torch._foreach_copy_([_local(c) for _, c in pairs], [_local(p) for p, _ in pairs])
        self.write_mx_pairs([(p, c) for p, c in pairs if id(p) in self._mx_cols])
        for hook, params in self._copy_hooks:
            hook([(p, self.compute_copies[p]) for p in params])

    def gradient_holders(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` holds some parameters' gradients in their place (the copies
        added with ``grads=True``): gradient clipping and norms take them beside the parameters."""
        return list(self._grad_copies.values())

    def gradient_holder(self, p: torch.Tensor) -> torch.Tensor | None:
        """The tensor whose ``.grad`` is ``p``'s gradient when that is not ``p`` itself, else None."""
        return self._grad_copies.get(id(p))

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        # The holder's gradient when the backward left one there, else the parameter's own (set
        # by hand, e.g. the zero gradients torch.distributed.checkpoint steps with to create the
        # optimizer state it loads into).
        copy = self.gradient_holder(p)
        return copy.grad if copy is not None and copy.grad is not None else p.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_scale = None
        super().zero_grad(set_to_none=set_to_none)
        for copy in self._grad_copies.values():
            if copy.grad is not None:
                if set_to_none:
                    copy.grad = None
                else:
                    copy.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale, self._grad_scale = self._grad_scale, None
        if self._parts is not None:
            (parts, after_part), self._parts = self._parts, None
            self._step_in_parts(parts, after_part, scale)
            return loss
        for group in self.param_groups:
            self._step_group(group, scale)
        for hook, params in self._copy_hooks:
            hook([(p, self.compute_copies[p]) for p in params if self._grad(p) is not None])
        return loss

    def step_parts(self, parts: list[list[torch.Tensor]], after_part: Callable[[int], None]) -> None:
        """One step(), its updates launched part by part in the order given (``parts``: lists of
        this optimizer's parameters, each in exactly one), ``after_part(i)`` called once part i's
        updates and its compute copies are launched (core.overlap records its events there). The
        same updates as step() bit for bit, as every update is elementwise within one parameter;
        through step() itself, so its hooks and an LR scheduler's step count see it."""
        if self._checked_parts is not parts:  # once per partition, not every step
            index = {id(p) for part in parts for p in part}
            params = [p for group in self.param_groups for p in group["params"]]
            if len(index) != sum(len(part) for part in parts) or index != {id(p) for p in params}:
                raise ValueError("step_parts: every parameter of the optimizer must be in exactly one part")
            self._checked_parts = parts
        self._parts = (parts, after_part)
        try:
            self.step()
        finally:
            self._parts = None

    def _step_in_parts(self, parts, after_part, scale: torch.Tensor | None) -> None:
        if scale is not None and scale.is_cuda:  # read on this stream after its maker drops it
            scale.record_stream(torch.cuda.current_stream(scale.device))
        for i, part in enumerate(parts):
            ids = {id(p) for p in part}
            for group in self.param_groups:
                self._step_group(group, scale, only=ids)
            for hook, hooked in self._copy_hooks:
                pairs = [(p, self.compute_copies[p]) for p in hooked if id(p) in ids and self._grad(p) is not None]
                if pairs:
                    hook(pairs)
            after_part(i)

    def _step_group(self, group: dict[str, Any], grad_scale: torch.Tensor | None = None,
                    only: set[int] | None = None) -> None:
        """Update ``group``'s parameters that have gradients (those whose id is in ``only``, if given)."""
        hyper = dict(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                     weight_decay=group["weight_decay"])
        buckets: dict[tuple[torch.device, torch.dtype], list[_Row]] = {}
        for p in group["params"]:
            if only is not None and id(p) not in only:
                continue
            grad = self._grad(p)
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("PrecisionAwareAdamW does not support sparse gradients")
            state = self._init_state(p)
            state["step"] += 1
            copy = self.compute_copies.get(p)
            scales = None
            if "exp_avg_scales" in state:  # 8-bit moments
                scales = (_local(state["exp_avg_scales"]), _local(state["exp_avg_sq_scales"]))
            row = _Row(_local(p), _local(grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                       state["step"], None if copy is None else _local(copy), scales)
            buckets.setdefault((row.param.device, row.param.dtype), []).append(row)
        for (device, dtype), rows in buckets.items():
            if self._takes_triton(device, dtype):
                from .adamw_triton import (adamw_update_, adamw_update_mx_pair_, adamw_update_q8_,
                                           adamw_update_split_)

                scale = None if grad_scale is None else grad_scale.to(device)
                rest = []
                for row in rows:
                    cols, mode = self._mx_cols.get(id(row.param), (None, None))
                    lo = self._lo.get(id(row.param))
                    written = [t for t in (row.param, row.copy, cols) if t is not None] if lo is None else [row.copy, lo]
                    if not all(t.is_contiguous() for t in (*row[1:4], *written)):
                        rest.append(row)
                        continue
                    if row.scales is not None:
                        if lo is not None:
                            adamw_update_q8_(row.copy, *row[1:4], *row.scales, lo=lo, step=row.step.item(),
                                             grad_scale=scale, **hyper)
                        else:
                            adamw_update_q8_(*row[:4], *row.scales, step=row.step.item(), out_bf16=row.copy,
                                             grad_scale=scale, **hyper)
                    elif lo is not None:
                        adamw_update_split_(row.copy, lo, *row[1:4], step=row.step.item(), grad_scale=scale, **hyper)
                    elif cols is None:
                        adamw_update_(*row[:4], step=row.step.item(), out_bf16=row.copy, grad_scale=scale, **hyper)
                    else:
                        adamw_update_mx_pair_(*row[:4], rows=row.copy, cols=cols, scale_mode=mode,
                                              step=row.step.item(), grad_scale=scale, **hyper)
                    # The kernel wrote through pointers: tell autograd's version counters, as
                    # torch's in-place optimizers do (caches keyed on _version see the change).
                    for t in written:
                        torch.autograd.graph.increment_version(t)  # one tensor: every torch >= 2.1
                rows = rest
            # A bf16 gradient held on a copy (grads=True) goes through the foreach path upcast (exact),
            # before any clip scaling, so the update is the one an fp32 gradient of the same value gets.
            held = {id(copy) for copy in self._grad_copies.values()}
            rows = [row._replace(grad=row.grad.to(row.param.dtype))
                    if id(row.copy) in held and row.grad.dtype != row.param.dtype else row for row in rows]
            if grad_scale is not None and rows:
                torch._foreach_mul_([row.grad for row in rows], grad_scale.to(device, rows[0].grad.dtype))
            self._foreach_step([row for row in rows if id(row.param) not in self._lo], hyper)
            # A split master steps as its joined fp32 value, then is split again (bit for bit the same
            # update as the kernel's adamw_update_split_), one at a time: one fp32 master held at once.
            for row in rows:
                lo = self._lo.get(id(row.param))
                if lo is not None:
                    joined = join_fp32(row.copy, lo, torch.empty(row.copy.shape, device=row.copy.device))
                    self._foreach_step([row._replace(param=joined, copy=None)], hyper)
                    split_fp32(joined, row.copy, lo)
                    for t in (row.copy, lo):
                        torch.autograd.graph.increment_version(t)

    def _takes_triton(self, device: torch.device, dtype: torch.dtype) -> bool:
        if self.kernel == AdamWKernel.foreach:
            return False
        if self.kernel == AdamWKernel.auto:
            return device.type == "cuda" and dtype == torch.float32 and triton_usable(device) is None
        why = triton_usable(device) or (None if dtype == torch.float32 else
                                        f"it updates fp32 parameters, these are {dtype}")
        if why:
            raise RuntimeError(f"PrecisionAwareAdamW(kernel='triton'): {why}; use kernel='auto' or 'foreach'")
        return True

    def _foreach_step(self, rows: list[_Row], hyper: dict[str, float]) -> None:
        for row in rows:
            if row.grad.dtype != row.param.dtype:
                raise RuntimeError(f"gradient dtype {row.grad.dtype} differs from its parameter's {row.param.dtype} "
                                   f"(the foreach path needs them equal; the Triton kernel takes bf16 gradients)")
        for row in rows:
            if row.scales is not None:
                self._update_8bit(row, hyper)
        for chunk in self._chunks([row[:5] for row in rows if row.scales is None]):
            self._update(chunk, **hyper)
        with_copies = [row for row in rows if row.copy is not None]
        if with_copies:
            torch._foreach_copy_([row.copy for row in with_copies], [row.param for row in with_copies])
        self.write_mx_pairs([(row.param, row.copy) for row in with_copies if id(row.param) in self._mx_cols])

    @torch.no_grad()
    def write_mx_pairs(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The torch reference of adamw_update_mx_pair_'s outputs, for (parameter, copy) pairs with
        mx_cols whose copies hold bf16(p): the copy quantized along I in place, its mx_cols along O."""
        from .precision.mx import MX_BLOCK, dequantize_mx, quantize_mx

        for p, copy in pairs:
            cols, mode = self._mx_cols[id(p)]
            w = _local(copy)
            for out, axis in ((_local(cols), -2), (w, -1)):  # along O first: the copy is overwritten last
                data, scale = quantize_mx(w, MX_BLOCK, axis, mode)
                out.copy_(dequantize_mx(data, scale, MX_BLOCK, axis))

    def _update_8bit(self, row: _Row, hyper: dict[str, float]) -> None:
        """One AdamW update of a parameter with 8-bit moments, the torch reference of adamw_update_q8_: a
        block of whole rows (about chunk_numel elements, at least one row) at a time, its moments widened to
        fp32 (core.moments_q8.load_moments), updated with the parameter by _update, and quantized back
        (store_moments)."""
        from .moments_q8 import load_moments, store_moments

        held = row[:4]
        (ms, vs), cols = row.scales, held[0].shape[-1] if held[0].dim() else 1
        if held[0].numel() == 0:
            return
        p, g, m, v = (t if t.is_contiguous() else t.contiguous() for t in held)  # a strided one steps a copy
        per = max(1, self.chunk_numel // max(cols, 1))
        flat = [t.view(-1, cols) for t in (p, g, m, v)] + [t.view(p.numel() // cols, -1) for t in (ms, vs)]
        for start in range(0, flat[0].shape[0], per):
            pp, gg, mm, vv, mss, vss = (t[start:start + per] for t in flat)
            m32, v32 = load_moments(mm, mss, vv, vss)
            self._update([(pp, gg, m32, v32, row.step)], **hyper)
            store_moments(m32, v32, mm, mss, vv, vss, int(row.step.item()))
        for kept, stepped in ((held[0], p), (held[2], m), (held[3], v)):
            if stepped is not kept:
                kept.copy_(stepped)

    def _chunks(self, rows: list[tuple[torch.Tensor, ...]]) -> Iterable[list[tuple[torch.Tensor, ...]]]:
        """Rows packed into chunks of at most chunk_numel elements; a larger contiguous tensor is
        split into flat views of that size (the ops are elementwise, so results do not change)."""
        chunk, size = [], 0
        for p, g, m, v, step in rows:
            if p.numel() == 0:
                continue
            if p.numel() > self.chunk_numel and all(t.is_contiguous() for t in (p, g, m, v)):
                pieces = zip(*(t.view(-1).split(self.chunk_numel) for t in (p, g, m, v)))
            else:
                pieces = [(p, g, m, v)]
            for piece in pieces:
                n = piece[0].numel()
                if chunk and size + n > self.chunk_numel:
                    yield chunk
                    chunk, size = [], 0
                chunk.append((*piece, step))
                size += n
        if chunk:
            yield chunk

    def _update(self, chunk: list[tuple[torch.Tensor, ...]], lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float) -> None:
        """One AdamW update of a chunk (torch's _multi_tensor_adam, non-capturable, in the same order)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = (list(col) for col in zip(*chunk))
        compute = params[0].dtype
        low = exp_avgs[0].dtype != compute
        if low:  # fp32 working copies of this chunk's moments
            stored_avgs, stored_sqs = exp_avgs, exp_avg_sqs
            exp_avgs = [torch.empty_like(t, dtype=compute) for t in stored_avgs]
            exp_avg_sqs = [torch.empty_like(t, dtype=compute) for t in stored_sqs]
            torch._foreach_copy_(exp_avgs, stored_avgs)
            torch._foreach_copy_(exp_avg_sqs, stored_sqs)
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        if low:  # round to nearest into the stored moments; the update below uses the fp32 values
            torch._foreach_copy_(stored_avgs, exp_avgs)
            torch._foreach_copy_(stored_sqs, exp_avg_sqs)
        step_values = [step.item() for step in steps]  # CPU scalars: no device sync
        step_size = [(lr / (1 - beta1**t)) * -1 for t in step_values]
        bias_correction2_sqrt = [(1 - beta2**t) ** 0.5 for t in step_values]
        if low:  # the working copy is free now: the denominator reuses it
            denom = exp_avg_sqs
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)
