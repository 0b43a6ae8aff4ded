"""VictoriaMetrics (the global tier's store) and vmalert's replay on loopback.

The global tier evaluates the fleet-wide rules in vmalert over what the Prometheus shards remote-write;
these helpers start the same engines for tests, the local stack and benchmarks.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import re
import select
import struct
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Self

import yaml

from gpuhealth.contract.duration import parse_duration
from gpuhealth.evaluation.blocks import uvarint  # the same base-128 varint as protobuf's
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

    def remote_write(self, series: Iterable[tuple[dict[str, str], list[tuple[float, float]]]]) -> None:
        """Send ``series`` (labels, (unix seconds, value) samples) by the remote-write protocol, as
        Prometheus and vmalert do, then make them searchable at once."""
        headers = {"Content-Encoding": "snappy", "Content-Type": "application/x-protobuf"}
        body = snappy_literal(write_request(series))
        request = urllib.request.Request(self.remote_write_url, data=body, method="POST", headers=headers)
        urllib.request.urlopen(request, timeout=120).close()
        self.flush()

    def export(self, match: str, start: float, end: float) -> Iterator[dict[str, Any]]:
        """Every series matching ``match`` with its raw samples in [start, end] (``/api/v1/export``):
        ``{"metric": {...}, "values": [...], "timestamps": [ms, ...]}``."""
        query = urllib.parse.urlencode({"match[]": match, "start": f"{start:.3f}", "end": f"{end:.3f}"})
        with urllib.request.urlopen(f"{self.url}/api/v1/export?{query}", timeout=300) as response:
            for line in response:
                if line.strip():
                    yield json.loads(line)

    def flush(self) -> None:
        urllib.request.urlopen(f"{self.url}/internal/force_flush", timeout=60).close()


STALE_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]  # Prometheus's staleness marker


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return uvarint(number << 3 | 2) + uvarint(len(payload)) + payload


def write_request(series: Iterable[tuple[dict[str, str], list[tuple[float, float]]]]) -> bytes:
    """A Prometheus remote-write ``WriteRequest`` (protobuf) of ``series``: labels and (unix seconds,
    value) samples. Hand-encoded: the remote-write protocol is the only way to send a staleness
    marker (an import's NaN is a plain NaN), and this is all of the schema it needs."""
    out = bytearray()
    for labels, samples in series:
        body = b"".join(_field(1, _field(1, k.encode()) + _field(2, v.encode()))
                        for k, v in sorted(labels.items()))
        for t, value in samples:
            sample = b"\x09" + struct.pack("<d", value) + b"\x10" + uvarint(round(t * 1000))
            body += _field(2, sample)
        out += _field(1, body)
    return bytes(out)


def snappy_literal(data: bytes) -> bytes:
    """``data`` in snappy's block format, as literals only: valid snappy that any decoder reads,
    without a compression library."""
    out = bytearray(uvarint(len(data)))
    for at in range(0, len(data), 65536):
        chunk = data[at:at + 65536]
        n = len(chunk) - 1
        if n < 60:
            out.append(n << 2)
        elif n < 256:
            out += bytes([60 << 2, n])
        else:
            out += bytes([61 << 2]) + n.to_bytes(2, "little")
        out += chunk
    return bytes(out)


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


def _shortest_interval(rule_files: Iterable[Path]) -> float:
    groups = [g for path in rule_files for g in (yaml.safe_load(path.read_text()) or {}).get("groups") or []]
    intervals = [parse_duration(group.get("interval", "1m")) for group in groups]
    return min(intervals, default=60.0)


def vmalert_replay(rule_files: Iterable[Path], server: VictoriaMetricsServer, start: float, end: float,
                   log_path: Path, timeout: float = 600.0,
                   remote_write: VictoriaMetricsServer | None = None) -> None:
    """Evaluate ``rule_files`` over [start, end] as vmalert would have, reading ``server`` and writing
    the recorded series and ALERTS back into it (or into ``remote_write``); raises ProcessError with
    vmalert's log when it fails.

    Each rule is one query over the whole period: vmalert 1.79 starts every replay request with its
    alerts inactive, so an alert pending across the boundary of two requests would wait its ``for``
    again. (VictoriaMetrics answers at most ``-search.maxPointsPerTimeseries`` points, 30,000 by
    default: three weeks at 1 min.)"""
    rule_files = list(rule_files)
    sink = remote_write or server
    points = int((end - start) // _shortest_interval(rule_files)) + 2
    argv = [
        _binary("vmalert"),
        *(f"-rule={path}" for path in rule_files),
        f"-datasource.url={server.url}",
        f"-remoteWrite.url={sink.url}",
        "-datasource.queryStep=0s",  # each group's own interval; the 5m default thins the replayed alerts
        f"-replay.maxDatapointsPerQuery={points}",
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
    sink.flush()


def _run_on_terminal(argv: list[str], log_path: Path, timeout: float) -> int:
    """Run ``argv`` with a pseudo-terminal as its stdin, stdout and stderr, copying its output to
    ``log_path``; return its exit status. It is killed after ``timeout`` s, or when this call fails."""
    primary, secondary = os.openpty()
    try:
        proc = subprocess.Popen(argv, stdin=secondary, stdout=secondary, stderr=secondary,
                                start_new_session=True)
    finally:
        os.close(secondary)
    deadline = time.monotonic() + timeout
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with log_path.open("wb") as log:
            while time.monotonic() < deadline:
                if not select.select([primary], [], [], 1.0)[0]:
                    continue
                try:
                    data = os.read(primary, 65536)
                except OSError:  # EIO: every holder of the terminal closed it
                    break
                if not data:
                    break
                log.write(data)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        os.close(primary)
        if proc.poll() is None:  # past its timeout, or this call failed
            proc.kill()
    return proc.wait()


def vmctl_import(data_dir: Path, server: VictoriaMetricsServer, log_path: Path,
                 timeout: float = 1800.0) -> None:
    """Load every series of a Prometheus data directory (its blocks) into ``server`` with
    ``vmctl prometheus``; raises ProcessError with vmctl's log when it fails. vmctl 1.79 gives up on
    a snapshot when its output is not a terminal (even with ``-s`` and no progress bar), so it gets one."""
    argv = [_binary("vmctl"), "prometheus", "-s", f"--prom-snapshot={data_dir}", f"--vm-addr={server.url}",
            "--vm-disable-progress-bar"]
    returncode = _run_on_terminal(argv, log_path, timeout)
    if returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise ProcessError(f"vmctl prometheus exited with {returncode}:\n{tail}")
    server.flush()
