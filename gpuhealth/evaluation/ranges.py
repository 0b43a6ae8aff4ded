"""Range queries over long periods, as arrays on the evaluation grid (``NaN`` where a series is absent).

Prometheus answers at most 11,000 points per series, so long periods are asked for in chunks.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from gpuhealth.local.prometheus import PrometheusAPI

# Prometheus holds a range query's intermediate results for every instant at once: a fleet-wide rule
# chain over two weeks at one step a minute takes tens of GB. A bounded number of instants per query
# bounds that (Prometheus itself refuses more than 11,000), while each chunk re-evaluates the windows
# its subqueries reach back over (a day of temperature baseline): fewer, longer chunks waste less.
CHUNK_POINTS = 2000
QUERY_TIMEOUT = 1800.0
PARALLEL = max(1, os.cpu_count() or 1)

Labels = tuple[tuple[str, str], ...]


@dataclass
class Matrix:
    times: np.ndarray
    series: dict[Labels, np.ndarray]


def grid(start: float, end: float, step: float) -> np.ndarray:
    """Evaluation instants: multiples of ``step`` from the first at or after ``start``, to ``end``."""
    first = np.ceil(start / step) * step
    return first + step * np.arange(int((end - first) // step) + 1)


def range_matrix(api: PrometheusAPI, expr: str, times: np.ndarray, workers: int = PARALLEL) -> Matrix:
    """``expr`` at every instant of ``times`` (a regular grid), in chunks of at most ``CHUNK_POINTS``
    instants answered ``workers`` at a time: Prometheus evaluates one range query on one core."""
    step = float(times[1] - times[0]) if times.size > 1 else 60.0
    chunks = workers * -(-times.size // (workers * CHUNK_POINTS))  # every worker busy to the end
    bounds = np.linspace(0, times.size, min(chunks, times.size) + 1).astype(int)
    pieces = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        answers = list(
            pool.map(
                lambda p: api.query_range(expr, times[p[0]], times[p[1] - 1], step, timeout=QUERY_TIMEOUT),
                pieces,
            )
        )
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    series: dict[Labels, np.ndarray] = {}
    for answer in answers:
        for item in answer:
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
