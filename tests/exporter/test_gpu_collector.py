"""The gpu collector against the simulator: golden exposition, faults, lost and hung GPUs."""

from __future__ import annotations

import threading

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
from gpuhealth.exporter.collector import Context
from gpuhealth.exporter.sim.nvml import SimulatedNvml
from gpuhealth.exporter.sim.scenario import parse_scenario


def test_default_node_golden(clock: FakeClock) -> None:
    collector = make_collector("gpu", sim_context({}, clock))
    scrape(collector)
    clock.advance(1.0)
    text = scrape(collector)
    assert_golden("gpu_default", text)
    promtool_check(text)
    assert value(text, "gpuhealth_gpus_visible") == 8
    assert len(samples(text, "gpuhealth_gpu_nvlink_up")) == 8 * 18


def test_small_volta_node_golden(clock: FakeClock) -> None:
    """V100s support page retirement; two idle GPUs with two NVLinks keep the file short."""
    scenario = {"gpus": 2, "nvlinks": 2, "model": "Tesla V100-SXM2-32GB", "workload": {"utilization": 0}}
    text = scrape(make_collector("gpu", sim_context(scenario, clock)))
    assert_golden("gpu_volta_idle", text)
    promtool_check(text)
    assert value(text, "gpuhealth_gpu_retired_pages", gpu="0", cause="double_bit") == 0
    assert value(text, "gpuhealth_gpu_clock_event_active", gpu="1", reason="gpu_idle") == 1
    assert value(text, "gpuhealth_gpu_pcie_link_generation", gpu="0") == 1  # idle link power saving
    assert value(text, "gpuhealth_gpu_pcie_link_downgraded", gpu="0") == 0  # is not a downgrade


def test_not_supported_leaves_series_out(clock: FakeClock) -> None:
    text = scrape(make_collector("gpu", sim_context({"gpus": 1}, clock)))
    assert samples(text, "gpuhealth_gpu_retired_pages") == {}  # H100: row remapping instead
    assert value(text, "gpuhealth_gpu_remapped_rows", gpu="0", type="correctable") == 0
    assert value(text, "gpuhealth_gpu_up", gpu="0") == 1


def test_hbm_degradation_moves_the_right_gpu(clock: FakeClock) -> None:
    scenario = {"faults": [{"kind": "hbm_degradation", "gpu": 5, "start": 10, "precursor": 100}]}
    collector = make_collector("gpu", sim_context(scenario, clock))
    before = scrape(collector)
    clock.advance(90)
    during = scrape(collector)
    corrected = {"type": "corrected", "counter": "volatile"}
    assert value(before, "gpuhealth_gpu_ecc_errors_total", gpu="5", **corrected) == 0
    assert value(during, "gpuhealth_gpu_ecc_errors_total", gpu="5", **corrected) > 1000
    assert value(during, "gpuhealth_gpu_remapped_rows", gpu="5", type="correctable") > 10
    assert value(during, "gpuhealth_gpu_ecc_errors_total", gpu="4", **corrected) == 0
    assert value(during, "gpuhealth_gpu_remap_pending", gpu="5") == 0
    clock.advance(30)
    after = scrape(collector)
    assert value(after, "gpuhealth_gpu_remap_pending", gpu="5") == 1
    assert value(after, "gpuhealth_gpu_remapped_rows", gpu="5", type="uncorrectable") == 1
    assert value(after, "gpuhealth_gpu_row_remap_availability_banks", gpu="5", availability="max") < 8192


def test_thermal_runaway_window_max_margin_and_throttle_time(clock: FakeClock) -> None:
    scenario = {"faults": [{"kind": "thermal_runaway", "gpu": 2, "start": 0, "precursor": 100}]}
    collector = make_collector("gpu", sim_context(scenario, clock, window_seconds=15))
    for _ in range(95):
        clock.advance(1)
        text = scrape(collector)
    assert value(text, "gpuhealth_gpu_temperature_max_celsius", gpu="2") > 88
    assert value(text, "gpuhealth_gpu_temperature_slowdown_margin_celsius", gpu="2") < 0
    assert value(text, "gpuhealth_gpu_temperature_slowdown_margin_celsius", gpu="3") > 20
    assert value(text, "gpuhealth_gpu_clock_event_active", gpu="2", reason="sw_thermal_slowdown") == 1
    throttled = value(text, "gpuhealth_gpu_clock_event_seconds_total", gpu="2", reason="sw_thermal_slowdown")
    assert 10 <= throttled < 95
    assert value(text, "gpuhealth_gpu_clock_event_seconds_total", gpu="3", reason="sw_thermal_slowdown") == 0
    assert value(text, "gpuhealth_gpu_sm_clock_hertz", gpu="2") < value(text, "gpuhealth_gpu_sm_clock_hertz",
                                                                          gpu="3")


