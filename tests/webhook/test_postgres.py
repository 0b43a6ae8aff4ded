"""Webhook replicas sharing a journal on a real PostgreSQL (one cluster for the module, one database
per test): duplicate delivery acts once, a killed replica's action is finished by the other exactly
once, a database restart mid-intake loses and doubles nothing, and the breaker caps the fleet."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from gpuhealth.webhook.backends.simulated import SimulatedBackend
from gpuhealth.webhook.config import parse_config
from gpuhealth.webhook.intake import resolve
from gpuhealth.webhook.journal import Journal
from gpuhealth.webhook.models import parse_notification
from gpuhealth.webhook.policy import decide
from gpuhealth.webhook.schema import LATEST, MIGRATIONS, SchemaTooNew
from gpuhealth.webhook.store import Chain, JournalUnwritable
from gpuhealth.webhook.store_postgres import ADMISSION_LOCK, AsyncPostgresJournal, PostgresJournal
from waiting import eventually
from webhook_helpers import TOKEN, alert, notification, resolved

from gpuhealth.local.postgres import LocalPostgres, bindir
from gpuhealth.local.process import ManagedProcess, free_port, http_ok, wait_until

pytestmark = [pytest.mark.skipif(bindir() is None, reason="PostgreSQL is not installed"),
              pytest.mark.timeout(180)]

NODES = [f"gpu{i:02d}" for i in range(1, 11)]
LEASE = 2.0
_databases = itertools.count()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    with LocalPostgres(tmp_path_factory.mktemp("postgres") / "postgres.log") as pg:
        yield pg


@pytest.fixture
def database(cluster: LocalPostgres) -> str:
    """A fresh database in the module's cluster: its URL."""
    name = f"journal{next(_databases)}"
    with psycopg.connect(cluster.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return cluster.url.rsplit("/", 1)[0] + "/" + name


class Replica:
    """One gpuhealth-webhook process on the shared journal and the shared simulated cluster."""

    def __init__(self, name: str, tmp_path: Path, url: str, **settings: Any) -> None:
        self.name, self.port = name, free_port()
        self.dir = tmp_path / name
        self.dir.mkdir()
        (self.dir / "token").write_text(TOKEN)
        self.cluster = tmp_path / "cluster.json"
        self.config = self.dir / "webhook.yaml"
        self.config.write_text(yaml.safe_dump({
            "listen": f"127.0.0.1:{self.port}", "state_dir": "state", "auth": {"token_file": "token"},
            "journal": {"url": url, "replica": name, "lease_seconds": LEASE},
            "backend": {"type": "simulated", "nodes": NODES, "state_file": str(self.cluster),
                        "latency_seconds": settings.pop("latency", 0.0),
                        "jobs": {n: [f"{n}-a", f"{n}-b"] for n in NODES}},
            "retry": {"job_retry_interval_seconds": 0, "backoff_initial_seconds": 0.2},
            **settings,
        }))
        self.proc: ManagedProcess | None = None

    def start(self) -> Replica:
        argv = [sys.executable, "-m", "gpuhealth.webhook.main", "--config", str(self.config)]
        self.proc = ManagedProcess(f"webhook-{self.name}", argv, self.dir / "webhook.log").start()
        self.proc.wait_ready(lambda: http_ok(f"http://127.0.0.1:{self.port}/healthz"), timeout=30)
        return self

    def kill(self) -> None:
        assert self.proc is not None and self.proc.proc is not None
        os.killpg(self.proc.proc.pid, signal.SIGKILL)
        self.proc.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def request(self, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Authorization": f"Bearer {TOKEN}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=20) as resp:
            return json.load(resp) if path not in ("/metrics", "/") else resp.read().decode()

    def actions(self) -> list[dict[str, Any]]:
        actions: list[dict[str, Any]] = self.request("/actions")["actions"]
        return actions

    def history(self) -> list[list[Any]]:
        return json.loads(self.cluster.read_text())["history"] if self.cluster.exists() else []


@pytest.fixture
def replicas(tmp_path: Path, database: str, request: pytest.FixtureRequest) -> Iterator[list[Replica]]:
    settings = getattr(request, "param", {})
    pair = [Replica(name, tmp_path, database, **dict(settings)) for name in ("a", "b")]
    try:
        for replica in pair:
            replica.start()
        yield pair
    finally:
        for replica in pair:
            replica.stop()


def test_two_stores_record_one_alert_once_and_claim_each_action_once(database):
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    parsed = parse_notification(notification(*[alert(n, action="drain") for n in NODES[:4]]))
    a, b = PostgresJournal(database, "a", LEASE), PostgresJournal(database, "b", LEASE)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = [f.result()[0] for f in [pool.submit(j.record, [(parsed, decide(parsed, config))], resolve)
                                          for j in (a, b)]]
    assert sorted(len(r.new_actions) for r in results) == [0, 4]  # the later one found them all
    assert sorted(r.duplicates for r in results) == [0, 4]
    now = time.time()
    mine = a.due(now, (), 2)
    assert len(mine) == 2 and {x.claimed_by for x in mine} == {"a"}
    theirs = b.due(now, (), 10)
    assert {x.id for x in theirs}.isdisjoint(x.id for x in mine) and len(theirs) == 2
    assert a.start(theirs[0].id, None) is False  # b holds it
    assert b.claims() == {"a": sorted(x.id for x in mine), "b": sorted(x.id for x in theirs)}
    taken = b.due(now + LEASE + 1, (), 10)  # a went silent: its lease ran out
    assert {x.id for x in taken} >= {x.id for x in mine} and {x.claimed_by for x in taken} == {"b"}
    # a, back from its pause, is fenced off what b took over; an operator's move still works anywhere
    assert a.start(mine[0].id, None) is False
    assert a.update(mine[0].id, "done", expect="pending", outcome="done", reason="ok") is False
    assert b.start(mine[0].id, None) is True and b.get(mine[0].id).state == "running"
    assert a.try_move(mine[1].id, ("pending",), "cancelled", "operator", "by a") is not None
    a.close()
    b.close()


def test_a_node_whose_oldest_action_another_replica_is_claiming_is_left_to_it(database):
    """Per-node order holds across replicas: while another session holds the row of a node's oldest
    action (a replica claiming it), ``due`` takes neither that action nor the next one of the node, and
    locks nothing it does not claim (other nodes' actions are claimed as usual)."""
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    parsed = parse_notification(notification(alert("gpu01", action="drain"), alert("gpu01", action="replace"),
                                             alert("gpu02", action="drain")))
    journal = PostgresJournal(database, "b", LEASE)
    [recorded] = journal.record([(parsed, decide(parsed, config))], resolve)
    oldest, following, other_node = recorded.new_actions
    with psycopg.connect(database) as claiming:
        claiming.execute("SELECT id FROM actions WHERE id = %s FOR UPDATE", (oldest,))
        assert [a.id for a in journal.due(time.time(), (), 10)] == [other_node]
        claiming.rollback()
    assert [a.id for a in journal.due(time.time(), (), 10)] == [oldest, other_node]  # its own claim again
    assert following not in {a.id for a in journal.due(time.time(), (), 10)}
    journal.close()


def test_intake_journals_what_the_sqlite_journal_does_in_one_statement_per_notification(database, tmp_path):
    """The same batches through both stores: the same answers and the same rows (PostgreSQL journals
    firing alerts in one statement per notification, SQLite statement by statement)."""
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES},
                           "guardrails": {"require_approval": ["drain_reboot"]}})
    seen = alert("gpu01", action="drain")
    twice = alert("gpu04", action="restart_job")
    varied = [seen, alert("gpu02", action="drain_reboot"),
              alert("gpu03", action="drain_reset_gpu", gpu="0;reboot"), twice,
              twice, alert("gpu05", action="no_such_action"), alert("gpu06", action="none"),
              alert("gpu07", action="drain", summary="bell \x07 and escape \x1b[31m")]
    batches = [[notification(seen)],  # then the same alert again, in one notification and across two:
               [notification(*varied), notification(alert("gpu08", action="drain"), twice)]]
    stores = Journal(tmp_path / "journal.sqlite3"), PostgresJournal(database, "a", LEASE)
    answers, rows = [], []
    for store in stores:
        answered = []
        for batch in batches:
            parsed = [parse_notification(body) for body in batch]
            answered += [(len(r.new_actions), r.duplicates, [x[1:] for x in r.refused])
                         for r in store.record([(n, decide(n, config)) for n in parsed], resolve)]
        answers.append(answered)
        rows.append(sorted((a.fingerprint, a.kind, a.node, a.gpu, a.alertname, a.summary, a.state, a.outcome,
                            a.reason, a.detail, a.finished_at is not None, len(store.transitions(a.id)))
                           for a in store.list_actions()))
        store.close()
    assert answers[0] == answers[1] and rows[0] == rows[1]
    new, duplicates, refused = answers[0][1]
    assert (new, duplicates) == (4, 2)  # gpu02, gpu04 once, gpu06 (none), gpu07; seen before and gpu04 again
    assert [(kind, reason) for kind, reason, _ in refused] == [("drain_reset_gpu", "invalid_label"),
                                                               ("unknown", "unknown_action")]
    assert {r[6] for r in rows[1]} == {"pending", "awaiting_approval", "skipped"}


