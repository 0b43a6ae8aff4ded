"""NVML's lifetime: a driverless start, a driver that appears later, a node-wide stall, expected GPUs."""

from __future__ import annotations

import pytest
from exporter_helpers import HERE, FakeClock, make_collector, promtool_check, scrape, sim_context, value

SYSFS = HERE / "fixtures" / "sysfs"  # three NVIDIA GPUs, one NVSwitch (a bridge), one Intel root port


def test_driverless_start_serves_nvml_up_0_and_recovers_when_the_driver_appears(clock: FakeClock) -> None:
    ctx = sim_context({"gpus": 2, "nvlinks": 0}, clock)
    ctx.nvml.nvmlShutdown()
    ctx.nvml.driver_loaded = False
    collector = make_collector("gpu", ctx)
    text = scrape(collector)
    promtool_check(text)
    assert value(text, "gpuhealth_nvml_up") == 0
    assert value(text, "gpuhealth_nvml_init_errors_total", error="driver_not_loaded") == 1
    assert value(text, "gpuhealth_gpus_visible") == 0
    clock.advance(0.5)  # within the backoff: not tried again
    assert value(scrape(collector), "gpuhealth_nvml_init_errors_total", error="driver_not_loaded") == 1
    ctx.nvml.driver_loaded = True  # the driver module is loaded
    clock.advance(5)
    text = scrape(collector)
    assert value(text, "gpuhealth_nvml_up") == 1
    assert value(text, "gpuhealth_gpu_up", gpu="1") == 1
    assert 'driver_version="550.54.15"' in text


def test_xid_collector_starts_without_a_driver(clock: FakeClock) -> None:
    ctx = sim_context({"gpus": 1, "nvlinks": 0}, clock)
    ctx.nvml.nvmlShutdown()
    ctx.nvml.driver_loaded = False
    assert value(scrape(make_collector("xid", ctx)), "gpuhealth_xid_nvml_registered", gpu="0") is None


@pytest.mark.timeout(30)
def test_a_node_wide_stall_is_reported_as_such_not_as_lost_gpus(clock: FakeClock) -> None:
    ctx = sim_context({"gpus": 4, "nvlinks": 0}, clock, nvml_timeout_seconds=10)
    collector = make_collector("gpu", ctx)
    scrape(collector)  # every GPU answers, however loaded the machine running this test
    ctx.nvml_timeout_seconds = 0.2
    ctx.nvml.stall(1.0)
    text = scrape(collector)
    assert value(text, "gpuhealth_nvml_stalled") == 1
    assert all(value(text, "gpuhealth_gpu_up", gpu=str(i)) == 1 for i in range(4))
    assert value(text, "gpuhealth_gpus_visible") == 4
    assert value(text, "gpuhealth_gpu_nvml_errors_total", gpu="0", error="timeout", query="sample") == 0
    assert value(text, "gpuhealth_gpu_temperature_celsius", gpu="0") is None  # no stale values


def test_expected_gpus_come_from_the_pci_bus(clock: FakeClock) -> None:
    ctx = sim_context({"gpus": 2, "nvlinks": 0}, clock, sysfs=SYSFS)
    text = scrape(make_collector("gpu", ctx))
    assert value(text, "gpuhealth_gpus_expected") == 3  # one GPU on the bus that NVML does not see
    assert value(text, "gpuhealth_gpus_visible") == 2


def test_configured_expected_gpus_win_and_no_sysfs_falls_back_to_nvml(clock: FakeClock) -> None:
    assert value(scrape(make_collector("gpu", sim_context({"gpus": 2, "nvlinks": 0}, clock, sysfs=SYSFS,
                                                          gpus_expected=8))), "gpuhealth_gpus_expected") == 8
    assert value(scrape(make_collector("gpu", sim_context({"gpus": 2, "nvlinks": 0}, clock))),
                 "gpuhealth_gpus_expected") == 2
