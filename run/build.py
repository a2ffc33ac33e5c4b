"""build(): a PretrainConfig made into a Trainer on this process's ranks (mesh, data, model,
precision, recompute, compile, parallel strategies, optimizer, schedule)."""

from __future__ import annotations

import random

import numpy as np
import torch

from moetron.core.checkpoint import Checkpointer
from moetron.core.distributed import is_main
from moetron.core.optim import OptimizerConfig
from moetron.core.precision import PrecisionConfig
from moetron.core.precision.config import copies_auto_on, copies_off_overrides, split_copies_held
from moetron.core.trainer import Trainer
from moetron.parallel import ParallelMesh, ParallelState, apply_strategies

from .config import PretrainConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_auto(precision: PrecisionConfig, optimizer: OptimizerConfig, device_type: str, *, one_rank: bool,
                 local_batch: int, micro_batch: int | None, fused_loss: bool) -> tuple[PrecisionConfig, OptimizerConfig]:
    """``precision`` and ``optimizer`` with the switches left at ``auto`` that depend on the layout resolved, for
    a run on ``one_rank`` (one process holding the whole model: ParallelConfig.one_rank) whose rank takes
    ``local_batch`` sequences a step in micro-batches of ``micro_batch`` (None: one), with the model's
    ``fused_loss``: the weight copies (core.precision.config.copies_auto_on: on for bf16 on one CUDA GPU, one
    micro-batch a step, this package's AdamW; off elsewhere) and optimizer.split_master where left at auto (its
    default: on where the copies are and the run holds copies it splits, split_copies_held). build() and
    tools/step_builder.py (the benchmarks) both ask here; the planner applies the same two rules
    (run/planner/switches.py)."""
    micro = micro_batch or local_batch
    on = copies_auto_on(precision.resolved_recipe(device_type), device_type, one_rank=one_rank,
                        micro_batches=max(1, local_batch // micro),
                        optimizer_writes_copies=optimizer.writes_copies(device_type == "cuda"), overlap=optimizer.overlap)
    resolved = precision.with_auto_copies(on)
    split = on and split_copies_held(resolved, resolved.resolved_recipe(device_type),
                                     resolved.resolved_backend(device_type), fused_loss)
    turned, undo = [], []
    if on and precision.auto_copies:
        turned.append("the optimizer's bf16 weight copies and their bf16 gradients (the values of casting at each use, "
                      "faster)")
        undo.append(f"{' '.join(copies_off_overrides())} turn the copies off")
    if split and optimizer.split_master is None:
        turned.append("the fp32 masters held split as those copies and an int16 rest (optimizer.split_master: 2 B an "
                      "element less)")
        undo.append("--optimizer.split_master=false keeps the masters whole")
    if turned and is_main():
        print(f"precision: auto (one GPU, one micro-batch a step) turned on {'; and '.join(turned)}. "
              f"{'; '.join(undo)}", flush=True)
    return resolved, optimizer.with_auto_split(split)


def build(cfg: PretrainConfig, device: torch.device, world: int, checkpointer: Checkpointer | None = None,
          **trainer_kwargs) -> tuple[Trainer, ParallelState]:
    """Compose a run: mesh, data, model, parallel strategies, optimizer, schedule, trainer.

    ``world`` is the number of ranks (torch.distributed is initialized when it is > 1);
    ``trainer_kwargs`` go to Trainer (e.g. tracker). Returns the trainer and the parallel state."""
    mesh = ParallelMesh.build(cfg.parallel, world, device.type)
    data = cfg.data.build(vocab_size=cfg.model.vocab_size, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size,
                          pin_memory=device.type == "cuda")  # the trainer's non_blocking copy is then async
    seed_everything(cfg.trainer.seed)
    model = cfg.model.build(device=device)  # identical on every rank: same seed
    precision, optimizer = resolve_auto(cfg.precision, cfg.optimizer, device.type, one_rank=cfg.parallel.one_rank(world),
                                        local_batch=data.local_batch_size, micro_batch=cfg.trainer.micro_batch_size,
                                        fused_loss=cfg.model.fused_loss)
    cfg = cfg.replace(precision=precision, optimizer=optimizer)
    precision = cfg.precision.build(device)
    precision.apply(model)  # the GEMM backend of every linear and of the experts
    cfg.memory.apply(model)  # activation recompute, before compile and the strategies wrap blocks
    if is_main():
        print(f"run {cfg.name}: {cfg.model.describe()}, {world} rank(s) on {device.type}, {mesh.describe()}",
              flush=True)
    if cfg.trainer.compile:
        model.compile_modules()
    state = ParallelState(
        # loss_fn None: the model's LM head computes the loss from the labels (fused and chunked
        # unless model.fused_loss=false), in the trainer and on the last pipeline stage alike.
        [model], mesh, mesh.cfg, cfg.model, device, precision=precision, loss_fn=None,
        seq_len=cfg.data.seq_len, local_batch_size=data.local_batch_size,
    )
    apply_strategies(state)
    if is_main():
        print(f"parallel strategies applied: {state.applied or 'none'}", flush=True)
        if state.ep_dispatch is not None:
            print(f"expert-parallel dispatch: {state.ep_dispatch}", flush=True)
    parts = state.model_parts
    optimizer = cfg.optimizer.build(parts[0] if len(parts) == 1 else torch.nn.ModuleList(parts))
    scheduler = cfg.scheduler.build(optimizer, cfg.trainer.steps)
    trainer = Trainer(
        cfg.trainer,
        parts,
        None,  # model(inputs, labels) -> loss
        optimizer,
        scheduler,
        data,
        flops_per_token=cfg.model.flops_per_token(cfg.data.seq_len),
        device=device,
        checkpointer=checkpointer,
        run_metadata={"config": cfg.to_dict()},
        world_size=world,
        step_fn=state.step_fn,
        eval_fn=state.eval_fn,
        grad_norm_groups=state.grad_norm_groups,
        precision=precision,
        grad_sync=state.grad_sync,
        overlap_optimizer=cfg.optimizer.overlap,
        triton_grad_norm=cfg.optimizer.triton_grad_norm,
        **trainer_kwargs,
    )
    return trainer, state
