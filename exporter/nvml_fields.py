"""The NVML field values the exporter reads, in one batched ``nvmlDeviceGetFieldValues`` per GPU.

Field values are how newer GPUs expose counters that have no function of their own: Hopper's
link-scoped NVLink DL counters, Blackwell's NVLink5 counters (``nvmlDeviceGetNvLinkErrorCounter``
is gone there), PCIe error counters, the driver's recovery action and the clock-event time. Each
request is a ``(field id, scope)`` pair, exactly as pynvml takes it; a pair the GPU answers
NotSupported for is remembered and left out of later batches.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldSpec:
    """One field: which metric it feeds, its label values after ``gpu`` (and ``link``), its scale."""

    field: str                 # pynvml constant name, NVML_FI_DEV_...
    metric: str
    labels: tuple[str, ...] = ()
    scale: float = 1.0
    per_link: bool = False
    in_link_total: bool = False  # summed into gpuhealth_gpu_nvlink_errors_all_links_total


# Device-scoped fields.
DEVICE_FIELDS = (
    FieldSpec("NVML_FI_DEV_MEMORY_TEMP", "gpuhealth_gpu_memory_temperature_celsius"),
    *(FieldSpec(f"NVML_FI_DEV_PCIE_COUNT_{name}", "gpuhealth_gpu_pcie_errors_total", (label,))
      for name, label in (("CORRECTABLE_ERRORS", "correctable"), ("NON_FATAL_ERROR", "non_fatal"),
                          ("FATAL_ERROR", "fatal"), ("UNSUPPORTED_REQ", "unsupported_request"),
                          ("RECEIVER_ERROR", "receiver"), ("BAD_TLP", "bad_tlp"), ("BAD_DLLP", "bad_dllp"),
                          ("LCRC_ERROR", "lcrc"), ("NAKS_RECEIVED", "naks_received"),
                          ("NAKS_SENT", "naks_sent"))),
    # the driver's own time counters (nanoseconds) replace sampling of the active reasons
    *(FieldSpec(f"NVML_FI_DEV_CLOCKS_EVENT_REASON_{name}", "gpuhealth_gpu_clock_event_seconds_total",
                (label,), 1e-9)
      for name, label in (("SW_POWER_CAP", "sw_power_cap"), ("SYNC_BOOST", "sync_boost"),
                          ("SW_THERM_SLOWDOWN", "sw_thermal_slowdown"),
                          ("HW_THERM_SLOWDOWN", "hw_thermal_slowdown"),
                          ("HW_POWER_BRAKE_SLOWDOWN", "hw_power_brake_slowdown"))),
)
RECOVERY_ACTION_FIELD = "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"

# Link-scoped fields: Hopper's DL counters, then Blackwell's NVLink5 counters.
LINK_FIELDS = (
    FieldSpec("NVML_FI_DEV_NVLINK_ERROR_DL_CRC", "gpuhealth_gpu_nvlink_errors_total", ("crc",),
              per_link=True, in_link_total=True),
    FieldSpec("NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY", "gpuhealth_gpu_nvlink_errors_total", ("replay",),
              per_link=True, in_link_total=True),
    FieldSpec("NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY", "gpuhealth_gpu_nvlink_errors_total", ("recovery",),
              per_link=True, in_link_total=True),
    FieldSpec("NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_ERRORS", "gpuhealth_gpu_nvlink_errors_total",
              ("effective",), per_link=True, in_link_total=True),
    FieldSpec("NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS", "gpuhealth_gpu_nvlink_errors_total", ("receive",),
              per_link=True, in_link_total=True),
    FieldSpec("NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS", "gpuhealth_gpu_nvlink_errors_total", ("symbol",),
              per_link=True),  # raw, before forward error correction: noisy on healthy links
    FieldSpec("NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_SUCCESSFUL_EVENTS",
              "gpuhealth_gpu_nvlink_recoveries_total", ("successful",), per_link=True),
    FieldSpec("NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS",
              "gpuhealth_gpu_nvlink_recoveries_total", ("failed",), per_link=True),
    FieldSpec("NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_BER", "gpuhealth_gpu_nvlink_bit_error_rate", ("effective",),
              per_link=True),
    FieldSpec("NVML_FI_DEV_NVLINK_COUNT_SYMBOL_BER", "gpuhealth_gpu_nvlink_bit_error_rate", ("symbol",),
              per_link=True),
    *(FieldSpec(f"NVML_FI_DEV_NVLINK_COUNT_FEC_HISTORY_{i}", "gpuhealth_gpu_nvlink_fec_history_total",
                (str(i),), per_link=True) for i in range(16)),
)


def value_members(nvml: Any) -> dict[int, str]:
    """Which member of a ``c_nvmlFieldValue_t``'s value union holds the number, by value type."""
    return {nvml.NVML_VALUE_TYPE_DOUBLE: "dVal", nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
            nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal", nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
            nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal", nvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
            nvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal"}


_STRUCTURE_GET = ctypes.Structure.__getattribute__
_UNION_GET = ctypes.Union.__getattribute__


def answers(values: Iterable[Any], members: dict[int, str]) -> Iterator[tuple[int, float]]:
    """(return code, number) of each ``c_nvmlFieldValue_t``, read through ctypes' own accessors.

    pynvml's structures pass every attribute through a Python ``__getattribute__`` (it decodes byte
    strings, which a field value has none of): for the hundreds of fields of a Blackwell GPU that
    cost more than everything else done with them. The number is 0.0 when the code is not success.
    """
    for value in values:
        code = _STRUCTURE_GET(value, "nvmlReturn")
        if code:
            yield code, 0.0
            continue
        member = members.get(_STRUCTURE_GET(value, "valueType"), "ullVal")
        yield code, float(_UNION_GET(_STRUCTURE_GET(value, "value"), member))


def ber(raw: float) -> float:
    """NVLink5 BER fields pack mantissa (bits 8..11) and exponent (bits 0..7): mantissa x 10^-exponent."""
    raw_int = int(raw)
    return ((raw_int >> 8) & 0xF) * 10.0 ** -(raw_int & 0xFF)
