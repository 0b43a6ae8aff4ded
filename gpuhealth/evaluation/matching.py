"""Alert episodes scored against ground truth.

A failure is *predicted* when an alert for its GPU or its node (an alert without a ``gpu`` label)
starts firing between the precursor onset and the hard failure, and *detected* when one starts within
``detect_window`` after the hard failure; otherwise it is *missed*. Only alerts that make the webhook
act count (``action`` other than ``none``): informational alerts neither predict nor false-alarm.
Every other actionable episode is a false alarm, except episodes on a node after its hard failure:
that node is drained and out of service, so they are counted apart (``after_failure``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpuhealth.evaluation.alerts import Episode
from gpuhealth.evaluation.scenario import Failure, Noise

DETECT_WINDOW = 300.0
REFERENCE_NODES = 64  # false alarms are quoted per day per 64 nodes, like the 504-GPU report


@dataclass
class Outcome:
    failure: Failure
    status: str  # predicted | detected | missed
    lead_seconds: float | None = None  # hard failure minus the first predictive alert
    alerts: list[str] = field(default_factory=list)


@dataclass
class Score:
    outcomes: list[Outcome]
    false_alarms: list[Episode]
    after_failure: list[Episode]
    informational: list[Episode]
    matched: list[Episode]
    days: float
    nodes: int

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def recall(self) -> float | None:
        return (
            (self.count("predicted") + self.count("detected")) / len(self.outcomes) if self.outcomes else None
        )

    @property
    def predicted_fraction(self) -> float | None:
        return self.count("predicted") / len(self.outcomes) if self.outcomes else None

    @property
    def leads(self) -> list[float]:
        return sorted(o.lead_seconds for o in self.outcomes if o.lead_seconds is not None)

    @property
    def median_lead_seconds(self) -> float | None:
        return statistics.median(self.leads) if self.leads else None

    @property
    def false_alarms_per_day(self) -> float:
        return len(self.false_alarms) / self.days * REFERENCE_NODES / self.nodes


def concerns(episode: Episode, failure: Failure) -> bool:
    """The alert is about the failing GPU, or about its whole node."""
    return episode.node == failure.node and episode.gpu in (None, str(failure.gpu))


def score(
    failures: Iterable[Failure],
    episodes: Iterable[Episode],
    start: float,
    duration: float,
    nodes: int,
    detect_window: float = DETECT_WINDOW,
) -> Score:
    """Match episodes to failures; ``start`` is the unix time failure offsets count from."""
    episodes = list(episodes)
    actionable = [e for e in episodes if e.action != "none"]
    informational = [e for e in episodes if e.action == "none"]
    outcomes, matched = [], set()
    failed_at: dict[str, float] = {}
    for failure in failures:
        onset, hard = start + failure.onset, start + failure.failure
        failed_at[failure.node] = min(failed_at.get(failure.node, hard), hard)
        mine = [e for e in actionable if concerns(e, failure)]
        early = [e for e in mine if onset <= e.start < hard]
        late = [e for e in mine if hard <= e.start <= hard + detect_window]
        matched.update(map(id, early + late))
        if early:
            first = min(e.start for e in early)
            outcomes.append(Outcome(failure, "predicted", hard - first, sorted({e.alert for e in early})))
        elif late:
            outcomes.append(Outcome(failure, "detected", None, sorted({e.alert for e in late})))
        else:
            outcomes.append(Outcome(failure, "missed"))
    hits = [e for e in actionable if id(e) in matched]
    rest = [e for e in actionable if id(e) not in matched]
    after = [e for e in rest if e.node in failed_at and e.start >= failed_at[e.node]]
    false = [e for e in rest if not (e.node in failed_at and e.start >= failed_at[e.node])]
    return Score(outcomes, false, after, informational, hits, duration / 86400, nodes)


def noise_near(episode: Episode, noise: Iterable[Noise], start: float, slack: float = 3600.0) -> str | None:
    """The benign event on the episode's node that overlaps it (within ``slack``), if any: the likely
    cause of a false alarm."""
    for event in noise:
        if (
            event.node == episode.node
            and start + event.at - slack <= episode.start <= start + event.at + event.duration + slack
        ):
            return event.kind
    return None
