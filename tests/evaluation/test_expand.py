"""Recording rules folded into the expressions that read them give what the recorded series would."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuhealth.evaluation.expand import Expander
from gpuhealth.evaluation.openmetrics import Thinning
from gpuhealth.evaluation.ranges import grid, range_matrix
from gpuhealth.evaluation.rulefiles import RulesError, load_rules, selectors
from gpuhealth.evaluation.signals import Family

from .tsdb import COUNT, START, STEP, prometheus_on

RULES = """
groups:
- name: g
  interval: 1m
  rules:
  - record: job:load:x
    expr: sum by (node) (load) * 2
    labels: {kind: a}
  - record: job:load:x
    expr: max by (node) (load)
    labels: {kind: b}
  - record: job:load:y
    expr: job:load:x{kind="a"} + on (node) job:load:x{kind=~"b"}
  - alert: High
    expr: job:load:y > 10 and rate(job:load:x{kind!="b"}[10m]) >= 0
    for: 5m
"""
EXPECTED = {
    'job:load:x{kind="a"}': 'label_replace(sum by (node) (load) * 2, "kind", "a", "", "")',
    'job:load:x{kind!~"a"}': 'label_replace(max by (node) (load), "kind", "b", "", "")',
    "job:load:y": "sum by (node) (load) * 2 + on (node) max by (node) (load)",
    'rate(job:load:x{kind="a"}[10m])': 'rate(label_replace(sum by (node) (load) * 2, "kind", "a", "", "")'
    "[10m:1m])",
    "count(job:load:x)": "count(sum by (node) (load)) * 2",
    '{__name__=~"job:load:[xy]", kind!="b"}': 'label_replace(label_replace(sum by (node) (load) * 2, "kind", '
    '"a", "", ""), "__name__", "job:load:x", "", "") or label_replace(sum by (node) (load) * 2 + on (node) '
    'max by (node) (load), "__name__", "job:load:y", "", "")',
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("expand")
    (workdir / "rules.yml").write_text(RULES)
    rng = np.random.default_rng(1)
    rows = [(f'node="n{n}",gpu="{g}"', np.round(rng.random(COUNT) * 10)) for n in range(2) for g in range(2)]
    with prometheus_on(workdir, [(Family("load", "gauge", rows), Thinning(0, 0))]) as (server, _):
        yield server, Expander(load_rules(workdir / "rules.yml"))


@pytest.mark.slow
@pytest.mark.parametrize("expr", sorted(EXPECTED))
def test_expansion_matches_the_recorded_semantics(setup, expr: str) -> None:
    server, expander = setup
    expanded = expander.expand(expr)
    assert not [s for s in selectors(expanded) if s.name in expander.definitions]
    times = grid(START + 3600, START + STEP * (COUNT - 1), STEP)
    got = range_matrix(server.api, expanded, times).series
    want = range_matrix(server.api, EXPECTED[expr], times).series
    assert got.keys() == want.keys() and got
    for labels in want:
        np.testing.assert_allclose(got[labels], want[labels], equal_nan=True)


@pytest.mark.slow
def test_offset_reads_the_recorded_value_of_the_past(setup) -> None:
    server, expander = setup
    times = grid(START + 3600, START + STEP * (COUNT - 1), STEP)
    now = range_matrix(server.api, expander.expand("job:load:y"), times).series
    past = range_matrix(server.api, expander.expand("job:load:y offset 30m"), times).series
    for labels, values in now.items():
        np.testing.assert_allclose(past[labels][30:], values[:-30])


def test_a_static_label_leaves_out_the_rules_that_cannot_match(setup) -> None:
    """A record split over rules by a static label (shards, types) costs one rule when a selector
    picks that label: the other rules are not computed and filtered away."""
    _, expander = setup
    picked = expander.expand('job:load:x{kind="a"}')
    assert "sum by (node) (load)" in picked and "max by" not in picked
    assert "max by" in expander.expand('job:load:x{kind=~"a|b"}')
    assert expander.expand('job:load:x{kind="c"}') == "(vector(0) > 1)"


def test_records_used_lists_dependencies_first(setup) -> None:
    _, expander = setup
    alert = next(r for r in expander.definitions["job:load:y"])
    assert expander.records_used("job:load:y > 1") == ["job:load:x", "job:load:y"]
    assert alert.interval == 60.0


def test_a_broken_record_becomes_an_empty_vector(setup) -> None:
    _, expander = setup
    fresh = Expander.__new__(Expander)
    fresh.__dict__.update({**expander.__dict__, "_done": {}, "broken": {}})
    fresh.mark_broken("job:load:x", "duplicate series")
    assert "(vector(0) > 1)" in fresh.expand("job:load:y")


def test_selectors_skip_strings_label_lists_and_functions() -> None:
    found = list(
        selectors(
            'sum by (node, gpu) (rate(a_total{x=~"b|c", y!="{z}"}[5m])) '
            '* on (node) group_left (model) label_replace(info, "k", "v", "up", "(.*)") offset 1h'
        )
    )
    assert [(s.name, s.range_seconds, s.function) for s in found] == [
        ("a_total", 300.0, "rate"),
        ("info", None, "label_replace"),
    ]
    assert [(m.label, m.op, m.value) for m in found[0].matchers] == [("x", "=~", "b|c"), ("y", "!=", "{z}")]
    assert found[0].accepts("a_total", {"x": "c", "y": "w"}) and not found[0].accepts("a_total", {"x": "bc"})


def test_cycles_are_reported(tmp_path: Path) -> None:
    rules = tmp_path / "r.yml"
    rules.write_text(
        "groups:\n- name: g\n  rules:\n  - record: a:b\n    expr: a:c + 1\n"
        "  - record: a:c\n    expr: a:b - 1\n"
    )
    with pytest.raises(RulesError, match="cycle"):
        Expander(load_rules(rules)).expand("a:b")
