"""A PNG timeline of one case: a failure (its raw signal, the evidence and risk score the rules
computed for its GPU, and the alerts that fired, from before precursor onset to after the failure
instant) or a false-alarm episode (the same panels around the alert, with the benign event near it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from gpuhealth.evaluation.alerts import AlertEvaluator, Episode
from gpuhealth.evaluation.matching import Outcome, Score, nearest_noise
from gpuhealth.evaluation.ranges import grid, range_matrix
from gpuhealth.evaluation.scenario import Noise, Scenario

RISK = "gpuhealth:gpu_failure_risk:score"
ECC = (
    "corrected ECC errors per hour",
    'sum(increase(gpuhealth_gpu_ecc_errors_total{{type="corrected",counter="volatile",{sel}}}[1h]))',
)
TEMPERATURE = ("GPU temperature (°C)", "max(gpuhealth_gpu_temperature_celsius{{{sel}}})")
REPLAYS = ("PCIe replays per 10 min", "sum(increase(gpuhealth_gpu_pcie_replays_total{{{sel}}}[10m]))")
NVLINK = (
    "NVLink errors per second (all links)",
    "sum(rate(gpuhealth_gpu_nvlink_errors_all_links_total{{{sel}}}[15m])) "
    "or sum(rate(gpuhealth_gpu_nvlink_errors_total{{{sel}}}[15m]))",
)
NVML = ("slowest NVML answer (s)", "max(gpuhealth_gpu_nvml_latency_seconds{{{sel}}})")
XIDS = ("XID events per 10 min", "sum(increase(gpuhealth_xid_events_total{{{sel}}}[10m]))")
REMAPS = (
    "remapped rows, remap pending",
    "sum(gpuhealth_gpu_remapped_rows{{{sel}}}) + 10 * max(gpuhealth_gpu_remap_pending{{{sel}}})",
)
CLOCKS = ("SM clock (MHz)", "max(gpuhealth_gpu_sm_clock_hertz{{{sel}}}) / 1e6")
NFS = (
    "NFS RPC queue seconds per op",
    "sum(rate(gpuhealth_nfs_rpc_queue_seconds_total{{{node}}}[5m])) "
    "/ sum(rate(gpuhealth_nfs_rpc_operations_total{{{node}}}[5m]))",
)
# The raw signal that shows each fault or benign kind best, as PromQL over the GPU's (or node's) series.
RAW = {
    "hbm_degradation": ECC,
    "sram_uncorrectable": XIDS,
    "thermal_runaway": TEMPERATURE,
    "pcie_degradation": REPLAYS,
    "nvlink_errors": NVLINK,
    "gsp_timeout": NVML,
    "fell_off_bus": ("GPU answers NVML", "max(gpuhealth_gpu_up{{{sel}}})"),
    "sbe_burst": ECC,
    "sbe_chatter": ECC,
    "benign_remap": REMAPS,
    "contained_xid94": REMAPS,
    "xid63": XIDS,
    "app_xid": XIDS,
    "nvlink_flap": NVLINK,
    "pcie_replay_steady": REPLAYS,
    "boot_replay_burst": REPLAYS,
    "reboot_loop": REPLAYS,
    "slow_nvml": NVML,
    "power_brake": CLOCKS,
    "power_cap": CLOCKS,
    "checkpoint_burst": NFS,
    "checkpoint_storm": NFS,
}


@dataclass
class Case:
    """What one plot shows: a node (and GPU), an instant to centre on, the period, a title."""

    node: str | None  # None: a fleet-wide false alarm
    gpu: str | None
    kind: str
    first: float
    last: float
    centre: float
    marks: tuple[tuple[float, str], ...]  # instants to mark, with their colour
    title: str


def pick(score: Score) -> Outcome | None:
    """The failure predicted with the longest lead, else the first with a precursor, else any."""
    predicted = [o for o in score.outcomes if o.lead_seconds is not None]
    if predicted:
        return max(predicted, key=lambda o: o.lead_seconds or 0)
    with_precursor = [o for o in score.outcomes if o.failure.has_precursor]
    candidates = with_precursor or score.outcomes
    return candidates[0] if candidates else None


def _failure_case(score: Score, start: float) -> Case | None:
    outcome = pick(score)
    if outcome is None:
        return None
    f = outcome.failure
    onset, instant = start + f.onset, start + f.instant
    title = (
        f"{f.kind} on {f.node} GPU {f.gpu} (XID {f.xid}, {f.shape} precursor, strength {f.strength}): "
        f"{outcome.status}"
        + (f", {outcome.lead_seconds / 60:.0f} min ahead" if outcome.lead_seconds else "")
        + (f", warned {outcome.late_lead_seconds / 60:.0f} min ahead" if outcome.late_lead_seconds else "")
        + (
            f", first alert {outcome.latency_seconds:.0f} s after"
            if outcome.latency_seconds is not None
            else ""
        )
    )
    return Case(
        f.node,
        str(f.gpu),
        f.kind,
        onset - 3 * 3600,
        instant + 3600,
        instant,
        ((onset, "tab:blue"), (instant, "tab:red")),
        title,
    )


def _false_alarm_case(score: Score, scenario: Scenario, reach: list[tuple[Noise, list[str]]]) -> Case | None:
    if not score.false_alarms:
        return None
    episode = max(score.false_alarms, key=lambda e: e.end - e.start)
    event = nearest_noise(episode, reach, scenario.start)
    kind = event.kind if event else "none"
    gpu = (
        episode.gpu
        if episode.gpu is not None
        else (str(event.gpu) if event and event.gpu is not None else None)
    )
    marks: tuple[tuple[float, str], ...] = ((episode.start, "tab:red"),)
    if event is not None:
        marks = ((scenario.start + event.at, "tab:blue"), *marks)
    title = (
        f"false alarm {episode.alert} on {episode.node}"
        + (f" GPU {gpu}" if gpu else "")
        + (f", benign {kind} nearby" if event else ", no benign event nearby")
    )
    first = min(t for t, _ in marks) - 3 * 3600
    return Case(
        episode.node, gpu, kind, first, max(episode.end, episode.start) + 3600, episode.start, marks, title
    )


def timeline(
    path: Path,
    evaluator: AlertEvaluator,
    score: Score,
    episodes: list[Episode],
    scenario: Scenario,
    data_start: float,
    *,
    false_alarm: bool = False,
    reach: list[tuple[Noise, list[str]]] | None = None,
) -> str | None:
    """Draw the case; returns its title (None when there is nothing to draw). ``reach`` pairs each
    benign event with the nodes it touched, to find the one behind a false alarm."""
    case = (
        _false_alarm_case(score, scenario, reach or [])
        if false_alarm
        else _failure_case(score, scenario.start)
    )
    if case is None:
        return None
    first, last = max(data_start, case.first), min(scenario.end, case.last)
    every = max(60.0, (last - first) // 240 // 60 * 60)  # a few hundred points...
    every = -(-every // evaluator.fused_step) * evaluator.fused_step  # ...where stored records are kept
    times = grid(first, last, every)
    node_sel = f'node="{case.node}"'
    selector = node_sel + (f',gpu="{case.gpu}"' if case.gpu is not None else "")
    label, raw_expr = RAW.get(case.kind, TEMPERATURE)
    raw = range_matrix(evaluator.api, raw_expr.format(sel=selector, node=node_sel), times).series
    evidence = {}
    for name in [
        n
        for n in evaluator.expander.definitions
        if ":gpu_evidence:" in n or ":node_evidence:" in n or n == RISK
    ]:
        if name in evaluator.expander.broken:
            continue
        series = range_matrix(evaluator.api, evaluator.expander.definition(name, (), every), times).series
        for labels, values in series.items():
            tags = dict(labels)
            if (
                tags.get("node") == case.node
                and (case.gpu is None or tags.get("gpu") in (None, case.gpu))
                and np.nanmax(np.nan_to_num(values)) > 0
            ):
                evidence[f"{name} {tags.get('gpu', '')}"] = values
    hours = (times - case.centre) / 3600
    fig, (top, middle, bottom) = plt.subplots(
        3, 1, figsize=(11, 8), sharex=True, gridspec_kw={"height_ratios": [2, 2, 1]}
    )
    for values in raw.values():
        top.plot(hours, values, color="tab:red")
    top.set_ylabel(label)
    top.set_title(case.title, fontsize=9)
    for name, values in evidence.items():
        style = {"color": "black", "linewidth": 2.5} if name.startswith(RISK) else {"linewidth": 1}
        short = "risk score" if name.startswith(RISK) else name.split(":")[-1]
        middle.plot(hours, values, label=short, **style)
    middle.set_ylim(-0.05, 1.05)
    middle.set_ylabel("evidence / risk (0..1)")
    if evidence:
        middle.legend(fontsize=7, loc="upper left", ncol=2)
    mine = [
        e
        for e in episodes
        if e.node == case.node
        and (case.gpu is None or e.gpu in (None, case.gpu))
        and e.end >= times[0]
        and e.start <= times[-1]
    ]
    names = sorted({e.alert for e in mine})
    for e in mine:
        bottom.barh(
            names.index(e.alert),
            max((e.end - e.start) / 3600, 1 / 60),
            left=(e.start - case.centre) / 3600,
            height=0.6,
            color="tab:orange",
        )
    bottom.set_yticks(range(len(names)), names, fontsize=7)
    bottom.set_xlabel(
        "hours relative to the alert (blue: the benign event starts, red: the alert)"
        if false_alarm
        else "hours relative to the failure instant (blue: precursor onset, red: first XID)"
    )
    bottom.set_xlim(hours[0], hours[-1])
    for axis in (top, middle, bottom):
        for mark, colour in case.marks:
            axis.axvline((mark - case.centre) / 3600, color=colour, linestyle="--", linewidth=1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return case.title
