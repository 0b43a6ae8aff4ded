"""The ``Store`` on PostgreSQL, shared by several webhook replicas (``journal: {url: ...}``).

It is the SQLite journal's SQL and rules, run through psycopg 3 (``gpuhealth[postgres]``), plus
what sharing one journal between replicas needs:

- firing notifications are journaled in one statement per group commit, replicas side by side: the
  alerts' primary key (fingerprint + startsAt) makes the insert of an alert another replica holds
  uncommitted wait for it, and then find it, a duplicate; a resolution, which reads and cancels
  actions, is journaled with the alerts table locked against every other intake;
- actions are claimed row by row: ``due`` reads the queue, picks what it may run, and claims only
  those rows, ``FOR UPDATE SKIP LOCKED`` (replicas never wait on each other's rows) with a lease,
  renewed on every pass of the worker; a replica that dies stops renewing and, once the lease has
  run out, another claims its actions and resumes them after their last journaled step;
- the decision of admission (the guardrails that count the fleet, then pending -> running) holds a
  session advisory lock, on a session kept open for it, so the breaker, cooldowns and rate limits
  read a journal no other replica is changing meanwhile: they are fleet-wide; what it reads and
  writes meanwhile goes through a connection of its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, cast

import psycopg
from gpuhealth.webhook.journal import (
    ACTION_COLUMNS,
    ALERT_COLUMNS,
    AsyncJournal,
    Journal,
    _action,
    _chain,
    action_values,
    alert_values,
    intake_state,
)
from gpuhealth.webhook.models import Notification
from gpuhealth.webhook.store import (
    ACTIVE_STATES,
    CANCELLED,
    CHAIN_ACTIVE,
    FINISHED_STATES,
    PENDING,
    RUNNING,
    SKIPPED,
    Action,
    Chain,
    Decision,
    DrainedNode,
    JournalUnwritable,
    RecordResult,
    Resolver,
)

log = logging.getLogger(__name__)
MIGRATION_LOCK = 0x67707568_0001  # advisory lock keys: "gpuh" and what they guard
ADMISSION_LOCK = 0x67707568_0002
# The store whose admission lock the current task holds: its journal calls take the admission's lane.
_ADMITTING: contextvars.ContextVar[AsyncPostgresJournal | None] = contextvars.ContextVar("admitting",
                                                                                     default=None)
_KEYS = {"drained": "node", "jobs": "job_id", "meta": "key"}  # INSERT OR REPLACE targets
_WITH_ID = ("notifications", "actions", "transitions", "chains")

Batch = list[tuple[Notification, dict[tuple[str, str], Decision]]]
REFUSED = (ValueError, psycopg.DataError, psycopg.IntegrityError)  # one notification the database refuses
# What sends a group commit statement by statement instead: a notification the database refuses (found
# in its own savepoint there), or a deadlock with another replica's intake on the same alerts.
ONE_BY_ONE = (*REFUSED, psycopg.errors.DeadlockDetected)


def all_firing(batch: Batch) -> bool:
    """Whether the batch is firing alerts only: those go in one statement (``_RECORD_FIRING``)."""
    return all(alert.status == "firing" for notification, _ in batch for alert in notification.alerts)


# A group commit of firing notifications in one statement, so one round trip and one transaction: the
# notifications, their new alerts (a conflict on the primary key, fingerprint + startsAt, is a
# duplicate, also while another replica's intake holds the key uncommitted: the insert waits for it),
# the actions of those new alerts and their first transitions. The rows come as one JSON document, in
# the tables' own columns (an alert's notification_id is its notification's position in the batch
# until the notification has its id; its labels and annotations are nested objects, stored as their
# JSON text). One row per notification comes back (position, id, new alerts), and one more per new
# action.
_RECORD_FIRING = f"""
WITH notes AS MATERIALIZED (
    SELECT ordinality AS position, nextval(pg_get_serial_sequence('notifications', 'id')) AS id,
           received_at, receiver, group_key, status, alerts
    FROM json_populate_recordset(NULL::notifications, %(rows)s::json -> 'notifications') WITH ORDINALITY),