def test_window_max_forgets_old_samples(clock: FakeClock) -> None:
    scenario = {"faults": [{"kind": "hot_aisle", "gpus": [0], "duration": 2, "delta_celsius": 20}]}
    collector = make_collector("gpu", sim_context(scenario, clock, window_seconds=5))
    hot = scrape(collector)
    clock.advance(3)
    still = scrape(collector)
    clock.advance(4)
    cool = scrape(collector)
    peak = value(hot, "gpuhealth_gpu_temperature_celsius", gpu="0")
    assert value(still, "gpuhealth_gpu_temperature_max_celsius", gpu="0") == peak
    assert value(still, "gpuhealth_gpu_temperature_celsius", gpu="0") == peak - 20
    assert value(cool, "gpuhealth_gpu_temperature_max_celsius", gpu="0") == peak - 20


def test_pcie_and_nvlink_degradation(clock: FakeClock) -> None:
    scenario = {"faults": [{"kind": "pcie_degradation", "gpu": 1, "precursor": 100},
                           {"kind": "nvlink_errors", "gpu": 6, "link": 11, "precursor": 100}]}
    collector = make_collector("gpu", sim_context(scenario, clock))
    clock.advance(90)
    text = scrape(collector)
    assert value(text, "gpuhealth_gpu_pcie_replays_total", gpu="1") > 1000
    assert value(text, "gpuhealth_gpu_pcie_link_width_lanes", gpu="1") == 8
    assert value(text, "gpuhealth_gpu_pcie_link_downgraded", gpu="1") == 1
    assert value(text, "gpuhealth_gpu_pcie_link_downgraded", gpu="0") == 0
    # Hopper: link-scoped DL field values, in one batched call
    assert value(text, "gpuhealth_gpu_nvlink_errors_total", gpu="6", link="11", type="crc") > 1000
    assert value(text, "gpuhealth_gpu_nvlink_errors_total", gpu="6", link="10", type="crc") == 0
    per_link = [v for k, v in samples(text, "gpuhealth_gpu_nvlink_errors_total").items() if ("gpu", "6") in k]
    assert len(per_link) == 18 * 3   # links x (crc, replay, recovery)
    # The per-GPU total is the sum over links and types: one series per GPU for the rules.
    assert value(text, "gpuhealth_gpu_nvlink_errors_all_links_total", gpu="6") == sum(per_link)
    assert value(text, "gpuhealth_gpu_nvlink_errors_all_links_total", gpu="0") == 0
    clock.advance(20)
    text = scrape(collector)
    assert value(text, "gpuhealth_gpu_nvlink_up", gpu="6", link="11") == 0
    assert value(text, "gpuhealth_gpu_nvlink_up", gpu="6", link="10") == 1


def test_fallen_off_bus_gpu_is_down_others_keep_reporting(clock: FakeClock) -> None:
    scenario = {"faults": [{"kind": "fell_off_bus", "gpu": 3, "start": 5}]}
    collector = make_collector("gpu", sim_context(scenario, clock))
    scrape(collector)
    clock.advance(10)
    text = scrape(collector)
    assert value(text, "gpuhealth_gpu_up", gpu="3") == 0
    assert value(text, "gpuhealth_gpu_nvml_errors_total", gpu="3", error="gpu_is_lost", query="sample") == 1
    assert value(text, "gpuhealth_gpus_visible") == 7
    assert value(text, "gpuhealth_gpus_expected") == 8
    assert value(text, "gpuhealth_gpu_temperature_celsius", gpu="3") is None
    assert any(dict(k)["gpu"] == "3" for k in samples(text, "gpuhealth_gpu_info"))
    assert all(value(text, "gpuhealth_gpu_up", gpu=str(i)) == 1 for i in range(8) if i != 3)


@pytest.mark.timeout(30)
def test_hung_gpu_times_out_and_stays_down_without_blocking(clock: FakeClock) -> None:
    release = threading.Event()
    scenario = {"gpus": 2, "faults": [{"kind": "gsp_timeout", "gpu": 1, "start": 1}]}
    ctx = sim_context(scenario, clock, nvml_timeout_seconds=1.0)
    ctx.nvml._sleep = lambda seconds: release.wait(10)  # a hung driver call, until the test ends
    collector = make_collector("gpu", ctx)
    try:
        scrape(collector)
        clock.advance(2)
        first = scrape(collector)
        second = scrape(collector)  # the stuck call is still running: fails at once, no new thread
        assert value(first, "gpuhealth_gpu_up", gpu="1") == 0
        assert value(second, "gpuhealth_gpu_nvml_errors_total", gpu="1", error="timeout", query="sample") == 2
        assert value(second, "gpuhealth_gpu_nvml_latency_seconds", gpu="1") == pytest.approx(1.0)
        assert value(second, "gpuhealth_gpu_up", gpu="0") == 1
        assert value(second, "gpuhealth_gpus_visible") == 2  # enumerated, just not answering
    finally:
        release.set()


