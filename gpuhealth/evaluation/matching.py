"""Alert episodes scored against ground truth.

The failure instant is the first XID the fault logs (``Failure.instant``); nothing that starts at or
after it predicts. Per failure, over the alerts about its GPU or its node (an alert without a ``gpu``
label) that make the webhook act (``action`` other than ``none``):

- *predicted*: one that suspects the hardware started between precursor onset and ``min_lead``
  before the instant, time enough to checkpoint the job and drain the node;
- *late warning*: the first one started later than that (or, for a fault without precursor or with
  a short one, within ``min_lead`` before the instant), but before the instant;
- *detected*: one started within ``detect_window`` (1 minute) after the instant;
- *missed*: none of these.

An alert that blames the job (``restart_job``: a buggy job's application XIDs) warns of nothing on
the hardware: one that happens to fire on the node before the failure neither predicts it nor is
excused as a warning (it stays a false alarm); after the instant it detects like any other.

A failure can be warned of and detected both; ``status`` keeps the best. Episodes on a node while it
is out of service (from the failure instant until it is repaired) are counted apart
(``after_failure``). Lemon alerts (a node failing again and again) are scored apart: one is right
when its node's next failure instant lies within ``lemon_window`` of its start. Every other actionable
episode is a false alarm; those whose action takes the node out are merged per node into *drains*
(episodes that overlap, or follow within one evaluation, are one drain).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from gpuhealth.evaluation.alerts import Episode
from gpuhealth.evaluation.scenario import (
    DEFAULT_FIELD_RATE,
    DEFAULT_LEMON_WINDOW,
    DEFAULT_MIN_LEAD,
    Failure,
    Noise,
)

DETECT_WINDOW = 60.0
AFTER_HORIZON = 1800.0  # how long after the failure instant a first alert still counts for latency
LONG_PRECURSOR = 3600.0  # precursors this long are the ones the rules can be held to
REFERENCE_NODES = 64  # false alarms are quoted per day per 64 nodes, like the 504-GPU report
# Webhook actions that take a node out of service (docs/contract.md: action label).
DRAINING_ACTIONS = ("checkpoint_drain", "checkpoint_drain_reset_gpu", "drain", "drain_reset_gpu",
                    "drain_reboot", "replace")
# Actions that blame the job, not the hardware (docs/contract.md): they warn of no hardware failure.
JOB_ACTIONS = ("restart_job",)
DRAIN_MERGE = 300.0  # a drain alert off for one (fused) evaluation and back is still the same drain
LEMON_ALERTS = "Lemon"  # alert names matching this (a regular expression) are lemon alerts


def wilson(successes: int, total: int, z: float = 1.96) -> tuple[float, float] | None:
    """95 % Wilson score interval of a share; None without trials."""
    if not total:
        return None
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass
class Outcome:
    failure: Failure
    status: str  # predicted | late_warning | detected | missed
    lead_seconds: float | None = None  # failure instant minus the first predictive alert
    alerts: list[str] = field(default_factory=list)
    late_lead_seconds: float | None = None  # lead of the first alert before the instant, when too short
    latency_seconds: float | None = None  # first alert at or after the instant, minus the instant
    drain_predicted: bool = False  # a draining alert gave at least ``min_lead``

    @property
    def detected(self) -> bool:
        return self.latency_seconds is not None and self.latency_seconds <= DETECT_WINDOW


@dataclass
class Score:
    outcomes: list[Outcome]
    false_alarms: list[Episode]
    after_failure: list[Episode]
    informational: list[Episode]
    matched: list[Episode]
    days: float
    nodes: int
    false_drains: list[list[Episode]] = field(default_factory=list)
    lemon_right: list[Episode] = field(default_factory=list)
    lemon_wrong: list[Episode] = field(default_factory=list)
    min_lead: float = DEFAULT_MIN_LEAD
    field_rate: float = DEFAULT_FIELD_RATE

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    def share(self, outcomes: list[Outcome], status: str) -> float | None:
        return sum(o.status == status for o in outcomes) / len(outcomes) if outcomes else None

    @property
    def recall(self) -> float | None:
        """Share of failures with an alert before the instant or within the detection window."""
        return (
            sum(o.status != "missed" for o in self.outcomes) / len(self.outcomes) if self.outcomes else None
        )

    @property
    def predicted_fraction(self) -> float | None:
        return self.share(self.outcomes, "predicted")

    @property
    def long_precursor(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failure.precursor_seconds >= LONG_PRECURSOR]

    @property
    def detected_fraction(self) -> float | None:
        return sum(o.detected for o in self.outcomes) / len(self.outcomes) if self.outcomes else None

    @property
    def leads(self) -> list[float]:
        return sorted(o.lead_seconds for o in self.outcomes if o.lead_seconds is not None)

    @property
    def latencies(self) -> list[float]:
        return sorted(o.latency_seconds for o in self.outcomes if o.latency_seconds is not None)

    @property
    def median_lead_seconds(self) -> float | None:
        return statistics.median(self.leads) if self.leads else None

    def per_day(self, count: int) -> float:
        """A count over the run, per day per 64 nodes."""
        return count / self.days * REFERENCE_NODES / self.nodes

    @property
    def false_alarms_per_day(self) -> float:
        return self.per_day(len(self.false_alarms))

    @property
    def false_drains_per_day(self) -> float:
        return self.per_day(len(self.false_drains))

    @property
    def precision_at_field_rate(self) -> float | None:
        """Share of drains that precede a real failure if failures came at ``field_rate`` per day per
        64 nodes: the drains that predict come at that rate times the share predicted by a drain, the
        false ones at the rate measured here."""
        if not self.outcomes:
            return None
        caught = sum(o.drain_predicted for o in self.outcomes) / len(self.outcomes)
        right = caught * self.field_rate
        return right / (right + self.false_drains_per_day) if right + self.false_drains_per_day else None


def concerns(episode: Episode, failure: Failure) -> bool:
    """The alert is about the failing GPU, or about its whole node."""
    return episode.node == failure.node and episode.gpu in (None, str(failure.gpu))


def drains(episodes: Iterable[Episode], merge: float = DRAIN_MERGE) -> list[list[Episode]]:
    """Draining episodes merged per node: one that starts while another drain alert of the node fires
    (or within ``merge`` of its end) is the same drain."""
    trips: list[list[Episode]] = []
    last: dict[str | None, list[Episode]] = {}
    for e in sorted((e for e in episodes if e.action in DRAINING_ACTIONS), key=lambda e: e.start):
        trip = last.get(e.node)
        if trip is not None and e.start <= max(x.end for x in trip) + merge:
            trip.append(e)
        else:
            last[e.node] = [e]
            trips.append(last[e.node])
    return trips


def warning_window(failure: Failure, start: float, min_lead: float) -> tuple[float, float]:
    """Unix times an alert about the failing GPU may start in to warn of it: from precursor onset
    (at least ``min_lead`` before the instant, so that the last minutes before a sudden fault count
    as a late warning, not a false alarm) until the instant."""
    instant = start + failure.instant
    return min(start + failure.onset, instant - min_lead), instant


def _outcome(failure: Failure, mine: list[Episode], start: float, min_lead: float) -> Outcome:
    onset, instant = start + failure.onset, start + failure.instant
    first, _ = warning_window(failure, start, min_lead)
    before = [e for e in mine if first <= e.start < instant and e.action not in JOB_ACTIONS]
    early = [e for e in before if onset <= e.start <= instant - min_lead]
    after = [e for e in mine if instant <= e.start <= instant + AFTER_HORIZON]
    latency = min(e.start for e in after) - instant if after else None
    detecting = [e for e in after if e.start <= instant + DETECT_WINDOW]
    outcome = Outcome(failure, "missed", latency_seconds=latency)
    if early:
        outcome.status, outcome.lead_seconds = "predicted", instant - min(e.start for e in early)
        outcome.alerts = sorted({e.alert for e in early})
        outcome.drain_predicted = any(e.action in DRAINING_ACTIONS for e in early)
    elif before:
        outcome.status, outcome.late_lead_seconds = "late_warning", instant - min(e.start for e in before)
        outcome.alerts = sorted({e.alert for e in before})
    elif detecting:
        outcome.status, outcome.alerts = "detected", sorted({e.alert for e in detecting})
    return outcome


def score(
    failures: Iterable[Failure],
    episodes: Iterable[Episode],
    start: float,
    duration: float,
    nodes: int,
    *,
    min_lead: float = DEFAULT_MIN_LEAD,
    field_rate: float = DEFAULT_FIELD_RATE,
    lemon_window: float = DEFAULT_LEMON_WINDOW,
    lemon_alerts: str = LEMON_ALERTS,
) -> Score:
    """Match episodes to failures; ``start`` is the unix time failure offsets count from."""
    failures = list(failures)
    episodes = list(episodes)
    lemon = re.compile(lemon_alerts)
    actionable = [e for e in episodes if e.action != "none"]
    lemons = [e for e in actionable if lemon.search(e.alert)]
    actionable = [e for e in actionable if not lemon.search(e.alert)]
    informational = [e for e in episodes if e.action == "none"]
    outcomes: list[Outcome] = []
    matched: set[int] = set()  # ids of the episodes that match a failure
    for failure in failures:
        mine = [e for e in actionable if concerns(e, failure)]
        outcome = _outcome(failure, mine, start, min_lead)
        outcomes.append(outcome)
        instant = start + failure.instant
        first, _ = warning_window(failure, start, min_lead)
        matched.update(
            id(e)
            for e in mine
            if first <= e.start <= instant + AFTER_HORIZON
            and (e.start >= instant or e.action not in JOB_ACTIONS)
        )
    out_spans = [
        (f.node, start + f.instant, math.inf if f.repaired is None else start + f.repaired) for f in failures
    ]

    def out_of_service(e: Episode) -> bool:
        return any(node == e.node and a <= e.start < b for node, a, b in out_spans)

    hits = [e for e in actionable if id(e) in matched]
    rest = [e for e in actionable if id(e) not in matched]
    after = [e for e in rest if out_of_service(e)]
    right, wrong = [], []
    for e in lemons:
        if out_of_service(e):
            after.append(e)
        elif any(
            f.node == e.node and e.start <= start + f.instant <= e.start + lemon_window for f in failures
        ):
            right.append(e)
        else:
            wrong.append(e)
    false = [e for e in rest if not out_of_service(e)] + wrong
    return Score(
        outcomes,
        sorted(false, key=lambda e: e.start),
        after,
        informational,
        hits,
        duration / 86400,
        nodes,
        false_drains=drains(false),
        lemon_right=right,
        lemon_wrong=wrong,
        min_lead=min_lead,
        field_rate=field_rate,
    )


def nearest_noise(
    episode: Episode, noise: Iterable[tuple[Noise, Collection[str]]], start: float, slack: float = 3600.0
) -> Noise | None:
    """The benign event that reached the episode's node (``noise`` pairs each event with the nodes it
    touched), on its GPU or node-wide, overlapping it within ``slack`` and starting closest to it, if
    any: the likely cause of a false alarm."""
    near = [
        event
        for event, nodes in noise
        if episode.node in nodes
        and (
            episode.gpu is None
            or event.gpu is None
            or (event.node, str(event.gpu)) == (episode.node, episode.gpu)
        )
        and start + event.at - slack <= episode.start <= start + event.at + event.duration + slack
    ]
    return min(near, key=lambda e: abs(start + e.at - episode.start), default=None)


def noise_near(
    episode: Episode, noise: Iterable[tuple[Noise, Collection[str]]], start: float, slack: float = 3600.0
) -> str | None:
    """The kind of ``nearest_noise``."""
    event = nearest_noise(episode, noise, start, slack)
    return event.kind if event else None
