"""One evaluation run: backfill the fleet, evaluate every alert, score against ground truth."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuhealth.evaluation import plot, report
from gpuhealth.evaluation.alerts import AlertEvaluator, AlertRun, reads_alerts
from gpuhealth.evaluation.fleet import (
    BackfilledFleet,
    add_series,
    backfilled_prometheus,
    store_records,
)
from gpuhealth.evaluation.matching import LEMON_ALERTS, score
from gpuhealth.evaluation.progress import Progress
from gpuhealth.evaluation.ranges import PARALLEL, label_text
from gpuhealth.evaluation.signals import Family

log = logging.getLogger(__name__)


@dataclass
class Options:
    scenario: Path
    rules: Path
    workdir: Path
    seed: int | None = None
    step: float | None = None
    fused_step: float | None = None
    plot: Path | None = None
    plot_false_alarm: bool = False  # plot a false-alarm episode instead of a failure
    lemon_alerts: str = LEMON_ALERTS
    progress: bool = True
    fold_records: bool = False  # fold records into the alerts instead of storing them (slow; exact)
    jobs: int = PARALLEL  # range queries Prometheus evaluates at once


def alerts_family(run: AlertRun) -> Family:
    """ALERTS{alertstate=...} as Prometheus would have written them, for rules that read ALERTS."""
    rows = []
    for state, table in (("firing", run.firing), ("pending", run.pending)):
        for series in table.values():
            for labels, mask in series.items():
                rows.append((label_text((*labels, ("alertstate", state))), np.where(mask, 1.0, np.nan)))
    return Family("ALERTS", "gauge", rows)


def evaluate(options: Options) -> dict[str, Any]:
    began = time.monotonic()
    with backfilled_prometheus(
        options.scenario,
        options.workdir,
        rules_dir=options.rules,
        seed=options.seed,
        record=False,
        progress=options.progress,
    ) as fleet:
        return evaluate_fleet(fleet, options, began)


def evaluate_alerts(fleet: BackfilledFleet, options: Options) -> AlertEvaluator:
    """Every alert of ``fleet.rules`` over the fleet's period (from the longest ``for:`` before it),
    by Prometheus's engine; alerts reading ALERTS read those of the others."""
    rules = fleet.rules
    assert rules is not None
    step = options.step or rules.interval
    fused_step = options.fused_step or fleet.scenario.fused_step or step
    longest_for = max((r.for_seconds for r in rules.alerts), default=0.0)
    evaluator = AlertEvaluator(
        fleet.server.api,
        rules,
        max(fleet.data_start, fleet.start - longest_for),
        fleet.end,
        step,
        fused_step,
        jobs=options.jobs,
    )
    if not options.fold_records:
        store_records(
            fleet.server,
            fleet.blocks,
            evaluator.expander,
            " or ".join(r.expr for r in rules.alerts),
            fleet.data_start,
            fleet.end,
            fused_step,
            progress=options.progress,
            jobs=options.jobs,
        )
    direct = [r for r in rules.alerts if not reads_alerts(r)]
    second = [r for r in rules.alerts if reads_alerts(r)]
    with Progress("evaluating alerts", len(direct), enabled=options.progress) as bar:
        evaluator.evaluate_all(direct, bar.advance)
    if second:
        add_series(
            fleet.server,
            fleet.blocks,
            [([alerts_family(evaluator.run)], evaluator.times)],
            "backfilling ALERTS",
            progress=options.progress,
        )
        with Progress("evaluating ALERTS rules", len(second), enabled=options.progress) as bar:
            evaluator.evaluate_all(second, bar.advance)
    return evaluator


def evaluate_fleet(fleet: BackfilledFleet, options: Options, began: float) -> dict[str, Any]:
    """Evaluate every alert of ``fleet.rules`` over the fleet's period and score them."""
    evaluator = evaluate_alerts(fleet, options)
    episodes = [e for e in evaluator.run.episodes() if e.start >= fleet.start]
    rules, step, fused_step = evaluator.rules, evaluator.step, evaluator.fused_step
    scenario = fleet.scenario
    result = score(
        scenario.failures,
        episodes,
        fleet.start,
        scenario.duration,
        scenario.fleet.nodes,
        min_lead=scenario.min_lead,
        field_rate=scenario.field_rate,
        lemon_window=scenario.lemon_window,
        lemon_alerts=options.lemon_alerts,
    )
    reach = [(event, fleet.signals.reach(event)) for event in scenario.noise]
    if options.plot:
        shown = plot.timeline(
            options.plot,
            evaluator,
            result,
            episodes,
            scenario,
            fleet.data_start,
            false_alarm=options.plot_false_alarm,
            reach=reach,
        )
        log.info("plot written path=%s shown=%s", options.plot, shown)
    return report.summary(
        result,
        evaluator.run,
        scenario,
        rules,
        (step, fused_step),
        fleet.samples,
        time.monotonic() - began,
        reach,
    )
