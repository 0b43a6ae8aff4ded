"""What the webhook tests import: alerts and notifications as Alertmanager sends them, and the harness
around the real app (``conftest.py``'s ``webhook`` fixture makes one). Tests never import ``conftest``
by name: another directory's would answer when both directories run in one pytest process."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpuhealth.webhook.backends.simulated import SimulatedBackend
from waiting import eventually

FIXTURES = Path(__file__).parent / "fixtures"
TOKEN = "test-token-0123456789"
NODES = [f"gpu{i:02d}" for i in range(1, 17)]
_fingerprints = itertools.count(1)


def recorded(name: str) -> dict[str, Any]:
    """A notification recorded from a real Alertmanager (tests/webhook/fixtures)."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


def alert(node: str | None = "gpu01", *, action: str = "drain", gpu: str | None = "0",
          alertname: str = "GPUHealthXidFatal", status: str = "firing", severity: str = "critical",
          fingerprint: str | None = None, starts_at: str = "2026-11-30T05:00:00.5Z",
          summary: str = "XID 79: GPU has fallen off the bus") -> dict[str, Any]:
    labels = {"alertname": alertname, "severity": severity, "action": action}
    if node is not None:
        labels["node"] = node
    if gpu is not None:
        labels["gpu"] = gpu
    return {
        "status": status, "labels": labels,
        "annotations": {"summary": summary, "description": f"{summary} on {node}", "runbook_url": "x"},
        "startsAt": starts_at,
        "endsAt": "2026-11-30T06:00:00Z" if status == "resolved" else "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus:9090/graph",
        "fingerprint": fingerprint or f"{next(_fingerprints):016x}",
    }


def resolved(firing: dict[str, Any]) -> dict[str, Any]:
    return {**firing, "status": "resolved", "endsAt": "2026-11-30T06:00:00Z"}


def notification(*alerts: dict[str, Any]) -> dict[str, Any]:
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    return {
        "version": "4", "groupKey": "{}:{node=\"x\"}", "truncatedAlerts": 0, "status": status,
        "receiver": "gpuhealth", "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093", "alerts": list(alerts),
    }


class Harness:
    """The app under test, its simulated cluster, and the calls the tests make."""

    def __init__(self, client: Any, backend: SimulatedBackend) -> None:
        self.client = client
        self.backend = backend
        self.auth = {"Authorization": f"Bearer {TOKEN}"}
        self.posting = {**self.auth, "Content-Type": "application/json"}  # a body as Alertmanager sends it

    async def post(self, *alerts: dict[str, Any], expect: int = 200) -> dict[str, Any]:
        resp = await self.client.post("/alerts", json=notification(*alerts), headers=self.auth)
        body = await resp.json()
        assert resp.status == expect, body
        return body

    async def call(self, method: str, path: str, expect: int = 200) -> Any:
        resp = await self.client.request(method, path, headers=self.auth)
        body = await resp.json()
        assert resp.status == expect, body
        return body

    async def actions(self, **query: str) -> list[dict[str, Any]]:
        resp = await self.client.get("/actions", params=query)
        assert resp.status == 200
        return sorted((await resp.json())["actions"], key=lambda a: a["id"])

    async def settle(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Wait until no action can make progress now; return them all, oldest first."""
        def quiet(actions: list[dict[str, Any]]) -> bool:
            now = time.time()
            return not any(a["state"] in ("pending", "running") and a["next_at"] <= now for a in actions)

        return await eventually(self.actions, quiet, timeout=timeout, what="actions under way to settle",
                                interval=0.02)

    async def until(self, predicate: Callable[[list[dict[str, Any]]], object], what: str,
                    timeout: float = 30.0) -> list[dict[str, Any]]:
        """Settle until ``predicate`` holds for the actions (deferred ones come due meanwhile)."""
        return await eventually(self.settle, predicate, timeout=timeout, what=what, interval=0.1)

    async def wait_action(self, action_id: int, predicate: Callable[[dict[str, Any]], bool],
                          timeout: float = 20.0) -> dict[str, Any]:
        """Poll one action until ``predicate`` holds, failing with its last state at the deadline."""
        return await eventually(lambda: self.call("GET", f"/actions/{action_id}"), predicate, timeout=timeout,
                                what=f"action {action_id}")

    async def until_metric(self, name: str, at_least: float, what: str, timeout: float = 30.0) -> float:
        """Poll a metric until it reaches ``at_least``."""
        return await eventually(lambda: self.metric(name), lambda v: v >= at_least, timeout=timeout,
                                what=what)

    async def metric(self, name: str, **labels: str) -> float:
        text = await (await self.client.get("/metrics")).text()
        wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
        series = f"{name}{{{wanted}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{series} not exposed")

    @property
    def drained(self) -> dict[str, str]:
        return {n: e["reason"] for n, e in self.backend.state["nodes"].items() if e["drained"]}


Factory = Callable[..., Awaitable[Harness]]
