"""Input series for `promtool test rules`, written once and spelled per input source.

A test describes a fleet in logical inputs (temperature, corrected ECC, interrupts, ...); `Fleet`
spells each one as gpuhealth-exporter or as dcgm-exporter/node_exporter would expose it, so the same
scenario checks both generated rule sets.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuhealth.evaluation.expand import Expander
from gpuhealth.evaluation.rulefiles import Rule, RuleSet

GENERATED = Path(__file__).resolve().parents[2] / "rules" / "generated"
SOURCES = ("gpuhealth", "dcgm")
MODEL = "NVIDIA H100 80GB HBM3"
RUNBOOK = "https://github.com/gpuhealth/gpuhealth/blob/main/rules/runbooks.md#"

# input -> (metric, fixed labels, scale) per source; an input a source lacks is simply not listed.
CLOCK_EVENTS = "gpuhealth_gpu_clock_event_seconds_total"
INPUTS: dict[str, dict[str, tuple[str, dict[str, str], float]]] = {
    "gpuhealth": {
        "info": ("gpuhealth_gpu_info", {"model": MODEL}, 1),
        "up": ("up", {}, 1),   # the GPU exporter's scrape health (node-level)
        "temperature": ("gpuhealth_gpu_temperature_celsius", {}, 1),
        "slowdown_temperature": ("gpuhealth_gpu_temperature_slowdown_threshold_celsius", {}, 1),
        "memory_temperature": ("gpuhealth_gpu_memory_temperature_celsius", {}, 1),
        "memory_temperature_limit": ("gpuhealth_gpu_memory_temperature_threshold_celsius", {}, 1),
        "power": ("gpuhealth_gpu_power_watts", {}, 1),
        "utilization": ("gpuhealth_gpu_utilization_ratio", {}, 1),
        "ecc_corrected": ("gpuhealth_gpu_ecc_errors_total", {"type": "corrected", "counter": "volatile"}, 1),
        "ecc_uncorrected": ("gpuhealth_gpu_ecc_errors_total",
                            {"type": "uncorrected", "counter": "volatile"}, 1),
        "retired_pending": ("gpuhealth_gpu_retired_pages_pending", {}, 1),
        "rows_correctable": ("gpuhealth_gpu_remapped_rows", {"type": "correctable"}, 1),
        "rows_uncorrectable": ("gpuhealth_gpu_remapped_rows", {"type": "uncorrectable"}, 1),
        "remap_pending": ("gpuhealth_gpu_remap_pending", {}, 1),
        "remap_failure": ("gpuhealth_gpu_remap_failure", {}, 1),
        "thermal_seconds": (CLOCK_EVENTS, {"reason": "hw_thermal_slowdown"}, 1),
        "power_cap_seconds": (CLOCK_EVENTS, {"reason": "sw_power_cap"}, 1),
        "power_brake_seconds": (CLOCK_EVENTS, {"reason": "hw_power_brake_slowdown"}, 1),
        "pcie_replays": ("gpuhealth_gpu_pcie_replays_total", {}, 1),
        "pcie_downgraded": ("gpuhealth_gpu_pcie_link_downgraded", {}, 1),
        "pcie_aer": ("gpuhealth_pcie_aer_errors_total", {"severity": "corrected"}, 1),
        "nvlink_crc": ("gpuhealth_gpu_nvlink_errors_all_links_total", {}, 1),
        "nvlink_up": ("gpuhealth_gpu_nvlink_up", {}, 1),
        "nvml_latency": ("gpuhealth_gpu_nvml_latency_seconds", {}, 1),
        "fallen_off_bus": ("gpuhealth_gpu_fallen_off_bus_total", {}, 1),
        "recovery_action": ("gpuhealth_gpu_recovery_action", {}, 1),
        "interrupts": ("gpuhealth_host_interrupts_total", {}, 1),
        "procs_running": ("gpuhealth_host_procs_running", {}, 1),
        "page_outs": ("gpuhealth_host_page_outs_total", {}, 1),
        "collector_success": ("gpuhealth_collector_success", {"collector": "gpu"}, 1),
        "gpus_expected": ("gpuhealth_gpus_expected", {}, 1),
        "gpus_visible": ("gpuhealth_gpus_visible", {}, 1),
        "nic_info": ("gpuhealth_nic_port_info", {"link_layer": "InfiniBand"}, 1),
        "nic_up": ("gpuhealth_nic_port_up", {}, 1),
        "nic_link_downed": ("gpuhealth_nic_port_link_downed_total", {}, 1),
        "nic_errors": ("gpuhealth_nic_port_errors_total", {}, 1),
        "nic_rate": ("gpuhealth_nic_port_rate_bytes_per_second", {}, 1),
        "nic_expected_rate": ("gpuhealth_nic_port_expected_rate_bytes_per_second", {}, 1),
        "carrier_changes": ("gpuhealth_netdev_carrier_changes_total", {}, 1),
        "nic_affinity": ("gpuhealth_nic_gpu_affinity_info", {"scope": "pcie_switch"}, 1),
    },
    "dcgm": {
        "temperature": ("DCGM_FI_DEV_GPU_TEMP", {"modelName": MODEL}, 1),
        "slowdown_temperature": ("DCGM_FI_DEV_SLOWDOWN_TEMP", {}, 1),
        "memory_temperature": ("DCGM_FI_DEV_MEMORY_TEMP", {}, 1),
        "memory_temperature_limit": ("DCGM_FI_DEV_MEM_MAX_OP_TEMP", {}, 1),
        "power": ("DCGM_FI_DEV_POWER_USAGE", {}, 1),
        "utilization": ("DCGM_FI_DEV_GPU_UTIL", {}, 100),
        "ecc_corrected": ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", {}, 1),
        "ecc_uncorrected": ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", {}, 1),
        "retired_pending": ("DCGM_FI_DEV_RETIRED_PENDING", {}, 1),
        "rows_correctable": ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", {}, 1),
        "rows_uncorrectable": ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", {}, 1),
        "remap_pending": ("DCGM_FI_DEV_ROW_REMAP_PENDING", {}, 1),
        "remap_failure": ("DCGM_FI_DEV_ROW_REMAP_FAILURE", {}, 1),
        "thermal_seconds": ("DCGM_FI_DEV_THERMAL_VIOLATION", {}, 1e6),
        "power_cap_seconds": ("DCGM_FI_DEV_POWER_VIOLATION", {}, 1e6),
        "up": ("up", {}, 1),   # the GPU exporter's scrape health (node-level)
        "pcie_replays": ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", {}, 1),
        "pcie_width": ("DCGM_FI_DEV_PCIE_LINK_WIDTH", {}, 1),
        "pcie_width_max": ("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", {}, 1),
        "pcie_gen": ("DCGM_FI_DEV_PCIE_LINK_GEN", {}, 1),
        "pcie_gen_max": ("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", {}, 1),
        "nvlink_crc": ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", {}, 1),
        "interrupts": ("node_intr_total", {}, 1),
        "procs_running": ("node_procs_running", {}, 1),
        "page_outs": ("node_vmstat_pgpgout", {}, 1),
    },
}
NFS = {
    "gpuhealth": ({"operations": "gpuhealth_nfs_rpc_operations_total",
                   "queue": "gpuhealth_nfs_rpc_queue_seconds_total",
                   "execute": "gpuhealth_nfs_rpc_execute_seconds_total"}, "mount", "op"),
    "dcgm": ({"operations": "node_mountstats_nfs_operations_requests_total",
              "queue": "node_mountstats_nfs_operations_queue_time_seconds_total",
              "execute": "node_mountstats_nfs_operations_request_time_seconds_total"}, "export", "operation"),
}
JOBS = {"gpuhealth": ("gpuhealth-exporter", 9835), "dcgm": ("dcgm-exporter", 9400)}
NODE_INPUTS = {"interrupts", "procs_running", "page_outs", "collector_success", "gpus_expected",
               "gpus_visible", "nic_info", "nic_up", "nic_link_downed", "nic_errors", "nic_rate",
               "nic_expected_rate", "carrier_changes", "nic_affinity"}

Segment = tuple[float, float, int]


def values(*segments: Segment | str, scale: float = 1) -> str:
    """promtool's expanding notation from (start, step, repeats) segments; strings pass unchanged."""
    parts = []
    for seg in segments:
        if isinstance(seg, str):
            parts.append(seg)
            continue
        start, step, times = seg
        parts.append(f"{start * scale:g}{step * scale:+g}x{times}")
    return " ".join(parts)


