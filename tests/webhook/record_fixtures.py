"""Record the webhook bodies a real Alertmanager delivers, so webhook tests parse what production sends.

Run ``.venv/bin/python tests/webhook/record_fixtures.py`` to refresh ``tests/webhook/fixtures/``.
A real Alertmanager, configured with the project's own routing (``rules/alertmanager.yml``: grouped
by ``node``, routed by ``action``, ``send_resolved``, bearer auth; only the timers are shortened),
delivers to a small local aiohttp capture server. The alerts are posted to Alertmanager's
``/api/v2/alerts`` in stages (firing, partly resolved, resolved) and each delivered body is saved as
it arrived.
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
import yaml
from aiohttp import web

from gpuhealth.local.prometheus import AlertmanagerServer

log = logging.getLogger(__name__)

FIXTURES_DIR = Path(__file__).parent / "fixtures"
ROUTING = Path(__file__).resolve().parents[2] / "rules" / "alertmanager.yml"
WEBHOOK_RECEIVER = "gpuhealth-webhook"
BEARER_TOKEN = "fixture-token"  # what Alertmanager is configured to send in the recording
RUNBOOK = "https://github.com/gpuhealth/gpuhealth/blob/main/rules/runbooks.md"


def _alert(name: str, node: str, labels: dict[str, str], summary: str, description: str) -> dict[str, Any]:
    """An alert as Prometheus sends it for the generated rules (labels and annotation texts alike)."""
    return {
        "labels": {"alertname": name, "node": node, **labels},
        "annotations": {"summary": summary, "description": description,
                        "runbook_url": f"{RUNBOOK}#{name.lower()}"},
        "generatorURL": f"http://prometheus.example:9090/graph?g0.expr=ALERTS%7Balertname%3D%22{name}%22%7D",
    }


# The project's routing groups by node within each action's route, so one node's alerts arrive in one
# notification per action. gpu01: a single GPU alert. gpu02: three GPU alerts of one action. gpu03: a
# node-level and a GPU alert of one action, and a node-level alert of another action.
XID = _alert("GPUHealthXidResetGpu", "gpu01",
             {"gpu": "3", "xid": "48", "severity": "critical", "action": "drain_reset_gpu"},
             "XID 48 on gpu01 GPU 3: reset the GPU",
             "GPU 3 of gpu01 reported XID 48 (1 in the last window); the GPU needs a reset before it is "
             "trusted again. Drain the node, requeue its jobs, reset.")
RISK0, RISK1 = (
    _alert("GPUHealthGpuFailureRisk", "gpu02", {"gpu": gpu, "severity": "warning", "action": "drain"},
           f"GPU {gpu} on gpu02 is likely to fail (risk {risk})",
           f"Several precursor signals of GPU {gpu} on gpu02 together put its failure risk at {risk}. Top "
           "contributions: ecc_corrected_growth=0.40, remapped_rows_growth=0.30.")
    for gpu, risk in (("0", "0.70"), ("1", "0.65")))
DIAG = _alert("GPUHealthXidDrain", "gpu02",
              {"gpu": "2", "reason": "XID 13/31 repeated on this GPU", "severity": "warning",
               "action": "drain"},
              "GPU 2 on gpu02 needs diagnostics (XID 13/31 repeated on this GPU)",
              "GPU 2 of gpu02: XID 13/31 repeated on this GPU (3). Drain the node and run diagnostics before "
              "it takes more jobs.")
LEMON = _alert("GPUHealthLemonNode", "gpu03", {"severity": "warning", "action": "replace"},
               "gpu03 failed 3 times recently: take it out of rotation",
               "gpu03 had 3 separate failures or exclusions in the lemon window. A few nodes cause most "
               "failures; keep this one out of rotation until it is repaired.")
REPLACE = _alert("GPUHealthXidReplaceGpu", "gpu03",
                 {"gpu": "5", "xid": "64", "severity": "critical", "action": "replace"},
                 "GPU 5 on gpu03 keeps failing row remapping: replace it",
                 "GPU 5 of gpu03 reported a row-remap failure 2 times in the repeat window; resets no longer "
                 "help. Take the node out of rotation and replace the GPU.")
MISSING = _alert("GPUHealthGpusMissing", "gpu03", {"severity": "critical", "action": "drain_reboot"},
                 "gpu03 sees 1 fewer GPUs than expected",
                 "1 GPUs of gpu03 are not enumerated by the driver. A GPU that vanished needs a node reboot "
                 "at least; drain first.")
ALERTS = (XID, RISK0, RISK1, DIAG, LEMON, REPLACE, MISSING)


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
    """The project's routing (rules/alertmanager.yml) pointed at ``webhook_url``, with short timers."""
    try:
        config = yaml.safe_load(ROUTING.read_text())
        config["route"].update(group_wait="200ms", group_interval="1s")
        [receiver] = [r for r in config["receivers"] if r["name"] == WEBHOOK_RECEIVER]
        [webhook] = receiver["webhook_configs"]
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        raise RuntimeError(f"{ROUTING} has no usable {WEBHOOK_RECEIVER} receiver: {exc!r}") from None
    webhook["url"] = webhook_url
    webhook["http_config"] = {"authorization": {"type": "Bearer", "credentials": BEARER_TOKEN}}
    return config


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


