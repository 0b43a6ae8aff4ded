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


JOBS_RULES = BROKEN_RULES + """  - alert: Rising
    for: 5m
    expr: max by (node) (load) > 10
  - alert: AlsoBusy
    expr: test:load:joined > 1 or test:load:max > 9
  - alert: Broken
    expr: load * on (node) load > 0
  - alert: Low
    expr: min by (node, gpu) (load) < 5
"""


@pytest.mark.slow
def test_alerts_evaluated_several_at_a_time_give_what_one_at_a_time_gives(tmp_path: Path) -> None:
    """With three queries in flight, AlsoBusy is submitted with the broken record folded in before
    Busy's failure marks it; it is evaluated again, and errors are reported in rule order."""
    (tmp_path / "rules.yml").write_text(JOBS_RULES)
    load = np.where(np.arange(COUNT) % 120 < 60, 3.0, 12.0)  # an hour quiet, an hour busy
    rows = [(f'node="n{n}",gpu="{g}"', load + 4 * n + g) for n in range(2) for g in range(2)]
    runs = []
    with prometheus_on(tmp_path, [(Family("load", "gauge", rows), Thinning(0, 0))]) as (server, _):
        rules = load_rules(tmp_path / "rules.yml")
        for jobs in (1, 3):
            end = START + STEP * (COUNT - 1)
            evaluator = AlertEvaluator(server.api, rules, START + 3600, end, STEP, jobs=jobs)
            evaluator.evaluate_all(rules.alerts, lambda: None)
            runs.append(evaluator.run)
    one, three = runs
    assert list(one.errors) == ["test:load:joined", "Broken"]
    assert list(three.errors) == list(one.errors)
    assert set(one.firing) == {"Busy", "Rising", "AlsoBusy", "Low"}
    for table in ("firing", "pending"):
        a, b = getattr(one, table), getattr(three, table)
        assert list(a) == list(b)
        for alert in a:
            assert list(a[alert]) == list(b[alert])
            assert all(np.array_equal(a[alert][k], b[alert][k]) for k in a[alert])
    assert one.pending["Rising"]  # the five minutes before each busy hour fires
