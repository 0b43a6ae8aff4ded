"""Webhook intake benchmark: alerts per second accepted and journaled, and request latency.

Runs the real ``gpuhealth-webhook`` as a separate process on loopback (simulated 1,000-node cluster)
and drives it with concurrent Alertmanager-style POSTs:
  1. intake, with every action held for approval so the worker stays idle: notifications of 1 alert
     (the common case) and of 10 alerts, side by side; besides wall-clock rates it prints the
     server's CPU time per alert, which a busy shared machine does not distort, and the sender's
     (a minimal keep-alive HTTP/1.1 client, so that it takes little of the CPUs it measures on);
  2. one notification carrying 10,000 alerts to a webhook that acts: every alert must become exactly
     one journaled action, and the worker must finish them all.
Targets (issue 4): >= 1,000 alerts/s and p99 < 50 ms on 2 cores.

With ``--journal postgres`` it runs instead, in one run on one PostgreSQL started for it, two
replicas sharing the journal (each sender alternates between them, as an Alertmanager HA pair
delivers to both) beside one replica on SQLite, under the same load; and checks that the shared
journal holds exactly one action per alert sent; it also prints PostgreSQL's CPU per alert (its
processes alive at the start and end of each case). Targets (issue 16): >= 1,000 alerts/s in total,
p99 < 50 ms, no loss. ``--baseline REV`` adds a second pair running the webhook as it was at git
revision REV (on its own database of the same PostgreSQL), driven in turn with the others, so a
change is measured before and after in one run, under one load; ``--rounds N`` repeats the intake
cases, every other round with the sides in reverse order. Each case also prints how many
notifications a group commit carried and its CPU ceiling (the alerts per second its measured CPU
per alert, servers, database and sender together, would allow on this machine's CPUs), and the run
ends with each pair judged against the targets, by the wall clock and by that ceiling.
``--commit-window`` sets the pair's ``journal.commit_window_seconds`` (the baseline keeps its own).
The sender stands in for Alertmanager and is measured with the rest: one notification per request,
the same bodies, each sender waiting for its answer before it sends again, as Alertmanager's
per-receiver delivery does; it was not made cheaper for the commit window.

What ``--concurrency`` stands for: Alertmanager's dispatcher runs one goroutine per aggregation
group (``go group.run(...)`` in ``dispatch/dispatch.go``); each flush sends that group's one
notification and waits for it, retried with exponential backoff until the flush's timeout
(``notify.RetryStage``), before the group can flush again. Towards one receiver there is no other
cap: as many notifications are in flight as groups flush at the same moment. gpuhealth's routes
group by ``cluster, node`` (``rules/alertmanager.yml``), so a sender here is one node's group with a
notification in flight; 8 is a steady trickle of nodes, a storm across hundreds of nodes (their
``group_wait`` ending together) briefly many more, each waiting longer. Throughput at a fixed
concurrency is bounded by latency (about senders / p50), so the default measures whether intake is
fast enough per notification, not how much queueing a burst adds (``--concurrency 32`` shows that).

SIGINT (Ctrl-C) and SIGTERM stop every PostgreSQL and webhook the benchmark started, and remove its
files.

    .venv/bin/python bench/webhook.py [--notifications 3000] [--concurrency 8]
                                      [--journal postgres [--baseline REV] [--rounds 1]
                                       [--cluster-latency 0.02]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import yaml

from gpuhealth.local.process import ManagedProcess, free_port, http_ok

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-token"
NODES = 1000
_alert_ids = itertools.count(1)


def _alert(i: int) -> dict[str, Any]:
    node = f"gpu{i % NODES + 1:04d}"
    return {
        "status": "firing",
        "labels": {"alertname": "GPUHealthXidFatal", "node": node, "gpu": str(i % 8), "severity": "critical",
                   "action": "drain", "instance": f"{node}:9835", "job": "gpuhealth"},
        "annotations": {"summary": "XID 79: GPU has fallen off the bus", "description": "bench",
                        "runbook_url": "https://example.invalid/runbook"},
        "startsAt": "2026-11-30T05:00:00.123Z", "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus:9090/graph", "fingerprint": f"{i:016x}",
    }


def _notification(size: int) -> dict[str, Any]:
    alerts = [_alert(next(_alert_ids)) for _ in range(size)]
    return {"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": "firing",
            "receiver": "gpuhealth", "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {},
            "externalURL": "http://alertmanager:9093", "alerts": alerts}


def _load(url: str | list[str], bodies: list[dict[str, Any]], concurrency: int) -> tuple[float, list[float]]:
    """POST every body with ``concurrency`` clients, to ``url`` or in turn to each of a list of them;
    wall time and per-request latencies. The event loop lives only while it sends: the servers are
    started and stopped outside it, so an interrupt anywhere unwinds through their teardown."""
    return asyncio.run(_send(url, bodies, concurrency))


async def _send(url: str | list[str], bodies: list[dict[str, Any]], concurrency: int
                ) -> tuple[float, list[float]]:
    """Each sender keeps one keep-alive HTTP/1.1 connection to each server and writes its requests
    itself, the bodies encoded beforehand: a minimal client, so that the sender (Alertmanager's stand-in,
    on other machines in a fleet) takes as little as it can of the CPUs the servers are measured on.
    A request's latency runs from its first byte written to the last byte of the answer read."""
    payloads = [json.dumps(body).encode() for body in reversed(bodies)]
    servers = [urlsplit(u) for u in ([url] if isinstance(url, str) else url)]
    heads = [(f"POST /alerts HTTP/1.1\r\nHost: {s.netloc}\r\nAuthorization: Bearer {TOKEN}\r\n"
              "Content-Type: application/json\r\nContent-Length: ").encode() for s in servers]
    targets = itertools.cycle(range(len(servers)))
    latencies: list[float] = []

    async def client() -> None:
        connections: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        try:
            while payloads:
                body, target = payloads.pop(), next(targets)
                if target not in connections:
                    connections[target] = await asyncio.open_connection(servers[target].hostname,
                                                                        servers[target].port)
                reader, writer = connections[target]
                started = time.perf_counter()
                writer.write(b"%s%d\r\n\r\n%s" % (heads[target], len(body), body))
                await writer.drain()
                status, answer = await _answer(reader)
                if status != 200:
                    raise RuntimeError(f"POST /alerts answered {status}: {answer[:500]!r}")
                latencies.append(time.perf_counter() - started)
        finally:
            for _, writer in connections.values():
                writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 answer with a Content-Length (the webhook's are): its status and body."""
    status_line = await reader.readline()
    length = None
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length is None:
        raise RuntimeError(f"an answer without Content-Length: {status_line!r}")
    return int(status_line.split()[1]), await reader.readexactly(length)


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1] if len(values) > 1 else values[0]


