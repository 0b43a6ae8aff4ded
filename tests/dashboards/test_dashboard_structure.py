"""The generated dashboards import into Grafana: ids, layout, datasource, variables, panel types, names."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from gpuhealth.dashboards.generate import render
from gpuhealth.dashboards.queries import Window, expand, panel_queries, panels
from gpuhealth.dashboards.settings import Settings

CONTRACT = (Path(__file__).resolve().parents[2] / "docs" / "contract.md").read_text()
DEPRECATED = {"graph", "singlestat", "table-old", "grafana-piechart-panel", "grafana-worldmap-panel"}
SUPPORTED = {"row", "timeseries", "stat", "table", "bargauge", "state-timeline", "status-history", "heatmap"}
VARIABLES = {
    "gpuhealth-fleet.json": {"datasource", "cluster", "node"},
    "gpuhealth-gpu.json": {"datasource", "cluster", "node", "gpu"},
    "gpuhealth-remediation.json": {"datasource", "cluster"},
}


@pytest.fixture(scope="module")
def models() -> dict[str, dict]:
    return {name: json.loads(text) for name, text in render().items()}


def test_three_dashboards_with_distinct_uids(models):
    assert set(models) == set(VARIABLES)
    uids = [m["uid"] for m in models.values()]
    assert len(set(uids)) == 3


def test_panel_ids_are_unique(models):
    for name, model in models.items():
        ids = [p["id"] for p in panels(model)]
        assert len(ids) == len(set(ids)), name
        assert all(isinstance(i, int) and i > 0 for i in ids), name


def test_grid_positions_are_sane_and_do_not_overlap(models):
    for name, model in models.items():
        boxes = []
        for panel in panels(model):
            g = panel["gridPos"]
            assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0, (name, panel["title"])
            assert g["x"] + g["w"] <= 24, (name, panel["title"])
            boxes.append((panel["title"], g))
        for (ta, a), (tb, b) in itertools.combinations(boxes, 2):
            apart = (a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"]
                     or a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"])
            assert apart, f"{name}: {ta!r} overlaps {tb!r}"


def test_datasource_comes_from_an_import_input_and_a_variable(models):
    for name, model in models.items():
        [ds_input] = model["__inputs"]
        assert ds_input["name"] == "DS_PROMETHEUS" and ds_input["type"] == "datasource", name
        assert ds_input["pluginId"] == "prometheus", name
        variable = next(v for v in model["templating"]["list"] if v["name"] == "datasource")
        assert variable["type"] == "datasource" and variable["query"] == "prometheus"
        assert variable["current"]["value"] == "${DS_PROMETHEUS}"
        for panel in panels(model):
            if panel["type"] == "row":
                continue
            refs = [panel["datasource"], *(t["datasource"] for t in panel["targets"])]
            assert all(ref == {"type": "prometheus", "uid": "${datasource}"} for ref in refs), panel["title"]
        uids = re.findall(r'"uid": "([^"]*)"', json.dumps(model))
        assert set(uids) <= {"${datasource}", "-- Grafana --", model["uid"]}, (name, uids)


def test_template_variables(models):
    for name, model in models.items():
        names = {v["name"] for v in model["templating"]["list"]}
        assert names == VARIABLES[name]
        for variable in model["templating"]["list"]:
            if variable["type"] == "query":
                assert variable["datasource"]["uid"] == "${datasource}"
    cluster = next(v for v in models["gpuhealth-fleet.json"]["templating"]["list"] if v["name"] == "cluster")
    assert cluster["includeAll"] and cluster["allValue"] == ".*"


def test_schema_version_is_current_and_no_deprecated_panels(models):
    for name, model in models.items():
        assert model["schemaVersion"] >= 39, name
        types = {p["type"] for p in panels(model)}
        assert not types & DEPRECATED, name
        assert types <= SUPPORTED, name
        required = {r["id"] for r in model["__requires"] if r["type"] == "panel"}
        assert required == types - {"row"}, name


def test_every_panel_is_titled_described_and_queries_something(models):
    for name, model in models.items():
        for panel in panels(model):
            if panel["type"] == "row":
                continue
            assert panel["title"] and panel["description"], (name, panel)
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), (name, panel["title"])
            assert all(t["expr"].strip() for t in panel["targets"])


def test_every_metric_name_is_in_the_contract(models):
    names = set()
    for model in models.values():
        for query in panel_queries(model):
            names |= set(re.findall(r"gpuhealth[_:][a-z0-9_:]+", query.expr))
    assert names, "no gpuhealth metric found in any query"
    for metric in sorted(names):
        base = re.sub(r"_bucket$", "", metric)
        assert f"`{base}" in CONTRACT or base.endswith(":"), f"{metric} is not in docs/contract.md"


def test_every_query_expands_with_concrete_variables(models):
    window = Window(start=0, end=3600, step=60)
    values = {"cluster": ".*", "node": "node-1", "gpu": "0", "datasource": "ignored"}
    for model in models.values():
        for query in panel_queries(model):
            expanded = expand(query.expr, values, window)
            assert "$__" not in expanded and "$node" not in expanded and "$gpu" not in expanded


def test_expand_rejects_unknown_variables_and_keeps_regex_groups():
    window = Window(start=0, end=600, step=15)
    assert expand('label_replace(x{node=~"$node"}, "s", "$1", "n", "(.*)")', {"node": "a"}, window) == \
        'label_replace(x{node=~"a"}, "s", "$1", "n", "(.*)")'
    assert expand("rate(x[$__rate_interval]) * $__range", {}, window) == "rate(x[60s]) * 600s"
    with pytest.raises(KeyError, match="nope"):
        expand("x{a=~\"$nope\"}", {}, window)


def test_non_default_settings_take_effect():
    settings = Settings(risk_warning=0.35, risk_critical=0.75, peer_band=(0.05, 0.95), top_gpus=7,
                        top_signals=2, lemon_nodes=4, latency_quantiles=(0.75,), nfs_op="READ",
                        inventory_metric="gpuhealth_gpu_info", time_from="now-7d", refresh="5m", tag="fleet")
    text = "".join(render(settings).values())
    default = "".join(render().values())
    for present, absent in [("0.35", "> 0.6)"), ("quantile(0.05,", "quantile(0.1,"), ("topk(7,", "topk(10,"),
                            ("topk by (node, gpu) (2,", "topk by (node, gpu) (3,"), ("topk(4,", None),
                            ('op=\\"READ\\"', 'op=\\"WRITE\\"'), ("histogram_quantile(0.75,", "(0.99,"),
                            ("label_values(gpuhealth_gpu_info", "label_values(gpuhealth_gpu_up"),
                            ('"now-7d"', '"now-24h"'), ('"5m"', None), ('"fleet"', None)]:
        assert present in text and present not in default, present
        if absent:
            assert absent in default and absent not in text, absent
    risk = json.loads(render(settings)["gpuhealth-fleet.json"])
    steps = next(p for p in panels(risk) if p["title"] == "Failure risk by node and GPU")
    assert [s["value"] for s in steps["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [None, 0.35, 0.75]


def test_risk_panels_follow_the_cluster_picker(models):
    """The rules keep `cluster` on every record, so each panel reading one filters by the picker."""
    risk = [query.expr for model in models.values() for query in panel_queries(model)
            if re.search(r"gpuhealth:(gpu|node)_(failure_risk|evidence)", query.expr)]
    assert risk, "no panel reads the risk or evidence records"
    for expr in risk:
        assert 'cluster=~"$cluster"' in expr, expr
