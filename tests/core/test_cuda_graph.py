"""trainer.cuda_graph (core/cuda_graph.py): the step's forward and backward captured once and replayed.

The reference is the ordinary step: a trainer with the switch must give the same losses and weights
as one without, step by step, bit for bit on the GPU (the replay runs the kernels the eager step
launches, on the same inputs), eager and compiled, with the gradients on the parameters and on the
optimizer's bf16 copies (precision.expert_grads_bf16). On the CPU: the layouts and devices it cannot
serve are refused with an error that names the fix, the benchmarks take the switch, and the replay's
host side (batch in, gradients and loss out, the replay count) runs with a stand-in for the graph.
"""

import sys
from pathlib import Path

import pytest
import torch

from moetron.core.config import ConfigError
from moetron.core.memory import MemoryConfig
from moetron.core.optim import OptimizerConfig
from moetron.core.precision import PrecisionConfig
from moetron.core.trainer import TrainerConfig
from moetron.models.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

COPIES = ["expert_weight_copies=optimizer", "expert_grads_bf16=true"]


def _trainer(device: str, cuda_graph: bool, compile: bool = False, precision: list[str] = (), overlap: bool = False,
             expert_backend: str = "grouped_mm", memory: list[str] = (), micro_batch: int | None = None):
    from step_builder import RandomTokens, build_trainer

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", f"moe.experts_backend={expert_backend}"])
    dev = torch.device(device)
    data = RandomTokens(cfg.vocab_size, 2, 32, dev)
    prec = PrecisionConfig(recipe="bf16" if dev.type == "cuda" else "fp32")
    prec.apply_overrides(list(precision))
    mem = MemoryConfig()
    mem.apply_overrides(list(memory))
    trainer = build_trainer(cfg, mem, data, dev, seq_len=32, compile=compile, precision=prec, micro_batch=micro_batch,
                            optimizer=OptimizerConfig(state_dtype="bf16", overlap=overlap),
                            trainer=TrainerConfig(cuda_graph=cuda_graph))
    return trainer, data


def _train(cuda_graph: bool, compile: bool, precision: list[str], steps: int = 6, memory: list[str] = (),
           micro_batch: int | None = None):
    torch._dynamo.reset()  # two runs a test: the second must not meet the first one's recompile limit either
    trainer, data = _trainer("cuda", cuda_graph, compile, precision, memory=memory, micro_batch=micro_batch)
    losses = [trainer.train_step(data.next_batch())[0] for _ in range(steps)]
    with trainer.masters_materialized():  # the default on one GPU holds the masters split (optimizer.split_master)
        weights = [p.detach().cpu().clone() for p in trainer.params]
    return [x.item() for x in losses], weights, trainer


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("copies", [False, True])
def test_replayed_step_equals_eager_step_on_gpu(compile, copies):
    """Six steps: two eager, the capture's step, three replays; each step's loss (the returned tensors
    are the step's own, not the graph's output buffer) and the weights after them equal the eager
    trainer's bit for bit; the batches differ every step, so a replay that kept the captured batch or
    stale gradients would differ."""
    precision = COPIES if copies else []
    off, w_off, _ = _train(False, compile, precision)
    on, w_on, trainer = _train(True, compile, precision)
    graph = trainer.step_graph
    assert graph.graph is not None and graph.replays == 4  # the capture's step is a replay too
    assert len(set(on)) == len(on)  # every step its own loss
    assert on == off
    assert all(torch.equal(a, b) for a, b in zip(w_on, w_off))
    if copies:  # the bf16 copies hold the experts' gradients: they are what the replay hands back
        holders = {id(t) for t in trainer._grad_holders}
        assert holders and holders <= {id(t) for t, _ in graph.grads}


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "mxfp8_emulated", "recompute_full"])
def test_replayed_step_equals_eager_step_for_each_recipe_on_gpu(recipe):
    """The recipes' own per-step state under the capture, compiled: native fp8_blockwise on the
    optimizer's bf16 copies (its FP8 grouped GEMMs, their host-built descriptors), mxfp8 emulated (its
    weights quantized once a step), and full activation recompute (checkpointed blocks run again in
    the backward). The same losses and weights as the eager trainer, bit for bit."""
    precision, memory = {
        "fp8_blockwise": (["recipe=fp8_blockwise", "backend=native", *COPIES], []),
        "mxfp8_emulated": (["recipe=mxfp8", "backend=emulated"], []),
        "recompute_full": ([], ["recompute=full"]),
    }[recipe]
    off, w_off, _ = _train(False, True, precision, memory=memory)
    on, w_on, trainer = _train(True, True, precision, memory=memory)
    assert trainer.step_graph.replays == 4 and len(set(on)) == len(on)
    assert on == off
    assert all(torch.equal(a, b) for a, b in zip(w_on, w_off))