def _report(name: str, alerts: int, wall: float, latencies: list[float], cpu: float, sender: float,
            database: float | None = None, load: float | None = None, per_commit: float | None = None
            ) -> float:
    """One case: wall-clock rate and latency, then CPU per alert of the servers, the sender and (on
    PostgreSQL) the database, the 1-minute load average when the case started, and (on PostgreSQL) the
    notifications a group commit carried on average (``/commit``). Returns the
    CPU ceiling: the alerts per second those CPU costs would allow if they had every CPU of the
    machine to themselves, which a busy shared machine does not distort as it does the wall clock."""
    spent = (cpu + sender + (database or 0.0)) / alerts
    ceiling = (os.cpu_count() or 1) / spent
    print(f"{name:<{34 if load is not None else 26}} {alerts:>6} {alerts / wall:8.0f} "
          f"{_p(latencies, 0.5) * 1000:7.1f} {_p(latencies, 0.99) * 1000:7.1f} {cpu / alerts * 1e6:12.0f} "
          f"{alerts / cpu:12.0f} {sender / alerts * 1e6:9.0f}"
          + ("" if load is None else f" {'-' if database is None else f'{database / alerts * 1e6:.0f}':>8} "
                                     f"{'-' if per_commit is None else f'{per_commit:.2f}':>8} {load:5.1f}")
          + f" {ceiling:8.0f}", flush=True)
    return ceiling


