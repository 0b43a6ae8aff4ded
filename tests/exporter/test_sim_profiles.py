"""Simulator hardware profiles: real memory sizes, NVLink generation, which queries answer; a
recorded device fixture refines a profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from exporter_helpers import (
    FakeClock,
    assert_golden,
    make_collector,
    promtool_check,
    samples,
    scrape,
    sim_context,
    value,
)
from gpuhealth.exporter.sim.profiles import PROFILES, load_profile

MIB = 1024 * 1024


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_golden_scrape_passes_promtool(name: str, clock: FakeClock, tmp_path: Path) -> None:
    profile = load_profile(name, fixtures=tmp_path)  # no recorded fixture: the built-in figures
    scenario = {"gpus": 2, "nvlinks": 2, "model": profile.model, "driver_version": "570.133.20",
                "faults": [{"kind": "nvlink_errors", "gpu": 1, "link": 1, "precursor": 100}]}
    collector = make_collector("gpu", sim_context(scenario, clock, profile=profile))
    scrape(collector)
    clock.advance(50)
    text = scrape(collector)
    assert_golden(f"profile_{name}", text)
    promtool_check(text)
    assert value(text, "gpuhealth_gpu_memory_total_bytes", gpu="0") == profile.memory_mib * MIB
    assert value(text, "gpuhealth_gpu_recovery_action", gpu="0", action="none") == 1  # polled on R570
    assert value(text, "gpuhealth_gpu_nvlink_errors_all_links_total", gpu="1") > 0
    assert value(text, "gpuhealth_gpu_nvlink_errors_all_links_total", gpu="0") == 0
    types = {dict(k)["type"] for k in samples(text, "gpuhealth_gpu_nvlink_errors_total")}
    if profile.nvlink_generation == 5:  # Blackwell: NVLink5 counters, no legacy error counter
        assert types == {"effective", "receive", "symbol"}
        assert value(text, "gpuhealth_gpu_nvlink_recoveries_total", gpu="1", link="1",
                     result="successful") > 0
        assert 0 < value(text, "gpuhealth_gpu_nvlink_bit_error_rate", gpu="1", link="1", type="symbol") < 1e-6
    else:  # Hopper: link-scoped DL field values
        assert types == {"crc", "replay", "recovery"}


def test_real_memory_sizes() -> None:
    assert PROFILES["h100-sxm"].memory_mib == 81559
    assert PROFILES["h200"].memory_mib == 143771


def test_recorded_device_fixture_refines_the_profile(tmp_path: Path, clock: FakeClock) -> None:
    """The JSON bench/device_check.sh writes: each NVML call once, its result or error."""
    (tmp_path / "h100-sxm.json").write_text(json.dumps({
        "model": "NVIDIA H100 80GB HBM3", "driver_version": "550.90.07",
        "calls": [
            {"call": "nvmlDeviceGetMemoryInfo", "gpu": 0, "args": [],
             "result": {"total": 81559 * MIB, "used": 0, "free": 81559 * MIB}, "error": None,
             "latency_seconds": 0.0001},
            {"call": "nvmlDeviceGetGpuFabricInfoV", "gpu": 0, "args": [], "result": None,
             "error": "not_supported", "latency_seconds": 0.00005},
            {"call": "nvmlDeviceGetRemappedRows", "gpu": 0, "args": [], "result": [0, 0, 0, 0], "error": None,
             "latency_seconds": 0.0002},
        ]}))
    profile = load_profile("h100-sxm", fixtures=tmp_path)
    assert profile.recorded == "h100-sxm.json"
    assert "nvmlDeviceGetGpuFabricInfoV" in profile.unsupported
    text = scrape(make_collector("gpu", sim_context({"gpus": 1, "nvlinks": 0}, clock, profile=profile)))
    assert value(text, "gpuhealth_gpu_up", gpu="0") == 1
    assert samples(text, "gpuhealth_gpu_fabric_state") == {}
    assert value(text, "gpuhealth_gpu_memory_total_bytes", gpu="0") == 81559 * MIB
    (tmp_path / "h200.json").write_text("{not json")
    assert load_profile("h200", fixtures=tmp_path) == PROFILES["h200"]  # unreadable: the built-in one
