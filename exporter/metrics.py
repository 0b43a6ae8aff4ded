"""Every metric the exporter publishes, in one table, so names, types and help live in one place.

Collectors add samples by name through ``Families``; a name missing here is a programming error
caught by the tests, and docs/contract.md is checked against this table.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.samples import Sample


@dataclass(frozen=True)
class Spec:
    kind: str  # "gauge" or "counter"
    help: str
    labels: tuple[str, ...] = ()


def _g(help_: str, *labels: str) -> Spec:
    return Spec("gauge", help_, labels)


def _c(help_: str, *labels: str) -> Spec:
    return Spec("counter", help_, labels)


LEGACY_NVLINK_ERROR_TYPES = ("crc_flit", "crc_data", "replay", "recovery")  # nvmlDeviceGetNvLinkErrorCounter
REMAP_AVAILABILITY = ("max", "high", "partial", "low", "none")
RECOVERY_ACTIONS = ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset",  # NVML 0..7
                    "recover_imex_domain", "bus_reset", "system_reboot")
KMSG_RESULTS = ("xid", "sxid", "aer", "fallen_off_bus", "ignored", "malformed", "not_kernel", "over_limit")

SPECS: dict[str, Spec] = {
    # exporter and node level
    "gpuhealth_exporter_build_info": _g("Exporter version and NVML backend; always 1.", "version", "backend"),
    "gpuhealth_collector_success": _g("1 when the collector's last run succeeded.", "collector"),
    "gpuhealth_collector_duration_seconds": _g("Duration of the collector's last run.", "collector"),
    "gpuhealth_gpus_expected": _g("GPUs this node should have: from config, else NVIDIA GPUs on the PCI "
                                  "bus."),
    "gpuhealth_nvml_up": _g("1 while NVML is initialised and answers."),
    "gpuhealth_nvml_init_errors_total": _c("Failed NVML initialisations, by error.", "error"),
    "gpuhealth_nvml_stalled": _g("1 while every GPU missed its NVML deadline at once (a driver-wide stall)."),
    "gpuhealth_xid_nvml_registered": _g("1 while the GPU is registered for NVML XID events.", "gpu"),
    "gpuhealth_xid_nvml_wait_errors_total": _c("Errors from waiting on the NVML XID event set.", "error"),
    "gpuhealth_gpus_visible": _g("GPUs that NVML enumerates and that answer now."),
    "gpuhealth_sxid_events_total": _c("NVSwitch SXID events from the kernel log.",
                                      "device", "sxid", "severity"),
    "gpuhealth_pcie_aer_errors_total": _c("PCIe AER errors reported in the kernel log.",
                                          "pci_bus_id", "severity", "gpu"),
    "gpuhealth_kmsg_lines_total": _c("Kernel log lines read, by how they were classified.", "result"),
    # GPU level
    "gpuhealth_gpu_info": _g("GPU identity; always 1.", "gpu", "uuid", "pci_bus_id", "model", "serial",
                             "driver_version", "vbios_version"),
    "gpuhealth_gpu_up": _g("1 while the GPU answers NVML.", "gpu"),
    "gpuhealth_gpu_nvml_errors_total": _c("NVML errors: query sample marked the GPU down, others left a "
                                          "series out.", "gpu", "error", "query"),
    "gpuhealth_gpu_nvml_latency_seconds": _g("NVML time for one full sample of the GPU, max over the window.",
                                             "gpu"),
    "gpuhealth_gpu_temperature_celsius": _g("GPU core temperature.", "gpu"),
    "gpuhealth_gpu_temperature_max_celsius": _g("Maximum GPU temperature over the sampling window.", "gpu"),
    "gpuhealth_gpu_memory_temperature_celsius": _g("HBM temperature.", "gpu"),
    "gpuhealth_gpu_memory_temperature_threshold_celsius": _g("Maximum operating HBM temperature.", "gpu"),
    "gpuhealth_gpu_temperature_slowdown_threshold_celsius": _g("Temperature at which the GPU slows down.",
                                                               "gpu"),
    "gpuhealth_gpu_temperature_shutdown_threshold_celsius": _g("Temperature at which the GPU shuts down.",
                                                               "gpu"),
    "gpuhealth_gpu_temperature_slowdown_margin_celsius": _g(
        "Slowdown threshold minus the maximum temperature over the window.", "gpu"),
    "gpuhealth_gpu_power_watts": _g("Power draw.", "gpu"),
    "gpuhealth_gpu_power_limit_watts": _g("Enforced power limit.", "gpu"),
    "gpuhealth_gpu_sm_clock_hertz": _g("Current SM clock.", "gpu"),
    "gpuhealth_gpu_sm_clock_max_hertz": _g("Maximum SM clock.", "gpu"),
    "gpuhealth_gpu_memory_clock_hertz": _g("Current memory clock.", "gpu"),
    "gpuhealth_gpu_memory_clock_max_hertz": _g("Maximum memory clock.", "gpu"),
    "gpuhealth_gpu_clock_event_active": _g("1 while the clock event (throttle) reason is active.",
                                           "gpu", "reason"),
    "gpuhealth_gpu_clock_event_seconds_total": _c("Time spent with the clock event reason active.",
                                                  "gpu", "reason"),
    "gpuhealth_gpu_utilization_ratio": _g("Fraction of time a kernel was running.", "gpu"),
    "gpuhealth_gpu_memory_utilization_ratio": _g("Fraction of time device memory was read or written.",
                                                 "gpu"),
    "gpuhealth_gpu_memory_used_bytes": _g("Device memory in use.", "gpu"),
    "gpuhealth_gpu_memory_total_bytes": _g("Device memory installed.", "gpu"),
    "gpuhealth_gpu_ecc_errors_total": _c("ECC errors by type and NVML counter.", "gpu", "type", "counter"),
    "gpuhealth_gpu_ecc_location_errors_total": _c("ECC errors by type, NVML counter and location.",
                                                  "gpu", "type", "counter", "location"),
    "gpuhealth_gpu_ecc_enabled": _g("1 while ECC is enabled.", "gpu"),
    "gpuhealth_gpu_ecc_pending_enabled": _g("1 when ECC will be enabled after the next reset.", "gpu"),
    "gpuhealth_gpu_retired_pages": _g("Pages retired, by cause.", "gpu", "cause"),
    "gpuhealth_gpu_retired_pages_pending": _g("1 while a page retirement waits for a reset.", "gpu"),
    "gpuhealth_gpu_remapped_rows": _g("HBM rows remapped, by error type.", "gpu", "type"),
    "gpuhealth_gpu_remap_pending": _g("1 while a row remap waits for a reset.", "gpu"),
    "gpuhealth_gpu_remap_failure": _g("1 when a row remap failed.", "gpu"),
    "gpuhealth_gpu_row_remap_availability_banks": _g("Memory banks by spare remap rows left.",
                                                     "gpu", "availability"),
    "gpuhealth_gpu_pcie_replays_total": _c("PCIe replay events.", "gpu"),
    "gpuhealth_gpu_pcie_errors_total": _c("PCIe errors the GPU counted, by type.", "gpu", "type"),
    "gpuhealth_gpu_pcie_link_generation": _g("Current PCIe link generation.", "gpu"),
    "gpuhealth_gpu_pcie_link_generation_max": _g("Maximum PCIe link generation.", "gpu"),
    "gpuhealth_gpu_pcie_link_width_lanes": _g("Current PCIe link width.", "gpu"),
    "gpuhealth_gpu_pcie_link_width_max_lanes": _g("Maximum PCIe link width.", "gpu"),
    "gpuhealth_gpu_pcie_link_downgraded": _g("1 when PCIe generation or width is below its maximum.", "gpu"),
    "gpuhealth_gpu_nvlink_up": _g("1 while the NVLink is active.", "gpu", "link"),
    "gpuhealth_gpu_nvlink_errors_total": _c("NVLink errors by link and type.", "gpu", "link", "type"),
    "gpuhealth_gpu_nvlink_errors_all_links_total": _c(
        "NVLink errors summed over the GPU's links (CRC, replay, recovery; NVLink5 effective, receive).",
        "gpu"),
    "gpuhealth_gpu_nvlink_recoveries_total": _c("NVLink5 link recoveries by result.",
                                                "gpu", "link", "result"),
    "gpuhealth_gpu_nvlink_bit_error_rate": _g("NVLink5 bit error rate (symbol: raw, effective: after FEC).",
                                              "gpu", "link", "type"),
    "gpuhealth_gpu_nvlink_fec_history_total": _c("NVLink5 FEC codewords by corrected-symbol bin.",
                                                 "gpu", "link", "bin"),
    "gpuhealth_gpu_fabric_state": _g("1 for the GPU's NVLink fabric registration state.", "gpu", "state"),
    "gpuhealth_gpu_fabric_status_ok": _g("1 when the fabric registration succeeded.", "gpu"),
    "gpuhealth_gpu_fabric_bandwidth_degraded": _g("1 when the fabric reports degraded NVLink bandwidth.",
                                                  "gpu"),
    "gpuhealth_gpu_processes": _g("Compute processes running on the GPU.", "gpu"),
    "gpuhealth_gpu_job_info": _g("A Slurm job using the GPU; always 1.", "gpu", "job_id"),
    "gpuhealth_xid_events_total": _c("XID events from NVML and the kernel log, counted once.", "gpu", "xid"),
    "gpuhealth_gpu_fallen_off_bus_total": _c("Kernel log lines saying the GPU has fallen off the bus.",
                                             "gpu"),
    "gpuhealth_gpu_recovery_action": _g("1 for the recovery action the driver requests (NVML, else XID 154).",
                                        "gpu", "action"),
    # host
    "gpuhealth_host_cpu_seconds_total": _c("CPU time by mode, all CPUs together.", "mode"),
    "gpuhealth_host_memory_total_bytes": _g("Physical memory."),
    "gpuhealth_host_memory_available_bytes": _g("Memory available for new work without swapping."),
    "gpuhealth_host_load1": _g("One-minute load average."),
    "gpuhealth_host_interrupts_total": _c("Interrupts serviced."),
    "gpuhealth_host_context_switches_total": _c("Context switches."),
    "gpuhealth_host_procs_running": _g("Runnable processes."),
    "gpuhealth_host_page_outs_total": _c("Pages paged out (pgpgout)."),
    "gpuhealth_host_swap_outs_total": _c("Pages swapped out (pswpout)."),
    "gpuhealth_host_disk_read_bytes_total": _c("Bytes read from the disk.", "device"),
    "gpuhealth_host_disk_written_bytes_total": _c("Bytes written to the disk.", "device"),
    "gpuhealth_host_network_receive_bytes_total": _c("Bytes received on the interface.", "device"),
    "gpuhealth_host_network_transmit_bytes_total": _c("Bytes sent on the interface.", "device"),
    # NFS client
    "gpuhealth_nfs_rpc_operations_total": _c("NFS RPC operations completed.", "mount", "op"),
    "gpuhealth_nfs_rpc_transmissions_total": _c("NFS RPC transmissions, retransmissions included.",
                                                "mount", "op"),
    "gpuhealth_nfs_rpc_queue_seconds_total": _c("Time NFS RPCs waited in the client queue.", "mount", "op"),
    "gpuhealth_nfs_rpc_rtt_seconds_total": _c("NFS RPC round-trip time.", "mount", "op"),
    "gpuhealth_nfs_rpc_execute_seconds_total": _c("NFS RPC total execution time.", "mount", "op"),
    "gpuhealth_nfs_transport_sends_total": _c("RPC requests sent on the mount's transport.", "mount"),
    "gpuhealth_nfs_transport_backlog_queue_total": _c("Cumulative RPC backlog queue length at each send.",
                                                      "mount"),
}


Series = tuple[tuple[str, ...], float]  # label values (as text, in SPECS order) and value


class Family:
    """One family of ``SPECS`` with its samples kept as (label values, value) pairs.

    Every family is rendered once per sampling run, so prometheus_client's families (a ``Sample``
    and a label dict per series) cost more than the rendering itself; the renderer reads these pairs
    directly. ``samples`` builds prometheus_client's form for whoever asks.
    """

    __slots__ = ("documentation", "label_names", "name", "pairs", "sample_name", "type")

    def __init__(self, name: str, spec: Spec) -> None:
        self.sample_name = name
        self.name = name.removesuffix("_total") if spec.kind == "counter" else name  # as prometheus_client
        self.documentation, self.type, self.label_names = spec.help, spec.kind, spec.labels
        self.pairs: list[Series] = []

    @property
    def samples(self) -> list[Sample]:
        return [Sample(self.sample_name, dict(zip(self.label_names, values, strict=False)), value)
                for values, value in self.pairs]


Exposed = Family | Metric  # what collectors yield: Family from Families, Metric from prometheus_client


class Families:
    """Collects samples by metric name and yields families in first-use order."""

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}

    def _family(self, name: str) -> Family:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = Family(name, SPECS[name])
        return family

    def add(self, name: str, value: float, labels: Sequence[object] = ()) -> None:
        self._family(name).pairs.append((tuple(map(str, labels)), float(value)))

    def extend(self, name: str, series: Iterable[Series]) -> None:
        """Series already in the form ``add`` stores: label values as text, the value a float."""
        self._family(name).pairs.extend(series)

    def __iter__(self) -> Iterator[Family]:
        return iter(self._families.values())


MAX_CACHED_SERIES = 100_000
_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n", '"': '\\"'})


def _utf8(value: str) -> str:
    """A label value the exposition can carry: the kernel's names are bytes, read with surrogateescape,
    and a byte that is not UTF-8 is shown as ``\\xff`` instead of failing the whole scrape."""
    try:
        value.encode()
        return value
    except UnicodeEncodeError:
        pass
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no byte escaped
        return value.encode("utf-8", "backslashreplace").decode()


_INFINITIES = {float("inf"): "+Inf", float("-inf"): "-Inf"}


def _format_value(value: float) -> str:
    if value != value:
        return "NaN"
    return _INFINITIES.get(value) or repr(float(value))


_SeriesKey = tuple[str, ...] | tuple[tuple[str, str], ...]  # a Family's label values, a Sample's items


class _Line:
    """A series' rendered line, kept with its value: most series hold their value from one run to
    the next (counters change every few seconds, health gauges rarely), so their line is reused."""

    __slots__ = ("prefix", "text", "value")

    def __init__(self, prefix: str) -> None:
        self.prefix, self.text, self.value = prefix, "", float("nan")  # NaN equals nothing: first update

    def update(self, value: float) -> str:
        self.value, self.text = value, self.prefix + _format_value(value)
        return self.text


class Renderer:
    """Prometheus text format, with each series' name-and-labels prefix built once and reused.

    The exposition is rendered every sampling run, so this is the exporter's hottest loop; series
    are stable from one run to the next, so nearly every prefix comes from the cache, found by the
    label values alone (a family's label names are fixed by ``SPECS``).
    """

    def __init__(self) -> None:
        self._series_lines: dict[str, dict[_SeriesKey, _Line]] = {}  # sample name -> label values -> line
        self._cached = 0
        self._headers: dict[tuple[str, str, str], str] = {}

    def _prefix(self, name: str, labels: dict[str, str]) -> str:
        inner = ",".join(f'{k}="{_utf8(str(v)).translate(_ESCAPES)}"' for k, v in sorted(labels.items()))
        return f"{name}{{{inner}}} " if inner else f"{name} "

    def _series(self, name: str) -> dict[_SeriesKey, _Line]:
        if self._cached > MAX_CACHED_SERIES:  # label values churned (jobs come and go)
            self._series_lines.clear()
            self._cached = 0
        return self._series_lines.setdefault(name, {})

    def render(self, families: Iterable[Exposed]) -> bytes:
        lines: list[str] = []
        for family in families:
            header_key = (family.name, family.type, family.documentation)
            header = self._headers.get(header_key)
            if header is None:
                name = family.name + ("_total" if family.type == "counter" else "")
                doc = family.documentation.replace("\\", "\\\\").replace("\n", "\\n")
                header = self._headers[header_key] = f"# HELP {name} {doc}\n# TYPE {name} {family.type}"
            lines.append(header)
            if isinstance(family, Family):
                series = self._series(family.sample_name)
                for values, value in family.pairs:
                    line = series.get(values)
                    if line is None:
                        labels = dict(zip(family.label_names, values, strict=False))
                        line = series[values] = _Line(self._prefix(family.sample_name, labels))
                        self._cached += 1
                    lines.append(line.text if line.value == value else line.update(value))
            else:
                for sample in family.samples:
                    series = self._series(sample.name)
                    key = tuple(sorted(sample.labels.items()))  # pairs: never equal to a Family's values
                    line = series.get(key)
                    if line is None:
                        line = series[key] = _Line(self._prefix(sample.name, sample.labels))
                        self._cached += 1
                    lines.append(line.update(sample.value))
        lines.append("")
        return "\n".join(lines).encode()


def render(families: Iterable[Exposed]) -> bytes:
    """Prometheus text exposition of ``families`` (one-off; the sampler keeps a ``Renderer``)."""
    return Renderer().render(families)
