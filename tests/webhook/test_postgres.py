"""Webhook replicas sharing a journal on a real PostgreSQL (one cluster for the module, one database
per test): duplicate delivery acts once, a killed replica's action is finished by the other exactly
once, a database restart mid-intake loses and doubles nothing, and the breaker caps the fleet."""

from __future__ import annotations

import concurrent.futures
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
from conftest import TOKEN, alert, notification
from gpuhealth.webhook.config import parse_config
from gpuhealth.webhook.intake import resolve
from gpuhealth.webhook.models import parse_notification
from gpuhealth.webhook.policy import decide
from gpuhealth.webhook.store import Chain
from gpuhealth.webhook.store_postgres import PostgresJournal

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


@pytest.mark.parametrize("replicas", [{"guardrails": {
    "breaker_max_nodes": 2, "breaker_max_fraction": 1.0, "node_cooldown_seconds": 0,
    "rate_limit_actions": 100}}], indirect=True)
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
