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

A run that cannot be bracketed from inside (a peer's script, whose compile and timed steps share one process) is
sampled from outside with ``nvidia-smi dmon -s pc -o T -d 1`` and a marks file of each run's start time;
``python tools/clocks.py dmon DMON MARKS`` prints each run's mean clock and power over its seconds under load
(``dmon_windows``; docs/bench/session56/next.sh).

Without a CUDA device or without ``nvidia-smi`` the summary's values are None (the CPU, the tests); a run whose
nvidia-smi printed nothing readable gives None too, never a made-up figure. A tools/ helper (a script imports it
as ``clocks``, as it does ``cli``). Tested on the CPU against a stand-in nvidia-smi and session 57's dmon log
(tests/tools/test_clocks.py); run on an H100 in session 58 (bench_train's row: 1,394 MHz, 696 W, 44 samples over 30
steps, beside dmon's 1,342 MHz over a window that also held the warm-up; profile_step's sampling not yet run there).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import subprocess
import sys

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


LOAD_W = 650.0
"""``dmon_windows``' default floor: a second counts as under load at this draw or more. The runs' windows also hold
their compiles and start-up, at 70-260 W on the H100s (sessions 57-58), and a second that straddles the steps' start
or end draws 400-600 W at a clock still near the top (session 58's torchtitan window: 410 W at 1,785 MHz, 600 W at
1,965); the steps themselves draw 680-700 W of the 700 W limit. Session 57 counted from 400 W."""


def dmon_rows(text: str) -> list[dict[str, str]]:
    """``nvidia-smi dmon -o T`` output as one dict a line, keyed by its first header line's names (Time, gpu, pwr,
    pclk, ...); the unit line and any repeated header are skipped, as are lines of another width."""
    header, rows = None, []
    for line in text.splitlines():
        if line.startswith("#"):
            header = header or line.lstrip("#").split()
        elif header and len(line.split()) == len(header):
            rows.append(dict(zip(header, line.split())))
    return rows


def dmon_windows(dmon: str, marks: str, load_w: float = LOAD_W) -> list[tuple[str, dict]]:
    """Per run, (its name, ``summarize`` over its seconds drawing at least ``load_w``). ``marks`` holds one
    "NAME HH:MM:SS" line as each run starts and a last line as the last ends; a run's window is [its start, the next
    mark's). dmon's "-" (a value it could not read) drops that second. Times compare as HH:MM:SS text, so a window
    that crosses midnight finds no samples (its summary's values None), never another window's."""
    rows = dmon_rows(dmon)
    points = [line.split() for line in marks.splitlines() if line.strip()]
    out = []
    for (name, start), (_, end) in zip(points, points[1:]):
        window = [r for r in rows if start <= r["Time"] < end and "-" not in (r.get("pwr", "-"), r.get("pclk", "-"))]
        out.append((name, summarize([(float(r["pclk"]), float(r["pwr"])) for r in window
                                     if float(r["pwr"]) >= load_w])))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Each run's mean SM clock and power under load from nvidia-smi "
                                     "dmon's log and a marks file (see tools/clocks.py)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dmon", help="summarize `nvidia-smi dmon -s pc -o T -d 1` output per run")
    d.add_argument("dmon", help="dmon's output file")
    d.add_argument("marks", help='one "NAME HH:MM:SS" line as each run starts, a last one as the last ends')
    d.add_argument("--load-w", type=float, default=LOAD_W, help=f"count only seconds at >= this draw ({LOAD_W:g} W)")
    args = parser.parse_args(argv)
    with open(args.dmon) as f_dmon, open(args.marks) as f_marks:
        windows = dmon_windows(f_dmon.read(), f_marks.read(), args.load_w)
    for name, s in windows:
        if s["clock_samples"]:
            print(f"{name:<11} {s['clock_samples']:>3} s under load  SM clock {s['sm_clock_mhz']:6.0f} MHz "
                  f"(min {s['sm_clock_min_mhz']:.0f})  power {s['power_w']:5.0f} W (max {s['power_max_w']:.0f})")
        else:
            print(f"{name}: no dmon samples at >= {args.load_w:g} W in its window")
    return 0


if __name__ == "__main__":
    sys.exit(main())
