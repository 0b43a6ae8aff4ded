"""The decision engine: guardrails first, then the action's steps, each step journaled as it ends.

An action is admitted once (pending -> running) after every guardrail passed; from then on it only
moves forward through its steps, and a restart resumes after the last journaled step. Backends are
idempotent, so a step interrupted by a crash is safely sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuhealth.webhook import guardrails, process
from gpuhealth.webhook.actions import DRAINING, KINDS, NONE, STEPS, UNDRAIN
from gpuhealth.webhook.announce import FOR_HUMANS, Announcer
from gpuhealth.webhook.backends.base import Backend, BackendError
from gpuhealth.webhook.backends.command import check_node, fill
from gpuhealth.webhook.config import Config
from gpuhealth.webhook.escalation import Escalation
from gpuhealth.webhook.guardrails import BREAKER, Admission, Verdict
from gpuhealth.webhook.metrics import Metrics
from gpuhealth.webhook.outcomes import Outcome, Reason
from gpuhealth.webhook.policy import drain_reason
from gpuhealth.webhook.store import (
    CANCELLED,
    DONE,
    FAILED,
    PENDING,
    RUNNING,
    SKIPPED,
    Action,
    DrainedNode,
    JobRecord,
    JournalUnwritable,
    Store,
)

log = logging.getLogger(__name__)

FINAL_STATE = {Outcome.DONE: DONE, Outcome.DRY_RUN: DONE, Outcome.FAILED: FAILED,
               Outcome.CANCELLED: CANCELLED}  # anything else ends SKIPPED


def newest_mtime(path: Path) -> float:
    """When ``path`` (a checkpoint file, or the newest file of a checkpoint folder) last changed; 0 if
    there is none."""
    try:
        if not path.is_dir():
            return path.stat().st_mtime
        return max((entry.stat().st_mtime for entry in path.iterdir()
                    if entry.is_file() and not entry.name.startswith(".")),  # not a partial write
                   default=0.0)
    except OSError:
        return 0.0


class Halt(Exception):
    """A step cannot go on now: it must wait (retry interval, failed health check) or end the action."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.detail)
        self.verdict = verdict


