"""Pure pieces of query expansion and preview drawing: legends, units, colours."""

from __future__ import annotations

import math

from gpuhealth.dashboards.queries import Window, legend, variable_queries, variable_values

from gpuhealth.previews.draw import _mapped, _threshold_colour, format_value


def test_legend_follows_legend_format_like_grafana():
    labels = {"__name__": "x", "node": "n1", "gpu": "3"}
    assert legend("{{node}} gpu {{ gpu }}", labels) == "n1 gpu 3"
    assert legend("{{missing}}!", labels) == "!"
    assert legend("", labels) == 'x{gpu="3", node="n1"}'
    assert legend("", {"__name__": "x"}) == "x"


def test_rate_interval_covers_four_scrapes_and_a_step():
    assert Window(0, 3600, step=15).rate_interval == 60
    assert Window(0, 86400, step=300).rate_interval == 315


def test_units_read_like_grafana():
    assert format_value(0.734, "percentunit") == "73%"
    assert format_value(71.2, "celsius") == "71.2°C"
    assert format_value(1.98e9, "hertz") == "1.98 GHz"
    assert format_value(0.25, "s") == "250 ms"
    assert format_value(12500, "short") == "12.5 k"
    assert format_value(math.nan, "s") == "-"


def test_threshold_and_mapping_colours():
    panel = {"fieldConfig": {"defaults": {
        "thresholds": {"steps": [{"value": None, "color": "green"}, {"value": 0.6, "color": "orange"},
                                 {"value": 0.8, "color": "red"}]},
        "mappings": [{"type": "value", "options": {"1": {"text": "open", "color": "red"}}}],
    }}}
    assert [_threshold_colour(panel, v) for v in (0.1, 0.6, 0.79, 0.95)] == \
        ["#73BF69", "#FF9830", "#FF9830", "#F2495C"]
    assert _mapped(panel, 1.0) == ("open", "#F2495C")
    assert _mapped(panel, 0.5) is None and _mapped(panel, 0.0) is None


def test_variables_pick_all_for_multi_pickers_and_the_gpu_for_single_ones():
    model = {"templating": {"list": [
        {"name": "datasource", "type": "datasource"},
        {"name": "cluster", "type": "query", "includeAll": True, "allValue": ".*",
         "query": {"query": "label_values(gpuhealth_gpu_up, cluster)"}},
        {"name": "node", "type": "query", "includeAll": False,
         "query": {"query": 'label_values(gpuhealth_gpu_up{cluster=~"$cluster"}, node)'}},
    ]}}
    assert variable_values(model, "n7", "2") == {"cluster": ".*", "node": "n7"}
    assert variable_queries(model) == {"cluster": "count by (cluster) (gpuhealth_gpu_up)",
                                       "node": 'count by (node) (gpuhealth_gpu_up{cluster=~"$cluster"})'}