_HEADER = (f"{'alerts':>6} {'alerts/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'CPU us/alert':>12} "
           f"{'alerts/CPU-s':>12} {'sender us':>9}")
_CEILING = f" {'ceiling':>8}"


def _journal_counts(path: Path) -> tuple[int, int]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        total = db.execute("SELECT COUNT(*) FROM actions").fetchone()[0]
        open_ = db.execute("SELECT COUNT(*) FROM actions WHERE state IN ('pending', 'running')").fetchone()[0]
    return total, open_


@contextlib.contextmanager
def _webhook(workdir: Path, approval: bool, journal: dict[str, Any] | None = None, code: Path | None = None,
             latency: float = 0.0) -> Iterator[tuple[str, psutil.Process]]:
    """The real service on loopback; with ``approval`` every action waits, so the worker stays idle.
    ``code``: a folder of the packages to run instead of the installed ones (``_checkout``);
    ``latency``: seconds the simulated cluster takes to answer each call."""
    workdir.mkdir()
    port = free_port()
    config = workdir / "webhook.yaml"
    (workdir / "token").write_text(TOKEN)
    config.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{port}", "state_dir": "state", "auth": {"token_file": "token"},
        "max_body_bytes": 64 * 1024 * 1024, **({"journal": journal} if journal else {}),
        "backend": {"type": "simulated", "nodes": [f"gpu[0001-{NODES:04d}]"], "latency_seconds": latency},
        "guardrails": {"breaker_max_nodes": NODES, "breaker_max_fraction": 1.0, "node_cooldown_seconds": 0,
                       "rate_limit_actions": 1_000_000, "require_approval": ["drain"] if approval else []},
    }))
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "gpuhealth.webhook.main", "--config", str(config)]
    env = None if code is None else {**os.environ, "PYTHONPATH": str(code)}
    # run from its own folder: ``-m`` puts the working directory first on the path
    with ManagedProcess("webhook", argv, workdir / "webhook.log", env=env, cwd=workdir) as proc:
        proc.start()
        proc.wait_ready(lambda: http_ok(f"{url}/healthz"), timeout=30)
        assert proc.proc is not None
        yield url, psutil.Process(proc.proc.pid)


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _tree_cpu(process: psutil.Process) -> float:
    """CPU time of a server and its children (PostgreSQL's backends, alive at the time of asking)."""
    total = 0.0
    for each in (process, *process.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += _cpu(each)
    return total


def _checkout(rev: str, into: Path) -> Path:
    """The packages at git revision ``rev``, laid out as installed (``pyproject.toml``'s package-dir):
    a folder to put first on PYTHONPATH."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True,
                                 check=True).stdout
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"--baseline {rev}: {exc.stderr.decode().strip()}") from None
    tree, site = into / "tree", into / "site"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    layout = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(layout.items()):  # "gpuhealth" before "gpuhealth.webhook"
        shutil.copytree(tree / folder, site / package.replace(".", "/"), dirs_exist_ok=True)
    return site


def intake(workdir: Path, notifications: int, concurrency: int) -> None:
    """Accepted and journaled alerts per second, the worker idle (every action awaits approval)."""
    with _webhook(workdir, approval=True) as (url, server):
        _load(url, [_notification(1) for _ in range(200)], concurrency)  # warm-up
        print(f"{'intake, worker idle':<26} {_HEADER}{_CEILING}")
        for size in (1, 10):
            count = notifications // size
            bodies = [_notification(size) for _ in range(count)]
            cpu, sender = _cpu(server), time.process_time()
            wall, latencies = _load(url, bodies, concurrency)
            _report(f"{count} x {size}-alert notification", count * size, wall, latencies, _cpu(server) - cpu,
                    time.process_time() - sender)


def storm(workdir: Path) -> int:
    """One notification of 10,000 alerts on 1,000 nodes: all journaled, then all acted on."""
    with _webhook(workdir, approval=False) as (url, server):
        cpu = _cpu(server)
        wall, _ = _load(url, [_notification(10_000)], 1)
        print(f"one 10,000-alert notification: answered in {wall * 1000:.0f} ms, server CPU "
              f"{(_cpu(server) - cpu) * 1000:.0f} ms")
        journal = workdir / "state" / "journal.sqlite3"
        total, _ = _journal_counts(journal)
        started = time.perf_counter()
        while _journal_counts(journal)[1]:
            time.sleep(0.2)
        acted = time.perf_counter() - started
        print(f"journaled actions: {total} of 10000 ({'no loss' if total == 10_000 else 'LOSS'}); the worker "
              f"finished them all {acted:.1f} s later ({total / acted:.0f} actions/s, simulated cluster)")
        return 0 if total == 10_000 else 1


def replicas(workdir: Path, notifications: int, concurrency: int, baseline: str | None,
             latency: float, rounds: int = 1, commit_window: float | None = None) -> int:
    """Two replicas on one PostgreSQL journal beside one on SQLite, the same load on each side; with
    ``baseline``, also two replicas of the webhook at that revision, on a database of their own;
    ``commit_window``: the pair's ``journal.commit_window_seconds`` (none: the webhook's default)."""
    import psycopg  # the postgres extra

    from gpuhealth.local.postgres import LocalPostgres

    workdir.mkdir()
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    with contextlib.ExitStack() as stack:
        pg = LocalPostgres(workdir / "postgres.log")
        stack.callback(pg.__exit__)  # registered before it starts: an interrupt mid-start stops it too
        pg.start()
        sides: list[tuple[str, str | None, list[tuple[str, psutil.Process]]]] = []  # name, database, servers
        code = None if baseline is None else _checkout(baseline, workdir / "baseline")
        if baseline is not None:
            with psycopg.connect(pg.url, autocommit=True) as conn:
                conn.execute("CREATE DATABASE baseline")
            url = pg.url.rsplit("/", 1)[0] + "/baseline"
            sides.append((f"2 on PostgreSQL @{baseline}", url, [stack.enter_context(_webhook(
                workdir / f"baseline-{name}", True, {"url": url, "replica": name}, code))
                for name in ("a", "b")]))
        window = {} if commit_window is None else {"commit_window_seconds": commit_window}
        shown = "the default" if commit_window is None else f"{commit_window:g} s"
        print(f"the pair's commit window: {shown}; {concurrency} senders, each alternating between the "
              "replicas of a pair")
        sides.append(("2 on PostgreSQL", pg.url, [stack.enter_context(_webhook(
            workdir / name, True, {"url": pg.url, "replica": name, **window})) for name in ("a", "b")]))
        sides.append(("1 on SQLite", None, [stack.enter_context(_webhook(workdir / "sqlite", True))]))
        for _, _, servers in sides:
            _load([url for url, _ in servers], [_notification(1) for _ in range(200)], concurrency)  # warm-up
        assert pg.process is not None and pg.process.proc is not None
        database_server = psutil.Process(pg.process.proc.pid)
        print(f"{'intake, worker idle':<34} {_HEADER} {'db us':>8} {'/commit':>8} {'load':>5}{_CEILING}")
        cases: dict[tuple[str, int, int], tuple[float, float, float]] = {}  # alerts/s, p99, ceiling
        # each round drives the sides in turn, every other round in reverse: the side measured second
        # does not always find the database and the page cache warmed by the first
        for round_, size in itertools.product(range(rounds), (1, 10)):
            count = notifications // size
            for name, database, servers in (sides if round_ % 2 == 0 else sides[::-1]):
                bodies = [_notification(size) for _ in range(count)]
                load = os.getloadavg()[0]
                cpu, sender = sum(_cpu(p) for _, p in servers), time.process_time()
                db, since = _tree_cpu(database_server), _last_notification(database)
                wall, latencies = _load([url for url, _ in servers], bodies, concurrency)
                ceiling = _report(
                    f"{name}, {count} x {size}", count * size, wall, latencies,
                    sum(_cpu(p) for _, p in servers) - cpu, time.process_time() - sender,
                    None if database is None else _tree_cpu(database_server) - db, load,
                    _per_commit(database, since))
                cases[name, size, round_] = (count * size / wall, _p(latencies, 0.99), ceiling)
        failed = 0
        whole: dict[str, bool] = {}
        for name, database, _ in sides:
            if database is None:
                continue
            with psycopg.connect(database) as conn:
                row = conn.execute("SELECT COUNT(*), COUNT(DISTINCT fingerprint) FROM actions").fetchone()
            total, distinct = row if row is not None else (0, 0)
            sent = 200 + (notifications // 1 + notifications // 10 * 10) * rounds
            whole[name] = total == distinct == sent
            failed |= not whole[name]
            print(f"{name}: {total} actions for {sent} alerts sent to the pair "
                  f"({'no loss, no double' if whole[name] else 'MISMATCH'})")
        _verdicts(cases, whole)
        for number, (name, database, _) in enumerate(sides):
            if database is not None:
                failed |= not _acting_pair(workdir / f"acting-{number}", name, database,
                                           code if number == 0 else None, latency)
        return 1 if failed else 0


TARGET_RATE, TARGET_P99 = 1000.0, 0.050  # alerts/s in total, seconds: the pair's intake targets


def _last_notification(database: str | None) -> int:
    """The newest notification's id in ``database`` (0 when none, or on SQLite)."""
    if database is None:
        return 0
    import psycopg

    with psycopg.connect(database, autocommit=True) as conn:
        row = conn.execute("SELECT COALESCE(MAX(id), 0) FROM notifications").fetchone()
    return int(row[0]) if row is not None else 0


