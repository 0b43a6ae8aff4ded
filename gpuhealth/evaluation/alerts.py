"""Every alert rule over the whole period, by range queries, with ``for:`` honoured as Prometheus does.

An alert is pending from the first evaluation at which its expression returns a series and fires
once it has returned it at every evaluation for the ``for:`` duration. A recording rule that errors
records nothing in Prometheus; when an alert's query fails, the records it reads are probed, those
Prometheus rejects are replaced by an empty vector and reported, and the alert is evaluated again.
Alerts reading ``ALERTS`` run last, on ALERTS series written from the others' results.

Queries run ``jobs`` at a time, the next ones submitted while a result is used, and results are used
in rule order: what a run produces does not depend on ``jobs``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gpuhealth.evaluation.expand import Expander
from gpuhealth.evaluation.ranges import PARALLEL, Labels, QueryPool, RangeQuery, grid
from gpuhealth.evaluation.rulefiles import Rule, RuleSet, selectors
from gpuhealth.local.prometheus import PrometheusAPI

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Episode:
    """Consecutive firing of one alert for one label set; times are evaluation instants (unix s)."""

    alert: str
    labels: Labels
    start: float
    end: float

    def label(self, name: str) -> str | None:
        return dict(self.labels).get(name)

    @property
    def node(self) -> str | None:
        return self.label("node")

    @property
    def gpu(self) -> str | None:
        return self.label("gpu")

    @property
    def action(self) -> str:
        return self.label("action") or "none"


@dataclass
class AlertRun:
    """What evaluating the rules produced: firing instants per alert and label set, and the errors."""

    times: np.ndarray
    firing: dict[str, dict[Labels, np.ndarray]] = field(default_factory=dict)
    pending: dict[str, dict[Labels, np.ndarray]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # rule name -> Prometheus's error

    def episodes(self) -> list[Episode]:
        out = []
        for alert, series in self.firing.items():
            for labels, fires in series.items():
                for a, b in runs(fires):
                    out.append(Episode(alert, labels, float(self.times[a]), float(self.times[b - 1])))
        return sorted(out, key=lambda e: (e.start, e.alert, e.labels))


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index pairs of the True stretches of ``mask``."""
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(), strict=True))


def fires(present: np.ndarray, for_seconds: float, step: float) -> np.ndarray:
    """Firing instants: the expression returned the series at this and every evaluation of the
    preceding ``for_seconds`` (Prometheus: firing once ``now - activeAt >= for``)."""
    index = np.arange(present.size)
    last_absent = np.maximum.accumulate(np.where(present, -1, index))
    held = index - last_absent  # evaluations in a row with the series, this one included
    return present & (held > math.ceil(for_seconds / step - 1e-9))


def _step(times: np.ndarray) -> float | None:
    return float(times[1] - times[0]) if times.size > 1 else None


def alert_labels(rule: Rule, labels: Labels) -> Labels:
    merged = {k: v for k, v in labels if k != "__name__"}
    merged.update(dict(rule.labels))
    merged["alertname"] = rule.name
    return tuple(sorted(merged.items()))


def reads_alerts(rule: Rule) -> bool:
    return any(s.name == "ALERTS" for s in selectors(rule.expr))


class AlertEvaluator:
    """Evaluates alert rules against one Prometheus over [start, end].

    Alerts are evaluated every ``step`` (the rules' interval). Alerts that read recording rules need
    the whole chain of records at every instant (folded in, or computed once and stored on the grid of
    ``fused_step``: see ``expand``), which dominates the cost on big fleets; ``fused_step`` (default
    ``step``) evaluates those less often, their state holding between evaluations as it does in
    Prometheus.
    """

    def __init__(
        self,
        api: PrometheusAPI,
        rules: RuleSet,
        start: float,
        end: float,
        step: float,
        fused_step: float | None = None,
        jobs: int = PARALLEL,
    ) -> None:
        self.api = api
        self.jobs = jobs
        self.rules = rules
        self.step = step
        self.fused_step = fused_step or step
        self.start, self.end = start, end
        self.expander = Expander(rules)
        self.times = grid(start, end, step)
        self.run = AlertRun(self.times)
        self._probed: set[str] = set()

    def step_for(self, rule: Rule) -> float:
        return self.fused_step if self.expander.records_used(rule.expr) else self.step

    def _times(self, rule: Rule) -> np.ndarray:
        return grid(self.start, self.end, self.step_for(rule))

    def _expr(self, rule: Rule) -> tuple[str, np.ndarray]:
        """The query that evaluates ``rule`` now (it changes as broken records are found)."""
        times = self._times(rule)
        return self.expander.expand(rule.expr, _step(times)), times

    def _find_broken_records(self, pool: QueryPool, rule: Rule, times: np.ndarray) -> bool:
        """Probe the records ``rule`` reads, dependencies first, at ``times``; mark those Prometheus
        rejects (in Prometheus they would record nothing). True when one was found."""
        found = False
        for name in self.expander.records_used(rule.expr):
            if name in self._probed:
                continue
            self._probed.add(name)
            try:
                pool.matrix(self.expander.definition(name, (), _step(times)), times)
            except RuntimeError as exc:
                log.warning("recording rule fails name=%s error=%r", name, str(exc))
                self.expander.mark_broken(name, str(exc))
                self.run.errors[name] = str(exc)
                found = True
        return found

    def _query(self, pool: QueryPool, rule: Rule, ahead: RangeQuery | None = None) -> RangeQuery | None:
        """The alert's query at its instants, answered; None (and the error noted) when Prometheus
        rejects it. ``ahead`` is its query submitted earlier, used if the expression is still the same."""
        expr, times = self._expr(rule)
        query = ahead if ahead is not None and ahead.expr == expr else pool.submit(expr, times)
        try:
            query.result()
            return query
        except RuntimeError as exc:
            if self._find_broken_records(pool, rule, times):
                return self._query(pool, rule)
            log.warning("alert rule fails name=%s error=%r", rule.name, str(exc))
            self.run.errors[rule.name] = str(exc)
            return None

    def evaluate(self, rule: Rule, pool: QueryPool | None = None, ahead: RangeQuery | None = None) -> None:
        if pool is None:
            with QueryPool(self.api, self.jobs) as own:
                self.evaluate(rule, own)
            return
        step = self.step_for(rule)
        times = self._times(rule)
        query = self._query(pool, rule, ahead)
        if query is None:
            return
        matrix = query.result()
        log.info(
            "alert evaluated name=%s step=%gs seconds=%.1f series=%d",
            rule.name,
            step,
            query.seconds,
            len(matrix.series),
        )
        # each instant of the evaluation grid takes the state of the last evaluation at or before it
        latest = np.searchsorted(times, self.times, side="right") - 1
        firing = self.run.firing.setdefault(rule.name, {})
        pending = self.run.pending.setdefault(rule.name, {})
        for labels, values in matrix.series.items():
            present = ~np.isnan(values)
            on = fires(present, rule.for_seconds, step)
            present, on = (np.where(latest >= 0, x[np.maximum(latest, 0)], False) for x in (present, on))
            key = alert_labels(rule, labels)
            if on.any():
                firing[key] = firing[key] | on if key in firing else on
            if (present & ~on).any():
                pending[key] = present & ~on

    def evaluate_all(self, rules: list[Rule], advance: Callable[[], None]) -> None:
        """Every rule, in order; the queries of the next ones run meanwhile (``QueryPool.ahead``)."""
        with QueryPool(self.api, self.jobs) as pool:
            for rule, ahead in pool.ahead(rules, self._expr):
                self.evaluate(rule, pool, ahead)
                advance()
