"""Small constructors over Grafana's typed builders, so each dashboard module reads as a layout.

Every panel queries the dashboard's ``$datasource`` variable, never a fixed datasource uid, so that
the JSON imports into any Grafana and points at whichever Prometheus the user picks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from grafana_foundation_sdk.builders import (
    bargauge,
    common,
    dashboard,
    prometheus,
    stat,
    statetimeline,
    table,
    timeseries,
)
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
GRID_WIDTH = 24

CLUSTER = 'cluster=~"$cluster"'
NODE = 'node=~"$node"'
GPU = 'gpu=~"$gpu"'


def selector(*matchers: str) -> str:
    """``{a, b}`` from the non-empty matchers; PromQL accepts an empty selector on a metric name."""
    kept = [m for m in matchers if m]
    return "{" + ", ".join(kept) + "}" if kept else ""


def events(series: str, window: str, by: str) -> str:
    """How many events a counter such as ``gpuhealth_xid_events_total`` counted over ``window``.

    ``increase`` misses the first event of a counter that only appears once its event happened (the
    series starts at 1 with no earlier sample), and for an XID that first one matters most; a series
    absent ``window`` ago counts from 0 here. Counter resets are clamped to 0.
    """
    now = f"sum by ({by}) ({series})"
    return f"clamp_min({now} - (sum by ({by}) ({series} offset {window}) or 0 * {now}), 0)"


def query(expr: str, legend: str = "", *, instant: bool = False, table_format: bool = False,
          ) -> prometheus.Dataquery:
    target = prometheus.Dataquery().expr(expr).datasource(DATASOURCE)
    target = target.instant() if instant else target.range()
    if legend:
        target = target.legend_format(legend)
    if table_format:
        target = target.format(pm.PromQueryFormat.TABLE)
    return target


def thresholds(*steps: tuple[float | None, str]) -> dashboard.ThresholdsConfig:
    """Colour steps; the first step's value is ``None`` (from minus infinity)."""
    return (dashboard.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE)
            .steps([dm.Threshold(value=v, color=c) for v, c in steps]))


def value_text(mapping: dict[str, tuple[str, str]]) -> list[dm.ValueMapping]:
    """Map raw values to (text, colour), e.g. a 0/1 gauge to "closed"/"open"."""
    return [dm.ValueMap(options={raw: dm.ValueMappingResult(text=text, color=color, index=i)
                                 for i, (raw, (text, color)) in enumerate(mapping.items())})]


def _common(panel, title: str, description: str, targets: Iterable[prometheus.Dataquery], *, w: int,
            h: int, unit: str):
    panel = panel.title(title).description(description).datasource(DATASOURCE).span(w).height(h)
    if unit:
        panel = panel.unit(unit)
    for target in targets:
        panel = panel.with_target(target)
    return panel


def _legend(right: bool = False) -> common.VizLegendOptions:
    legend = common.VizLegendOptions().show_legend(True)
    if right:
        return (legend.display_mode(cm.LegendDisplayMode.TABLE).placement(cm.LegendPlacement.RIGHT)
                .calcs(["max", "lastNotNull"]))
    return legend.display_mode(cm.LegendDisplayMode.LIST).placement(cm.LegendPlacement.BOTTOM)


def timeseries_panel(title: str, description: str, targets: Sequence[prometheus.Dataquery], *, w: int = 12,
                     h: int = 8, unit: str = "", bars: bool = False, stacked: bool = False,
                     legend_right: bool = False, min_val: float | None = None) -> timeseries.Panel:
    panel = _common(timeseries.Panel(), title, description, targets, w=w, h=h, unit=unit)
    panel = panel.legend(_legend(legend_right)).tooltip(
        common.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
    if bars:
        panel = panel.draw_style(cm.GraphDrawStyle.BARS).fill_opacity(80).line_width(1)
    else:
        panel = panel.fill_opacity(10).line_width(1).show_points(cm.VisibilityMode.NEVER)
    if stacked:
        panel = panel.stacking(common.StackingConfig().mode(cm.StackingMode.NORMAL))
    if min_val is not None:
        panel = panel.min(min_val)
    return panel


def band(panel: timeseries.Panel, low: str, high: str, colour: str) -> timeseries.Panel:
    """Shade between the ``low`` and ``high`` series (by display name) like a percentile band."""
    shared = [dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": colour}),
              dm.DynamicConfigValue(id_val="custom.lineWidth", value=0)]
    return (panel
            .override_by_name(high, [*shared, dm.DynamicConfigValue(id_val="custom.fillBelowTo", value=low),
                                     dm.DynamicConfigValue(id_val="custom.fillOpacity", value=25)])
            .override_by_name(low, [*shared, dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0)]))


