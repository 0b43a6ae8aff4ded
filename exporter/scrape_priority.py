"""Scrapes go first: sampling work steps aside while the HTTP thread answers a request.

Under CPython's GIL a scrape that arrives during a sampling run competes for every step it takes
(accept, read, write: each a wait for the GIL) with the sampling thread and every GPU worker; with
eight busy workers one step can wait through several switch intervals, and that made the scrape
tail (exporter README, ``bench/exporter_tail.py``). So the server marks each request from its start
to its written answer, and sampling threads call ``yield_to_scrape()`` between small pieces of work
(each NVML call, each collector): while a request is being answered they wait there, off the GIL.

Sampling is only delayed, never skipped, and boundedly: a wait ends when an answer is written or
``hold`` seconds after the last connection or request began, whichever comes first, and one
sampling run gives way for ``budget`` seconds in all, so hundreds of idle or hostile connections
slow a run by at most ``budget``. With several requests in flight, the first answer ends the wait
(a node exporter has one or two scrapers); nothing is counted that a lost connection could leave
unbalanced.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ScrapePriority:
    """Shared by the HTTP server (``begin``/``end`` per request) and the sampling threads."""

    def __init__(self, hold: float = 0.005, budget: float = 0.02,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hold = hold
        self.budget = budget
        self.clock = clock
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._until = 0.0  # the last request's priority ends here at the latest
        self._spent = 0.0  # waited in this sampling run, by every sampling thread together

    def begin(self) -> None:
        """A connection was accepted or a request arrived: sampling gives way from now."""
        self._until = self.clock() + self.hold
        self._idle.clear()

    def end(self) -> None:
        """The answer is written: sampling goes on."""
        self._idle.set()

    @property
    def answering(self) -> bool:
        """A request is being answered (and sampling threads give way, within the bounds)."""
        return not self._idle.is_set()

    @property
    def given_way(self) -> float:
        """Seconds sampling threads have waited for scrapes in this run: the delay scrapes added."""
        return self._spent

    def new_run(self) -> None:
        """A sampling run starts: its budget is whole again."""
        self._spent = 0.0

    def yield_to_scrape(self) -> None:
        """Wait while a request is being answered, within the hold and the run's budget."""
        if self._idle.is_set():
            return
        left = min(self._until - self.clock(), self.budget - self._spent)
        if left > 0:
            start = self.clock()
            self._idle.wait(left)
            with self._lock:
                self._spent += self.clock() - start
