"""The ``Store`` on PostgreSQL, shared by several webhook replicas (``journal: {url: ...}``).

It is the SQLite journal's SQL and rules, run through psycopg 3 (``gpuhealth[postgres]``), plus
what sharing one journal between replicas needs:

- intake takes a transaction-level advisory lock, so notifications delivered to two replicas at
  once (an Alertmanager HA pair) are journaled one after the other: the second finds the alert
  already there and is a duplicate;
- actions are claimed row by row: ``due`` picks candidates ``FOR UPDATE SKIP LOCKED`` (replicas
  never wait on each other's rows) and claims them with a lease, renewed on every pass of the
  worker; a replica that dies stops renewing and, once the lease has run out, another claims its
  actions and resumes them after their last journaled step;
- admission (guardrails, then pending -> running) holds a session advisory lock, so the breaker,
  cooldowns and rate limits read a journal no other replica is changing meanwhile: they are
  fleet-wide.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import psycopg
from gpuhealth.webhook.journal import (
    ACTION_COLUMNS,
    ALERT_COLUMNS,
    AsyncJournal,
    Journal,
    _action,
    action_values,
    alert_values,
    intake_state,
)
from gpuhealth.webhook.models import Notification
from gpuhealth.webhook.store import (
    ACTIVE_STATES,
    PENDING,
    RUNNING,
    SKIPPED,
    Action,
    Decision,
    DrainedNode,
    JournalUnwritable,
    RecordResult,
    Resolver,
)

log = logging.getLogger(__name__)
INTAKE_LOCK = 0x67707568_0001  # advisory lock keys: "gpuh" and what they guard
ADMISSION_LOCK = 0x67707568_0002
_KEYS = {"drained": "node", "jobs": "job_id", "meta": "key"}  # INSERT OR REPLACE targets
_WITH_ID = ("notifications", "actions", "transitions")


_REAL = frozenset({"received_at", "resolved_at", "next_at", "finished_at", "updated_at"})


def _unnest(prefix: str, columns: tuple[str, ...]) -> str:
    """Rows from one array parameter per column (``{prefix}{column}``), numbered by ``position``."""
    arrays = ", ".join(f"%({prefix}{c})s::{'float8' if c in _REAL else 'text'}[]" for c in columns)
    return f"unnest({arrays}) WITH ORDINALITY AS {prefix}rows ({', '.join(columns)}, position)"


# One notification of firing alerts in one statement: its new alerts (a conflict on the primary key,
# fingerprint + startsAt, is a duplicate, also when another replica's intake holds the key: the insert
# waits for that one to commit), the actions of those new alerts, their first transitions, and the
# notification itself with its count of new alerts. It returns the notification's id, that count, and
# the new actions.
_RECORD_FIRING = f"""
WITH note AS (SELECT nextval(pg_get_serial_sequence('notifications', 'id')) AS id),
new_alerts AS (
    INSERT INTO alerts ({', '.join(ALERT_COLUMNS)}, notification_id)
    SELECT {', '.join(ALERT_COLUMNS)}, note.id FROM {_unnest('alert_', ALERT_COLUMNS)}, note ORDER BY position
    ON CONFLICT DO NOTHING RETURNING fingerprint, starts_at),
new_actions AS (
    INSERT INTO actions ({', '.join(ACTION_COLUMNS)})
    SELECT {', '.join(ACTION_COLUMNS)} FROM {_unnest('action_', ACTION_COLUMNS)}
    JOIN new_alerts USING (fingerprint, starts_at) ORDER BY position
    ON CONFLICT DO NOTHING RETURNING id, kind, state, reason, detail),
first_transitions AS (
    INSERT INTO transitions (action_id, at, state, reason, detail)
    SELECT id, %(now)s, state, reason, detail FROM new_actions),
stored AS (
    INSERT INTO notifications (id, received_at, receiver, group_key, status, alerts, new_alerts)
    SELECT id, %(now)s, %(receiver)s, %(group_key)s, %(status)s, %(alerts)s, (SELECT COUNT(*) FROM new_alerts)
    FROM note)
