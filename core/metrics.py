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


# Environment variables a benchmark's figures depend on (besides every NCCL_* one).
BENCH_ENV_KEYS = ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "CUDA_DEVICE_MAX_CONNECTIONS",
                  "OMP_NUM_THREADS")


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
        "env_vars": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_") or k in BENCH_ENV_KEYS},
        "topology": gpu_topology(),
    }