new_alerts AS (
    INSERT INTO alerts ({', '.join(ALERT_COLUMNS)}, notification_id)
    SELECT {', '.join(f'a.{c}' for c in ALERT_COLUMNS)}, notes.id
    FROM json_populate_recordset(NULL::alerts, %(rows)s::json -> 'alerts') WITH ORDINALITY AS a
    JOIN notes ON notes.position = a.notification_id ORDER BY a.ordinality
    ON CONFLICT DO NOTHING RETURNING fingerprint, starts_at, notification_id),
new_actions AS (
    INSERT INTO actions ({', '.join(ACTION_COLUMNS)})
    SELECT {', '.join(f'c.{c}' for c in ACTION_COLUMNS)}
    FROM json_populate_recordset(NULL::actions, %(rows)s::json -> 'actions') WITH ORDINALITY AS c
    JOIN new_alerts USING (fingerprint, starts_at) ORDER BY c.ordinality
    ON CONFLICT DO NOTHING RETURNING id, fingerprint, starts_at, kind, state, reason, detail),
first_transitions AS (
    INSERT INTO transitions (action_id, at, state, reason, detail)
    SELECT id, %(now)s, state, reason, detail FROM new_actions),
stored AS (
    INSERT INTO notifications (id, received_at, receiver, group_key, status, alerts, new_alerts)
    SELECT id, received_at, receiver, group_key, status, alerts,
           (SELECT COUNT(*) FROM new_alerts WHERE notification_id = notes.id)
    FROM notes)
SELECT notes.position, notes.id, (SELECT COUNT(*) FROM new_alerts WHERE notification_id = notes.id),
       c.id, c.kind, c.state, c.reason, c.detail
FROM notes LEFT JOIN (new_actions c JOIN new_alerts USING (fingerprint, starts_at))
    ON new_alerts.notification_id = notes.id
ORDER BY notes.position, c.id
"""


def _firing_arguments(batch: Batch, now: float) -> dict[str, Any]:
    """``_RECORD_FIRING``'s parameters: the rows the journal's own statements would write."""
    notifications, alerts, actions = [], [], []
    for position, (notification, decisions) in enumerate(batch, start=1):
        notifications.append({"received_at": now, "receiver": notification.receiver,
                              "group_key": notification.group_key, "status": notification.status,
                              "alerts": len(notification.alerts)})
        for alert in notification.alerts:
            alerts.append(dict(zip(ALERT_COLUMNS, alert_values(alert, "firing", now, _as_is), strict=True),
                               notification_id=position))
            if (decision := decisions.get(alert.key)) is not None:
                actions.append(dict(zip(ACTION_COLUMNS, action_values(alert, decision.kind,
                                                                      *intake_state(decision), now),
                                        strict=True)))
    return {"now": now, "rows": json.dumps({"notifications": notifications, "alerts": alerts,
                                            "actions": actions})}


def _as_is(value: Any) -> Any:
    return value


def _firing_results(batch: Batch, rows: list[tuple[Any, ...]]) -> list[RecordResult | Exception]:
    results: dict[int, RecordResult] = {}
    for position, notification_id, new_alerts, action_id, kind, state, reason, detail in rows:
        if position not in results:
            alerts = len(batch[position - 1][0].alerts)
            results[position] = RecordResult(int(notification_id), duplicates=alerts - int(new_alerts))
        if action_id is None:
            continue  # a notification with no new action
        if state == SKIPPED:
            results[position].refused.append((int(action_id), kind, reason, detail))
        else:
            results[position].new_actions.append(int(action_id))
    return [results[position] for position in range(1, len(batch) + 1)]


class _Row(dict[str, Any]):
    """A row readable by name and by position, as ``sqlite3.Row`` is."""

    def __getitem__(self, key: str | int) -> Any:
        return list(self.values())[key] if isinstance(key, int) else super().__getitem__(key)


def _rows(cursor: psycopg.Cursor[Any]) -> Callable[[Sequence[Any]], _Row]:
    names = [c.name for c in cursor.description or ()]
    return lambda values: _Row(zip(names, values, strict=True))


@functools.lru_cache(maxsize=512)
def _translate(sql: str) -> str:
    """SQLite's statement in PostgreSQL's words: placeholders, upserts, no index hints."""
    sql = sql.replace("?", "%s").replace(" INDEXED BY actions_active", "").replace("BEGIN IMMEDIATE", "BEGIN")
    if match := re.match(r"INSERT OR IGNORE INTO (\w+)", sql):
        sql = "INSERT" + sql[len("INSERT OR IGNORE"):] + " ON CONFLICT DO NOTHING"
        if match[1] in _WITH_ID:
            sql += " RETURNING id"
    elif match := re.match(r"INSERT OR REPLACE INTO (\w+) \(([^)]*)\)", sql):
        columns = [c.strip() for c in match[2].split(",")]
        key = _KEYS[match[1]]
        sql = ("INSERT" + sql[len("INSERT OR REPLACE"):] + f" ON CONFLICT ({key}) DO UPDATE SET "
               + ", ".join(f"{c} = EXCLUDED.{c}" for c in columns if c != key))
    elif (match := re.match(r"INSERT INTO (\w+)", sql)) and match[1] in _WITH_ID:
        sql += " RETURNING id"
    return sql


class _Cursor:
    """What the journal reads from a statement: rows, ``rowcount``, ``lastrowid``."""

    def __init__(self, cursor: psycopg.Cursor[Any]) -> None:
        self.rowcount = cursor.rowcount
        self._rows = [_rows(cursor)(r) for r in cursor.fetchall()] if cursor.description else []
        first = self._rows[0] if self._rows else {}
        self.lastrowid = int(first["id"]) if "id" in first else None

    def fetchone(self) -> _Row | None:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[_Row]:
        return self._rows

    def __iter__(self) -> Iterator[_Row]:
        return iter(self._rows)


class _Connection:
    """A psycopg connection with ``sqlite3``'s ``execute``; reconnects once the old one is broken."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = self._connect()

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True, connect_timeout=5)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> _Cursor:
        return _Cursor(self._execute(_translate(sql), tuple(args)))

    def _execute(self, sql: str, args: Sequence[Any] | dict[str, Any]) -> psycopg.Cursor[Any]:
        if self.conn.closed:
            self.conn = self._connect()
        try:
            return self.conn.execute(sql, args)
        except psycopg.OperationalError:
            if self.conn.broken:
                self.conn.close()  # the next statement connects again (after a restart of the server)
            raise

    def record_firing(self, arguments: dict[str, Any]) -> list[tuple[Any, ...]]:
        """``_RECORD_FIRING``, alone in its transaction (autocommit): one round trip."""
        rows: list[tuple[Any, ...]] = self._execute(_RECORD_FIRING, arguments).fetchall()
        return rows

    def close(self) -> None:
        self.conn.close()


