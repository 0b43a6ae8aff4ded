"""Alert state over an evaluation grid: ``for:`` as Prometheus applies it, and episodes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuhealth.evaluation.alerts import AlertEvaluator, AlertRun, alert_labels, fires, runs
from gpuhealth.evaluation.openmetrics import Thinning
from gpuhealth.evaluation.rulefiles import Rule, load_rules
from gpuhealth.evaluation.signals import Family

from .tsdb import COUNT, START, STEP, prometheus_on


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


BROKEN_RULES = """
groups:
- name: g
  interval: 1m
  rules:
  - record: test:load:joined
    expr: load * on (node) load
  - record: test:load:max
    expr: max by (node) (load)
  - alert: Busy
    expr: test:load:joined > 0 or test:load:max > 5
"""


@pytest.mark.slow
def test_a_record_prometheus_rejects_is_reported_and_records_nothing(tmp_path: Path) -> None:
    """``load * on (node) load`` meets two GPUs per node: Prometheus refuses it (many-to-many), so in
    Prometheus it would record nothing; the alert still fires on its other branch."""
    (tmp_path / "rules.yml").write_text(BROKEN_RULES)
    rows = [(f'node="n{n}",gpu="{g}"', np.full(COUNT, 3.0 + 4 * n)) for n in range(2) for g in range(2)]
    with prometheus_on(tmp_path, [(Family("load", "gauge", rows), Thinning(0, 0))]) as (server, _):
        rules = load_rules(tmp_path / "rules.yml")
        evaluator = AlertEvaluator(server.api, rules, START + 3600, START + STEP * (COUNT - 1), STEP)
        evaluator.evaluate(rules.alerts[0])
    assert list(evaluator.run.errors) == ["test:load:joined"]
    assert "many-to-many" in evaluator.run.errors["test:load:joined"]
    firing = evaluator.run.firing["Busy"]
    assert [dict(labels)["node"] for labels in firing] == ["n1"]
    assert all(on.all() for on in firing.values())