def _lock_waiters(conn: psycopg.Connection[Any]) -> int:
    """How many sessions of this database wait for a lock."""
    row = conn.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock'").fetchone()
    return 0 if row is None else int(row[0])


def test_a_resolution_waits_for_a_replica_starting_its_action_and_leaves_it_running(database):
    """A replica's worker holds an action's row while it starts it; the alert's resolution, journaled
    meanwhile, waits for that commit and finds the action running: it is not cancelled under way (its
    node is undrained after it, as for any drain that ran)."""
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    journal = PostgresJournal(database, "a", LEASE)
    firing = alert(NODES[0], action="drain")
    fired, gone = parse_notification(notification(firing)), parse_notification(notification(resolved(firing)))
    [recorded] = journal.record([(fired, decide(fired, config))], resolve)
    assert not isinstance(recorded, Exception)
    [action_id] = recorded.new_actions
    with psycopg.connect(database) as worker, psycopg.connect(database, autocommit=True) as watch, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        worker.execute("SELECT state FROM actions WHERE id = %s FOR UPDATE", (action_id,))
        resolving = pool.submit(journal.record, [(gone, decide(gone, config))], resolve)
        wait_until(lambda: _lock_waiters(watch) == 1, timeout=10, what="the resolution waiting on the row")
        worker.execute("UPDATE actions SET state = 'running', started_at = 1 WHERE id = %s", (action_id,))
        worker.commit()
        [ended] = resolving.result(timeout=30)
    assert not isinstance(ended, Exception)
    assert ended.resolved == 1 and ended.cancelled == [] and len(ended.new_actions) == 1  # the undrain
    assert journal.get(action_id).state == "running"
    journal.close()