def _per_commit(database: str | None, since: int) -> float | None:
    """Notifications per group commit among those journaled after ``since``: the notifications of one
    group commit share its time of receipt, so each distinct one is a commit (a round trip)."""
    if database is None:
        return None
    import psycopg

    with psycopg.connect(database, autocommit=True) as conn:
        row = conn.execute("SELECT COUNT(*), COUNT(DISTINCT received_at) FROM notifications WHERE id > %s",
                           (since,)).fetchone()
    return row[0] / row[1] if row is not None and row[1] else None


def _verdicts(cases: dict[tuple[str, int, int], tuple[float, float, float]], whole: dict[str, bool]) -> None:
    """Each pair on PostgreSQL against the targets, per notification size: the wall clock (what the
    machine allowed this run), and the CPU ceiling (what the same CPU costs allow on this machine's
    CPUs with nothing else running)."""
    print(f"targets: >= {TARGET_RATE:,.0f} alerts/s in total, p99 < {TARGET_P99 * 1000:.0f} ms, no loss "
          f"({os.cpu_count()} CPUs)")
    for (name, size, round_), (rate, p99, ceiling) in sorted(cases.items(), key=lambda case: case[0][2]):
        if name not in whole:
            continue
        loss = "no loss" if whole[name] else "LOSS or double"
        print(f"  {name}, {size}-alert notifications, round {round_ + 1}: {rate:,.0f} alerts/s "
              f"{'met' if rate >= TARGET_RATE else 'NOT met'}; p99 {p99 * 1000:.1f} ms "
              f"{'met' if p99 < TARGET_P99 else 'NOT met'}; {loss}; "
              f"CPU ceiling {ceiling:,.0f} alerts/s ({'above' if ceiling >= TARGET_RATE else 'BELOW'} the "
              f"target)", flush=True)


