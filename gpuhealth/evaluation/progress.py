"""A progress bar on stderr for the long phases of an evaluation; one summary line when not a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``with Progress("backfill", total) as bar: bar.advance()``; silent when ``enabled`` is false."""

    WIDTH = 30

    def __init__(self, label: str, total: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.live = enabled and self.stream.isatty()
        self.started = time.monotonic()
        self._drawn = -1.0

    def __enter__(self) -> Progress:
        self._draw()
        return self

    def advance(self, count: int = 1) -> None:
        self.done = min(self.done + count, self.total)
        self._draw()

    def _draw(self) -> None:
        if not self.live:
            return
        now = time.monotonic()
        if now - self._drawn < 0.2 and self.done < self.total:
            return
        self._drawn = now
        filled = int(self.WIDTH * self.done / self.total)
        self.stream.write(
            f"\r{self.label:<24} [{'#' * filled}{'.' * (self.WIDTH - filled)}] "
            f"{100 * self.done / self.total:5.1f}% {now - self.started:6.1f}s"
        )
        self.stream.flush()

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self.live:
            self.stream.write("\n")
        elif exc[0] is None:
            self.stream.write(f"{self.label}: done in {time.monotonic() - self.started:.1f}s\n")
        self.stream.flush()
