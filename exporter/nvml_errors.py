"""What each NVML error means for the exporter: one table, so every query reacts the same way.

Real nodes refuse ordinary queries for reasons that say nothing about the GPU's health: MIG mode
inside a container answers NoPermission, a newer driver answers Deprecated, an older one lacks a
versioned symbol (``NVMLLibraryMismatchError``, a plain Exception). Only a lost, hung or unknown
state, or a failed core query, means the GPU stopped answering; only a library-level error means
NVML itself must be initialised again (a driver reload).
"""

from __future__ import annotations

import enum
import re
from typing import Any


class Reaction(enum.Enum):
    GPU_DOWN = "gpu_down"      # the GPU stopped answering: gpu_up 0
    NVML_DOWN = "nvml_down"    # the library is gone or stale: initialise again
    ABSENT = "absent"          # the feature is not there for us: leave it out, do not ask again
    SKIP = "skip"              # this answer failed: leave the series out this run, ask again next run


_GPU_DOWN = ("GpuIsLost", "Unknown", "Timeout")
_NVML_DOWN = ("Uninitialized", "DriverNotLoaded", "LibRmVersionMismatch", "LibraryNotFound")
_ABSENT = ("NotSupported", "NoPermission", "FunctionNotFound", "Deprecated")
# Absence is a capability, not an error: not counted (a V100 would count its missing remapper forever).
UNCOUNTED = ("not_supported", "function_not_found")


class GpuDown(Exception):
    """A query's error that marks the GPU down; ``error`` and ``query`` are metric labels."""

    def __init__(self, error: str, query: str) -> None:
        super().__init__(f"{query}: {error}")
        self.error, self.query = error, query


class NvmlDown(GpuDown):
    """NVML itself failed (uninitialised, driver unloaded or reloaded): re-initialise."""


def error_label(exc: BaseException) -> str:
    """``NVMLError_GpuIsLost`` -> ``gpu_is_lost``; ``NVMLLibraryMismatchError`` -> ``library_mismatch``."""
    if isinstance(exc, GpuDown):
        return exc.error
    name = type(exc).__name__
    if name == "NVMLLibraryMismatchError":
        return "library_mismatch"
    if name == "DeadlineExceeded":
        return "timeout"
    name = name.removeprefix("NVMLError_").removeprefix("NVMLError")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower() or "unknown"


def reaction(nvml: Any, exc: BaseException) -> Reaction | None:
    """How to react to ``exc`` from an NVML call; None when it is not an NVML error at all."""
    if isinstance(exc, nvml.NVMLLibraryMismatchError):
        return Reaction.ABSENT  # the driver lacks the versioned symbol this binding calls
    if not isinstance(exc, nvml.NVMLError):
        return None
    for names, result in ((_GPU_DOWN, Reaction.GPU_DOWN), (_NVML_DOWN, Reaction.NVML_DOWN),
                          (_ABSENT, Reaction.ABSENT)):
        if any(isinstance(exc, getattr(nvml, f"NVMLError_{n}")) for n in names):
            return result
    return Reaction.SKIP


def query_name(fn: Any) -> str:
    """``nvmlDeviceGetTotalEccErrors`` -> ``total_ecc_errors``: the ``query`` label."""
    name = getattr(fn, "__name__", str(fn)).removeprefix("nvmlDeviceGet").removeprefix("nvmlDevice") \
        .removeprefix("nvml")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
