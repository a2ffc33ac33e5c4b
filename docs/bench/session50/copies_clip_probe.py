"""Session 50, call 6: why test_dense_copies_train_as_the_fp32_masters_on_gpu (and the auto test built like it) now
misses its 1e-5: three compiled steps on one batch of the tiny MoE (tests' cuda_losses_on_one_batch), the expert
copies on, the dense and head copies off / on, with the trainer's clipping (grad_clip 1.0, the default) and without
(0): the losses and the clipping norms at full precision. Run from the repo root: python3 docs/bench/session50/copies_clip_probe.py"""
import sys

import torch

sys.path.insert(0, "tools")
from step_builder import RandomTokens, build_trainer  # noqa: E402

from moetron.core.memory import MemoryConfig  # noqa: E402
from moetron.core.optim import OptimizerConfig  # noqa: E402
from moetron.core.precision import PrecisionConfig  # noqa: E402
from moetron.core.trainer import TrainerConfig  # noqa: E402
from moetron.models import ModelConfig  # noqa: E402

cfg = ModelConfig.preset("tiny-moe")
cfg.apply_overrides(["n_layers=2"])
dev = torch.device("cuda")
for clip in (1.0, 0.0):
    for dense in (False, True):
        data = RandomTokens(cfg.vocab_size, 2, 64, dev)
        precision = PrecisionConfig(recipe="bf16", expert_weight_copies="optimizer", expert_grads_bf16=True,
                                    dense_weight_copies=dense, head_weight_copy=dense)
        trainer = build_trainer(cfg, MemoryConfig(), data, dev, seq_len=64, compile=True, precision=precision,
                                optimizer=OptimizerConfig(state_dtype="bf16"), trainer=TrainerConfig(grad_clip=clip))
        batch = data.next_batch()
        out = [trainer.train_step(batch) for _ in range(3)]
        print(f"clip {clip} dense+head copies {dense}: losses {[f'{l.item():.9f}' for l, _ in out]} "
              f"norms {[f'{n.item():.9f}' for _, n in out]}", flush=True)
