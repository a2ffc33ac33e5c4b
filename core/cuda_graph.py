"""trainer.cuda_graph: the step's forward and backward captured once in a CUDA graph and replayed.

A compiled step still launches every kernel from the host: thousands a step, each a few to a few
hundred microseconds of Python, dispatch and launch (docs/performance.md: the FP8 grouped GEMMs
about 0.3 ms of host time each), so a step with short kernels waits on the host. A CUDA graph
launches the whole forward and backward of every micro-batch with one call. What makes it possible
is a step with static shapes and no host syncs: the MoE routing runs on the GPU (token counts stay
device tensors; the grouped GEMMs take device offsets), the loss and grad norm stay on the device,
and the MoE statistics are accumulated in place (core/moe/layer.py).

What is captured: ``fwd_bwd(batch) -> loss`` (the trainer's micro-batch loop: forward, loss,
backward). What is not: clipping, the optimizer step, the schedule and the expert-bias update: they
read host values that change every step (the learning rate, the step count) and launch a few dozen
kernels that the host enqueues while the GPU replays the graph. The gradients the captured backward
writes live in the graph's private memory pool at fixed addresses; after each replay they are put
back on their tensors' ``.grad`` (the optimizer's ``zero_grad(set_to_none=True)`` drops them).

The capture happens at the ``warmup_steps + 1``-th call, after that many ordinary steps (torch.compile
compiles, Triton autotunes and the lazily made state exists by then): one more forward and backward
runs on the capture's side stream first (per-stream state such as cuBLAS workspaces is made outside
the capture; its gradients are dropped and the modules' buffers, the MoE statistics, restored), the
per-step weight caches are dropped (a capture that hit a cache would bake that step's weights into
every replay), then the step is captured and replayed. The batch is copied into a fixed input tensor
before each replay: every later batch must have the first one's shape.

Refused where it cannot run (Trainer checks): off CUDA, with several ranks (collectives inside the
capture are not supported here), under a pipeline schedule, with optimizer.overlap. A capture that
meets a host sync (a backend that splits experts on the host: precision.bf16_experts=cublas, the
cuBLAS FP8 experts) fails with an error that says so.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch
from torch import nn

from .config import ConfigError

__all__ = ["StepGraph"]


class StepGraph:
    """``fwd_bwd(batch_on_device) -> loss`` run eagerly for the first ``warmup_steps`` calls, then
    captured and replayed (see the module docstring). ``grad_tensors``: every tensor whose ``.grad``
    the step reads (parameters and gradient holders); ``modules``: whose buffers the capture's warm-up
    pass restores; ``drop_caches()``: forgets per-step weight caches (PrecisionPolicy.after_optimizer_step).
    ``replays``: the steps run from the graph, the capture's own included (the GPU tests read it to tell
    a replayed step from an eager one: equal losses alone would not)."""

    def __init__(self, fwd_bwd: Callable[[torch.Tensor], torch.Tensor], grad_tensors: list[torch.Tensor],
                 modules: list[nn.Module], drop_caches: Callable[[], None], device: torch.device,
                 warmup_steps: int = 2):
        if device.type != "cuda":
            raise ConfigError(f"trainer.cuda_graph=true captures the step in a CUDA graph, and this run is on "
                              f"{device}: set trainer.cuda_graph=false")
        if warmup_steps < 1:
            raise ConfigError(f"trainer.cuda_graph needs at least one eager step before the capture, "
                              f"got {warmup_steps}")
        self.fwd_bwd, self.grad_tensors, self.modules = fwd_bwd, grad_tensors, modules
        self.drop_caches, self.device, self.warmup_steps = drop_caches, device, warmup_steps
        self.graph: torch.cuda.CUDAGraph | None = None
        self.calls = 0
        self.replays = 0
        self.static_batch: torch.Tensor | None = None
        self.static_loss: torch.Tensor | None = None
        self.grads: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """One step's forward and backward over ``batch`` [B, S+1]; the loss (a fresh 0-dim tensor)."""
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup_steps:
            return self.fwd_bwd(batch.to(self.device, non_blocking=True))
        if self.graph is None:
            self._capture(batch)
        elif batch.shape != self.static_batch.shape:
            raise ConfigError(f"trainer.cuda_graph=true replays the step captured for batches of shape "
                              f"{tuple(self.static_batch.shape)}, and this one is {tuple(batch.shape)}: keep the "
                              f"batch shape fixed or set trainer.cuda_graph=false")
        self.static_batch.copy_(batch, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        for t, grad in self.grads:
            t.grad = grad
        return self.static_loss.clone()  # the next replay overwrites static_loss

    def _capture(self, batch: torch.Tensor) -> None:
        self.static_batch = batch.to(self.device).clone()  # outside the graph's pool: lives across steps
        # The buffers' snapshot is taken on the current stream before the side stream starts: it must
        # not read them while the warm-up pass below adds to them.
        saved = [(buf, buf.clone()) for m in self.modules for buf in m.buffers()]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.fwd_bwd(self.static_batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)
        del saved
        for t in self.grad_tensors:
            t.grad = None  # the captured backward then writes (not adds) every gradient, in its pool
        self.drop_caches()
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()  # the eager steps' cached blocks: the pool cannot use them
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a data loader thread's CUDA calls (pinned copies) are not part of the capture.
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self.static_loss = self.fwd_bwd(self.static_batch)
        except Exception as e:
            raise RuntimeError(
                f"trainer.cuda_graph=true could not capture the step in a CUDA graph ({type(e).__name__}: {e}). "
                f"A captured step may not sync the host (.item(), .tolist(), shapes read from device values) nor "
                f"copy from pageable host memory; precision.bf16_experts=cublas and the cuBLAS FP8 experts split "
                f"the experts on the host. Use the grouped expert GEMMs or set trainer.cuda_graph=false"
            ) from e
        self.graph = graph
        self.grads = [(t, t.grad) for t in self.grad_tensors if t.grad is not None]
        self.drop_caches()  # the capture's cached weights are graph memory: the next eager forward makes its own