def _labels(labels: dict[str, str]) -> str:
    return ", ".join(f'{k}="{v}"' for k, v in labels.items())


@dataclass
class Fleet:
    """Input series of a simulated fleet, spelled for one source. Minutes are sample indexes (1m interval)."""

    source: str
    series: dict[str, str] = field(default_factory=dict)

    def _target(self, node: str) -> dict[str, str]:
        job, port = JOBS[self.source]
        return {"job": job, "instance": f"{node}:{port}", "node": node}

    def supports(self, name: str) -> bool:
        return name in INPUTS[self.source]

    def add(self, name: str, node: str, gpu: int | None, *segments: Segment | str, **labels: str) -> Fleet:
        if not self.supports(name):
            return self
        metric, fixed, scale = INPUTS[self.source][name]
        target = self._target(node)
        if name in NODE_INPUTS and self.source == "dcgm":
            target["job"], target["instance"] = "node-exporter", f"{node}:9100"
        all_labels = {**target, **({} if gpu is None else {"gpu": str(gpu)}), **fixed, **labels}
        self.series[f"{metric}{{{_labels(all_labels)}}}"] = values(*segments, scale=scale)
        return self

    def gpu(self, node: str, gpu: int, minutes: int, temperature: float = 60,
            utilization: float = 0.9) -> Fleet:
        """A healthy GPU: the series that put it in the GPU set, flat for ``minutes``."""
        self.add("info", node, gpu, (1, 0, minutes), uuid=f"GPU-{node}-{gpu}")
        self.add("temperature", node, gpu, (temperature, 0, minutes))
        return self.add("utilization", node, gpu, (utilization, 0, minutes))

    def node(self, node: str, minutes: int, gpus: int = 8, utilization: float = 0.9,
             interrupts_per_s: float = 10_000, procs: float = 40) -> Fleet:
        """A busy, healthy node: its GPUs plus the host series the collapse signals compare."""
        for index in range(gpus):
            self.gpu(node, index, minutes, utilization=utilization)
        self.add("interrupts", node, None, (0, interrupts_per_s * 60, minutes))
        return self.add("procs_running", node, None, (procs, 0, minutes))

    def xid(self, node: str, gpu: int, events: list[tuple[int, int]], minutes: int) -> Fleet:
        """XIDs at the given minutes: a counter per XID (absent until its first event, as the exporter
        creates it), or dcgm-exporter's gauge holding the last XID."""
        target = {**self._target(node), "gpu": str(gpu)}
        if self.source == "dcgm":
            current, points = 0, []
            for minute in range(minutes + 1):
                current = next((x for m, x in events if m == minute), current)
                points.append(str(current))
            labels = _labels({**target, "modelName": MODEL})
            self.series[f"DCGM_FI_DEV_XID_ERRORS{{{labels}}}"] = " ".join(points)
            return self
        for xid in sorted({x for _, x in events}):
            count, points = 0, []
            for minute in range(minutes + 1):
                count += sum(1 for m, x in events if m == minute and x == xid)
                first = min(m for m, x in events if x == xid)
                points.append("_" if minute < first else str(count))
            self.xid_counter(node, gpu, xid, " ".join(points))
        return self

    def xid_counter(self, node: str, gpu: int, xid: int, points: str) -> Fleet:
        """One XID counter (gpuhealth source) with its values in promtool notation."""
        labels = _labels({**self._target(node), "gpu": str(gpu), "xid": str(xid)})
        self.series[f"gpuhealth_xid_events_total{{{labels}}}"] = points
        return self

    def sxid(self, node: str, severity: str, minutes_with_events: list[int], minutes: int) -> Fleet:
        """NVSwitch SXIDs of ``severity`` (fatal, non_fatal) at the given minutes: gpuhealth-exporter's
        counter (absent until the first), or DCGM's gauge of the switch's last SXID, alternating
        between two SXID numbers so that each event is a change."""
        points, count = [], 0
        for minute in range(minutes + 1):
            count += minutes_with_events.count(minute)
            points.append(count)
        target = self._target(node)
        if self.source == "dcgm":
            metric = {"fatal": "DCGM_FI_DEV_NVSWITCH_FATAL_ERRORS",
                      "non_fatal": "DCGM_FI_DEV_NVSWITCH_NON_FATAL_ERRORS"}[severity]
            gauge = " ".join("0" if c == 0 else str(12028 + c % 2) for c in points)
            self.series[f"{metric}{{{_labels({**target, 'nvswitch': '0'})}}}"] = gauge
            return self
        first = min(minutes_with_events)
        labels = _labels({**target, "device": "0000:05:00.0", "sxid": "12028", "severity": severity})
        self.series[f"gpuhealth_sxid_events_total{{{labels}}}"] = " ".join(
            "_" if minute < first else str(c) for minute, c in enumerate(points))
        return self

    def nfs(self, node: str, mount: str, op: str, per_second: dict[str, float], minutes: int) -> Fleet:
        metrics, mount_label, op_label = NFS[self.source]
        labels = {**self._target(node), mount_label: mount, op_label: op}
        if self.source == "dcgm":
            labels["job"], labels["instance"] = "node-exporter", f"{node}:9100"
        for kind, rate in per_second.items():
            self.series[f"{metrics[kind]}{{{_labels(labels)}}}"] = values((0, rate * 60, minutes))
        return self

    def raw(self, series: str, vals: str) -> Fleet:
        self.series[series] = vals
        return self

    def input_series(self) -> list[dict[str, str]]:
        return [{"series": s, "values": v} for s, v in sorted(self.series.items())]


