"""The decision engine: guardrails first, then the action's steps, each step journaled as it ends.

An action is admitted once (pending -> running) after every guardrail passed; from then on it only
moves forward through its steps, and a restart resumes after the last journaled step. Backends are
idempotent, so a step interrupted by a crash is safely sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import fnmatch
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gpuhealth.webhook.backends.base import Backend, BackendError, NodeState
from gpuhealth.webhook.config import ACTIONS, Config
from gpuhealth.webhook.journal import (
    BREAKER,
    CANCELLED,
    DONE,
    DRAINING_KINDS,
    FAILED,
    PENDING,
    RUNNING,
    SKIPPED,
    UNDRAIN,
    Action,
    AsyncJournal,
    JobRecord,
    JournalUnwritable,
)
from gpuhealth.webhook.labels import label_problem
from gpuhealth.webhook.metrics import Metrics
from gpuhealth.webhook.outcomes import Outcome, Reason
from gpuhealth.webhook.policy import STEPS, drain_reason, is_ours

log = logging.getLogger(__name__)

ACTING_DRAINS = (*DRAINING_KINDS, "replace")
FINAL_STATE = {Outcome.DONE: DONE, Outcome.DRY_RUN: DONE, Outcome.FAILED: FAILED,
               Outcome.CANCELLED: CANCELLED}  # anything else ends SKIPPED


@dataclass(frozen=True)
class Verdict:
    """A guardrail's answer that ends or postpones admission."""

    outcome: Outcome
    reason: Reason
    detail: str
    retry_at: float | None = None  # for DEFERRED
    drop_drained: bool = False
    started: bool = False  # the action was moved to running before this verdict (dry-run)


