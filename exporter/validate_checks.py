"""The checks ``gpuhealth-validate`` runs on what NVML and the kernel log say about the node.

Each GPU is read once, with the exporter's own reader and error table (``nvml_reader``,
``nvml_errors``), so a GPU that the exporter would mark down fails validation for the same reason.
A check is ``ok`` True (passed), False (failed, or could not be read: a return-to-service gate
fails closed) or None (not applicable here: the GPU or driver does not offer the feature).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.exporter.fabric_settings import GBPS
from gpuhealth.exporter.guard import DeadlineExceeded, GuardedWorker
from gpuhealth.exporter.inventory import GpuIdentity, Inventory
from gpuhealth.exporter.kmsg import KmsgFollower, parse_line, split_record
from gpuhealth.exporter.nvml_errors import GpuDown, NvmlDown, error_label, query_name
from gpuhealth.exporter.nvml_reader import GpuReading, NvmlReader
from gpuhealth.exporter.nvml_session import NvmlSession
from gpuhealth.exporter.sysfs_fabric import ReadErrors, read_ports

log = logging.getLogger(__name__)

JsonValue = Any  # what json.dumps takes: the value of a check


@dataclass(frozen=True)
class Check:
    """One line of the verdict; ``value`` is what was read, by GPU where the check is per GPU."""

    name: str
    ok: bool | None
    detail: str
    value: JsonValue = None

    def as_json(self) -> dict[str, JsonValue]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "value": self.value}


class NvmlUnavailable(Exception):
    """NVML cannot be initialised or failed as a whole: nothing about the GPUs can be checked."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


@dataclass
class GpuState:
    """One GPU as read for validation: its reading, or why it could not be read."""

    index: int
    identity: GpuIdentity | None = None
    reading: GpuReading | None = None
    error: str | None = None  # gpu_is_lost, timeout, ...: the GPU does not answer

    def value(self, metric: str, *labels: str) -> float | None:
        """A sample of the reading, or None when the GPU did not report it."""
        if self.reading is None:
            return None
        for name, sample_labels, number in (*self.reading.samples, *self.reading.slow):
            if name == metric and sample_labels == labels:
                return number
        return None

    def read_error(self, *queries: str) -> str | None:
        """The error an optional query met (the reading counts them by query), if any."""
        if self.reading is None:
            return None
        for error, query in self.reading.errors:
            if query in queries:
                return str(error)
        return None


@dataclass
class NodeState:
    driver_version: str
    count: int
    gpus: list[GpuState] = field(default_factory=list)

    @property
    def up(self) -> list[GpuState]:
        return [gpu for gpu in self.gpus if gpu.error is None]

    def inventory(self) -> Inventory:
        """Identities by PCI address, so a kernel-log line maps to its GPU index."""
        inventory = Inventory(driver_version=self.driver_version)
        for gpu in self.gpus:
            if gpu.identity is not None:
                inventory.add(gpu.identity)
        return inventory


def read_node(nvml: Any, timeout: float) -> NodeState:
    """Initialise NVML and read every GPU it counts, each on its own worker under ``timeout``.

    Raises NvmlUnavailable when the library cannot be used at all.
    """
    session = NvmlSession(nvml, timeout, time.monotonic)
    if not session.ensure():
        raise NvmlUnavailable(next(iter(session.init_errors), "unknown"))
    reader = NvmlReader(nvml)
    try:
        count = int(GuardedWorker.result(GuardedWorker("validate-count").submit(
            lambda: reader.core(nvml.nvmlDeviceGetCount)), timeout))
    except (GpuDown, DeadlineExceeded) as exc:
        raise NvmlUnavailable(error_label(exc)) from exc
    node = NodeState(session.driver_version, count)
    futures = []
    for index in range(count):
        def sample(index: int = index) -> tuple[GpuIdentity, GpuReading]:
            return reader.identity(index), reader.read(index, full=True)
        futures.append(GuardedWorker(f"validate-gpu{index}").submit(sample))
    deadline = time.monotonic() + timeout
    for index, future in enumerate(futures):
        gpu = GpuState(index)
        try:
            gpu.identity, gpu.reading = GuardedWorker.result(future, deadline - time.monotonic())
        except NvmlDown as exc:
            raise NvmlUnavailable(exc.error) from exc
        except (GpuDown, DeadlineExceeded) as exc:
            gpu.error = error_label(exc)
            log.warning("gpu unreadable gpu=%d error=%s", index, gpu.error)
        node.gpus.append(gpu)
    return node