ACTING_ALERTS = 500


def _acting_pair(workdir: Path, name: str, journal: str, code: Path | None, latency: float) -> bool:
    """The workers of a pair: two replicas that act (no approval) on a fresh database beside
    ``journal``, and one notification of ``ACTING_ALERTS`` alerts delivered to both at once, as an HA
    Alertmanager pair does; how long until every action ended, and whether each alert has exactly one
    action, ended. Every action passes admission (the fleet's lock) and journals each step; each call
    to the simulated cluster takes ``latency`` seconds (a real one answers in milliseconds to tens of
    them: ``scontrol``, an API server), so that what waits for the cluster shows."""
    import psycopg

    database = f"acting_{workdir.name.replace('-', '_')}"
    with psycopg.connect(journal, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database}")
    url = journal.rsplit("/", 1)[0] + "/" + database
    workdir.mkdir()
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(_webhook(workdir / replica, False, {"url": url, "replica": replica},
                                                code, latency)) for replica in ("a", "b")]
        body = _notification(ACTING_ALERTS)
        started = time.perf_counter()
        _load([server_url for server_url, _ in servers], [body, body], 2)
        with psycopg.connect(url, autocommit=True) as conn:
            def counts() -> tuple[int, int, int]:
                row = conn.execute("SELECT COUNT(*), COUNT(DISTINCT fingerprint), COUNT(*) FILTER "
                                   "(WHERE state IN ('pending', 'running')) FROM actions").fetchone()
                return (0, 0, 0) if row is None else row

            while (now := counts())[2] or not now[0]:
                time.sleep(0.2)
            acted = time.perf_counter() - started
            runs = conn.execute("SELECT started_at, finished_at FROM actions WHERE finished_at IS NOT NULL "
                                "AND started_at IS NOT NULL ORDER BY started_at").fetchall()
    whole = now[0] == now[1] == ACTING_ALERTS
    starts = [start for start, _ in runs]
    apart = statistics.median(b - a for a, b in itertools.pairwise(starts)) if len(starts) > 1 else 0.0
    ran = statistics.median(end - start for start, end in runs) if runs else 0.0
    print(f"{name}, acting: {ACTING_ALERTS} alerts to both replicas, cluster calls {latency * 1000:.0f} ms, "
          f"{now[0]} actions all ended "
          f"{acted:.1f} s after sending ({now[0] / acted:.0f} actions/s; "
          f"{'one per alert' if whole else 'MISMATCH'}); median start-to-start {apart * 1000:.0f} ms, "
          f"start-to-end {ran * 1000:.0f} ms", flush=True)
    return whole


