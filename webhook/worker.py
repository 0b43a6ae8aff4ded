"""The action worker: feeds the engine from the journal, never from the HTTP handler.

Actions of one node run strictly one after another in arrival order; different nodes run in
parallel up to a small limit. The worker wakes when a notification is journaled, when an action
ends, or when the earliest deferred action comes due.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time

from gpuhealth.webhook.engine import Engine
from gpuhealth.webhook.outcomes import Reason
from gpuhealth.webhook.store import Action, JournalUnwritable, Store

log = logging.getLogger(__name__)

CONCURRENCY = 8
IDLE_POLL_SECONDS = 5.0  # re-read the journal at least this often (clock jumps, manual edits)
PRUNE_EVERY_SECONDS = 3600.0
# A pending action waiting out a cooldown lets a (stronger) action behind it on its node go first.
YIELDING_REASONS = (Reason.COOLDOWN,)
# While the journal refuses writes nothing is started; a probe write is tried this often, doubling.
WRITE_RETRY_INITIAL_SECONDS = 0.5
WRITE_RETRY_MAX_SECONDS = 30.0


class Worker:
    def __init__(self, engine: Engine, journal: Store, retention_seconds: float,
                 concurrency: int = CONCURRENCY) -> None:
        self.engine = engine
        self.journal = journal
        self.retention_seconds = retention_seconds
        self.concurrency = concurrency
        self._pruned_at = 0.0
        self._write_retry = WRITE_RETRY_INITIAL_SECONDS
        self._write_retry_at = 0.0
        self._write_failed_at = float("-inf")
        self._wake = asyncio.Event()
        self._busy: dict[str, asyncio.Task[None]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False

    def wake(self) -> None:
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="action-worker")

    async def stop(self, grace: float = 5.0) -> None:
        """Stop taking work; give running actions ``grace`` seconds, then cancel (they resume on restart)."""
        self._stopping = True  # the loop also ends on its own should a cancel get lost in a race
        self.wake()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await self.engine.escalation.stop()
        running = list(self._busy.values())
        if running:
            _, late = await asyncio.wait(running, timeout=grace)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    async def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                timeout = await self._dispatch()
            except JournalUnwritable:  # logged by the journal; _writable paces the next attempt
                timeout = max(0.01, self._write_retry_at - time.monotonic())
            except sqlite3.Error as exc:  # a locked or failing journal: keep trying, never die
                log.error("event=journal_read_failed error=%r", exc)
                timeout = IDLE_POLL_SECONDS
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that
            # arrives just as the wake-up does, and the worker would never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    async def _writable(self) -> bool:
        """False while the journal refuses writes: nothing may start then, since what a step did could
        not be recorded. One attempt (a probe write, then the due actions) per back-off period, which
        doubles while failures go on, so a full disk costs neither a spin nor a flood of log lines."""
        now = time.monotonic()
        if self.journal.write_error is None:
            if now - self._write_failed_at > WRITE_RETRY_MAX_SECONDS:
                self._write_retry = WRITE_RETRY_INITIAL_SECONDS
            return True
        self._write_failed_at = now
        if now < self._write_retry_at:
            return False
        self._write_retry_at = now + self._write_retry
        self._write_retry = min(self._write_retry * 2, WRITE_RETRY_MAX_SECONDS)
        with contextlib.suppress(JournalUnwritable):
            await self.journal.probe()
        return self.journal.write_error is None

    async def _dispatch(self) -> float:
        """Start what is due; return how long to sleep unless woken."""
        if not await self._writable():
            return max(0.01, self._write_retry_at - time.monotonic())
        if time.monotonic() - self._pruned_at > PRUNE_EVERY_SECONDS or not self._pruned_at:
            self._pruned_at = time.monotonic()
            pruned = await self.journal.prune(time.time() - self.retention_seconds)
            if any(pruned.values()):
                log.info("event=journal_pruned %s", " ".join(f"{k}={v}" for k, v in pruned.items()))
        free = self.concurrency - len(self._busy)
        if free > 0:
            for action in await self.journal.due(time.time(), self._busy, free, YIELDING_REASONS):
                self._launch(action)
        chain_at = await self.engine.escalation.tick(self.wake)  # chains verified in tasks of their own
        now = time.time()
        future = [t for t in (await self.journal.next_due_at(), chain_at) if t is not None and t > now]
        return min([IDLE_POLL_SECONDS, *(t - now for t in future)])

    def _launch(self, action: Action) -> None:
        task = asyncio.create_task(self.engine.run(action), name=f"action-{action.id}")
        self._busy[action.node] = task

        def done(finished: asyncio.Task[None]) -> None:
            self._busy.pop(action.node, None)
            self._wake.set()
            if not finished.cancelled() and finished.exception() is not None:
                log.error("event=action_crashed id=%s error=%r (it stays journaled and is retried)",
                          action.id, finished.exception())

        task.add_done_callback(done)
