"""Throughput accounting: model FLOPs per device per second and MFU, plus a JSONL metrics log."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, from the vendors' datasheets.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "B200": 2250.0,
    "B300": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
}


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """The device's dense bf16 peak; None where unknown (the CPU), so MFU is not made up."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def model_tflops_per_device(flops_per_token: float, tokens: int, seconds: float, world_size: int) -> float:
    return flops_per_token * tokens / max(seconds, 1e-12) / world_size / 1e12


def mfu(tflops: float, peak: float | None) -> float:
    return tflops / peak if peak else math.nan


class MetricsLog:
    """Appends one JSON object per record to <run_dir>/metrics.jsonl (main rank only)."""

    def __init__(self, path: str | None):
        self.path = path
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if not self.path:
            return
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
