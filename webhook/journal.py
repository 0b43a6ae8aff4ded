"""The durable journal (SQLite, WAL): notifications, alerts, actions and every state transition.

A notification is acknowledged only after its transaction commits, and the action worker is fed
from the journal alone, so a webhook killed at any point resumes exactly where it stopped. All
SQLite work runs on journal threads: the event loop never blocks on a disk write, and a connection
is never shared between threads. The journal is a store (``store.Store``): it keeps records and
answers questions; every rule about them (which kinds drain, what a resolution does) is passed in.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import copy
import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from gpuhealth.webhook.labels import clean_text, journaled
from gpuhealth.webhook.models import Alert, Notification
from gpuhealth.webhook.schema import pending
from gpuhealth.webhook.store import (
    ACTIVE_STATES,
    AWAITING_APPROVAL,
    CANCELLED,
    CHAIN_ACTIVE,
    CHAIN_FINISHED,
    CHAIN_STATES,
    FINISHED_STATES,
    PENDING,
    RUNNING,
    SKIPPED,
    STATES,
    SUCCEEDED,
    VERIFYING,
    Action,
    Chain,
    Decision,
    DrainedNode,
    JobRecord,
    JournalUnwritable,
    RecordResult,
    Resolver,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
JOURNAL_ERRORS = (sqlite3.Error, OSError)  # what a full, read-only or failing disk raises

_ACTIVE = "state IN ('pending', 'running')"  # the worker's queue; matches the partial index


def _rowid(cur: sqlite3.Cursor) -> int:
    assert cur.lastrowid is not None  # an INSERT that wrote a row
    return cur.lastrowid


def _marks(values: tuple[str, ...]) -> str:
    return ", ".join("?" * len(values))


# The columns a new alert and a new action are journaled with, in the order of the values below.
ALERT_COLUMNS = ("fingerprint", "starts_at", "status", "node", "gpu", "alertname", "labels", "annotations",
                 "received_at", "resolved_at")
ACTION_COLUMNS = ("fingerprint", "starts_at", "kind", "node", "gpu", "alertname", "summary", "state",
                  "outcome", "reason", "detail", "next_at", "received_at", "finished_at", "updated_at")

_INSERT_ALERT = (f"INSERT OR IGNORE INTO alerts ({', '.join(ALERT_COLUMNS)}, notification_id) "
                 f"VALUES ({_marks(ALERT_COLUMNS)}, ?)")
_INSERT_ACTION = (f"INSERT OR IGNORE INTO actions ({', '.join(ACTION_COLUMNS)}) "
                  f"VALUES ({_marks(ACTION_COLUMNS)})")


def alert_values(alert: Alert, status: str, now: float, encode: Callable[[Any], Any] = json.dumps
                 ) -> tuple[Any, ...]:
    """A new alert's row; ``encode`` turns its labels and annotations into the stored JSON text (the
    identity when the row itself is sent as JSON: PostgreSQL stores a nested object as its text)."""
    return (*alert.key, status, alert.node, alert.gpu, alert.alertname, encode(alert.labels),
            encode(alert.annotations), now, now if status == "resolved" else None)


def action_values(alert: Alert, kind: str, state: str, reason: str, detail: str, now: float
                  ) -> tuple[Any, ...]:
    """A new action's row; one refused at intake (skipped) is finished as it is journaled."""
    finished = state == SKIPPED
    return (*alert.key, kind, *journaled(alert.node, alert.gpu, alert.alertname),
            clean_text(alert.annotations.get("summary", "")), state, SKIPPED if finished else "", reason,
            detail, now, now, now if finished else None, now)


def intake_state(decision: Decision) -> tuple[str, str, str]:
    """The state, reason and detail of the action a new firing alert's decision journals."""
    if decision.problem is not None:
        return SKIPPED, *decision.problem
    if decision.needs_approval:
        return AWAITING_APPROVAL, "approval_required", ""
    return PENDING, "", ""


def _action(row: sqlite3.Row) -> Action:
    data = dict(row)
    data["progress"] = json.loads(data["progress"])
    return Action(**data)


def _chain(row: sqlite3.Row) -> Chain:
    return Chain(**dict(row))