SELECT note.id, (SELECT COUNT(*) FROM new_alerts), a.id, a.kind, a.state, a.reason, a.detail
FROM note LEFT JOIN new_actions a ON TRUE ORDER BY a.id
"""


def _firing_arguments(notification: Notification, decisions: dict[tuple[str, str], Decision],
                      now: float) -> dict[str, Any]:
    """``_RECORD_FIRING``'s parameters: the rows the journal's own statements would write, by column."""
    alerts = [alert_values(alert, "firing", now) for alert in notification.alerts]
    actions = [action_values(alert, decision.kind, *intake_state(decision), now)
               for alert in notification.alerts if (decision := decisions.get(alert.key)) is not None]
    arguments: dict[str, Any] = {"now": now, "receiver": notification.receiver,
                                 "group_key": notification.group_key, "status": notification.status,
                                 "alerts": len(notification.alerts)}
    for prefix, columns, rows in (("alert_", ALERT_COLUMNS, alerts), ("action_", ACTION_COLUMNS, actions)):
        arguments |= {f"{prefix}{c}": [row[i] for row in rows] for i, c in enumerate(columns)}
    return arguments


def _firing_result(alerts: int, rows: list[tuple[Any, ...]]) -> RecordResult:
    result = RecordResult(int(rows[0][0]), duplicates=alerts - int(rows[0][1]))
    for _, _, action_id, kind, state, reason, detail in rows:
        if action_id is None:
            continue  # no new action: the notification's only row
        if state == SKIPPED:
            result.refused.append((int(action_id), kind, reason, detail))
        else:
            result.new_actions.append(int(action_id))
    return result


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
        if self.conn.closed:
            self.conn = self._connect()
        try:
            return _Cursor(self.conn.execute(_translate(sql), tuple(args)))
        except psycopg.OperationalError:
            if self.conn.broken:
                self.conn.close()  # the next statement connects again (after a restart of the server)
            raise

    def pipelined(self, statements: Sequence[tuple[str, Any]]) -> list[list[tuple[Any, ...]]]:
        """Run ``statements`` as one transaction sent in one go (pipeline mode: one round trip, not one
        per statement); each one's rows. Any error rolls the transaction back before it is raised."""
        if self.conn.closed:
            self.conn = self._connect()
        try:
            with self.conn.pipeline():
                self.conn.execute("BEGIN")
                cursors = [self.conn.execute(sql, args) for sql, args in statements]
                self.conn.execute("COMMIT")
            return [cursor.fetchall() if cursor.description else [] for cursor in cursors]
        except BaseException:
            if self.conn.broken:
                self.conn.close()
            elif self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                self.conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.conn.close()


