"""The whole gpuhealth loop as local processes on loopback.

A Slurm cluster (one slurmd per simulated node), one ``gpuhealth-exporter --backend sim`` per node,
a real Prometheus loading the generated rules, a real Alertmanager routing to the webhook, and the
webhook acting on Slurm. Faults are injected into a running exporter by rewriting its scenario file
and sending SIGHUP. Used by ``gpuhealth demo``, the end-to-end test and ``bench/e2e.py``.

The webhook resets a GPU as a site's ``reset_gpu_command`` would (``ssh -- {node} nvidia-smi -r -i {gpu}``):
``gpuhealth-sim-reset`` asks the node's exporter, over its ``--sim-control`` socket, to reset the GPU
in its simulator, which succeeds or fails as ``nvidia-smi -r`` does (exporter/README.md), and takes
what the reset ended on that GPU out of the node's hardware file, as a real reset leaves the GPU.

The webhook returns a node to service as on a real fleet: after its alerts resolved and
``gpuhealth-validate`` passed, run here on this host with the simulator against the node's hardware
(``nodes/<node>/hardware.yml``: every fault injected on it, as it is once the fault has struck).
``complete_reboot`` plays a reboot the webhook asked Slurm for: the node's faults are gone (a reboot
is the repair), its exporter starts again with an empty kernel log, and its slurmd reports a boot.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gpuhealth.contract.faults import FABRIC_KINDS
from gpuhealth.contract.faults import SIMULATED_NODE_NOISE_KINDS as NOISE_KINDS
from gpuhealth.demo import deployment
from gpuhealth.local.process import ManagedProcess, ProcessError, free_port, http_ok, wait_until
from gpuhealth.local.prometheus import AlertmanagerServer, PrometheusAPI, PrometheusServer
from gpuhealth.local.slurm import SlurmCluster

log = logging.getLogger(__name__)

#: The rule catalogue's demo overlay: 5 s intervals, windows short enough for a precursor of minutes.
OVERLAY = deployment.REPO / "rules" / "overlays" / "demo.yaml"
NODE_WIDE_KINDS = ("hot_aisle", "idle_node", "app_xid", "slow_nvml", "power_brake")
WEBHOOK_STAMP = re.compile(r"ts=(\S+ \S+) ")
NIC_KINDS = ("ib_link_flap", "ib_symbol_errors", "ib_rate_downgrade", "ib_boot_flap")  # on the GPU's own NIC
PROMETHEUS_RULES_DIR = deployment.role_defaults("gpuhealth_prometheus")["gpuhealth_prometheus_rules_dir"]


@dataclass(frozen=True)
class Fault:
    """One injected event: a fault of docs/contract.md's vocabulary, or benign noise."""

    node: str
    kind: str
    gpu: int = 0
    duration: float = 0.0  # precursor length (faults) or active time (noise), seconds
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def is_noise(self) -> bool:
        return self.kind in NOISE_KINDS

    def scenario_entry(self) -> dict[str, Any]:
        """This event as an entry of the exporter simulator's scenario file (exporter/README.md)."""
        entry: dict[str, Any] = {"kind": self.kind, "start": 0, **self.params}
        if self.kind in NIC_KINDS:
            entry["nic"] = self.gpu  # HGX: NIC i sits on GPU i's PCIe switch
        elif self.kind not in NODE_WIDE_KINDS and self.kind not in FABRIC_KINDS:
            entry["gpu"] = self.gpu
        entry["duration" if self.is_noise else "precursor"] = self.duration
        return entry


@dataclass
class StackOptions:
    nodes: int = 4
    job_nodes: int = 2
    jobs: int = 1
    scrape_interval: str = "5s"
    evaluation_interval: str = "5s"
    breaker_max_nodes: int = 2
    checkpoint_interval: float = 10.0  # the training jobs' checkpoint interval, seconds


T = TypeVar("T")


def started(daemon: T | None) -> T:
    """A daemon of the stack, which must have been started by now (the stack starts them in order)."""
    if daemon is None:
        raise ProcessError("the stack has not started this daemon yet")
    return daemon