@pytest.mark.timeout(30)
def test_a_hung_first_gpu_leaves_the_others_sampled_together(clock: FakeClock) -> None:
    release = threading.Event()
    scenario = {"gpus": 4, "nvlinks": 0, "faults": [{"kind": "gsp_timeout", "gpu": 0, "start": 1}]}
    ctx = sim_context(scenario, clock, nvml_timeout_seconds=2.0)
    ctx.nvml._sleep = lambda seconds: release.wait(10)
    collector = make_collector("gpu", ctx)
    try:
        scrape(collector)
        clock.advance(2)
        text = scrape(collector)
        assert value(text, "gpuhealth_gpu_nvml_errors_total", gpu="0", error="timeout", query="sample") == 1
        assert all(value(text, "gpuhealth_gpu_up", gpu=str(i)) == 1 for i in range(1, 4))
        assert value(text, "gpuhealth_nvml_stalled") == 0
    finally:
        release.set()


def test_gpus_are_sampled_one_at_a_time_while_none_hangs(clock: FakeClock) -> None:
    """One sampling worker at a time competes for the GIL with a scrape, not eight."""
    ctx = sim_context({"gpus": 8, "nvlinks": 0}, clock)
    collector = make_collector("gpu", ctx)
    gpu = collector.collector
    sample, lock = gpu._sample, threading.Lock()
    running, most = [0], [0]

    def counted(*args):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            threading.Event().wait(0.01)  # long enough for a second worker to start, were one started
            return sample(*args)
        finally:
            with lock:
                running[0] -= 1

    gpu._sample = counted
    text = scrape(collector)
    assert all(value(text, "gpuhealth_gpu_up", gpu=str(i)) == 1 for i in range(8))
    assert most[0] == 1


def test_gsp_precursor_shows_as_nvml_latency(clock: FakeClock) -> None:
    """Slow answers before the GSP timeout: the simulator's delays move an injected clock, not real time.

    Each GPU is sampled on its own thread, so each thread's waits count only on that thread's clock:
    GPU 0's slow answers cannot leak into GPU 1's measured latency, whatever the interleaving.
    """
    waited = threading.local()

    def now() -> float:
        return clock() + getattr(waited, "seconds", 0.0)

    def sleep(seconds: float) -> None:
        waited.seconds = getattr(waited, "seconds", 0.0) + seconds

    scenario = parse_scenario({"gpus": 2, "faults": [{"kind": "gsp_timeout", "gpu": 0, "precursor": 2}]})
    nvml = SimulatedNvml(scenario, clock=clock, sleep=sleep)
    collector = make_collector("gpu", Context(nvml=nvml, clock=now))
    clock.advance(1.5)  # three quarters into the precursor: the temperature answers after 0.1875 s
    text = scrape(collector)
    slow, fast = (value(text, "gpuhealth_gpu_nvml_latency_seconds", gpu=g) for g in ("0", "1"))
    assert slow == pytest.approx(0.25 * 1.5 / 2)
    assert fast == 0


def test_driver_clock_event_counters_win_over_sampling(clock: FakeClock) -> None:
    """Where the driver counts time in a reason (field values, ns), that exact figure is published."""
    import pynvml

    class DriverTimed(SimulatedNvml):
        def _field(self, gpu, field_id, scope):
            if field_id == pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN:
                return 2_500_000_000
            return super()._field(gpu, field_id, scope)

    scenario = {"gpus": 1, "nvlinks": 0, "faults": [{"kind": "thermal_runaway", "gpu": 0, "precursor": 100}]}
    nvml = DriverTimed(parse_scenario(scenario), clock=clock)
    collector = make_collector("gpu", Context(nvml=nvml, clock=clock))
    for _ in range(95):
        clock.advance(1)
        text = scrape(collector)
    assert value(text, "gpuhealth_gpu_clock_event_active", gpu="0", reason="sw_thermal_slowdown") == 1
    seconds = samples(text, "gpuhealth_gpu_clock_event_seconds_total")
    assert seconds[(("gpu", "0"), ("reason", "sw_thermal_slowdown"))] == 2.5  # the driver's counter
    assert seconds[(("gpu", "0"), ("reason", "hw_slowdown"))] > 0  # no counter for it: sampled
    promtool_check(text)


def test_counters_are_read_every_few_seconds_and_load_every_second(clock: FakeClock) -> None:
    from gpuhealth.exporter.collectors.gpu import FULL_EVERY_SECONDS

    scenario = {"gpus": 1, "nvlinks": 0,
                "faults": [{"kind": "hbm_degradation", "gpu": 0, "start": 0, "precursor": 100}]}
    collector = make_collector("gpu", sim_context(scenario, clock))
    clock.advance(50)
    first = scrape(collector)
    clock.advance(1)
    second = scrape(collector)
    clock.advance(FULL_EVERY_SECONDS)
    third = scrape(collector)
    ecc = [value(t, "gpuhealth_gpu_ecc_errors_total", gpu="0", type="corrected", counter="volatile")
           for t in (first, second, third)]
    power = [value(t, "gpuhealth_gpu_power_watts", gpu="0") for t in (first, second)]
    assert ecc[0] == ecc[1] < ecc[2]  # counters: the last full read until the next one
    assert power[0] != power[1]       # load: every second
