"""The background sampling loop and the snapshot that ``/metrics`` serves.

Collectors run in one thread at a fixed interval (about 1 s), far faster than Prometheus scrapes,
which is what makes window maxima and time-in-state features possible. Steps (the inventory) run
before the collectors, which read what they learned. Each run renders the whole exposition once; a
scrape only writes those bytes, so it never renders and never waits on NVML or the filesystem. It
gets the last complete run's snapshot: at most one sampling interval plus one run old.

Gzip is paid for only when a scraper asks for it. While gzip requests keep coming (one within
``GZIP_INTEREST_SECONDS``, two of Prometheus's default scrape intervals), each run also compresses
its exposition (level 1, about half a millisecond), so those scrapes only write bytes too; otherwise
the first gzip request of a snapshot compresses it, once, and a plain scraper never costs a
compression.
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

log = logging.getLogger(__name__)
# Level 1 still compresses the exposition about 10:1 (its repetitive label text is what compresses),
# for a fraction of the default level's CPU.
GZIP_LEVEL = 1
GZIP_INTEREST_SECONDS = 120.0
# A scrape arriving mid-run waits for the GIL at each of its socket calls and event-loop turns; a 0.2 ms
# switch interval (Python's default is 5 ms) bounds each wait. Threads switch only while another one
# waits, so no scrape, no cost. 50 us gave no steadier scrapes on a loaded machine (exporter README).
SWITCH_INTERVAL_SECONDS = 0.0002


def compress(body: bytes) -> bytes:
    return gzip.compress(body, GZIP_LEVEL, mtime=0)


class Snapshot(NamedTuple):
    """One sampling run's exposition, and its gzipped form once someone compressed it."""

    plain: bytes
    gzipped: bytes | None = None


class Sampler:
    """Runs the collectors, times them, isolates their failures and keeps the latest exposition."""

    def __init__(self, collectors: dict[str, Collector], static: Callable[[], Iterable[Exposed]] = tuple,
                 interval: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 steps: Sequence[Callable[[], None]] = ()) -> None:
        self.collectors = collectors
        self.steps = steps
        self.static = static
        self.interval = interval
        self.clock = clock
        self._failing: set[str] = set()
        self._snapshot = Snapshot(b"")
        self._publish = threading.Lock()  # a run's snapshot and a scrape's compression of an older one
        self._gzip_asked = float("-inf")  # when a scraper last asked for gzip (self.clock)
        self._renderer = Renderer()
        self._last_run: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # sample_once may also be called from a reload signal

    def sample_once(self) -> bytes:
        with self._lock:
            families: list[Exposed] = list(self.static())
            meta = Families()
            for step in self.steps:
                try:
                    step()
                except Exception:  # the collectors still run, on what the inventory already knows
                    log.exception("sampling step failed step=%s", getattr(step, "__qualname__", step))
            for name, collector in self.collectors.items():
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
            plain = self._renderer.render([*families, *meta])
            wanted = self.clock() - self._gzip_asked < GZIP_INTEREST_SECONDS
            snapshot = Snapshot(plain, compress(plain) if wanted else None)
            with self._publish:
                self._snapshot = snapshot
            self._last_run = self.clock()
            return plain

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def gzipped(self) -> bytes:
        """The latest exposition gzipped, for a scraper that asked for gzip: compressed by the run while
        such scrapers keep coming, else here, once per snapshot."""
        self._gzip_asked = self.clock()
        snapshot = self._snapshot
        if snapshot.gzipped is not None:
            return snapshot.gzipped
        body = compress(snapshot.plain)
        with self._publish:
            if self._snapshot is snapshot:  # not replaced by a newer run meanwhile
                self._snapshot = snapshot._replace(gzipped=body)
        return body

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
