"""Counting an XID once when both NVML's event set and the kernel log report it.

The two sources see the same event at nearly the same time but in no fixed order. An event is
counted when it arrives unless the other source reported the same (GPU, XID) within ``window``
seconds and that report has not been paired yet. Repeats from one source always count: a GPU
logging XID 31 five times had five faults.
"""

from __future__ import annotations

import collections


class XidDeduplicator:
    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._recent: dict[tuple[str, int], collections.deque[tuple[str, float]]] = collections.defaultdict(
            collections.deque)

    def is_new(self, source: str, gpu: str, xid: int, now: float) -> bool:
        """Record a report; False when it pairs with the other source's earlier report."""
        recent = self._recent[(gpu, xid)]
        while recent and recent[0][1] < now - self.window:
            recent.popleft()
        for entry in recent:
            if entry[0] != source:
                recent.remove(entry)
                return False
        recent.append((source, now))
        return True
