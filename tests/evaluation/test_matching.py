"""Scoring alert episodes against ground truth, on hand-made cases."""

from __future__ import annotations

import pytest

from gpuhealth.evaluation.alerts import Episode
from gpuhealth.evaluation.matching import REFERENCE_NODES, score
from gpuhealth.evaluation.scenario import Failure

START = 1_767_571_200.0  # offsets below count from here
HOUR = 3600.0


def failure(
    node: str = "n1",
    gpu: int = 3,
    onset: float = 10 * HOUR,
    hard: float = 12 * HOUR,
    kind: str = "hbm_degradation",
) -> Failure:
    return Failure(node, gpu, kind, onset, hard, 94, 0.5)


def episode(
    start: float,
    end: float | None = None,
    *,
    alert: str = "Risk",
    node: str = "n1",
    gpu: str | None = "3",
    action: str = "drain",
) -> Episode:
    labels = {"alertname": alert, "node": node, "action": action}
    if gpu is not None:
        labels["gpu"] = gpu
    return Episode(
        alert, tuple(sorted(labels.items())), START + start, START + (end if end is not None else start)
    )


def run(failures: list[Failure], episodes: list[Episode], days: float = 1.0, nodes: int = 4):
    return score(failures, episodes, START, days * 86400, nodes)


def test_early_alert_predicts_with_lead_time() -> None:
    result = run([failure()], [episode(11 * HOUR, 12.5 * HOUR)])
    (outcome,) = result.outcomes
    assert outcome.status == "predicted"
    assert outcome.lead_seconds == HOUR
    assert result.recall == 1.0 and result.predicted_fraction == 1.0
    assert result.median_lead_seconds == HOUR
    assert not result.false_alarms


def test_alert_within_five_minutes_after_failure_detects() -> None:
    result = run([failure()], [episode(12 * HOUR + 240, 13 * HOUR, alert="Xid", action="drain_reset_gpu")])
    (outcome,) = result.outcomes
    assert outcome.status == "detected" and outcome.lead_seconds is None
    assert outcome.alerts == ["Xid"]
    assert result.recall == 1.0 and result.predicted_fraction == 0.0


def test_late_alert_misses_and_is_not_a_false_alarm_on_a_failed_node() -> None:
    result = run([failure()], [episode(12 * HOUR + 600)])
    assert result.outcomes[0].status == "missed"
    assert result.recall == 0.0
    assert result.after_failure and not result.false_alarms


def test_alert_before_onset_is_a_false_alarm_not_a_prediction() -> None:
    result = run([failure()], [episode(9 * HOUR, 10.5 * HOUR)])
    assert result.outcomes[0].status == "missed"
    assert len(result.false_alarms) == 1


def test_missed_failure_without_alerts() -> None:
    result = run([failure(), failure(node="n2", gpu=0)], [episode(11 * HOUR)])
    assert [o.status for o in result.outcomes] == ["predicted", "missed"]
    assert result.recall == 0.5
    assert result.median_lead_seconds == HOUR


def test_duplicate_episodes_for_one_failure_count_once_and_are_not_false_alarms() -> None:
    episodes = [
        episode(10.5 * HOUR, 10.6 * HOUR),
        episode(11 * HOUR, 12 * HOUR),  # flapping
        episode(11.5 * HOUR, alert="Other"),
        episode(12 * HOUR + 60, alert="Xid"),
    ]
    result = run([failure()], episodes)
    (outcome,) = result.outcomes
    assert outcome.status == "predicted"
    assert outcome.lead_seconds == 1.5 * HOUR  # from the first episode
    assert outcome.alerts == ["Other", "Risk"]
    assert len(result.matched) == 4
    assert not result.false_alarms


def test_alert_on_the_wrong_gpu_is_a_false_alarm() -> None:
    result = run([failure()], [episode(11 * HOUR, gpu="4")])
    assert result.outcomes[0].status == "missed"
    assert len(result.false_alarms) == 1


def test_node_level_alert_counts_for_every_gpu_of_the_node() -> None:
    result = run([failure()], [episode(11 * HOUR, gpu=None, alert="InterruptCollapse")])
    assert result.outcomes[0].status == "predicted"


def test_alert_on_another_node_is_a_false_alarm() -> None:
    result = run([failure()], [episode(11 * HOUR, node="n2")])
    assert result.outcomes[0].status == "missed"
    assert len(result.false_alarms) == 1


def test_informational_alerts_neither_predict_nor_false_alarm() -> None:
    result = run(
        [failure()], [episode(11 * HOUR, action="none"), episode(3 * HOUR, node="n2", action="none")]
    )
    assert result.outcomes[0].status == "missed"
    assert not result.false_alarms
    assert len(result.informational) == 2


def test_sudden_failure_can_only_be_detected() -> None:
    sudden = Failure("n1", 3, "fell_off_bus", 12 * HOUR, 12 * HOUR, 79, 0.5)
    result = run([sudden], [episode(12 * HOUR, gpu=None, alert="GpusMissing", action="drain_reboot")])
    assert result.outcomes[0].status == "detected"
    assert result.predicted_fraction == 0.0


@pytest.mark.parametrize(("nodes", "days", "episodes", "expected"), [(64, 1.0, 2, 2.0), (4, 2.0, 1, 8.0)])
def test_false_alarms_per_day_are_quoted_per_64_nodes(
    nodes: int, days: float, episodes: int, expected: float
) -> None:
    alarms = [episode(h * HOUR, node=f"x{h}") for h in range(episodes)]
    result = run([], alarms, days=days, nodes=nodes)
    assert result.false_alarms_per_day == pytest.approx(expected)
    assert REFERENCE_NODES == 64
    assert result.recall is None
