"""Load diagnostics: per layer and per expert token counts, max violation, entropy, drops, bias.

One averaged number hides imbalance, so every layer's and every expert's load is kept: the log line
shows the worst layer, and ``moe_load.npz`` in the run dir holds the arrays for plots
(tokens_per_expert [records, layers, experts], expert_bias likewise, max_violation [records, layers],
and each aux loss per layer, lb_loss / z_loss [records, layers]). The aux losses logged as
``lb_loss`` / ``z_loss`` are these per-layer values summed over layers.
"""

from __future__ import annotations

import os

import numpy as np
import torch

AUX_LOSSES = ("lb_loss", "z_loss")
"""The MoE layers' auxiliary losses, as named in pop_load_stats() and the logs."""


def summarize(layer_stats: dict[int, dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    """Stack the per-layer stats of MoELayer.pop_load_stats() (one host transfer) into arrays."""
    layers = sorted(layer_stats)
    has_bias = all("expert_bias" in layer_stats[i] for i in layers)
    aux = [name for name in AUX_LOSSES if all(name in layer_stats[i] for i in layers)]
    # Per layer [tokens_per_expert (E), dropped, entropy, aux losses, expert_bias (E)?]: one stack, one copy.
    packed_L = torch.stack([
        torch.cat([s["tokens_per_expert"], s["dropped"][None], s["entropy"][None]]
                  + [s[name][None] for name in aux] + ([s["expert_bias"]] if has_bias else []))
        for s in (layer_stats[i] for i in layers)
    ]).cpu().numpy()
    E = layer_stats[layers[0]]["tokens_per_expert"].numel()
    tokens_LE = packed_L[:, :E]
    out = {
        "layers": np.array(layers),
        "tokens_per_expert": tokens_LE,
        "dropped": packed_L[:, E],
        "entropy": packed_L[:, E + 1],
    }
    for j, name in enumerate(aux):
        out[name] = packed_L[:, E + 2 + j]
    mean_L = tokens_LE.mean(axis=1)
    out["max_violation"] = np.where(mean_L > 0, tokens_LE.max(axis=1) / np.maximum(mean_L, 1e-9) - 1.0, 0.0)
    if has_bias:
        out["expert_bias"] = packed_L[:, E + 2 + len(aux):]
    return out


class LoadLog:
    """Accumulates summaries at log steps and rewrites <run_dir>/moe_load.npz (main rank only).

    A resumed run calls :meth:`resume` first, so the file keeps the steps before the resume too."""

    def __init__(self, path: str | None):
        self.path = path
        self.steps: list[int] = []
        self.records: list[dict[str, np.ndarray]] = []

    def resume(self, step: int) -> None:
        """Take over the records of an existing moe_load.npz up to ``step`` (the resumed step):
        the steps after it are trained again and re-recorded."""
        if not self.path or not os.path.exists(self.path):
            return
        with np.load(self.path) as saved:
            arrays = {k: saved[k] for k in saved.files}
        steps, layers = arrays.pop("step").tolist(), arrays.pop("layers")
        keep = [i for i, s in enumerate(steps) if s <= step]
        self.steps = [int(steps[i]) for i in keep]
        self.records = [dict({k: v[i] for k, v in arrays.items()}, layers=layers) for i in keep]

    def add(self, step: int, summary: dict[str, np.ndarray]) -> dict[str, float]:
        self.steps.append(step)
        self.records.append(summary)
        if self.path:
            arrays = {k: np.stack([r[k] for r in self.records]) for k in summary if k != "layers"}
            tmp = self.path + ".tmp.npz"
            np.savez(tmp, step=np.array(self.steps), layers=summary["layers"], **arrays)
            os.replace(tmp, self.path)
        worst = int(np.argmax(summary["max_violation"]))
        total = summary["tokens_per_expert"].sum()
        return {
            "moe_max_violation": float(summary["max_violation"].max()),
            "moe_max_violation_layer": int(summary["layers"][worst]),
            "moe_mean_violation": float(summary["max_violation"].mean()),
            "moe_entropy": float(summary["entropy"].mean()),
            "moe_dropped_frac": float(summary["dropped"].sum() / total) if total else 0.0,
            **{name: float(summary[name].sum()) for name in AUX_LOSSES if name in summary},
        }


def expert_share(tokens_LE: np.ndarray) -> np.ndarray:
    """Each expert's share of its layer's routed tokens [L, E] (a layer with no tokens: zeros)."""
    tokens_LE = np.asarray(tokens_LE, dtype=np.float64)
    return tokens_LE / np.maximum(tokens_LE.sum(axis=-1, keepdims=True), 1e-12)


def starved_experts(tokens_LE: np.ndarray, share_of_fair: float) -> np.ndarray:
    """Which experts got less than ``share_of_fair`` x the fair share (1/E) of their layer's
    tokens: bool [L, E]. Dead experts (no tokens at all) are starved too; a layer that routed
    nothing has none."""
    tokens_LE = np.asarray(tokens_LE, dtype=np.float64)
    routed_L = tokens_LE.sum(axis=-1, keepdims=True) > 0
    return (expert_share(tokens_LE) < share_of_fair / tokens_LE.shape[-1]) & routed_L


ALERT_LISTED_EXPERTS = 16
"""A starved-expert alert names at most this many experts (and says how many there are)."""


class StarvedExpertWatch:
    """Per layer and expert, the consecutive log steps spent under ``share_of_fair`` x the fair
    share. A layer raises an alert when one of its experts' streaks reaches ``log_steps`` and again
    every ``log_steps`` log steps while it lasts: the averaged balance metrics can look fine while
    some experts get (almost) nothing. Works on the host summary of each log step (no sync)."""

    def __init__(self, share_of_fair: float, log_steps: int):
        self.share_of_fair, self.log_steps = share_of_fair, log_steps
        self.streak_LE: np.ndarray | None = None

    def update(self, step: int, summary: dict[str, np.ndarray]) -> list[str]:
        """Count this log step's summary (``summarize``'s arrays); returns the alert lines, one per layer."""
        if self.share_of_fair <= 0:
            return []
        tokens_LE = summary["tokens_per_expert"]
        starved_LE = starved_experts(tokens_LE, self.share_of_fair)
        if self.streak_LE is None or self.streak_LE.shape != starved_LE.shape:
            self.streak_LE = np.zeros(starved_LE.shape, dtype=np.int64)
        self.streak_LE = np.where(starved_LE, self.streak_LE + 1, 0)
        share_LE = expert_share(tokens_LE)
        E = tokens_LE.shape[-1]
        lines = []
        for row, layer in enumerate(np.asarray(summary["layers"]).tolist()):
            streak_E = self.streak_LE[row]
            if not ((streak_E >= self.log_steps) & (streak_E % self.log_steps == 0)).any():
                continue
            experts = np.flatnonzero(streak_E >= self.log_steps).tolist()
            listed = experts[:ALERT_LISTED_EXPERTS]  # a bounded line: 128 starved experts would fill a screen
            shares = ", ".join(f"{share_LE[row, e]:.4f}" for e in listed)
            which = ", ".join(map(str, listed))
            if len(experts) > len(listed):
                which = f"{len(experts)} of {E} ({which}, ...; every one in the run's moe_load.npz)"
                shares += ", ..."
            lines.append(
                f"alert: step {step}: layer {layer}: expert(s) {which} got under "
                f"{self.share_of_fair:g} x the fair share (1/{E}) of the tokens for {int(streak_E[experts].min())}+ "
                f"consecutive log steps (shares now {shares}); the averaged balance metrics hide this "
                f"(tools/plot.py RUN_DIR draws every layer's load)"
            )
        return lines
