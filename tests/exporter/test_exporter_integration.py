"""A real exporter process on simulated GPUs, scraped by a real Prometheus, checked through its API."""

from __future__ import annotations

import os
import signal
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from exporter_helpers import promtool_check

from gpuhealth.local.process import ManagedProcess, free_port, http_ok, wait_until
from gpuhealth.local.prometheus import PrometheusServer

pytestmark = pytest.mark.slow

SCRIPT = Path(sys.executable).parent / "gpuhealth-exporter"
FAULTS = {"gpus": 4, "nvlinks": 2, "faults": [
    {"kind": "hbm_degradation", "gpu": 2, "start": 0, "precursor": 4, "xid": 95},
    {"kind": "nvlink_errors", "gpu": 1, "link": 1, "precursor": 3},
    {"kind": "fell_off_bus", "gpu": 3, "start": 2},
    {"kind": "ib_rate_downgrade", "nic": 2, "precursor": 3},
    {"kind": "nvswitch_fatal", "precursor": 2, "count": 1},
]}


class Exporter(ManagedProcess):
    def __init__(self, workdir: Path, scenario: Path, state_dir: Path) -> None:
        self.port = free_port()
        argv = [SCRIPT if SCRIPT.exists() else sys.executable, *([] if SCRIPT.exists() else
                ["-m", "gpuhealth.exporter.main"]),
                "--backend", "sim", "--sim-scenario", scenario, "--listen", f"127.0.0.1:{self.port}",
                "--kmsg-path", workdir / "kmsg", "--state-dir", state_dir, "--sampling.interval", "0.5"]
        super().__init__("exporter", argv, workdir / f"exporter-{self.port}.log")
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> Exporter:
        super().start()
        self.wait_ready(lambda: http_ok(f"{self.url}/healthz"), timeout=30)
        return self

    def scrape(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            return resp.read().decode()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Exporter, PrometheusServer, Path]]:
    scenario, state = tmp_path / "scenario.yml", tmp_path / "state"
    scenario.write_text(yaml.safe_dump(FAULTS))
    state.mkdir()
    exporter = Exporter(tmp_path, scenario, state)
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [{"job_name": "gpuhealth", "static_configs": [
                  {"targets": [f"127.0.0.1:{exporter.port}"], "labels": {"node": "node-a"}}]}]}
    prometheus = PrometheusServer(tmp_path / "prometheus", config)
    with exporter, prometheus:
        exporter.start()
        prometheus.start()
        yield exporter, prometheus, scenario


def value(prometheus: PrometheusServer, expr: str) -> float | None:
    result = prometheus.api.query(expr)
    return float(result[0]["value"][1]) if result else None


def eventually(prometheus: PrometheusServer, expr: str, timeout: float = 30) -> None:
    """Wait until the PromQL expression returns something (comparisons filter, so any result is true)."""
    wait_until(lambda: bool(prometheus.api.query(expr)), timeout, interval=0.5, what=expr)


def test_faults_show_on_the_right_gpu_in_prometheus(node) -> None:
    exporter, prometheus, _ = node
    eventually(prometheus, 'gpuhealth_gpu_remap_pending{node="node-a",gpu="2"} == 1')
    eventually(prometheus, 'gpuhealth_xid_events_total{gpu="2",xid="95"} == 1')
    eventually(prometheus, 'gpuhealth_gpu_recovery_action{gpu="2",action="gpu_reset"} == 1')
    eventually(prometheus, 'gpuhealth_gpu_up{gpu="3"} == 0')
    eventually(prometheus, 'gpuhealth_gpus_visible < gpuhealth_gpus_expected')
    eventually(prometheus, 'gpuhealth_xid_events_total{gpu="3",xid="79"} == 1')
    eventually(prometheus, 'gpuhealth_gpu_nvlink_up{gpu="1",link="1"} == 0')
    eventually(prometheus, 'gpuhealth_xid_events_total{gpu="1",xid="74"} == 1')
    assert value(prometheus, 'gpuhealth_gpu_nvlink_errors_total{gpu="1",link="1",type="crc"}') > 1000
    assert value(prometheus, 'gpuhealth_gpu_nvlink_errors_total{gpu="1",link="0",type="crc"}') == 0
    assert value(prometheus, 'count(gpuhealth_xid_events_total{gpu="0"})') is None  # a healthy GPU has none
    assert value(prometheus, 'gpuhealth_gpu_up{gpu="0"}') == 1
    assert value(prometheus, 'sum(gpuhealth_gpu_ecc_errors_total{type="corrected",counter="volatile",'
                             'gpu!="2"})') == 0
    # the fabric, from the simulator's sysfs tree: NIC 2 retrained at 200 Gb/s, beside GPU 1
    eventually(prometheus, 'gpuhealth_nic_port_rate_bytes_per_second{device="mlx5_2"} '
                           '< gpuhealth_nic_port_expected_rate_bytes_per_second')
    eventually(prometheus, 'gpuhealth_sxid_events_total{severity="fatal"} == 1')
    assert value(prometheus, 'gpuhealth_nic_port_rate_bytes_per_second{device="mlx5_2"}') == 2.5e10
    assert value(prometheus, 'count(gpuhealth_nic_port_up == 1)') == 8
    assert value(prometheus, 'gpuhealth_nic_gpu_affinity_info{device="mlx5_2",gpu="1",'
                             'scope="pcie_switch"}') == 1
    eventually(prometheus, 'gpuhealth_fabric_manager_up == 1')
    assert value(prometheus, 'gpuhealth_gpus_expected') == 4  # counted on the simulated PCI bus
    assert value(prometheus, 'min(gpuhealth_collector_success)') == 1
    assert value(prometheus, 'gpuhealth_kmsg_lines_total{result="malformed"}') == 0
    promtool_check(exporter.scrape())


def test_sighup_reloads_the_scenario_and_a_restart_does_not_replay(node) -> None:
    exporter, prometheus, scenario = node
    eventually(prometheus, 'gpuhealth_gpu_up{gpu="3"} == 0')
    scenario.write_text(yaml.safe_dump({"gpus": 4, "nvlinks": 2, "faults": [
        {"kind": "thermal_runaway", "gpu": 0, "precursor": 8}]}))
    os.kill(exporter.proc.pid, signal.SIGHUP)
    eventually(prometheus, 'gpuhealth_gpu_up{gpu="3"} == 1')  # GPUs come back as after a reset
    eventually(prometheus, 'gpuhealth_gpu_temperature_max_celsius{gpu="0"} > 10 + '
                           'scalar(max(gpuhealth_gpu_temperature_max_celsius{gpu!="0"}))')
    eventually(prometheus, 'gpuhealth_gpu_clock_event_active{gpu="0",reason="sw_thermal_slowdown"} == 1')
    eventually(prometheus, 'gpuhealth_xid_events_total{gpu="0",xid="79"} == 1')
    exporter.stop()
    scenario.write_text(yaml.safe_dump({"gpus": 4, "nvlinks": 2}))
    exporter.start()  # same kmsg file, same state dir: nothing already counted comes back
    text = exporter.scrape()
    assert "gpuhealth_xid_events_total{" not in text
    assert 'gpuhealth_kmsg_lines_total{result="xid"} 0.0' in text
