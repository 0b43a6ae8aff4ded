"""The one way webhook tests wait: poll with a deadline, never sleep-then-assert, never block the loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(probe: Callable[[], Awaitable[T]], done: Callable[[T], object] = bool, *,
                     timeout: float, what: str, interval: float = 0.05) -> T:
    """Await ``probe()`` until ``done`` holds for its value and return that value; at the deadline,
    fail naming ``what`` and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}: {value!r}"
        await asyncio.sleep(interval)
