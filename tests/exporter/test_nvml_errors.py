"""Every NVML error the binding defines, injected into every query: a reaction, never a traceback.

Only a lost, hung or unknown state, or a failed core query, marks a GPU down; a refused optional
query leaves its series out, is counted by query, and (NotSupported, NoPermission) is not asked again
until NVML is initialised again.
"""

from __future__ import annotations

import pynvml
import pytest
from exporter_helpers import FakeClock, make_collector, samples, scrape, sim_context, value
from gpuhealth.exporter.collectors.gpu import FULL_EVERY_SECONDS
from gpuhealth.exporter.nvml_errors import Reaction, reaction

ERRORS = sorted({cls for cls in vars(pynvml).values() if isinstance(cls, type)
                 and issubclass(cls, pynvml.NVMLError) and cls is not pynvml.NVMLError},
                key=lambda c: c.__name__)
CORE = ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo", "nvmlDeviceGetName")
OPTIONAL = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo",
            "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetEccMode", "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetMemoryErrorCounter", "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetRowRemapperHistogram", "nvmlDeviceGetPcieReplayCounter",
            "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration",
            "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetNvLinkState",
            "nvmlDeviceGetFieldValues", "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetSerial", "nvmlDeviceGetVbiosVersion")
GPU_DOWN = {"NVMLError_GpuIsLost", "NVMLError_Unknown", "NVMLError_Timeout"}
NVML_DOWN = {"NVMLError_Uninitialized", "NVMLError_DriverNotLoaded", "NVMLError_LibRmVersionMismatch",
             "NVMLError_LibraryNotFound"}


def _node(clock: FakeClock, query: str, error: BaseException):
    ctx = sim_context({"gpus": 1, "nvlinks": 1}, clock)
    collector = make_collector("gpu", ctx)
    ctx.nvml.inject[query] = error  # from the first sample on, identity included
    return ctx, collector


def test_classification_covers_every_error_class() -> None:
    assert len(ERRORS) >= 30
    for cls in ERRORS:
        expected = (Reaction.GPU_DOWN if cls.__name__ in GPU_DOWN else Reaction.NVML_DOWN
                    if cls.__name__ in NVML_DOWN else None)
        got = reaction(pynvml, cls())
        if expected is not None:
            assert got is expected, cls.__name__
        else:
            assert got in (Reaction.ABSENT, Reaction.SKIP), cls.__name__
    assert reaction(pynvml, pynvml.NVMLLibraryMismatchError("no _v3")) is Reaction.ABSENT
    assert reaction(pynvml, ValueError()) is None


def _all_errors() -> list[BaseException]:
    return [cls() for cls in ERRORS] + [pynvml.NVMLLibraryMismatchError("Unversioned function called")]


@pytest.mark.parametrize("query", OPTIONAL)
def test_every_error_in_an_optional_query(clock: FakeClock, query: str) -> None:
    ctx, collector = _node(clock, query, RuntimeError("replaced below"))
    for error in _all_errors():
        ctx.nvml.inject[query] = error
        ctx.inventory.gpus.clear()  # identity is read again, so its optional queries meet the error too
        clock.advance(FULL_EVERY_SECONDS)  # every query is asked
        text = scrape(collector)  # a traceback would fail the test here
        name = type(error).__name__
        down = name in GPU_DOWN | NVML_DOWN
        assert value(text, "gpuhealth_gpu_up", gpu="0") == (0 if down else 1), (query, name)
        if not down:
            assert value(text, "gpuhealth_gpu_power_watts", gpu="0") is not None or \
                query == "nvmlDeviceGetPowerUsage", (query, name)
        del ctx.nvml.inject[query]
        collector.reader.forget()
        clock.advance(FULL_EVERY_SECONDS)  # every query is asked
        assert value(scrape(collector), "gpuhealth_gpu_up", gpu="0") == 1, (query, name)


@pytest.mark.parametrize("query", CORE)
def test_every_error_in_a_core_query_marks_the_gpu_down(clock: FakeClock, query: str) -> None:
    ctx, collector = _node(clock, query, RuntimeError("replaced below"))
    for error in ERRORS:
        ctx.nvml.inject[query] = error()
        ctx.inventory.gpus.clear()
        clock.advance(FULL_EVERY_SECONDS)  # every query is asked
        text = scrape(collector)
        assert value(text, "gpuhealth_gpu_up", gpu="0") == 0, (query, error.__name__)
        del ctx.nvml.inject[query]
        clock.advance(FULL_EVERY_SECONDS)  # every query is asked
        assert value(scrape(collector), "gpuhealth_gpu_up", gpu="0") == 1, (query, error.__name__)