def alert(name: str, labels: dict[str, str], summary: str, description: str, severity: str,
          action: str) -> dict[str, Any]:
    """One expected alert with every label and annotation, as promtool compares them."""
    return {
        "exp_labels": {**labels, "severity": severity, "action": action},
        "exp_annotations": {"summary": summary, "description": description,
                            "runbook_url": RUNBOOK + name.lower()},
    }


def needed_groups(files: list[Path], tests: list[dict[str, Any]], out: Path) -> list[Path]:
    """Copies of the rule ``files`` in ``out`` keeping only the groups the ``tests`` can observe: those
    of the alerts they assert on and of the records those alerts (and their PromQL checks) read,
    directly or through other records. The others cannot change what the tests compare, yet promtool
    evaluates every group at every step, and the sharded per-GPU groups make that most of its time.
    The groups keep their order, so a `for:` starts at the same step. A rule reading ``ALERTS`` (or
    an assertion on it) depends on alerts by their labels, which this does not follow: then every
    group is kept."""
    texts = [yaml.safe_load(path.read_text()) for path in files]
    rules = [Rule("record" if "record" in rule else "alert", rule.get("record") or rule["alert"],
                  str(rule["expr"]), group["name"], 60.0)
             for text in texts for group in text["groups"] for rule in group["rules"]]
    alerts = {check["alertname"] for test in tests for check in test.get("alert_rule_test", [])}
    exprs = [check["expr"] for test in tests for check in test.get("promql_expr_test", [])]
    read = [r.expr for r in rules if r.kind == "alert" and r.name in alerts] + exprs
    names = alerts | set(Expander(RuleSet(rules)).records_used(" or ".join(read) or "vector(0)"))
    if any("ALERTS" in r.expr for r in rules if r.name in names) or any("ALERTS" in e for e in exprs):
        return files
    out.mkdir(parents=True, exist_ok=True)
    kept = []
    for path, text in zip(files, texts, strict=True):
        groups = [g for g in text["groups"] if any((r.get("record") or r.get("alert")) in names
                                                    for r in g["rules"])]
        (out / path.name).write_text(yaml.safe_dump({"groups": groups}, sort_keys=False, width=1000))
        kept.append(out / path.name)
    return kept