def test_intake_that_deadlocks_with_another_is_journaled_again_one_notification_at_a_time(database, caplog):
    """Replica a's group commit waits on an alert another session holds uncommitted, b's on one of a's,
    and that session then on one of b's: PostgreSQL cancels a's statement (the first to wait) and a
    journals its notifications again one by one, with the alerts table to itself. Every alert ends up
    journaled once, with one action, and every notification answered."""
    caplog.set_level("INFO", logger="gpuhealth.webhook.store_postgres")
    # A deadlock is found by a session that has waited deadlock_timeout: with 5 s that is a, the first
    # to wait, however slowly a loaded machine closes the cycle.
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {database.rsplit('/', 1)[1]} SET deadlock_timeout = '5s'")
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    a, b = PostgresJournal(database, "a", LEASE), PostgresJournal(database, "b", LEASE)
    k0, k1, k2 = (alert(n, action="drain", fingerprint=f"{i:016x}") for i, n in enumerate(NODES[:3], 100))
    parsed = {key: parse_notification(notification(x)) for key, x in (("k0", k0), ("k1", k1), ("k2", k2))}

    def batch(*keys: str) -> list[tuple[Any, Any]]:
        return [(parsed[k], decide(parsed[k], config)) for k in keys]

    def insert_alert(conn: psycopg.Connection[Any], fingerprint: str) -> None:
        conn.execute("INSERT INTO alerts (fingerprint, starts_at, status, labels, annotations, received_at, "
                     "notification_id) VALUES (%s, %s, 'firing', '{}', '{}', 0, 0) ON CONFLICT DO NOTHING",
                     (fingerprint, OLD_ALERT[1]))

    with psycopg.connect(database) as other, psycopg.connect(database, autocommit=True) as watch, \
            concurrent.futures.ThreadPoolExecutor(3) as pool:
        insert_alert(other, k1["fingerprint"])  # held, uncommitted
        by_a = pool.submit(a.record, batch("k0", "k1"), resolve)
        wait_until(lambda: _lock_waiters(watch) == 1, timeout=10, what="a waiting on k1")
        by_b = pool.submit(b.record, batch("k2", "k0"), resolve)
        wait_until(lambda: _lock_waiters(watch) == 2, timeout=10, what="b waiting on k0")
        closing = pool.submit(insert_alert, other, k2["fingerprint"])  # closes the cycle
        answers_b = by_b.result(timeout=30)  # a gave way: b journals both
        closing.result(timeout=30)
        other.rollback()  # the other session's alerts were never journaled: a journals k1
        answers_a = by_a.result(timeout=30)
    assert [(len(x.new_actions), x.duplicates) for x in answers_b] == [(1, 0), (1, 0)]
    assert [(len(x.new_actions), x.duplicates) for x in answers_a] == [(0, 1), (1, 0)]
    assert sorted(x.node for x in a.list_actions()) == NODES[:3]
    assert any("event=intake_one_by_one notifications=2" in r.getMessage() for r in caplog.records)
    a.close()
    b.close()


def test_one_replica_at_a_time_claims_and_advances_a_chain(database):
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    parsed = parse_notification(notification(alert("gpu03", action="restart_job", gpu="1")))
    a, b = PostgresJournal(database, "a", LEASE), PostgresJournal(database, "b", LEASE)
    [action_id] = a.record([(parsed, decide(parsed, config))], resolve)[0].new_actions
    a.due(time.time(), (), 1)
    assert a.start(action_id, None)
    assert a.update(action_id, "done", expect="running", outcome="done", reason="ok")
    action = a.get(action_id)
    now = time.time()
    chain = Chain(0, "gpu03", "1", action.alertname, action.fingerprint, action.starts_at, "", "restart_job",
                  action_id, "running", "", None, now, None, now, now, None)
    chain.id = a.open_chain(chain)
    assert chain.id is not None and b.open_chain(chain) is None, "one active chain per node and GPU"
    [mine] = a.due_chains(now, (), 10, now)
    assert (mine.id, mine.claimed_by) == (chain.id, "a")
    assert b.due_chains(now, (), 10, now) == [], "a live claim is left to its replica"
    assert b.move_chain(chain.id, "running", "verifying", "b") is None, "fenced off a's chain"
    assert b.escalate_chain(chain.id, "running", "drain_reset_gpu", "pending", "b") is None
    moved = a.move_chain(chain.id, "running", "verifying", "a verifies", step_done_at=now, verify_at=now,
                         deadline=now + 60)
    assert moved is not None and moved.state == "verifying"
    [taken] = b.due_chains(now + LEASE + 1, (), 10, now)  # a went silent: its lease ran out
    assert taken.claimed_by == "b"
    assert a.escalate_chain(chain.id, "verifying", "drain_reset_gpu", "pending", "a") is None, "a is fenced"
    escalated = b.escalate_chain(chain.id, "verifying", "drain_reset_gpu", "pending", "b escalates")
    assert escalated is not None and escalated.step == "drain_reset_gpu" and escalated.state == "running"
    step = b.get(escalated.action_id)
    assert (step.kind, step.state, step.node, step.gpu) == ("drain_reset_gpu", "pending", "gpu03", "1")
    assert a.move_chain(chain.id, "running", "cancelled", "cancelled by an operator on a") is not None
    assert b.chain_counts()["cancelled"] == 1 and b.chain_for_action(escalated.action_id) is None
    a.close()
    b.close()