class Halt(Exception):
    """A step cannot go on now: it must wait (retry interval, failed health check) or end the action."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.detail)
        self.verdict = verdict


def _matches(node: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(node, p) for p in patterns)


class Engine:
    def __init__(self, config: Config, backend: Backend, journal: AsyncJournal, metrics: Metrics) -> None:
        self.config = config
        self.backend = backend
        self.journal = journal
        self.db = journal.sync
        self.metrics = metrics
        self._admission = asyncio.Lock()  # one admission at a time: the breaker count stays exact
        self._unsaved: dict[int, tuple[Callable[..., object], tuple[object, ...]]] = {}

    async def breaker(self) -> dict[str, Any]:
        return await self.journal.call(self.db.get_meta, BREAKER) or {"open": False}

    async def reset_breaker(self, by: str) -> dict[str, Any]:
        """Close the breaker; undrains it skipped run again, since their nodes are still out."""
        state = {"open": False, "since": time.time(), "reason": f"reset by {by}"}
        rearmed = await self.journal.write(self.db.reset_breaker, state, by)
        self.metrics.breaker_open.set(0)
        log.warning("event=breaker_reset by=%s undrains_rearmed=%d", by, len(rearmed))
        return state

    async def run(self, action: Action) -> None:
        """Carry ``action`` forward as far as it can go now; every outcome lands in the journal.

        While the journal cannot be written nothing moves: the write that followed a side effect is
        kept here and lands first, so no step is ever sent again for want of its record.
        """
        with contextlib.suppress(JournalUnwritable):  # logged once by the journal; the worker backs off
            await self._run(action)

    async def _run(self, action: Action) -> None:
        try:
            if action.id in self._unsaved:
                fn, args = self._unsaved[action.id]
                await self.journal.write(fn, *args)
                del self._unsaved[action.id]
                refreshed = await self.journal.call(self.db.get, action.id)
                if refreshed is None or refreshed.state not in (PENDING, RUNNING):
                    return
                action = refreshed
            if action.state == PENDING:
                async with self._admission:
                    verdict = await self._admit(action)
                if verdict is not None:
                    await self._conclude(replace(action, state=RUNNING) if verdict.started else action,
                                         verdict)
                    return
                refreshed = await self.journal.call(self.db.get, action.id)
                if refreshed is None or refreshed.state != RUNNING:
                    return
                action = refreshed
            await self._steps(action)
        except JournalUnwritable:
            raise
        except Halt as halt:
            await self._conclude(action, halt.verdict)
        except BackendError as exc:
            await self._backend_failed(action, str(exc), exc.retryable)
        except Exception as exc:  # a bug must not spin or lose the action: back off and keep it
            log.exception("event=action_error id=%s kind=%s node=%s", action.id, action.kind, action.node)
            await self._backend_failed(action, f"internal error: {exc!r}", True)

    async def _after_effect(self, a: Action, fn: Callable[..., object], *args: object) -> None:
        """Journal what a side effect did; if the journal refuses, keep the write to land first."""
        try:
            await self.journal.write(fn, *args)
        except JournalUnwritable:
            self._unsaved[a.id] = (fn, copy.deepcopy(args))
            raise

    # -- admission ---------------------------------------------------------------------------

    async def _admit(self, a: Action) -> Verdict | None:
        if a.kind == "none":
            return Verdict(Outcome.DONE, Reason.RECORD_ONLY, "recorded only (action none)")
        problem = label_problem(a.node, a.gpu, a.alertname)  # journaled before the check existed
        if problem is not None:
            return Verdict(Outcome.SKIPPED, *problem)
        verdict = await (self._admit_undrain(a) if a.kind == UNDRAIN else self._admit_action(a))
        if verdict is not None:
            return verdict
        reserve = None
        if a.kind in ACTING_DRAINS:
            reserve = (a.node, self._reason(a), a.kind == "replace")
        started = await self.journal.write(self.db.start, a.id, reserve)
        if self.config.dry_run:  # started and reserved as the real one would be, so that every guardrail
            # (rate limit, cooldown, breaker) counts it; it ends here, having done nothing
            return Verdict(Outcome.DRY_RUN, Reason.DRY_RUN, "would " + self._plan(a), started=started,
                           drop_drained=a.kind == UNDRAIN)
        if started:
            log.info("event=action_started id=%s kind=%s node=%s gpu=%s alertname=%s plan=%r", a.id, a.kind,
                     a.node, a.gpu, a.alertname, self._plan(a))
        return None

    async def _state(self, node: str) -> NodeState | None:
        """The node's state; in dry-run an unreachable cluster is tolerated (None: unknown)."""
        try:
            return await self.backend.node_state(node)
        except BackendError:
            if self.config.dry_run:
                return None
            raise

    async def _admit_action(self, a: Action) -> Verdict | None:
        g = self.config.guardrails
        if _matches(a.node, g.deny_nodes):
            return Verdict(Outcome.SKIPPED, Reason.DENIED, f"{a.node} is on the deny list")
        if g.allow_nodes and not _matches(a.node, g.allow_nodes):
            return Verdict(Outcome.SKIPPED, Reason.NOT_ALLOWED, f"{a.node} is not on the allow list")
        if (await self.breaker())["open"]:
            return Verdict(Outcome.SKIPPED, Reason.BREAKER_OPEN, "the circuit breaker is open")
        state = await self._state(a.node)
        drained_by_us = False
        if state is not None:
            if not state.exists:
                return Verdict(Outcome.SKIPPED, Reason.UNKNOWN_NODE, f"the cluster has no node {a.node}")
            if state.drained and not is_ours(state.reason):
                return Verdict(Outcome.SKIPPED, Reason.DRAINED_BY_OTHER,
                               f"{a.node} was drained by someone else: {state.reason!r}")
            drained_by_us = state.drained
            if a.kind == "drain" and drained_by_us:
                return Verdict(Outcome.SKIPPED, Reason.ALREADY_DRAINED, f"{a.node} is already drained by us")
        now = time.time()
        # Only as strong an action counts (ACTIONS runs weakest first): a drain after a requeue, or a
        # reboot after a drain, is an escalation the cooldown must not hold back.
        last = await self.journal.call(self.db.last_acted_at, a.node, a.id, ACTIONS[ACTIONS.index(a.kind):])
        if last is not None and now - last < g.node_cooldown_seconds:
            return Verdict(Outcome.DEFERRED, Reason.COOLDOWN,
                           f"{a.node} was acted on {now - last:.0f}s ago (cooldown "
                           f"{g.node_cooldown_seconds:.0f}s)", last + g.node_cooldown_seconds)
        window = g.rate_limit_window_seconds
        retry_at = await self.journal.call(self.db.rate_limited_until, now - window, g.rate_limit_actions,
                                           window)
        if retry_at is not None:
            return Verdict(Outcome.DEFERRED, Reason.RATE_LIMITED,
                           f"{g.rate_limit_actions} actions started in the last {window:.0f}s (the limit)",
                           retry_at)
        if a.kind in ACTING_DRAINS and not drained_by_us:
            return await self._check_breaker(a)
        if a.kind == "restart_job":
            return await self._check_requeue_cap(a)
        return None

    async def _check_breaker(self, a: Action) -> Verdict | None:
        """Count what we drained, from the journal: a backend that cannot see drains (or a human who
        resumed a node while its alert still fires) must not let a storm through."""
        g = self.config.guardrails
        fleet: int | None = None  # dry-run without a reachable cluster: only breaker_max_nodes applies
        try:
            fleet = await self.backend.fleet_size()
        except BackendError:
            if not self.config.dry_run:
                raise
        cap = g.breaker_max_nodes
        if fleet is not None:
            cap = min(cap, max(1, math.floor(g.breaker_max_fraction * fleet)))
        ours = set(await self.journal.call(self.db.drained))
        would_be = len(ours - {a.node}) + 1
        if would_be <= cap:
            return None
        return await self._trip(a, f"draining {a.node} would make {would_be} nodes drained by gpuhealth; cap "
                                   f"is {cap} (breaker_max_nodes {g.breaker_max_nodes}, breaker_max_fraction "
                                   f"{g.breaker_max_fraction:g} of {fleet} nodes)")

    async def _check_requeue_cap(self, a: Action) -> Verdict | None:
        """Requeueing moves work without draining, so it has its own cap: nodes in a window."""
        g = self.config.guardrails
        since = time.time() - g.requeue_breaker_window_seconds
        nodes = await self.journal.call(self.db.nodes_started, "restart_job", since, a.node)
        if nodes + 1 <= g.requeue_breaker_max_nodes:
            return None
        return await self._trip(a, f"requeueing on {a.node} would make {nodes + 1} nodes whose jobs "
                                   f"gpuhealth requeued in {g.requeue_breaker_window_seconds:.0f}s; cap is "
                                   f"{g.requeue_breaker_max_nodes} (requeue_breaker_max_nodes)")

    async def _trip(self, a: Action, reason: str) -> Verdict:
        state = {"open": True, "since": time.time(), "reason": reason}
        await self.journal.write(self.db.set_meta, BREAKER, state)
        self.metrics.breaker_open.set(1)
        log.error("event=breaker_tripped id=%s kind=%s node=%s reason=%r", a.id, a.kind, a.node, reason)
        return Verdict(Outcome.SKIPPED, Reason.BREAKER_OPEN, f"circuit breaker tripped: {reason}")

    async def _admit_undrain(self, a: Action) -> Verdict | None:
        entry = (await self.journal.call(self.db.drained)).get(a.node)
        if entry is None:
            return Verdict(Outcome.SKIPPED, Reason.NOT_DRAINED_BY_US, f"{a.node} is not drained by us")
        if entry["keep"]:
            return Verdict(Outcome.SKIPPED, Reason.LEFT_FOR_HUMAN, f"{a.node} is left drained for a human")
        if await self.journal.call(self.db.firing_drains, a.node, (a.fingerprint, a.starts_at)):
            return Verdict(Outcome.SKIPPED, Reason.STILL_FIRING, f"other alerts still keep {a.node} drained")
        if self.config.undrain.mode == "manual":
            return Verdict(Outcome.SKIPPED, Reason.LEFT_FOR_HUMAN, "undrain mode is manual")
        if (await self.breaker())["open"]:
            return Verdict(Outcome.SKIPPED, Reason.BREAKER_OPEN, "the circuit breaker is open")
        if self.config.dry_run:
            return None  # a node drained in dry-run was never drained: it would be resumed
        return self._ownership(a, await self.backend.node_state(a.node), "resume")

    @staticmethod
    def _ownership(a: Action, state: NodeState, step: str) -> Verdict | None:
        """None when ``step`` may change the node now: it is ours to drain, or drained by us."""
        if not state.exists:
            return Verdict(Outcome.SKIPPED, Reason.UNKNOWN_NODE, f"the cluster has no node {a.node}",
                           drop_drained=True)
        if state.drained and not is_ours(state.reason):
            return Verdict(Outcome.SKIPPED, Reason.DRAINED_BY_OTHER,
                           f"{a.node} was drained by someone else before {step}: {state.reason!r}",
                           drop_drained=True)
        if step == "resume" and not state.drained:
            return Verdict(Outcome.DONE, Reason.ALREADY_RESUMED, f"{a.node} is already back in service",
                           drop_drained=True)
        if step in ("reset_gpu", "reboot") and not state.drained:
            return Verdict(Outcome.SKIPPED, Reason.NOT_DRAINED_BY_US,
                           f"{a.node} was put back in service by someone else before {step}",
                           drop_drained=True)
        return None

    # -- steps -------------------------------------------------------------------------------

    async def _steps(self, a: Action) -> None:
        progress = dict(a.progress)
        done = progress.setdefault("done", [])
        for step in STEPS[a.kind]:
            if step in done:
                continue
            await getattr(self, f"_step_{step}")(a, progress)
            done.append(step)
            await self._after_effect(a, self.db.save_progress, a.id, progress)
        summary = self._summary(a, progress)
        await self._conclude(a, Verdict(Outcome.DONE, Reason.OK, summary, drop_drained=a.kind == UNDRAIN))

    async def _readmit(self, a: Action, step: str) -> None:
        """Re-admission right before a step that changes the node: an operator's drain always wins."""
        verdict = self._ownership(a, await self.backend.node_state(a.node), step)
        if verdict is not None:
            raise Halt(verdict)

    async def _step_drain(self, a: Action, progress: dict[str, Any]) -> None:
        await self._readmit(a, "drain")
        await self.backend.drain(a.node, self._reason(a))

    async def _step_requeue(self, a: Action, progress: dict[str, Any]) -> None:
        if "jobs" not in progress:
            progress["jobs"] = sorted(await self.backend.jobs_on_node(a.node))
            await self.journal.write(self.db.save_progress, a.id, progress)
        retry = self.config.retry
        handled = progress.setdefault("requeued", []), progress.setdefault("exhausted", [])
        for job_id in progress["jobs"]:
            if any(job_id in group for group in handled):
                continue
            job = await self.journal.call(self.db.job, job_id) or JobRecord(job_id, 0, 0.0, [], False, "")
            if job.attempts >= retry.job_max_attempts:
                handled[1].append(job_id)
                job.exhausted = True
                await self.journal.write(self.db.job_requeued, a.id, progress, job)
                log.warning("event=job_retry_exhausted job=%s attempts=%d nodes=%s", job_id, job.attempts,
                            ",".join([*job.excluded, a.node]))
                continue
            wait_until = job.last_at + retry.job_retry_interval_seconds
            if job.attempts and wait_until > time.time():
                detail = f"job {job_id} was requeued {time.time() - job.last_at:.0f}s ago"
                raise Halt(Verdict(Outcome.DEFERRED, Reason.JOB_RETRY_INTERVAL, detail, wait_until))
            excluded = sorted({*job.excluded, a.node})
            await self.backend.requeue(job_id, excluded)
            handled[0].append(job_id)
            record = JobRecord(job_id, job.attempts + 1, time.time(), excluded, False, a.node)
            await self._after_effect(a, self.db.job_requeued, a.id, progress, record)
            log.info("event=job_requeued job=%s attempt=%d exclude=%s", job_id, job.attempts + 1,
                     ",".join(excluded))

    async def _step_reset_gpu(self, a: Action, progress: dict[str, Any]) -> None:
        await self._readmit(a, "reset_gpu")
        await self.backend.reset_gpu(a.node, a.gpu or None, self._reason(a))

    async def _step_reboot(self, a: Action, progress: dict[str, Any]) -> None:
        await self._readmit(a, "reboot")
        await self.backend.reboot(a.node, self._reason(a))

    async def _step_resume(self, a: Action, progress: dict[str, Any]) -> None:
        cfg = self.config.undrain
        if cfg.health_check:
            ok, output = await self._health_check(a.node)
            if not ok:
                progress["health_checks_failed"] = progress.get("health_checks_failed", 0) + 1
                await self.journal.write(self.db.save_progress, a.id, progress)
                if progress["health_checks_failed"] >= cfg.health_check_max_attempts:
                    await self.journal.write(self.db.keep_drained, a.node)
                    raise Halt(Verdict(Outcome.SKIPPED, Reason.HEALTH_CHECK_FAILED,
                                       f"health check failed, node left drained: {output}"))
                retry_at = time.time() + cfg.health_check_retry_seconds
                raise Halt(Verdict(Outcome.DEFERRED, Reason.HEALTH_CHECK_FAILED,
                                   f"health check failed: {output}", retry_at))
        await self._readmit(a, "resume")  # after the health check, which may take minutes
        await self.backend.resume(a.node)

    async def _health_check(self, node: str) -> tuple[bool, str]:
        cfg = self.config.undrain
        argv = [arg.replace("{node}", node) for arg in cfg.health_check]
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
        except OSError as exc:
            return False, f"cannot run {argv[0]}: {exc.strerror}"
        try:
            async with asyncio.timeout(cfg.health_check_timeout_seconds):
                out, _ = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return False, f"timed out after {cfg.health_check_timeout_seconds:g}s"
        text = out.decode(errors="replace").strip()[-300:]
        return proc.returncode == 0, f"exit {proc.returncode}: {text}"

    # -- endings -----------------------------------------------------------------------------

    async def _backend_failed(self, a: Action, error: str, retryable: bool) -> None:
        current = await self.journal.call(self.db.get, a.id)
        attempts = (current.attempts if current else a.attempts) + 1
        retry = self.config.retry
        if retryable and attempts < retry.backend_max_attempts:
            delay = min(retry.backoff_initial_seconds * 2 ** (attempts - 1), retry.backoff_max_seconds)
            verdict = Verdict(Outcome.DEFERRED, Reason.BACKEND_ERROR, error, time.time() + delay)
        else:
            verdict = Verdict(Outcome.FAILED, Reason.BACKEND_ERROR, error)
        await self._conclude(a, verdict, attempts=attempts)

    async def _conclude(self, a: Action, v: Verdict, **extra: Any) -> None:
        """Journal the verdict, provided ``a`` is still in the state the worker found it in."""
        fields = {"outcome": v.outcome.value, "reason": v.reason.value, "detail": v.detail, **extra}
        if v.outcome is Outcome.DEFERRED:
            fields |= {"next_at": v.retry_at}
            state = a.state
        else:
            fields |= {"drop_drained": a.node if v.drop_drained else None}
            state = FINAL_STATE.get(v.outcome, SKIPPED)
        if not await self.journal.write(self.db.update, a.id, state, expect=a.state, **fields):
            log.info("event=action_changed_meanwhile id=%s kind=%s node=%s verdict=%s", a.id, a.kind, a.node,
                     v.reason.value)
            return
        if v.outcome is Outcome.DONE and a.kind != "none":
            self.metrics.latency.observe(max(0.0, time.time() - a.received_at))
        self.metrics.action(a.kind, v.outcome, v.reason)
        level = logging.WARNING if v.outcome in (Outcome.FAILED, Outcome.SKIPPED) else logging.INFO
        log.log(level, "event=action_%s id=%s kind=%s node=%s gpu=%s alertname=%s reason=%s detail=%r",
                v.outcome.value, a.id, a.kind, a.node, a.gpu, a.alertname, v.reason.value, v.detail)

    def _reason(self, a: Action) -> str:
        summary = f"replace requested: {a.summary}" if a.kind == "replace" else a.summary
        return drain_reason(a.alertname, summary)

    def _plan(self, a: Action) -> str:
        words = {"drain": f"drain {a.node} ({self._reason(a)!r})",
                 "requeue": f"requeue the jobs on {a.node} excluding it",
                 "reset_gpu": f"reset GPU {a.gpu or 'all'} on {a.node}",
                 "reboot": f"reboot {a.node}",
                 "resume": f"resume {a.node}"}
        return ", then ".join(words[s] for s in STEPS[a.kind])

    @staticmethod
    def _summary(a: Action, progress: dict[str, Any]) -> str:
        parts = [", ".join(progress.get("done", []))]
        if progress.get("requeued"):
            parts.append(f"requeued jobs {','.join(progress['requeued'])}")
        if progress.get("exhausted"):
            parts.append(f"jobs out of retries {','.join(progress['exhausted'])}")
        return "; ".join(p for p in parts if p)
