"""A small progress line for long jobs (conversion, loading): counts, bytes, rate and ETA."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class Progress:
    """Redraws one line on a terminal; elsewhere prints a line at most every ``every`` seconds."""

    def __init__(
        self, label: str, total_items: int, total_bytes: int, stream: TextIO | None = None, every: float = 5.0
    ) -> None:
        self.label = label
        self.total_items = total_items
        self.total_bytes = total_bytes
        self.items = 0
        self.bytes = 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.every = every
        self.start = time.perf_counter()
        self._last = -float("inf")

    def update(self, items: int, nbytes: int, note: str = "") -> None:
        self.items += items
        self.bytes += nbytes
        now = time.perf_counter()
        done = self.items >= self.total_items
        if self.tty or done or now - self._last >= self.every:
            self._last = now
            self._draw(now, note)

    def _draw(self, now: float, note: str) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.bytes / elapsed
        left = (self.total_bytes - self.bytes) / rate if rate > 0 else float("inf")
        eta = f"{left:.0f}s" if left != float("inf") else "?"
        frac = self.bytes / self.total_bytes if self.total_bytes else 1.0
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        line = (
            f"{self.label} [{bar}] {self.items}/{self.total_items} tensors, "
            f"{human_bytes(self.bytes)}/{human_bytes(self.total_bytes)}, "
            f"{human_bytes(rate)}/s, ETA {eta} {note}"
        ).rstrip()
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if self.items >= self.total_items:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
