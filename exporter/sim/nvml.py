"""A pynvml-compatible module backed by the simulated node.

Only the calls the exporter makes exist. Return values are pynvml's own ctypes structures and
errors are pynvml's own exception classes, so the collectors' ``except pynvml.NVMLError_...``
clauses behave exactly as on real hardware.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
from gpuhealth.exporter.sim.fabric import Fabric
from gpuhealth.exporter.sim.gpu import (
    MEM_CLOCK_MAX,
    PCIE_GEN,
    PCIE_WIDTH,
    SHUTDOWN_C,
    SLOWDOWN_C,
    SM_CLOCK_MAX,
    GpuState,
    Node,
    ResetRefused,
)
from gpuhealth.exporter.sim.kmsg_writer import KmsgWriter
from gpuhealth.exporter.sim.nvml_current import MEMORY_MAX_OPERATING_C, NvmlCurrent, wrap_queries
from gpuhealth.exporter.sim.profiles import Profile
from gpuhealth.exporter.sim.scenario import Scenario, ScenarioError
from gpuhealth.exporter.sim.sysfs_tree import SysfsTree

HANG_SECONDS = 30.0  # how long a call on a GPU hung by a GSP timeout blocks before failing


class SimHandle:
    """Device handle; like NVML's, only meaningful to the module that issued it."""

    def __init__(self, index: int) -> None:
        self.index = index


class _EventSet:
    def __init__(self) -> None:
        self.devices: set[int] = set()
        self.pending: collections.deque[tuple[int, int]] = collections.deque()