# GPU index (or "unknown") -> (ok, value, problem): a per-GPU judgement
Judgement = tuple[bool | None, JsonValue, str | None]


def _per_gpu(name: str, gpus: Iterable[GpuState], judge: Callable[[GpuState], Judgement],
             passed: str, absent: str) -> Check:
    """Judge every GPU that answers; fails when one fails, passes when one passes and none fails."""
    values: dict[str, JsonValue] = {}
    problems: list[str] = []
    results: list[bool | None] = []
    for gpu in gpus:
        ok, value, problem = judge(gpu)
        values[str(gpu.index)] = value
        results.append(ok)
        if ok is False:
            problems.append(f"gpu {gpu.index} {problem}")
    if problems:
        return Check(name, False, "; ".join(problems), values)
    if True in results:
        return Check(name, True, passed, values)
    return Check(name, None, absent, values)


def _unread(gpu: GpuState, *queries: str) -> Judgement:
    """A value the GPU did not report: could not be read (fails) or not offered (not applicable)."""
    error = gpu.read_error(*queries)
    if error is not None:
        return False, None, f"could not be read ({error})"
    return None, None, None


def check_gpus_visible(node: NodeState, expected: int, expected_from: str) -> Check:
    answering = node.up
    down = {str(gpu.index): gpu.error for gpu in node.gpus if gpu.error is not None}
    value = {"expected": expected, "expected_from": expected_from, "counted": node.count,
             "answering": len(answering), "down": down}
    problems = [f"gpu {index} {error}" for index, error in down.items()]
    if len(answering) < expected:
        problems.insert(0, f"{len(answering)} of {expected} GPUs answer NVML")
    if problems:
        return Check("gpus_visible", False, "; ".join(problems), value)
    return Check("gpus_visible", True, f"{len(answering)} of {expected} GPUs answer NVML", value)


def check_row_remap(node: NodeState, nvml: Any) -> Check:
    query = query_name(nvml.nvmlDeviceGetRemappedRows)

    def judge(gpu: GpuState) -> Judgement:
        pending = gpu.value("gpuhealth_gpu_remap_pending")
        failure = gpu.value("gpuhealth_gpu_remap_failure")
        if pending is None or failure is None:
            return _unread(gpu, query)
        value = {"pending": bool(pending), "failure": bool(failure)}
        if failure:
            return False, value, "row remap failure (replace the GPU)"
        if pending:
            return False, value, "row remap pending (reset the GPU)"
        return True, value, None
    return _per_gpu("row_remap", node.up, judge, "no remap pending or failed",
                    "row remapping not reported (no HBM row remapper)")


def check_recovery_action(node: NodeState, nvml: Any) -> Check:
    query = query_name(nvml.nvmlDeviceGetFieldValues)

    def judge(gpu: GpuState) -> Judgement:
        action = gpu.reading.recovery_action if gpu.reading else None
        if action is None:
            return _unread(gpu, query)
        return action == "none", action, None if action == "none" else f"recovery action {action}"
    return _per_gpu("recovery_action", node.up, judge, "no recovery action requested",
                    "the driver does not report a recovery action (before R565)")


