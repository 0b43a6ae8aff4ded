"""Deadlines for calls into a driver that may hang.

A ctypes call into a hung driver cannot be interrupted. Each GPU gets its own daemon worker thread:
a call that misses its deadline is reported as a timeout, and while it stays stuck, further calls
for that GPU fail at once instead of piling up threads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class DeadlineExceeded(Exception):
    """The call did not finish in time (or an earlier call on the same worker is still stuck)."""


class GuardedWorker:
    """Runs calls one at a time on a daemon thread, so a stuck call never blocks the caller."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._busy: Future[Any] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller through the future
                future.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn``; the future fails with DeadlineExceeded at once while the worker is stuck."""
        future: Future[Any] = Future()
        if self._busy is not None and not self._busy.done():
            future.set_exception(DeadlineExceeded("an earlier call is still running"))
            return future
        self._busy = future
        self._jobs.put((fn, future))
        return future

    @staticmethod
    def result(future: Future[Any], timeout: float) -> Any:
        """The call's result, raising its exception, or DeadlineExceeded after ``timeout`` seconds."""
        timeout = max(timeout, 0.0)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"no answer within {timeout:.3g}s") from None
