"""The renderer reuses each series' line between runs; what it writes must still follow every value."""

from __future__ import annotations

import math

from exporter_helpers import FakeClock, make_collector, samples, sim_context, value
from gpuhealth.exporter.metrics import SPECS, Families, Renderer, render
from gpuhealth.exporter.sampler import Sampler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def _families(temperature: float, errors: float) -> Families:
    f = Families()
    f.add("gpuhealth_gpu_temperature_celsius", temperature, [0])
    f.add("gpuhealth_gpu_nvml_errors_total", errors, ["0", "timeout", "sample"])
    return f


def test_a_reused_renderer_follows_every_value() -> None:
    renderer = Renderer()
    values = [(60.0, 0.0), (60.0, 0.0), (61.5, 3.0), (math.nan, 3.0), (math.inf, -math.inf), (60.0, 4.0)]
    for temperature, errors in values:
        assert renderer.render(_families(temperature, errors)) == render(_families(temperature, errors))
    text = renderer.render(_families(60.0, 4.0)).decode()
    assert 'gpuhealth_gpu_temperature_celsius{gpu="0"} 60.0\n' in text
    assert 'gpuhealth_gpu_nvml_errors_total{error="timeout",gpu="0",query="sample"} 4.0\n' in text


def test_a_family_kept_by_its_collector_and_changed_in_place_is_rendered_afresh() -> None:
    """Unchanged families reuse their block; the comparison is with a copy of what was rendered, so a
    collector that keeps its family (the fabric collector does, between sysfs reads) and changes a
    value in place is not served the old block."""
    renderer = Renderer()
    families = Families()
    families.add("gpuhealth_gpu_temperature_celsius", 60.0, [0])
    (kept,) = families
    first = renderer.render([kept])
    assert renderer.render([kept]) is first
    kept.pairs[0] = (("0",), 71.0)
    assert 'gpuhealth_gpu_temperature_celsius{gpu="0"} 71.0\n' in renderer.render([kept]).decode()
    kept.pairs.append((("1",), 55.0))
    assert renderer.render([kept]) == render([kept])


def test_families_render_as_prometheus_client_families() -> None:
    gauge = GaugeMetricFamily("gpuhealth_gpu_temperature_celsius",
                              SPECS["gpuhealth_gpu_temperature_celsius"].help, labels=["gpu"])
    gauge.add_metric(["0"], 61.5)
    name = "gpuhealth_gpu_nvml_errors_total"
    counter = CounterMetricFamily(name, SPECS[name].help, labels=["gpu", "error", "query"])
    counter.add_metric(["0", "timeout", "sample"], 3.0)
    ours = _families(61.5, 3.0)
    assert render(ours) == render([gauge, counter])
    assert [s for family in ours for s in family.samples] == [*gauge.samples, *counter.samples]


def test_a_lost_gpu_serves_none_of_its_old_values(clock: FakeClock) -> None:
    """The sampler's renderer and the collector's grouped slow series keep nothing of a GPU that stops
    answering: its telemetry, counters and link state leave the very next exposition."""
    scenario = {"gpus": 2, "nvlinks": 2, "faults": [{"kind": "fell_off_bus", "gpu": 1, "start": 5}]}
    sampler = Sampler({"gpu": make_collector("gpu", sim_context(scenario, clock))}, clock=clock)
    before = sampler.sample_once().decode()
    for name in ("gpuhealth_gpu_temperature_celsius", "gpuhealth_gpu_nvlink_up",
                 "gpuhealth_gpu_temperature_slowdown_threshold_celsius"):
        assert any(dict(labels)["gpu"] == "1" for labels in samples(before, name)), name
    clock.advance(6)
    after = sampler.sample_once().decode()
    assert value(after, "gpuhealth_gpu_up", gpu="1") == 0
    kept = {name for name in SPECS if any(dict(labels).get("gpu") == "1" for labels in samples(after, name))}
    assert kept == {"gpuhealth_gpu_info", "gpuhealth_gpu_up", "gpuhealth_gpu_nvml_errors_total",
                    "gpuhealth_gpu_nvml_latency_seconds", "gpuhealth_gpu_recovery_action"}
