"""bench/device_check.py against the simulator: it calls every query the exporter makes, its JSON is the
simulator's fixture format, and its sanity checks catch a sick node."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from exporter_helpers import FakeClock, make_collector, scrape, sim_context
from gpuhealth.exporter.sim.nvml import SimulatedNvml
from gpuhealth.exporter.sim.profiles import load_profile
from gpuhealth.exporter.sim.scenario import Scenario
from test_nvml_api_parity import used_names

ROOT = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("device_check", ROOT / "bench" / "device_check.py")
device_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_check)

NOT_QUERIES = {"nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetIndex",
               "nvmlDeviceRegisterEvents"}


def test_every_query_the_exporter_makes_is_recorded() -> None:
    nvml = SimulatedNvml(Scenario(gpus=1, nvlinks=1))
    recorded = {name for name, _ in device_check.calls_for(nvml, None)}
    queries = {n for n in used_names() if n.startswith("nvmlDevice")} - NOT_QUERIES
    assert queries <= recorded, queries - recorded


def test_recorded_calls_are_the_simulators_fixture(tmp_path: Path, clock: FakeClock) -> None:
    recorded = device_check.record_calls(SimulatedNvml(Scenario(gpus=2, nvlinks=2)))
    assert recorded["gpus"] == 2 and recorded["model"] == "NVIDIA H100 80GB HBM3"
    errors = {c["call"]: c["error"] for c in recorded["calls"] if c["error"]}
    assert errors == {"nvmlDeviceGetRetiredPages": "not_supported",
                      "nvmlDeviceGetRetiredPagesPendingStatus": "not_supported"}
    memory = next(c for c in recorded["calls"] if c["call"] == "nvmlDeviceGetMemoryInfo")
    assert memory["result"]["total"] == 81559 * 2**20 and memory["latency_seconds"] >= 0
    fields = next(c for c in recorded["calls"] if c["call"] == "nvmlDeviceGetFieldValues")
    assert {"fieldId", "scopeId", "nvmlReturn", "value"} <= set(fields["result"][0])
    name = device_check.profile_name(recorded["model"])
    (tmp_path / f"{name}.json").write_text(json.dumps(recorded))
    profile = load_profile(name, fixtures=tmp_path)
    assert profile.recorded == "h100-sxm.json"
    assert {"nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPagesPendingStatus"} == profile.unsupported
    text = scrape(make_collector("gpu", sim_context({"gpus": 1, "nvlinks": 0}, clock, profile=profile)))
    assert device_check.sanity(text) == []


def test_sanity_catches_a_lost_gpu(clock: FakeClock) -> None:
    ctx = sim_context({"gpus": 2, "nvlinks": 0, "faults": [{"kind": "fell_off_bus", "gpu": 1, "start": 1}]},
                      clock)
    collector = make_collector("gpu", ctx)
    scrape(collector)
    clock.advance(2)
    problems = device_check.sanity(scrape(collector))
    assert "gpu 1 is down" in problems and any("gpus_expected" in p for p in problems)
