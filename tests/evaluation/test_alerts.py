"""Alert state over an evaluation grid: ``for:`` as Prometheus applies it, and episodes."""

from __future__ import annotations

import numpy as np

from gpuhealth.evaluation.alerts import AlertRun, alert_labels, fires, runs
from gpuhealth.evaluation.rulefiles import Rule


def mask(text: str) -> np.ndarray:
    return np.array([c == "#" for c in text])


def shown(values: np.ndarray) -> str:
    return "".join("#" if v else "." for v in values)


def test_for_zero_fires_at_once() -> None:
    assert shown(fires(mask("..##.#."), 0, 60)) == "..##.#."


def test_for_waits_the_whole_duration_and_restarts_after_a_gap() -> None:
    # for: 2m at a 1m step: pending at the first two evaluations, firing from the third
    assert shown(fires(mask(".####.###.##"), 120, 60)) == "...##...#..."


def test_for_that_is_not_a_multiple_of_the_step_rounds_up() -> None:
    assert shown(fires(mask("#####"), 90, 60)) == "..###"


def test_runs_are_half_open_index_pairs() -> None:
    assert runs(mask("##..#.###")) == [(0, 2), (4, 5), (6, 9)]
    assert runs(mask("....")) == []


def test_episodes_carry_alert_labels_and_instants() -> None:
    rule = Rule("alert", "Risk", "x > 1", "g", 60.0, 0.0, (("action", "drain"), ("severity", "warning")))
    labels = alert_labels(rule, (("__name__", "x"), ("node", "n1"), ("gpu", "2")))
    assert dict(labels) == {
        "alertname": "Risk",
        "node": "n1",
        "gpu": "2",
        "action": "drain",
        "severity": "warning",
    }
    run = AlertRun(times=1000.0 + 60 * np.arange(6), firing={"Risk": {labels: mask(".##..#")}})
    first, second = run.episodes()
    assert (first.start, first.end, second.start, second.end) == (1060.0, 1120.0, 1300.0, 1300.0)
    assert first.node == "n1" and first.gpu == "2" and first.action == "drain"