class PostgresJournal(Journal):
    """``Journal`` on one PostgreSQL connection, with claims for replicas."""

    REFUSED = REFUSED
    DIALECT = "postgres"
    LOCK_ROWS = " FOR UPDATE"  # a resolution's actions: a replica's worker cannot start one meanwhile

    def __init__(self, url: str, replica: str, lease_seconds: float) -> None:
        self.replica, self.lease_seconds = replica, lease_seconds
        self._renewed_at = float("-inf")  # when this replica last renewed its claims
        self._fenced = False  # set while the worker's own transitions run: they need the claim
        self._attach(_Connection(url))  # type: ignore[arg-type]  # same calls as sqlite3.Connection

    def _schema_version(self) -> int:
        """PostgreSQL keeps the version in the ``schema_version`` table; replicas starting together
        migrate one after the other (a lock held until the migration commits)."""
        self.db.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK,))
        self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
        row = self.db.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0]) if row is not None and row[0] is not None else 0

    def _set_schema_version(self, version: int) -> None:
        self.db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))

    def record(self, batch: Batch, resolve: Resolver) -> list[RecordResult | Exception]:
        """Firing alerts, the bulk of intake, go in one statement per group commit (one round trip),
        beside the other replicas' intake: the alerts' primary key makes the second delivery of an alert
        a duplicate, whichever replica has it. Anything else goes statement by statement
        (``record_one_by_one``). The webhook itself sends firing notifications through
        ``AsyncPostgresJournal``, which runs the same statement on the event loop."""
        if all_firing(batch):
            try:
                rows = cast(_Connection, self.db).record_firing(_firing_arguments(batch, time.time()))
            except ONE_BY_ONE as exc:
                log.info("event=intake_one_by_one notifications=%d why=%r", len(batch), exc)
            else:
                return _firing_results(batch, rows)
        return self.record_one_by_one(batch, resolve)

    def record_one_by_one(self, batch: Batch, resolve: Resolver) -> list[RecordResult | Exception]:
        """The journal's own statements, with the alerts table locked against every other intake: for a
        batch with a resolution (what it reads and cancels must not change meanwhile), one the database
        refused in one statement (a notification it cannot store is isolated here in its savepoint),
        and one that crossed another replica's on the same alerts in another order (a deadlock, which
        PostgreSQL broke)."""
        return super().record(batch, resolve)

    def _lock_intake(self) -> None:
        """Alone: intake elsewhere (which inserts alerts) waits until this transaction commits."""
        self.db.execute("LOCK TABLE alerts IN SHARE ROW EXCLUSIVE MODE")

    def _state_of(self, action_id: int) -> str | None:
        """The state, with the row locked until commit: replicas change one action one at a time.

        While fenced, an action another replica has claimed reads as claimed by it, which no caller
        expects: a replica whose lease ran out (paused, cut off) cannot start or end an action
        another has taken over. Operators' moves (approve, cancel) are not fenced."""
        row = self.db.execute("SELECT state, claimed_by FROM actions WHERE id = ? FOR UPDATE",
                              (action_id,)).fetchone()
        if row is None:
            return None
        if self._fenced and row["claimed_by"] not in ("", self.replica):
            return f"claimed by {row['claimed_by']}"
        return str(row["state"])

    @contextlib.contextmanager
    def _fence(self) -> Iterator[None]:
        self._fenced = True
        try:
            yield
        finally:
            self._fenced = False

    def update(self, action_id: int, state: str, *, expect: str, outcome: str = "", reason: str = "",
               detail: str = "", drop_drained: str | None = None, next_at: float | None = None,
               attempts: int | None = None) -> bool:
        with self._fence():
            return super().update(action_id, state, expect=expect, outcome=outcome, reason=reason,
                                  detail=detail, drop_drained=drop_drained, next_at=next_at,
                                  attempts=attempts)

    def _claim(self, table: str, candidates: str, args: Sequence[Any],
               choose: Callable[[list[Any]], list[int]], now: float, claimable: str = "") -> list[Any]:
        """The claim step of ``due`` and ``due_chains``: read the candidate rows of ``table`` without
        locking them, let ``choose`` pick ids among them, and claim those for one lease in one statement
        that takes only their rows, skips a row another replica is claiming now (``FOR UPDATE SKIP
        LOCKED``: replicas never wait on each other) and checks again on the row itself that no other
        live replica holds it (and ``claimable``); the claimed rows, oldest first.

        Locking only the chosen rows matters: a backlog of thousands of pending actions would otherwise
        be locked (written) on every pass of the worker, and a replica skipping the oldest action of a
        node that another replica is claiming would take the next one of that node."""
        chosen = choose(self.db.execute(candidates, args).fetchall())
        if not chosen:
            return []
        claimed = self.db.execute(
            f"UPDATE {table} SET claimed_by = ?, lease_until = ? WHERE id IN (SELECT id FROM {table} WHERE "
            f"id = ANY(?) AND (claimed_by IN ('', ?) OR lease_until IS NULL OR lease_until <= ?){claimable} "
            "FOR UPDATE SKIP LOCKED) RETURNING *",
            (self.replica, now + self.lease_seconds, chosen, self.replica, now))
        return sorted(claimed, key=lambda r: int(r["id"]))

    def _held_elsewhere(self, row: Any, now: float) -> bool:
        """Another replica's claim on the row, its lease still running."""
        return row["claimed_by"] not in ("", self.replica) and (row["lease_until"] or 0) > now

    def due(self, now: float, busy_nodes: Iterable[str], limit: int,
            yield_reasons: Iterable[str] = ()) -> list[Action]:
        """Claim what is due for this replica: its own claims (renewed), unclaimed actions, and those
        whose claim lapsed. A node whose oldest active action another replica holds is left to it."""
        busy, yielding = frozenset(busy_nodes), frozenset(yield_reasons)

        def choose(rows: list[Any]) -> list[int]:
            seen, chosen = set(busy), []
            for row in rows:
                if row["node"] in seen:
                    continue
                if self._held_elsewhere(row, now):
                    seen.add(row["node"])  # another replica holds this node's queue
                    continue
                if row["reason"] in yielding and row["state"] == PENDING and row["next_at"] > now:
                    continue
                seen.add(row["node"])
                if row["next_at"] <= now:
                    chosen.append(int(row["id"]))
                    if len(chosen) >= limit:
                        break
            return chosen

        self._renew(now)
        candidates = ("SELECT id, node, state, reason, next_at, claimed_by, lease_until FROM actions "
                      "WHERE state IN (?, ?) ORDER BY id")
        return [_action(r) for r in self._claim("actions", candidates, (PENDING, RUNNING), choose, now,
                                                 f" AND state IN ('{PENDING}', '{RUNNING}')")]

    def _renew(self, now: float) -> None:
        """The heartbeat: extend this replica's claims, a few times per lease rather than per wake-up."""
        if now - self._renewed_at > self.lease_seconds / 4:
            self.db.execute("UPDATE actions SET lease_until = ? WHERE claimed_by = ? AND state IN (?, ?, ?)",
                            (now + self.lease_seconds, self.replica, *ACTIVE_STATES))
            self._renewed_at = now

    def next_due_at(self) -> float | None:
        """Asked on every pass of the worker, even when all its slots are busy: the heartbeat rides on it."""
        self._renew(time.time())
        return super().next_due_at()

    def start(self, action_id: int, reserve: DrainedNode | None) -> bool:
        """Pending -> running, only while this replica holds the claim."""
        with self._fence():
            return super().start(action_id, reserve)

    # -- escalation chains: claimed as actions are, so that exactly one replica advances each ----------

    def _chain_state_of(self, chain_id: int) -> str | None:
        """The chain's state, its row locked until commit; one another replica claims reads as that."""
        row = self.db.execute("SELECT state, claimed_by, lease_until FROM chains WHERE id = ? FOR UPDATE",
                              (chain_id,)).fetchone()
        if row is None:
            return None
        if self._fenced and row["claimed_by"] not in ("", self.replica):
            return f"claimed by {row['claimed_by']}"
        return str(row["state"])

    def move_chain(self, chain_id: int, expect: str, state: str, detail: str, *,
                   step_done_at: float | None = None, verify_at: float | None = None,
                   deadline: float | None = None, follow_up: str | None = None,
                   adopt: tuple[str, int] | None = None) -> Chain | None:
        """Fenced as the worker's own transitions are; a cancel is not (an operator's, from any replica)."""
        with self._fence() if state != CANCELLED else contextlib.nullcontext():
            return super().move_chain(chain_id, expect, state, detail, step_done_at=step_done_at,
                                      verify_at=verify_at, deadline=deadline, follow_up=follow_up,
                                      adopt=adopt)

    def escalate_chain(self, chain_id: int, expect: str, kind: str, action_state: str,
                       detail: str) -> Chain | None:
        with self._fence():
            return super().escalate_chain(chain_id, expect, kind, action_state, detail)

    def due_chains(self, now: float, busy: Iterable[int], limit: int, reopen_since: float) -> list[Chain]:
        """Claim the due chains no live replica holds, and renew this replica's claims on the chains it
        is still verifying."""
        skip = set(busy)

        def choose(rows: list[Any]) -> list[int]:  # another live replica advances those it holds
            return [int(r["id"]) for r in rows
                    if r["id"] not in skip and not self._held_elsewhere(r, now)][:limit]

        self.db.execute(f"UPDATE chains SET lease_until = ? WHERE claimed_by = ? AND state IN "
                        f"({', '.join('?' * len(CHAIN_ACTIVE))})", (now + self.lease_seconds, self.replica,
                                                                    *CHAIN_ACTIVE))
        due = self._claim("chains", self._DUE_CHAINS, (now, *FINISHED_STATES, reopen_since), choose, now)
        return [_chain(r) for r in due]


