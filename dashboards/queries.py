"""The dashboards' queries as Grafana would send them, for tests and previews against a real Prometheus.

Grafana expands template variables and its interval macros before a query reaches Prometheus; this
module does the same expansion so that what is tested and previewed is exactly what users see.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)")
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*\}\}")


class PrometheusQueries(Protocol):
    """The two HTTP API reads Grafana makes; whoever runs the queries brings the client."""

    def query(self, expr: str, time: float | None = None) -> list[dict[str, Any]]: ...

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class PanelQuery:
    panel_id: int
    panel_title: str
    panel_type: str
    ref_id: str
    expr: str
    legend: str
    instant: bool


@dataclass(frozen=True)
class Window:
    """The time range a dashboard shows and the resolution Grafana would ask for."""

    start: float
    end: float
    step: float
    scrape_interval: float = 15.0

    @property
    def rate_interval(self) -> float:
        """Grafana's ``$__rate_interval``: at least four scrapes, and at least one step plus a scrape."""
        return max(self.step + self.scrape_interval, 4 * self.scrape_interval)


def panels(model: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included, in layout order."""
    for panel in model.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_queries(model: dict[str, Any]) -> list[PanelQuery]:
    return [
        PanelQuery(panel["id"], panel["title"], panel["type"], target["refId"], target["expr"],
                   target.get("legendFormat", ""), bool(target.get("instant")))
        for panel in panels(model) for target in panel.get("targets", [])
    ]


def variable_queries(model: dict[str, Any]) -> dict[str, str]:
    """Name -> PromQL equivalent of each ``label_values(selector, label)`` picker query."""
    out = {}
    for variable in model["templating"]["list"]:
        if variable["type"] != "query":
            continue
        found = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
        if not found:
            raise ValueError(f"variable {variable['name']}: unsupported query {variable['query']!r}")
        out[variable["name"]] = f"count by ({found[2]}) ({found[1]})"
    return out


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


def expand(expr: str, variables: dict[str, str], window: Window) -> str:
    """``expr`` with Grafana's macros and the template ``variables`` replaced; unknown names raise."""
    values = {
        "__rate_interval": _duration(window.rate_interval),
        "__interval": _duration(window.step),
        "__range": _duration(window.end - window.start),
        **variables,
    }

    def replace(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return values[name]

    return VARIABLE.sub(replace, expr)


def legend(fmt: str, labels: dict[str, str]) -> str:
    """A series' display name as Grafana derives it from ``legendFormat``."""
    if fmt:
        return LEGEND_LABEL.sub(lambda m: labels.get(m[1], ""), fmt)
    shown = {k: v for k, v in labels.items() if k != "__name__"}
    body = ", ".join(f'{k}="{v}"' for k, v in sorted(shown.items()))
    name = labels.get("__name__", "")
    return f"{name}{{{body}}}" if body else name


def run(api: PrometheusQueries, query: PanelQuery, variables: dict[str, str], window: Window,
        ) -> list[dict[str, Any]]:
    """The query's result as Grafana would fetch it: instant at the window's end, else a range."""
    expr = expand(query.expr, variables, window)
    if query.instant:
        return api.query(expr, time=window.end)
    return api.query_range(expr, window.start, window.end, window.step)


def riskiest_gpu(api: PrometheusQueries, window: Window) -> tuple[str, str]:
    """The (node, gpu) a user would drill into: the highest failure risk over the window.

    Falls back to the first GPU the inventory lists when no risk has been recorded.
    """
    span = _duration(window.end - window.start)
    for expr in (f"topk(1, max_over_time(gpuhealth:gpu_failure_risk:score[{span}]))",
                 f"topk(1, last_over_time(gpuhealth_gpu_up[{span}]))"):
        result = api.query(expr, time=window.end)
        if result:
            labels = result[0]["metric"]
            return labels["node"], labels["gpu"]
    raise LookupError("no GPU in Prometheus over the window: nothing to drill into")


def variable_values(model: dict[str, Any], node: str, gpu: str) -> dict[str, str]:
    """What a user would pick: "All" for multi-value pickers, the given node and GPU otherwise."""
    values = {}
    for variable in model["templating"]["list"]:
        name = variable["name"]
        if variable["type"] != "query":
            continue
        if variable.get("includeAll"):
            values[name] = variable["allValue"]
        else:
            values[name] = {"node": node, "gpu": gpu}[name]
    return values
