"""The one progress bar of the long offline jobs (preprocessing, HF import/export, upcycling).

A single line on stderr, redrawn at most twice a second, off unless stderr is a terminal, so logs,
pipes and the tools' one-line errors stay clean; no dependency (tqdm is not one of ours). It lives
here, the lowest library package the tools share besides core, and models/ never imports it: the
conversion functions take a plain ``progress(done, total)`` callback that a tool points at
:meth:`Progress.update`.

    with Progress("tokenizing -> out.bin", total=size, unit="B") as bar:
        bar.update(done_bytes, note=f"{num_tokens:,} tokens")
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING, Callable, TextIO

if TYPE_CHECKING:  # torch only for the hints: preprocessing never imports it
    import torch

__all__ = ["Progress"]


def _amount(value: float, unit: str) -> str:
    return f"{value / 1e6:.1f}MB" if unit == "B" else f"{int(value):,} {unit}"


class Progress:
    """``label [#####.....]  45.0% 12.3MB/27.1MB 8.2MB/s note`` on one line.

    ``total`` may be given late (``update(done, total)``); ``unit="B"`` prints megabytes, any other
    unit counts items. ``enabled=None`` means "when ``stream`` (default stderr) is a terminal".
    Use it as a context manager (or call :meth:`close`): the line is ended even when the job
    fails, so an error message starts on a line of its own.
    """

    def __init__(self, label: str, total: int | None = None, unit: str = "B", enabled: bool | None = None,
                 stream: TextIO | None = None, interval_s: float = 0.5):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.interval_s = interval_s
        self.done, self.note = 0, ""
        self.start = self.last = time.monotonic()

    def update(self, done: int, total: int | None = None, note: str = "", force: bool = False) -> None:
        """Record ``done`` (of ``total``, if given now) and redraw if the last draw is old enough;
        ``note`` (e.g. "1,234 tokens") is kept for later draws until another is given."""
        self.done = done
        if note:
            self.note = note
        if total is not None:
            self.total = total
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < self.interval_s):
            return
        self.last = now
        total = self.total or 0
        frac = min(done / total, 1.0) if total > 0 else 0.0
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        rate = done / max(now - self.start, 1e-9)
        of = f"/{_amount(total, self.unit)}" if total else ""
        tail = f" {self.note}" if self.note else ""
        self.stream.write(f"\r\x1b[K{self.label} [{bar}] {100 * frac:5.1f}% {_amount(done, self.unit)}{of} "
                          f"{_amount(rate, self.unit)}/s{tail}")
        self.stream.flush()

    def advance(self, amount: int, note: str = "") -> None:
        self.update(self.done + amount, note=note)

    def tracking(self, specs: dict[str, tuple[tuple[int, ...], "torch.dtype"]],
                 produce: Callable[[str], "torch.Tensor"]) -> Callable[[str], "torch.Tensor"]:
        """``produce`` (a core.weights.save_weights source) that advances the bar by each produced
        tensor's bytes; the total is the bytes of ``specs``."""
        self.update(self.done, total=sum(_nbytes(shape, dtype) for shape, dtype in specs.values()))

        def tracked(name: str) -> "torch.Tensor":
            tensor = produce(name)
            self.advance(_nbytes(*specs[name]))
            return tensor

        return tracked

    def close(self, note: str = "") -> None:
        """Draw the final state and end the line (when enabled); later updates draw nothing."""
        if self.enabled:
            self.update(self.done, note=note, force=True)
            self.stream.write("\n")
            self.stream.flush()
            self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nbytes(shape: tuple[int, ...], dtype: "torch.dtype") -> int:
    return math.prod(shape) * dtype.itemsize
