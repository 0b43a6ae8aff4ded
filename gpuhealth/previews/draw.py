"""PNG previews of the dashboards, drawn with matplotlib from the same queries and the same data.

Each panel is placed by its ``gridPos`` and drawn the way its Grafana panel type draws it, close
enough that users can see what a dashboard shows before importing it. Every value comes from a real
Prometheus through :mod:`gpuhealth.dashboards.queries`; nothing is drawn that was not queried.
"""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib.dates as mdates
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from gpuhealth.dashboards.queries import PanelQuery, Window, legend, panel_queries, panels, run
from gpuhealth.local.prometheus import PrometheusAPI

log = logging.getLogger(__name__)

GRID_COLUMNS = 24
FIG_WIDTH_IN = 20.0
ROW_HEIGHT_IN = 0.36
HEADER_IN = 0.6
BACKGROUND, PANEL, TEXT, MUTED, GRIDLINE = "#111217", "#181b1f", "#ccccdc", "#8e8e9a", "#2c3235"
NAMED = {"green": "#73BF69", "orange": "#FF9830", "red": "#F2495C", "blue": "#5794F2", "yellow": "#FADE2A",
         "purple": "#B877D9", "transparent": "#00000000"}
PALETTE = ("#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9", "#705DA0",
           "#508642", "#CCA300", "#447EBC", "#C15C17")

Series = tuple[str, dict[str, str], list[tuple[float, float]]]


def colour(name: str) -> str:
    return NAMED.get(name, name)


def format_value(value: float, unit: str) -> str:
    """A compact reading in the panel's Grafana unit."""
    if value is None or math.isnan(value):
        return "-"
    if unit == "percentunit":
        return f"{value * 100:.0f}%"
    suffix = {"celsius": "°C", "watt": " W", "s": " s", "cps": "/s", "hertz": " Hz"}.get(unit, "")
    if unit == "s" and 0 < abs(value) < 1:
        return f"{value * 1000:.0f} ms"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{suffix.strip() or ''}".rstrip()
    return f"{value:.3g}{suffix}"


def _defaults(panel: dict[str, Any]) -> dict[str, Any]:
    return panel.get("fieldConfig", {}).get("defaults", {})


def _threshold_colour(panel: dict[str, Any], value: float) -> str:
    steps = _defaults(panel).get("thresholds", {}).get("steps", [{"value": None, "color": "green"}])
    chosen = steps[0]["color"]
    for step in steps[1:]:
        if value >= step["value"]:
            chosen = step["color"]
    return colour(chosen)


def _mapped(panel: dict[str, Any], value: float) -> tuple[str, str] | None:
    """(text, colour) from the panel's value mappings, if one matches."""
    if value is None or math.isnan(value) or value != int(value):
        return None
    for mapping in _defaults(panel).get("mappings", []):
        hit = mapping.get("options", {}).get(str(int(value)))
        if hit:
            return hit["text"], colour(hit["color"])
    return None


def _day_number(t: float) -> float:
    """A Unix time as matplotlib places dates on an axis (days since its epoch)."""
    return float(mdates.date2num(datetime.fromtimestamp(t, UTC)))


