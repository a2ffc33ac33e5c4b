"""The pipeline with the LM head's own loss (state.loss_fn None, as tools/pretrain.py runs it): the
last stage returns the normed hidden and its LM head computes the fused, chunked loss. Oracle: the
single-process run with the plain loss over full logits (tests/parallel/test_pipeline.py's
reference): same losses, aux losses, grad norm and parameters after AdamW steps, and eval loss,
in float64, the loss' gradients computed at the micro-batch's declared weight (FSDP2 under the
pipeline with the head's loss: tests/parallel/test_equivalence.py's pp
layouts, which run through tools/pretrain.py's build()).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.distributed import run_distributed  # noqa: E402
from tests.parallel.test_pipeline import (  # noqa: E402
    ATOL, RTOL, _assert_matches, _eval_losses, _model, _model_cfg, _reference, _train,
)

from moetron.core.config import ConfigError  # noqa: E402
from moetron.parallel.config import ParallelConfig  # noqa: E402
from moetron.parallel.mesh import ParallelMesh  # noqa: E402
from moetron.parallel.pipeline import PipelineParallel  # noqa: E402
from moetron.parallel.registry import ParallelState  # noqa: E402

CHUNK = 7
"""Tokens per loss chunk: a micro-batch's 2 x 16 tokens split unevenly."""


def _apply_head_loss(cfg: ParallelConfig, world_size: int) -> ParallelState:
    model = _model()
    model.lm_head.chunk_tokens = CHUNK
    assert model.lm_head.fused
    mesh = ParallelMesh.build(cfg, world_size, "cpu")
    state = ParallelState([model], mesh, mesh.cfg, _model_cfg(), device=torch.device("cpu"), loss_fn=None)
    strategy = PipelineParallel()
    strategy.validate(state)
    strategy.apply(state)
    return state


def _check(rank: int, world_size: int, schedule: str, stages_per_rank: int, n_micro: int):
    # float64: the fused loss sums in another order than F.cross_entropy; in fp32 AdamW's
    # normalised update would magnify that (1e-7) on near-zero gradients past a tight tolerance.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _check_float64(rank, world_size, schedule, stages_per_rank, n_micro)
    finally:
        torch.set_default_dtype(default)


def _check_float64(rank: int, world_size: int, schedule: str, stages_per_rank: int, n_micro: int):
    cfg = ParallelConfig(pp=world_size, dp_shard=1, pp_schedule=schedule, pp_stages_per_rank=stages_per_rank,
                         pp_microbatches=n_micro, strategies=["pipeline"])
    state = _apply_head_loss(cfg, world_size)
    last = [s for s in state.model_parts if s.lm_head is not None]
    assert all(s.head_loss for s in state.model_parts)
    _, losses, aux0, gnorm0 = _train(state)
    ref_model, _, ref_losses, ref_aux0, ref_gnorm0 = _reference(n_micro)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    assert aux0 == pytest.approx(ref_aux0, rel=RTOL)
    assert gnorm0 == pytest.approx(ref_gnorm0, rel=RTOL)
    _assert_matches(state.model_parts, ref_model, f"rank {rank}, head loss, {schedule}", rtol=1e-9, atol=1e-12)
    loss, ref = _eval_losses(state, ref_model)
    torch.testing.assert_close(loss, ref.float(), rtol=RTOL, atol=ATOL)  # the pipeline shares the loss in fp32
    if last and last[0].embed is None:  # the last stage stops at the final norm: its output is [b, S, D]
        with torch.no_grad():
            assert last[0](torch.randn(2, 16, _model_cfg().d_model)).shape == (2, 16, _model_cfg().d_model)


@pytest.mark.parametrize("schedule,stages_per_rank", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_one_process_head_loss_matches_plain_run(schedule, stages_per_rank):
    _check(0, 1, schedule, stages_per_rank, 4)


def test_the_schedule_declares_each_micro_batch_weight_to_the_fused_loss(monkeypatch):
    """The pipeline divides each micro-batch's loss by their number and declares that weight
    (core.layers.loss.loss_weight), so the head's fused loss computes its gradients at it
    (model.fused_loss_prescale; its backward checks the gradient it receives is that weight); the
    float64 oracle above still holds for the run."""
    from moetron.core.layers import loss as L

    seen = []
    declared = L.declared_loss_weight
    monkeypatch.setattr(L, "declared_loss_weight", lambda: seen.append(declared()) or seen[-1])
    _check(0, 1, "1f1b", 1, 4)
    assert seen and set(seen) == {0.25}


@pytest.mark.parametrize("schedule,stages_per_rank", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)])
def test_pp2_head_loss_matches_plain_run(schedule, stages_per_rank):
    run_distributed(_check, 2, schedule, stages_per_rank, 4)


def test_head_loss_needs_an_lm_head_that_takes_labels():
    model = _model()
    model.lm_head = torch.nn.Linear(32, 64, bias=False)
    cfg = ParallelConfig(pp=1, dp_shard=1, strategies=["pipeline"])
    state = ParallelState([model], ParallelMesh.build(cfg, 1, "cpu"), cfg, _model_cfg(), loss_fn=None)
    with pytest.raises(ConfigError, match="computes the loss itself"):
        PipelineParallel().validate(state)
