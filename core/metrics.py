"""Throughput accounting: model FLOPs per device per second and MFU, a JSONL metrics log, and the
record of the machine and software that benchmarks write beside their figures."""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import subprocess
import time
from typing import Any

import numpy as np
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


def _json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float (numpy's too) as None, so the JSON is valid."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


class MetricsLog:
    """Appends one JSON object per record to <run_dir>/metrics.jsonl (main rank only).

    Every line is strict JSON: a NaN or infinite value (a diverged loss) is written as null."""

    def __init__(self, path: str | None):
        self.path = path
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if not self.path:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")

    def truncate_after(self, step: int) -> int:
        """Drop the rows of steps after ``step`` (a resumed run trains them again); rewrites the
        file atomically. Returns the number of rows dropped."""
        if not self.path or not os.path.exists(self.path):
            return 0
        with open(self.path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
        kept = []
        for line in lines:
            try:
                row_step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                row_step = None  # a torn last line of a killed run: dropped as well
            if isinstance(row_step, int) and row_step <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        if len(kept) == len(lines):
            return 0
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)
        return len(lines) - len(kept)


# Environment variables a benchmark's figures depend on: these, and every one starting with a
# BENCH_ENV_PREFIXES entry (NCCL's settings; inductor's, e.g. TORCHINDUCTOR_MAX_AUTOTUNE_GEMM, which
# change the compiled step's kernels; the MX kernels' switches read at import: MOETRON_MX_LEAN,
# MOETRON_MX_FUSED, MOETRON_MX_BOTH_TILE, MOETRON_MX_GRID).
BENCH_ENV_KEYS = ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "CUDA_DEVICE_MAX_CONNECTIONS",
                  "OMP_NUM_THREADS")
BENCH_ENV_PREFIXES = ("NCCL_", "TORCHINDUCTOR_", "MOETRON_MX_")


def gpu_topology() -> str | None:
    """`nvidia-smi topo -m` (which GPU pairs talk over NVLink, PCIe, ...), or None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def launch_command(script: str, argv: list[str]) -> str:
    """How this process was started, as a command to copy: torchrun's shape when under torchrun."""
    line = f"{script} {shlex.join(argv)}".rstrip()
    if "LOCAL_WORLD_SIZE" in os.environ:
        nodes = int(os.environ.get("WORLD_SIZE", 1)) // max(int(os.environ["LOCAL_WORLD_SIZE"]), 1)
        prefix = f"torchrun --nproc-per-node {os.environ['LOCAL_WORLD_SIZE']}"
        return f"{prefix} --nnodes {nodes} {line}" if nodes > 1 else f"{prefix} {line}"
    return "python " + line


def run_environment(device: torch.device, world: int, script: str, argv: list[str]) -> dict[str, Any]:
    """The machine and software a benchmark ran on: device, ranks, backend, versions, date, the
    command, NCCL and related variables, and the GPU topology."""
    import torch.distributed as dist

    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "gpus": world if cuda else 0,
        "world_size": world,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": launch_command(script, argv),
        "env_vars": {k: v for k, v in sorted(os.environ.items()) if k.startswith(BENCH_ENV_PREFIXES) or k in BENCH_ENV_KEYS},
        "topology": gpu_topology(),
    }
