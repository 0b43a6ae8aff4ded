"""Counting an XID once when both NVML's event set and the kernel log report it.

The two sources see the same event at nearly the same time but in no fixed order. An event is
counted when it arrives unless the other source reported the same (GPU, XID) within ``window``
seconds and that report has not been paired yet. Repeats from one source always count: a GPU
logging XID 31 five times had five faults.
"""

from __future__ import annotations

import collections

# Unpaired reports kept per (GPU, XID, source): a flood of one XID from one source only needs to
# pair with as many reports of the other source, and the NVML side delivers at most
# MAX_EVENTS_PER_RUN (10,000) a run; beyond this the oldest are forgotten (a later report of the
# other source then counts as an event of its own).
MAX_UNPAIRED = 10000


class XidDeduplicator:
    """Constant time per report: a kernel log flooded with one XID must not make each line cost as much
    as every line of the last ``window`` seconds."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._unpaired: dict[tuple[str, int], dict[str, collections.deque[float]]] = collections.defaultdict(
            dict)

    def is_new(self, source: str, gpu: str, xid: int, now: float) -> bool:
        """Record a report; False when it pairs with the other source's earlier report."""
        by_source = self._unpaired[(gpu, xid)]
        for other, times in by_source.items():
            while times and times[0] < now - self.window:
                times.popleft()
            if other != source and times:
                times.popleft()
                return False
        by_source.setdefault(source, collections.deque(maxlen=MAX_UNPAIRED)).append(now)
        return True
