"""The renderer reuses each series' line between runs; what it writes must still follow every value."""

from __future__ import annotations

import math

from gpuhealth.exporter.metrics import SPECS, Families, Renderer, render
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
