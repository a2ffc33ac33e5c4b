"""Load diagnostics: per layer and per expert token counts, max violation, entropy, drops, bias.

One averaged number hides imbalance, so every layer's and every expert's load is kept: the log line
shows the worst layer, and ``moe_load.npz`` in the run dir holds the arrays for plots
(tokens_per_expert [records, layers, experts], expert_bias likewise, max_violation [records, layers]).
"""

from __future__ import annotations

import os

import numpy as np
import torch


def summarize(layer_stats: dict[int, dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    """Stack the per-layer stats of MoELayer.pop_load_stats() (one host transfer) into arrays."""
    layers = sorted(layer_stats)
    has_bias = all("expert_bias" in layer_stats[i] for i in layers)
    # Per layer [tokens_per_expert (E), dropped, entropy, expert_bias (E)?]: one stack, one copy.
    packed_L = torch.stack([
        torch.cat([s["tokens_per_expert"], s["dropped"][None], s["entropy"][None]]
                  + ([s["expert_bias"]] if has_bias else []))
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
    mean_L = tokens_LE.mean(axis=1)
    out["max_violation"] = np.where(mean_L > 0, tokens_LE.max(axis=1) / np.maximum(mean_L, 1e-9) - 1.0, 0.0)
    if has_bias:
        out["expert_bias"] = packed_L[:, E + 2:]
    return out


class LoadLog:
    """Accumulates summaries at log steps and rewrites <run_dir>/moe_load.npz (main rank only)."""

    def __init__(self, path: str | None):
        self.path = path
        self.steps: list[int] = []
        self.records: list[dict[str, np.ndarray]] = []

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
        }
