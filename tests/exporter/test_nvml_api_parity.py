"""Every NVML name the exporter uses exists in the real pynvml and in the simulator.

The collectors run unchanged against both, so a name only the simulator knows would pass every
other test here and fail on the first real GPU.
"""

from __future__ import annotations

import ctypes
import inspect
import re
from pathlib import Path

import pynvml
import pytest
from gpuhealth.exporter.nvml_reader import CLOCK_EVENT_REASONS, NvmlReader
from gpuhealth.exporter.sim.nvml import SimulatedNvml
from gpuhealth.exporter.sim.scenario import Scenario

EXPORTER = Path(__file__).parents[2] / "exporter"
SOURCES = [EXPORTER / "nvml_reader.py", *(EXPORTER / "collectors").glob("*.py"), EXPORTER / "main.py"]


def used_names() -> set[str]:
    names: set[str] = set()
    for path in SOURCES:
        names |= set(re.findall(r"\bnvml\.((?:nvml|NVML)\w+)", path.read_text()))
    names |= {f"nvmlClocksEventReason{suffix}" for suffix in CLOCK_EVENT_REASONS.values()}
    names |= {f"NVML_NVLINK_ERROR_DL_{t.upper()}" for t in ("crc_flit", "crc_data", "replay", "recovery")}
    return names


@pytest.mark.parametrize("name", sorted(used_names()))
def test_name_exists_in_pynvml_and_simulator(name: str) -> None:
    assert hasattr(pynvml, name), f"pynvml has no {name}"
    assert hasattr(SimulatedNvml(Scenario()), name), f"the simulator lacks {name}"


def test_reader_builds_on_the_real_module() -> None:
    reader = NvmlReader(pynvml)  # touches constants only: no library needed
    assert reader.ask(None, 0, lambda handle: (_ for _ in ()).throw(pynvml.NVMLError_NotSupported()), None) \
        is None


def _parameters(fn) -> list[tuple[str, bool]]:
    return [(p.name, p.default is inspect.Parameter.empty)
            for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", sorted(n for n in used_names() if n.startswith("nvml") and
                                        callable(getattr(pynvml, n))))
def test_simulator_takes_the_same_arguments_as_pynvml(name: str) -> None:
    """Same parameter count and required ones: a call that works on the simulator works on pynvml."""
    real, sim = getattr(pynvml, name), getattr(SimulatedNvml(Scenario()), name)
    real_params, sim_params = _parameters(real), _parameters(sim)
    assert len(sim_params) == len(real_params), f"{name}: {sim_params} vs pynvml {real_params}"
    assert [required for _, required in sim_params] == [required for _, required in real_params], name


# What pynvml returns, read from its source (it cannot run here without libnvidia-ml): the simulator
# must hand the collectors the same types, so attribute access behaves the same on a real GPU.
RETURN_TYPES = [
    ("nvmlDeviceGetPciInfo", (), pynvml.nvmlPciInfo_t),
    ("nvmlDeviceGetUtilizationRates", (), pynvml.c_nvmlUtilization_t),
    ("nvmlDeviceGetMemoryInfo", (), pynvml.c_nvmlMemory_t),
    ("nvmlDeviceGetMemoryInfo", (pynvml.nvmlMemory_v2,), pynvml.c_nvmlMemory_v2_t),
    ("nvmlDeviceGetRowRemapperHistogram", (), pynvml.c_nvmlRowRemapperHistogramValues),
    ("nvmlDeviceGetRemappedRows", (), tuple),
    ("nvmlDeviceGetEccMode", (), list),
    ("nvmlDeviceGetComputeRunningProcesses", (), list),
    ("nvmlDeviceGetTemperatureV", (pynvml.NVML_TEMPERATURE_GPU,), int),
    ("nvmlDeviceGetTotalEccErrors", (0, 0), int),
    ("nvmlDeviceGetMemoryErrorCounter", (0, 0, pynvml.NVML_MEMORY_LOCATION_DRAM), int),
    ("nvmlDeviceGetFieldValues",  # a (field, scope) pair and a bare field id, both as pynvml takes them
     ([(pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC, 0), pynvml.NVML_FI_DEV_MEMORY_TEMP],),
     pynvml.c_nvmlFieldValue_t * 2),
    ("nvmlDeviceGetGpuFabricInfoV", (ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t()),), int),
]


@pytest.mark.parametrize(("name", "args", "expected"), RETURN_TYPES, ids=[f"{n}{len(a)}" for n, a, _ in
                                                                          RETURN_TYPES])
def test_simulator_returns_pynvmls_types(name: str, args: tuple, expected: type) -> None:
    nvml = SimulatedNvml(Scenario(gpus=1, nvlinks=1))
    nvml.nvmlInit()
    result = getattr(nvml, name)(nvml.nvmlDeviceGetHandleByIndex(0), *args)
    assert type(result) is expected or isinstance(result, expected), (name, type(result))
    if name == "nvmlDeviceGetRemappedRows":
        assert len(result) == 4
    if name == "nvmlDeviceGetFieldValues":
        assert (result[0].fieldId, result[0].scopeId) == (pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC, 0)
        assert result[1].fieldId == pynvml.NVML_FI_DEV_MEMORY_TEMP
