"""Real Prometheus and Alertmanager servers on loopback, plus a tiny HTTP API client.

Prometheus's own engine evaluates every query and rule: callers never re-implement PromQL.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Self

import yaml

from gpuhealth.local.process import ManagedProcess, ProcessError, free_port, http_ok

PROMETHEUS_BIN = "prometheus"
ALERTMANAGER_BIN = "prometheus-alertmanager"  # Debian's name; upstream tarballs call it "alertmanager"


def find_binary(*names: str) -> str:
    """First of ``names`` found on PATH; a clear error naming the Debian package otherwise."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise ProcessError(f"none of {', '.join(names)} found on PATH; install the Debian packages "
                       "'prometheus' and 'prometheus-alertmanager' (see README)")


class PrometheusAPI:
    """The few Prometheus HTTP API calls gpuhealth needs, on the standard library."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _get(self, path: str, params: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
        query = urllib.parse.urlencode(params) if params else ""
        if len(query) > 4000:  # long expressions go in a form body: URLs have length limits
            request = urllib.request.Request(f"{self.url}{path}", data=query.encode(), method="POST")
        else:
            request = urllib.request.Request(f"{self.url}{path}{'?' if query else ''}{query}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:  # 4xx/5xx still carry Prometheus's error text
            try:
                body = json.load(exc)
            except ValueError:
                raise RuntimeError(f"Prometheus {path} failed: HTTP {exc.code}") from None
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus {path} failed: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str, time: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if time is not None:
            params["time"] = f"{time:.3f}"
        return self._get("/api/v1/query", params)["result"]

    def query_step(self, expr: str, time: float, step: str) -> list[dict[str, Any]]:
        """An instant query with ``step`` set, as vmalert asks VictoriaMetrics (its lookback)."""
        return self._get("/api/v1/query", {"query": expr, "time": f"{time:.3f}", "step": step})["result"]

    def query_range(self, expr: str, start: float, end: float, step: float,
                    timeout: float = 60.0) -> list[dict[str, Any]]:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        return self._get("/api/v1/query_range", params, timeout=timeout)["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/targets")["activeTargets"]

    def rule_groups(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/rules")["groups"]

    def alerts(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/alerts")["alerts"]


class LoopbackServer(ManagedProcess):
    """A Prometheus-family daemon on a free loopback port, its config written into ``workdir``.

    Subclasses name the binary and its flags; readiness is the ``/-/ready`` endpoint they all share.
    """

    name = ""
    config_name = ""
    ready_timeout = 30.0

    def __init__(self, workdir: Path, config: dict[str, Any] | str, port: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / self.config_name
        text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
        self.config_path.write_text(text)
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(self.name, self.command(), self.workdir / f"{self.name}.log")

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float | None = None) -> Self:
        super().start()
        self.wait_ready(lambda: http_ok(f"{self.url}/-/ready"), timeout or self.ready_timeout)
        return self


class PrometheusServer(LoopbackServer):
    """A Prometheus with the lifecycle API on (reloads), storing its TSDB in ``data_dir``."""

    name = "prometheus"
    config_name = "prometheus.yml"
    ready_timeout = 60.0

    def __init__(self, workdir: Path, config: dict[str, Any], port: int | None = None,
                 extra_args: list[str] | None = None, data_dir: Path | None = None) -> None:
        self.data_dir = data_dir or Path(workdir) / "data"
        self.extra_args = extra_args or []
        super().__init__(workdir, config, port)
        self.api = PrometheusAPI(self.url)

    def command(self) -> list[str]:
        return [
            find_binary(PROMETHEUS_BIN),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.data_dir}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
            *self.extra_args,
        ]

    def stop_scraping(self) -> None:
        """Reload with an empty configuration: scraping and rule evaluation stop, the data stays, so
        queries that follow measure only themselves."""
        self.config_path.write_text(yaml.safe_dump({"global": {}}))
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        urllib.request.urlopen(request, timeout=60).close()

    def cpu_seconds(self) -> float:
        """User + system CPU time so far: unlike wall time, other load on the machine barely moves it."""
        import psutil  # the tools extra: only benchmarks measure CPU, and the daemons' installs lack it

        assert self.proc is not None
        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system


class AlertmanagerServer(LoopbackServer):
    """An Alertmanager with clustering off (no gossip port to collide on)."""

    name = "alertmanager"
    config_name = "alertmanager.yml"

    def command(self) -> list[str]:
        return [
            find_binary(ALERTMANAGER_BIN, "alertmanager"),
            f"--config.file={self.config_path}",
            f"--storage.path={self.workdir / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--cluster.listen-address=",
        ]
