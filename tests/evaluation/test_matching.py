"""Scoring alert episodes against ground truth, on hand-made cases."""

from __future__ import annotations

import pytest

from gpuhealth.evaluation.alerts import Episode
from gpuhealth.evaluation.matching import REFERENCE_NODES, noise_near, score, wilson
from gpuhealth.evaluation.scenario import Failure, Noise

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


def test_alert_within_a_minute_after_failure_detects() -> None:
    result = run([failure()], [episode(12 * HOUR + 60, 13 * HOUR, alert="Xid", action="drain_reset_gpu")])
    (outcome,) = result.outcomes
    assert outcome.status == "detected" and outcome.lead_seconds is None
    assert outcome.alerts == ["Xid"] and outcome.latency_seconds == 60
    assert result.recall == 1.0 and result.predicted_fraction == 0.0
    assert result.detected_fraction == 1.0


def test_alert_four_minutes_after_failure_is_slow_detection_not_detection() -> None:
    result = run([failure()], [episode(12 * HOUR + 240, 13 * HOUR, alert="Xid", action="drain_reset_gpu")])
    (outcome,) = result.outcomes
    assert outcome.status == "missed" and not outcome.detected
    assert outcome.latency_seconds == 240 and result.latencies == [240]
    assert not result.false_alarms


def test_late_alert_misses_and_is_not_a_false_alarm_on_a_failed_node() -> None:
    result = run([failure()], [episode(12 * HOUR + 600)])
    assert result.outcomes[0].status == "missed"
    assert result.recall == 0.0
    assert not result.false_alarms


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


def test_alert_with_less_than_min_lead_is_a_late_warning_not_a_prediction() -> None:
    result = run([failure()], [episode(12 * HOUR - 600, 12.5 * HOUR)])
    (outcome,) = result.outcomes
    assert outcome.status == "late_warning" and outcome.lead_seconds is None
    assert outcome.late_lead_seconds == 600
    assert result.predicted_fraction == 0.0 and result.count("late_warning") == 1
    assert result.recall == 1.0 and not result.false_alarms


def test_alert_with_exactly_min_lead_predicts_and_min_lead_is_the_scenarios() -> None:
    assert run([failure()], [episode(12 * HOUR - 900)]).outcomes[0].status == "predicted"
    strict = score([failure()], [episode(12 * HOUR - 900)], START, 86400, 4, min_lead=HOUR)
    assert strict.outcomes[0].status == "late_warning"


def test_failure_instant_is_the_first_xid_not_the_death_of_the_gpu() -> None:
    # the link logs XID 74 at 11 h and goes down at 12 h; an alert at 11.5 h follows the first XID
    early = Failure("n1", 3, "nvlink_errors", 6 * HOUR, 12 * HOUR, 74, 0.5, "ramp", 11 * HOUR)
    assert early.instant == 11 * HOUR and early.precursor_seconds == 5 * HOUR
    result = run([early], [episode(11 * HOUR, alert="Xid"), episode(11.5 * HOUR, alert="Risk")])
    (outcome,) = result.outcomes
    assert outcome.status == "detected" and outcome.alerts == ["Xid"]
    assert outcome.latency_seconds == 0
    assert not result.false_alarms
    predicted = run([early], [episode(10 * HOUR)]).outcomes[0]
    assert predicted.status == "predicted" and predicted.lead_seconds == HOUR


def test_long_precursor_share_counts_only_failures_with_an_hour_of_precursor() -> None:
    long = failure(onset=8 * HOUR)
    short = failure(node="n2", onset=11.5 * HOUR)
    result = run([long, short], [episode(9 * HOUR), episode(11.6 * HOUR, node="n2")])
    assert [o.status for o in result.outcomes] == ["predicted", "predicted"]
    assert [o.failure for o in result.long_precursor] == [long]
    assert result.predicted_fraction == 1.0


def test_distinct_drains_merge_per_node_while_the_alerts_fire() -> None:
    episodes = [
        episode(1 * HOUR, 2 * HOUR, node="n2", alert="Risk"),
        episode(1.5 * HOUR, 1.6 * HOUR, node="n2", alert="Xid", action="drain_reset_gpu"),  # same trip
        episode(2 * HOUR + 240, 2.6 * HOUR, node="n2", alert="Risk"),  # off for one evaluation: the same
        episode(2.7 * HOUR, node="n2", alert="Risk"),  # a new drain
        episode(1 * HOUR, node="n3", alert="Risk"),  # another node
        episode(1 * HOUR, node="n4", alert="Job", action="restart_job"),  # does not drain
    ]
    result = run([], episodes, days=1.0, nodes=64)
    assert len(result.false_alarms) == 6
    assert [len(trip) for trip in result.false_drains] == [3, 1, 1]
    assert result.false_drains_per_day == pytest.approx(3.0)


def test_lemon_alert_is_right_when_its_node_fails_again_within_the_window() -> None:
    again = failure(onset=30 * HOUR, hard=40 * HOUR)
    lemon_right = episode(5 * HOUR, node="n1", gpu=None, alert="LemonNode", action="replace")
    lemon_wrong = episode(5 * HOUR, node="n2", gpu=None, alert="LemonNode", action="replace")
    result = score([again], [lemon_right, lemon_wrong], START, 3 * 86400, 4, lemon_window=2 * 86400)
    assert result.lemon_right == [lemon_right] and result.lemon_wrong == [lemon_wrong]
    assert result.false_alarms == [lemon_wrong]  # a wrong lemon alert takes a node out for nothing
    assert result.outcomes[0].status == "missed"  # a lemon alert is not a prediction
    short = score([again], [lemon_right], START, 3 * 86400, 4, lemon_window=HOUR)
    assert short.lemon_wrong == [lemon_right]


