"""The escalation chain: per node and GPU, restart the job, then reset the GPU, then reboot, then replace,
each step verified before the next is tried.

An alert's own action that is a step of the chain opens one at that step (an alert that already asks
for a reset starts there). When a step's action ends, the chain waits ``settle_seconds`` and then
verifies it until its timeout: the alert that opened the chain no longer fires, the jobs a restart
requeued are running again, and after a reset or reboot the configured health check
(``undrain.health_check``, e.g. ``gpuhealth-validate``) passes. A passing verification closes the
chain (succeeded); a failing one at the timeout, the same alert firing again within ``window_seconds``
of the step (even after the chain succeeded: it is reopened), or a step that failed starts the next
step; after the last step (``replace``: a person decides) the chain is exhausted. The next step is an
ordinary journaled action, admitted through every guardrail as an alert's action is, never a side
door: this module only decides when to ask for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from gpuhealth.webhook.actions import KINDS, UNDRAIN
from gpuhealth.webhook.announce import Announcer
from gpuhealth.webhook.backends.base import Backend, BackendError
from gpuhealth.webhook.config import Config
from gpuhealth.webhook.labels import action_problem
from gpuhealth.webhook.outcomes import Reason
from gpuhealth.webhook.store import (
    AWAITING_APPROVAL,
    CANCELLED,
    DONE,
    EXHAUSTED,
    FAILED,
    PENDING,
    RUNNING,
    SKIPPED,
    SUCCEEDED,
    VERIFYING,
    Action,
    Chain,
    JournalUnwritable,
    Store,
)

log = logging.getLogger(__name__)

CONCURRENCY = 8  # chains verified at once (a health check may take minutes)
LAST_RESORT = "replace"  # a person decides what comes after it: nothing to verify


class Escalation:
    def __init__(self, config: Config, store: Store, backend: Backend, announcer: Announcer,
                 health_check: Callable[[str], Awaitable[tuple[bool, str]]]) -> None:
        self.config = config
        self.store = store
        self.backend = backend
        self.announcer = announcer
        self.health_check = health_check
        self._tasks: dict[int, asyncio.Task[None]] = {}

    @property
    def enabled(self) -> bool:
        return self.config.escalation.enabled

    async def action_ended(self, a: Action) -> None:
        """An action ended done: if it is an alert's own action and a step with a stronger one after it,
        a chain opens at that step (one per node and GPU; an active one is left as it is)."""
        steps = self.config.escalation.steps
        if not self.enabled or a.kind not in steps or a.kind == steps[-1]:
            return
        if await self.store.chain_for_action(a.id) is not None:
            return  # a chain's own step: the chain advances itself
        now = time.time()
        chain = Chain(0, a.node, a.gpu, a.alertname, a.fingerprint, a.starts_at, a.summary, a.kind, a.id,
                      RUNNING, f"opened by action {a.id} ({a.kind})", None, now, None, now, now, None)
        chain_id = await self.store.open_chain(chain)
        if chain_id is not None:
            chain.id = chain_id
            await self._tell(chain, "chain_opened", chain.detail)
            return
        active = await self.store.active_chain(a.node, a.gpu)
        if active is not None and steps.index(a.kind) > steps.index(active.step):
            # another alert already asked for a stronger step and it ran: that is the chain's step now
            moved = await self.store.move_chain(active.id, active.state, RUNNING,
                                                f"action {a.id} ({a.kind}) of {a.alertname} ran",
                                                verify_at=now, adopt=(a.kind, a.id))
            if moved is not None:
                await self._tell(moved, "chain_escalated", moved.detail, step=a.kind, from_step=active.step)

    async def tick(self, on_done: Callable[[], None]) -> float | None:
        """Start advancing the chains whose time came, each in its own task; when the next comes due."""
        if not self.enabled:
            return None
        free = CONCURRENCY - len(self._tasks)
        if free > 0:
            now = time.time()
            reopen_since = now - self.config.escalation.window_seconds
            for chain in await self.store.due_chains(now, self._tasks, free, reopen_since):
                task = asyncio.create_task(self._advance(chain), name=f"chain-{chain.id}")
                self._tasks[chain.id] = task

                def done(_: asyncio.Task[None], chain_id: int = chain.id) -> None:
                    self._tasks.pop(chain_id, None)
                    on_done()

                task.add_done_callback(done)
        return await self.store.next_chain_at()

    async def stop(self) -> None:
        """Stop verifying; a chain cut short is verified again after a restart (its state is journaled)."""
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def cancel(self, action_id: int, by: str) -> Chain | None:
        """Stop the active chain whose current step is ``action_id``: no further step is started."""
        chain = await self.store.chain_for_action(action_id)
        if chain is None:
            return None
        moved = await self.store.move_chain(chain.id, chain.state, CANCELLED, f"cancelled by {by}")
        if moved is not None:
            await self._tell(moved, "chain_cancelled", moved.detail, by=by)
        return moved

    # -- advancing one chain ---------------------------------------------------------------------

    async def _advance(self, chain: Chain) -> None:
        try:
            if chain.state == RUNNING:
                await self._step_ended(chain)
            elif chain.state == VERIFYING:
                await self._verify(chain)
            else:  # succeeded, and the same alert fired again within the window: the step did not hold
                await self._escalate(chain, f"{chain.alertname} fired again on {chain.node} within "
                                            f"{self.config.escalation.window_seconds:g}s of {chain.step}")
        except JournalUnwritable:
            pass  # logged by the journal; the chain is still as journaled and is taken up again
        except Exception as exc:  # a cluster that does not answer, or a bug: look again later, never spin
            if isinstance(exc, BackendError):
                log.warning("event=chain_check_failed chain=%s node=%s error=%r", chain.id, chain.node,
                            str(exc))
            else:
                log.exception("event=chain_error chain=%s node=%s", chain.id, chain.node)
            with contextlib.suppress(JournalUnwritable):
                await self.store.move_chain(chain.id, chain.state, chain.state, f"verification error: {exc}",
                                            verify_at=time.time() + self.config.escalation.poll_seconds)

    async def _step_ended(self, chain: Chain) -> None:
        """The current step's action ended: verify it, escalate past it, or end the chain."""
        cfg = self.config.escalation
        a = await self.store.get(chain.action_id)
        if a is None:
            await self._end(chain, CANCELLED, f"the action of step {chain.step} is gone")
        elif a.state == DONE and chain.step == LAST_RESORT:
            await self._end(chain, EXHAUSTED, f"{chain.step} done: a person decides what comes next")
        elif a.state == DONE:
            done_at = a.finished_at or time.time()
            moved = await self.store.move_chain(
                chain.id, RUNNING, VERIFYING, f"{chain.step} done; verifying", step_done_at=done_at,
                verify_at=done_at + cfg.settle_seconds, deadline=done_at + cfg.timeout(chain.step))
            if moved is not None:
                await self._tell(moved, "chain_verifying", moved.detail)
        elif a.state == FAILED:
            await self._escalate(chain, f"{chain.step} failed: {a.detail}")
        elif a.state == SKIPPED and a.reason == Reason.BREAKER_OPEN:  # a reset may replay or drop it
            await self.store.move_chain(chain.id, RUNNING, RUNNING, f"{chain.step} held by the breaker",
                                        verify_at=time.time() + cfg.poll_seconds)
        else:  # cancelled, or a guardrail said no (an operator's drain, the deny list): stop here
            await self._end(chain, CANCELLED, f"{chain.step} {a.state} ({a.reason}): {a.detail}")

    async def _verify(self, chain: Chain) -> None:
        cfg = self.config.escalation
        now = time.time()
        done_at = chain.step_done_at or chain.updated_at
        if await self.store.refired(chain.node, chain.gpu, chain.alertname, done_at,
                                    done_at + cfg.window_seconds, chain.alert):
            await self._escalate(chain, f"{chain.alertname} fired again on {chain.node} after {chain.step}")
            return
        ok, why = await self._checks(chain)
        if ok:
            await self._end(chain, SUCCEEDED, f"{chain.step} verified: {why}",
                            UNDRAIN if await self._drained_by_chain(chain) else None)
        elif chain.deadline is not None and now >= chain.deadline:
            limit = cfg.timeout(chain.step)
            await self._escalate(chain, f"{chain.step} not verified within {limit:g}s: {why}")
        else:
            deadline = chain.deadline if chain.deadline is not None else now + cfg.poll_seconds
            await self.store.move_chain(chain.id, VERIFYING, VERIFYING, f"verifying {chain.step}: {why}",
                                        verify_at=min(now + cfg.poll_seconds, deadline))

    async def _checks(self, chain: Chain) -> tuple[bool, str]:
        """The step's verification: (passed, what it found). The node's own state first (the health
        check after a reset or reboot, the requeued jobs after a restart), then the alert."""
        kind = KINDS[chain.step]
        found = []
        if {"reset_gpu", "reboot"} & set(kind.steps) and self.config.undrain.health_check:
            ok, output = await self.health_check(chain.node)
            if not ok:
                return False, f"health check failed: {output}"
            found.append(f"health check passed: {output}")
        if kind.moves_work_only:
            action = await self.store.get(chain.action_id)
            jobs = action.progress.get("requeued", []) if action is not None else []
            for job_id in jobs:
                state = await self.backend.job_state(job_id)
                if state.waiting:
                    return False, f"job {job_id} is {state.state}, not running again yet"
            found.append(f"requeued jobs running ({','.join(jobs) or 'none'})")
        if await self.store.alert_firing(chain.node, chain.gpu, chain.alertname):
            return False, f"{chain.alertname} still firing"
        return True, "; ".join([f"{chain.alertname} resolved", *found])

    def _next_step(self, chain: Chain) -> str | None:
        """The next step that can act on this node and GPU (a GPU reset needs the alert to name a GPU)."""
        steps = self.config.escalation.steps
        later = steps[steps.index(chain.step) + 1:] if chain.step in steps else ()
        usable = (s for s in later if action_problem(s, chain.node, chain.gpu, chain.alertname) is None)
        return next(usable, None)

    async def _escalate(self, chain: Chain, why: str) -> None:
        step = self._next_step(chain)
        if step is None:
            await self._end(chain, EXHAUSTED, f"{why}; no step left: a person decides")
            return
        state = AWAITING_APPROVAL if step in self.config.guardrails.require_approval else PENDING
        detail = f"{why}; next step {step}"
        moved = await self.store.escalate_chain(chain.id, chain.state, step, state, detail)
        if moved is not None:
            await self._tell(moved, "chain_escalated", moved.detail, step=step, from_step=chain.step)

    async def _drained_by_chain(self, chain: Chain) -> bool:
        """A step of this chain keeps the node drained: the alert has resolved (the chain succeeded), so
        its undrain is asked for again, in case it ran before that step drained the node once more."""
        entry = (await self.store.drained()).get(chain.node)
        if entry is None or entry.keep:
            return False
        owner = await self.store.get(entry.action_id)
        return owner is not None and owner.alert == chain.alert

    async def _end(self, chain: Chain, state: str, detail: str, follow_up: str | None = None) -> None:
        moved = await self.store.move_chain(chain.id, chain.state, state, detail, follow_up=follow_up)
        if moved is not None:
            await self._tell(moved, f"chain_{state}", detail)

    async def _tell(self, chain: Chain, event: str, detail: str, **extra: object) -> None:
        """The audit log (and, for an exhausted chain, Alertmanager) hears of every transition."""
        log.log(logging.WARNING if event == "chain_exhausted" else logging.INFO,
                "event=%s chain=%s node=%s gpu=%s step=%s action=%s detail=%r", event, chain.id, chain.node,
                chain.gpu, chain.step, chain.action_id, detail)
        action = await self.store.get(chain.action_id)
        if action is not None:
            await self.announcer.transition(action, event, detail, chain=chain.id, chain_state=chain.state,
                                            chain_step=chain.step, **extra)
