"""Telling people: every action transition to a JSON-lines audit log, and what operators must hear of
posted to Alertmanager as ``GPUHealthRemediation*`` alerts.

Posting through Alertmanager's API v2 (``POST /api/v2/alerts``) reaches the receivers a site already
has (Slack, PagerDuty, email) with no new integration. The alerts carry the action kind as
``remediation``, never as ``action``: the routes that send alerts to this webhook match ``action``,
and an announcement must not come back as a request to act. Neither the log nor a post may hold an
action up: a failure is logged and counted, and the action goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from gpuhealth.webhook.config import AnnounceConfig
from gpuhealth.webhook.metrics import Metrics
from gpuhealth.webhook.outcomes import Outcome, Reason
from gpuhealth.webhook.store import Action

log = logging.getLogger(__name__)

PREFIX = "GPUHealthRemediation"
# transition -> (alert name suffix, severity); a transition not listed is logged only
ALERTS = {
    "started": ("Started", "info"),
    Outcome.DONE.value: ("Succeeded", "info"),
    Outcome.FAILED.value: ("Failed", "warning"),
    "left_for_human": ("LeftForHuman", "warning"),
    "jobs_exhausted": ("Exhausted", "warning"),
    "chain_exhausted": ("ChainExhausted", "warning"),
    "breaker_tripped": ("BreakerOpen", "critical"),
}
FOR_HUMANS = (Reason.HEALTH_CHECK_FAILED, Reason.LEFT_FOR_HUMAN)


def _iso(when: float) -> str:
    return datetime.fromtimestamp(when, UTC).isoformat().replace("+00:00", "Z")


class Announcer:
    def __init__(self, config: AnnounceConfig, audit_log: Path, metrics: Metrics) -> None:
        self.config = config
        self.audit_log = audit_log
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._posts: set[asyncio.Task[None]] = set()
        self._in_order = asyncio.Lock()  # FIFO: a start never lands after the post that resolves it

    async def close(self) -> None:
        """Let posts under way finish (each is bounded by the timeout), then close the session."""
        if self._posts:
            await asyncio.gather(*self._posts, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def transition(self, a: Action, event: str, detail: str = "", **extra: Any) -> None:
        """Record one transition of ``a``; post it to Alertmanager if people should hear of it."""
        now = time.time()
        record = {"ts": round(now, 3), "id": a.id, "kind": a.kind, "node": a.node, "gpu": a.gpu,
                  "alertname": a.alertname, "event": event, "detail": detail, **extra}
        self._write(record)
        name = ALERTS.get(event)
        if name is not None and self.config.alertmanager_urls:
            # the started alert resolves with the action's end; the others stand for resolve_after
            ends = now + self.config.resolve_after_seconds
            alerts = [self._alert(a, *name, detail, now, ends)]
            if event != "started":
                alerts.append(self._alert(a, *ALERTS["started"], "", a.received_at, now))
            task = asyncio.create_task(self._post(alerts))
            self._posts.add(task)
            task.add_done_callback(self._posts.discard)

    def _write(self, record: dict[str, Any]) -> None:
        try:
            self.audit_log.parent.mkdir(parents=True, exist_ok=True)
            with self.audit_log.open("a") as fh:
                fh.write(json.dumps(record, sort_keys=True) + "\n")
        except OSError as exc:
            log.error("event=audit_log_unwritable path=%s error=%r record=%s", self.audit_log, exc,
                      json.dumps(record))

    def _alert(self, a: Action, suffix: str, severity: str, detail: str, starts: float, ends: float
               ) -> dict[str, Any]:
        labels = {"alertname": PREFIX + suffix, "severity": severity, "node": a.node,
                  "remediation": a.kind, "action_id": str(a.id), "source_alertname": a.alertname}
        if a.gpu:
            labels["gpu"] = a.gpu
        summary = f"gpuhealth {a.kind} on {a.node}: {suffix.lower()}"
        return {"labels": {k: v for k, v in labels.items() if v},
                "annotations": {"summary": summary, "description": detail or summary},
                "startsAt": _iso(starts), "endsAt": _iso(ends)}

    async def _post(self, alerts: list[dict[str, Any]]) -> None:
        async with self._in_order:
            await self._post_now(alerts)

    async def _post_now(self, alerts: list[dict[str, Any]]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=self.config.timeout_seconds))
        for url in self.config.alertmanager_urls:  # every member of an HA pair, as Prometheus does
            try:
                async with self._session.post(f"{url.rstrip('/')}/api/v2/alerts", json=alerts) as resp:
                    if resp.status >= 300:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                           message=(await resp.text())[:200])
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.metrics.announce_failures.inc()
                log.warning("event=announce_failed url=%s alerts=%s error=%r", url,
                            ",".join(x["labels"]["alertname"] for x in alerts), exc)