def check_fabric(node: NodeState, nvml: Any) -> Check:
    query = query_name(nvml.nvmlDeviceGetGpuFabricInfoV)
    states = ("not_started", "in_progress", "completed")

    def judge(gpu: GpuState) -> Judgement:
        state = next((s for s in states if gpu.value("gpuhealth_gpu_fabric_state", s) == 1), None)
        if state is None:
            return _unread(gpu, query)
        status_ok = gpu.value("gpuhealth_gpu_fabric_status_ok") == 1
        degraded = gpu.value("gpuhealth_gpu_fabric_bandwidth_degraded") == 1
        value = {"state": state, "status_ok": status_ok, "bandwidth_degraded": degraded}
        if state != "completed":
            return False, value, f"fabric registration {state}"
        if not status_ok:
            return False, value, "fabric registration failed"
        if degraded:
            return False, value, "fabric bandwidth degraded"
        return True, value, None
    return _per_gpu("fabric", node.up, judge, "fabric registration completed",
                    "no NVLink fabric (NVSwitch/IMEX) on these GPUs")


def check_ecc_mode(node: NodeState, nvml: Any) -> Check:
    query = query_name(nvml.nvmlDeviceGetEccMode)

    def judge(gpu: GpuState) -> Judgement:
        current = gpu.value("gpuhealth_gpu_ecc_enabled")
        pending = gpu.value("gpuhealth_gpu_ecc_pending_enabled")
        if current is None or pending is None:
            return _unread(gpu, query)
        value = {"enabled": bool(current), "pending_enabled": bool(pending)}
        if not current:
            return False, value, "ECC off"
        if not pending:
            return False, value, "ECC off after the next reset"
        return True, value, None
    return _per_gpu("ecc_mode", node.up, judge, "ECC on", "ECC mode not reported")


def check_temperature(node: NodeState, nvml: Any, idle_max: float, busy_margin: float) -> Check:
    queries = (query_name(nvml.nvmlDeviceGetTemperatureV), query_name(nvml.nvmlDeviceGetTemperature))

    def judge(gpu: GpuState) -> Judgement:
        reading = gpu.reading
        if reading is None or reading.temperature is None:
            return _unread(gpu, *queries)
        busy = bool(reading.pids) or (gpu.value("gpuhealth_gpu_utilization_ratio") or 0) > 0
        limit = idle_max
        if busy:  # a job still runs (the health check runs between jobs too): judged by its margin
            if reading.slowdown_threshold is None:
                return None, {"celsius": reading.temperature, "busy": True}, None
            limit = reading.slowdown_threshold - busy_margin
        value = {"celsius": reading.temperature, "busy": busy, "limit_celsius": limit}
        if reading.temperature > limit:
            state = "busy" if busy else "idle"
            return False, value, f"{reading.temperature:g} °C {state}, above {limit:g} °C"
        return True, value, None
    return _per_gpu("temperature", node.up, judge, "temperatures sane", "temperature not reported")


@dataclass(frozen=True)
class KernelLog:
    """Where and since when XIDs count: ``since`` is seconds since boot (kmsg timestamps)."""

    path: Path
    since: float = 0.0
    ignore: frozenset[int] = frozenset()


# The kernel's ring buffer holds at most 32 MiB (log_buf_len's ceiling): some 300,000 records of 100 bytes.
# A log beyond either bound (/dev/zero, a years-long syslog) fails the check instead of filling memory.
MAX_LOG_RECORDS = 500_000
MAX_LOG_CHARS = 64 << 20


def _count_xids(lines: list[str], kernel_log: KernelLog, inventory: Inventory,
                found: dict[str, dict[str, int]]) -> int:
    """Add the lines' XIDs since ``kernel_log.since`` to ``found`` (gpu -> XID -> lines); how many
    were ignored."""
    ignored = 0
    for line in lines:
        _, at, _ = split_record(line)
        if at is not None and at < kernel_log.since:
            continue
        event = parse_line(line)
        if event.kind == "xid" and event.code in kernel_log.ignore:
            ignored += 1
        elif event.kind in ("xid", "fallen_off_bus"):
            code = event.code if event.kind == "xid" else 79  # the notice stands for XID 79
            gpu = inventory.gpu_for_pci(event.pci_bus_id) if event.pci_bus_id else "unknown"
            counts = found.setdefault(gpu, {})
            counts[str(code)] = counts.get(str(code), 0) + 1
    return ignored