class PostgresJournal(Journal):
    """``Journal`` on one PostgreSQL connection, with claims for replicas."""

    REFUSED = (ValueError, psycopg.DataError, psycopg.IntegrityError)
    DIALECT = "postgres"

    def __init__(self, url: str, replica: str, lease_seconds: float) -> None:
        self.replica, self.lease_seconds = replica, lease_seconds
        self._renewed_at = float("-inf")  # when this replica last renewed its claims
        self._fenced = False  # set while the worker's own transitions run: they need the claim
        self._attach(_Connection(url))  # type: ignore[arg-type]  # same calls as sqlite3.Connection

    def _schema_version(self) -> int:
        """PostgreSQL keeps the version in the ``schema_version`` table; replicas starting together
        migrate one after the other (the intake lock, held until the migration commits)."""
        self.db.execute("SELECT pg_advisory_xact_lock(?)", (INTAKE_LOCK,))
        self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
        row = self.db.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0]) if row is not None and row[0] is not None else 0

    def _set_schema_version(self, version: int) -> None:
        self.db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))

    def record(self, batch: list[tuple[Notification, dict[tuple[str, str], Decision]]], resolve: Resolver
               ) -> list[RecordResult | Exception]:
        """Firing alerts, the bulk of intake, go in one statement per notification and one round trip per
        group commit, beside the other replicas' intake (the intake lock, shared): the alerts' primary key
        makes the second delivery of an alert a duplicate, whichever replica has it.

        A batch with a resolution runs the journal's own statements holding the intake lock alone (what
        a resolution reads and cancels must not change meanwhile), and so does a batch the database
        refused (a notification it cannot store, isolated there in its savepoint) or one that crossed
        another replica's on the same alerts in another order (a deadlock, which PostgreSQL broke).
        """
        if all(alert.status == "firing" for notification, _ in batch for alert in notification.alerts):
            now = time.time()
            statements: list[tuple[str, Any]] = [("SELECT pg_advisory_xact_lock_shared(%s)", (INTAKE_LOCK,))]
            statements += [(_RECORD_FIRING, _firing_arguments(n, d, now)) for n, d in batch]
            try:
                stored = cast(_Connection, self.db).pipelined(statements)[1:]
            except (*self.REFUSED, psycopg.errors.DeadlockDetected) as exc:
                log.info("event=intake_one_by_one notifications=%d why=%r", len(batch), exc)
            else:
                return [_firing_result(len(n.alerts), rows)
                        for (n, _), rows in zip(batch, stored, strict=True)]
        return super().record(batch, resolve)

    def _lock_intake(self) -> None:
        """Alone: no other replica's intake runs until this one commits."""
        self.db.execute("SELECT pg_advisory_xact_lock(?)", (INTAKE_LOCK,))

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

    def due(self, now: float, busy_nodes: Iterable[str], limit: int,
            yield_reasons: Iterable[str] = ()) -> list[Action]:
        """Claim what is due for this replica: its own claims (renewed), unclaimed actions, and those
        whose claim lapsed. A node whose oldest active action another replica holds is left to it."""
        def run() -> list[Action]:
            lease = now + self.lease_seconds
            self._renew(now)
            rows = self.db.execute("SELECT * FROM actions WHERE state IN (?, ?) ORDER BY id "
                                   "FOR UPDATE SKIP LOCKED", (PENDING, RUNNING)).fetchall()
            seen, yielding, chosen = set(busy_nodes), frozenset(yield_reasons), []
            for row in rows:
                if row["node"] in seen:
                    continue
                if row["claimed_by"] not in ("", self.replica) and (row["lease_until"] or 0) > now:
                    seen.add(row["node"])  # another replica holds this node's queue
                    continue
                if row["reason"] in yielding and row["state"] == PENDING and row["next_at"] > now:
                    continue
                seen.add(row["node"])
                if row["next_at"] <= now:
                    chosen.append(int(row["id"]))
                    if len(chosen) >= limit:
                        break
            claimed = self.db.execute(
                "UPDATE actions SET claimed_by = ?, lease_until = ? WHERE id = ANY(?) RETURNING *",
                (self.replica, lease, chosen)) if chosen else None
            return sorted((_action(r) for r in claimed or ()), key=lambda a: a.id)

        result: list[Action] = self._tx(run)
        return result

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


class AsyncPostgresJournal(AsyncJournal):
    """The ``Store`` on PostgreSQL: the SQLite store's threads, one connection each."""

    ERRORS = (psycopg.OperationalError, psycopg.InterfaceError, OSError)

    def __init__(self, url: str, resolve: Resolver, replica: str, lease_seconds: float = 30.0,
                 on_failure: Callable[[], object] | None = None) -> None:
        self._url, self._lease_seconds = url, lease_seconds
        super().__init__(None, resolve, on_failure=on_failure, replica=replica)

    def _open(self, power_safe: bool) -> Journal:
        return PostgresJournal(self._url, self.replica, self._lease_seconds)

    async def _read(self, fn: Callable[[], Any]) -> Any:
        """Reads fail as writes do while the server cannot be reached: callers wait and retry."""
        try:
            return await super()._read(fn)
        except self.ERRORS as exc:
            self._failed(exc)
            raise JournalUnwritable(str(exc)) from exc

    @contextlib.asynccontextmanager
    async def admission(self) -> AsyncIterator[None]:
        """Hold the fleet's admission lock: one replica admits at a time."""
        try:
            conn = await psycopg.AsyncConnection.connect(self._url, autocommit=True, connect_timeout=5)
            await conn.execute("SELECT pg_advisory_lock(%s)", (ADMISSION_LOCK,))
        except self.ERRORS as exc:
            self._failed(exc)
            raise JournalUnwritable(str(exc)) from exc
        try:
            yield
        finally:
            await conn.close()  # closing the session releases its advisory lock
