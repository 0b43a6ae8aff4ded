"""The background sampling loop and the snapshot that ``/metrics`` serves.

Collectors run in one thread at a fixed interval (about 1 s), far faster than Prometheus scrapes,
which is what makes window maxima and time-in-state features possible. Steps (the inventory) run
before the collectors, which read what they learned. Each run renders the whole exposition once
and compresses it once (gzip level 1, under half a millisecond); a scrape only writes
those bytes, so it never renders or compresses and never waits on NVML or the filesystem. It gets
the last complete run's snapshot: at most one sampling interval plus one run old (a run gives
scrapes 20 ms at most, ``scrape_priority.py``).
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from gpuhealth.exporter.collector import Collector
from gpuhealth.exporter.metrics import Exposed, Families, Renderer
from gpuhealth.exporter.scrape_priority import ScrapePriority

log = logging.getLogger(__name__)
# Level 1 still compresses the exposition about 10:1 (its repetitive label text is what compresses),
# for a fraction of the default level's CPU: cheap enough to do at every run.
GZIP_LEVEL = 1


class Snapshot(NamedTuple):
    """One sampling run's exposition, plain and gzipped, published together."""

    plain: bytes
    gzipped: bytes


EMPTY = Snapshot(b"", gzip.compress(b"", GZIP_LEVEL, mtime=0))


class Sampler:
    """Runs the collectors, times them, isolates their failures and keeps the latest exposition."""

    def __init__(self, collectors: dict[str, Collector], static: Callable[[], Iterable[Exposed]] = tuple,
                 interval: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 steps: Sequence[Callable[[], None]] = (), priority: ScrapePriority | None = None) -> None:
        self.collectors = collectors
        self.steps = steps
        self.static = static
        self.interval = interval
        self.clock = clock
        self._failing: set[str] = set()
        self.priority = priority or ScrapePriority()
        self._snapshot = EMPTY
        self._renderer = Renderer(self.priority.yield_to_scrape)
        self._last_run: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # sample_once may also be called from a reload signal

    def sample_once(self) -> bytes:
        with self._lock:
            pause = self.priority.yield_to_scrape
            self.priority.new_run()
            families: list[Exposed] = list(self.static())
            meta = Families()
            for step in self.steps:
                pause()
                try:
                    step()
                except Exception:  # the collectors still run, on what the inventory already knows
                    log.exception("sampling step failed step=%s", getattr(step, "__qualname__", step))
            for name, collector in self.collectors.items():
                pause()
                start = time.perf_counter()
                try:
                    for family in collector.collect():  # what a failing collector yielded still counts
                        families.append(family)
                    ok = True
                except Exception:
                    ok = False
                    if name not in self._failing:
                        log.exception("collector failed collector=%s", name)
                    else:
                        log.debug("collector still failing collector=%s", name, exc_info=True)
                if ok and name in self._failing:
                    log.info("collector recovered collector=%s", name)
                (self._failing.discard if ok else self._failing.add)(name)
                meta.add("gpuhealth_collector_success", int(ok), [name])
                meta.add("gpuhealth_collector_duration_seconds", time.perf_counter() - start, [name])
            pause()
            plain = self._renderer.render([*families, *meta])
            pause()
            self._snapshot = Snapshot(plain, gzip.compress(plain, GZIP_LEVEL, mtime=0))
            self._last_run = self.clock()
            return plain

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    @property
    def exposition(self) -> bytes:
        return self._snapshot.plain

    def healthy(self) -> bool:
        """True while the loop keeps up: the last run ended less than three intervals ago."""
        return self._last_run is not None and self.clock() - self._last_run < 3 * self.interval + 1

    def start(self) -> None:
        self.sample_once()  # the first scrape already has data
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_run = time.monotonic() + self.interval
        while not self._stop.wait(max(next_run - time.monotonic(), 0)):
            self.sample_once()
            next_run += self.interval
            if next_run < time.monotonic():  # fell behind (slow collector): do not try to catch up
                next_run = time.monotonic() + self.interval

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for collector in self.collectors.values():
            close = getattr(collector, "close", None)
            if close is not None:
                close()