def run_promtool(tmp_path: Path, source: str, groups: list[str], tests: list[dict[str, Any]],
                 evaluation_interval: str = "1m", rules_dir: Path = GENERATED, timeout: int = 240,
                 group_eval_order: list[str] | None = None, in_file_order: bool = False) -> None:
    """Write a promtool unit-test file for ``groups`` of ``source`` (only their groups the tests can
    observe, see ``needed_groups``) and run it, for at most ``timeout`` seconds; fail with its output.
    promtool evaluates groups in no fixed order within a step unless told, and all at the same instant
    (Prometheus runs each group at an offset of its own within the interval): ``group_eval_order`` names
    the groups it evaluates first, in that order; ``in_file_order`` gives it the files' order (producers
    first), which a test needs when a step is longer than the 5-minute lookback: a record read from a
    group evaluated later in the step would be the last step's, gone."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install the Debian package 'prometheus' (scripts/bootstrap.sh)")
    files = [rules_dir / source / f"{group}.yml" for group in groups]
    kept = needed_groups(files, tests, tmp_path / f"{source}-rules")
    spec: dict[str, Any] = {
        "rule_files": [str(f) for f in kept],
        "evaluation_interval": evaluation_interval,
        **({"group_eval_order": group_eval_order} if group_eval_order else {}),
        "tests": tests,
    }
    if in_file_order and not group_eval_order:
        spec["group_eval_order"] = [group["name"] for path in kept
                                    for group in yaml.safe_load(path.read_text())["groups"]]
    path = tmp_path / f"{source}-{'-'.join(groups)}.test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False, width=1000))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"promtool test rules {path}:\n{result.stdout}\n{result.stderr}"
