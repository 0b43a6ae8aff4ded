"""One full NVML sample of one GPU, through an injected pynvml-compatible module.

Every feature is optional and every error has one reaction (``nvml_errors``): a feature the GPU
does not offer us (NotSupported, NoPermission, Deprecated, a missing versioned symbol) is left out
and not asked again until NVML is initialised again; any other refusal of an optional query leaves
its series out and is counted by query. Only a lost, hung or unknown state, or a failed core query
(handle, identity), marks the GPU down.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuhealth.exporter.inventory import GpuIdentity
from gpuhealth.exporter.metrics import LEGACY_NVLINK_ERROR_TYPES, RECOVERY_ACTIONS, REMAP_AVAILABILITY
from gpuhealth.exporter.nvml_errors import (
    UNCOUNTED,
    GpuDown,
    NvmlDown,
    Reaction,
    error_label,
    query_name,
    reaction,
)
from gpuhealth.exporter.nvml_fields import (
    DEVICE_FIELDS,
    LINK_FIELDS,
    RECOVERY_ACTION_FIELD,
    FieldSpec,
    answers,
    ber,
    value_members,
)

# (spec, scope, field id, label values after gpu) of one field value to ask; spec None: the recovery action
FieldRequest = tuple["FieldSpec | None", int, int, tuple[str, ...]]

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
FABRIC_STATES = ("not_supported", "not_started", "in_progress", "completed")
ECC_LOCATIONS = ("dram", "sram")


@dataclass
class GpuReading:
    """Instant values by metric name (labels after ``gpu``) plus what the derived features need."""

    samples: list[tuple[str, tuple[str, ...], float]] = field(default_factory=list)
    slow: list[tuple[str, tuple[str, ...], float]] = field(default_factory=list)  # only when ``full``
    full: bool = True
    temperature: float | None = None
    slowdown_threshold: float | None = None
    clock_events: dict[str, bool] = field(default_factory=dict)
    driver_clock_event_reasons: set[str] = field(default_factory=set)  # timed by the driver's counters
    recovery_action: str | None = None
    pids: list[int] = field(default_factory=list)
    errors: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)  # error, query

    def add(self, name: str, value: float | None, *labels: str) -> None:
        if value is not None:
            self.samples.append((name, labels, float(value)))


def _field_labels(spec: FieldSpec, scope: int) -> tuple[str, ...]:
    return (str(scope), *spec.labels) if spec.per_link else spec.labels


def _stable(value: Any) -> Any:
    return value if isinstance(value, int | float | str) else type(value).__name__


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Reads GPUs through ``nvml``; remembers what each GPU does not offer until ``forget()``."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._absent: set[tuple[Any, ...]] = set()   # (gpu, query, args) and (gpu, "field", field id, scope)
        self._links: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self._reasons = {label: getattr(nvml, f"nvmlClocksEventReason{suffix}")
                         for label, suffix in CLOCK_EVENT_REASONS.items()}
        # field ids and value types resolved once: a sample asks for hundreds of fields
        self._device_fields = [(spec, getattr(nvml, spec.field)) for spec in DEVICE_FIELDS]
        self._link_fields = [(spec, getattr(nvml, spec.field)) for spec in LINK_FIELDS]
        self._recovery_field = getattr(nvml, RECOVERY_ACTION_FIELD)
        self._value_members = value_members(nvml)
        self._success = nvml.NVML_SUCCESS
        self._requests: dict[int, tuple[int, list[FieldRequest]]] = {}
        self._absent_version = 0

    def forget(self) -> None:
        """After NVML was initialised again (a driver reload): ask every feature afresh."""
        with self._lock:
            self._absent.clear()
            self._links.clear()
            self._absent_version += 1

    @staticmethod
    def _key(index: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
        """What identifies a query: the function and its plain arguments (args[0] is the handle; an
        output buffer such as ``byref(struct)`` or a list of fields counts by its type)."""
        return index, getattr(fn, "__name__", fn), tuple(map(_stable, args[1:]))

    def _is_absent(self, index: int, fn: Callable[..., Any], *args: Any) -> bool:
        return self._key(index, fn, args) in self._absent

    def ask(self, r: GpuReading | None, index: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` for an optional feature, or None when it is absent or refused this time."""
        key = self._key(index, fn, args)
        if key in self._absent:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            how = reaction(self.nvml, exc)
            if how is None:
                raise
            label, query = error_label(exc), query_name(fn)
            if how is Reaction.GPU_DOWN:
                raise GpuDown(label, query) from exc
            if how is Reaction.NVML_DOWN:
                raise NvmlDown(label, query) from exc
            if how is Reaction.ABSENT:
                self._remember_absent(key)
            if r is not None and label not in UNCOUNTED:
                r.errors[(label, query)] += 1
            return None

    def _remember_absent(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            self._absent.add(key)
            self._absent_version += 1

    def core(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A query without which the GPU cannot be sampled: any NVML error marks the GPU down."""
        try:
            return fn(*args)
        except Exception as exc:
            how = reaction(self.nvml, exc)
            if how is None:
                raise
            cls = NvmlDown if how is Reaction.NVML_DOWN else GpuDown
            raise cls(error_label(exc), query_name(fn)) from exc

    def identity(self, index: int) -> GpuIdentity:
        nvml, core = self.nvml, self.core
        handle = core(nvml.nvmlDeviceGetHandleByIndex, index)
        pci = core(nvml.nvmlDeviceGetPciInfo, handle)
        return GpuIdentity(
            index=index,
            uuid=_text(core(nvml.nvmlDeviceGetUUID, handle)),
            pci_bus_id=_text(pci.busId).upper(),
            model=_text(core(nvml.nvmlDeviceGetName, handle)),
            serial=_text(self.ask(None, index, nvml.nvmlDeviceGetSerial, handle) or ""),
            vbios_version=_text(self.ask(None, index, nvml.nvmlDeviceGetVbiosVersion, handle) or ""),
        )

    def read(self, index: int, full: bool = True) -> GpuReading:
        """Every second the fast-moving values; with ``full``, also the counters, health and link
        state (``slow``), which change slowly and cost most of a sample (see FULL_EVERY_SECONDS)."""
        nvml = self.nvml
        handle = self.core(nvml.nvmlDeviceGetHandleByIndex, index)
        r = GpuReading(full=full)

        def opt(fn: Callable[..., Any], *args: Any) -> Any:
            return self.ask(r, index, fn, handle, *args)

        r.temperature = self._temperature(r, index, handle)
        r.add("gpuhealth_gpu_temperature_celsius", r.temperature)
        power = opt(nvml.nvmlDeviceGetPowerUsage)
        r.add("gpuhealth_gpu_power_watts", None if power is None else power / 1000)
        limit = opt(nvml.nvmlDeviceGetEnforcedPowerLimit)
        r.add("gpuhealth_gpu_power_limit_watts", None if limit is None else limit / 1000)
        for name, clock in (("sm", nvml.NVML_CLOCK_SM), ("memory", nvml.NVML_CLOCK_MEM)):
            mhz = opt(nvml.nvmlDeviceGetClockInfo, clock)
            r.add(f"gpuhealth_gpu_{name}_clock_hertz", None if mhz is None else mhz * 1e6)
        self._clock_events(r, opt)
        util = opt(nvml.nvmlDeviceGetUtilizationRates)
        if util is not None:
            r.add("gpuhealth_gpu_utilization_ratio", util.gpu / 100)
            r.add("gpuhealth_gpu_memory_utilization_ratio", util.memory / 100)
        self._memory(r, index, opt)
        procs = opt(nvml.nvmlDeviceGetComputeRunningProcesses)
        if procs is not None:
            r.pids = [p.pid for p in procs]
            r.add("gpuhealth_gpu_processes", len(procs))
        if full:
            fast = len(r.samples)
            self._slow(r, index, handle, opt, busy=None if util is None else util.gpu > 0)
            r.samples, r.slow = r.samples[:fast], r.samples[fast:]
        return r

    def _slow(self, r: GpuReading, index: int, handle: Any, opt: Callable[..., Any],
              busy: bool | None) -> None:
        nvml = self.nvml
        r.slowdown_threshold = opt(nvml.nvmlDeviceGetTemperatureThreshold,
                                   nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        r.add("gpuhealth_gpu_temperature_slowdown_threshold_celsius", r.slowdown_threshold)
        r.add("gpuhealth_gpu_temperature_shutdown_threshold_celsius",
              opt(nvml.nvmlDeviceGetTemperatureThreshold, nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN))
        r.add("gpuhealth_gpu_memory_temperature_threshold_celsius",
              opt(nvml.nvmlDeviceGetTemperatureThreshold, nvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX))
        for name, clock in (("sm", nvml.NVML_CLOCK_SM), ("memory", nvml.NVML_CLOCK_MEM)):
            mhz = opt(nvml.nvmlDeviceGetMaxClockInfo, clock)
            r.add(f"gpuhealth_gpu_{name}_clock_max_hertz", None if mhz is None else mhz * 1e6)
        self._memory_errors(r, opt)
        self._pcie(r, opt, busy)
        links = self._discover_links(index, handle)
        for link in links:
            state = opt(nvml.nvmlDeviceGetNvLinkState, link)
            if state is not None:
                r.add("gpuhealth_gpu_nvlink_up", int(state == nvml.NVML_FEATURE_ENABLED), str(link))
        if not self._field_values(r, index, handle, links):  # no NVLink counter among the fields
            self._legacy_nvlink(r, opt, links)
        self._fabric(r, opt)

    def _temperature(self, r: GpuReading, index: int, handle: Any) -> float | None:
        """``nvmlDeviceGetTemperatureV`` (current); the deprecated call only where V is missing."""
        nvml = self.nvml
        for fn in (nvml.nvmlDeviceGetTemperatureV, nvml.nvmlDeviceGetTemperature):
            value: float | None = self.ask(r, index, fn, handle, nvml.NVML_TEMPERATURE_GPU)
            if value is not None or not self._is_absent(index, fn, handle, nvml.NVML_TEMPERATURE_GPU):
                return value
        return None

    def _clock_events(self, r: GpuReading, opt: Callable[..., Any]) -> None:
        nvml = self.nvml
        mask = opt(nvml.nvmlDeviceGetCurrentClocksEventReasons)
        if mask is None:  # drivers before 535 know only the older name
            mask = opt(nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        if mask is None:
            return
        for label, bit in self._reasons.items():
            r.clock_events[label] = bool(mask & bit)
            r.add("gpuhealth_gpu_clock_event_active", int(r.clock_events[label]), label)

    def _memory(self, r: GpuReading, index: int, opt: Callable[..., Any]) -> None:
        """Memory info v2 counts driver-reserved memory apart from used; v1 where v2 is missing."""
        nvml = self.nvml
        memory = opt(nvml.nvmlDeviceGetMemoryInfo, nvml.nvmlMemory_v2)
        if memory is None and self._is_absent(index, nvml.nvmlDeviceGetMemoryInfo, None, nvml.nvmlMemory_v2):
            memory = opt(nvml.nvmlDeviceGetMemoryInfo)
        if memory is not None:
            r.add("gpuhealth_gpu_memory_used_bytes", memory.used)
            r.add("gpuhealth_gpu_memory_total_bytes", memory.total)

    def _memory_errors(self, r: GpuReading, opt: Callable[..., Any]) -> None:
        nvml = self.nvml
        modes = opt(nvml.nvmlDeviceGetEccMode)
        if modes is not None:
            current, pending = modes
            r.add("gpuhealth_gpu_ecc_enabled", int(current == nvml.NVML_FEATURE_ENABLED))
            r.add("gpuhealth_gpu_ecc_pending_enabled", int(pending == nvml.NVML_FEATURE_ENABLED))
        types = (("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                 ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))
        counters = (("volatile", nvml.NVML_VOLATILE_ECC), ("aggregate", nvml.NVML_AGGREGATE_ECC))
        for type_label, error_type in types:
            for counter_label, counter in counters:
                r.add("gpuhealth_gpu_ecc_errors_total",
                      opt(nvml.nvmlDeviceGetTotalEccErrors, error_type, counter), type_label, counter_label)
                for location in ECC_LOCATIONS:
                    r.add("gpuhealth_gpu_ecc_location_errors_total",
                          opt(nvml.nvmlDeviceGetMemoryErrorCounter, error_type, counter,
                              getattr(nvml, f"NVML_MEMORY_LOCATION_{location.upper()}")),
                          type_label, counter_label, location)
        causes = (("single_bit", nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
                  ("double_bit", nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
        for cause_label, cause in causes:
            pages = opt(nvml.nvmlDeviceGetRetiredPages, cause)
            r.add("gpuhealth_gpu_retired_pages", None if pages is None else len(pages), cause_label)
        r.add("gpuhealth_gpu_retired_pages_pending", opt(nvml.nvmlDeviceGetRetiredPagesPendingStatus))
        remapped = opt(nvml.nvmlDeviceGetRemappedRows)
        if remapped is not None:
            correctable, uncorrectable, pending, failure = remapped
            r.add("gpuhealth_gpu_remapped_rows", correctable, "correctable")
            r.add("gpuhealth_gpu_remapped_rows", uncorrectable, "uncorrectable")
            r.add("gpuhealth_gpu_remap_pending", int(bool(pending)))
            r.add("gpuhealth_gpu_remap_failure", int(bool(failure)))
        histogram = opt(nvml.nvmlDeviceGetRowRemapperHistogram)
        if histogram is not None:
            for label in REMAP_AVAILABILITY:
                r.add("gpuhealth_gpu_row_remap_availability_banks", getattr(histogram, label), label)

    def _pcie(self, r: GpuReading, opt: Callable[..., Any], busy: bool | None) -> None:
        nvml = self.nvml
        r.add("gpuhealth_gpu_pcie_replays_total", opt(nvml.nvmlDeviceGetPcieReplayCounter))
        gen = opt(nvml.nvmlDeviceGetCurrPcieLinkGeneration)
        gen_max = opt(nvml.nvmlDeviceGetMaxPcieLinkGeneration)
        width = opt(nvml.nvmlDeviceGetCurrPcieLinkWidth)
        width_max = opt(nvml.nvmlDeviceGetMaxPcieLinkWidth)
        r.add("gpuhealth_gpu_pcie_link_generation", gen)
        r.add("gpuhealth_gpu_pcie_link_generation_max", gen_max)
        r.add("gpuhealth_gpu_pcie_link_width_lanes", width)
        r.add("gpuhealth_gpu_pcie_link_width_max_lanes", width_max)
        if None not in (gen, gen_max, width, width_max):
            # An idle GPU lowers its link generation to save power: only a GPU known to be busy is
            # downgraded by generation (MIG mode reports no utilisation: that is not "busy").
            downgraded = width < width_max or (busy is True and gen < gen_max)
            r.add("gpuhealth_gpu_pcie_link_downgraded", int(downgraded))

    def _discover_links(self, index: int, handle: Any) -> list[int]:
        """The GPU's NVLinks, probed once (up to NVML_NVLINK_MAX_LINKS: 36 in NVML 13)."""
        nvml = self.nvml
        with self._lock:
            known = self._links.get(index)
        if known is None:
            known = [link for link in range(nvml.NVML_NVLINK_MAX_LINKS)
                     if self._link_state(index, handle, link) is not None]
            with self._lock:
                self._links[index] = known
        return known

    def _link_state(self, index: int, handle: Any, link: int) -> int | None:
        """Probing: a link number past the GPU's last answers InvalidArgument (or NotSupported)."""
        try:
            state: int = self.nvml.nvmlDeviceGetNvLinkState(handle, link)
            return state
        except Exception as exc:
            how = reaction(self.nvml, exc)
            if how is None:
                raise
            if how in (Reaction.GPU_DOWN, Reaction.NVML_DOWN):
                cls = NvmlDown if how is Reaction.NVML_DOWN else GpuDown
                raise cls(error_label(exc), "nv_link_state") from exc
            return None

    def _field_requests(self, index: int, links: list[int]) -> list[FieldRequest]:
        """The field values still worth asking this GPU, with their label values.

        Rebuilt only when something became absent: a sample reads the cached list.
        """
        with self._lock:
            cached = self._requests.get(index)
            if cached is not None and cached[0] == self._absent_version:
                return cached[1]
            everything: list[FieldRequest] = [
                *((spec, 0, field_id, _field_labels(spec, 0)) for spec, field_id in self._device_fields),
                (None, 0, self._recovery_field, ()),
                *((spec, link, field_id, _field_labels(spec, link))
                  for link in links for spec, field_id in self._link_fields)]
            requests = [q for q in everything if (index, "field", q[2], q[1]) not in self._absent]
            self._requests[index] = (self._absent_version, requests)
            return requests

    def _field_values(self, r: GpuReading, index: int, handle: Any, links: list[int]) -> bool:
        """Every field value in one call; pairs the GPU does not support are left out from then on.
        True when an NVLink error counter answered (the per-GPU total is then published)."""
        nvml = self.nvml
        requests = self._field_requests(index, links)
        if not requests:
            return False
        pairs = [(field_id, scope) for _, scope, field_id, _ in requests]  # pynvml's (field, scope) form
        values = self.ask(r, index, nvml.nvmlDeviceGetFieldValues, handle, pairs)
        if values is None:
            return False
        total: float | None = None
        for (spec, scope, field_id, labels), (code, number) in zip(
                requests, answers(values, self._value_members), strict=True):
            if code != self._success:
                exc = nvml.NVMLError(code)  # pynvml picks the subclass for the code
                if reaction(nvml, exc) is Reaction.ABSENT:
                    self._remember_absent((index, "field", field_id, scope))
                if error_label(exc) not in UNCOUNTED:
                    r.errors[(error_label(exc), "field_values")] += 1
                continue
            if spec is None:
                if 0 <= number < len(RECOVERY_ACTIONS):
                    r.recovery_action = RECOVERY_ACTIONS[int(number)]
                continue
            if spec.metric == "gpuhealth_gpu_nvlink_bit_error_rate":
                number = ber(number)
            r.add(spec.metric, number * spec.scale, *labels)
            if spec.metric == "gpuhealth_gpu_clock_event_seconds_total":
                r.driver_clock_event_reasons.add(spec.labels[0])
            if spec.in_link_total:
                total = (total or 0) + number
        if total is not None:
            r.add("gpuhealth_gpu_nvlink_errors_all_links_total", total)
        return total is not None

    def _legacy_nvlink(self, r: GpuReading, opt: Callable[..., Any], links: list[int]) -> None:
        """Before Hopper's field values: ``nvmlDeviceGetNvLinkErrorCounter`` (gone on Blackwell)."""
        nvml = self.nvml
        total: float | None = None
        for link in links:
            for type_label in LEGACY_NVLINK_ERROR_TYPES:  # crc_flit -> NVML_NVLINK_ERROR_DL_CRC_FLIT, ...
                counter = getattr(nvml, f"NVML_NVLINK_ERROR_DL_{type_label.upper()}")
                value = opt(nvml.nvmlDeviceGetNvLinkErrorCounter, link, counter)
                r.add("gpuhealth_gpu_nvlink_errors_total", value, str(link), type_label)
                if value is not None:
                    total = (total or 0) + value
        # One series per GPU for the rules, instead of 18 links x 4 types: a fleet-wide rate reads
        # 16,384 series at 2,048 nodes, not 1.2 million. The per-link series say which link.
        r.add("gpuhealth_gpu_nvlink_errors_all_links_total", total)

    def _fabric(self, r: GpuReading, opt: Callable[..., Any]) -> None:
        """NVLink fabric (NVSwitch, IMEX) registration state and health, where the GPU has one."""
        nvml = self.nvml
        info = nvml.c_nvmlGpuFabricInfoV_t()
        if opt(nvml.nvmlDeviceGetGpuFabricInfoV, ctypes.byref(info)) is None:
            return
        if info.state == nvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
            return
        for value, state in enumerate(FABRIC_STATES):
            r.add("gpuhealth_gpu_fabric_state", int(info.state == value), state)
        r.add("gpuhealth_gpu_fabric_status_ok", int(info.status == nvml.NVML_SUCCESS))
        degraded = (info.healthMask >> nvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW) \
            & nvml.NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW
        if degraded != nvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_NOT_SUPPORTED:
            r.add("gpuhealth_gpu_fabric_bandwidth_degraded",
                  int(degraded == nvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE))
