"""Record the webhook bodies a real Alertmanager delivers, so webhook tests parse what production sends.

Run ``.venv/bin/python tests/webhook/record_fixtures.py`` to refresh ``tests/webhook/fixtures/``.
A real Alertmanager (grouping by ``node``, ``send_resolved``, bearer auth) delivers to a small local
aiohttp capture server; the alerts are posted to Alertmanager's ``/api/v2/alerts`` in stages (firing,
partly resolved, resolved) and each delivered body is saved as it arrived.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gpuhealth.local.prometheus import AlertmanagerServer

log = logging.getLogger(__name__)

FIXTURES_DIR = Path(__file__).parent / "fixtures"
BEARER_TOKEN = "fixture-token"  # what Alertmanager is configured to send in the recording
RUNBOOK = "https://github.com/gpuhealth/gpuhealth/blob/main/rules/runbooks.md"


def _alert(name: str, node: str, gpu: str | None, severity: str, action: str, summary: str) -> dict[str, Any]:
    labels = {"alertname": name, "node": node, "severity": severity, "action": action,
              "instance": f"{node}:9835", "job": "gpuhealth"}
    if gpu is not None:
        labels["gpu"] = gpu
    anchor = name.lower()
    return {
        "labels": labels,
        "annotations": {"summary": summary,
                        "description": f"{summary} on {node}" + (f" GPU {gpu}" if gpu else "") + ".",
                        "runbook_url": f"{RUNBOOK}#{anchor}"},
        "generatorURL": f"http://prometheus.example:9090/graph?g0.expr={name}",
    }


# One GPU alert alone on gpu01; three alerts (two per-GPU, one node-level) grouped on gpu02.
XID = _alert("GPUHealthXidFatal", "gpu01", "3", "critical", "drain_reset_gpu",
             "XID 79: GPU has fallen off the bus")
RISK = _alert("GPUHealthGpuFailureRisk", "gpu02", "0", "warning", "drain", "GPU failure risk is high")
NVLINK = _alert("GPUHealthNvlinkErrors", "gpu02", "1", "warning", "drain", "NVLink CRC errors are rising")
MISSING = _alert("GPUHealthGpusMissing", "gpu02", None, "critical", "drain_reboot",
                 "Fewer GPUs visible than expected")


@dataclass
class Capture:
    """Every webhook request Alertmanager made, in arrival order."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        self.headers.append(dict(request.headers))
        self.arrived.set()
        return web.Response(text="ok")

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float,
                       what: str) -> dict[str, Any]:
        """The first delivered body (old or new) matching ``predicate``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for body in self.bodies[seen:]:
                if predicate(body):
                    return body
            seen = len(self.bodies)
            self.arrived.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"Alertmanager did not deliver {what} within {timeout:.0f}s; "
                                   f"got {len(self.bodies)} bodies")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), remaining)


def alertmanager_config(webhook_url: str) -> dict[str, Any]:
    """Grouping as recommended in webhook/README.md: one notification per node, resolved ones sent too."""
    return {
        "route": {"receiver": "gpuhealth", "group_by": ["node"], "group_wait": "200ms",
                  "group_interval": "1s", "repeat_interval": "4h"},
        "receivers": [{"name": "gpuhealth", "webhook_configs": [{
            "url": webhook_url, "send_resolved": True, "max_alerts": 0,
            "http_config": {"authorization": {"type": "Bearer", "credentials": BEARER_TOKEN}},
        }]}],
    }


@contextlib.asynccontextmanager
async def capture_server() -> AsyncIterator[tuple[Capture, str]]:
    capture = Capture()
    app = web.Application()
    app.router.add_post("/alerts", capture.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield capture, f"http://127.0.0.1:{port}/alerts"
    finally:
        await runner.cleanup()


def _stamp(alert: dict[str, Any], starts: str, ends: str | None = None) -> dict[str, Any]:
    stamped = {**alert, "startsAt": starts}
    if ends is not None:
        stamped["endsAt"] = ends
    return stamped


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _statuses(body: dict[str, Any], node: str) -> dict[str, str] | None:
    if body["groupLabels"].get("node") != node:
        return None
    return {a["labels"]["alertname"]: a["status"] for a in body["alerts"]}


async def record(workdir: Path, timeout: float = 20.0) -> dict[str, Any]:
    """Drive a real Alertmanager through the staged scenario; return ``{fixture name: body}``."""
    async with capture_server() as (capture, url):
        am = AlertmanagerServer(workdir, alertmanager_config(url))
        await asyncio.to_thread(am.start)
        try:
            async with aiohttp.ClientSession() as session:
                async def post(*alerts: dict[str, Any]) -> None:
                    async with session.post(f"{am.url}/api/v2/alerts", json=list(alerts)) as resp:
                        if resp.status != 200:
                            text = await resp.text()
                            raise RuntimeError(f"Alertmanager refused alerts: {resp.status} {text}")

                def group(node: str, expected: dict[str, str]) -> Callable[[dict[str, Any]], bool]:
                    return lambda body: _statuses(body, node) == expected

                started = _now()
                await post(*(_stamp(a, started) for a in (XID, RISK, NVLINK, MISSING)))
                firing = {"GPUHealthGpuFailureRisk": "firing", "GPUHealthNvlinkErrors": "firing",
                          "GPUHealthGpusMissing": "firing"}
                bodies = {
                    "firing_single_gpu": await capture.wait_for(
                        group("gpu01", {"GPUHealthXidFatal": "firing"}), timeout, "the gpu01 firing group"),
                    "firing_node_group": await capture.wait_for(
                        group("gpu02", firing), timeout, "the gpu02 firing group"),
                }
                await post(_stamp(NVLINK, started, _now()))
                partly = {**firing, "GPUHealthNvlinkErrors": "resolved"}
                bodies["partly_resolved_node_group"] = await capture.wait_for(
                    group("gpu02", partly), timeout, "the gpu02 partly resolved group")
                ended = _now()
                await post(*(_stamp(a, started, ended) for a in (XID, RISK, NVLINK, MISSING)))
                bodies["resolved_single_gpu"] = await capture.wait_for(
                    group("gpu01", {"GPUHealthXidFatal": "resolved"}), timeout, "the gpu01 resolution")
                bodies["resolved_node_group"] = await capture.wait_for(
                    group("gpu02", dict.fromkeys(firing, "resolved")), timeout, "the gpu02 resolution")
        finally:
            await asyncio.to_thread(am.stop)
    bodies["delivery_headers"] = {k: v for k, v in capture.headers[0].items()
                                  if k.lower() in ("authorization", "content-type", "user-agent")}
    return bodies


def write(bodies: dict[str, Any], outdir: Path) -> list[Path]:
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, body in bodies.items():
        path = outdir / f"{name}.json"
        path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURES_DIR,
                        help="fixture folder (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="gpuhealth-am-") as tmp:
        try:
            bodies = asyncio.run(record(Path(tmp)))
        except (TimeoutError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    for path in write(bodies, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