class _Waiting(NamedTuple):
    """A firing notification waiting for its group commit, and when it arrived (the loop's clock)."""

    notification: Notification
    decisions: dict[tuple[str, str], Decision]
    done: asyncio.Future[RecordResult]
    arrived: float


class AsyncPostgresJournal(AsyncJournal):
    """The ``Store`` on PostgreSQL: the SQLite store's threads, one connection each, and two connections
    on the event loop, each kept open and opened again once broken.

    Firing notifications, the bulk of intake, are group-committed on the event loop (``_RECORD_FIRING``,
    one round trip): no thread hand-off, so an answer does not wait for a journal thread to get the
    interpreter back from the request handlers. What else intake journals (resolutions, and a group
    commit the database refused or broke off in a deadlock) runs statement by statement on the intake
    thread. Admission holds the fleet's advisory lock on a connection of its own, and what it reads
    and writes meanwhile (the guardrails' counts, the start) goes through a thread and connection of
    its own too: on the shared one it would queue behind every running action's step writes, and the
    whole fleet would wait for them, since no replica admits while the lock is held.
    """

    ERRORS = (psycopg.OperationalError, psycopg.InterfaceError, OSError)

    def __init__(self, url: str, resolve: Resolver, replica: str, lease_seconds: float = 30.0,
                 on_failure: Callable[[], object] | None = None, *, commit_window: float = 0.0) -> None:
        self._url, self._lease_seconds, self._commit_window = url, lease_seconds, commit_window
        super().__init__(None, resolve, on_failure=on_failure, replica=replica)
        self._firing: collections.deque[_Waiting] = collections.deque()
        self._committer: asyncio.Task[None] | None = None
        self._sizes: collections.deque[int] = collections.deque(maxlen=16)  # the latest batches' sizes
        self._full: asyncio.Future[None] | None = None  # resolved once ``_enough`` wait
        self._enough = math.inf  # the fullest of the latest batches (none yet: no early commit)
        self._loop_connections: dict[str, psycopg.AsyncConnection[Any]] = {}  # "intake", "admission"
        self._admission_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal-admission")
        self._admission_db = self._admission_executor.submit(self._open, False).result()

    def _open(self, power_safe: bool) -> Journal:
        return PostgresJournal(self._url, self.replica, self._lease_seconds)

    async def _connection(self, name: str) -> psycopg.AsyncConnection[Any]:
        conn = self._loop_connections.get(name)
        if conn is None or conn.closed:
            conn = await psycopg.AsyncConnection.connect(self._url, autocommit=True, connect_timeout=5)
            self._loop_connections[name] = conn
        return conn

    async def _drop_connection(self, name: str) -> None:
        """Close a connection whose state is unknown (broken, or a call on it cancelled): the next use
        opens another, and the server ends what the old session held (an advisory lock)."""
        conn = self._loop_connections.pop(name, None)
        if conn is not None:
            await conn.close()

    async def record(self, notification: Notification,
                     decisions: dict[tuple[str, str], Decision]) -> RecordResult:
        """Journal one notification, group-committed with the firing ones waiting at the same time.

        The commit runs in a task of its own, whatever becomes of the caller: a request cancelled
        mid-way is journaled all the same (and deduplicated when Alertmanager retries)."""
        if not all_firing([(notification, decisions)]):
            return await super().record(notification, decisions)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[RecordResult] = loop.create_future()
        self._firing.append(_Waiting(notification, decisions, done, loop.time()))
        if self._full is not None and not self._full.done() and len(self._firing) >= self._enough:
            self._full.set_result(None)
        if self._committer is None:
            self._committer = asyncio.create_task(self._commit_firing(), name="journal-intake")
        return await asyncio.shield(done)

    async def _commit_firing(self) -> None:
        """Commit what waits, in one statement per batch; what arrives meanwhile is the next batch.

        A batch goes once its oldest notification has waited the commit window (counted from its
        arrival, so one that arrived during the previous commit waits only what is left of it), or
        sooner, once as many wait as the fullest of the latest batches held (senders that wait for
        their answers, as Alertmanager's do, send no more until then); and the event loop runs once
        more what is ready: requests received meanwhile join this batch instead of paying a commit of
        their own. Each commit costs PostgreSQL and the replica a fixed share (the statement, the WAL
        flush) whatever it carries, so on busy CPUs fuller batches are what lets intake keep up;
        every caller is still answered only once its rows are committed."""
        loop = asyncio.get_running_loop()
        waiting: list[_Waiting] = []
        try:
            while self._firing:
                left = self._firing[0].arrived + self._commit_window - loop.time()
                self._enough = max(self._sizes, default=math.inf)
                if left > 0 and len(self._firing) < self._enough:
                    self._full = loop.create_future()
                    await asyncio.wait([self._full], timeout=left)
                    self._full = None
                await asyncio.sleep(0)
                waiting = [self._firing.popleft() for _ in range(len(self._firing))]
                self._sizes.append(len(waiting))
                batch = [(each.notification, each.decisions) for each in waiting]
                results: list[RecordResult | Exception]
                try:
                    results = await self._record_firing(batch)
                except Exception as exc:  # a bug: these requests fail (500), the next batch is tried
                    log.exception("event=intake_failed notifications=%d", len(batch))
                    results = [exc] * len(batch)
                for each, result in zip(waiting, results, strict=True):
                    if isinstance(result, Exception):
                        each.done.set_exception(result)
                    else:
                        each.done.set_result(result)
        finally:
            self._committer = None
            for each in (*waiting, *self._firing):  # cancelled (shut down): nothing was answered
                if not each.done.done():
                    each.done.set_exception(JournalUnwritable("the webhook is shutting down"))

    async def _record_firing(self, batch: Batch) -> list[RecordResult | Exception]:
        try:
            conn = await self._connection("intake")
            cursor = await conn.execute(_RECORD_FIRING, _firing_arguments(batch, time.time()))
            rows = await cursor.fetchall()
        except ONE_BY_ONE as exc:
            log.info("event=intake_one_by_one notifications=%d why=%r", len(batch), exc)
            return await self._one_by_one(batch)
        except self.ERRORS as exc:
            await self._drop_connection("intake")
            self._failed(exc)
            return [JournalUnwritable(str(exc) or type(exc).__name__)] * len(batch)
        except BaseException:
            await self._drop_connection("intake")  # cancelled (shut down) mid-statement
            raise
        self._recovered()
        return _firing_results(batch, rows)

    async def _one_by_one(self, batch: Batch) -> list[RecordResult | Exception]:
        intake = cast(PostgresJournal, self._intake)
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self._intake_executor, lambda: intake.record_one_by_one(batch, self._resolve))
        except self.ERRORS as exc:
            self._failed(exc)
            return [JournalUnwritable(str(exc) or type(exc).__name__)] * len(batch)
        self._recovered()
        return results

    def _lane(self) -> tuple[ThreadPoolExecutor, Journal]:
        if _ADMITTING.get() is self:
            return self._admission_executor, self._admission_db
        return super()._lane()

    async def _read(self, fn: Callable[[Journal], Any]) -> Any:
        """Reads fail as writes do while the server cannot be reached: callers wait and retry."""
        try:
            return await super()._read(fn)
        except self.ERRORS as exc:
            self._failed(exc)
            raise JournalUnwritable(str(exc)) from exc

    @contextlib.asynccontextmanager
    async def admission(self) -> AsyncIterator[None]:
        """Hold the fleet's admission lock: one replica admits at a time. The session stays open from
        one admission to the next (the engine admits one action at a time)."""
        kept = "admission" in self._loop_connections
        while True:
            try:
                conn = await self._connection("admission")
                await conn.execute("SELECT pg_advisory_lock(%s)", (ADMISSION_LOCK,))
                break
            except BaseException as exc:
                await self._drop_connection("admission")
                if not isinstance(exc, self.ERRORS):
                    raise
                if kept:  # a session the server ended meanwhile (restarted, cut): once more, on a new one
                    kept = False
                    continue
                self._failed(exc)
                raise JournalUnwritable(str(exc)) from exc
        admitting = _ADMITTING.set(self)
        try:
            yield
        finally:
            _ADMITTING.reset(admitting)
            try:
                await conn.execute("SELECT pg_advisory_unlock(%s)", (ADMISSION_LOCK,))
            except BaseException as exc:
                await self._drop_connection("admission")  # ending the session releases the lock as well
                if not isinstance(exc, self.ERRORS):
                    raise

    async def close(self) -> None:
        if self._committer is not None:
            await asyncio.wait([self._committer])
        for name in list(self._loop_connections):
            await self._drop_connection(name)
        await asyncio.get_running_loop().run_in_executor(self._admission_executor, self._admission_db.close)
        self._admission_executor.shutdown(wait=True)
        await super().close()