@wrap_queries
class SimulatedNvml(NvmlCurrent):
    """Stands in for the ``pynvml`` module. Constants and exception classes come from pynvml itself."""

    def __init__(self, scenario: Scenario, kmsg_path: Path | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, profile: Profile | None = None,
                 mig: bool = False, sysfs: Path | None = None) -> None:
        """``sysfs``: a private directory where the node's PCI tree and InfiniBand ports are written."""
        self._setup_current(profile, mig)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.RLock()
        self._writer = KmsgWriter(kmsg_path) if kmsg_path else None
        self._event_sets: list[_EventSet] = []
        self._node = Node(scenario, self._emit)
        self.fabric = Fabric(self.profile.nics if scenario.nics is None else scenario.nics, self._emit)
        self._load_fabric(scenario)
        self._tree = None if sysfs is None else SysfsTree(
            sysfs, [gpu.pci_bus_id for gpu in self._node.gpus], self.fabric, self.profile.fabric_manager)
        self._start = clock()
        self._advanced_to: float | None = None
        self._initialised = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML", "nvmlClocks", "nvmlEventType", "c_nvml", "nvmlMemory_v",
                            "nvmlTemperature_v")):
            return getattr(pynvml, name)
        raise AttributeError(f"the NVML simulator does not implement {name}")

    # scenario control
    def reload(self, scenario: Scenario) -> None:
        """Replace the faults; their times count from now. GPUs come back as after a reset."""
        with self._lock:
            self._advance()
            if scenario.gpus != len(self._node.gpus):
                raise ValueError(f"a reload cannot change the GPU count ({len(self._node.gpus)} -> "
                                 f"{scenario.gpus}); restart the exporter")
            self._load_fabric(scenario)
            self._node.load(scenario)
            self._start = self._clock()
            self._advanced_to = None

    def reset_gpu(self, gpu: str) -> str:
        """Reset one GPU, named by index or UUID, as ``nvidia-smi -r -i GPU`` would (``Node.reset_gpu``);
        what nvidia-smi prints. Raises ``ResetRefused`` when the reset fails."""
        with self._lock:
            self._advance()
            index = self.gpu_index(gpu)
            self._node.reset_gpu(index)
            return f"GPU {self._node.gpus[index].pci_bus_id} was successfully reset."

    def gpu_index(self, gpu: str) -> int:
        """The index of the GPU named by index or UUID, as ``nvidia-smi -i`` takes it; ``ResetRefused``
        for a GPU this node does not have."""
        uuids = [self._uuid(index) for index in range(len(self._node.gpus))]
        if gpu.isdecimal() and int(gpu) < len(uuids):
            return int(gpu)
        if gpu in uuids:
            return uuids.index(gpu)
        raise ResetRefused(f"no GPU {gpu!r} on this node (indices 0-{len(uuids) - 1} or GPU-<uuid>)")

    @property
    def fabric_manager_pid_file(self) -> Path | None:
        """Where the simulated fabric manager's pid is, None on a profile without one."""
        return self._tree.pid_file if self._tree is not None and self.profile.fabric_manager else None

    def _load_fabric(self, scenario: Scenario) -> None:
        count = len(self.fabric.nics)
        missing = [f"faults[{i}].nic: NIC {fault.params['nic']} does not exist (the node has {count})"
                   for i, fault in enumerate(scenario.faults) if fault.params.get("nic", -1) >= count]
        if missing:
            raise ScenarioError("scenario", missing)
        self.fabric.load(scenario.faults)

    def _emit(self, index: int, text: str, xid: int | None) -> None:
        if self._writer is not None:
            self._writer.write(text)
        if xid is not None:
            for event_set in self._event_sets:
                if index in event_set.devices:
                    event_set.pending.append((index, xid))

    def _advance(self) -> None:
        """Move the node to now; calls within a millisecond share one step (a sample is ~60 calls)."""
        t = self._clock() - self._start
        if self._advanced_to is None or abs(t - self._advanced_to) >= 0.001:
            self._node.advance(t)
            self.fabric.advance(t)
            if self._tree is not None:
                self._tree.write(t)
            self._advanced_to = t

    def _gpu(self, handle: SimHandle) -> GpuState:
        if not self._initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        with self._lock:
            self._advance()
            gpu = self._node.gpus[handle.index]
        if gpu.hung:
            self._sleep(HANG_SECONDS)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    # library
    def nvmlInit(self) -> None:
        self._init_check()
        self._initialised = True

    def nvmlShutdown(self) -> None:
        self._initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._node.scenario.driver_version

    def nvmlDeviceGetCount(self) -> int:
        with self._lock:
            self._advance()  # the fabric moves even when only the inventory asks
        return len(self._node.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimHandle:
        if not 0 <= index < len(self._node.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        handle = SimHandle(index)
        self._gpu(handle)
        return handle

    def nvmlDeviceGetIndex(self, handle: SimHandle) -> int:
        return handle.index

    # identity
    def nvmlDeviceGetUUID(self, handle: SimHandle) -> str:
        self._gpu(handle)
        return self._uuid(handle.index)

    def _uuid(self, index: int) -> str:
        return f"GPU-{uuid.UUID(int=(self._node.scenario.seed << 16) + index + 0x5EED)}"

    def nvmlDeviceGetName(self, handle: SimHandle) -> str:
        self._gpu(handle)
        return self._node.scenario.model

    def nvmlDeviceGetSerial(self, handle: SimHandle) -> str:
        self._gpu(handle)
        return f"16549220{handle.index:05d}"

    def nvmlDeviceGetVbiosVersion(self, handle: SimHandle) -> str:
        self._gpu(handle)
        return "96.00.89.00.01"

    def nvmlDeviceGetPciInfo(self, handle: SimHandle) -> pynvml.nvmlPciInfo_t:
        gpu = self._gpu(handle)
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.pci_bus_id.encode()
        info.pciDeviceId = self.profile.pci_device_id
        return info

    # thermals, power, clocks
    def nvmlDeviceGetTemperature(self, handle: SimHandle, sensor: int) -> int:
        gpu = self._gpu(handle)
        if gpu.nvml_delay:
            self._sleep(gpu.nvml_delay)
        return round(gpu.temperature)

    def nvmlDeviceGetTemperatureThreshold(self, handle: SimHandle, threshold: int) -> int:
        self._gpu(handle)
        values = {pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: SLOWDOWN_C,
                  pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: SHUTDOWN_C,
                  pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: MEMORY_MAX_OPERATING_C}
        if threshold not in values:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(values[threshold])

    def nvmlDeviceGetPowerUsage(self, handle: SimHandle) -> int:
        return int(self._gpu(handle).power_watts * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: SimHandle) -> int:
        return int(self._gpu(handle).power_limit_watts * 1000)

    def nvmlDeviceGetClockInfo(self, handle: SimHandle, clock_type: int) -> int:
        gpu = self._gpu(handle)
        return int(gpu.sm_clock) if clock_type == pynvml.NVML_CLOCK_SM else MEM_CLOCK_MAX

    def nvmlDeviceGetMaxClockInfo(self, handle: SimHandle, clock_type: int) -> int:
        self._gpu(handle)
        return SM_CLOCK_MAX if clock_type == pynvml.NVML_CLOCK_SM else MEM_CLOCK_MAX

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: SimHandle) -> int:
        return self._gpu(handle).reasons

    nvmlDeviceGetCurrentClocksThrottleReasons = nvmlDeviceGetCurrentClocksEventReasons

    def nvmlDeviceGetUtilizationRates(self, handle: SimHandle) -> pynvml.c_nvmlUtilization_t:
        gpu = self._gpu(handle)
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu, rates.memory = round(gpu.utilization * 100), round(gpu.memory_utilization * 100)
        return rates

    # memory errors
    def nvmlDeviceGetTotalEccErrors(self, handle: SimHandle, error_type: int, counter_type: int) -> int:
        gpu = self._gpu(handle)
        corrected = error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        volatile = counter_type == pynvml.NVML_VOLATILE_ECC
        name = f"ecc_{'corrected' if corrected else 'uncorrected'}_{'volatile' if volatile else 'aggregate'}"
        return int(getattr(gpu, name))

    def nvmlDeviceGetRetiredPages(self, handle: SimHandle, cause: int) -> list[int]:
        gpu = self._gpu(handle)
        self._page_retirement_supported()
        count = gpu.retired_double_bit if cause else gpu.retired_single_bit
        return [0x1000 * (i + 1) for i in range(count)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: SimHandle) -> int:
        gpu = self._gpu(handle)
        self._page_retirement_supported()
        return gpu.retired_pending

    def _page_retirement_supported(self) -> None:
        """Since Ampere, HBM errors are handled by row remapping; page retirement is not supported."""
        if "V100" not in self._node.scenario.model:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetRemappedRows(self, handle: SimHandle) -> tuple[int, int, int, int]:
        gpu = self._gpu(handle)
        return (int(gpu.remapped_correctable), gpu.remapped_uncorrectable, gpu.remap_pending,
                gpu.remap_failure)

    def nvmlDeviceGetRowRemapperHistogram(self, handle: SimHandle) -> pynvml.c_nvmlRowRemapperHistogramValues:
        gpu = self._gpu(handle)
        values = pynvml.c_nvmlRowRemapperHistogramValues()
        for name, count in gpu.histogram().items():
            setattr(values, name, count)
        return values

    # PCIe
    def nvmlDeviceGetPcieReplayCounter(self, handle: SimHandle) -> int:
        return int(self._gpu(handle).pcie_replays)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: SimHandle) -> int:
        return self._gpu(handle).pcie_gen

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: SimHandle) -> int:
        self._gpu(handle)
        return PCIE_GEN

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: SimHandle) -> int:
        return self._gpu(handle).pcie_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: SimHandle) -> int:
        self._gpu(handle)
        return PCIE_WIDTH

    # NVLink
    def _link(self, handle: SimHandle, link: int) -> GpuState:
        gpu = self._gpu(handle)
        if not 0 <= link < gpu.nvlinks:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def nvmlDeviceGetNvLinkState(self, handle: SimHandle, link: int) -> int:
        gpu = self._link(handle, link)
        state: int = pynvml.NVML_FEATURE_DISABLED if link in gpu.nvlink_down else pynvml.NVML_FEATURE_ENABLED
        return state

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: SimHandle, link: int, counter: int) -> int:
        gpu = self._link(handle, link)
        kind = {pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
                pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
                pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
                pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery"}
        if counter not in kind:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(gpu.nvlink_errors.get((link, kind[counter]), 0))

    # processes
    def nvmlDeviceGetComputeRunningProcesses(self, handle: SimHandle) -> list[pynvml.nvmlFriendlyObject]:
        gpu = self._gpu(handle)
        return [pynvml.nvmlFriendlyObject({"pid": p.pid, "usedGpuMemory": p.memory_bytes})
                for p in self._node.scenario.processes if gpu.index in p.gpus]

    # events
    def nvmlEventSetCreate(self) -> _EventSet:
        event_set = _EventSet()
        self._event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: SimHandle, event_types: int, event_set: _EventSet) -> None:
        self._gpu(handle)
        event_set.devices.add(handle.index)

    def nvmlEventSetWait(self, event_set: _EventSet, timeout_ms: int) -> _Event:
        with self._lock:
            self._advance()
            if not event_set.pending:
                if any(self._node.gpus[i].lost for i in event_set.devices):  # as real NVML: until freed
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            index, xid = event_set.pending.popleft()
        return _Event(SimHandle(index), xid)

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        if event_set in self._event_sets:
            self._event_sets.remove(event_set)


class _Event:
    """Event data shaped like ``c_nvmlEventData_t``, whose ``device`` is a simulator handle."""

    eventType = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self, handle: SimHandle, xid: int) -> None:
        self.device = handle
        self.eventData = xid