def test_no_permission_leaves_the_series_out_counts_once_and_is_not_asked_again(clock: FakeClock) -> None:
    ctx, collector = _node(clock, "nvmlDeviceGetRemappedRows", pynvml.NVMLError_NoPermission())
    for _ in range(3):
        clock.advance(FULL_EVERY_SECONDS)  # every query is asked
        text = scrape(collector)
    assert value(text, "gpuhealth_gpu_up", gpu="0") == 1
    assert samples(text, "gpuhealth_gpu_remapped_rows") == {}
    assert value(text, "gpuhealth_gpu_nvml_errors_total", gpu="0", error="no_permission",
                 query="remapped_rows") == 1
    # not asked again: an error that would mark the GPU down is never met
    ctx.nvml.inject["nvmlDeviceGetRemappedRows"] = pynvml.NVMLError_GpuIsLost()
    clock.advance(FULL_EVERY_SECONDS)  # every query is asked
    assert value(scrape(collector), "gpuhealth_gpu_up", gpu="0") == 1
    # a driver reload: NVML is initialised again and every feature asked afresh
    del ctx.nvml.inject["nvmlDeviceGetRemappedRows"]
    ctx.nvml.driver_reloaded = True
    clock.advance(FULL_EVERY_SECONDS)  # every query is asked
    text = scrape(collector)
    assert value(text, "gpuhealth_nvml_up") == 0
    assert value(text, "gpuhealth_gpu_up", gpu="0") == 0
    clock.advance(FULL_EVERY_SECONDS)  # every query is asked
    text = scrape(collector)
    assert value(text, "gpuhealth_nvml_up") == 1
    assert value(text, "gpuhealth_gpu_up", gpu="0") == 1
    assert value(text, "gpuhealth_gpu_remapped_rows", gpu="0", type="correctable") == 0


def test_library_mismatch_in_processes_keeps_the_gpu_up(clock: FakeClock) -> None:
    """R525 drivers lack nvmlDeviceGetComputeRunningProcesses_v3: pynvml raises a plain Exception."""
    _, collector = _node(clock, "nvmlDeviceGetComputeRunningProcesses",
                         pynvml.NVMLLibraryMismatchError("Unversioned function called"))
    text = scrape(collector)
    assert value(text, "gpuhealth_gpu_up", gpu="0") == 1
    assert samples(text, "gpuhealth_gpu_processes") == {}
    assert value(text, "gpuhealth_gpu_nvml_errors_total", gpu="0", error="library_mismatch",
                 query="compute_running_processes") == 1


def test_mig_mode_gpu_is_up_and_an_idle_trained_down_link_is_no_downgrade(clock: FakeClock) -> None:
    ctx = sim_context({"gpus": 1, "nvlinks": 0, "workload": {"utilization": 0}}, clock)
    ctx.nvml.mig = True
    text = scrape(make_collector("gpu", ctx))
    assert value(text, "gpuhealth_gpu_up", gpu="0") == 1
    assert samples(text, "gpuhealth_gpu_utilization_ratio") == {}  # unknown, not "busy"
    assert value(text, "gpuhealth_gpu_pcie_link_generation", gpu="0") < value(
        text, "gpuhealth_gpu_pcie_link_generation_max", gpu="0")
    assert value(text, "gpuhealth_gpu_pcie_link_downgraded", gpu="0") == 0
    assert value(text, "gpuhealth_gpu_nvml_errors_total", gpu="0", error="no_permission",
                 query="compute_running_processes") == 1


def test_an_absent_query_with_an_output_buffer_is_remembered_too(clock: FakeClock) -> None:
    """nvmlDeviceGetGpuFabricInfoV takes byref(struct), a new object every call."""
    ctx, collector = _node(clock, "nvmlDeviceGetGpuFabricInfoV", pynvml.NVMLError_NotSupported())
    scrape(collector)
    ctx.nvml.inject["nvmlDeviceGetGpuFabricInfoV"] = pynvml.NVMLError_GpuIsLost()
    clock.advance(FULL_EVERY_SECONDS)  # every query is asked
    text = scrape(collector)
    assert value(text, "gpuhealth_gpu_up", gpu="0") == 1  # not asked again
    assert samples(text, "gpuhealth_gpu_fabric_state") == {}