def test_intake_isolates_a_notification_the_database_refuses_and_resolutions_run_alone(database):
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    journal = PostgresJournal(database, "a", LEASE)
    first, middle, last = (parse_notification(notification(alert(n, action="drain"))) for n in NODES[:3])
    refused = dataclasses.replace(middle, receiver="NUL \x00 inside")  # past the parser: only the database
    results = journal.record([(n, decide(n, config)) for n in (first, refused, last)], resolve)
    assert isinstance(results[1], psycopg.DataError)
    assert [len(r.new_actions) for r in (results[0], results[2])] == [1, 1]  # its neighbours are journaled
    assert sorted(a.node for a in journal.list_actions()) == [NODES[0], NODES[2]]
    firing = alert(NODES[3], action="drain")
    held_back = parse_notification(notification(firing))
    [held] = journal.record([(held_back, decide(held_back, config))], resolve)
    gone = parse_notification(notification(resolved(firing)))
    fresh = parse_notification(notification(alert(NODES[4], action="drain")))
    ended, started = journal.record([(n, decide(n, config)) for n in (gone, fresh)], resolve)
    assert not isinstance(ended, Exception) and not isinstance(started, Exception)
    assert ended.resolved == 1 and ended.cancelled == ["drain"] and len(started.new_actions) == 1
    assert journal.get(held.new_actions[0]).state == "cancelled"
    journal.close()


def test_a_hostile_nul_in_labels_is_journaled_and_refused_alone_as_on_sqlite(database):
    """PostgreSQL's text holds no NUL: a label carrying one must not fail its notification (Alertmanager
    would retry it, good alerts and all, for ever); it is journaled and skipped as on SQLite, firing and
    resolved, with its neighbour acted on."""
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    journal = PostgresJournal(database, "a", LEASE)
    hostile = alert(f"{NODES[0]}\x00; reboot", action="drain", summary="XID 79\x00 forged")
    good = alert(NODES[1], action="drain")
    firing = parse_notification(notification(hostile, good))
    [result] = journal.record([(firing, decide(firing, config))], resolve)
    assert not isinstance(result, Exception), result
    assert len(result.new_actions) == 1 and [r[2] for r in result.refused] == ["invalid_node"]
    assert sorted((a.node, a.state) for a in journal.list_actions()) == [
        (ascii(f"{NODES[0]}\ufffd; reboot"), "skipped"), (NODES[1], "pending")]  # journaled quoted
    gone = parse_notification(notification(resolved(hostile)))
    [ended] = journal.record([(gone, decide(gone, config))], resolve)
    assert not isinstance(ended, Exception) and ended.resolved == 1
    journal.close()


async def test_the_webhook_store_group_commits_firing_intake_isolating_what_the_database_refuses(database):
    """Through the store the webhook uses (intake on the event loop): notifications arriving together are
    journaled together, one the database refuses fails alone (journaled again one by one, it is isolated
    there) while its neighbours are answered, a resolution is journaled statement by statement, and a
    caller cancelled mid-way (a client that hung up) has its notification journaled all the same."""
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    store = AsyncPostgresJournal(database, resolve, "a", LEASE)
    try:
        firing = alert(NODES[0], action="drain")
        first, middle, last = (parse_notification(notification(x)) for x in (
            firing, alert(NODES[1], action="drain"), alert(NODES[2], action="drain")))
        refused = dataclasses.replace(middle, receiver="NUL \x00 inside")  # only the database refuses it
        answers = await asyncio.gather(*(store.record(n, decide(n, config)) for n in (first, refused, last)),
                                       return_exceptions=True)
        assert isinstance(answers[1], psycopg.DataError)
        assert [len(a.new_actions) for a in (answers[0], answers[2])] == [1, 1]
        again = await store.record(first, decide(first, config))
        assert (again.duplicates, again.new_actions) == (1, [])
        gone = parse_notification(notification(resolved(firing)))
        ended = await store.record(gone, decide(gone, config))
        assert ended.resolved == 1 and ended.cancelled == ["drain"]
        hung_up = parse_notification(notification(alert(NODES[3], action="drain")))
        caller = asyncio.create_task(store.record(hung_up, decide(hung_up, config)))
        await asyncio.sleep(0)  # the caller has handed its notification over
        caller.cancel()
        nodes = await eventually(lambda: store.list_actions(state="pending"), lambda found: len(found) == 2,
                                 timeout=10, what="the cancelled caller's action")
        assert sorted(a.node for a in nodes) == [NODES[2], NODES[3]]
    finally:
        await store.close()