class ClosedLoopStack:
    """Start, observe and tear down the loop. Always use it as a context manager."""

    rules_tier = "single"  # what `gpuhealth rules generate --tier` the Prometheus loads

    def __init__(self, options: StackOptions | None = None, workdir: Path | None = None) -> None:
        self.options = options or StackOptions()
        self._own_workdir = workdir is None
        self.root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="gpuhealth-demo-"))
        # the exporters' control sockets in a short /tmp folder, whatever the length of ``workdir``
        # (a Unix socket path holds at most 107 bytes)
        self._sockets = Path(tempfile.mkdtemp(prefix="gpuhealth-sim-"))
        self.token = secrets.token_hex(16)
        self.slurm = SlurmCluster(self.root / "slurm", nodes=self.options.nodes, prefix="node")
        self.nodes = self.slurm.node_names
        self.exporters: dict[str, ManagedProcess] = {}
        self.exporter_ports: dict[str, int] = {}
        self.prometheus: PrometheusServer | None = None
        self.alertmanager: AlertmanagerServer | None = None
        self.webhook: ManagedProcess | None = None
        self.webhook_port = free_port()
        self.webhook_url = f"http://127.0.0.1:{self.webhook_port}"
        self.jobs: list[str] = []
        self._faults: dict[str, list[Fault]] = {node: [] for node in self.nodes}

    # --- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> ClosedLoopStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, progress=lambda message: None) -> ClosedLoopStack:
        """Start everything; on any failure stop what was started and re-raise."""
        try:
            progress("starting Slurm (slurmctld, munged, one slurmd per node)")
            self.slurm.start()
            progress("starting one simulated-GPU exporter per node")
            self._start_exporters()
            progress("generating rules and starting Alertmanager, the webhook and Prometheus")
            generated = self._generate_rules(self.rules_tier)
            self._start_alertmanager(yaml.safe_load((generated / "alertmanager.yml").read_text()))
            self._start_webhook()
            self._start_metrics(generated, progress)
            progress(f"submitting {self.options.jobs} training job(s) of {self.options.job_nodes} nodes")
            for index in range(self.options.jobs):
                self.jobs.append(self.slurm.submit_training_job(
                    self.options.job_nodes, seconds=3600, name=f"train{index + 1}",
                    checkpoint_interval=self.options.checkpoint_interval))
            progress("waiting for Prometheus to scrape every exporter")
            self.wait_targets_up()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process; a temporary working folder (no ``workdir`` given) goes too."""
        for proc in [self.prometheus, self.alertmanager, self.webhook, *self.exporters.values()]:
            if proc is not None:
                proc.stop()
        self.slurm.stop()
        shutil.rmtree(self._sockets, ignore_errors=True)
        if self._own_workdir:
            shutil.rmtree(self.root, ignore_errors=True)

    # --- components --------------------------------------------------------------------------------

    def _bin(self, name: str) -> str:
        return str(Path(sys.executable).with_name(name))

    def _scenario_path(self, node: str) -> Path:
        return self.root / "nodes" / node / "scenario.yml"

    def _hardware_path(self, node: str) -> Path:
        return self.root / "nodes" / node / "hardware.yml"

    def _control_path(self, node: str) -> Path:
        """The socket through which ``gpuhealth-sim-reset`` resets the node's simulated GPUs."""
        return self._sockets / f"{node}.sock"

    def _write_scenario(self, node: str) -> None:
        """The exporter's scenario (each fault from its precursor's onset), and the node's hardware as
        ``gpuhealth-validate`` sees it: every fault already struck, so that no node under a precursor
        passes validation."""
        faults = [f.scenario_entry() for f in self._faults[node]]
        deployment.write(self._scenario_path(node), yaml.safe_dump({"gpus": 8, "faults": faults}))
        struck = [{**entry, "precursor": 0} if "precursor" in entry else entry for entry in faults]
        deployment.write(self._hardware_path(node), yaml.safe_dump({"gpus": 8, "faults": struck}))

    def _start_exporters(self) -> None:
        for node in self.nodes:
            self._write_scenario(node)
            self._start_exporter(node, free_port())
        for node in self.nodes:
            self._wait_exporter(node)

    def _start_exporter(self, node: str, port: int) -> None:
        node_dir = self.root / "nodes" / node
        (node_dir / "state").mkdir(parents=True, exist_ok=True)
        argv: list[str | Path] = [self._bin("gpuhealth-exporter"), "--backend", "sim",
                "--sim-scenario", self._scenario_path(node), "--kmsg-path", node_dir / "kmsg",
                "--listen", f"127.0.0.1:{port}", "--state-dir", node_dir / "state",
                "--sampling.window", "5", "--sim-control", self._control_path(node)]
        proc = ManagedProcess(f"exporter-{node}", argv, node_dir / "exporter.log").start()
        self.exporters[node], self.exporter_ports[node] = proc, port

    def _wait_exporter(self, node: str) -> None:
        url = f"http://127.0.0.1:{self.exporter_ports[node]}/healthz"
        self.exporters[node].wait_ready(functools.partial(http_ok, url))

    def _generate_rules(self, tier: str) -> Path:
        """``gpuhealth rules generate --tier TIER`` over the demo overlay; the output folder (its
        ``gpuhealth/*.yml`` and the Alertmanager example)."""
        out = self.root / "generated" / tier
        overlay = self.root / "catalogue-overlay.yml"
        settings = yaml.safe_load(OVERLAY.read_text())
        settings["defaults"].update(scrape_interval=self.options.scrape_interval,
                                    evaluation_interval=self.options.evaluation_interval)
        deployment.write(overlay, yaml.safe_dump(settings, sort_keys=False))
        cmd = [self._bin("gpuhealth"), "rules", "generate", "--catalogue", str(overlay),
               "--source", "gpuhealth", "--tier", tier, "--out", str(out)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ProcessError(f"rule generation failed:\n{result.stderr}")
        return out

    def _install_rules(self, generated: Path, rules_dir: str) -> list[Path]:
        """Copy the generated rule files to where the deployment reads them (``rules_dir`` under root)."""
        target = self.root / rules_dir.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        installed = []
        for path in sorted((generated / "gpuhealth").glob("*.yml")):
            installed.append(target / path.name)
            installed[-1].write_text(path.read_text())
        return installed

    def _start_metrics(self, generated: Path, progress: Callable[[str], None]) -> None:
        """The metrics tier: one Prometheus scraping every exporter and evaluating every rule."""
        self._install_rules(generated, PROMETHEUS_RULES_DIR)
        self.prometheus = PrometheusServer(self.root / "prometheus", self._prometheus_config()).start()

    def _start_alertmanager(self, example: dict[str, Any]) -> None:
        token_file = "/etc/prometheus/gpuhealth-webhook.token"
        deployment.write(self.root / token_file.lstrip("/"), self.token)
        os.chmod(self.root / token_file.lstrip("/"), 0o600)
        text = deployment.render("gpuhealth_prometheus", "alertmanager.yml.j2", {
            "gpuhealth_prometheus_alertmanager_example": example,
            "gpuhealth_prometheus_root_prefix": str(self.root),
            "gpuhealth_prometheus_webhook_url": f"{self.webhook_url}/alerts",
            "gpuhealth_prometheus_webhook_token_file": token_file,
        })
        self.alertmanager = AlertmanagerServer(self.root / "alertmanager", text).start()

    def _start_webhook(self) -> None:
        config_dir = "/etc/gpuhealth"
        deployment.write(self.root / config_dir.lstrip("/") / "webhook.token", self.token)
        text = deployment.render("gpuhealth_webhook", "webhook.yml.j2", {
            "gpuhealth_webhook_root_prefix": str(self.root),
            "gpuhealth_webhook_config_dir": config_dir,
            "gpuhealth_webhook_state_dir": "/var/lib/gpuhealth-webhook",
            "gpuhealth_webhook_port": self.webhook_port,
            "gpuhealth_webhook_backend": {
                "type": "slurm", "slurm_conf": str(self.slurm.conf_path),
                # nvidia-smi -r -i {gpu} on the node, played by its simulator; what the reset ended
                # leaves the node's hardware, so that gpuhealth-validate then sees the repair
                "reset_gpu_command": [self._bin("gpuhealth-sim-reset"), "--control",
                                      str(self._control_path("{node}")), "-i", "{gpu}",
                                      "--scenario", str(self._hardware_path("{node}"))]},
            "gpuhealth_webhook_guardrails": {
                "breaker_max_nodes": self.options.breaker_max_nodes,
                "breaker_max_fraction": 0.5,
                "node_cooldown_seconds": 60,
            },
            "gpuhealth_webhook_retry": {"backoff_initial_seconds": 0.5, "job_retry_interval_seconds": 5},
            # a node goes back once its alerts resolved and gpuhealth-validate passed on its hardware,
            # every NIC port up at the simulator's 400 Gb/s among its checks
            "gpuhealth_webhook_undrain": {
                "health_check": [self._bin("gpuhealth-validate"), "--backend", "sim", "--sim-scenario",
                                 str(self._hardware_path("{node}")),
                                 "--nic-rate-gbps", "400"],
                "health_check_timeout_seconds": 60, "health_check_retry_seconds": 2,
                "health_check_max_attempts": 1000},
            # the training jobs checkpoint on USR1: a predictive drain waits for that file, not their exit
            "gpuhealth_webhook_checkpoint": {
                "confirm": "file", "grace_seconds": 30, "poll_seconds": 0.5,
                "path": str(self.slurm.workdir / "checkpoints" / "job-{job_id}")},
        })
        config = deployment.write(self.root / config_dir.lstrip("/") / "webhook.yml", text)
        self.webhook = ManagedProcess("webhook", [self._bin("gpuhealth-webhook"), "--config", config],
                                      self.root / "webhook.log", env={**os.environ, **self.slurm.env}).start()
        self.webhook.wait_ready(lambda: http_ok(f"{self.webhook_url}/healthz"))

    def _prometheus_config(self, **variables: Any) -> dict[str, Any]:
        """prometheus.yml as the gpuhealth_prometheus role writes it (and its file_sd targets);
        ``variables`` override the role's (a shard's index and remote write)."""
        file_sd = "/etc/prometheus/file_sd"
        common = {"gpuhealth_prometheus_root_prefix": str(self.root),
                  "gpuhealth_prometheus_file_sd_dir": file_sd,
                  "gpuhealth_prometheus_rules_dir": PROMETHEUS_RULES_DIR}
        targets = [{"node": node, "address": f"127.0.0.1:{self.exporter_ports[node]}"} for node in self.nodes]
        deployment.write(self.root / file_sd.lstrip("/") / "gpuhealth-exporters.yml",
                         deployment.render("gpuhealth_prometheus", "gpuhealth-exporters.yml.j2",
                                           {**common, "gpuhealth_prometheus_exporter_targets": targets}))
        text = deployment.render("gpuhealth_prometheus", "prometheus.yml.j2", {
            **common,
            "gpuhealth_prometheus_exporter_targets": targets,
            "gpuhealth_prometheus_scrape_interval": self.options.scrape_interval,
            "gpuhealth_prometheus_scrape_timeout": self.options.scrape_interval,
            "gpuhealth_prometheus_evaluation_interval": self.options.evaluation_interval,
            "gpuhealth_prometheus_alertmanager_targets": [f"127.0.0.1:{started(self.alertmanager).port}"],
            "gpuhealth_prometheus_webhook_target": f"127.0.0.1:{self.webhook_port}",
            **variables,
        })
        return yaml.safe_load(text)

    # --- acting on the simulated fleet --------------------------------------------------------------

    def inject(self, fault: Fault) -> float:
        """Add ``fault`` to its node's scenario and reload that exporter; the injection time."""
        self._faults[fault.node].append(fault)
        self._write_scenario(fault.node)
        proc = self.exporters[fault.node].proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGHUP)
        log.info("fault injected node=%s kind=%s gpu=%s", fault.node, fault.kind, fault.gpu)
        return time.time()

    def complete_reboot(self, node: str, timeout: float = 60.0) -> None:
        """Play the reboot the webhook asked Slurm for, once Slurm issued it: the node's faults are
        repaired, its exporter restarts with an empty kernel log and state, its slurmd boots."""
        wait_until(lambda: self.slurm.reboot_issued(node), timeout, interval=0.2,
                   what=f"Slurm to issue the reboot of {node}")
        self._faults[node] = []
        self._write_scenario(node)
        self.exporters[node].stop()
        node_dir = self.root / "nodes" / node
        (node_dir / "kmsg").unlink(missing_ok=True)
        shutil.rmtree(node_dir / "state", ignore_errors=True)
        self._start_exporter(node, self.exporter_ports[node])
        self._wait_exporter(node)
        self.slurm.complete_reboot(node, timeout)
        log.info("node rebooted node=%s", node)

    # --- observing ---------------------------------------------------------------------------------

    @property
    def fleet_api(self) -> PrometheusAPI:
        """Where every node's records and alerts can be read: the one Prometheus here."""
        return started(self.prometheus).api

    def wait_targets_up(self, timeout: float = 60.0) -> None:
        assert self.prometheus is not None
        api = self.prometheus.api

        def all_up() -> bool:
            up = api.query('up{job="gpuhealth-exporter"} == 1')
            return len(up) == len(self.nodes)
        self.prometheus.wait_ready(all_up, timeout)

    def webhook_logged(self, pattern: str) -> list[float]:
        """When the webhook logged each line matching ``pattern`` (``ts=2026-12-02 03:14:39,051 ...``)."""
        found = []
        for line in (self.root / "webhook.log").read_text().splitlines():
            stamp = WEBHOOK_STAMP.match(line)
            if stamp and re.search(pattern, line[stamp.end():]):
                found.append(datetime.datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f").timestamp())
        return found

    def webhook_get(self, path: str) -> Any:
        request = urllib.request.Request(f"{self.webhook_url}{path}",
                                         headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=5) as resp:
            return json.load(resp)

    def urls(self) -> dict[str, str]:
        return {
            "Prometheus": f"{self.prometheus.url}/alerts" if self.prometheus else "",
            "Alertmanager": self.alertmanager.url if self.alertmanager else "",
            "Webhook status": f"{self.webhook_url}/",
        }

