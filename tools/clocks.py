"""The GPU's SM clock and power draw while a benchmark's timed steps run.

A training step can hold a card at its power limit: on an H100 (700 W) both moetron's and torchtitan's steps
ran at about 1,500 MHz of the SM clock's 1,980 (docs/performance.md, session 57; the H200 not yet measured), so a
step's time depends on the clock the card could hold as well as on its FLOPs and bytes, and figures from two
cards, or two runs, compare fairly only beside their clocks. ``ClockSampler`` runs ``nvidia-smi`` in a child
process that prints the SM clock and the power draw every ``interval_ms`` while a ``with`` block runs, and
summarizes the samples:

    with ClockSampler(device) as clocks:
        ...  # the timed steps
    row.update(clocks.summary())  # sm_clock_mhz, sm_clock_min_mhz, power_w, power_max_w, clock_samples

Without a CUDA device or without ``nvidia-smi`` the summary's values are None (the CPU, the tests); a run whose
nvidia-smi printed nothing readable gives None too, never a made-up figure. A tools/ helper (a script imports it
as ``clocks``, as it does ``cli``). Tested on the CPU against a stand-in nvidia-smi (tests/tools/test_clocks.py);
not yet run on a GPU (session 57 wrote it after its only device call).
"""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess

import torch

QUERY = "clocks.sm,power.draw"
"""nvidia-smi's fields, in this order: the SM clock (MHz) and the board's power draw (W)."""

FIELDS = ("sm_clock_mhz", "sm_clock_min_mhz", "power_w", "power_max_w", "clock_samples")
"""The keys ``summary()`` returns."""


def device_selector(device: torch.device) -> str | None:
    """nvidia-smi's ``-i`` for a CUDA device: its UUID (the same card whatever CUDA_VISIBLE_DEVICES says), else
    None (not CUDA, or a torch without the UUID)."""
    if device.type != "cuda":
        return None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def parse_samples(text: str) -> list[tuple[float, float]]:
    """(clock MHz, power W) from nvidia-smi's ``--format=csv,noheader,nounits`` lines; lines with a field it could
    not read ("[N/A]", "[Unknown Error]") or of another shape are skipped."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            samples.append((float(parts[0]), float(parts[1])))
        except ValueError:
            continue
    return samples


def summarize(samples: list[tuple[float, float]]) -> dict:
    """The samples' mean and least clock, mean and largest power, and their count (values None without any)."""
    if not samples:
        return dict.fromkeys(FIELDS[:-1], None) | {"clock_samples": 0}
    clocks, power = [s[0] for s in samples], [s[1] for s in samples]
    return {"sm_clock_mhz": statistics.fmean(clocks), "sm_clock_min_mhz": min(clocks),
            "power_w": statistics.fmean(power), "power_max_w": max(power), "clock_samples": len(samples)}


class ClockSampler:
    """``with ClockSampler(device, interval_ms):`` samples the card's SM clock and power draw every
    ``interval_ms`` (nvidia-smi ``-lms``) until the block ends; then ``summary()``. A no-op off CUDA or where
    ``nvidia-smi`` is not on PATH. The first sample comes once nvidia-smi has started (about 0.1-0.3 s), so a
    window shorter than that has none."""

    def __init__(self, device: torch.device, interval_ms: int = 200):
        if interval_ms < 1:
            raise ValueError(f"ClockSampler: interval_ms={interval_ms}; at least 1")
        self.selector = device_selector(device)
        self.interval_ms = interval_ms
        self.proc: subprocess.Popen | None = None
        self.samples: list[tuple[float, float]] = []

    def command(self) -> list[str] | None:
        """The nvidia-smi command line, or None where there is nothing to sample."""
        exe = shutil.which("nvidia-smi")
        if self.selector is None or exe is None:
            return None
        return [exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(self.interval_ms),
                "-i", self.selector]

    def __enter__(self) -> "ClockSampler":
        cmd = self.command()
        if cmd is not None:
            try:
                self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:  # nvidia-smi found but not runnable: no samples, the benchmark goes on
                self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        # SIGINT, as Ctrl-C stops nvidia-smi's loop: it exits cleanly, its output written out; killed if it lingers.
        self.proc.send_signal(signal.SIGINT)
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.samples = parse_samples(out or "")
        self.proc = None

    def summary(self) -> dict:
        return summarize(self.samples)