async def test_a_request_still_on_its_way_to_the_journal_joins_the_group_commit_about_to_go(database):
    """The group commit lets the event loop run once before it goes: a handler that was ready to journal
    (here, one step behind the first caller) rides in the same commit instead of the next round trip."""
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    store = AsyncPostgresJournal(database, resolve, "a", LEASE)
    first, second = (parse_notification(notification(alert(node, action="drain"))) for node in NODES[:2])

    async def one_step_behind() -> Any:
        await asyncio.sleep(0)  # still parsing when the first caller hands its notification over
        return await store.record(second, decide(second, config))

    try:
        answers = await asyncio.gather(store.record(first, decide(first, config)), one_step_behind())
        assert [len(answer.new_actions) for answer in answers] == [1, 1]
        with psycopg.connect(database) as conn:
            commits = conn.execute("SELECT COUNT(DISTINCT received_at), COUNT(*) FROM notifications"
                                   ).fetchone()
        assert commits == (1, 2)  # a group commit's notifications share its time of receipt
    finally:
        await store.close()


@pytest.mark.parametrize(("window", "commits"), [(2.0, 1), (0.0, 2)])
async def test_notifications_arriving_within_the_commit_window_share_one_commit(database, window, commits):
    """With a commit window, a notification arriving after the first one, while that one waits, rides in
    its commit; neither caller is answered before the commit holds its rows. Without a window each
    goes in a commit of its own."""
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    store = AsyncPostgresJournal(database, resolve, "a", LEASE, commit_window=window)
    first, second = (parse_notification(notification(alert(node, action="drain"))) for node in NODES[:2])

    def journaled() -> tuple[int, int]:
        with psycopg.connect(database) as conn:
            row = conn.execute("SELECT COUNT(DISTINCT received_at), COUNT(*) FROM notifications").fetchone()
        assert row is not None
        return row

    try:
        early = asyncio.create_task(store.record(first, decide(first, config)))
        if window:
            await asyncio.sleep(0.05)  # well inside the window
            assert not early.done() and journaled() == (0, 0)  # held, and so not answered yet
        else:
            await eventually(lambda: asyncio.sleep(0, early.done()), bool, timeout=10,
                             what="the first commit")
        late = await store.record(second, decide(second, config))
        assert [len(answer.new_actions) for answer in (await early, late)] == [1, 1]
        assert journaled() == (commits, 2)  # a group commit's notifications share its time of receipt
    finally:
        await store.close()


async def test_the_commit_window_ends_once_as_many_wait_as_the_fullest_recent_batch(database):
    """Senders that wait for their answers send no more meanwhile: once as many notifications wait as
    the fullest of the latest batches held, the batch goes without waiting out the window, and one
    arriving later (here well inside the window) goes in the next commit."""
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    store = AsyncPostgresJournal(database, resolve, "a", LEASE, commit_window=2.0)
    parsed = [parse_notification(notification(alert(node, action="drain"))) for node in NODES[:5]]

    def record(n: Any) -> Any:
        return store.record(n, decide(n, config))

    try:
        await asyncio.gather(*map(record, parsed[:2]))  # no batch before: waits the window; then 2 is enough
        pair = asyncio.gather(*map(record, parsed[2:4]))
        await asyncio.sleep(0.1)
        late = await record(parsed[4])
        assert [len(answer.new_actions) for answer in (*await pair, late)] == [1, 1, 1]
        with psycopg.connect(database) as conn:
            commits = [count for (count,) in conn.execute(
                "SELECT COUNT(*) FROM notifications GROUP BY received_at ORDER BY MIN(id)")]
        assert commits == [2, 2, 1]  # a group commit's notifications share its time of receipt
    finally:
        await store.close()


async def test_admission_holds_the_fleet_lock_on_one_session_kept_open_and_opened_again_once_cut(database):
    a, b = (AsyncPostgresJournal(database, resolve, name, LEASE) for name in ("a", "b"))
    watch = await psycopg.AsyncConnection.connect(database, autocommit=True)

    async def advisory_waiters() -> int:
        cursor = await watch.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event = 'advisory'")
        row = await cursor.fetchone()
        return 0 if row is None else int(row[0])

    async def holder() -> int | None:
        cursor = await watch.execute("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
                                     "((classid::bigint << 32) | objid::bigint) = %s", (ADMISSION_LOCK,))
        row = await cursor.fetchone()
        return None if row is None else int(row[0])

    released = asyncio.Event()

    async def b_admits() -> None:
        async with b.admission():
            await released.wait()

    try:
        async with a.admission():
            first = await holder()
            waiting = asyncio.create_task(b_admits())
            await eventually(advisory_waiters, timeout=10, what="b waiting for the lock")
            assert not waiting.done(), "one replica admits at a time"
        await eventually(holder, lambda pid: pid not in (None, first), timeout=10, what="b admitting after a")
        released.set()
        await asyncio.wait_for(waiting, timeout=10)
        async with a.admission():
            assert await holder() == first, "the same session, not a connection per action"
        await watch.execute("SELECT pg_terminate_backend(%s)", (first,))
        async with a.admission():  # the cut session is noticed and replaced
            assert await holder() not in (None, first)
    finally:
        await watch.close()
        for store in (a, b):
            await store.close()


