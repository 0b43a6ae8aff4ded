"""The NVML simulator: pynvml's exceptions, noise kinds, reload semantics and its kernel log."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest
from exporter_helpers import FakeClock
from gpuhealth.exporter.sim.nvml import SimulatedNvml
from gpuhealth.exporter.sim.scenario import ScenarioError, parse_scenario


def sim(scenario: dict, clock: FakeClock, kmsg: Path | None = None) -> SimulatedNvml:
    nvml = SimulatedNvml(parse_scenario(scenario), kmsg, clock=clock)
    nvml.nvmlInit()
    return nvml


def test_errors_are_pynvmls_own_classes(clock: FakeClock) -> None:
    nvml = sim({"gpus": 2, "faults": [{"kind": "fell_off_bus", "gpu": 1, "start": 1}]}, clock)
    handle = nvml.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetRetiredPages(handle, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNvLinkState(handle, 18)
    clock.advance(2)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(5)
    assert nvml.NVMLError_Timeout is pynvml.NVMLError_Timeout
    with pytest.raises(AttributeError, match="does not implement"):
        nvml.nvmlDeviceGetBAR1MemoryInfo  # noqa: B018


def test_noise_kinds(clock: FakeClock) -> None:
    nvml = sim({"gpus": 3, "faults": [
        {"kind": "sbe_burst", "gpu": 0, "start": 0, "duration": 10, "count": 100},
        {"kind": "power_cap", "gpu": 1, "watts": 300, "duration": 100},
        {"kind": "boot_replay_burst", "gpu": 2, "count": 50, "duration": 5}]}, clock)
    gpu0, gpu1, gpu2 = (nvml.nvmlDeviceGetHandleByIndex(i) for i in range(3))
    clock.advance(20)
    corrected = (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)
    assert nvml.nvmlDeviceGetTotalEccErrors(gpu0, *corrected) == 100
    assert nvml.nvmlDeviceGetPcieReplayCounter(gpu2) == 50
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(gpu1) == 300_000
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(gpu1) & pynvml.nvmlClocksEventReasonSwPowerCap
    assert nvml.nvmlDeviceGetPowerUsage(gpu1) <= 300_000
    assert nvml.nvmlDeviceGetClockInfo(gpu1, pynvml.NVML_CLOCK_SM) < nvml.nvmlDeviceGetClockInfo(
        gpu0, pynvml.NVML_CLOCK_SM)
    clock.advance(100)  # every noise item is over: the burst stopped, the cap was lifted
    assert nvml.nvmlDeviceGetTotalEccErrors(gpu0, *corrected) == 100
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(gpu1) == 700_000
    assert not nvml.nvmlDeviceGetCurrentClocksEventReasons(gpu1) & pynvml.nvmlClocksEventReasonSwPowerCap


def test_idle_node_and_job_loop(clock: FakeClock) -> None:
    nvml = sim({"gpus": 1, "workload": {"period_seconds": 10, "idle_fraction": 0.5}}, clock)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    clock.now = 1002.0  # 2 s into a period: idle phase (the simulator started at 1000)
    assert nvml.nvmlDeviceGetUtilizationRates(handle).gpu == 0
    clock.now = 1007.0
    assert nvml.nvmlDeviceGetUtilizationRates(handle).gpu > 80
    idle = sim({"gpus": 2, "faults": [{"kind": "idle_node", "start": 5, "duration": 10}]}, clock)
    handle = idle.nvmlDeviceGetHandleByIndex(1)
    assert idle.nvmlDeviceGetUtilizationRates(handle).gpu > 80
    clock.advance(6)
    assert idle.nvmlDeviceGetUtilizationRates(handle).gpu == 0
    assert idle.nvmlDeviceGetPowerUsage(handle) < 100_000
    assert idle.nvmlDeviceGetCurrentClocksEventReasons(handle) & pynvml.nvmlClocksEventReasonGpuIdle


def test_reload_restarts_faults_keeps_aggregate_counters(tmp_path: Path, clock: FakeClock) -> None:
    kmsg = tmp_path / "kmsg"
    nvml = sim({"gpus": 2, "faults": [{"kind": "hbm_degradation", "gpu": 0, "precursor": 10}]}, clock, kmsg)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    clock.advance(11)
    aggregate = nvml.nvmlDeviceGetTotalEccErrors(handle, 0, pynvml.NVML_AGGREGATE_ECC)
    assert nvml.nvmlDeviceGetRemappedRows(handle)[2] == 1  # remap pending
    nvml.reload(parse_scenario({"gpus": 2}))
    assert nvml.nvmlDeviceGetTotalEccErrors(handle, 0, pynvml.NVML_AGGREGATE_ECC) == aggregate
    assert nvml.nvmlDeviceGetTotalEccErrors(handle, 0, pynvml.NVML_VOLATILE_ECC) == 0
    assert nvml.nvmlDeviceGetRemappedRows(handle)[2] == 0  # as after a reset
    with pytest.raises(ValueError, match="GPU count"):
        nvml.reload(parse_scenario({"gpus": 4}))
    lines = kmsg.read_text().splitlines()
    assert [int(line.split(",")[1]) for line in lines] == list(range(len(lines)))
    assert sum("): 63," in line for line in lines) == 64 and "): 95," in lines[-2] and "): 154," in lines[-1]


def test_kmsg_sequence_continues_across_restarts(tmp_path: Path, clock: FakeClock) -> None:
    kmsg = tmp_path / "kmsg"
    for _ in range(2):
        nvml = sim({"gpus": 1, "faults": [{"kind": "fell_off_bus", "gpu": 0}]}, clock, kmsg)
        nvml.nvmlDeviceGetCount()
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            nvml.nvmlDeviceGetHandleByIndex(0)
    seqs = [int(line.split(",")[1]) for line in kmsg.read_text().splitlines()]
    assert seqs == [0, 1, 2, 3]


def test_benign_kinds_shared_with_the_detection_benchmark(tmp_path: Path, clock: FakeClock) -> None:
    kmsg = tmp_path / "kmsg"
    naps: list[float] = []
    nvml = SimulatedNvml(parse_scenario({"gpus": 4, "nvlinks": 2, "faults": [
        {"kind": "benign_remap", "gpu": 0, "duration": 50},
        {"kind": "contained_xid94", "gpu": 1, "duration": 50},
        {"kind": "nvlink_flap", "gpu": 2, "link": 1, "duration": 100},
        {"kind": "warm_gpu", "gpu": 3, "delta_celsius": 9, "duration": 100},
        {"kind": "app_xid", "xid": 31, "gpus": [0, 1], "duration": 100},
        {"kind": "power_brake", "gpus": [2], "duration": 100},
        {"kind": "slow_nvml", "duration": 30},
        {"kind": "pcie_replay_steady", "gpu": 3, "count": 80, "duration": 100},
        {"kind": "sram_uncorrectable", "gpu": 3, "start": 200}]}), kmsg, clock=clock, sleep=naps.append)
    nvml.nvmlInit()
    gpus = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
    clock.advance(10)
    assert nvml.nvmlDeviceGetRemappedRows(gpus[0])[2] == 1 and nvml.nvmlDeviceGetRemappedRows(gpus[1])[2] == 1
    assert nvml.nvmlDeviceGetTemperature(gpus[3], 0) >= nvml.nvmlDeviceGetTemperature(gpus[2], 0) + 5
    assert naps and min(naps) >= 0.3  # every GPU of the node answers slowly
    reasons = nvml.nvmlDeviceGetCurrentClocksEventReasons(gpus[2])
    assert reasons & pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    clock.advance(40)
    assert nvml.nvmlDeviceGetNvLinkState(gpus[2], 1) == pynvml.NVML_FEATURE_DISABLED  # mid-flap
    clock.advance(60)
    naps.clear()
    nvml.nvmlDeviceGetTemperature(gpus[0], 0)
    assert not naps
    assert nvml.nvmlDeviceGetRemappedRows(gpus[0])[2] == 0  # pending until the reset that ended it
    assert nvml.nvmlDeviceGetNvLinkState(gpus[2], 1) == pynvml.NVML_FEATURE_ENABLED  # it healed
    assert nvml.nvmlDeviceGetPcieReplayCounter(gpus[3]) == 80
    clock.advance(150)
    nvml.nvmlDeviceGetTemperature(gpus[3], 0)  # the simulator moves when it is read
    lines = kmsg.read_text()
    assert ": 63, " in lines and ": 94, " in lines and ": 95, " in lines
    assert lines.count(": 31, ") >= 4  # on both GPUs of the job, again at later reads


def test_the_demo_can_inject_every_kind_of_the_simulator() -> None:
    from gpuhealth.contract.faults import FAULT_KINDS, NODE_NOISE_KINDS

    from gpuhealth.demo import stack

    for kind in (*FAULT_KINDS, *NODE_NOISE_KINDS):
        entry = stack.Fault("gpu-000", kind, gpu=1, duration=10.0).scenario_entry()
        assert parse_scenario({"faults": [entry]}).faults[0].kind == kind


def test_scenario_times_are_seconds_or_prometheus_durations() -> None:
    fault = {"kind": "hbm_degradation", "gpu": 0}
    numbers = parse_scenario({"faults": [fault | {"start": 90, "precursor": 3600}]})
    words = parse_scenario({"faults": [fault | {"start": "1m30s", "precursor": "1h"}]})
    assert numbers.faults == words.faults and words.faults[0].start == 90.0
    with pytest.raises(ScenarioError) as caught:
        parse_scenario({"gpus": 2, "faults": [{"kind": "sbe_burst", "gpu": 2, "start": "1.5h", "colour": 1}]})
    assert caught.value.problems == [
        "faults[0].start: '1.5h' is not a duration (whole numbers with units y, w, d, h, m, s, ms, largest "
        "first, e.g. 30s, 1h30m, 500ms, 1w)",
        "faults[0].colour: unknown key",
        "faults[0].gpu: GPU 2 does not exist (the scenario has 2)",
    ]
