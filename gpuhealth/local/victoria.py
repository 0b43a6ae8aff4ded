"""VictoriaMetrics (the global tier's store) and vmalert's replay on loopback.

The global tier evaluates the fleet-wide rules in vmalert over what the Prometheus shards remote-write;
these helpers start the same engines for tests, the local stack and benchmarks.
"""

from __future__ import annotations

import copy
import datetime
import re
import subprocess
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Self

from gpuhealth.local.process import ManagedProcess, ProcessError, free_port, http_ok
from gpuhealth.local.prometheus import PrometheusAPI
from gpuhealth.rules.catalogue import REMOTE_WRITE_SERIES

VM_PACKAGE = "victoria-metrics"  # Debian: victoria-metrics, vmagent, vmalert, vmctl


def _binary(name: str) -> str:
    import shutil

    path = shutil.which(name)
    if path is None:
        raise ProcessError(f"{name} not found on PATH; install the Debian package '{VM_PACKAGE}'")
    return path


class VictoriaMetricsServer(ManagedProcess):
    """A single-node VictoriaMetrics keeping data of any age (backfilled history is years old)."""

    def __init__(self, workdir: Path, port: int | None = None, extra_args: Iterable[str] = ()) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = PrometheusAPI(self.url)
        super().__init__("victoria-metrics", [
            _binary("victoria-metrics"),
            f"-storageDataPath={self.workdir / 'data'}",
            f"-httpListenAddr=127.0.0.1:{self.port}",
            "-retentionPeriod=100y",
            "-search.latencyOffset=0s",  # answer for samples written a moment ago, as Prometheus does
            "-search.disableCache",      # imported history would otherwise hide behind cached results
            *extra_args,
        ], self.workdir / "victoria-metrics.log")

    def start(self, timeout: float = 30.0) -> Self:
        super().start()
        self.wait_ready(lambda: http_ok(f"{self.url}/health"), timeout)
        return self

    @property
    def remote_write_url(self) -> str:
        return f"{self.url}/api/v1/write"

    def import_text(self, lines: Iterable[str]) -> None:
        """Import exposition lines with millisecond timestamps, then make them searchable at once."""
        body = "".join(f"{line}\n" for line in lines).encode()
        request = urllib.request.Request(f"{self.url}/api/v1/import/prometheus", data=body, method="POST")
        urllib.request.urlopen(request, timeout=120).close()
        self.flush()

    def flush(self) -> None:
        urllib.request.urlopen(f"{self.url}/internal/force_flush", timeout=60).close()


def shard_config(index: int, shards: int, base: dict[str, Any], remote_write_url: str) -> dict[str, Any]:
    """``base`` (a Prometheus configuration) as shard ``index`` of ``shards``: every scrape job keeps
    the targets whose node hashes to ``index`` (every job of a node in one shard: the dcgm source reads
    two exporters of each node), and the shard remote-writes its records and alerts."""
    keep = [{"source_labels": ["node"], "modulus": shards, "target_label": "__tmp_shard",
             "action": "hashmod"},
            {"source_labels": ["__tmp_shard"], "regex": str(index), "action": "keep"}]
    config = copy.deepcopy(base)
    for job in config.get("scrape_configs", []):
        job["relabel_configs"] = [*keep, *job.get("relabel_configs", [])]
    config.setdefault("global", {}).setdefault("external_labels", {})["prometheus"] = f"shard-{index}"
    config["remote_write"] = [{"url": remote_write_url, "write_relabel_configs": [
        {"source_labels": ["__name__"], "regex": REMOTE_WRITE_SERIES, "action": "keep"}]}]
    return config


class VmalertServer(ManagedProcess):
    """vmalert evaluating ``rule_files`` over VictoriaMetrics, writing its alerts back and notifying
    Alertmanager, as the global tier runs it."""

    def __init__(self, workdir: Path, rule_files: Iterable[Path], server: VictoriaMetricsServer,
                 alertmanager_url: str, interval: str = "1m") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__("vmalert", [
            _binary("vmalert"),
            *(f"-rule={path}" for path in rule_files),
            f"-datasource.url={server.url}",
            f"-remoteWrite.url={server.url}",
            f"-remoteRead.url={server.url}",     # alert state survives a restart
            f"-notifier.url={alertmanager_url}",
            f"-httpListenAddr=127.0.0.1:{self.port}",
            f"-evaluationInterval={interval}",
            "-datasource.queryStep=0s",
        ], Path(workdir) / "vmalert.log")

    def start(self, timeout: float = 30.0) -> Self:
        super().start()
        self.wait_ready(lambda: http_ok(f"{self.url}/health"), timeout)
        return self

    def iterations(self, group: str) -> int:
        """How many times ``group`` has been evaluated so far (vmalert's own counter)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        pattern = re.compile(rf'^vmalert_iteration_total\{{group="{re.escape(group)}"[,}}].* (\d+)$', re.M)
        return sum(int(count) for count in pattern.findall(text))


def _rfc3339(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def vmalert_replay(rule_files: Iterable[Path], server: VictoriaMetricsServer, start: float, end: float,
                   log_path: Path, timeout: float = 600.0) -> None:
    """Evaluate ``rule_files`` over [start, end] as vmalert would have, writing the recorded series and
    ALERTS back into ``server``; raises ProcessError with vmalert's log when it fails."""
    argv = [
        _binary("vmalert"),
        *(f"-rule={path}" for path in rule_files),
        f"-datasource.url={server.url}",
        f"-remoteWrite.url={server.url}",
        "-datasource.queryStep=0s",  # each group's own interval; the 5m default thins the replayed alerts
        f"-httpListenAddr=127.0.0.1:{free_port()}",
        f"-replay.timeFrom={_rfc3339(start)}",
        f"-replay.timeTo={_rfc3339(end)}",
        "-replay.rulesDelay=0s",
        "-replay.disableProgressBar",
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        result = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if result.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise ProcessError(f"vmalert -replay exited with {result.returncode}:\n{tail}")
    server.flush()
