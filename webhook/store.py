"""What the webhook keeps, and the interface of the store that keeps it.

The store holds records and answers questions about them; it decides nothing. What a resolution
does is the intake's (``intake.py``), whether an action may start the guardrails' (``guardrails.py``),
which steps run the action table's (``actions.py``). ``Store`` is the asynchronous interface the
rest of the webhook uses, so that a second implementation (another database) only has to answer
the same calls: SQLite's is ``journal.AsyncJournal``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuhealth.webhook.models import Notification

PENDING, AWAITING_APPROVAL, RUNNING = "pending", "awaiting_approval", "running"
DONE, SKIPPED, FAILED, CANCELLED = "done", "skipped", "failed", "cancelled"
ACTIVE_STATES = (PENDING, AWAITING_APPROVAL, RUNNING)
FINISHED_STATES = (DONE, SKIPPED, FAILED, CANCELLED)
STATES = (*ACTIVE_STATES, *FINISHED_STATES)

# An escalation chain: its current step's action runs (running), then is checked (verifying), until a
# check passes (succeeded), the last step is spent (exhausted) or an operator or the cluster stops it.
VERIFYING, SUCCEEDED, EXHAUSTED = "verifying", "succeeded", "exhausted"
CHAIN_ACTIVE = (RUNNING, VERIFYING)
CHAIN_FINISHED = (SUCCEEDED, EXHAUSTED, CANCELLED)
CHAIN_STATES = (*CHAIN_ACTIVE, *CHAIN_FINISHED)


class JournalUnwritable(Exception):
    """The store refused a write; whatever depends on it must wait, never run twice."""


@dataclass
class Action:
    id: int
    fingerprint: str
    starts_at: str
    kind: str
    node: str
    gpu: str
    alertname: str
    summary: str
    state: str
    outcome: str
    reason: str
    detail: str
    attempts: int
    next_at: float
    progress: dict[str, Any]
    received_at: float
    started_at: float | None
    finished_at: float | None
    updated_at: float
    claimed_by: str = ""  # the replica that runs (or ran) the action
    lease_until: float | None = None  # until when that replica's claim holds without renewal

    @property
    def alert(self) -> tuple[str, str]:
        """The identity of the alert that asked for this action."""
        return self.fingerprint, self.starts_at

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Chain:
    """One escalation chain of a node and GPU: the alert that opened it, its step and what it waits for."""

    id: int
    node: str
    gpu: str
    alertname: str
    fingerprint: str  # the alert that opened the chain; every step's action is journaled under it
    starts_at: str
    summary: str
    step: str  # the action kind of the current step
    action_id: int  # the current step's action
    state: str
    detail: str
    step_done_at: float | None  # when the current step's action ended; verification counts from here
    verify_at: float  # when the chain is looked at next
    deadline: float | None  # the current step's verification must pass by then
    started_at: float
    updated_at: float
    finished_at: float | None
    claimed_by: str = ""
    lease_until: float | None = None

    @property
    def alert(self) -> tuple[str, str]:
        return self.fingerprint, self.starts_at

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Decision:
    """What the policy chose for one firing alert, before any guardrail looked at it.

    ``problem`` (reason, detail): a value the action would use is outside its grammar, or the action
    is unknown, so the action is journaled already skipped, with that value quoted, never passed on.
    """

    kind: str
    needs_approval: bool
    problem: tuple[str, str] | None = None


@dataclass(frozen=True)
class Resolution:
    """What a resolved alert does to its own actions: the intake decides, the store carries it out."""

    cancel: tuple[int, ...] = ()  # not started yet: moot now
    follow_up: str | None = None  # the kind of action the resolution calls for (the undrain), if any


Resolver = Callable[[Sequence[Action]], Resolution]


@dataclass
class RecordResult:
    notification_id: int
    new_actions: list[int] = field(default_factory=list)
    duplicates: int = 0
    resolved: int = 0
    cancelled: list[str] = field(default_factory=list)  # kinds of actions the resolution made moot
    refused: list[tuple[int, str, str, str]] = field(default_factory=list)  # skipped at intake:
    # (action id, kind, reason, detail)


@dataclass
class JobRecord:
    job_id: str
    attempts: int
    last_at: float
    excluded: list[str]
    exhausted: bool
    last_node: str


@dataclass(frozen=True)
class DrainedNode:
    """A node drained by us: reserved when its draining action started, dropped by its undrain."""

    node: str
    action_id: int
    since: float
    reason: str
    keep: bool  # left drained for a human: no automatic undrain touches it


class Store(Protocol):
    """The webhook's durable state. Writes raise ``JournalUnwritable`` when refused."""

    @property
    def write_error(self) -> str | None:
        """Why writes fail now, or None while they succeed."""

    async def record(self, notification: Notification, decisions: dict[tuple[str, str], Decision]
                     ) -> RecordResult: ...

    async def get(self, action_id: int) -> Action | None: ...

    async def transitions(self, action_id: int) -> list[dict[str, Any]]: ...

    async def list_actions(self, node: str | None = None, state: str | None = None,
                           since: float | None = None, limit: int = 500,
                           reason: str | None = None, before: int | None = None) -> list[Action]: ...

    async def counts(self) -> dict[str, int]: ...

    async def due(self, now: float, busy_nodes: Iterable[str], limit: int,
                  yield_reasons: Iterable[str] = ()) -> list[Action]: ...

    async def next_due_at(self) -> float | None: ...

    async def start(self, action_id: int, reserve: DrainedNode | None) -> bool: ...

    async def update(self, action_id: int, state: str, *, expect: str, outcome: str = "", reason: str = "",
                     detail: str = "", drop_drained: str | None = None, next_at: float | None = None,
                     attempts: int | None = None) -> bool: ...

    async def try_move(self, action_id: int, from_states: Iterable[str], state: str, reason: str,
                       detail: str, outcome: str = "") -> Action | None: ...

    async def save_progress(self, action_id: int, progress: dict[str, Any]) -> None: ...

    async def rearm(self, kind: str, reason: str, detail: str, meta: tuple[str, Any]) -> list[int]: ...

    async def last_started(self, node: str, exclude_id: int, kinds: Iterable[str]) -> float | None: ...

    async def last_finished(self, node: str, kind: str, state: str, reason: str) -> float | None: ...

    async def nodes_started(self, kind: str, since: float, exclude_node: str) -> int: ...

    async def nth_latest_start(self, since: float, kinds: Iterable[str], n: int) -> float | None: ...

    async def firing_actions(self, node: str, exclude: tuple[str, str]) -> list[Action]: ...

    async def drained(self) -> dict[str, DrainedNode]: ...

    async def claims(self) -> dict[str, list[int]]: ...

    async def keep_drained(self, node: str) -> None: ...

    async def job(self, job_id: str) -> JobRecord | None: ...

    async def job_requeued(self, action_id: int, progress: dict[str, Any], job: JobRecord) -> None: ...

    async def exhausted_jobs(self) -> list[JobRecord]: ...

    async def get_meta(self, key: str) -> Any: ...

    async def open_chain(self, chain: Chain) -> int | None:
        """A new chain; None when the node and GPU have an active one already."""

    async def chain_for_action(self, action_id: int) -> Chain | None:
        """The active chain whose current step is ``action_id``."""

    async def move_chain(self, chain_id: int, expect: str, state: str, detail: str, *,
                         step_done_at: float | None = None, verify_at: float | None = None,
                         deadline: float | None = None, follow_up: str | None = None,
                         adopt: tuple[str, int] | None = None) -> Chain | None:
        """Move a chain from ``expect`` to ``state``; None, changing nothing, when it is no longer in
        ``expect`` (cancelled meanwhile, or another replica advanced it). ``follow_up``: an action kind of
        the chain's alert made pending in the same commit (new, or its finished one armed again);
        ``adopt``: (step, action id) of an action that becomes the chain's current step."""

    async def active_chain(self, node: str, gpu: str) -> Chain | None: ...

    async def escalate_chain(self, chain_id: int, expect: str, kind: str, action_state: str,
                             detail: str) -> Chain | None:
        """Journal the next step's action (``kind``, in ``action_state``) and make it the chain's
        current step (running), in one commit; None when the chain is no longer in ``expect``."""

    async def due_chains(self, now: float, busy: Iterable[int], limit: int,
                         reopen_since: float) -> list[Chain]:
        """Chains to look at now: verifying ones whose time came, running ones whose step's action
        ended, and the newest of a node and GPU that succeeded since ``reopen_since`` and whose alert
        fired again since. On a shared journal they are claimed for this replica."""

    async def next_chain_at(self) -> float | None: ...

    async def chains(self, node: str | None = None, limit: int = 100) -> list[Chain]: ...

    async def chain_counts(self) -> dict[str, int]: ...

    async def alert_firing(self, node: str, gpu: str, alertname: str) -> bool:
        """Whether an alert of ``alertname`` fires on the node (and GPU, when given)."""

    async def refired(self, node: str, gpu: str, alertname: str, after: float, until: float,
                      exclude: tuple[str, str]) -> bool:
        """Whether an alert of ``alertname`` on the node (and GPU, when the chain has one), other than
        ``exclude``, was received in (``after``, ``until``]."""

    async def set_meta(self, key: str, value: Any) -> None: ...

    async def prune(self, before: float) -> dict[str, int]: ...

    async def probe(self) -> None: ...

    def admission(self) -> AbstractAsyncContextManager[None]:
        """Held while one action is admitted: no other replica admits meanwhile, so the guardrails
        read a journal nobody else is changing (the breaker, cooldowns and rate limits are fleet-wide)."""

    async def close(self) -> None: ...
