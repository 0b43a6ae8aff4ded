"""Fleet scenarios: the shipped files load, random draws follow the seed, every problem is listed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuhealth.cli import main
from gpuhealth.evaluation.scenario import (
    FAULT_KINDS,
    NOISE_KINDS,
    ScenarioError,
    load_scenario,
    parse_duration,
    parse_scenario,
)

SCENARIOS = Path(__file__).resolve().parents[2] / "bench" / "scenarios"


def test_small_scenario_matches_the_issue() -> None:
    small = load_scenario(SCENARIOS / "small.yaml")
    assert small.fleet.nodes == 4 and small.duration == 86400
    assert {f.kind for f in small.failures} >= {"hbm_degradation", "fell_off_bus"}
    assert all(f.onset == f.failure for f in small.failures if f.kind == "fell_off_bus")


def test_reference_scenario_covers_every_kind() -> None:
    reference = load_scenario(SCENARIOS / "reference.yaml")
    assert reference.fleet.nodes == 64 and reference.fleet.gpus_per_node == 8
    assert reference.duration == 14 * 86400 and reference.fused_step == 300
    assert len(reference.failures) >= 24 and {f.kind for f in reference.failures} == set(FAULT_KINDS)
    assert len(reference.noise) == 200 and {n.kind for n in reference.noise} == set(NOISE_KINDS)
    assert len({f.node for f in reference.failures}) == len(reference.failures)
    for f in reference.failures:
        assert 0 <= f.onset <= f.failure < reference.duration
        assert (f.onset == f.failure) == (f.kind in ("gsp_timeout", "fell_off_bus"))


def test_seed_changes_the_draws_and_is_reproducible() -> None:
    path = SCENARIOS / "reference.yaml"
    assert load_scenario(path, seed=5).failures == load_scenario(path, seed=5).failures
    assert load_scenario(path, seed=5).failures != load_scenario(path, seed=6).failures
    assert load_scenario(path, seed=5).seed == 5


def test_draws_mix_slow_and_fast_weak_and_strong_degradations() -> None:
    failures = [f for f in load_scenario(SCENARIOS / "reference.yaml").failures if f.has_precursor]
    leads = sorted(f.failure - f.onset for f in failures)
    strengths = sorted(f.strength for f in failures)
    assert leads[0] < 3 * 3600 and leads[-1] > 24 * 3600
    assert strengths[0] < 0.5 < strengths[-1]


BAD = {
    "duration": "two days",
    "step": "0s",
    "colour": "blue",
    "fleet": {"nodes": 0, "gpus_per_node": 8},
    "workload": {"job_nodes": [4, 1]},
    "failures": [
        {"node": "gpu-999", "gpu": 3, "kind": "hbm_degradation", "onset": "5h", "failure": "2h"},
        {"node": "gpu-000", "gpu": 9, "kind": "meltdown", "failure": "1h"},
        {"node": "gpu-000", "gpu": 1, "kind": "fell_off_bus", "onset": "1h", "failure": "2h", "xid": 48},
    ],
    "noise": [{"node": "gpu-000", "kind": "hot_aisle", "at": "soon"}],
    "random": {"failures": {"count": 1, "kinds": ["gremlins"]}},
}


def test_malformed_scenario_lists_every_problem_at_once() -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(BAD, "bad.yaml")
    text = str(caught.value)
    for fragment in (
        "scenario.duration",
        "scenario.step",
        "scenario.colour: unknown key",
        "fleet.nodes",
        "workload.job_nodes",
        "failures[0].node",
        "failures[0]: onset 5h is after failure 2h",
        "failures[1].gpu",
        "failures[1].kind",
        "failures[2].onset: fell_off_bus has no precursor",
        "failures[2].xid",
        "noise[0].at",
        "random.failures.kinds: unknown kind(s) gremlins",
    ):
        assert fragment in text, fragment
    assert len(caught.value.problems) >= 13


def test_cli_reports_a_malformed_scenario_with_exit_2_and_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(BAD))
    rules = tmp_path / "rules.yml"
    rules.write_text("groups: []\n")
    assert main(["eval", "--scenario", str(bad), "--rules", str(rules)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "problem(s)" in err and "failures[1].kind" in err and "noise[0].at" in err


def test_cli_reports_unreadable_yaml_and_missing_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("fleet: [unclosed\n")
    rules = tmp_path / "rules.yml"
    rules.write_text("groups: []\n")
    assert main(["eval", "--scenario", str(broken), "--rules", str(rules)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["eval", "--scenario", str(SCENARIOS / "small.yaml"), "--rules", str(tmp_path / "none")]) == 2
    assert "not found" in capsys.readouterr().err


def test_compound_durations_and_no_follow_up_error_for_an_unreadable_one() -> None:
    assert parse_duration("1h30m") == 5400 and parse_duration("1d12h") == 129600
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("1h30")
    bad = yaml.safe_load((SCENARIOS / "small.yaml").read_text())
    bad["failures"][0]["failure"] = "14 hours"
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(bad, "bad.yaml")
    assert caught.value.problems == [
        "failures[0].failure: '14 hours' is not a duration (e.g. 30s, 15m, 6h, 14d, 1h30m)"
    ]