async def test_what_admission_reads_and_writes_under_the_lock_never_queues_behind_the_workers_calls(database):
    """The shared journal thread busy (a running action's step write, say): admission, holding the
    fleet's lock, still reads its counts and starts its action, on a connection of its own."""
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    store = AsyncPostgresJournal(database, resolve, "a", LEASE)
    busy = threading.Event()
    try:
        body = parse_notification(notification(alert(NODES[0], action="drain")))
        [action_id] = (await store.record(body, decide(body, config))).new_actions
        [due] = await store.due(time.time(), (), 1)
        blocked = asyncio.get_running_loop().run_in_executor(store._executor, busy.wait)  # the shared lane
        async with asyncio.timeout(60), store.admission():  # on the shared lane: stuck until the timeout
            assert await store.get_meta("breaker") is None
            assert await store.start(action_id, None)
        assert not blocked.done()
        busy.set()
        await blocked
        assert due.id == action_id and (await store.get(action_id)).state == "running"
    finally:
        busy.set()
        await store.close()


async def test_admission_holds_the_fleet_lock_for_the_decision_not_across_cluster_reads(webhook, database):
    """A backend call can take long (scontrol, an API server): the lock every replica admits under is
    free while the cluster is read."""
    watch = await psycopg.AsyncConnection.connect(database, autocommit=True)

    async def lock_held() -> bool:
        cursor = await watch.execute("SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                                     "AND ((classid::bigint << 32) | objid::bigint) = %s", (ADMISSION_LOCK,))
        row = await cursor.fetchone()
        return row is not None and int(row[0]) > 0

    reads: list[tuple[str, bool]] = []

    class Watched(SimulatedBackend):
        async def node_state(self, node: str) -> Any:
            reads.append(("node_state", await lock_held()))
            return await super().node_state(node)

        async def fleet_size(self) -> int:
            reads.append(("fleet_size", await lock_held()))
            return await super().fleet_size()

        async def drain(self, node: str, reason: str, **kwargs: Any) -> None:
            reads.append(("drain", await lock_held()))
            await super().drain(node, reason, **kwargs)

    try:
        hook = await webhook(backend=Watched(NODES), journal={"url": database, "replica": "a"})
        await hook.post(alert(NODES[0], action="drain"))  # one: another action's admission holds it
        [action] = await hook.settle()
        assert action["state"] == "done"
        # the admission's reads (node, fleet size), then the node read again right before the drain
        assert reads == [("node_state", False), ("fleet_size", False), ("node_state", False),
                         ("drain", False)]
    finally:
        await watch.close()


async def test_intake_on_the_event_loop_answers_unwritable_while_the_server_is_gone(database, cluster):
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    store = AsyncPostgresJournal(database, resolve, "a", LEASE)
    try:
        before = parse_notification(notification(alert(NODES[0], action="drain")))
        await store.record(before, decide(before, config))
        cluster.stop()
        during = parse_notification(notification(alert(NODES[1], action="drain")))
        with pytest.raises(JournalUnwritable):
            await store.record(during, decide(during, config))
        assert store.write_error is not None
        cluster.start()
        after = await store.record(during, decide(during, config))  # Alertmanager's retry
        assert len(after.new_actions) == 1 and store.write_error is None
    finally:
        await store.close()


async def test_a_group_commit_that_fails_answers_unwritable_to_every_caller_and_journals_none(database,
                                                                                             cluster):
    """Concurrent notifications committed together: when the commit fails each caller is told (503,
    Alertmanager retries), and none of them is in the journal, so a retry is not a duplicate."""
    config = parse_config({"backend": {"type": "simulated", "nodes": NODES}})
    store = AsyncPostgresJournal(database, resolve, "a", LEASE)
    group = [parse_notification(notification(alert(node, action="drain", fingerprint=f"{i + 1:016x}")))
             for i, node in enumerate(NODES[:4])]
    try:
        await store.record(group[0], decide(group[0], config))  # the intake connection is open
        cluster.stop()
        outcomes = await asyncio.gather(*(store.record(n, decide(n, config)) for n in group[1:]),
                                        return_exceptions=True)
        assert all(isinstance(o, JournalUnwritable) for o in outcomes), outcomes
        cluster.start()
        with psycopg.connect(database) as conn:
            journaled = conn.execute("SELECT fingerprint FROM alerts ORDER BY fingerprint").fetchall()
        assert journaled == [("0000000000000001",)]  # only the one answered 200 before
        retried = [await store.record(n, decide(n, config)) for n in group[1:]]  # Alertmanager's retries
        assert [(len(r.new_actions), r.duplicates) for r in retried] == [(1, 0)] * 3
    finally:
        await store.close()


OLD_ALERT = ("0000000000000001", "2026-11-30T05:00:00.500000+00:00")  # conftest's alert(), as journaled


@pytest.mark.parametrize("version", range(LATEST))
def test_a_journal_migrates_from_each_older_version_keeping_its_records(database, version):
    """A database at ``version`` (0: empty), as the webhook of that version left it with a drain
    pending for a firing alert, is carried to the latest layout in place."""
    with psycopg.connect(database, autocommit=True) as conn:
        if version:
            conn.execute("CREATE TABLE schema_version (version BIGINT NOT NULL)")
        for migration in MIGRATIONS[:version]:
            for statement in migration.statements("postgres"):
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (migration.version,))
        if version:
            conn.execute("INSERT INTO alerts (fingerprint, starts_at, status, node, gpu, alertname, labels, "
                         "annotations, received_at, notification_id) VALUES (%s, %s, 'firing', 'gpu01', '0', "
                         "'GPUHealthXidFatal', '{}', '{}', 1, 1)", OLD_ALERT)
            conn.execute("INSERT INTO actions (fingerprint, starts_at, kind, node, gpu, alertname, summary, "
                         "state, next_at, received_at, updated_at) VALUES (%s, %s, 'drain', 'gpu01', '0', "
                         "'GPUHealthXidFatal', 'XID 79', 'pending', 1, 1, 1)", OLD_ALERT)
    journal = PostgresJournal(database, "a", LEASE)
    with psycopg.connect(database) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_version ORDER BY version")]
    assert versions == list(range(1, LATEST + 1))
    again = parse_notification(notification(alert("gpu01", action="drain", fingerprint=OLD_ALERT[0])))
    [result] = journal.record([(again, decide(again, parse_config({"backend": {
        "type": "simulated", "nodes": NODES}})))], resolve)
    if version:  # the old record is read in the new layout, and still deduplicates
        [old] = journal.list_actions()
        assert (old.kind, old.node, old.state, old.claimed_by) == ("drain", "gpu01", "pending", "")
        assert result.duplicates == 1 and result.new_actions == []
    else:
        assert result.duplicates == 0 and len(result.new_actions) == 1
    journal.close()
    PostgresJournal(database, "b", LEASE).close()  # an up-to-date journal opens unchanged
    with psycopg.connect(database) as conn:
        assert conn.execute("SELECT COUNT(*) FROM schema_version").fetchone() == (LATEST,)