def _key(alert: dict[str, Any]) -> str:
    return f"{alert['labels']['alertname']}/{alert['labels'].get('gpu', '')}"


def _statuses(body: dict[str, Any], node: str) -> dict[str, str] | None:
    if body["groupLabels"].get("node") != node:
        return None
    return {_key(a): a["status"] for a in body["alerts"]}


# (fixture name, node, {alert key: status}) for each notification to keep, by stage.
FIRING = [
    ("firing_single_gpu", "gpu01", {"GPUHealthXidResetGpu/3": "firing"}),
    ("firing_node_group", "gpu02", {"GPUHealthGpuFailureRisk/0": "firing",
                                    "GPUHealthGpuFailureRisk/1": "firing", "GPUHealthXidDrain/2": "firing"}),
    ("firing_node_and_gpu", "gpu03", {"GPUHealthLemonNode/": "firing", "GPUHealthXidReplaceGpu/5": "firing"}),
    ("firing_same_node_other_action", "gpu03", {"GPUHealthGpusMissing/": "firing"}),
]
PARTLY = [("partly_resolved_node_group", "gpu02", {**FIRING[1][2], "GPUHealthGpuFailureRisk/1": "resolved"})]
RESOLVED = [("resolved_single_gpu", "gpu01", {"GPUHealthXidResetGpu/3": "resolved"}),
            ("resolved_node_group", "gpu02", dict.fromkeys(FIRING[1][2], "resolved"))]


async def record(workdir: Path, timeout: float = 20.0) -> dict[str, Any]:
    """Drive a real Alertmanager through the staged scenario; return ``{fixture name: body}``."""
    bodies: dict[str, Any] = {}
    async with capture_server() as (capture, url):
        am = AlertmanagerServer(workdir, alertmanager_config(url))
        await asyncio.to_thread(am.start)
        try:
            async with aiohttp.ClientSession() as session:
                async def stage(alerts: list[dict[str, Any]], expected: list[tuple[str, str, dict]]) -> None:
                    async with session.post(f"{am.url}/api/v2/alerts", json=alerts) as resp:
                        if resp.status != 200:
                            text = await resp.text()
                            raise RuntimeError(f"Alertmanager refused alerts: {resp.status} {text}")
                    for name, node, statuses in expected:
                        bodies[name] = await capture.wait_for(
                            lambda body, n=node, s=statuses: _statuses(body, n) == s, timeout, name)

                started = _now()
                await stage([_stamp(a, started) for a in ALERTS], FIRING)
                await stage([_stamp(RISK1, started, _now())], PARTLY)
                ended = _now()
                await stage([_stamp(a, started, ended) for a in ALERTS], RESOLVED)
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