def test_repaired_node_alerts_count_again_as_false_alarms() -> None:
    repaired = Failure("n1", 3, "fell_off_bus", 12 * HOUR, 12 * HOUR, 79, 0.5, "none", None, 20 * HOUR)
    result = run([repaired], [episode(15 * HOUR), episode(21 * HOUR)], days=2.0)
    assert len(result.after_failure) == 1 and len(result.false_alarms) == 1
    assert result.false_alarms[0].start == START + 21 * HOUR


@pytest.mark.parametrize(
    ("field_rate", "false_drains", "expected"),
    [(0.17, 1, 0.17 * 0.5 / (0.17 * 0.5 + 1.0)), (1.0, 0, 1.0), (0.5, 2, 0.5 * 0.5 / (0.5 * 0.5 + 2.0))],
)
def test_precision_at_the_field_rate(field_rate: float, false_drains: int, expected: float) -> None:
    # one of two failures predicted by a drain, false drains on other nodes, 64 nodes for a day
    failures = [failure(), failure(node="n2")]
    episodes = [episode(10.5 * HOUR)] + [episode(h * HOUR, node=f"x{h}") for h in range(false_drains)]
    result = score(failures, episodes, START, 86400, 64, field_rate=field_rate)
    assert result.false_drains_per_day == pytest.approx(false_drains)
    assert result.precision_at_field_rate == pytest.approx(expected)


def test_precision_needs_a_prediction_by_a_drain() -> None:
    result = score([failure()], [episode(10.5 * HOUR, action="checkpoint_drain")], START, 86400, 64)
    assert result.outcomes[0].drain_predicted and result.precision_at_field_rate == 1.0
    result = score([failure()], [episode(10.5 * HOUR, action="restart_job")], START, 86400, 64)
    assert result.precision_at_field_rate is None


def test_a_job_restart_before_the_failure_is_no_warning_but_detects_after_it() -> None:
    """A buggy job's application XIDs on the node during a precursor blame the job: crediting them
    would score a coincidence as a prediction."""
    before = episode(10.5 * HOUR, alert="XidRestartJob", action="restart_job")
    late = episode(12 * HOUR - 60, alert="XidRestartJob", action="restart_job")
    result = run([failure()], [before, late])
    assert result.outcomes[0].status == "missed"
    assert len(result.false_alarms) == 2
    after = episode(12 * HOUR + 30, alert="XidNvlinkError", action="restart_job")
    result = run([failure()], [before, after])
    assert result.outcomes[0].status == "detected" and result.outcomes[0].alerts == ["XidNvlinkError"]
    assert [e.alert for e in result.false_alarms] == ["XidRestartJob"]


@pytest.mark.parametrize(
    ("k", "n", "low", "high"), [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0)]
)
def test_wilson_interval(k: int, n: int, low: float, high: float) -> None:
    interval = wilson(k, n)
    assert interval is not None
    assert interval[0] == pytest.approx(low, abs=1e-4) and interval[1] == pytest.approx(high, abs=1e-4)
    assert wilson(0, 0) is None


def test_a_false_alarm_is_blamed_on_the_closest_benign_event_that_reached_its_gpu_or_node() -> None:
    chatter = Noise("n1", "sbe_chatter", 0, 20 * HOUR, 0.5, gpu=2)
    xid94 = Noise("n1", "contained_xid94", 10 * HOUR, 600, 0.5, gpu=3)
    buggy_job = Noise("n2", "app_xid", 9 * HOUR, 4 * HOUR, 0.5)
    reach = [(chatter, ["n1"]), (xid94, ["n1"]), (buggy_job, ["n2", "n3"])]
    assert noise_near(episode(10 * HOUR, gpu="3"), reach, START) == "contained_xid94"
    assert noise_near(episode(10 * HOUR, gpu="2"), reach, START) == "sbe_chatter"
    assert noise_near(episode(10 * HOUR, node="n3", gpu="5"), reach, START) == "app_xid"  # same job
    assert noise_near(episode(10 * HOUR, node="n4"), reach, START) is None


def test_alert_in_the_minutes_before_a_sudden_fault_is_a_late_warning_not_a_false_alarm() -> None:
    sudden = Failure("n1", 3, "gsp_timeout", 12 * HOUR, 12 * HOUR, 119, 0.5, "none")
    result = run([sudden], [episode(12 * HOUR - 600, gpu=None, alert="SlowNvml")])
    assert result.outcomes[0].status == "late_warning" and not result.false_alarms
    earlier = run([sudden], [episode(12 * HOUR - 1800, gpu=None, alert="SlowNvml")])
    assert earlier.outcomes[0].status == "missed" and len(earlier.false_alarms) == 1


def test_a_flapping_alert_is_a_drain_each_time_it_comes_back() -> None:
    flaps = [episode(h * HOUR, h * HOUR + 60, node="n2") for h in range(24)]
    result = run([], flaps, days=1.0, nodes=64)
    assert len(result.false_drains) == 24
