"""The interface every cluster backend implements, so the decision engine is backend-agnostic.

Backends must be idempotent where the cluster allows it (draining a drained node is a no-op) and
raise ``BackendError`` with the cluster's own message on failure; the action worker retries with
backoff and records the error, it never marks a failed step done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class BackendError(RuntimeError):
    """A cluster call failed (non-zero exit, HTTP error, timeout); ``retryable`` says if it may pass."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class NodeState:
    """What the cluster says about one node."""

    name: str
    exists: bool
    drained: bool  # no new work may start there (Slurm DRAIN/DRAINING/DRAINED, Kubernetes cordon)
    reason: str = ""  # who drained it and why (Slurm Reason, our cordon annotation)


# A scheduler's words for a job waiting to (re)start: not running again yet.
WAITING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})


@dataclass(frozen=True)
class JobState:
    """What waiting for a job's checkpoint, and verifying that it runs again, need to know about it."""

    active: bool  # still running, starting or suspended; False once it ended or is gone
    comment: str = ""  # a note the job may set on itself (Slurm's Comment), e.g. "checkpointed"
    state: str = ""  # the scheduler's word for it (Slurm: RUNNING, PENDING, ...); empty if it does not say

    @property
    def waiting(self) -> bool:
        """Queued to start (again), not running yet."""
        return self.state in WAITING_STATES


class Backend(Protocol):
    """``alertname`` is the name of the alert a step acts for, already held to Prometheus's grammar;
    a site command may use it (``{alertname}``), never read it back out of the reason."""

    name: str

    async def node_state(self, node: str) -> NodeState: ...

    async def fleet_size(self) -> int: ...

    async def drain(self, node: str, reason: str, *, alertname: str = "") -> None: ...

    async def resume(self, node: str) -> None: ...

    async def jobs_on_node(self, node: str) -> list[str]: ...

    async def requeue(self, job_id: str, exclude_nodes: list[str]) -> None: ...

    async def signal_job(self, job_id: str, signal: str, target: str) -> None:
        """Send ``signal`` to a job (``target`` ``batch``: its batch script, ``full``: every step)."""
        ...

    async def job_state(self, job_id: str) -> JobState: ...

    async def reset_gpu(self, node: str, gpu: str | None, reason: str, *, alertname: str = "") -> None: ...

    async def reboot(self, node: str, reason: str, *, alertname: str = "") -> None: ...
