"""A PNG timeline of one failure: its raw signal, the evidence and risk score the rules computed for
its GPU, and the alerts that fired, between precursor onset and shortly after the hard failure."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from gpuhealth.evaluation.alerts import AlertEvaluator, Episode
from gpuhealth.evaluation.matching import Outcome, Score, concerns
from gpuhealth.evaluation.ranges import grid, range_matrix

RISK = "gpuhealth:gpu_failure_risk:score"
# The raw signal that shows each fault kind best, as PromQL over the failing GPU's series.
RAW = {
    "hbm_degradation": (
        "corrected ECC errors per hour",
        'sum(increase(gpuhealth_gpu_ecc_errors_total{{type="corrected",counter="volatile",{sel}}}[1h]))',
    ),
    "thermal_runaway": ("GPU temperature (°C)", "max(gpuhealth_gpu_temperature_celsius{{{sel}}})"),
    "pcie_degradation": (
        "PCIe replays per 10 min",
        "sum(increase(gpuhealth_gpu_pcie_replays_total{{{sel}}}[10m]))",
    ),
    "nvlink_errors": (
        "NVLink errors per second (all links)",
        "sum(rate(gpuhealth_gpu_nvlink_errors_total{{{sel}}}[15m]))",
    ),
    "gsp_timeout": ("slowest NVML answer (s)", "max(gpuhealth_gpu_nvml_latency_seconds{{{sel}}})"),
    "fell_off_bus": ("GPU answers NVML", "max(gpuhealth_gpu_up{{{sel}}})"),
}


def pick(score: Score) -> Outcome | None:
    """The failure predicted with the longest lead, else the first with a precursor, else any."""
    predicted = [o for o in score.outcomes if o.lead_seconds is not None]
    if predicted:
        return max(predicted, key=lambda o: o.lead_seconds or 0)
    with_precursor = [o for o in score.outcomes if o.failure.has_precursor]
    return (with_precursor or score.outcomes or [None])[0]


def timeline(
    path: Path,
    evaluator: AlertEvaluator,
    score: Score,
    episodes: list[Episode],
    start: float,
    data_start: float,
    end: float,
) -> Outcome | None:
    outcome = pick(score)
    if outcome is None:
        return None
    failure = outcome.failure
    onset, hard = start + failure.onset, start + failure.failure
    first, last = max(data_start, onset - 3 * 3600), min(end, hard + 3600)
    times = grid(first, last, max(60.0, (last - first) // 240 // 60 * 60))  # a few hundred points
    selector = f'node="{failure.node}",gpu="{failure.gpu}"'
    label, raw_expr = RAW[failure.kind]
    raw = range_matrix(evaluator.api, raw_expr.format(sel=selector), times).series
    evidence = {}
    definitions = evaluator.expander.definitions
    for name in [n for n in definitions if ":gpu_evidence:" in n or ":node_evidence:" in n or n == RISK]:
        if name in evaluator.expander.broken:
            continue
        series = range_matrix(evaluator.api, evaluator.expander.definition(name), times).series
        for labels, values in series.items():
            tags = dict(labels)
            if (
                tags.get("node") == failure.node
                and tags.get("gpu") in (None, str(failure.gpu))
                and np.nanmax(np.nan_to_num(values)) > 0
            ):
                evidence[name] = values
    hours = (times - hard) / 3600
    fig, (top, middle, bottom) = plt.subplots(
        3, 1, figsize=(11, 8), sharex=True, gridspec_kw={"height_ratios": [2, 2, 1]}
    )
    for values in raw.values():
        top.plot(hours, values, color="tab:red")
    top.set_ylabel(label)
    top.set_title(
        f"{failure.kind} on {failure.node} GPU {failure.gpu} (XID {failure.xid}, strength "
        f"{failure.strength}): {outcome.status}"
        + (f", {outcome.lead_seconds / 60:.0f} min ahead" if outcome.lead_seconds else "")
    )
    for name, values in evidence.items():
        style = {"color": "black", "linewidth": 2.5} if name == RISK else {"linewidth": 1}
        middle.plot(hours, values, label=name.split(":")[-1] if name != RISK else "risk score", **style)
    middle.set_ylim(-0.05, 1.05)
    middle.set_ylabel("evidence / risk (0..1)")
    if evidence:
        middle.legend(fontsize=7, loc="upper left", ncol=2)
    mine = [e for e in episodes if concerns(e, failure) and e.end >= times[0] and e.start <= times[-1]]
    names = sorted({e.alert for e in mine})
    for e in mine:
        row = names.index(e.alert)
        bottom.barh(
            row,
            max((e.end - e.start) / 3600, 1 / 60),
            left=(e.start - hard) / 3600,
            height=0.6,
            color="tab:orange",
        )
    bottom.set_yticks(range(len(names)), names, fontsize=7)
    bottom.set_xlabel("hours relative to the hard failure")
    bottom.set_xlim(hours[0], hours[-1])
    for axis in (top, middle, bottom):
        axis.axvline((onset - hard) / 3600, color="tab:blue", linestyle="--", linewidth=1)
        axis.axvline(0, color="tab:red", linestyle="--", linewidth=1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return outcome