class Journal:
    """Synchronous journal operations; use ``AsyncJournal`` from the event loop.

    ``replica`` names this webhook in the actions it starts (``claimed_by``). A second database
    subclasses this one and overrides only what its SQL or its sharing between replicas changes.
    """

    # What one notification's text can raise when the database refuses it: that one gets a 400.
    REFUSED: tuple[type[Exception], ...] = (ValueError, sqlite3.DataError, sqlite3.IntegrityError)
    DIALECT = "sqlite"  # which SQL of each migration this database runs
    LOCK_ROWS = ""  # what a read of rows about to change adds to stay theirs until commit (BEGIN IMMEDIATE)

    def __init__(self, path: Path, busy_timeout: float = 5.0, power_safe: bool = True,
                 replica: str = "") -> None:
        self.replica = replica
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit survives power loss. NORMAL (WAL): it survives a crash of this process, and
        # the next FULL commit makes it power-safe too, since the WAL is synced in order.
        db.execute(f"PRAGMA synchronous={'FULL' if power_safe else 'NORMAL'}")
        db.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
        self._attach(db)

    def _attach(self, db: sqlite3.Connection) -> None:
        """Take ``db`` as this journal's connection once it is migrated; closed again when it cannot be
        (a journal newer than this webhook, a failing database), so a refused journal leaves nothing open."""
        self.db = db
        try:
            self._migrate()
        except BaseException:
            db.close()
            raise

    def _migrate(self) -> None:
        """The one migration runner: apply the migrations of ``schema.MIGRATIONS`` the journal has not
        seen, in one transaction; only how the version is read and written differs by database."""
        def run() -> None:
            for migration in pending(self._schema_version()):
                for statement in migration.statements(self.DIALECT):
                    self.db.execute(statement)
                self._set_schema_version(migration.version)
                log.info("event=journal_migrated version=%d why=%r", migration.version, migration.why)

        self._tx(run)

    def _schema_version(self) -> int:
        """SQLite keeps the version in ``PRAGMA user_version``; a file with tables but version 0 was
        written before the journal recorded its version, and is version 1."""
        version = int(self.db.execute("PRAGMA user_version").fetchone()[0])
        if version == 0 and self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                                            "name = 'actions'").fetchone():
            return 1
        return version

    def _set_schema_version(self, version: int) -> None:
        self.db.execute(f"PRAGMA user_version = {int(version)}")

    def close(self) -> None:
        self.db.close()

    def _tx(self, fn: Callable[[], T]) -> T:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            result = fn()
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")
        return result

    def _transition(self, action_id: int, state: str, reason: str, detail: str, now: float) -> None:
        self.db.execute("INSERT INTO transitions (action_id, at, state, reason, detail) VALUES (?,?,?,?,?)",
                        (action_id, now, state, reason, detail))

    def _insert_action(self, alert: Alert, kind: str, state: str, reason: str, now: float,
                       detail: str = "") -> int | None:
        cur = self.db.execute(_INSERT_ACTION, action_values(alert, kind, state, reason, detail, now))
        if not cur.rowcount:
            return None
        action_id = _rowid(cur)
        self._transition(action_id, state, reason, detail, now)
        return action_id

    def record(self, batch: list[tuple[Notification, dict[tuple[str, str], Decision]]], resolve: Resolver
               ) -> list[RecordResult | Exception]:
        """Journal notifications and the actions their new alerts call for, all in one transaction;
        ``resolve`` says what a resolved alert does to its actions.

        Notifications that arrive together share one commit (and one fsync): group commit is what
        lets a storm be journaled faster than the disk can sync once per request.
        """
        now = time.time()
        def run() -> list[RecordResult | Exception]:
            self._lock_intake()
            return [self._isolated(n, d, resolve, now) for n, d in batch]

        return self._tx(run)

    def _lock_intake(self) -> None:
        """Make this intake transaction the only one until it commits (BEGIN IMMEDIATE already does)."""

    def _isolated(self, notification: Notification, decisions: dict[tuple[str, str], Decision],
                  resolve: Resolver, now: float) -> RecordResult | Exception:
        """One notification of a group commit, in its own savepoint: one that cannot be stored (text
        SQLite refuses) is rolled back alone and its exception returned; its neighbours commit."""
        self.db.execute("SAVEPOINT notification")
        try:
            result: RecordResult | Exception = self._record_one(notification, decisions, resolve, now)
        except self.REFUSED as exc:
            self.db.execute("ROLLBACK TO notification")
            result = exc
        self.db.execute("RELEASE notification")
        return result

    def _record_one(self, notification: Notification, decisions: dict[tuple[str, str], Decision],
                    resolve: Resolver, now: float) -> RecordResult:
        cur = self.db.execute(
            "INSERT INTO notifications (received_at, receiver, group_key, status, alerts, new_alerts) "
            "VALUES (?,?,?,?,?,0)", (now, notification.receiver, notification.group_key,
                                    notification.status, len(notification.alerts)))
        result = RecordResult(_rowid(cur))
        for alert in notification.alerts:
            if alert.status == "firing":
                self._record_firing(alert, decisions.get(alert.key), now, result)
            else:
                self._record_resolved(alert, resolve, now, result)
        self.db.execute("UPDATE notifications SET new_alerts = ? WHERE id = ?",
                        (len(notification.alerts) - result.duplicates, result.notification_id))
        return result

    def _insert_alert(self, alert: Alert, status: str, now: float, notification_id: int) -> bool:
        cur = self.db.execute(_INSERT_ALERT, (*alert_values(alert, status, now), notification_id))
        return bool(cur.rowcount)

    def _record_firing(self, alert: Alert, decision: Decision | None, now: float,
                       result: RecordResult) -> None:
        if not self._insert_alert(alert, "firing", now, result.notification_id):
            result.duplicates += 1
            return
        if decision is None:
            return
        state, reason, detail = intake_state(decision)
        action_id = self._insert_action(alert, decision.kind, state, reason, now, detail)
        if action_id is None:
            return
        if state == SKIPPED:
            result.refused.append((action_id, decision.kind, reason, detail))
        else:
            result.new_actions.append(action_id)

    def _record_resolved(self, alert: Alert, resolve: Resolver, now: float, result: RecordResult) -> None:
        row = self.db.execute("SELECT status FROM alerts WHERE fingerprint = ? AND starts_at = ?",
                              alert.key).fetchone()
        if row is None:
            self._insert_alert(alert, "resolved", now, result.notification_id)
            result.resolved += 1
            return
        if row["status"] == "resolved":
            result.duplicates += 1
            return
        self.db.execute("UPDATE alerts SET status = 'resolved', resolved_at = ? WHERE fingerprint = ? "
                        "AND starts_at = ?", (now, *alert.key))
        result.resolved += 1
        rows = self.db.execute(f"SELECT * FROM actions WHERE fingerprint = ? AND starts_at = ? ORDER BY id"
                               f"{self.LOCK_ROWS}", alert.key)
        actions = [_action(r) for r in rows]
        resolution = resolve(actions)
        for action in actions:
            if action.id in resolution.cancel:
                self._set_state(action.id, CANCELLED, "cancelled", "resolved",
                                "the alert resolved before the action started", now)
                result.cancelled.append(action.kind)
        if resolution.follow_up is not None:
            action_id = self._insert_action(alert, resolution.follow_up, PENDING, "", now)
            if action_id is not None:
                result.new_actions.append(action_id)

    def _set_state(self, action_id: int, state: str, outcome: str, reason: str, detail: str, now: float,
                   **extra: Any) -> None:
        columns = {"state": state, "outcome": outcome, "reason": reason, "detail": detail, "updated_at": now,
                   **extra}
        if state in FINISHED_STATES:
            columns["finished_at"] = now
        assignments = ", ".join(f"{k} = ?" for k in columns)
        self.db.execute(f"UPDATE actions SET {assignments} WHERE id = ?", (*columns.values(), action_id))
        self._transition(action_id, state, reason, detail, now)

    def _state_of(self, action_id: int) -> str | None:
        row = self.db.execute("SELECT state FROM actions WHERE id = ?", (action_id,)).fetchone()
        return None if row is None else str(row["state"])

    def update(self, action_id: int, state: str, *, expect: str, outcome: str = "", reason: str = "",
               detail: str = "", drop_drained: str | None = None, next_at: float | None = None,
               attempts: int | None = None) -> bool:
        """Move an action from ``expect`` to ``state`` and journal the transition; ``drop_drained``: a
        node no longer drained by us, in the same commit.

        False, changing nothing, when the action is no longer in ``expect`` (an operator cancelled
        it while the worker was deciding).
        """
        extra = {k: v for k, v in (("next_at", next_at), ("attempts", attempts)) if v is not None}

        def run() -> bool:
            if self._state_of(action_id) != expect:
                return False
            self._set_state(action_id, state, outcome, reason, detail, time.time(), **extra)
            if drop_drained is not None:
                self.db.execute("DELETE FROM drained WHERE node = ?", (drop_drained,))
            return True

        return self._tx(run)

    def start(self, action_id: int, reserve: DrainedNode | None) -> bool:
        """Pending -> running, reserving the node as drained by us in the same commit.

        False when the action is no longer pending (cancelled meanwhile). The reservation counts
        against the circuit breaker from this moment, before the drain itself is sent.
        """
        def run() -> bool:
            if self._state_of(action_id) != PENDING:
                return False
            now = time.time()
            if reserve is not None:
                self.db.execute("INSERT OR REPLACE INTO drained (node, action_id, since, reason, keep) "
                                "VALUES (?,?,?,?,?)", (reserve.node, reserve.action_id, reserve.since,
                                                      reserve.reason, int(reserve.keep)))
            self._set_state(action_id, RUNNING, "", "", "started", now, started_at=now, next_at=now,
                            claimed_by=self.replica)
            return True

        return self._tx(run)

    def job_requeued(self, action_id: int, progress: dict[str, Any], job: JobRecord) -> None:
        """A job's new attempt and the action's progress, together: a restart never counts it twice."""
        def run() -> None:
            self.db.execute("INSERT OR REPLACE INTO jobs (job_id, attempts, last_at, excluded, exhausted, "
                            "last_node) VALUES (?,?,?,?,?,?)",
                            (job.job_id, job.attempts, job.last_at, json.dumps(job.excluded),
                             int(job.exhausted), job.last_node))
            self.save_progress(action_id, progress)

        self._tx(run)

    def save_progress(self, action_id: int, progress: dict[str, Any]) -> None:
        """Record a finished step, so that a restart resumes after it rather than repeating it."""
        self.db.execute("UPDATE actions SET progress = ?, updated_at = ? WHERE id = ?",
                        (json.dumps(progress), time.time(), action_id))

    def try_move(self, action_id: int, from_states: Iterable[str], state: str, reason: str, detail: str,
                 outcome: str = "") -> Action | None:
        """Move an action only if it is in one of ``from_states``; the action after, or None."""
        allowed = tuple(from_states)

        def run() -> Action | None:
            if self._state_of(action_id) not in allowed:
                return None
            self._set_state(action_id, state, outcome, reason, detail, time.time(), next_at=time.time())
            return self.get(action_id)

        return self._tx(run)

    def rearm(self, kind: str, reason: str, detail: str, meta: tuple[str, Any]) -> list[int]:
        """Put the ``kind`` actions skipped for ``reason`` back to pending, and write ``meta``, in one
        commit; their ids."""
        def run() -> list[int]:
            self.set_meta(*meta)
            held = [r[0] for r in self.db.execute("SELECT id FROM actions WHERE kind = ? AND state = ? AND "
                                                  "reason = ?", (kind, SKIPPED, reason))]
            now = time.time()
            for action_id in held:
                self._set_state(action_id, PENDING, "", "", detail, now, next_at=now, finished_at=None)
            return held

        return self._tx(run)

    def get(self, action_id: int) -> Action | None:
        row = self.db.execute("SELECT * FROM actions WHERE id = ?", (action_id,)).fetchone()
        return None if row is None else _action(row)

    def transitions(self, action_id: int) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT at, state, reason, detail FROM transitions WHERE action_id = ? "
                               "ORDER BY id", (action_id,))
        return [dict(r) for r in rows]

    def list_actions(self, node: str | None = None, state: str | None = None, since: float | None = None,
                     limit: int = 500, reason: str | None = None, before: int | None = None) -> list[Action]:
        """Newest first; ``before`` (an id) pages back through older ones."""
        where, args = [], []
        for clause, value in (("node = ?", node), ("state = ?", state), ("updated_at >= ?", since),
                              ("reason = ?", reason), ("id < ?", before)):
            if value is not None:
                where.append(clause)
                args.append(value)
        sql = "SELECT * FROM actions" + (" WHERE " + " AND ".join(where) if where else "")
        rows = self.db.execute(sql + " ORDER BY id DESC LIMIT ?", (*args, limit))
        return [_action(r) for r in rows]

    def due(self, now: float, busy_nodes: Iterable[str], limit: int,
            yield_reasons: Iterable[str] = ()) -> list[Action]:
        """Runnable actions: per node only the oldest active one (node order is FIFO), and only when due.
        A pending action waiting for one of ``yield_reasons`` lets those behind it on its node go first.

        Walks active actions oldest first and stops once ``limit`` are found, so a deep backlog
        costs only the rows in front of it.
        """
        seen = set(busy_nodes)
        yielding = frozenset(yield_reasons)
        due: list[Action] = []
        # The partial index yields active actions already in id order; without it SQLite would sort
        # the whole backlog on every call.
        rows = self.db.execute(f"SELECT * FROM actions INDEXED BY actions_active WHERE {_ACTIVE} ORDER BY id")
        for row in rows:
            if row["node"] in seen:
                continue
            if row["reason"] in yielding and row["state"] == PENDING and row["next_at"] > now:
                continue
            seen.add(row["node"])
            if row["next_at"] <= now:
                due.append(_action(row))
                if len(due) >= limit:
                    break
        return due

    def next_due_at(self) -> float | None:
        row = self.db.execute("SELECT MIN(next_at) FROM actions WHERE state IN (?, ?)",
                              (PENDING, RUNNING)).fetchone()
        return None if row[0] is None else float(row[0])

    def counts(self) -> dict[str, int]:
        rows = self.db.execute("SELECT state, COUNT(*) FROM actions GROUP BY state").fetchall()
        return {state: 0 for state in STATES} | {r[0]: r[1] for r in rows}

    def last_started(self, node: str, exclude_id: int, kinds: Iterable[str]) -> float | None:
        """When an action of ``kinds`` other than ``exclude_id`` last started on ``node``; dry runs count,
        actions that never started (skips) do not."""
        wanted = tuple(kinds)
        row = self.db.execute(f"SELECT MAX(started_at) FROM actions WHERE node = ? AND id != ? AND kind IN "
                              f"({_marks(wanted)})", (node, exclude_id, *wanted)).fetchone()
        return None if row[0] is None else float(row[0])

    def last_finished(self, node: str, kind: str, state: str, reason: str) -> float | None:
        """When an action of ``kind`` last ended on ``node`` in ``state`` for ``reason``."""
        row = self.db.execute("SELECT MAX(finished_at) FROM actions WHERE node = ? AND kind = ? AND "
                              "state = ? AND reason = ?", (node, kind, state, reason)).fetchone()
        return None if row[0] is None else float(row[0])

    def nodes_started(self, kind: str, since: float, exclude_node: str) -> int:
        """How many other nodes an action of ``kind`` started on since ``since``."""
        row = self.db.execute("SELECT COUNT(DISTINCT node) FROM actions WHERE kind = ? AND started_at >= ? "
                              "AND node != ?", (kind, since, exclude_node)).fetchone()
        return int(row[0])

    def nth_latest_start(self, since: float, kinds: Iterable[str], n: int) -> float | None:
        """The start time of the ``n``-th most recent action of ``kinds`` started since ``since``; None
        when fewer started."""
        wanted = tuple(kinds)
        row = self.db.execute(f"SELECT started_at FROM actions WHERE started_at >= ? AND kind IN "
                              f"({_marks(wanted)}) ORDER BY started_at DESC LIMIT 1 OFFSET ?",
                              (since, *wanted, n - 1)).fetchone()
        return None if row is None else float(row[0])

    def firing_actions(self, node: str, exclude: tuple[str, str]) -> list[Action]:
        """The actions of alerts still firing on ``node``, but for the alert ``exclude``."""
        rows = self.db.execute(
            "SELECT ac.* FROM alerts al JOIN actions ac ON ac.fingerprint = al.fingerprint AND "
            "ac.starts_at = al.starts_at WHERE al.node = ? AND al.status = 'firing' "
            "AND NOT (al.fingerprint = ? AND al.starts_at = ?) ORDER BY ac.id", (node, *exclude))
        return [_action(r) for r in rows]

    def claims(self) -> dict[str, list[int]]:
        """The unfinished actions each replica holds, where its claim has not lapsed."""
        rows = self.db.execute(f"SELECT claimed_by, id FROM actions WHERE claimed_by != '' AND state IN "
                               f"({_marks(ACTIVE_STATES)}) AND (lease_until IS NULL OR lease_until > ?) "
                               "ORDER BY id", (*ACTIVE_STATES, time.time()))
        held: dict[str, list[int]] = {}
        for row in rows:
            held.setdefault(row["claimed_by"], []).append(int(row["id"]))
        return held

    def drained(self) -> dict[str, DrainedNode]:
        rows = self.db.execute("SELECT * FROM drained ORDER BY node")
        return {r["node"]: DrainedNode(r["node"], r["action_id"], r["since"], r["reason"], bool(r["keep"]))
                for r in rows}

    def keep_drained(self, node: str) -> None:
        """Leave ``node`` drained for a human: no automatic undrain will touch it."""
        self.db.execute("UPDATE drained SET keep = 1 WHERE node = ?", (node,))

    def job(self, job_id: str) -> JobRecord | None:
        row = self.db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            return None
        return JobRecord(row["job_id"], row["attempts"], row["last_at"], json.loads(row["excluded"]),
                         bool(row["exhausted"]), row["last_node"])

    def exhausted_jobs(self) -> list[JobRecord]:
        rows = self.db.execute("SELECT job_id FROM jobs WHERE exhausted = 1 ORDER BY last_at DESC LIMIT 100")
        return [job for r in rows if (job := self.job(r[0])) is not None]

    def prune(self, before: float) -> dict[str, int]:
        """Forget history finished before ``before``; rows the webhook still needs are kept.

        Kept whatever their age: unfinished actions, alerts still firing (their identity is what
        makes Alertmanager's re-deliveries duplicates) and the actions of those alerts (a later
        resolution looks them up to undrain).
        """
        finished = f"state IN ({_marks(FINISHED_STATES)})"
        alert_firing = ("EXISTS (SELECT 1 FROM alerts al WHERE al.fingerprint = actions.fingerprint AND "
                        "al.starts_at = actions.starts_at AND al.status = 'firing')")
        statements = {
            "actions": (f"DELETE FROM actions WHERE {finished} AND finished_at < ? AND NOT {alert_firing}",
                        (*FINISHED_STATES, before)),
            "transitions": ("DELETE FROM transitions WHERE at < ? AND action_id NOT IN "
                            "(SELECT id FROM actions)", (before,)),
            "alerts": ("DELETE FROM alerts WHERE status = 'resolved' AND resolved_at < ?", (before,)),
            "notifications": ("DELETE FROM notifications WHERE received_at < ?", (before,)),
            "jobs": ("DELETE FROM jobs WHERE last_at < ?", (before,)),
            "chains": (f"DELETE FROM chains WHERE state IN ({_marks(CHAIN_FINISHED)}) AND finished_at < ?",
                       (*CHAIN_FINISHED, before)),
        }
        return self._tx(lambda: {table: self.db.execute(sql, args).rowcount
                                 for table, (sql, args) in statements.items()})

    def probe(self) -> None:
        """A small write: does the journal take writes again?"""
        self._tx(lambda: self.set_meta("probe", time.time()))

    def get_meta(self, key: str) -> Any:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def set_meta(self, key: str, value: Any) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    # -- escalation chains -------------------------------------------------------------------------

    def open_chain(self, chain: Chain) -> int | None:
        """A new chain; None when the node and GPU have an active one (the partial unique index)."""
        def run() -> int | None:
            cur = self.db.execute(
                "INSERT OR IGNORE INTO chains (node, gpu, alertname, fingerprint, starts_at, summary, step, "
                "action_id, state, detail, step_done_at, verify_at, deadline, started_at, updated_at) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (chain.node, chain.gpu, chain.alertname, chain.fingerprint, chain.starts_at, chain.summary,
                 chain.step, chain.action_id, chain.state, chain.detail, chain.step_done_at, chain.verify_at,
                 chain.deadline, chain.started_at, chain.updated_at))
            return _rowid(cur) if cur.rowcount else None

        return self._tx(run)

    def get_chain(self, chain_id: int) -> Chain | None:
        row = self.db.execute("SELECT * FROM chains WHERE id = ?", (chain_id,)).fetchone()
        return None if row is None else _chain(row)

    def active_chain(self, node: str, gpu: str) -> Chain | None:
        row = self.db.execute(f"SELECT * FROM chains WHERE node = ? AND gpu = ? AND state IN "
                              f"({_marks(CHAIN_ACTIVE)})", (node, gpu, *CHAIN_ACTIVE)).fetchone()
        return None if row is None else _chain(row)

    def chain_for_action(self, action_id: int) -> Chain | None:
        row = self.db.execute(f"SELECT * FROM chains WHERE action_id = ? AND state IN "
                              f"({_marks(CHAIN_ACTIVE)})", (action_id, *CHAIN_ACTIVE)).fetchone()
        return None if row is None else _chain(row)

    def _chain_state_of(self, chain_id: int) -> str | None:
        row = self.db.execute("SELECT state FROM chains WHERE id = ?", (chain_id,)).fetchone()
        return None if row is None else str(row["state"])

    def _set_chain(self, chain_id: int, now: float, **columns: Any) -> None:
        columns["updated_at"] = now
        if columns.get("state") in CHAIN_FINISHED:
            columns["finished_at"] = now
        assignments = ", ".join(f"{k} = ?" for k in columns)
        self.db.execute(f"UPDATE chains SET {assignments} WHERE id = ?", (*columns.values(), chain_id))

    def move_chain(self, chain_id: int, expect: str, state: str, detail: str, *,
                   step_done_at: float | None = None, verify_at: float | None = None,
                   deadline: float | None = None, follow_up: str | None = None,
                   adopt: tuple[str, int] | None = None) -> Chain | None:
        """``follow_up``: an action kind of the chain's alert to make pending in the same commit (a new
        one, or the alert's finished one of that kind armed again). ``adopt``: (step, action id), an
        action that becomes the chain's current step."""
        extra: dict[str, Any] = {k: v for k, v in (("step_done_at", step_done_at), ("verify_at", verify_at),
                                                   ("deadline", deadline)) if v is not None}
        if adopt is not None:
            extra.update(step=adopt[0], action_id=adopt[1])

        def run() -> Chain | None:
            if self._chain_state_of(chain_id) != expect:
                return None
            now = time.time()
            self._set_chain(chain_id, now, state=state, detail=detail, **extra)
            chain = self.get_chain(chain_id)
            if chain is not None and follow_up is not None:
                row = self.db.execute("SELECT id, state FROM actions WHERE fingerprint = ? AND starts_at = ? "
                                      "AND kind = ?", (*chain.alert, follow_up)).fetchone()
                if row is None:
                    self._insert_chain_action(chain, follow_up, PENDING, detail, now)
                elif row["state"] in FINISHED_STATES:
                    self._set_state(row["id"], PENDING, "", "", detail, now, next_at=now, finished_at=None)
            return chain

        return self._tx(run)

    def _insert_chain_action(self, chain: Chain, kind: str, state: str, detail: str, now: float) -> int:
        """An action of the chain's alert, journaled as an alert's action is: admitted by the worker."""
        reason = "approval_required" if state == AWAITING_APPROVAL else ""
        cur = self.db.execute(
            "INSERT INTO actions (fingerprint, starts_at, kind, node, gpu, alertname, summary, state, "
            "reason, next_at, received_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (chain.fingerprint, chain.starts_at, kind, chain.node, chain.gpu, chain.alertname,
             chain.summary, state, reason, now, now, now))
        action_id = _rowid(cur)
        self._transition(action_id, state, "escalation", detail, now)
        return action_id

    def escalate_chain(self, chain_id: int, expect: str, kind: str, action_state: str,
                       detail: str) -> Chain | None:
        def run() -> Chain | None:
            chain = self.get_chain(chain_id)
            if chain is None or self._chain_state_of(chain_id) != expect:
                return None
            now = time.time()
            action_id = self._insert_chain_action(chain, kind, action_state, detail, now)
            self._set_chain(chain_id, now, state=RUNNING, step=kind, action_id=action_id, detail=detail,
                            step_done_at=None, deadline=None, verify_at=now, finished_at=None)
            return self.get_chain(chain_id)

        return self._tx(run)

    def due_chains(self, now: float, busy: Iterable[int], limit: int, reopen_since: float) -> list[Chain]:
        rows = self.db.execute(self._DUE_CHAINS, (now, *FINISHED_STATES, reopen_since))
        skip = set(busy)
        return [_chain(r) for r in rows if r["id"] not in skip][:limit]

    # due: a verifying chain whose time came, a running one whose step's action ended, or the newest
    # chain of its node and GPU, succeeded since ``reopen_since``, whose alert fired again since
    _DUE_CHAINS = (f"SELECT c.* FROM chains c JOIN actions a ON a.id = c.action_id WHERE (c.verify_at <= ? "
                   f"AND (c.state = '{VERIFYING}' OR (c.state = '{RUNNING}' AND a.state IN "
                   f"({_marks(FINISHED_STATES)})))) OR (c.state = '{SUCCEEDED}' AND c.finished_at >= ? AND "
                   "EXISTS (SELECT 1 FROM alerts al WHERE al.node = c.node AND al.alertname = c.alertname "
                   "AND (c.gpu = '' OR al.gpu = c.gpu) AND al.status = 'firing' "
                   "AND al.received_at > c.finished_at) "
                   "AND c.id = (SELECT MAX(l.id) FROM chains l WHERE l.node = c.node AND l.gpu = c.gpu)) "
                   "ORDER BY c.id")

    def next_chain_at(self) -> float | None:
        row = self.db.execute(f"SELECT MIN(verify_at) FROM chains WHERE state = '{VERIFYING}'").fetchone()
        return None if row[0] is None else float(row[0])

    def chains(self, node: str | None = None, limit: int = 100) -> list[Chain]:
        where, args = ("WHERE node = ? ", (node,)) if node is not None else ("", ())
        rows = self.db.execute(f"SELECT * FROM chains {where}ORDER BY id DESC LIMIT ?", (*args, limit))
        return [_chain(r) for r in rows]

    def chain_counts(self) -> dict[str, int]:
        rows = self.db.execute("SELECT state, COUNT(*) FROM chains GROUP BY state").fetchall()
        return {state: 0 for state in CHAIN_STATES} | {r[0]: r[1] for r in rows}

    def alert_firing(self, node: str, gpu: str, alertname: str) -> bool:
        gpu_clause, args = ("AND gpu = ? ", (gpu,)) if gpu else ("", ())
        row = self.db.execute(f"SELECT 1 FROM alerts WHERE node = ? AND alertname = ? {gpu_clause}AND "
                              "status = 'firing' LIMIT 1", (node, alertname, *args)).fetchone()
        return row is not None

    def refired(self, node: str, gpu: str, alertname: str, after: float, until: float,
                exclude: tuple[str, str]) -> bool:
        gpu_clause, args = ("AND gpu = ? ", (gpu,)) if gpu else ("", ())
        row = self.db.execute(
            f"SELECT 1 FROM alerts WHERE node = ? AND alertname = ? {gpu_clause}AND received_at > ? AND "
            "received_at <= ? AND NOT (fingerprint = ? AND starts_at = ?) LIMIT 1",
            (node, alertname, *args, after, until, *exclude)).fetchone()
        return row is not None


