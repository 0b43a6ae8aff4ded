"""A real gpuhealth-webhook on a simulated cluster, scraped by a real Prometheus.

The simulated fleet of the evaluation benchmark has no remediation; this gives the remediation
panels real data for their tests and previews: the webhook runs as installed, receives Alertmanager
v4 notifications, acts on a simulated cluster (no scheduler needed) and publishes its metrics.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpuhealth.local.process import ManagedProcess, ProcessError, free_port, http_ok, wait_until
from gpuhealth.local.prometheus import PrometheusServer

log = logging.getLogger(__name__)

SCRAPE_SECONDS = 1
# (alertname, action, node, gpu): two drains, a job restart, a repeat, then drains the breaker stops.
ALERTS = (
    ("GPUHealthGpuFailureRisk", "drain", "gpu-001", "3"),
    ("GPUHealthXidRestartJob", "restart_job", "gpu-000", "2"),
    ("GPUHealthXidResetGpu", "drain_reset_gpu", "gpu-002", "5"),
    ("GPUHealthGpuFailureRisk", "drain", "gpu-001", "3"),
    ("GPUHealthXidRebootNode", "drain_reboot", "gpu-003", "1"),
    ("GPUHealthLemonNode", "replace", "gpu-004", ""),
)


@dataclass(frozen=True)
class Session:
    server: PrometheusServer
    start: float
    end: float


def _webhook_argv() -> list[str]:
    path = shutil.which("gpuhealth-webhook") or str(Path(sys.executable).with_name("gpuhealth-webhook"))
    if not Path(path).exists():
        raise ProcessError("gpuhealth-webhook is not installed: pip install the gpuhealth package")
    return [path]


def _payload(alertname: str, action: str, node: str, gpu: str) -> bytes:
    labels = {"alertname": alertname, "action": action, "node": node, "severity": "warning"}
    if gpu:
        labels["gpu"] = gpu
    fingerprint = hashlib.sha256(f"{alertname}/{node}/{gpu}".encode()).hexdigest()[:16]
    alert = {"status": "firing", "labels": labels,
             "annotations": {"summary": alertname, "description": alertname, "runbook_url": ""},
             "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "endsAt": "0001-01-01T00:00:00Z",
             "generatorURL": "", "fingerprint": fingerprint}
    return json.dumps({
        "version": "4", "groupKey": f'{{}}:{{node="{node}"}}', "truncatedAlerts": 0, "status": "firing",
        "receiver": "gpuhealth", "groupLabels": {"node": node}, "commonLabels": labels,
        "commonAnnotations": alert["annotations"], "externalURL": "", "alerts": [alert],
    }).encode()


def _samples(server: PrometheusServer) -> int:
    found = server.api.query("count_over_time(gpuhealth_webhook_queue_depth[1h])")
    return int(float(found[0]["value"][1])) if found else 0


@contextlib.contextmanager
def webhook_session(workdir: Path, pause: float = 2.0) -> Iterator[Session]:
    """Run the webhook, send it ``ALERTS`` ``pause`` seconds apart while Prometheus scrapes it."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = workdir / "webhook.yml"
    config.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{port}", "state_dir": str(workdir / "state"), "auth": {"disabled": True},
        "backend": {"type": "simulated", "nodes": ["gpu-00[0-7]"], "latency_seconds": 0.2},
        # Let two of the eight nodes drain, so that the third drain trips the breaker.
        "guardrails": {"breaker_max_nodes": 2, "breaker_max_fraction": 0.5},
    }))
    url = f"http://127.0.0.1:{port}"
    webhook = ManagedProcess("gpuhealth-webhook", [*_webhook_argv(), "--config", config],
                             workdir / "webhook.log")
    prometheus = PrometheusServer(workdir / "prometheus", {
        "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s"},
        "scrape_configs": [{"job_name": "gpuhealth-webhook", "static_configs": [{"targets": [url[7:]]}]}],
    })
    try:
        webhook.start()
        webhook.wait_ready(lambda: http_ok(f"{url}/healthz"), 30)
        prometheus.start()
        wait_until(lambda: _samples(prometheus) >= 1, 30, 0.1, "Prometheus scraping the webhook")
        start = time.time() - 2 * SCRAPE_SECONDS
        for alert in ALERTS:
            request = urllib.request.Request(f"{url}/alerts", _payload(*alert),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                log.info("alert sent alertname=%s node=%s status=%d", alert[0], alert[2], response.status)
            time.sleep(pause)
        scraped = _samples(prometheus)
        wait_until(lambda: _samples(prometheus) >= scraped + 2, 30, 0.1, "scrapes after the last alert")
        yield Session(prometheus, start, time.time())
    finally:
        prometheus.stop()
        webhook.stop()
