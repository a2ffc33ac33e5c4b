"""One training step as the benchmarks build it: model, precision, memory, AdamW, Trainer, and the
token stream it trains on (random ids, or the embedded corpus so routing sees real text).

tools/bench_train.py, tools/bench_memory.py and tools/profile_step.py build their step here, so the
three measure the same thing. Like every tools/ script this is imported by file name (see
tools/cli.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import NamedTuple, Protocol

import torch

from moetron.core.config import ConfigError
from moetron.core.memory import MemoryConfig
from moetron.core.optim import OptimizerConfig, SchedulerConfig
from moetron.core.precision import PrecisionConfig
from moetron.core.trainer import Trainer, TrainerConfig, use_deterministic
from moetron.data.loader import DataConfig
from moetron.models import ModelConfig
from moetron.run.build import resolve_auto


class RandomTokens:
    """Uniform random ids [batch, seq_len + 1] over the vocabulary, seeded (routing near uniform)."""

    def __init__(self, vocab: int, batch: int, seq_len: int, device):
        self.vocab, self.batch, self.seq_len, self.device = vocab, batch, seq_len, device
        self.gen = torch.Generator(device=device).manual_seed(0)

    @property
    def local_batch_size(self) -> int:
        return self.batch

    def next_batch(self) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), device=self.device, generator=self.gen)

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


class TokenStream(Protocol):
    """What the trainer reads: ``next_batch()`` -> LongTensor [batch, seq_len + 1], ``local_batch_size`` its batch."""

    local_batch_size: int

    def next_batch(self) -> torch.Tensor: ...


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say which step to build (the rest of the command line is --model.*,
    --memory.*, --optimizer.*, --precision.*, --trainer.cuda_graph / grad_clip and, with --real-text,
    --data.* overrides)."""
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each block and the final norm, as the trainer does")
    parser.add_argument("--real-text", action="store_true",
                        help="train on the embedded corpus (data-dependent routing) instead of random token ids")


def split_overrides(overrides: list[str], sections: tuple[str, ...]) -> dict[str, list[str]]:
    """``['--model.n_layers=2', '--memory.recompute=full']`` -> ``{'model': ['n_layers=2'], 'memory':
    ['recompute=full']}`` for each of ``sections``; an argument of any other section is a ConfigError."""
    out: dict[str, list[str]] = {s: [] for s in sections}
    for arg in overrides:
        section, dot, field = arg.removeprefix("--").partition(".")
        if not arg.startswith("--") or not dot or section not in out:
            allowed = ", ".join(f"--{s}.*" for s in sections)
            raise ConfigError(f"unrecognized argument {arg!r}: overrides are {allowed}")
        out[section].append(field)
    return out


STEP_SECTIONS = ("model", "memory", "optimizer", "precision")
"""The config sections a benchmarked step takes overrides for (--<section>.<field>=value); beside them
--trainer.* for the fields of STEP_TRAINER_FIELDS."""

STEP_TRAINER_FIELDS = ("cuda_graph", "grad_clip", "deterministic")
"""The TrainerConfig fields that change a benchmarked step (the rest are the run's: steps, logging, ...)."""


class StepConfigs(NamedTuple):
    model: ModelConfig
    memory: MemoryConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    data: list[str]
    """--data.* overrides (for token_stream with real text)."""
    trainer: TrainerConfig
    """--trainer.* overrides (STEP_TRAINER_FIELDS) on the defaults, for build_trainer."""


def step_trainer(fields: list[str]) -> TrainerConfig:
    """The TrainerConfig of a benchmarked step: the defaults with its --trainer.* overrides (``fields``:
    ``['deterministic=true', ...]``, STEP_TRAINER_FIELDS only; another is a ConfigError), validated. step_configs
    and the planner's replay of a bench row (tools/plan.py bench_plan) both read them here."""
    other = [o for o in fields if o.partition("=")[0] not in STEP_TRAINER_FIELDS]
    if other:
        raise ConfigError(f"{['--trainer.' + o for o in other]}: a benchmarked step takes only "
                          f"{', '.join('--trainer.' + f for f in STEP_TRAINER_FIELDS)}")
    trainer = TrainerConfig()
    trainer.apply_overrides(fields)
    trainer.validate()
    return trainer


