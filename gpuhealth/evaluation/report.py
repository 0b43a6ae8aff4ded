"""The benchmark's figures: one JSON-ready summary, and the table printed on the terminal."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from gpuhealth.evaluation.alerts import AlertRun
from gpuhealth.evaluation.matching import Score, noise_near
from gpuhealth.evaluation.rulefiles import RuleSet
from gpuhealth.evaluation.scenario import FAULT_KINDS, Scenario


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def summary(
    score: Score,
    run: AlertRun,
    scenario: Scenario,
    rules: RuleSet,
    steps: tuple[float, float],
    samples: int,
    wall_seconds: float,
) -> dict[str, Any]:
    leads = score.leads
    per_kind: dict[str, Any] = {}
    for kind in FAULT_KINDS:
        outcomes = [o for o in score.outcomes if o.failure.kind == kind]
        if outcomes:
            per_kind[kind] = {
                "failures": len(outcomes),
                **{
                    status: sum(o.status == status for o in outcomes)
                    for status in ("predicted", "detected", "missed")
                },
                "median_lead_seconds": _round(
                    _median([o.lead_seconds for o in outcomes if o.lead_seconds is not None]), 0
                ),
            }
    per_alert: dict[str, Any] = {}
    for rule in rules.alerts:
        name = rule.name
        per_alert[name] = {
            "action": dict(rule.labels).get("action", "none"),
            "predicted": sum(o.status == "predicted" and name in o.alerts for o in score.outcomes),
            "detected": sum(o.status == "detected" and name in o.alerts for o in score.outcomes),
            "false_alarms": sum(e.alert == name for e in score.false_alarms),
            "after_failure": sum(e.alert == name for e in score.after_failure),
            "informational": sum(e.alert == name for e in score.informational),
            "error": run.errors.get(name),
        }
    causes = Counter(noise_near(e, scenario.noise, scenario.start) or "none" for e in score.false_alarms)
    return {
        "scenario": scenario.name,
        "seed": scenario.seed,
        "nodes": scenario.fleet.nodes,
        "gpus": scenario.fleet.nodes * scenario.fleet.gpus_per_node,
        "days": _round(score.days, 2),
        "failures": len(score.outcomes),
        "noise_events": len(scenario.noise),
        "evaluation_step_seconds": steps[0],
        "fused_alert_step_seconds": steps[1],
        "recall": _round(score.recall),
        "predicted_fraction": _round(score.predicted_fraction),
        "detected_fraction": _round(
            score.count("detected") / len(score.outcomes) if score.outcomes else None
        ),
        "median_lead_seconds": _round(score.median_lead_seconds, 0),
        "lead_seconds": {
            q: _round(float(np.percentile(leads, p)), 0)
            for q, p in (("min", 0), ("p25", 25), ("median", 50), ("p75", 75), ("max", 100))
        }
        if leads
        else None,
        "false_alarms": len(score.false_alarms),
        "false_alarms_per_day": _round(score.false_alarms_per_day),
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
                "precursor_seconds": o.failure.failure - o.failure.onset,
                "status": o.status,
                "lead_seconds": _round(o.lead_seconds, 0),
                "alerts": o.alerts,
            }
            for o in score.outcomes
        ],
        "false_alarm_episodes": [
            {
                "alert": e.alert,
                "node": e.node,
                "gpu": e.gpu,
                "start": e.start,
                "end": e.end,
                "near_noise": noise_near(e, scenario.noise, scenario.start),
            }
            for e in score.false_alarms
        ],
        "rule_errors": dict(run.errors),
        "samples_written": samples,
        "wall_seconds": _round(wall_seconds, 1),
    }


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _minutes(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds / 60:.0f} min"


def table(result: dict[str, Any]) -> str:
    lines = [
        f"scenario {result['scenario']} (seed {result['seed']}): {result['nodes']} nodes, "
        f"{result['gpus']} GPUs, "
        f"{result['days']} days, {result['failures']} failures, {result['noise_events']} benign events, "
        f"alerts evaluated every {result['evaluation_step_seconds']:g}s "
        f"(alerts on recording rules every {result['fused_alert_step_seconds']:g}s)",
        "",
        f"  recall                     {_pct(result['recall'])}",
        f"  predicted before failure   {_pct(result['predicted_fraction'])}",
        f"  median lead time           {_minutes(result['median_lead_seconds'])}",
        f"  false alarms per day       {result['false_alarms_per_day']:.3f} per 64 nodes "
        f"({result['false_alarms']} episodes)",
        "",
        f"  {'fault kind':<20} {'failures':>8} {'predicted':>9} {'detected':>8} {'missed':>6} "
        f"{'median lead':>12}",
    ]
    for kind, row in result["per_kind"].items():
        lines.append(
            f"  {kind:<20} {row['failures']:>8} {row['predicted']:>9} {row['detected']:>8} "
            f"{row['missed']:>6} {_minutes(row['median_lead_seconds']):>12}"
        )
    lines += [
        "",
        f"  {'alert':<32} {'action':<16} {'predicted':>9} {'detected':>8} {'false':>6} {'after':>6} "
        f"{'info':>5}",
    ]
    for name, row in result["per_alert"].items():
        lines.append(
            f"  {name:<32} {row['action']:<16} {row['predicted']:>9} {row['detected']:>8} "
            f"{row['false_alarms']:>6} {row['after_failure']:>6} {row['informational']:>5}"
            + ("  ERROR" if row["error"] else "")
        )
    if result["rule_errors"]:
        lines += ["", "  rules Prometheus rejected (they record or fire nothing):"]
        lines += [f"    {name}: {error}" for name, error in result["rule_errors"].items()]
    lines += ["", f"  wall time {result['wall_seconds']:.0f}s, {result['samples_written']:,} samples written"]
    return "\n".join(lines)
