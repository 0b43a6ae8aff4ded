"""The evaluation's rules in vmalert over VictoriaMetrics, to hold them to what Prometheus gives.

The fleet's TSDB blocks go into VictoriaMetrics with ``vmctl prometheus``; ``vmalert -replay`` then
evaluates the rules over the period. vmalert replays one rule at a time and pushes its results into a
remote-write queue that flushes every ``-remoteWrite.flushInterval``: a rule reading another's record
sees it only if that flush, and VictoriaMetrics' ingestion, ended within ``-replay.rulesDelay``, a
race on a loaded machine. So the replay runs in passes, as the evaluation does (``fleet.store_records``
and ``benchmark.evaluate_alerts``): the recording rules level by level (each level reads only records
of the levels before it), VictoriaMetrics flushed between levels; then every alert; then the rules
reading ``ALERTS``, writing into a second VictoriaMetrics so that each reads only the other alerts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from gpuhealth.evaluation.alerts import Episode, reads_alerts, runs
from gpuhealth.evaluation.rulefiles import Rule, RuleSet, selectors
from gpuhealth.local.victoria import STALE_NAN, VictoriaMetricsServer, vmalert_replay, vmctl_import

# Prometheus's lookback for instant selectors, 5 min, as the least and the most VictoriaMetrics looks
# back. Backfilled blocks hold no staleness markers and are thinned where values stand still
# (``openmetrics.Thinning``), so Prometheus reads a series' last sample for its whole lookback;
# VictoriaMetrics, left to itself, for about one sample interval. VictoriaMetrics leaves the window's
# start out, so a series that stops is read one evaluation less than in Prometheus 2; 5m1s would
# include it, but 1.79 then widens every range shorter than that, `rate(x[5m])` too.
LOOKBACK_ARGS = ("-search.minStalenessInterval=5m", "-search.maxStalenessInterval=5m")
# Labels vmalert adds to ALERTS that Prometheus does not.
VMALERT_LABELS = ("alertgroup", "alertstate", "__name__")


def _reads(rule: Rule) -> set[str]:
    return {s.name for s in selectors(rule.expr) if s.name is not None}


@dataclass
class Passes:
    """The order vmalert replays the rules in: ``records`` level by level, then ``alerts``, then
    ``readers`` (the alerts reading ALERTS)."""

    records: list[list[Rule]]
    alerts: list[Rule]
    readers: list[Rule]

    @classmethod
    def of(cls, rules: RuleSet) -> Passes:
        if reading := [r.name for r in rules.records if reads_alerts(r)]:
            raise ValueError(f"recording rules reading ALERTS cannot be replayed in passes: {reading}")
        recorders: dict[str, list[Rule]] = {}
        for rule in rules.records:
            recorders.setdefault(rule.name, []).append(rule)
        level: dict[Rule, int] = {}

        def level_of(rule: Rule, seen: tuple[Rule, ...]) -> int:
            if rule in seen:
                raise ValueError(f"recording rules read each other in a cycle: {[r.name for r in seen]}")
            if rule not in level:
                feeding = [r for name in _reads(rule) for r in recorders.get(name, [])]
                level[rule] = 1 + max((level_of(r, (*seen, rule)) for r in feeding), default=-1)
            return level[rule]

        for rule in rules.records:
            level_of(rule, ())
        depth = max(level.values(), default=-1) + 1
        levels = [[r for r in rules.records if level[r] == k] for k in range(depth)]
        readers = [r for r in rules.alerts if reads_alerts(r)]
        return cls(levels, [r for r in rules.alerts if r not in readers], readers)


def write_rule_file(rules: Iterable[Rule], path: Path) -> Path:
    """``rules`` as one rule file, in their own groups and intervals (the group's name labels ALERTS)."""
    groups: dict[tuple[str, float], list[dict[str, object]]] = {}
    for rule in rules:
        entry: dict[str, object] = {rule.kind: rule.name, "expr": rule.expr}
        if rule.for_seconds:
            entry["for"] = f"{rule.for_seconds:g}s"
        if rule.labels:
            entry["labels"] = dict(rule.labels)
        groups.setdefault((rule.group, rule.interval), []).append(entry)
    data = {"groups": [{"name": name, "interval": f"{interval:g}s", "rules": entries}
                       for (name, interval), entries in groups.items()]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def end_records(server: VictoriaMetricsServer, rules: list[Rule], start: float, end: float) -> int:
    """Write a staleness marker one interval after each run of the series ``rules`` record, as rule
    evaluation does live (and as the evaluation's exact reads of stored records assume: see
    ``expand``); replayed records have none, and would linger for the lookback. Returns how many."""
    intervals: dict[str, float] = {}
    for rule in rules:
        intervals[rule.name] = min(intervals.get(rule.name, rule.interval), rule.interval)
    if not intervals:
        return 0
    markers = []
    names = "|".join(intervals)
    for series in server.export(f'{{__name__=~"{names}"}}', start, end):
        step = intervals[series["metric"]["__name__"]]
        times = np.array(series["timestamps"]) / 1000
        last = times[np.append(np.diff(times) > step * 1.5, True)] + step
        if (after := last[last <= end]).size:
            markers.append((series["metric"], [(float(t), STALE_NAN) for t in after]))
    if markers:
        server.remote_write(markers)
    return sum(len(samples) for _, samples in markers)


def alert_episodes(server: VictoriaMetricsServer, rules: RuleSet, start: float, end: float) -> list[Episode]:
    """The firing episodes of the alerts of ``rules`` that ``server`` holds ALERTS of, over
    [start, end]: runs of samples no further apart than the alert's group interval."""
    interval = {r.name: r.interval for r in rules.alerts}
    found = []
    span = f"{int(end - start) + 1}s"
    for series in server.api.query(f'ALERTS{{alertstate="firing"}}[{span}]', end):
        labels = tuple(sorted((k, v) for k, v in series["metric"].items() if k not in VMALERT_LABELS))
        alert = dict(labels)["alertname"]
        step = interval[alert]
        times = np.array(sorted(float(t) for t, _ in series["values"]))
        index = np.rint((times - times[0]) / step).astype(np.int64)
        present = np.zeros(int(index[-1]) + 1, dtype=bool)
        present[index] = True
        found += [Episode(alert, labels, float(times[0] + a * step), float(times[0] + (b - 1) * step))
                  for a, b in runs(present)]
    return sorted(found, key=lambda e: (e.start, e.alert, e.labels))


def replay(rules: RuleSet, data_dir: Path, start: float, end: float, workdir: Path,
           alerts_from: float | None = None) -> list[Episode]:
    """Every alert of ``rules`` as vmalert evaluates it over the series of ``data_dir`` (a Prometheus
    data directory) in VictoriaMetrics: records over [start, end], alerts over [alerts_from, end]
    (default ``start``)."""
    order = Passes.of(rules)
    alerts_from = start if alerts_from is None else alerts_from
    workdir.mkdir(parents=True, exist_ok=True)
    with VictoriaMetricsServer(workdir / "vm", extra_args=LOOKBACK_ARGS) as vm, \
            VictoriaMetricsServer(workdir / "vm-readers", extra_args=LOOKBACK_ARGS) as sink:
        vm.start()
        sink.start()
        vmctl_import(data_dir, vm, workdir / "vmctl.log")
        for number, level in enumerate(order.records):
            path = write_rule_file(level, workdir / f"records-{number}.yml")
            vmalert_replay([path], vm, start, end, workdir / f"vmalert-records-{number}.log")
            later = {r.name for other in order.records[number + 1:] for r in other}
            complete = {r.name for r in level} - later
            end_records(vm, [r for r in rules.records if r.name in complete], start, end)
        if order.alerts:
            path = write_rule_file(order.alerts, workdir / "alerts.yml")
            vmalert_replay([path], vm, alerts_from, end, workdir / "vmalert-alerts.log")
        if order.readers:
            path = write_rule_file(order.readers, workdir / "readers.yml")
            vmalert_replay([path], vm, alerts_from, end, workdir / "vmalert-readers.log", remote_write=sink)
        found = [*alert_episodes(vm, rules, alerts_from, end), *alert_episodes(sink, rules, alerts_from, end)]
    return sorted(found, key=lambda e: (e.start, e.alert, e.labels))