def check_xid(node: NodeState, kernel_log: KernelLog | None) -> Check:
    """XIDs (and fallen-off-the-bus notices) the kernel logged since ``since``, by GPU."""
    if kernel_log is None:
        return Check("xid", None, "kernel log not read (--no-kmsg)")
    inventory = node.inventory()
    found: dict[str, dict[str, int]] = {}  # gpu -> XID -> lines
    ignored = records = chars = 0
    try:
        follower = KmsgFollower(kernel_log.path, from_start=True)
        try:
            while batch := follower.read_lines():
                records, chars = records + len(batch), chars + sum(map(len, batch))
                if records > MAX_LOG_RECORDS or chars > MAX_LOG_CHARS:
                    return Check("xid", False, f"the kernel log {kernel_log.path} holds more than "
                                 f"{MAX_LOG_RECORDS} records or {MAX_LOG_CHARS >> 20} MiB: not one boot's "
                                 "kernel log (use /dev/kmsg)")
                ignored += _count_xids(batch, kernel_log, inventory, found)
        finally:
            follower.close()
    except OSError as exc:
        return Check("xid", False, f"cannot read the kernel log {kernel_log.path}: {exc.strerror or exc}")
    since = "boot" if kernel_log.since <= 0 else f"{kernel_log.since:g} s after boot"
    value = {"since_seconds_after_boot": kernel_log.since, "xids": found, "ignored": ignored}
    if found:
        detail = "; ".join(f"gpu {gpu} XID {', '.join(sorted(codes, key=int))}"
                           for gpu, codes in sorted(found.items()))
        return Check("xid", False, f"{detail} since {since}", value)
    return Check("xid", True, f"no XID since {since}", value)


@dataclass(frozen=True)
class NicPorts:
    """The InfiniBand/RoCE ports a node must have up: ``ports`` (HCA, port) and, when given, the rate
    each must run at; no ports but a rate: every port found."""

    sysfs: Path
    ports: tuple[tuple[str, str], ...] = ()
    rate_gbps: float | None = None


def check_nic_ports(expected: NicPorts | None) -> Check:
    """Every expected port ACTIVE with its physical link up, at (at least) its expected rate."""
    if expected is None:
        return Check("nic_ports", None, "no NIC ports expected (--nic-ports, --nic-rate-gbps)")
    errors = ReadErrors()
    found = {(port.device, port.port): port for port in read_ports(expected.sysfs, errors)}
    wanted = list(expected.ports) or sorted(found)
    if not wanted:
        return Check("nic_ports", False, f"no InfiniBand/RoCE port under {expected.sysfs}/class/infiniband",
                     {})
    values: dict[str, JsonValue] = {}
    problems: list[str] = []
    for device, number in wanted:
        name = f"{device} port {number}"
        port = found.get((device, number))
        if port is None:
            values[f"{device}:{number}"] = None
            problems.append(f"{name} missing")
            continue
        gbps = None if port.rate is None else port.rate / GBPS
        values[f"{device}:{number}"] = {"up": port.up, "state": port.state,
                                         "physical_state": port.physical_state, "rate_gbps": gbps}
        if not port.up:
            problems.append(f"{name} down (state {port.state}, physical state {port.physical_state})")
        elif expected.rate_gbps is not None and (gbps is None or gbps < expected.rate_gbps):
            rate = "unreadable" if gbps is None else f"{gbps:g} Gb/s"
            problems.append(f"{name} at {rate}, expected {expected.rate_gbps:g} Gb/s")
    if problems:
        return Check("nic_ports", False, "; ".join(problems), values)
    at = f" at {expected.rate_gbps:g} Gb/s" if expected.rate_gbps is not None else ""
    return Check("nic_ports", True, f"{len(wanted)} NIC ports up{at}", values)
