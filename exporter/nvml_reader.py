"""One full NVML sample of one GPU, through an injected pynvml-compatible module.

Every feature is optional: NotSupported (per feature, per GPU) leaves its series out. Any other NVML
error propagates and marks the GPU down, because it means the GPU stopped answering.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuhealth.exporter.inventory import GpuIdentity
from gpuhealth.exporter.metrics import NVLINK_ERROR_TYPES, REMAP_AVAILABILITY

CLOCK_EVENT_REASONS = {  # label -> pynvml constant suffix
    "gpu_idle": "GpuIdle",
    "applications_clocks_setting": "ApplicationsClocksSetting",
    "sw_power_cap": "SwPowerCap",
    "hw_slowdown": "HwSlowdown",
    "sync_boost": "SyncBoost",
    "sw_thermal_slowdown": "SwThermalSlowdown",
    "hw_thermal_slowdown": "HwThermalSlowdown",
    "hw_power_brake_slowdown": "HwPowerBrakeSlowdown",
    "display_clock_setting": "DisplayClockSetting",
}


@dataclass
class GpuReading:
    """Instant values by metric name (labels after ``gpu``) plus what the derived features need."""

    samples: list[tuple[str, tuple[str, ...], float]] = field(default_factory=list)
    temperature: float | None = None
    slowdown_threshold: float | None = None
    clock_events: dict[str, bool] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    nvlinks: list[int] = field(default_factory=list)

    def add(self, name: str, value: float | None, *labels: str) -> None:
        if value is not None:
            self.samples.append((name, labels, float(value)))


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Reads GPUs through ``nvml``; remembers which NVLinks each GPU has after the first sample."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._absent = (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound)
        self._links: dict[int, list[int]] = {}
        self._reasons = {label: getattr(nvml, f"nvmlClocksEventReason{suffix}")
                         for label, suffix in CLOCK_EVENT_REASONS.items()}

    def optional(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None when the GPU does not support it."""
        try:
            return fn(*args)
        except self._absent:
            return None

    def identity(self, index: int) -> GpuIdentity:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        pci = nvml.nvmlDeviceGetPciInfo(handle)
        return GpuIdentity(
            index=index,
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            pci_bus_id=_text(pci.busId).upper(),
            model=_text(nvml.nvmlDeviceGetName(handle)),
            serial=_text(self.optional(nvml.nvmlDeviceGetSerial, handle) or ""),
            vbios_version=_text(self.optional(nvml.nvmlDeviceGetVbiosVersion, handle) or ""),
        )

    def read(self, index: int) -> GpuReading:
        nvml, opt = self.nvml, self.optional
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        r = GpuReading()
        r.temperature = opt(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
        r.add("gpuhealth_gpu_temperature_celsius", r.temperature)
        r.slowdown_threshold = opt(nvml.nvmlDeviceGetTemperatureThreshold, handle,
                                   nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        r.add("gpuhealth_gpu_temperature_slowdown_threshold_celsius", r.slowdown_threshold)
        r.add("gpuhealth_gpu_temperature_shutdown_threshold_celsius",
              opt(nvml.nvmlDeviceGetTemperatureThreshold, handle, nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN))
        r.add("gpuhealth_gpu_memory_temperature_celsius", self._memory_temperature(handle))
        power = opt(nvml.nvmlDeviceGetPowerUsage, handle)
        r.add("gpuhealth_gpu_power_watts", None if power is None else power / 1000)
        limit = opt(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        r.add("gpuhealth_gpu_power_limit_watts", None if limit is None else limit / 1000)
        for name, clock in (("sm", nvml.NVML_CLOCK_SM), ("memory", nvml.NVML_CLOCK_MEM)):
            for suffix, fn in (("", nvml.nvmlDeviceGetClockInfo), ("_max", nvml.nvmlDeviceGetMaxClockInfo)):
                mhz = opt(fn, handle, clock)
                r.add(f"gpuhealth_gpu_{name}_clock{suffix}_hertz", None if mhz is None else mhz * 1e6)
        self._clock_events(handle, r)
        util = opt(nvml.nvmlDeviceGetUtilizationRates, handle)
        if util is not None:
            r.add("gpuhealth_gpu_utilization_ratio", util.gpu / 100)
            r.add("gpuhealth_gpu_memory_utilization_ratio", util.memory / 100)
        memory = opt(nvml.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            r.add("gpuhealth_gpu_memory_used_bytes", memory.used)
            r.add("gpuhealth_gpu_memory_total_bytes", memory.total)
        self._memory_errors(handle, r)
        self._pcie(handle, r, busy=util is None or util.gpu > 0)
        self._nvlink(index, handle, r)
        procs = opt(nvml.nvmlDeviceGetComputeRunningProcesses, handle)
        if procs is not None:
            r.pids = [p.pid for p in procs]
            r.add("gpuhealth_gpu_processes", len(procs))
        return r

    def _memory_temperature(self, handle: Any) -> float | None:
        nvml = self.nvml
        values = self.optional(nvml.nvmlDeviceGetFieldValues, handle, [nvml.NVML_FI_DEV_MEMORY_TEMP])
        if not values or values[0].nvmlReturn != nvml.NVML_SUCCESS:
            return None
        return values[0].value.uiVal

    def _clock_events(self, handle: Any, r: GpuReading) -> None:
        nvml = self.nvml
        mask = self.optional(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
        if mask is None:  # drivers before 535 know only the older name
            mask = self.optional(nvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        if mask is None:
            return
        for label, bit in self._reasons.items():
            r.clock_events[label] = bool(mask & bit)
            r.add("gpuhealth_gpu_clock_event_active", int(r.clock_events[label]), label)

    def _memory_errors(self, handle: Any, r: GpuReading) -> None:
        nvml, opt = self.nvml, self.optional
        for type_label, error_type in (("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                       ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            for counter_label, counter in (("volatile", nvml.NVML_VOLATILE_ECC),
                                           ("aggregate", nvml.NVML_AGGREGATE_ECC)):
                r.add("gpuhealth_gpu_ecc_errors_total", opt(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                                            error_type, counter), type_label, counter_label)
        causes = (("single_bit", nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
                  ("double_bit", nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
        for cause_label, cause in causes:
            pages = opt(nvml.nvmlDeviceGetRetiredPages, handle, cause)
            r.add("gpuhealth_gpu_retired_pages", None if pages is None else len(pages), cause_label)
        r.add("gpuhealth_gpu_retired_pages_pending", opt(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle))
        remapped = opt(nvml.nvmlDeviceGetRemappedRows, handle)
        if remapped is not None:
            correctable, uncorrectable, pending, failure = remapped
            r.add("gpuhealth_gpu_remapped_rows", correctable, "correctable")
            r.add("gpuhealth_gpu_remapped_rows", uncorrectable, "uncorrectable")
            r.add("gpuhealth_gpu_remap_pending", int(bool(pending)))
            r.add("gpuhealth_gpu_remap_failure", int(bool(failure)))
        histogram = opt(nvml.nvmlDeviceGetRowRemapperHistogram, handle)
        if histogram is not None:
            for label in REMAP_AVAILABILITY:
                r.add("gpuhealth_gpu_row_remap_availability_banks", getattr(histogram, label), label)

    def _pcie(self, handle: Any, r: GpuReading, busy: bool) -> None:
        nvml, opt = self.nvml, self.optional
        r.add("gpuhealth_gpu_pcie_replays_total", opt(nvml.nvmlDeviceGetPcieReplayCounter, handle))
        gen = opt(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)
        gen_max = opt(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
        width = opt(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle)
        width_max = opt(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
        r.add("gpuhealth_gpu_pcie_link_generation", gen)
        r.add("gpuhealth_gpu_pcie_link_generation_max", gen_max)
        r.add("gpuhealth_gpu_pcie_link_width_lanes", width)
        r.add("gpuhealth_gpu_pcie_link_width_max_lanes", width_max)
        if None not in (gen, gen_max, width, width_max):
            # an idle GPU lowers its link generation to save power: only a busy one is downgraded
            downgraded = width < width_max or (busy and gen < gen_max)
            r.add("gpuhealth_gpu_pcie_link_downgraded", int(downgraded))

    def _nvlink(self, index: int, handle: Any, r: GpuReading) -> None:
        nvml = self.nvml
        if index not in self._links:
            self._links[index] = [link for link in range(nvml.NVML_NVLINK_MAX_LINKS)
                                  if self._link_state(handle, link) is not None]
        total: float | None = None
        for link in self._links[index]:
            state = self._link_state(handle, link)
            if state is None:
                continue
            r.add("gpuhealth_gpu_nvlink_up", int(state == nvml.NVML_FEATURE_ENABLED), str(link))
            for type_label in NVLINK_ERROR_TYPES:  # crc_flit -> NVML_NVLINK_ERROR_DL_CRC_FLIT, ...
                counter = getattr(nvml, f"NVML_NVLINK_ERROR_DL_{type_label.upper()}")
                value = self.optional(nvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter)
                r.add("gpuhealth_gpu_nvlink_errors_total", value, str(link), type_label)
                if value is not None:
                    total = (total or 0) + value
        # One series per GPU for the rules, instead of 18 links x 4 types: a fleet-wide rate reads
        # 16,384 series at 2,048 nodes, not 1.2 million. The per-link series say which link.
        r.add("gpuhealth_gpu_nvlink_errors_all_links_total", total)

    def _link_state(self, handle: Any, link: int) -> int | None:
        try:
            return self.optional(self.nvml.nvmlDeviceGetNvLinkState, handle, link)
        except self.nvml.NVMLError_InvalidArgument:
            return None
