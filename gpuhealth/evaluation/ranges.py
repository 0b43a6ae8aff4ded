"""Range queries over long periods, as arrays on the evaluation grid (``NaN`` where a series is absent).

Prometheus answers at most 11,000 points per series, so long periods are asked for in chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuhealth.local.prometheus import PrometheusAPI

MAX_POINTS = 10000
QUERY_TIMEOUT = 1800.0

Labels = tuple[tuple[str, str], ...]


@dataclass
class Matrix:
    times: np.ndarray
    series: dict[Labels, np.ndarray]


def grid(start: float, end: float, step: float) -> np.ndarray:
    """Evaluation instants: multiples of ``step`` from the first at or after ``start``, to ``end``."""
    first = np.ceil(start / step) * step
    return first + step * np.arange(int((end - first) // step) + 1)


def range_matrix(api: PrometheusAPI, expr: str, times: np.ndarray) -> Matrix:
    step = float(times[1] - times[0]) if times.size > 1 else 60.0
    series: dict[Labels, np.ndarray] = {}
    for first in range(0, times.size, MAX_POINTS):
        last = min(first + MAX_POINTS, times.size) - 1
        for item in api.query_range(expr, times[first], times[last], step, timeout=QUERY_TIMEOUT):
            key = tuple(sorted(item["metric"].items()))
            values = series.setdefault(key, np.full(times.size, np.nan))
            points = np.array(item["values"], dtype=float)
            index = np.rint((points[:, 0] - times[0]) / step).astype(np.int64)
            values[index] = points[:, 1]
    return Matrix(times, series)


def label_text(labels: Labels) -> str:
    """OpenMetrics label text, without ``__name__``."""
    escaped = ((k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")) for k, v in labels)
    return ",".join(f'{k}="{v}"' for k, v in escaped if k != "__name__")
