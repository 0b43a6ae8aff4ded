"""The simulator's side of current NVML: profiles, MIG mode, field values with scopes, the driver's
lifetime (absent, reloaded) and node-wide stalls.

Kept apart from the per-GPU state machine in ``nvml.py``; ``SimulatedNvml`` mixes it in.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pynvml
from gpuhealth.exporter.sim.profiles import (
    DEFAULT_PROFILE,
    MIG_NO_PERMISSION,
    MIG_NOT_SUPPORTED,
    PROFILES,
    Profile,
)

if TYPE_CHECKING:
    from gpuhealth.exporter.sim.gpu import GpuState, Node

NVLINK_DL_FIELDS = {pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC: ("crc_flit", "crc_data"),
                    pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY: ("replay",),
                    pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY: ("recovery",)}
NVLINK5_FIELDS = {pynvml.NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_ERRORS: ("crc_data", "replay"),
                  pynvml.NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS: ("crc_flit",),
                  pynvml.NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS: ("crc_data",),
                  pynvml.NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_SUCCESSFUL_EVENTS: ("recovery",),
                  pynvml.NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS: ()}
NVLINK5_BER = (pynvml.NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_BER, pynvml.NVML_FI_DEV_NVLINK_COUNT_SYMBOL_BER)
PCIE_FIELDS = {pynvml.NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS,
               pynvml.NVML_FI_DEV_PCIE_COUNT_NON_FATAL_ERROR, pynvml.NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR,
               pynvml.NVML_FI_DEV_PCIE_COUNT_UNSUPPORTED_REQ}
MEMORY_MAX_OPERATING_C = 95
RECOVERY_ACTION_DRIVER = 565  # first driver branch with NVML_FI_DEV_GET_GPU_RECOVERY_ACTION


def refusable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Applies the driver state, profile and MIG mode before the simulated query runs."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: NvmlCurrent, *args: Any, **kwargs: Any) -> Any:
        self._driver_check(name)
        if name in self.profile.unsupported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if self.mig and name in MIG_NOT_SUPPORTED:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if self.mig and name in MIG_NO_PERMISSION:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        if name in self.inject:
            raise self.inject[name]
        return fn(self, *args, **kwargs)
    return wrapper


class NvmlCurrent:
    """Mixin: needs ``_gpu(handle)`` and ``_node`` from SimulatedNvml."""

    if TYPE_CHECKING:  # what SimulatedNvml provides
        _initialised: bool
        _node: Node

        def _gpu(self, handle: Any) -> GpuState: ...
        def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
        def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int: ...

    profile: Profile = PROFILES[DEFAULT_PROFILE]
    mig = False

    def _setup_current(self, profile: Profile | None, mig: bool) -> None:
        self.profile = profile or PROFILES[DEFAULT_PROFILE]
        self.mig = mig
        self.driver_loaded = True       # False: nvmlInit fails with DriverNotLoaded
        self.driver_reloaded = False    # True: every call fails with LibRmVersionMismatch until nvmlInit
        self.inject: dict[str, BaseException] = {}  # function name -> error it raises (tests)
        self._stall_until = 0.0
        self._stall_lock = threading.Lock()

    # driver lifetime and node-wide stalls
    def stall(self, seconds: float) -> None:
        """Every NVML call blocks for ``seconds`` from now, on every GPU: a GSP stall of the driver."""
        with self._stall_lock:
            self._stall_until = time.monotonic() + seconds

    def _driver_check(self, name: str) -> None:
        if not self._initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if self.driver_reloaded:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
        remaining = self._stall_until - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def _init_check(self) -> None:
        if not self.driver_loaded:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self.driver_reloaded = False

    # queries of current drivers
    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int,
                                  version: int = pynvml.nvmlTemperature_v1) -> int:
        return self.nvmlDeviceGetTemperature(handle, sensor)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu = self._gpu(handle)
        memory = pynvml.c_nvmlMemory_v2_t() if version else pynvml.c_nvmlMemory_t()
        total = self.profile.memory_bytes
        processes = [p for p in self._node.scenario.processes if gpu.index in p.gpus]
        if processes:
            used = sum(p.memory_bytes for p in processes)
        else:  # an anonymous training job holds most of the memory while the GPU is busy
            used = int(total * 0.7) if gpu.utilization > 0 else 0
        reserved = 512 * 1024 * 1024
        if version:  # v2 reports the driver's reservation apart; v1 counts it as used
            memory.version, memory.total, memory.reserved, memory.used = version, total, reserved, used
            memory.free = total - reserved - used
        else:
            memory.total, memory.used, memory.free = total, used + reserved, total - used - reserved
        return memory

    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        self._gpu(handle)
        return [pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_ENABLED]

    def nvmlDeviceGetMemoryErrorCounter(self, handle: Any, error_type: int, counter_type: int,
                                        location: int) -> int:
        if location == pynvml.NVML_MEMORY_LOCATION_SRAM:
            self._gpu(handle)
            return 0
        if location != pynvml.NVML_MEMORY_LOCATION_DRAM:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type)

    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, info: Any) -> int:
        self._gpu(device)
        if not self.profile.fabric:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        struct = info._obj if hasattr(info, "_obj") else info  # ctypes.byref(struct), as pynvml takes it
        struct.state = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
        struct.status = pynvml.NVML_SUCCESS
        struct.healthMask = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[Any]) -> Any:
        """Field ids or ``(field id, scope)`` pairs, exactly as pynvml takes them."""
        gpu = self._gpu(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for value, requested in zip(values, field_ids, strict=True):
            try:
                value.fieldId, value.scopeId = requested
            except TypeError:
                value.fieldId = requested
            number = self._field(gpu, value.fieldId, value.scopeId)
            if number is None:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            elif isinstance(number, float):
                value.valueType, value.value.dVal = pynvml.NVML_VALUE_TYPE_DOUBLE, number
            else:
                value.valueType, value.value.ullVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, number
        return values

    def _field(self, gpu: GpuState, field_id: int, scope: int) -> int | float | None:
        generation = self.profile.nvlink_generation
        if field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            return round(gpu.memory_temperature)
        if field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:  # R565 and later
            major = int(self._node.scenario.driver_version.split(".")[0] or 0)
            return gpu.recovery_action if major >= RECOVERY_ACTION_DRIVER else None
        if field_id in PCIE_FIELDS:
            correctable = field_id == pynvml.NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS
            return int(gpu.pcie_replays // 100) if correctable else 0
        link_fields = NVLINK_DL_FIELDS if generation == 4 else NVLINK5_FIELDS
        if field_id in link_fields and 0 <= scope < gpu.nvlinks:
            return int(sum(gpu.nvlink_errors.get((scope, kind), 0) for kind in link_fields[field_id]))
        if generation == 5 and field_id in NVLINK5_BER and 0 <= scope < gpu.nvlinks:
            errors = gpu.nvlink_errors.get((scope, "crc_flit"), 0)
            exponent = 15 if errors == 0 else 9
            return (1 << 8) | exponent  # mantissa 1, x 10^-exponent
        return None


def wrap_queries(cls: type) -> type:
    """Class decorator: every ``nvmlDevice*``/``nvmlEvent*`` method goes through ``refusable``."""
    for name, member in list(vars(cls).items()) + [(n, m) for n, m in vars(NvmlCurrent).items()
                                                    if n not in vars(cls)]:
        if callable(member) and name.startswith(("nvmlDevice", "nvmlEvent")):
            setattr(cls, name, refusable(member))
    return cls