class AsyncJournal:
    """The ``Store`` on SQLite: ``Journal`` calls on journal threads, so the event loop never blocks on
    the disk.

    Two connections, each on its own thread: intake (``record``) commits power-safe and never
    queues behind the worker's many small progress updates; everything else shares the other one,
    crash-safe, which is what exactly-once across a SIGKILL needs (a step lost to a power cut is
    sent again, and backends are idempotent).
    """

    ERRORS: tuple[type[BaseException], ...] = JOURNAL_ERRORS  # a write refused: 503, retried later

    def __init__(self, path: Path | None, resolve: Resolver, busy_timeout: float = 5.0,
                 on_failure: Callable[[], object] | None = None, replica: str = "") -> None:
        self._path, self._busy_timeout, self.replica = path, busy_timeout, replica
        self._resolve = resolve  # what a resolved alert does to its actions (the intake's rule)
        self._on_failure = on_failure  # counts refused writes (a metric)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal")
        self._intake_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal-intake")
        self._intake = self._intake_executor.submit(self._open, True).result()
        self._db = self._executor.submit(self._open, False).result()
        self._write_error: str | None = None  # set while writes fail: /healthz answers 503
        self._waiting: collections.deque[tuple[Notification, dict[tuple[str, str], Decision],
                                               concurrent.futures.Future[RecordResult]]] = collections.deque()

    def _open(self, power_safe: bool) -> Journal:
        """One connection; ``power_safe``: commits survive power loss, not only a crash."""
        assert self._path is not None  # a store without a file opens its own connections
        return Journal(self._path, self._busy_timeout, power_safe, self.replica)

    @property
    def write_error(self) -> str | None:
        return self._write_error

    async def record(self, notification: Notification,
                     decisions: dict[tuple[str, str], Decision]) -> RecordResult:
        """Journal one notification, committed together with any others waiting at the same time.

        The commit happens on the journal thread whatever becomes of the caller, so a request
        cancelled mid-way is journaled all the same (and deduplicated when Alertmanager retries).
        """
        done: concurrent.futures.Future[RecordResult] = concurrent.futures.Future()
        self._waiting.append((notification, decisions, done))
        self._intake_executor.submit(self._commit_waiting)
        return await asyncio.wrap_future(done)

    def _commit_waiting(self) -> None:
        batch = []
        while self._waiting:
            batch.append(self._waiting.popleft())
        if not batch:
            return  # an earlier call committed this one's notification already
        live = [done.set_running_or_notify_cancel() for _, _, done in batch]
        results: list[RecordResult | Exception]
        try:
            results = self._intake.record([(n, d) for n, d, _ in batch], self._resolve)
        except Exception as exc:
            refused: Exception = exc
            if isinstance(exc, self.ERRORS):
                self._failed(exc)
                refused = JournalUnwritable(str(exc) or type(exc).__name__)
            results = [refused] * len(batch)
        else:
            self._recovered()
        for (_, _, done), waiting, result in zip(batch, live, results, strict=True):
            if not waiting:
                continue
            if isinstance(result, Exception):
                done.set_exception(result)
            else:
                done.set_result(result)

    @contextlib.asynccontextmanager
    async def admission(self) -> AsyncIterator[None]:
        """Held while an action is admitted; one process is the only writer of this file already."""
        yield

    async def _read(self, fn: Callable[[Journal], T]) -> T:
        """``fn`` on a journal thread's connection: the shared one, or the admission's own while this
        task holds the admission (``_lane``)."""
        executor, db = self._lane()
        return await asyncio.get_running_loop().run_in_executor(executor, fn, db)

    def _lane(self) -> tuple[ThreadPoolExecutor, Journal]:
        """SQLite has one lane: one process writes the file, and a second connection would only wait
        for the first one's lock."""
        return self._executor, self._db

    async def _write(self, fn: Callable[[Journal], T]) -> T:
        """A write: a failure marks the journal unwritable (``JournalUnwritable``), a success marks it
        writable again."""
        try:
            result = await self._read(fn)
        except self.ERRORS as exc:
            self._failed(exc)
            raise JournalUnwritable(str(exc)) from exc
        self._recovered()
        return result

    def _failed(self, exc: BaseException) -> None:
        log.debug("event=journal_write_refused error=%r", exc)
        if self._on_failure is not None:
            self._on_failure()
        if self._write_error is None:
            log.error("event=journal_unwritable error=%r (actions wait until it can be written)", exc)
        self._write_error = str(exc) or type(exc).__name__

    def _recovered(self) -> None:
        if self._write_error is not None:
            log.warning("event=journal_writable_again after=%r", self._write_error)
            self._write_error = None

    async def get(self, action_id: int) -> Action | None:
        return await self._read(lambda db: db.get(action_id))

    async def transitions(self, action_id: int) -> list[dict[str, Any]]:
        return await self._read(lambda db: db.transitions(action_id))

    async def list_actions(self, node: str | None = None, state: str | None = None,
                           since: float | None = None, limit: int = 500,
                           reason: str | None = None, before: int | None = None) -> list[Action]:
        return await self._read(lambda db: db.list_actions(node, state, since, limit, reason, before))

    async def counts(self) -> dict[str, int]:
        return await self._read(lambda db: db.counts())

    async def due(self, now: float, busy_nodes: Iterable[str], limit: int,
                  yield_reasons: Iterable[str] = ()) -> list[Action]:
        busy, yielding = tuple(busy_nodes), tuple(yield_reasons)
        return await self._read(lambda db: db.due(now, busy, limit, yielding))

    async def next_due_at(self) -> float | None:
        return await self._read(lambda db: db.next_due_at())

    async def start(self, action_id: int, reserve: DrainedNode | None) -> bool:
        return await self._write(lambda db: db.start(action_id, reserve))

    async def update(self, action_id: int, state: str, *, expect: str, outcome: str = "", reason: str = "",
                     detail: str = "", drop_drained: str | None = None, next_at: float | None = None,
                     attempts: int | None = None) -> bool:
        return await self._write(lambda db: db.update(
            action_id, state, expect=expect, outcome=outcome, reason=reason, detail=detail,
            drop_drained=drop_drained, next_at=next_at, attempts=attempts))

    async def try_move(self, action_id: int, from_states: Iterable[str], state: str, reason: str,
                       detail: str, outcome: str = "") -> Action | None:
        allowed = tuple(from_states)
        return await self._write(lambda db: db.try_move(action_id, allowed, state, reason, detail,
                                                           outcome))

    async def save_progress(self, action_id: int, progress: dict[str, Any]) -> None:
        saved = copy.deepcopy(progress)  # the caller goes on changing its own
        await self._write(lambda db: db.save_progress(action_id, saved))

    async def rearm(self, kind: str, reason: str, detail: str, meta: tuple[str, Any]) -> list[int]:
        return await self._write(lambda db: db.rearm(kind, reason, detail, meta))

    async def last_started(self, node: str, exclude_id: int, kinds: Iterable[str]) -> float | None:
        wanted = tuple(kinds)
        return await self._read(lambda db: db.last_started(node, exclude_id, wanted))

    async def last_finished(self, node: str, kind: str, state: str, reason: str) -> float | None:
        return await self._read(lambda db: db.last_finished(node, kind, state, reason))

    async def nodes_started(self, kind: str, since: float, exclude_node: str) -> int:
        return await self._read(lambda db: db.nodes_started(kind, since, exclude_node))

    async def nth_latest_start(self, since: float, kinds: Iterable[str], n: int) -> float | None:
        wanted = tuple(kinds)
        return await self._read(lambda db: db.nth_latest_start(since, wanted, n))

    async def firing_actions(self, node: str, exclude: tuple[str, str]) -> list[Action]:
        return await self._read(lambda db: db.firing_actions(node, exclude))

    async def claims(self) -> dict[str, list[int]]:
        return await self._read(lambda db: db.claims())

    async def drained(self) -> dict[str, DrainedNode]:
        return await self._read(lambda db: db.drained())

    async def keep_drained(self, node: str) -> None:
        await self._write(lambda db: db.keep_drained(node))

    async def job(self, job_id: str) -> JobRecord | None:
        return await self._read(lambda db: db.job(job_id))

    async def job_requeued(self, action_id: int, progress: dict[str, Any], job: JobRecord) -> None:
        saved, record = copy.deepcopy(progress), copy.deepcopy(job)
        await self._write(lambda db: db.job_requeued(action_id, saved, record))

    async def exhausted_jobs(self) -> list[JobRecord]:
        return await self._read(lambda db: db.exhausted_jobs())

    async def get_meta(self, key: str) -> Any:
        return await self._read(lambda db: db.get_meta(key))

    async def set_meta(self, key: str, value: Any) -> None:
        await self._write(lambda db: db.set_meta(key, value))

    async def prune(self, before: float) -> dict[str, int]:
        return await self._write(lambda db: db.prune(before))

    async def open_chain(self, chain: Chain) -> int | None:
        return await self._write(lambda db: db.open_chain(chain))

    async def chain_for_action(self, action_id: int) -> Chain | None:
        return await self._read(lambda db: db.chain_for_action(action_id))

    async def move_chain(self, chain_id: int, expect: str, state: str, detail: str, *,
                         step_done_at: float | None = None, verify_at: float | None = None,
                         deadline: float | None = None, follow_up: str | None = None,
                         adopt: tuple[str, int] | None = None) -> Chain | None:
        return await self._write(lambda db: db.move_chain(chain_id, expect, state, detail,
                                                             step_done_at=step_done_at, verify_at=verify_at,
                                                             deadline=deadline, follow_up=follow_up,
                                                             adopt=adopt))

    async def active_chain(self, node: str, gpu: str) -> Chain | None:
        return await self._read(lambda db: db.active_chain(node, gpu))

    async def escalate_chain(self, chain_id: int, expect: str, kind: str, action_state: str,
                             detail: str) -> Chain | None:
        return await self._write(lambda db: db.escalate_chain(chain_id, expect, kind, action_state,
                                                                 detail))

    async def due_chains(self, now: float, busy: Iterable[int], limit: int,
                         reopen_since: float) -> list[Chain]:
        skip = tuple(busy)  # a write: on a shared journal it claims them
        return await self._write(lambda db: db.due_chains(now, skip, limit, reopen_since))

    async def next_chain_at(self) -> float | None:
        return await self._read(lambda db: db.next_chain_at())

    async def chains(self, node: str | None = None, limit: int = 100) -> list[Chain]:
        return await self._read(lambda db: db.chains(node, limit))

    async def chain_counts(self) -> dict[str, int]:
        return await self._read(lambda db: db.chain_counts())

    async def alert_firing(self, node: str, gpu: str, alertname: str) -> bool:
        return await self._read(lambda db: db.alert_firing(node, gpu, alertname))

    async def refired(self, node: str, gpu: str, alertname: str, after: float, until: float,
                      exclude: tuple[str, str]) -> bool:
        return await self._read(lambda db: db.refired(node, gpu, alertname, after, until, exclude))

    async def probe(self) -> None:
        await self._write(lambda db: db.probe())

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._intake_executor, self._intake.close)
        await self._read(lambda db: db.close())
        self._intake_executor.shutdown(wait=True)
        self._executor.shutdown(wait=True)
