"""The query pool: chunks of several queries in flight, results handed back in submission order."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from gpuhealth.evaluation import ranges
from gpuhealth.evaluation.ranges import QueryPool
from gpuhealth.local.process import wait_until


class FakeAPI:
    """Answers ``value(expr)`` at every instant; counts the queries in flight at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.in_flight = 0
        self.most = 0
        self.release = threading.Event()

    def query_range(
        self, expr: str, start: float, end: float, step: float, timeout: float
    ) -> list[dict[str, Any]]:
        with self.lock:
            self.started.append(expr)
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        self.release.wait(timeout=10)
        with self.lock:
            self.in_flight -= 1
        if expr == "bad":
            raise RuntimeError("bad_data: parse error")
        points = [[t, str(float(expr))] for t in np.arange(start, end + step / 2, step).tolist()]
        return [{"metric": {"q": expr}, "values": points}]


def test_results_come_back_in_order_with_jobs_chunks_in_flight(monkeypatch: Any) -> None:
    monkeypatch.setattr(ranges, "CHUNK_POINTS", 10)
    api = FakeAPI()
    times = 60.0 * np.arange(40)
    submitted: list[str] = []
    with QueryPool(api, 3) as pool:  # type: ignore[arg-type]  # a duck-typed PrometheusAPI
        submit = pool.submit
        monkeypatch.setattr(pool, "submit", lambda expr, t: submitted.append(expr) or submit(expr, t))
        order = pool.ahead(range(8), lambda i: (str(i), times))
        first, query = next(order)
        assert submitted == [str(i) for i in range(6)]  # twice the jobs ahead of the one in use
        wait_until(lambda: api.in_flight == 3, timeout=10)
        assert api.started == ["0"] * 3  # the first query's chunks go first
        api.release.set()
        got = [(first, query.result())] + [(i, q.result()) for i, q in order]
    assert [i for i, _ in got] == list(range(8))
    for i, matrix in got:
        (values,) = matrix.series.values()
        assert np.array_equal(values, np.full(times.size, float(i)))  # every chunk in its place
    assert api.most == 3
    assert all(q.seconds > 0 for q in [query])  # the span its chunks ran, for the log


def test_a_rejected_query_raises_prometheus_error() -> None:
    api = FakeAPI()
    api.release.set()
    with QueryPool(api, 2) as pool, pytest.raises(RuntimeError, match="parse error"):  # type: ignore[arg-type]  # a duck-typed PrometheusAPI
        pool.matrix("bad", 60.0 * np.arange(5))