def test_a_journal_from_a_newer_webhook_is_refused_untouched_and_its_connection_closed(database):
    PostgresJournal(database, "a", LEASE).close()
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (LATEST + 1,))
        with pytest.raises(SchemaTooNew, match=f"schema version {LATEST + 1}, newer than"):
            PostgresJournal(database, "a", LEASE)

        def others() -> int:
            row = conn.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
                               "AND pid != pg_backend_pid()").fetchone()
            return -1 if row is None else int(row[0])

        wait_until(lambda: others() == 0, timeout=10, what="the refused journal's session to end")
        assert conn.execute("SELECT MAX(version) FROM schema_version").fetchone() == (LATEST + 1,)


ESCALATING = {"escalation": {"enabled": True, "settle_seconds": 0, "poll_seconds": 0.1,
                             "step_timeout_seconds": {"restart_job": 0.5, "drain_reset_gpu": 0.5,
                                                      "drain_reboot": 0.5}},
              "guardrails": {"node_cooldown_seconds": 3600}}


@pytest.mark.parametrize("replicas", [ESCALATING], indirect=True)
def test_two_replicas_advance_a_chain_through_every_step_once(replicas):
    a, b = replicas
    b.request("/alerts", notification(alert("gpu04", action="restart_job", gpu="2",
                                            alertname="GPUHealthXidRestartJob")))

    def chain() -> dict[str, Any]:
        chains = a.request("/actions")["chains"]
        return chains[0] if chains else {}

    wait_until(lambda: chain().get("state") == "exhausted", timeout=90, interval=0.1,
               what="the chain to run through every step")
    assert [x["kind"] for x in sorted(b.actions(), key=lambda x: x["id"])] == [
        "restart_job", "drain_reset_gpu", "drain_reboot", "replace"]
    effects = Counter((op[0], op[1]) for op in a.history())
    assert effects == Counter({("requeue", "gpu04-a"): 1, ("requeue", "gpu04-b"): 1, ("drain", "gpu04"): 1,
                               ("reset_gpu", "gpu04"): 1, ("reboot", "gpu04"): 1})
    logs = [replica.dir / "state" / "audit.jsonl" for replica in (a, b)]

    def events() -> Counter[str]:
        return Counter(json.loads(line)["event"] for log in logs if log.exists()
                       for line in log.read_text().splitlines())
    wait_until(lambda: events()["chain_exhausted"], timeout=10, interval=0.1, what="the audit line")
    assert (events()["chain_opened"], events()["chain_escalated"], events()["chain_exhausted"]) == (1, 3, 1)
    assert "gpuhealth_webhook_chains{state=\"exhausted\"} 1.0" in b.request("/metrics")


