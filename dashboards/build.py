"""The parts every gpuhealth dashboard shares, and the one pass that makes it importable.

Grafana's builders produce the dashboard model; ``finalise`` then adds what sharing needs and the
builders leave out: ``__inputs`` (so the import dialog asks for a Prometheus), ``__requires``,
unique panel ids and query refIds. It is the only place that touches the JSON after the builders.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gpuhealth.dashboards.panels import CLUSTER, DATASOURCE, NODE, selector
from gpuhealth.dashboards.queries import panels
from gpuhealth.dashboards.settings import Settings
from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm

DS_INPUT = "DS_PROMETHEUS"
GRAFANA_VERSION = "11.6.0"


def _label_variable(name: str, label: str, source: str, *, multi: bool) -> dashboard.QueryVariable:
    variable = (dashboard.QueryVariable(name).label(label).datasource(DATASOURCE)
                .query({"query": f"label_values({source}, {name})", "refId": f"{name}-values",
                        "qryType": 1})
                .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.NATURAL_ASC))
    if multi:
        variable = variable.multi(True).include_all(True).all_value(".*")
    return variable


def new_dashboard(uid: str, title: str, description: str, settings: Settings, *,
                  node: str = "", gpu: bool = False) -> dashboard.Dashboard:
    """A dashboard with the datasource and cluster pickers, plus node (``"multi"`` or ``"single"``) and gpu.

    ``cluster`` matches with a regex whose "All" is ``.*``, which also matches series without the
    label: single-cluster setups that never set it still see their data.
    """
    metric = settings.inventory_metric
    dash = (dashboard.Dashboard(title).uid(uid).description(description).tags([settings.tag])
            .time(settings.time_from, "now").refresh(settings.refresh).timezone("utc")
            .tooltip(dm.DashboardCursorSync.CROSSHAIR).editable()
            .link(dashboard.DashboardLink("gpuhealth").type(dm.DashboardLinkType.DASHBOARDS)
                  .tags([settings.tag]).as_dropdown(True).include_vars(True).keep_time(True))
            .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
                           .current(dm.VariableOption(text=f"${{{DS_INPUT}}}", value=f"${{{DS_INPUT}}}",
                                                      selected=True)))
            .with_variable(_label_variable("cluster", "Cluster", metric, multi=True)))
    if node:
        dash = dash.with_variable(_label_variable("node", "Node", f"{metric}{selector(CLUSTER)}",
                                                  multi=node == "multi"))
    if gpu:
        dash = dash.with_variable(_label_variable(
            "gpu", "GPU", metric + selector(CLUSTER, NODE), multi=False))
    return dash


def with_sections(dash: dashboard.Dashboard, sections: Sequence[tuple[str, Sequence[Any]]],
                  ) -> dashboard.Dashboard:
    """Each (row title, panels) as a row followed by its panels, packed left to right, top to bottom."""
    for title, panels_of_row in sections:
        dash = dash.with_row(dashboard.Row(title))
        for panel in panels_of_row:
            dash = dash.with_panel(panel)
    return dash


def finalise(dash: dashboard.Dashboard) -> dict[str, Any]:
    """The builder's dashboard as Grafana's "export for sharing externally" JSON."""
    model = json.loads(JSONEncoder().encode(dash.build()))
    panel_types = set()
    for panel_id, panel in enumerate(panels(model), start=1):
        panel["id"] = panel_id
        if panel["type"] != "row":
            panel_types.add(panel["type"])
        for index, target in enumerate(panel.get("targets", [])):
            target["refId"] = chr(ord("A") + index)
    model["__inputs"] = [{
        "name": DS_INPUT, "label": "Prometheus", "description": "Prometheus that scrapes gpuhealth",
        "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus",
    }]
    model["__requires"] = [
        {"type": "grafana", "id": "grafana", "name": "Grafana", "version": GRAFANA_VERSION},
        {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        *({"type": "panel", "id": kind, "name": kind, "version": ""} for kind in sorted(panel_types)),
    ]
    model.setdefault("annotations", {})["list"] = [{
        "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
        "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
        "type": "dashboard",
    }]
    return model


def to_json(model: dict[str, Any]) -> str:
    return json.dumps(model, indent=2, sort_keys=True) + "\n"
