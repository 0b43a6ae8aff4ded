"""Every NVML name the exporter uses exists in the real pynvml and in the simulator.

The collectors run unchanged against both, so a name only the simulator knows would pass every
other test here and fail on the first real GPU.
"""

from __future__ import annotations

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
