"""Range queries over long periods, as arrays on the evaluation grid (``NaN`` where a series is absent).

Prometheus answers at most 11,000 points per series, so long periods are asked for in chunks. Prometheus
evaluates one range query on one core: a ``QueryPool`` keeps ``jobs`` chunks in flight at once, the
chunks of several queries queued behind each other, so every core stays busy to the last chunk.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

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
T = TypeVar("T")


@dataclass
class Matrix:
    times: np.ndarray
    series: dict[Labels, np.ndarray]


def grid(start: float, end: float, step: float) -> np.ndarray:
    """Evaluation instants: multiples of ``step`` from the first at or after ``start``, to ``end``."""
    first = np.ceil(start / step) * step
    return first + step * np.arange(int((end - first) // step) + 1)


def _pieces(size: int, workers: int) -> list[tuple[int, int]]:
    """[start, end) index pairs of at most ``CHUNK_POINTS`` instants, a multiple of ``workers`` of them
    so every worker is busy to the end of a query of its own."""
    chunks = workers * -(-size // (workers * CHUNK_POINTS))
    bounds = np.linspace(0, size, min(chunks, size) + 1).astype(int)
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))


def _assemble(times: np.ndarray, step: float, answers: list[list[dict[str, Any]]]) -> Matrix:
    series: dict[Labels, np.ndarray] = {}
    for answer in answers:
        for item in answer:
            key = tuple(sorted(item["metric"].items()))
            values = series.setdefault(key, np.full(times.size, np.nan))
            points = np.array(item["values"], dtype=float)
            index = np.rint((points[:, 0] - times[0]) / step).astype(np.int64)
            values[index] = points[:, 1]
    return Matrix(times, series)


class RangeQuery:
    """One range query whose chunks are queued on a ``QueryPool``; ``result`` waits for them."""

    def __init__(self, pool: QueryPool, expr: str, times: np.ndarray) -> None:
        self.expr = expr
        self.times = times
        self.step = float(times[1] - times[0]) if times.size > 1 else 60.0
        self._api = pool.api
        self._spans: list[tuple[float, float]] = []  # when each chunk ran
        self._matrix: Matrix | None = None
        self._chunks: list[Future[list[dict[str, Any]]]] = [
            pool.executor.submit(self._chunk, times[a], times[b - 1])
            for a, b in _pieces(times.size, pool.jobs)
        ]

    def _chunk(self, start: float, end: float) -> list[dict[str, Any]]:
        began = time.monotonic()
        try:
            return self._api.query_range(self.expr, start, end, self.step, timeout=QUERY_TIMEOUT)
        finally:
            self._spans.append((began, time.monotonic()))

    @property
    def seconds(self) -> float:
        """Wall time from its first chunk's start to its last chunk's end (other queries' chunks may
        have run meanwhile)."""
        return max(b for _, b in self._spans) - min(a for a, _ in self._spans) if self._spans else 0.0

    def result(self) -> Matrix:
        """The matrix, assembled once; Prometheus's error (``RuntimeError``) when it rejected a chunk."""
        if self._matrix is None:
            try:
                answers = [chunk.result() for chunk in self._chunks]
            except BaseException:
                for chunk in self._chunks:
                    chunk.cancel()
                raise
            self._matrix = _assemble(self.times, self.step, answers)
        return self._matrix


class QueryPool:
    """``jobs`` range-query chunks in flight against one Prometheus; a context manager.

    Queries submitted ahead of their turn (``ahead``) run while earlier results are used, and are
    handed back in submission order, so what is built from them does not depend on ``jobs``.
    """

    def __init__(self, api: PrometheusAPI, jobs: int = PARALLEL) -> None:
        self.api = api
        self.jobs = max(1, jobs)
        self.executor = ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="range-query")

    def __enter__(self) -> QueryPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def submit(self, expr: str, times: np.ndarray) -> RangeQuery:
        return RangeQuery(self, expr, times)

    def matrix(self, expr: str, times: np.ndarray) -> Matrix:
        return self.submit(expr, times).result()

    def ahead(
        self, items: Iterable[T], query: Callable[[T], tuple[str, np.ndarray]]
    ) -> Iterator[tuple[T, RangeQuery]]:
        """Each item with its query (``query(item)``: expression and instants), in order, the next
        ``2 * jobs`` submitted ahead. ``query`` is called in the caller's thread, before the items
        ahead of it are handed back: a consumer whose handling of an item changes what a later item
        asks for compares ``RangeQuery.expr`` with what it would ask now."""
        window: deque[tuple[T, RangeQuery]] = deque()
        pending = iter(items)
        while True:
            for item in pending:
                window.append((item, self.submit(*query(item))))
                if len(window) >= 2 * self.jobs:
                    break
            if not window:
                return
            yield window.popleft()


def range_matrix(api: PrometheusAPI, expr: str, times: np.ndarray, workers: int = PARALLEL) -> Matrix:
    """``expr`` at every instant of ``times`` (a regular grid), in chunks of at most ``CHUNK_POINTS``
    instants answered ``workers`` at a time."""
    with QueryPool(api, workers) as pool:
        return pool.matrix(expr, times)


def label_text(labels: Labels) -> str:
    """OpenMetrics label text, without ``__name__``."""
    escaped = ((k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")) for k, v in labels)
    return ",".join(f'{k}="{v}"' for k, v in escaped if k != "__name__")