def test_duplicate_delivery_to_both_replicas_yields_one_action_and_any_replica_approves(replicas):
    a, b = replicas
    body = notification(alert("gpu01", action="drain"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda r: r.request("/alerts", body), (a, b)))
    assert sorted(len(x["new_actions"]) for x in answers) == [0, 1]
    wait_until(lambda: [x["state"] for x in b.actions()] == ["done"], timeout=30, what="the drain to finish")
    assert Counter(op[0] for op in a.history()) == Counter({"drain": 1, "requeue": 2})
    [done] = a.actions()
    assert done["claimed_by"] in ("a", "b")
    status = b.request("/status")
    assert status["replica"] == "b" and status["claims"] == {}
    assert 'gpuhealth_webhook_claimed_actions{replica="b"} 0.0' in b.request("/metrics")
    page = b.request("/")
    assert "replica b," in page and f"<td>{done['claimed_by']}</td></tr>" in page


@pytest.mark.parametrize("replicas", [{"latency": 0.6}], indirect=True)
def test_sigkill_of_the_replica_running_an_action_the_other_finishes_it_exactly_once(replicas):
    a, b = replicas
    body = notification(alert("gpu02", action="drain_reboot"))
    [action_id] = a.request("/alerts", body)["new_actions"]

    def running_with_progress() -> bool:
        action = a.request(f"/actions/{action_id}")
        return action["state"] == "running" and bool(action["progress"].get("done"))

    wait_until(running_with_progress, timeout=30, interval=0.05, what="the action part-way through")
    holder = a.request(f"/actions/{action_id}")["claimed_by"]
    victim, survivor = (a, b) if holder == "a" else (b, a)
    assert survivor.request("/status")["claims"] == {holder: [action_id]}  # visible from the other one
    victim.kill()
    wait_until(lambda: survivor.request(f"/actions/{action_id}")["state"] == "done", timeout=60,
               interval=0.1, what="the surviving replica to finish the action")
    finished = survivor.request(f"/actions/{action_id}")
    assert finished["claimed_by"] == survivor.name and finished["reason"] == "ok"
    effects = Counter((op[0], op[1]) for op in survivor.history())
    assert effects == Counter({("drain", "gpu02"): 1, ("requeue", "gpu02-a"): 1, ("requeue", "gpu02-b"): 1,
                               ("reboot", "gpu02"): 1})


def test_postgres_restarted_mid_intake_answers_5xx_and_loses_or_doubles_nothing(replicas, cluster):
    a, b = replicas
    statuses: Counter[int] = Counter()
    sent: list[str] = []
    restarted = threading.Event()

    def deliver(target: Replica, fingerprint: str) -> None:
        """Alertmanager: send until the replica answers 2xx; 5xx (or no answer) is retried."""
        body = notification(alert(NODES[len(sent) % len(NODES)], action="none", fingerprint=fingerprint))
        deadline = time.monotonic() + 60
        while True:
            try:
                target.request("/alerts", body)
                statuses[200] += 1
                sent.append(fingerprint)
                return
            except urllib.error.HTTPError as exc:
                statuses[exc.code] += 1
                assert exc.code >= 500, exc.read()
            except OSError:
                statuses[0] += 1
            assert time.monotonic() < deadline, "the webhook never took the notification again"
            time.sleep(0.1)  # Alertmanager's own back-off

    def stream(target: Replica, first: int) -> None:
        """Fresh alerts one after another, until five more have gone through after the restart."""
        numbers = itertools.count(first, 2)
        while not restarted.is_set():
            deliver(target, f"{next(numbers):016x}")
        for _ in range(5):
            deliver(target, f"{next(numbers):016x}")

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream, a, 0), pool.submit(stream, b, 1)]
        wait_until(lambda: len(sent) >= 10, timeout=30, what="intake under way")
        cluster.restart()
        restarted.set()
        for done in streams:
            done.result()
    assert statuses[503] + statuses[0] > 0, statuses  # the restart was felt, and answered as retryable
    assert not set(statuses) - {200, 503, 0}, statuses
    wait_until(lambda: http_ok(f"http://127.0.0.1:{a.port}/healthz"), timeout=30, what="a healthy again")
    journaled = Counter((x["fingerprint"], x["kind"]) for x in a.actions())
    assert journaled == Counter({(f, "none"): 1 for f in sent}) and len(set(sent)) == len(sent)


STORM_GUARDRAILS = {"breaker_max_nodes": 2, "breaker_max_fraction": 1.0, "node_cooldown_seconds": 0,
                    "rate_limit_actions": 100}


@pytest.mark.parametrize("replicas", [{"guardrails": STORM_GUARDRAILS},
                                      {"guardrails": STORM_GUARDRAILS, "latency": 0.3}],  # reads overlap
                         indirect=True, ids=["instant-cluster", "slow-cluster"])
def test_a_storm_on_60_percent_of_nodes_split_across_replicas_is_capped_fleet_wide(replicas):
    a, b = replicas
    storm = NODES[:6]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda pair: pair[0].request("/alerts", notification(
            *[alert(n, action="drain") for n in pair[1]])), ((a, storm[:3]), (b, storm[3:]))))
    wait_until(lambda: all(x["state"] not in ("pending", "running") for x in a.actions()), timeout=60,
               what="every drain decided")
    drains = [op for op in a.history() if op[0] == "drain"]
    assert len(drains) == 2  # the cap, for the fleet, not per replica
    assert a.request("/status")["breaker"]["open"] and b.request("/status")["breaker"]["open"]
    assert len(b.request("/status")["drained_by_us"]) == 2
