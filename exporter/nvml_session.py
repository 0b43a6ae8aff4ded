"""NVML's lifetime: initialised under a deadline, retried with backoff, initialised again after a
driver reload.

A node whose driver is broken at start-up must still export (``gpuhealth_nvml_up 0`` is the
signal), and a driver reload (``LibRmVersionMismatch``, ``Uninitialized``) must not leave the
exporter reading a stale library until someone restarts it.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from gpuhealth.exporter.guard import GuardedWorker
from gpuhealth.exporter.nvml_errors import error_label

log = logging.getLogger(__name__)

BACKOFF_FIRST, BACKOFF_MAX = 1.0, 60.0


class NvmlSession:
    """Owns ``nvmlInit``/``nvmlShutdown``; ``generation`` grows at each successful initialisation."""

    def __init__(self, nvml: Any, timeout: float, clock: Callable[[], float]) -> None:
        self.nvml = nvml
        self.timeout = timeout
        self.clock = clock
        self.up = False
        self.generation = 0
        self.driver_version = ""
        self.init_errors: collections.Counter[str] = collections.Counter()
        self._worker = GuardedWorker("nvml-init")
        self._retry_at = 0.0
        self._backoff = BACKOFF_FIRST
        self._stale = False
        self._lock = threading.Lock()

    def ensure(self) -> bool:
        """True when NVML is usable; otherwise try to initialise it, at most once per backoff step."""
        with self._lock:
            if self.up:
                return True
            if self.clock() < self._retry_at:
                return False
            try:
                self.driver_version = GuardedWorker.result(self._worker.submit(self._init), self.timeout)
            except Exception as exc:  # NVMLError_*, DeadlineExceeded; never fatal to the exporter
                label = error_label(exc)
                self.init_errors[label] += 1
                self._retry_at = self.clock() + self._backoff
                log.warning("nvml init failed error=%s detail=%s retry_in=%.0fs", label, exc, self._backoff)
                self._backoff = min(self._backoff * 2, BACKOFF_MAX)
                return False
            self.up = True
            self.generation += 1
            self._backoff = BACKOFF_FIRST
            log.info("nvml initialised driver_version=%s generation=%d", self.driver_version, self.generation)
            return True

    def _init(self) -> str:
        if self._stale:  # release the old library state first (the binding counts initialisations)
            self._stale = False
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError as exc:  # a stale library may refuse; initialising still works
                log.debug("nvml shutdown failed error=%s", exc)
        self.nvml.nvmlInit()
        return str(self.nvml.nvmlSystemGetDriverVersion())

    def lost(self, reason: str) -> None:
        """The library failed as a whole (driver unloaded or reloaded): initialise again next run."""
        with self._lock:
            if not self.up:
                return
            self.up = False
            self._stale = True
            self._retry_at = 0.0
        log.warning("nvml lost error=%s; initialising again", reason)
