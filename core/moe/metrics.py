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
