"""Slurm backend: drain, resume, requeue and reboot through ``scontrol`` and ``squeue``.

Slurm's own clients are the interface, so the webhook needs no REST daemon or database, and every
change shows in ``scontrol show node`` with our reason (``gpuhealth: <alertname>: <summary>``) for
operators to see. Each call is an asyncio subprocess with a timeout; a failure becomes a
``BackendError`` with the client's stderr, retryable unless Slurm's answer cannot change (an unknown
node or job, missing rights).

Requeueing a job away from a node is three steps that Slurm 22.05 accepts in this order: hold the job
as it is requeued (``requeuehold``, so it cannot start again before the exclusion is in place), merge
the node into its ``ExcNodeList`` and, once the old allocation has ended (and a margin after, for the
nodes' revoked job credential), lift the two minutes Slurm would otherwise hold it back
(``StartTime=now``) and release it. Each step is checked
against ``scontrol show job`` first, so a requeue interrupted by a crash and retried completes
without a second restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from gpuhealth.contract.validation import Model, problems
from gpuhealth.webhook.backends.base import BackendError, JobState, NodeState
from gpuhealth.webhook.backends.command import (
    ResetGpuTemplate,
    alert_fields,
    check_node,
    environment,
    fill,
    run_argv,
)
from gpuhealth.webhook.backends.helpers import TracksHelpers
from gpuhealth.webhook.backends.scontrol import job_fields, parse_node_line
from gpuhealth.webhook.labels import SIGNAL, clean_text, valid_node
from pydantic import Field, PlainValidator, ValidationError, WithJsonSchema
from pydantic_core import PydanticCustomError

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 200
# No new work starts on the node: drained, failing, or down (where a reboot with nextstate=DOWN leaves
# it, our reason kept, until the undrain's health check passes and resumes it).
DRAIN_FLAGS = {"DRAIN", "DRAINING", "DRAINED", "FAIL", "FAILING", "DOWN"}
REBOOT_FLAGS = {"REBOOT_REQUESTED", "REBOOT_ISSUED"}
# "scontrol reboot [ASAP] [nextstate=...] [reason=...] {ALL|NodeList}": a node list "ASAP" is the keyword
REBOOT_WORDS = frozenset({"ASAP"})
ACTIVE_STATES = "RUNNING,CONFIGURING"
RESTARTABLE = {"RUNNING", "CONFIGURING", "SUSPENDED", "FAILED", "NODE_FAIL", "PREEMPTED"}
COMPLETING_POLL_SECONDS = 0.2
OUR_HOLD = "job_requeued_in_held_state"  # the Reason scontrol requeuehold leaves on the job
# Slurm's answers that a retry cannot change: unknown names or ids, missing rights, refused operations.
PERMANENT = re.compile(r"Invalid (node name|job id)|not found|Invalid node state|Requested operation is "
                       r"presently disabled|Access/permission denied|Only batch jobs", re.IGNORECASE)
JOB_ID = re.compile(r"\d+(_\d+)?")  # one job (or array task), never a list
SIGNALLED_STATES = {"RUNNING", "CONFIGURING", "SUSPENDED"}  # a job that may still write a checkpoint


def _program(value: Any) -> Any:
    """A program as a path or an argv prefix (a wrapper such as sudo); never a shell line."""
    argv = [value] if isinstance(value, str) else value
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise PydanticCustomError("program",
                                  "a program, or an argv list such as [sudo, -n, /usr/bin/scontrol]")
    return tuple(argv)


Program = Annotated[tuple[str, ...], PlainValidator(_program),
                    WithJsonSchema({"anyOf": [{"type": "string", "minLength": 1},
                                              {"type": "array", "items": {"type": "string", "minLength": 1},
                                               "minItems": 1}]})]
NonEmpty = Annotated[str, Field(min_length=1)]


class SlurmSettings(Model):
    """The ``backend:`` section for ``type: slurm`` (without ``type``)."""

    scontrol: Program = ("scontrol",)  # an argv prefix: [sudo, -n, /usr/bin/scontrol] works
    squeue: Program = ("squeue",)
    scancel: Program = ("scancel",)  # sends the checkpoint signal of checkpoint_drain
    slurm_conf: NonEmpty | None = None
    timeout_seconds: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 30.0
    partition: NonEmpty | None = None
    reset_gpu_command: ResetGpuTemplate | None = None
    # error: fail the action; reboot: no way to reset one GPU, so reboot the node
    reset_gpu_fallback: Literal["error", "reboot"] = "error"
    start_requeued_now: bool = True  # a requeued job may start at once elsewhere, not after Slurm's delay
    # ... but only this long after its old allocation ended: slurmd refuses to launch a job whose
    # credential it revoked in the same second (or later, by the nodes' clock skew)
    start_requeued_margin_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 2.0
    # DOWN: a rebooted node stays out, with our reason, until its alert resolves and the undrain's
    # health check (gpuhealth-validate on the node) passes; RESUME returns it unchecked
    reboot_next_state: Literal["RESUME", "DOWN"] = "DOWN"


def _settings(section: Mapping[str, Any]) -> SlurmSettings:
    try:
        return SlurmSettings.model_validate(dict(section))
    except ValidationError as exc:
        raise ValueError("slurm backend:\n  " + "\n  ".join(problems(exc, "backend"))) from None


def slurm_reason(reason: str) -> str:
    """One clean line, at most ``MAX_REASON_CHARS``: Slurm stores the reason and prints it in every
    listing, so no control character or terminal escape may reach it."""
    return clean_text(reason, MAX_REASON_CHARS)


def parse_node(node: str, line: str) -> NodeState:
    """``scontrol show node -o``: ``State=IDLE+DRAIN`` flags, and the Reason without Slurm's additions."""
    parsed = parse_node_line(line)
    return NodeState(node, exists=True, drained=bool(parsed.flags & DRAIN_FLAGS), reason=parsed.reason)


