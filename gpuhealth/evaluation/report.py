"""The benchmark's figures: one JSON-ready summary, and the table printed on the terminal."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from gpuhealth.evaluation.alerts import AlertRun
from gpuhealth.evaluation.matching import LONG_PRECURSOR, Score, noise_near, wilson
from gpuhealth.evaluation.rulefiles import RuleSet
from gpuhealth.evaluation.scenario import FAULT_KINDS, Noise, Scenario

STATUSES = ("predicted", "late_warning", "detected", "missed")


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _share(count: int, total: int) -> dict[str, Any]:
    """A share with its 95 % Wilson interval."""
    interval = wilson(count, total)
    return {
        "count": count,
        "of": total,
        "fraction": _round(count / total) if total else None,
        "ci95": [_round(interval[0]), _round(interval[1])] if interval else None,
    }


def _quantiles(values: list[float]) -> dict[str, float | None] | None:
    if not values:
        return None
    return {
        q: _round(float(np.percentile(values, p)), 0)
        for q, p in (("min", 0), ("p25", 25), ("median", 50), ("p75", 75), ("p90", 90), ("max", 100))
    }


def summary(
    score: Score,
    run: AlertRun,
    scenario: Scenario,
    rules: RuleSet,
    steps: tuple[float, float],
    samples: int,
    wall_seconds: float,
    reach: list[tuple[Noise, list[str]]],
) -> dict[str, Any]:
    """The figures; ``reach`` pairs each benign event with the nodes it touched."""
    outcomes, n = score.outcomes, len(score.outcomes)
    long = score.long_precursor
    predicted = _share(score.count("predicted"), n)
    long_predicted = _share(sum(o.status == "predicted" for o in long), len(long))
    detected = _share(sum(o.detected for o in outcomes), n)
    recall = _share(sum(o.status != "missed" for o in outcomes), n)
    late = _share(score.count("late_warning"), n)
    per_kind: dict[str, Any] = {}
    for kind in FAULT_KINDS:
        mine = [o for o in outcomes if o.failure.kind == kind]
        if mine:
            per_kind[kind] = {
                "failures": len(mine),
                **{status: sum(o.status == status for o in mine) for status in STATUSES},
                "with_precursor_1h": sum(o.failure.precursor_seconds >= LONG_PRECURSOR for o in mine),
                "detected_within_1m": sum(o.detected for o in mine),
                "median_lead_seconds": _round(
                    _median([o.lead_seconds for o in mine if o.lead_seconds is not None]), 0
                ),
            }
    per_alert: dict[str, Any] = {}
    drained = {id(e) for trip in score.false_drains for e in trip}
    for rule in rules.alerts:
        name = rule.name
        per_alert[name] = {
            "action": dict(rule.labels).get("action", "none"),
            **{
                status: sum(o.status == status and name in o.alerts for o in outcomes)
                for status in ("predicted", "late_warning", "detected")
            },
            "false_alarms": sum(e.alert == name for e in score.false_alarms),
            "false_drain_episodes": sum(e.alert == name and id(e) in drained for e in score.false_alarms),
            "after_failure": sum(e.alert == name for e in score.after_failure),
            "informational": sum(e.alert == name for e in score.informational),
            "lemon_right": sum(e.alert == name for e in score.lemon_right),
            "lemon_wrong": sum(e.alert == name for e in score.lemon_wrong),
            "error": run.errors.get(name),
        }
    causes = Counter(noise_near(e, reach, scenario.start) or "none" for e in score.false_alarms)
    lemon_total = len(score.lemon_right) + len(score.lemon_wrong)
    return {
        "scenario": scenario.name,
        "seed": scenario.seed,
        "nodes": scenario.fleet.nodes,
        "gpus": scenario.fleet.nodes * scenario.fleet.gpus_per_node,
        "days": _round(score.days, 2),
        "failures": n,
        "failures_with_precursor_1h": len(long),
        "noise_events": len(scenario.noise),
        "noise_by_kind": dict(sorted(Counter(e.kind for e in scenario.noise).items())),
        "evaluation_step_seconds": steps[0],
        "fused_alert_step_seconds": steps[1],
        "min_lead_seconds": score.min_lead,
        "field_rate_per_day_per_64_nodes": score.field_rate,
        "recall": _round(score.recall),
        "recall_ci95": recall["ci95"],
        "predicted_fraction": predicted["fraction"],
        "predicted_fraction_ci95": predicted["ci95"],
        "predicted_long_precursor_fraction": long_predicted["fraction"],
        "predicted_long_precursor_fraction_ci95": long_predicted["ci95"],
        "predicted_long_precursor": long_predicted["count"],
        "late_warnings": score.count("late_warning"),
        "late_warning_fraction": late["fraction"],
        "late_warning_fraction_ci95": late["ci95"],
        "late_warning_lead_seconds": _quantiles(
            [o.late_lead_seconds for o in outcomes if o.late_lead_seconds is not None]
        ),
        "detected_fraction": detected["fraction"],
        "detected_fraction_ci95": detected["ci95"],
        "detection_latency_seconds": _quantiles(score.latencies),
        "median_lead_seconds": _round(score.median_lead_seconds, 0),
        "lead_seconds": _quantiles(score.leads),
        "false_alarms": len(score.false_alarms),
        "false_alarms_per_day": _round(score.false_alarms_per_day),
        "false_drains": len(score.false_drains),
        "false_drains_per_day": _round(score.false_drains_per_day),
        "precision_at_field_rate": _round(score.precision_at_field_rate, 5),
        "lemon_alerts": {
            "right": len(score.lemon_right),
            "wrong": len(score.lemon_wrong),
            "precision": _round(len(score.lemon_right) / lemon_total) if lemon_total else None,
        },
        "false_alarms_by_noise": dict(sorted(causes.items())),
        "per_kind": per_kind,
        "per_alert": per_alert,
        "failures_detail": [
            {
                "node": o.failure.node,
                "gpu": o.failure.gpu,
                "kind": o.failure.kind,
                "xid": o.failure.xid,
                "strength": o.failure.strength,
                "shape": o.failure.shape,
                "onset_seconds": o.failure.onset,
                "instant_seconds": o.failure.instant,
                "failure_seconds": o.failure.failure,
                "repaired_seconds": o.failure.repaired,
                "precursor_seconds": o.failure.precursor_seconds,
                "status": o.status,
                "lead_seconds": _round(o.lead_seconds, 0),
                "late_lead_seconds": _round(o.late_lead_seconds, 0),
                "detection_latency_seconds": _round(o.latency_seconds, 0),
                "alerts": o.alerts,
            }
            for o in outcomes
        ],
        "false_alarm_episodes": [
            {
                "alert": e.alert,
                "node": e.node,
                "gpu": e.gpu,
                "action": e.action,
                "start": e.start,
                "end": e.end,
                "near_noise": noise_near(e, reach, scenario.start),
            }
            for e in score.false_alarms
        ],
        "rule_errors": dict(run.errors),
        "samples_written": samples,
        "wall_seconds": _round(wall_seconds, 1),
    }


def _pct(value: float | None, decimals: int = 0) -> str:
    return "n/a" if value is None else f"{100 * value:.{decimals}f}%"


def _ci(interval: list[float] | None) -> str:
    return "" if not interval else f" [{100 * interval[0]:.0f}-{100 * interval[1]:.0f}%]"


def _minutes(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds / 60:.0f} min"


def table(result: dict[str, Any]) -> str:
    latency = result["detection_latency_seconds"] or {}
    lemons = result["lemon_alerts"]
    precision = result["precision_at_field_rate"]
    lines = [
        f"scenario {result['scenario']} (seed {result['seed']}): {result['nodes']} nodes, "
        f"{result['gpus']} GPUs, "
        f"{result['days']} days, {result['failures']} failures "
        f"({result['failures_with_precursor_1h']} with a precursor of 1 h or more), "
        f"{result['noise_events']} benign events, "
        f"alerts evaluated every {result['evaluation_step_seconds']:g}s "
        f"(alerts on recording rules every {result['fused_alert_step_seconds']:g}s)",
        "",
        "  shares with their 95% Wilson interval",
        f"  recall (any alert by 1 min after)  {_pct(result['recall'])}{_ci(result['recall_ci95'])}",
        f"  detected within 1 min              {_pct(result['detected_fraction'])}"
        f"{_ci(result['detected_fraction_ci95'])}; latency median {latency.get('median', 'n/a')} s, "
        f"p90 {latency.get('p90', 'n/a')} s",
        f"  predicted >= {result['min_lead_seconds'] / 60:.0f} min ahead          "
        f"{_pct(result['predicted_fraction'])}{_ci(result['predicted_fraction_ci95'])}",
        f"  ... of failures with >= 1 h precursor {_pct(result['predicted_long_precursor_fraction'])}"
        f"{_ci(result['predicted_long_precursor_fraction_ci95'])} "
        f"({result['predicted_long_precursor']} of {result['failures_with_precursor_1h']})",
        f"  late warnings (< min lead)          {result['late_warnings']}",
        f"  median lead time                    {_minutes(result['median_lead_seconds'])}",
        f"  false alarms per day per 64 nodes   {result['false_alarms_per_day']:.3f} "
        f"({result['false_alarms']} episodes)",
        f"  false drains per day per 64 nodes   {result['false_drains_per_day']:.3f} "
        f"({result['false_drains']} drains)",
        f"  precision at the field rate         {_pct(precision, 2)} "
        f"({result['field_rate_per_day_per_64_nodes']:g} failures per day per 64 nodes)",
        f"  lemon alerts                        {lemons['right']} right, {lemons['wrong']} wrong",
        "",
        f"  {'fault kind':<20} {'failures':>8} {'>=1h':>5} {'predicted':>9} {'late':>5} {'detected':>8} "
        f"{'missed':>6} {'median lead':>12}",
    ]
    for kind, row in result["per_kind"].items():
        lines.append(
            f"  {kind:<20} {row['failures']:>8} {row['with_precursor_1h']:>5} {row['predicted']:>9} "
            f"{row['late_warning']:>5} {row['detected']:>8} {row['missed']:>6} "
            f"{_minutes(row['median_lead_seconds']):>12}"
        )
    lines += [
        "",
        f"  {'alert':<32} {'action':<16} {'predicted':>9} {'late':>5} {'detected':>8} {'false':>6} "
        f"{'drains':>6} {'after':>6} {'info':>5}",
    ]
    for name, row in result["per_alert"].items():
        lines.append(
            f"  {name:<32} {row['action']:<16} {row['predicted']:>9} {row['late_warning']:>5} "
            f"{row['detected']:>8} {row['false_alarms']:>6} {row['false_drain_episodes']:>6} "
            f"{row['after_failure']:>6} {row['informational']:>5}" + ("  ERROR" if row["error"] else "")
        )
    if result["false_alarms_by_noise"]:
        lines += [
            "",
            "  false alarms by the benign event near them: "
            + ", ".join(f"{kind} {count}" for kind, count in result["false_alarms_by_noise"].items()),
        ]
    if result["rule_errors"]:
        lines += ["", "  rules Prometheus rejected (they record or fire nothing):"]
        lines += [f"    {name}: {error}" for name, error in result["rule_errors"].items()]
    lines += ["", f"  wall time {result['wall_seconds']:.0f}s, {result['samples_written']:,} samples written"]
    return "\n".join(lines)
