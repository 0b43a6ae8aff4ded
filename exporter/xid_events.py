"""NVML's critical-XID event set, kept working through the failures real drivers produce.

``nvmlEventSetCreate`` can fail at start-up, registration can fail for one GPU, and after
``Unknown`` the set is in an undefined state (NVML's reference: free it); ``nvmlEventSetWait``
answers ``GpuIsLost`` as long as a lost GPU is in the set, which would silence every other GPU. So
the set is freed and recreated with backoff, GPUs that failed to register are retried, and an
event whose device no longer maps to an index still counts, as ``gpu="unknown"``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

from gpuhealth.exporter.nvml_errors import error_label

log = logging.getLogger(__name__)

BACKOFF_FIRST, BACKOFF_MAX = 1.0, 60.0
MAX_EVENTS_PER_RUN = 10000


class NvmlXidEvents:
    """Drains the event set; all methods run on one guarded worker thread."""

    def __init__(self, nvml: Any, clock: Callable[[], float]) -> None:
        self.nvml = nvml
        self.clock = clock
        self.event_set: Any = None
        self.registered: dict[int, bool] = {}
        self.wait_errors: collections.Counter[str] = collections.Counter()
        self._generation = 0
        self._retry_at = 0.0
        self._backoff = BACKOFF_FIRST
        self._register_retry_at = 0.0

    def drain(self, generation: int, count: int) -> list[tuple[str, int]]:
        """Pending critical XIDs as (gpu, xid). ``generation``: NVML's initialisation count; ``count``:
        the GPUs it enumerates (the inventory step's count)."""
        if generation != self._generation:  # NVML was initialised again: handles and sets are stale
            self._generation = generation
            self.event_set = None
            self.registered.clear()
            self._retry_at = 0.0
        if self.event_set is None and not self._create():
            return []
        self._register_missing(count)
        return self._wait()

    def _create(self) -> bool:
        nvml = self.nvml
        if self.clock() < self._retry_at:
            return False
        try:
            self.event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("NVML event set create failed error=%s retry_in=%.0fs", error_label(exc),
                        self._backoff)
            self._retry_at = self.clock() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX)
            return False
        self._backoff = BACKOFF_FIRST
        self.registered.clear()
        self._register_retry_at = 0.0
        return True

    def _register_missing(self, count: int) -> None:
        nvml = self.nvml
        if self.clock() < self._register_retry_at:
            return
        missing = [i for i in range(count) if not self.registered.get(i)]
        for index in missing:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self.event_set)
                self.registered[index] = True
            except nvml.NVMLError as exc:
                if self.registered.get(index) is None:
                    log.info("no NVML XID events gpu=%d error=%s", index, error_label(exc))
                self.registered[index] = False
        if not all(self.registered.get(i) for i in range(count)):
            self._register_retry_at = self.clock() + BACKOFF_MAX / 2

    def _wait(self) -> list[tuple[str, int]]:
        nvml = self.nvml
        events: list[tuple[str, int]] = []
        for _ in range(MAX_EVENTS_PER_RUN):
            try:
                event = nvml.nvmlEventSetWait(self.event_set, 0)
            except nvml.NVMLError_Timeout:
                break
            except nvml.NVMLError as exc:
                self.wait_errors[error_label(exc)] += 1
                if isinstance(exc, nvml.NVMLError_GpuIsLost | nvml.NVMLError_Unknown):
                    # undefined state, or a lost GPU that would answer every wait: start a new set,
                    # where the lost GPU fails to register and the others keep reporting
                    log.warning("NVML event set reset error=%s", error_label(exc))
                    self._free()
                else:
                    log.warning("NVML event wait failed error=%s", error_label(exc))
                break
            if event.eventType != nvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                gpu = str(nvml.nvmlDeviceGetIndex(event.device))
            except nvml.NVMLError:
                gpu = "unknown"
            events.append((gpu, int(event.eventData)))
        return events

    def _free(self) -> None:
        nvml, event_set = self.nvml, self.event_set
        self.event_set = None
        self.registered.clear()
        self._retry_at = self.clock() + BACKOFF_FIRST
        try:
            nvml.nvmlEventSetFree(event_set)
        except nvml.NVMLError as exc:
            log.debug("NVML event set free failed error=%s", error_label(exc))