def run(workdir: Path, notifications: int, concurrency: int) -> int:
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    intake(workdir / "intake", notifications, concurrency)
    return storm(workdir / "storm")


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, through the teardown of everything started."""
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notifications", type=int, default=3000, help="alerts per intake case")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent senders")
    parser.add_argument("--journal", choices=("sqlite", "postgres"), default="sqlite",
                        help="postgres: two replicas on a shared PostgreSQL journal beside one on SQLite")
    parser.add_argument("--baseline", metavar="REV",
                        help="with --journal postgres: also two replicas of the webhook at git revision REV "
                             "(e.g. main), driven in turn with the others")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="with --journal postgres: drive the intake cases N times, every other time with "
                             "the sides in reverse order (default 1)")
    parser.add_argument("--cluster-latency", type=float, default=0.02, metavar="SECONDS",
                        help="with --journal postgres: how long each call to the simulated cluster takes in "
                             "the acting case (default 0.02)")
    parser.add_argument("--commit-window", type=float, metavar="SECONDS",
                        help="with --journal postgres: the pair's journal.commit_window_seconds (default: "
                             "the webhook's own default; the baseline pair keeps its revision's)")
    args = parser.parse_args()
    if args.commit_window is not None and (args.journal != "postgres" or not 0 <= args.commit_window <= 1):
        parser.error("--commit-window needs --journal postgres and 0 to 1 seconds")
    if args.baseline is not None and args.journal != "postgres":
        parser.error("--baseline needs --journal postgres")
    if args.rounds < 1 or (args.rounds != 1 and args.journal != "postgres"):
        parser.error("--rounds needs --journal postgres and at least 1")
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    try:
        with tempfile.TemporaryDirectory(prefix="gpuhealth-bench-") as tmp:
            if args.journal == "postgres":
                return replicas(Path(tmp) / "replicas", args.notifications, args.concurrency, args.baseline,
                                args.cluster_latency, args.rounds, args.commit_window)
            return run(Path(tmp), args.notifications, args.concurrency)
    except KeyboardInterrupt:
        print("interrupted: every server it started is stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