def step_configs(preset: str, precision: str, overrides: list[str], real_text: bool = False) -> StepConfigs:
    """The configs of a benchmarked step: ``preset``'s model, the default memory, optimizer and
    precision (recipe ``precision``) configs, each with its section's ``overrides``
    (``['--model.n_layers=2', '--optimizer.state_dtype=bf16', ...]``; another section is a
    ConfigError), validated; --data.* ones only with ``real_text``. One path for tools/bench_train.py,
    bench_memory.py and profile_step.py."""
    sections = split_overrides(overrides, STEP_SECTIONS + ("data", "trainer"))
    if sections["data"] and not real_text:
        raise ConfigError(f"{['--data.' + o for o in sections['data']]} only apply with --real-text")
    trainer = step_trainer(sections["trainer"])
    model, memory, optimizer = ModelConfig.preset(preset), MemoryConfig(), OptimizerConfig()
    precision_cfg = PrecisionConfig(recipe=precision)
    for name, cfg in zip(STEP_SECTIONS, (model, memory, optimizer, precision_cfg)):
        cfg.apply_overrides(sections[name])
        cfg.validate()
    return StepConfigs(model, memory, optimizer, precision_cfg, sections["data"], trainer)


def token_stream(model_cfg: ModelConfig, batch: int, seq_len: int, device: torch.device, real_text: bool = False,
                 data_overrides: list[str] = ()) -> TokenStream:
    """Random ids over the whole vocabulary, or (``real_text``) the embedded corpus cut into
    ``batch`` sequences of ``seq_len`` (built on first use; its tokenizer's vocabulary is the
    model's or 4096, whichever is smaller, unless ``data_overrides`` say otherwise)."""
    if not real_text:  # (step_configs refuses --data.* overrides without real text)
        return RandomTokens(model_cfg.vocab_size, batch, seq_len, device)
    data = DataConfig(seq_len=seq_len, global_batch_size=batch,
                      corpus_vocab_size=min(model_cfg.vocab_size, DataConfig.corpus_vocab_size))
    data.apply_overrides(list(data_overrides))
    return data.build(model_cfg.vocab_size, pin_memory=device.type == "cuda")


def build_trainer(model_cfg: ModelConfig, memory: MemoryConfig, data: TokenStream, device: torch.device, *,
                  seq_len: int, precision: str | PrecisionConfig = "auto", compile: bool = False,
                  micro_batch: int | None = None, optimizer: OptimizerConfig | None = None,
                  trainer: TrainerConfig | None = None) -> Trainer:
    """The Trainer of tools/bench_train.py: the model built on ``device`` (seed 0), the precision
    recipe and memory config applied, each block and the final norm compiled if ``compile``, AdamW
    with a constant learning rate (``optimizer``: its settings, default OptimizerConfig()), the
    Trainer configured by ``trainer`` (default TrainerConfig(); its steps, micro-batch and run dir set
    here); ``trainer.train_step(data.next_batch())`` runs one step."""
    torch.manual_seed(0)
    model = model_cfg.build(device=device)
    optim_cfg = optimizer or OptimizerConfig()
    precision_cfg, optim_cfg = resolve_auto(precision if isinstance(precision, PrecisionConfig) else PrecisionConfig(recipe=precision),
                                            optim_cfg, device.type, one_rank=True, local_batch=data.local_batch_size,
                                            micro_batch=micro_batch, fused_loss=model_cfg.fused_loss)
    recipe = precision_cfg.build(device)
    recipe.apply(model)
    memory.apply(model)
    if compile:
        model.compile_modules()
    optimizer = optim_cfg.build(model)
    scheduler = SchedulerConfig(warmup_steps=0).build(optimizer, 10_000)
    tcfg = dataclasses.replace(trainer or TrainerConfig(), steps=10_000, micro_batch_size=micro_batch, run_dir="")
    if not tcfg.deterministic:  # the flag is the process's: a variant after a deterministic one turns it off (the
        use_deterministic(False)  # Trainer turns it on where trainer.deterministic asks)
    return Trainer(tcfg, model, None, optimizer, scheduler, data,
                   model_cfg.flops_per_token(seq_len), device, precision=recipe, overlap_optimizer=optim_cfg.overlap,
                   triton_grad_norm=optim_cfg.triton_grad_norm)