def _overrides(panel: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Display name -> {property id: value} from the panel's by-name overrides."""
    out: dict[str, dict[str, Any]] = {}
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        if override["matcher"]["id"] == "byName":
            out[override["matcher"]["options"]] = {p["id"]: p["value"] for p in override["properties"]}
    return out


class Previewer:
    """Draws one dashboard from one Prometheus over one window with fixed variable values."""

    def __init__(self, api: PrometheusAPI, window: Window, variables: dict[str, str]) -> None:
        self.api = api
        self.window = window
        self.variables = variables
        self.empty: list[str] = []  # titles of panels drawn as "No data"

    def series(self, query: PanelQuery) -> list[Series]:
        out = []
        for item in run(self.api, query, self.variables, self.window):
            points = item["values"] if "values" in item else [item["value"]]
            out.append((legend(query.legend, item["metric"]), item["metric"],
                        [(float(t), float(v)) for t, v in points]))
        return out

    def render(self, model: dict[str, Any], path: Path) -> Path:
        all_panels = list(panels(model))
        rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in all_panels)
        height = rows * ROW_HEIGHT_IN + HEADER_IN
        fig = Figure(figsize=(FIG_WIDTH_IN, height), facecolor=BACKGROUND)
        start = datetime.fromtimestamp(self.window.start, UTC).strftime("%Y-%m-%d %H:%M")
        end = datetime.fromtimestamp(self.window.end, UTC).strftime("%H:%M UTC")
        chosen = "  ".join(f"{k}={v}" for k, v in self.variables.items())
        fig.text(0.005, 1 - 0.25 / height, model["title"], color=TEXT, fontsize=15, weight="bold",
                 va="center")
        fig.text(0.995, 1 - 0.25 / height, f"{start} to {end}    {chosen}", color=MUTED, fontsize=9,
                 ha="right", va="center")
        queries: dict[int, list[PanelQuery]] = {}
        for query in panel_queries(model):
            queries.setdefault(query.panel_id, []).append(query)
        for panel in all_panels:
            g = panel["gridPos"]
            pad_x, pad_y = 0.06 / FIG_WIDTH_IN, 0.06 / height
            left = g["x"] / GRID_COLUMNS + pad_x
            top = 1 - (HEADER_IN + g["y"] * ROW_HEIGHT_IN) / height
            width = g["w"] / GRID_COLUMNS - 2 * pad_x
            panel_height = g["h"] * ROW_HEIGHT_IN / height - 2 * pad_y
            if panel["type"] == "row":
                fig.text(left, top - panel_height / 2, panel["title"], color=TEXT, fontsize=12, weight="bold",
                         va="center")
                continue
            self._panel(fig, panel, queries.get(panel["id"], []), (left, top - pad_y - panel_height,
                                                                  width, panel_height), height)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=80, facecolor=BACKGROUND)
        log.info("preview path=%s panels=%d", path, len(all_panels))
        return path

    def _panel(self, fig: Figure, panel: dict[str, Any], queries: list[PanelQuery],
               rect: tuple[float, float, float, float], fig_height: float) -> None:
        left, bottom, width, height = rect
        frame = fig.add_axes(rect)
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(GRIDLINE)
        title_h = 0.3 / fig_height
        fig.text(left + 0.004, bottom + height - title_h / 2, panel["title"], color=TEXT, fontsize=10,
                 weight="bold", va="center")
        inner = (left + 0.03 * width + 0.02, bottom + 0.06 * height, width * 0.94 - 0.02,
                 height - title_h - 0.1 * height)
        results = [(q, self.series(q)) for q in queries]
        draw = {"timeseries": self._timeseries, "stat": self._stat, "bargauge": self._bargauge,
                "table": self._table, "state-timeline": self._timeline}[panel["type"]]
        if not any(series for _, series in results):
            self.empty.append(panel["title"])
            fig.text(left + width / 2, bottom + height / 2, "No data", color=MUTED, ha="center", va="center")
            return
        draw(fig, panel, results, inner)

    def _time_axis(self, ax: Axes) -> None:
        ax.xaxis_date(UTC)
        ax.set_xlim(_day_number(self.window.start), _day_number(self.window.end))
        span = self.window.end - self.window.start
        fmt = "%H:%M:%S" if span <= 600 else "%H:%M" if span <= 86400 else "%m-%d %H:%M"
        ax.xaxis.set_major_formatter(mdates.DateFormatter(fmt, tz=UTC))
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(maxticks=6))

    @staticmethod
    def _style(ax: Axes) -> None:
        ax.set_facecolor(PANEL)
        ax.tick_params(colors=MUTED, labelsize=7, length=0)
        ax.grid(color=GRIDLINE, linewidth=0.5)
        for spine in ax.spines.values():
            spine.set_visible(False)

    def _timeseries(self, fig: Figure, panel: dict[str, Any], results, rect) -> None:
        left, bottom, width, height = rect
        ax = fig.add_axes((left + 0.025, bottom + 0.12 * height, width - 0.03, height * 0.78))
        self._style(ax)
        unit = _defaults(panel).get("unit", "")
        overrides = _overrides(panel)
        custom = _defaults(panel).get("custom", {})
        bars = custom.get("drawStyle") == "bars"
        stacked = custom.get("stacking", {}).get("mode") == "normal"
        drawn: dict[str, tuple[list[float], list[float]]] = {}
        bottoms: dict[float, float] = {}
        index = 0
        for _query, series in results:
            for name, _labels, points in series:
                times = [_day_number(t) for t, _ in points]
                values = [v for _, v in points]
                props = overrides.get(name, {})
                fixed = props.get("color", {}).get("fixedColor")
                line_colour = fixed or PALETTE[index % len(PALETTE)]
                index += 1
                drawn[name] = (times, values)
                if bars:
                    base = [bottoms.get(t, 0.0) if stacked else 0.0 for t, _ in points]
                    ax.bar(times, values, bottom=base, width=self.window.step / 86400 * 0.9,
                           color=line_colour, label=name, linewidth=0)
                    if stacked:
                        for (t, v), b in zip(points, base, strict=True):
                            bottoms[t] = b + (0.0 if math.isnan(v) else v)
                elif props.get("custom.lineWidth", 1) > 0:
                    ax.plot(times, values, color=line_colour, linewidth=props.get("custom.lineWidth", 1),
                            label=name)
        for name, props in overrides.items():
            low = props.get("custom.fillBelowTo")
            if low and name in drawn and low in drawn:
                times, high_values = drawn[name]
                low_by_time = dict(zip(*drawn[low], strict=True))
                ax.fill_between(times, [low_by_time.get(t, math.nan) for t in times], high_values,
                                color=props["color"]["fixedColor"], alpha=0.3, linewidth=0,
                                label=f"{low}-{name.split()[-1]}")
        self._time_axis(ax)
        if "min" in _defaults(panel):
            ax.set_ylim(bottom=_defaults(panel)["min"])
        ax.yaxis.set_major_formatter(lambda v, _pos: format_value(v, unit))
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            shown = min(len(handles), 8)
            ax.legend(handles[:shown], labels[:shown], loc="upper left", fontsize=6, ncol=min(shown, 4),
                      frameon=False, labelcolor=TEXT, bbox_to_anchor=(0, -0.08))

    def _stat(self, fig: Figure, panel: dict[str, Any], results, rect) -> None:
        left, bottom, width, height = rect
        unit = _defaults(panel).get("unit", "")
        values = [(name, pts[-1][1]) for _, series in results for name, _, pts in series]
        name, value = values[0]
        mapped = _mapped(panel, value)
        text, shade = mapped or (format_value(value, unit), _threshold_colour(panel, value))
        box = fig.add_axes((left - 0.01, bottom, width + 0.01, height))
        box.set_axis_off()
        box.add_patch(Rectangle((0, 0), 1, 1, transform=box.transAxes, color=shade, alpha=0.85))
        box.text(0.5, 0.55, text, color="white", fontsize=26, weight="bold", ha="center", va="center",
                 transform=box.transAxes)
        box.text(0.5, 0.12, name, color="white", fontsize=8, ha="center", transform=box.transAxes)

    def _bargauge(self, fig: Figure, panel: dict[str, Any], results, rect) -> None:
        left, bottom, width, height = rect
        unit = _defaults(panel).get("unit", "")
        bars = [(name, pts[-1][1]) for _, series in results for name, _, pts in series][:12]
        names = [n for n, _ in bars]
        values = [0.0 if math.isnan(v) else v for _, v in bars]
        rows = range(len(bars))
        ax = fig.add_axes((left + width * 0.3, bottom, width * 0.55, height))
        self._style(ax)
        ax.grid(False)
        full = _defaults(panel).get("max", max([*values, 1e-9]))
        ax.barh(rows, [full] * len(bars), color=GRIDLINE, height=0.7)
        ax.barh(rows, values, color=[_threshold_colour(panel, v) for v in values], height=0.7)
        ax.set_ylim(max(len(bars), 6) - 0.5, -0.5)
        ax.set_yticks(rows, names, fontsize=7, color=TEXT)
        ax.set_xticks([])
        for i, v in enumerate(values):
            ax.text(1.01, i, format_value(v, unit), transform=ax.get_yaxis_transform(), color=TEXT,
                    fontsize=7, va="center")

    def _table(self, fig: Figure, panel: dict[str, Any], results, rect) -> None:
        height = rect[3]
        organise: dict[str, Any] = next(
            (t["options"] for t in panel.get("transformations", []) if t["id"] == "organize"), {})
        hidden = {name for name, hide in organise.get("excludeByName", {}).items() if hide}
        value_name = organise.get("renameByName", {}).get("Value", "Value")
        unit = _defaults(panel).get("unit", "")
        rows = []
        for _, series in results:
            for _name, labels, pts in series:
                row = {k: v for k, v in labels.items() if k not in hidden}
                if "Value" not in hidden:
                    row[value_name] = pts[-1][1]
                rows.append(row)
        sort_spec: dict[str, Any] = next(iter(panel.get("options", {}).get("sortBy", [])), {})
        sort_by = sort_spec.get("displayName")
        if sort_by:
            rows.sort(key=lambda r: -r.get(sort_by, -math.inf))
        columns = list(dict.fromkeys(k for r in rows for k in r if k != value_name))
        columns += [value_name] if any(value_name in r for r in rows) else []
        ax = fig.add_axes(rect)
        ax.set_axis_off()
        capacity = max(1, int(height * fig.get_figheight() / 0.2) - 1)
        cells = [[format_value(r[c], unit) if c == value_name else str(r.get(c, "")) for c in columns]
                 for r in rows[:capacity]]
        step = 1 / (capacity + 1)
        for j, name in enumerate(columns):
            ax.text(j / len(columns), 1 - step / 2, name, color=MUTED, fontsize=7, weight="bold", va="center",
                    transform=ax.transAxes)
            for i, cell_row in enumerate(cells):
                ax.text(j / len(columns), 1 - step * (i + 1.5), cell_row[j][:40], color=TEXT, fontsize=7,
                        va="center", transform=ax.transAxes)

    def _timeline(self, fig: Figure, panel: dict[str, Any], results, rect) -> None:
        left, bottom, width, height = rect
        series = [s for _, found in results for s in found]
        series.sort(key=lambda s: s[0])
        columns = round((self.window.end - self.window.start) / self.window.step) + 1
        grid = np.zeros((len(series), columns, 4))
        for i, (_name, _labels, points) in enumerate(series):
            for t, v in points:
                j = round((t - self.window.start) / self.window.step)
                if 0 <= j < columns and not math.isnan(v):
                    mapped = _mapped(panel, v)
                    grid[i, j] = to_rgba(mapped[1] if mapped else _threshold_colour(panel, v))
        label_w = 0.07 if width > 0.5 else 0.12 * width / 0.5
        ax = fig.add_axes((left + label_w, bottom + 0.1 * height, width - label_w, height * 0.88))
        self._style(ax)
        ax.grid(False)
        start, end = _day_number(self.window.start), _day_number(self.window.end)
        ax.imshow(grid, aspect="auto", interpolation="nearest", extent=(start, end, len(series) - 0.5, -0.5))
        self._time_axis(ax)
        points_per_row = 72 * height * fig.get_figheight() * 0.88 / len(series)
        size = max(4.0, min(7.0, points_per_row * 0.75))
        ax.set_yticks(range(len(series)), [s[0] for s in series], fontsize=size, color=TEXT)