class SlurmBackend(TracksHelpers):
    """Acts with the rights of the user it runs as: ``scontrol update`` and ``requeue`` need an operator."""

    name = "slurm"

    def __init__(self, settings: SlurmSettings | None = None) -> None:
        self.settings = settings or SlurmSettings()
        self._env = {**os.environ}
        if self.settings.slurm_conf:
            self._env["SLURM_CONF"] = self.settings.slurm_conf

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> SlurmBackend:
        """Build from the ``backend:`` section; raises ``ValueError`` listing every problem."""
        return cls(_settings(section))

    async def _run(self, tool: tuple[str, ...], *args: str) -> str:
        argv = [*tool, *args]
        try:
            return await run_argv(argv, env=self._env, timeout=self.settings.timeout_seconds)
        except BackendError as exc:
            if exc.retryable and PERMANENT.search(str(exc)):
                raise BackendError(str(exc), retryable=False) from None
            raise

    async def _scontrol(self, *args: str) -> str:
        return await self._run(self.settings.scontrol, *args)

    async def _show_node(self, node: str) -> str | None:
        try:
            return (await self._scontrol("show", "node", check_node(node), "-o")).strip()
        except BackendError as exc:
            if not exc.retryable:  # "Node x not found"
                return None
            raise

    async def node_state(self, node: str) -> NodeState:
        line = await self._show_node(node) if valid_node(node) else None
        if line is None:
            return NodeState(node, exists=False, drained=False)
        return parse_node(node, line)

    async def fleet_size(self) -> int:
        if self.settings.partition:
            out = await self._scontrol("show", "partition", self.settings.partition, "-o")
            match = re.search(r"(?:^|\s)TotalNodes=(\d+)", out)
            if not match:
                raise BackendError(f"no TotalNodes in scontrol show partition: {out[:200]!r}")
            return int(match[1])
        out = await self._scontrol("show", "node", "-o")
        return sum(1 for line in out.splitlines() if line.startswith("NodeName="))

    async def drain(self, node: str, reason: str, *, alertname: str = "") -> None:
        text = slurm_reason(reason)
        if (await self.node_state(node)).drained:  # the first reason stays: ours, or an operator's
            return
        await self._scontrol("update", f"NodeName={check_node(node)}", "State=DRAIN", f"Reason={text}")
        log.info("event=slurm_drain node=%s reason=%r", node, text)

    async def resume(self, node: str) -> None:
        state = await self.node_state(node)
        if not state.exists:
            raise BackendError(f"node {node} not found", retryable=False)
        if not state.drained:
            return
        await self._scontrol("update", f"NodeName={node}", "State=RESUME")
        log.info("event=slurm_resume node=%s", node)

    async def jobs_on_node(self, node: str) -> list[str]:
        out = await self._run(self.settings.squeue, "-h", "-w", check_node(node), "-t", ACTIVE_STATES,
                              "-o", "%i")
        return out.split()

    async def _job(self, job_id: str) -> dict[str, str]:
        text = await self._scontrol("show", "job", job_id, "-o")
        return job_fields(text, ("JobState", "ExcNodeList", "Reason"))

    async def _hostnames(self, hostlist: str) -> list[str]:
        if hostlist in ("", "(null)"):
            return []
        return (await self._scontrol("show", "hostnames", hostlist)).split()

    async def requeue(self, job_id: str, exclude_nodes: list[str]) -> None:
        """Restart a running or failed job away from ``exclude_nodes``; a job that ended otherwise
        (completed, cancelled, timed out) is left alone, since running it again is not a retry."""
        if not JOB_ID.fullmatch(job_id):
            raise BackendError(f"{job_id!r} is not a single Slurm job id", retryable=False)
        for node in exclude_nodes:
            check_node(node)
        job = await self._job(job_id)
        state = job.get("JobState", "")
        if state != "PENDING" and job.get("Reason") != OUR_HOLD:
            if state == "COMPLETING":
                raise BackendError(f"job {job_id} is completing; it can be requeued once it has ended")
            if state not in RESTARTABLE:
                log.info("event=slurm_requeue_skipped job=%s state=%s", job_id, state)
                return
            await self._scontrol("requeuehold", job_id)
            job = await self._job(job_id)
        excluded = await self._hostnames(job.get("ExcNodeList", ""))
        missing = [n for n in exclude_nodes if n not in excluded]
        if missing:
            merged = ",".join([*excluded, *missing])
            await self._scontrol("update", f"JobId={job_id}", f"ExcNodeList={merged}")
            job = await self._job(job_id)
            now = await self._hostnames(job.get("ExcNodeList", ""))
            if not set(exclude_nodes) <= set(now):
                raise BackendError(f"job {job_id}: ExcNodeList is {now} after asking for {merged}")
        if self.settings.start_requeued_now:  # before the release, whose scheduling pass then starts it
            await self._start_now(job_id)
        if job.get("Reason") == OUR_HOLD:
            await self._scontrol("release", job_id)
        log.info("event=slurm_requeue job=%s excluded=%s", job_id, ",".join(sorted({*excluded, *missing})))

    async def signal_job(self, job_id: str, signal: str, target: str) -> None:
        """``scancel --signal=USR1 --batch JOB``: only the batch script (which forwards it), or ``--full``."""
        if not JOB_ID.fullmatch(job_id) or not SIGNAL.fullmatch(signal) or target not in ("batch", "full"):
            raise BackendError(f"cannot signal job {job_id!r} with {signal!r} ({target!r})", retryable=False)
        await self._run(self.settings.scancel, f"--signal={signal}", f"--{target}", job_id)
        log.info("event=slurm_signal job=%s signal=%s target=%s", job_id, signal, target)

    async def job_state(self, job_id: str) -> JobState:
        """From ``squeue`` (``%k``: the whole comment, spaces included); a job Slurm forgot has ended."""
        if not JOB_ID.fullmatch(job_id):
            raise BackendError(f"{job_id!r} is not a single Slurm job id", retryable=False)
        try:
            out = await self._run(self.settings.squeue, "-h", "-j", job_id, "-t", "all", "-o", "%T %k")
        except BackendError as exc:
            if exc.retryable:
                raise
            return JobState(active=False)
        state, _, comment = out.strip().partition(" ")
        return JobState(active=state in SIGNALLED_STATES, comment="" if comment == "(null)" else comment,
                        state=state)

    async def _start_now(self, job_id: str) -> None:
        """Lift the ~2 minutes Slurm makes a requeued job wait (its BeginTime): ``StartTime=now``, which
        Slurm 22.05 honours. Slurm sets that delay once the old allocation has finished completing, so
        the update waits for that; a job that is no longer pending is left alone.

        Slurm's delay (``cred_expire``, 120 s by default) is there for one reason: when the job was
        killed for the requeue, each slurmd of its old allocation revoked its credential, and refuses
        a launch whose credential is not newer, to the second, than that revocation ("Job credential
        revoked": the batch job then FAILS instead of running). The healthy nodes of the old
        allocation are the first the scheduler picks again, so the start waits out
        ``start_requeued_margin_seconds`` after the allocation ended, not two minutes."""
        deadline = time.monotonic() + self.settings.timeout_seconds
        while (state := (await self._job(job_id)).get("JobState")) == "COMPLETING":
            if time.monotonic() > deadline:
                raise BackendError(f"job {job_id} still completing after "
                                   f"{self.settings.timeout_seconds:.0f}s")
            await asyncio.sleep(COMPLETING_POLL_SECONDS)
        if state == "PENDING":
            await asyncio.sleep(self.settings.start_requeued_margin_seconds)
            await self._scontrol("update", f"JobId={job_id}", "StartTime=now")

    async def reset_gpu(self, node: str, gpu: str | None, reason: str, *, alertname: str = "") -> None:
        check_node(node)
        command = self.settings.reset_gpu_command
        if command is None:
            if self.settings.reset_gpu_fallback == "reboot":
                await self.reboot(node, reason, alertname=alertname)
                return
            raise BackendError("slurm backend: no reset_gpu_command configured (a site command that "
                               "resets one GPU, e.g. through ssh and nvidia-smi -r), and "
                               "reset_gpu_fallback is 'error'", retryable=False)
        fields = alert_fields(node, reason, gpu or "", alertname=alertname)
        await run_argv(fill(command, fields), env=environment("reset_gpu", fields, self._env),
                       timeout=self.settings.timeout_seconds, helpers=self.helpers)
        log.info("event=slurm_reset_gpu node=%s gpu=%s", node, gpu)

    async def _return_to_service(self) -> str:
        """slurm.conf's ReturnToService, as the controller runs it (``scontrol show config``)."""
        config = await self._scontrol("show", "config")
        match = re.search(r"^ReturnToService\s*=\s*(\S+)", config, re.MULTILINE)
        return match[1] if match else ""

    async def reboot(self, node: str, reason: str, *, alertname: str = "") -> None:
        if node.upper() in REBOOT_WORDS:
            raise BackendError(f"node {node} cannot be named to scontrol reboot, which reads {node!r} as "
                               "its own keyword (the node list would be missing)", retryable=False)
        line = await self._show_node(node)
        if line is None:
            raise BackendError(f"node {node} not found", retryable=False)
        if parse_node_line(line).flags & REBOOT_FLAGS:
            return
        if self.settings.reboot_next_state == "DOWN" and await self._return_to_service() == "2":
            raise BackendError("slurm.conf has ReturnToService=2, which puts a node rebooted with "
                               "nextstate=DOWN back in service as soon as its slurmd registers, before "
                               "any validation: set ReturnToService=0 or 1 (or reboot_next_state: RESUME "
                               "to accept an unchecked return); the node stays drained", retryable=False)
        await self._scontrol("reboot", "ASAP", f"nextstate={self.settings.reboot_next_state}",
                             f"reason={slurm_reason(reason)}", node)
        log.info("event=slurm_reboot node=%s next_state=%s", node, self.settings.reboot_next_state)
