"""SIGKILL the real webhook process mid-action, restart it: every accepted action completes exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from webhook_helpers import TOKEN, alert, notification

from gpuhealth.local.process import ManagedProcess, free_port, http_ok, wait_until

NODES = [f"gpu{i:02d}" for i in range(1, 9)]


class Webhook:
    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.tmp_path = tmp_path
        self.config = tmp_path / "webhook.yaml"
        (tmp_path / "token").write_text(TOKEN)
        self.cluster = tmp_path / "cluster.json"
        self.config.write_text(yaml.safe_dump({
            "listen": f"127.0.0.1:{self.port}", "state_dir": "state", "auth": {"token_file": "token"},
            "backend": {"type": "simulated", "nodes": NODES, "state_file": str(self.cluster),
                        "latency_seconds": 0.15, "jobs": {n: [f"{n}-a", f"{n}-b"] for n in NODES}},
            "guardrails": {"node_cooldown_seconds": 0, "breaker_max_nodes": 8, "breaker_max_fraction": 1.0,
                           "rate_limit_actions": 100},
            "retry": {"job_retry_interval_seconds": 0},
        }))
        self.proc: ManagedProcess | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "gpuhealth.webhook.main", "--config", str(self.config)]
        self.proc = ManagedProcess("webhook", argv, self.tmp_path / "webhook.log").start()
        self.proc.wait_ready(lambda: http_ok(f"http://127.0.0.1:{self.port}/healthz"), timeout=30)

    def kill(self) -> None:
        assert self.proc is not None and self.proc.proc is not None
        os.killpg(self.proc.proc.pid, signal.SIGKILL)
        self.proc.proc.wait()

    def request(self, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Authorization": f"Bearer {TOKEN}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.load(resp)

    def actions(self) -> list[dict[str, Any]]:
        return self.request("/actions")["actions"]

    def journaled_states(self) -> Counter[str]:
        """Action states as the dead process left them in its journal."""
        with contextlib.closing(sqlite3.connect(self.tmp_path / "state" / "journal.sqlite3")) as db:
            return Counter(state for (state,) in db.execute("SELECT state FROM actions"))

    def history(self) -> list[list[Any]]:
        return json.loads(self.cluster.read_text())["history"] if self.cluster.exists() else []


@pytest.mark.slow
def test_sigkill_mid_action_then_restart_completes_every_action_exactly_once(tmp_path):
    hook = Webhook(tmp_path)
    body = notification(*[alert(node, action="drain_reboot") for node in NODES])
    try:
        hook.start()
        assert len(hook.request("/alerts", body)["new_actions"]) == len(NODES)
        for finished_before_kill in (1, 4):
            # Kill while actions are part-way through their steps (drain, requeue, reboot).
            wait_until(lambda n=finished_before_kill: len(hook.history()) >= n * 2 and any(
                a["state"] == "running" and a["progress"].get("done") for a in hook.actions()),
                timeout=30, interval=0.02, what="an action part-way through its steps")
            hook.kill()
            assert hook.journaled_states()["running"] >= 1  # the crash left work in flight
            hook.start()
        # Alertmanager's retry of the notification it sent before the crash:
        assert hook.request("/alerts", body)["duplicates"] == len(NODES)
        wait_until(lambda: all(a["state"] == "done" for a in hook.actions()), timeout=60, interval=0.1,
                   what="every action to complete")
        actions = hook.actions()
    finally:
        if hook.proc is not None:
            hook.proc.stop()
    assert len(actions) == len(NODES) and {a["reason"] for a in actions} == {"ok"}
    effects = Counter((op[0], op[1]) for op in hook.history())
    expected = Counter({("drain", n): 1 for n in NODES} | {("reboot", n): 1 for n in NODES}
                       | {("requeue", f"{n}-{j}"): 1 for n in NODES for j in "ab"})
    assert effects == expected
    cluster = json.loads(hook.cluster.read_text())
    assert all(job["node"] is None and job["requeues"] == 1 for job in cluster["jobs"].values())
    log = (tmp_path / "webhook.log").read_text()
    assert log.count("event=started") == 3


SLOW_DRAIN = """\
import os, sys, time
from pathlib import Path
node, site = os.environ["GPUHEALTH_NODE"], Path(os.environ["SITE_DIR"])
def log(line):
    with open(site / "drains.log", "a") as out:
        out.write(line + "\\n")
marker = site / f"running-{node}"
if marker.exists():
    old = int(marker.read_text())
    try:
        alive = Path(f"/proc/{old}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        alive = False
    if alive:
        log(f"OVERLAP {node} {old}")
marker.write_text(str(os.getpid()))
log(f"start {node} {os.getpid()}")
while not (site / "release").exists():  # held until the webhook has been killed and restarted
    time.sleep(0.02)
log(f"end {node}")
marker.unlink()
"""


@pytest.mark.slow
def test_sigkill_during_a_command_helper_kills_it_before_the_step_runs_again(tmp_path):
    """The killed webhook's helper lives on in its own session; the restarted webhook kills it and waits
    for it to die before running the interrupted drain again, so two runs never overlap."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "drain.py").write_text(SLOW_DRAIN)
    hook = Webhook(tmp_path)
    nodes = NODES[:3]
    hook.config.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{hook.port}", "state_dir": "state", "auth": {"token_file": "token"},
        "backend": {"type": "command", "fleet_size": 8, "timeout_seconds": 60,
                    "env": {"SITE_DIR": str(site)},
                    "commands": {
                        "node_state": ["sh", "-c", "echo '{{\"exists\": true, \"drained\": false}}'"],
                        "drain": [sys.executable, str(site / "drain.py")]}},
        "guardrails": {"node_cooldown_seconds": 0, "breaker_max_nodes": 8, "breaker_max_fraction": 1.0},
    }))
    drains = site / "drains.log"

    def lines() -> list[str]:
        return drains.read_text().splitlines() if drains.exists() else []

    try:
        hook.start()
        hook.request("/alerts", notification(*[alert(n, action="drain") for n in nodes]))
        wait_until(lambda: sum(line.startswith("start") for line in lines()) == len(nodes), timeout=30,
                   interval=0.02, what="every drain helper to start")
        hook.kill()  # right after the 200, mid-drain
        survivors = [int(line.split()[2]) for line in lines() if line.startswith("start")]
        assert all(Path(f"/proc/{pid}").exists() for pid in survivors), "helpers outlive the webhook"
        hook.start()
        (site / "release").touch()  # a helper the restart failed to kill would now log a second "end"
        wait_until(lambda: all(a["state"] == "done" for a in hook.actions()), timeout=60, interval=0.1,
                   what="every drain to complete")
    finally:
        (site / "release").touch()
        if hook.proc is not None:
            hook.proc.stop()
    log = lines()
    assert [line for line in log if line.startswith("OVERLAP")] == []
    assert sorted(line for line in log if line.startswith("end")) == [f"end {n}" for n in nodes]
    assert (tmp_path / "webhook.log").read_text().count("event=helper_killed") == len(nodes)