def fixed_colour(panel, name: str, colour: str, width: float = 1):
    return panel.override_by_name(name, [
        dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": colour}),
        dm.DynamicConfigValue(id_val="custom.lineWidth", value=width),
        dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
    ])


def stat_panel(title: str, description: str, targets: Sequence[prometheus.Dataquery], *, w: int = 6,
               h: int = 4, unit: str = "", steps: dashboard.ThresholdsConfig | None = None,
               mappings: list[dm.ValueMapping] | None = None) -> stat.Panel:
    panel = _common(stat.Panel(), title, description, targets, w=w, h=h, unit=unit)
    panel = (panel.color_mode(cm.BigValueColorMode.BACKGROUND).graph_mode(cm.BigValueGraphMode.NONE)
             .text_mode(cm.BigValueTextMode.VALUE_AND_NAME)
             .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
             .thresholds(steps or thresholds((None, "blue"))))
    if mappings:
        panel = panel.mappings(mappings)
    return panel


def table_panel(title: str, description: str, targets: Sequence[prometheus.Dataquery], *, w: int = 12,
                h: int = 8, unit: str = "", hide: Sequence[str] = (), rename: dict[str, str] | None = None,
                sort_by: str = "") -> table.Panel:
    """Instant queries in table format, merged on their shared labels into one row per key."""
    panel = _common(table.Panel(), title, description, targets, w=w, h=h, unit=unit)
    panel = panel.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
    panel = panel.with_transformation(dm.DataTransformerConfig(id_val="organize", options={
        "excludeByName": {"Time": True, **{name: True for name in hide}},
        "renameByName": dict(rename or {}),
    }))
    if sort_by:
        panel = panel.sort_by([common.TableSortByFieldState().display_name(sort_by).desc(True)])
    return panel


def state_timeline_panel(title: str, description: str, targets: Sequence[prometheus.Dataquery], *,
                         w: int = 12, h: int = 8, unit: str = "",
                         steps: dashboard.ThresholdsConfig | None = None,
                         mappings: list[dm.ValueMapping] | None = None) -> statetimeline.Panel:
    panel = _common(statetimeline.Panel(), title, description, targets, w=w, h=h, unit=unit)
    panel = (panel.show_value(cm.VisibilityMode.NEVER).merge_values(False).row_height(0.9).fill_opacity(80)
             .legend(common.VizLegendOptions().show_legend(False).display_mode(cm.LegendDisplayMode.LIST)
                     .placement(cm.LegendPlacement.BOTTOM))
             .color_scheme(dashboard.FieldColor().mode(dm.FieldColorModeId.THRESHOLDS))
             .thresholds(steps or thresholds((None, "green"))))
    if mappings:
        panel = panel.mappings(mappings)
    return panel


def bargauge_panel(title: str, description: str, targets: Sequence[prometheus.Dataquery], *, w: int = 12,
                   h: int = 8, unit: str = "", steps: dashboard.ThresholdsConfig | None = None,
                   max_val: float | None = None) -> bargauge.Panel:
    """Horizontal bars; ``max_val`` fixes the full bar (a 0..1 score), else the largest value fills it."""
    panel = _common(bargauge.Panel(), title, description, targets, w=w, h=h, unit=unit)
    if max_val is not None:
        panel = panel.min(0).max(max_val)
    return (panel.display_mode(cm.BarGaugeDisplayMode.GRADIENT).orientation(cm.VizOrientation.HORIZONTAL)
            .show_unfilled(True)
            .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .thresholds(steps or thresholds((None, "blue"))))