class Engine:
    def __init__(self, config: Config, backend: Backend, store: Store, metrics: Metrics,
                 announcer: Announcer) -> None:
        self.config = config
        self.announcer = announcer
        self.backend = backend
        self.store = store
        self.metrics = metrics
        self._admission = asyncio.Lock()  # one admission at a time: the breaker count stays exact
        self._unsaved: dict[int, Callable[[], Awaitable[object]]] = {}
        self._runners: dict[str, Callable[[Action, dict[str, Any]], Awaitable[None]]] = {
            "checkpoint": self._checkpoint, "drain": self._drain, "requeue": self._requeue,
            "reset_gpu": self._reset_gpu, "reboot": self._reboot,
            "resume": self._resume}  # one per step of the action table
        self.escalation = Escalation(config, store, backend, announcer, self._health_check)

    async def breaker(self) -> dict[str, Any]:
        return await guardrails.breaker_state(self.store)

    async def held_by_breaker(self) -> list[Action]:
        """Actions the open breaker skipped that no reset has replayed or dropped yet: selected by the
        journal, so that a flood of other skipped actions can neither hide them nor cost each read."""
        return await self.store.list_actions(state=SKIPPED, reason=Reason.BREAKER_OPEN.value, limit=10_000)

    async def reset_breaker(self, by: str, held: str = "keep") -> dict[str, Any]:
        """Close the breaker. Undrains it skipped always run again, since their nodes are still out;
        the other actions it held are replayed (``replay``: through every guardrail again, so a storm
        that is still on trips it again), dropped with a record (``drop``), or kept listed (``keep``)."""
        state = {"open": False, "since": time.time(), "reason": f"reset by {by}"}
        waiting = await self.held_by_breaker()
        replayed = await self.store.rearm(UNDRAIN, Reason.BREAKER_OPEN,
                                          f"re-armed by the breaker reset ({by})", (BREAKER, state))
        dropped: list[int] = []
        if held == "replay":
            for kind in sorted({a.kind for a in waiting} - {UNDRAIN}):
                replayed += await self.store.rearm(kind, Reason.BREAKER_OPEN,
                                                   f"replayed by the breaker reset ({by})", (BREAKER, state))
        for a in waiting:
            if held == "drop" and a.kind != UNDRAIN and await self.store.try_move(
                    a.id, (SKIPPED,), SKIPPED, Reason.DROPPED_AT_RESET.value,
                    f"held by the breaker, dropped at its reset by {by}", Outcome.SKIPPED.value):
                dropped.append(a.id)
                self.metrics.action(a.kind, Outcome.SKIPPED, Reason.DROPPED_AT_RESET)
        for a in waiting:
            if a.id in replayed or a.id in dropped:
                await self.announcer.transition(a, "replayed" if a.id in replayed else "dropped",
                                                f"breaker reset by {by}", by=by)
        self.metrics.breaker_open.set(0)
        log.warning("event=breaker_reset by=%s held=%s replayed=%d dropped=%d kept=%d", by, held,
                    len(replayed), len(dropped), len(waiting) - len(replayed) - len(dropped))
        return state | {"replayed": sorted(replayed), "dropped": dropped}

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
                await self._unsaved[action.id]()
                del self._unsaved[action.id]
                refreshed = await self.store.get(action.id)
                if refreshed is None or refreshed.state not in (PENDING, RUNNING):
                    return
                action = refreshed
            if action.state == PENDING:
                verdict = await self._admit(action)
                if verdict is not None:
                    await self._conclude(replace(action, state=RUNNING) if verdict.started else action,
                                         verdict)
                    return
                refreshed = await self.store.get(action.id)
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

    async def _after_effect(self, a: Action, write: Callable[[], Awaitable[object]]) -> None:
        """Journal what a side effect did; if the journal refuses, keep the write to land first."""
        try:
            await write()
        except JournalUnwritable:
            self._unsaved[a.id] = write
            raise

    # -- admission ---------------------------------------------------------------------------

    async def _admit(self, a: Action) -> Verdict | None:
        """The guardrails, then pending -> running (reserving a node we drain, for the breaker).

        The fleet's admission lock is held for the decision only (the checks that count the fleet, and
        the start): the checks before it, and the cluster's reads, run beside other admissions."""
        ctx = Admission(a, self.config, self.backend, self.store, self.metrics)
        verdict = await guardrails.before_lock(ctx)
        if verdict is not None:
            return verdict
        async with self._admission, self.store.admission():
            verdict = await guardrails.under_lock(ctx)
            if verdict is not None:
                return verdict
            reserve = None
            if a.kind in DRAINING:
                reserve = DrainedNode(a.node, a.id, time.time(), self._reason(a),
                                      keep=not KINDS[a.kind].undone_on_resolve)
            started = await self.store.start(a.id, reserve)
        if self.config.dry_run:  # started and reserved as the real one would be, so that every guardrail
            # (rate limit, cooldown, breaker) counts it; it ends here, having done nothing
            return Verdict(Outcome.DRY_RUN, Reason.DRY_RUN, "would " + self._plan(a), started=started,
                           drop_drained=a.kind == UNDRAIN)
        if started:
            log.info("event=action_started id=%s kind=%s node=%s gpu=%s alertname=%s plan=%r", a.id, a.kind,
                     a.node, a.gpu, a.alertname, self._plan(a))
            await self.announcer.transition(a, "started", self._plan(a))
        return None

    # -- steps -------------------------------------------------------------------------------

    async def _steps(self, a: Action) -> None:
        progress = dict(a.progress)
        done = progress.setdefault("done", [])
        for step in KINDS[a.kind].steps:
            if step in done:
                continue
            current = await self.store.get(a.id)
            if current is None or current.state != RUNNING:  # cancelled through the API meanwhile
                log.warning("event=action_stopped id=%s kind=%s node=%s state=%s before=%s", a.id, a.kind,
                            a.node, current.state if current else "pruned", step)
                await self.announcer.transition(a, "cancelled", f"stopped before {step}",
                                                done=list(done))
                return
            if STEPS[step].changes_node:
                if step == "resume":
                    await self._health_gate(a, progress)  # first: it may take minutes
                await self._readmit(a, step)
            await self._runners[step](a, progress)
            done.append(step)
            await self._after_effect(a, self._progress_write(a.id, progress))
            await self.announcer.transition(a, "step_done", step, step=step)
        summary = self._summary(progress)
        await self._conclude(a, Verdict(Outcome.DONE, Reason.OK, summary, drop_drained=a.kind == UNDRAIN))

    async def _readmit(self, a: Action, step: str) -> None:
        """Re-admission right before a step that changes the node: an operator's drain always wins."""
        verdict = guardrails.ownership(a, await self.backend.node_state(a.node), step)
        if verdict is not None:
            raise Halt(verdict)

    async def _checkpoint(self, a: Action, progress: dict[str, Any]) -> None:
        """Ask the node's jobs to checkpoint, then wait up to the grace for each to confirm.

        The signal time is journaled before the signals go out, so a restarted webhook waits out the
        same grace instead of signalling again. A job that could not be signalled is not waited for:
        saving work is worth a short wait, never a drain that does not happen.
        """
        cfg = self.config.checkpoint
        state = progress.setdefault("checkpoint", {})
        if "signalled_at" not in state:
            state.update(jobs=sorted(await self.backend.jobs_on_node(a.node)), signalled_at=time.time())
            await self.store.save_progress(a.id, progress)
            errors = state.setdefault("errors", {})
            for job_id in state["jobs"]:
                try:
                    await self.backend.signal_job(job_id, cfg.signal, cfg.target)
                except BackendError as exc:
                    errors[job_id] = str(exc)[-300:]
            await self.store.save_progress(a.id, progress)
        deadline = state["signalled_at"] + cfg.grace_seconds
        waiting = [job for job in state["jobs"] if job not in state.get("errors", {})]
        while True:
            waiting = [job for job in waiting if not await self._checkpointed(job, state["signalled_at"])]
            if not waiting or time.time() >= deadline:
                break
            await asyncio.sleep(min(cfg.poll_seconds, max(0.0, deadline - time.time())))
        state["unconfirmed"] = waiting
        errors = state.get("errors", {})
        state["confirmed"] = [j for j in state["jobs"] if j not in waiting and j not in errors]
        state["ended_at"] = time.time()
        log.info("event=checkpoint_waited id=%s node=%s confirmed=%s unconfirmed=%s not_signalled=%s "
                 "seconds=%.1f", a.id, a.node, ",".join(state["confirmed"]), ",".join(waiting),
                 ",".join(state.get("errors", {})), state["ended_at"] - state["signalled_at"])

    async def _checkpointed(self, job_id: str, since: float) -> bool:
        """The job's own exit always confirms; otherwise what ``checkpoint.confirm`` names."""
        cfg = self.config.checkpoint
        job = await self.backend.job_state(job_id)
        if not job.active:
            return True
        if cfg.confirm == "comment":
            return cfg.comment.search(job.comment) is not None
        if cfg.confirm == "file" and cfg.path:
            return newest_mtime(Path(cfg.path.format(job_id=job_id))) > since
        return False

    async def _drain(self, a: Action, progress: dict[str, Any]) -> None:
        await self.backend.drain(a.node, self._reason(a), alertname=a.alertname)

    async def _requeue(self, a: Action, progress: dict[str, Any]) -> None:
        if "jobs" not in progress:  # with those asked to checkpoint: one may have ended since
            signalled = progress.get("checkpoint", {}).get("jobs", [])
            progress["jobs"] = sorted({*signalled, *await self.backend.jobs_on_node(a.node)})
            await self.store.save_progress(a.id, progress)
        retry = self.config.retry
        handled = progress.setdefault("requeued", []), progress.setdefault("exhausted", [])
        for job_id in progress["jobs"]:
            if any(job_id in group for group in handled):
                continue
            job = await self.store.job(job_id) or JobRecord(job_id, 0, 0.0, [], False, "")
            if job.attempts >= retry.job_max_attempts:
                handled[1].append(job_id)
                job.exhausted = True
                await self.store.job_requeued(a.id, progress, job)
                log.warning("event=job_retry_exhausted job=%s attempts=%d nodes=%s", job_id, job.attempts,
                            ",".join([*job.excluded, a.node]))
                await self.announcer.transition(
                    a, "jobs_exhausted", f"job {job_id} failed on {job.attempts + 1} nodes; left alone",
                    job=job_id, nodes=[*job.excluded, a.node])
                continue
            wait_until = job.last_at + retry.job_retry_interval_seconds
            if job.attempts and wait_until > time.time():
                detail = f"job {job_id} was requeued {time.time() - job.last_at:.0f}s ago"
                raise Halt(Verdict(Outcome.DEFERRED, Reason.JOB_RETRY_INTERVAL, detail, wait_until))
            excluded = sorted({*job.excluded, a.node})
            await self.backend.requeue(job_id, excluded)
            handled[0].append(job_id)
            record = JobRecord(job_id, job.attempts + 1, time.time(), excluded, False, a.node)
            await self._after_effect(a, self._progress_write(a.id, progress, record))
            log.info("event=job_requeued job=%s attempt=%d exclude=%s", job_id, job.attempts + 1,
                     ",".join(excluded))

    def _progress_write(self, action_id: int, progress: dict[str, Any], job: JobRecord | None = None
                        ) -> Callable[[], Awaitable[None]]:
        """The journal write for a finished step (or one requeued job), on a copy of the progress as it
        is now: kept as it is should the journal refuse it."""
        saved = copy.deepcopy(progress)
        if job is None:
            return lambda: self.store.save_progress(action_id, saved)
        return lambda: self.store.job_requeued(action_id, saved, job)

    async def _reset_gpu(self, a: Action, progress: dict[str, Any]) -> None:
        await self.backend.reset_gpu(a.node, a.gpu, self._reason(a), alertname=a.alertname)

    async def _reboot(self, a: Action, progress: dict[str, Any]) -> None:
        await self.backend.reboot(a.node, self._reason(a), alertname=a.alertname)

    async def _resume(self, a: Action, progress: dict[str, Any]) -> None:
        await self.backend.resume(a.node)

    async def _health_gate(self, a: Action, progress: dict[str, Any]) -> None:
        """The configured health check must pass before a resume; after enough failures the node is
        left drained for a human."""
        cfg = self.config.undrain
        if not cfg.health_check:
            return
        ok, output = await self._health_check(a.node)
        if ok:
            return
        progress["health_checks_failed"] = progress.get("health_checks_failed", 0) + 1
        await self.store.save_progress(a.id, progress)
        if progress["health_checks_failed"] >= cfg.health_check_max_attempts:
            await self.store.keep_drained(a.node)
            raise Halt(Verdict(Outcome.SKIPPED, Reason.HEALTH_CHECK_FAILED,
                               f"health check failed, node left drained: {output}"))
        retry_at = time.time() + cfg.health_check_retry_seconds
        raise Halt(Verdict(Outcome.DEFERRED, Reason.HEALTH_CHECK_FAILED, f"health check failed: {output}",
                           retry_at))

    async def _health_check(self, node: str) -> tuple[bool, str]:
        """Run the check with ``{node}`` filled in as one argv element, held to the node grammar first."""
        cfg = self.config.undrain
        argv = fill(cfg.health_check, {"node": check_node(node)})
        try:
            done = await process.run(argv, timeout=cfg.health_check_timeout_seconds, merge_stderr=True)
        except (process.NotStarted, process.TimedOut) as exc:
            log.warning("event=health_check node=%s ok=false detail=%r", node, str(exc))
            return False, str(exc)
        text = done.stdout.decode(errors="replace").strip()[-300:]
        ok = done.returncode == 0
        log.log(logging.INFO if ok else logging.WARNING, "event=health_check node=%s ok=%s exit=%d",
                node, str(ok).lower(), done.returncode)
        return ok, f"exit {done.returncode}: {text}"

    # -- endings -----------------------------------------------------------------------------

    async def _backend_failed(self, a: Action, error: str, retryable: bool) -> None:
        current = await self.store.get(a.id)
        attempts = (current.attempts if current else a.attempts) + 1
        retry = self.config.retry
        if retryable and attempts < retry.backend_max_attempts:
            delay = min(retry.backoff_initial_seconds * 2 ** (attempts - 1), retry.backoff_max_seconds)
            verdict = Verdict(Outcome.DEFERRED, Reason.BACKEND_ERROR, error, time.time() + delay)
        else:
            verdict = Verdict(Outcome.FAILED, Reason.BACKEND_ERROR, error)
        await self._conclude(a, verdict, attempts=attempts)

    async def _conclude(self, a: Action, v: Verdict, attempts: int | None = None) -> None:
        """Journal the verdict, provided ``a`` is still in the state the worker found it in."""
        state, next_at, drop = a.state, v.retry_at, None
        if v.outcome is not Outcome.DEFERRED:
            state, next_at = FINAL_STATE.get(v.outcome, SKIPPED), None
            drop = a.node if v.drop_drained else None
        if not await self.store.update(a.id, state, expect=a.state, outcome=v.outcome.value,
                                       reason=v.reason.value, detail=v.detail, drop_drained=drop,
                                       next_at=next_at, attempts=attempts):
            log.info("event=action_changed_meanwhile id=%s kind=%s node=%s verdict=%s", a.id, a.kind, a.node,
                     v.reason.value)
            return
        if v.outcome is Outcome.DONE and a.kind != NONE:
            self.metrics.latency.observe(max(0.0, time.time() - a.received_at))
        self.metrics.action(a.kind, v.outcome, v.reason)
        event = v.outcome.value
        if v.tripped:
            event = "breaker_tripped"
        elif v.outcome is Outcome.SKIPPED and v.reason in FOR_HUMANS:
            event = "left_for_human"
        await self.announcer.transition(a, event, v.detail, outcome=v.outcome.value, reason=v.reason.value)
        if state == DONE:
            await self.escalation.action_ended(a)
        level = logging.WARNING if v.outcome in (Outcome.FAILED, Outcome.SKIPPED) else logging.INFO
        log.log(level, "event=action_%s id=%s kind=%s node=%s gpu=%s alertname=%s reason=%s detail=%r",
                v.outcome.value, a.id, a.kind, a.node, a.gpu, a.alertname, v.reason.value, v.detail)

    def _reason(self, a: Action) -> str:
        note = KINDS[a.kind].reason_note
        return drain_reason(a.alertname, f"{note}: {a.summary}" if note else a.summary)

    def _plan(self, a: Action) -> str:
        fields = {"node": a.node, "gpu": a.gpu, "reason": self._reason(a)}
        return ", then ".join(STEPS[s].plan.format(**fields) for s in KINDS[a.kind].steps)

    @staticmethod
    def _summary(progress: dict[str, Any]) -> str:
        parts = [", ".join(progress.get("done", []))]
        checkpoint = progress.get("checkpoint", {})
        for key, said in (("confirmed", "checkpoint confirmed by"),
                          ("unconfirmed", "no checkpoint confirmed by"), ("errors", "could not signal")):
            if checkpoint.get(key):
                parts.append(f"{said} jobs {','.join(checkpoint[key])}")
        if progress.get("requeued"):
            parts.append(f"requeued jobs {','.join(progress['requeued'])}")
        if progress.get("exhausted"):
            parts.append(f"jobs out of retries {','.join(progress['exhausted'])}")
        return "; ".join(p for p in parts if p)
