"""Experiment tracking: TensorBoard event files and Weights & Biases runs beside metrics.jsonl.

Both are optional dependencies (``pip install moetron[track]``). The Trainer hands the
:class:`Tracker` each record it writes to metrics.jsonl, with the MoE load summary of that log step
(core/moe/metrics.py ``summarize``): both are already on the host, so tracking adds no host sync to
the step. Only the main rank writes. Every scalar of the record goes out under its metrics.jsonl
name; the per-layer load goes out as ``moe/layer{i}/max_violation``, ``.../entropy``,
``.../dropped_frac``, ``.../lb_loss``, ``.../z_loss``, one ``moe/layer{i}/expert_share/e{j}``
per expert, and a histogram ``moe/layer{i}/expert_share`` of the experts' shares.

Legend: L MoE layers, E experts.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from typing import Any

import numpy as np

from .config import Config, ConfigError, StrEnum
from .distributed import is_main
from .moe.metrics import expert_share


class WandbMode(StrEnum):
    off = "off"
    """No Weights & Biases run."""
    online = "online"
    """Stream to the W&B server (needs network and a login: ``wandb login`` or WANDB_API_KEY)."""
    offline = "offline"
    """Write the run under <run_dir>/wandb only (no network); ``wandb sync <dir>`` uploads it later."""

    @classmethod
    def _missing_(cls, value: object) -> "WandbMode | None":
        # YAML reads a bare `off` (--logging.wandb=off) as false.
        return cls.off if value is False else None


# What each backend imports, and what to install when it is missing.
_NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def _require(setting: str, module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"{setting} needs the {package} package, which is not installed: pip install {package} "
            f"(or pip install 'moetron[track]' for tensorboard, wandb and matplotlib)"
        ) from None


@dataclasses.dataclass
class LoggingConfig(Config):
    """Where the metrics go besides the console and <run_dir>/metrics.jsonl."""

    tensorboard: bool = False
    """Write TensorBoard event files under <run_dir>/tb (``tensorboard --logdir <run_dir>/tb``)."""
    wandb: WandbMode = WandbMode.off
    """Weights & Biases: off, online, or offline (files under <run_dir>/wandb, no network)."""
    wandb_project: str = "moetron"
    """The W&B project of the run."""
    wandb_name: str | None = None
    """The W&B run name; None = the run's ``name``."""
    wandb_tags: list[str] = dataclasses.field(default_factory=list)
    """W&B tags, e.g. --logging.wandb_tags=[moe,ablation]."""
    expert_scalars: bool = True
    """One scalar per layer and expert (``moe/layer{i}/expert_share/e{j}``); with hundreds of
    experts over tens of layers switch it off and keep the per-layer histogram."""

    def validate(self) -> None:
        if self.wandb != WandbMode.off and not self.wandb_project:
            raise ConfigError("logging.wandb_project must not be empty when logging.wandb is on")

    def build(self, run_dir: str, run_name: str, run_config: dict[str, Any] | None = None) -> "Tracker":
        """A Tracker for this run. Checks on every rank that the asked-for packages import (one
        ConfigError naming what to install); the writers open at the first record, main rank only."""
        self.validate()
        if self.tensorboard:
            _require("logging.tensorboard=true", *_NEEDS["tensorboard"])
        if self.wandb != WandbMode.off:
            _require(f"logging.wandb={self.wandb}", *_NEEDS["wandb"])
        return Tracker(self, run_dir, run_name, run_config or {})


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers as metrics.jsonl holds them: NaN/inf (null there) and the step left out."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def layer_scalars(moe: dict[str, np.ndarray], expert_scalars: bool = True) -> dict[str, float]:
    """Per-layer load scalars of one summary (``summarize``'s arrays): name -> value."""
    total_L = np.asarray(moe["tokens_per_expert"], dtype=np.float64).sum(axis=1)
    share_LE = expert_share(moe["tokens_per_expert"])
    out = {}
    for row, layer in enumerate(np.asarray(moe["layers"]).tolist()):
        prefix = f"moe/layer{layer}"
        out[f"{prefix}/max_violation"] = float(moe["max_violation"][row])
        out[f"{prefix}/entropy"] = float(moe["entropy"][row])
        out[f"{prefix}/dropped_frac"] = float(moe["dropped"][row] / total_L[row]) if total_L[row] else 0.0
        for name in ("lb_loss", "z_loss"):
            if name in moe:
                out[f"{prefix}/{name}"] = float(moe[name][row])
        if expert_scalars:
            for e, share in enumerate(share_LE[row]):
                out[f"{prefix}/expert_share/e{e}"] = float(share)
    return out


def expert_shares(moe: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``moe/layer{i}/expert_share`` -> that layer's shares of the tokens [E] (for histograms)."""
    share_LE = expert_share(moe["tokens_per_expert"])
    return {f"moe/layer{layer}/expert_share": share_LE[row]
            for row, layer in enumerate(np.asarray(moe["layers"]).tolist())}


class Tracker:
    """Sends each log record to the configured writers (main rank; a no-op elsewhere or when off)."""

    def __init__(self, cfg: LoggingConfig, run_dir: str, run_name: str, run_config: dict[str, Any]):
        self.cfg, self.run_dir, self.run_name, self.run_config = cfg, run_dir, run_name, run_config
        self.enabled = is_main() and bool(run_dir) and (cfg.tensorboard or cfg.wandb != WandbMode.off)
        self._tb = None
        self._wandb_run = None

    def _open(self, first_step: int) -> None:
        if self.cfg.tensorboard and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the events of steps a resumed run trains again (as metrics.jsonl drops them).
            self._tb = SummaryWriter(os.path.join(self.run_dir, "tb"), purge_step=first_step)
        if self.cfg.wandb != WandbMode.off and self._wandb_run is None:
            import wandb

            os.makedirs(self.run_dir, exist_ok=True)
            self._wandb_run = wandb.init(
                project=self.cfg.wandb_project, name=self.cfg.wandb_name or self.run_name,
                tags=list(self.cfg.wandb_tags) or None, dir=self.run_dir, mode=str(self.cfg.wandb),
                config=self.run_config,
            )

    def log(self, record: dict[str, Any], moe: dict[str, np.ndarray] | None = None) -> None:
        """Write one record (a metrics.jsonl row) and, at MoE log steps, that step's load summary."""
        if not self.enabled:
            return
        step = int(record["step"])
        self._open(step)
        scalars = _scalars(record)
        if moe is not None:
            scalars.update(layer_scalars(moe, self.cfg.expert_scalars))
        histograms = expert_shares(moe) if moe is not None else {}
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, step)
            for name, values in histograms.items():
                self._tb.add_histogram(name, values, step)
            self._tb.flush()  # a log step's cost: the events are readable while the run goes on
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.log(dict(scalars, **{k: wandb.Histogram(v) for k, v in histograms.items()}), step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