@pytest.mark.gpu
def test_replayed_step_accumulates_micro_batches_on_gpu():
    """Two micro-batches a step: the graph holds both forwards and backwards, the second adding onto
    the gradients the first wrote; the same losses and weights as the eager accumulation."""
    off, w_off, _ = _train(False, True, [], micro_batch=1)
    on, w_on, trainer = _train(True, True, [], micro_batch=1)
    assert trainer.step_graph.replays == 4 and len(set(on)) == len(on)
    assert on == off
    assert all(torch.equal(a, b) for a, b in zip(w_on, w_off))


@pytest.mark.gpu
def test_replay_refuses_another_batch_shape_on_gpu():
    trainer, data = _trainer("cuda", True)
    for _ in range(3):
        trainer.train_step(data.next_batch())
    with pytest.raises(ConfigError, match=r"batches of shape \(2, 33\).*\(1, 33\).*cuda_graph=false"):
        trainer.train_step(data.next_batch()[:1])


@pytest.mark.gpu
def test_capture_names_a_host_sync_on_gpu():
    """The per-expert cuBLAS experts read the group sizes on the host: the capture fails saying so."""
    trainer, data = _trainer("cuda", True, expert_backend="grouped_mm", precision=["bf16_experts=cublas"])
    for _ in range(2):
        trainer.train_step(data.next_batch())
    with pytest.raises(RuntimeError, match="could not capture the step.*bf16_experts=cublas.*cuda_graph=false"):
        trainer.train_step(data.next_batch())


def test_replay_host_side_with_a_stand_in_graph():
    """StepGraph after its capture, the CUDA graph replaced by a stand-in that computes the step's loss
    and gradient from the captured batch buffer: each call copies its batch in before the replay, hands
    the replay's gradient buffers back as the tensors' .grad, returns a loss of its own (not the buffer
    the next replay overwrites), counts the replay (StepGraph.replays, which the GPU tests read: session
    41 removed it as unread) and refuses a batch of another shape."""
    from moetron.core.cuda_graph import StepGraph

    w, grad_buf = torch.zeros(3), torch.zeros(3)
    graph = StepGraph(lambda batch: None, [w], [], lambda: None, torch.device("cuda"), warmup_steps=1)
    graph.calls = 1  # the eager warm-up step, already taken
    graph.static_batch, graph.static_loss = torch.zeros(2, 5, dtype=torch.long), torch.zeros(())

    class Captured:
        def replay(self):
            graph.static_loss.copy_(graph.static_batch.sum())
            grad_buf.copy_(graph.static_batch[0, :3])

    graph.graph, graph.grads = Captured(), [(w, grad_buf)]
    losses = [graph(torch.full((2, 5), i)) for i in (1, 2)]
    assert [x.item() for x in losses] == [10.0, 20.0]
    assert w.grad is grad_buf and torch.equal(w.grad, torch.full((3,), 2.0))
    assert graph.replays == 2
    with pytest.raises(ConfigError, match=r"batches of shape \(2, 5\).*\(1, 5\).*cuda_graph=false"):
        graph(torch.zeros(1, 5, dtype=torch.long))
    assert graph.replays == 2


def test_cuda_graph_is_refused_on_the_cpu():
    with pytest.raises(ConfigError, match="on cpu: set trainer.cuda_graph=false"):
        _trainer("cpu", True)


def test_cuda_graph_is_refused_with_optimizer_overlap():
    with pytest.raises(ConfigError, match="cuda_graph=true and optimizer.overlap=true do not combine"):
        _trainer("cpu", True, overlap=True)


def test_cuda_graph_is_refused_for_pipelined_models():
    from moetron.core.trainer import Trainer

    trainer, data = _trainer("cpu", False)
    args = (trainer.model, None, trainer.optimizer, trainer.scheduler, data, 1.0, torch.device("cpu"))
    with pytest.raises(ConfigError, match="several ranks or stages.*set trainer.cuda_graph=false"):
        Trainer(TrainerConfig(cuda_graph=True, run_dir=""), *args, step_fn=lambda batch: batch.sum())
    with pytest.raises(ConfigError, match="several ranks or stages"):
        Trainer(TrainerConfig(cuda_graph=True, run_dir=""), *args, world_size=2)


def test_benchmarked_steps_take_the_switch_and_refuse_other_trainer_fields():
    from step_builder import step_configs

    cfgs = step_configs("tiny-moe", "auto", ["--trainer.cuda_graph=true"])
    assert cfgs.trainer.cuda_graph is True
    assert step_configs("tiny-moe", "auto", []).trainer.cuda_graph is False
    with pytest.raises(ConfigError, match=r"--trainer.steps=3.*takes only --trainer.cuda_graph"):
        step_configs("tiny-moe", "auto", ["--trainer.steps=3"])
