"""Fleet scenarios: the shipped files load, random draws follow the seed, every problem is listed."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import yaml
from gpuhealth.contract.faults import FABRIC_KINDS

from gpuhealth.cli import main
from gpuhealth.evaluation.scenario import (
    FAULT_KINDS,
    FIELD_SHARES,
    NOISE_KINDS,
    PRECURSOR_SHAPES,
    SUDDEN_KINDS,
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


def test_reference_scenario_meets_its_specification() -> None:
    reference = load_scenario(SCENARIOS / "reference.yaml")
    assert reference.fleet.nodes == 64 and reference.fleet.gpus_per_node == 8
    assert reference.duration == 14 * 86400 and reference.fused_step == 300
    assert reference.min_lead == 900 and reference.field_rate == 0.17
    assert len(reference.failures) >= 40
    assert sum(f.precursor_seconds >= 3600 for f in reference.failures) >= 15
    assert len(reference.noise) >= 400
    assert {n.kind for n in reference.noise} == set(NOISE_KINDS) - set(FABRIC_KINDS)
    for f in reference.failures:
        assert 0 <= f.onset <= f.instant <= f.failure < reference.duration
        assert f.repaired is not None and f.repaired > f.failure
        if f.kind in SUDDEN_KINDS:
            assert f.shape == "none" and not f.has_precursor
    # repaired nodes fail again, and a few lemon nodes hold a large share of the failures
    per_node = sorted(Counter(f.node for f in reference.failures).values(), reverse=True)
    assert sum(per_node[:3]) >= 0.2 * len(reference.failures) and per_node[0] >= 4
    assert {f.shape for f in reference.failures} == set(PRECURSOR_SHAPES)


def test_field_mix_draws_kinds_in_the_published_shares() -> None:
    kinds = Counter(
        f.kind for seed in range(6) for f in load_scenario(SCENARIOS / "reference.yaml", seed=seed).failures
    )
    total = sum(kinds.values())
    # the reference lists the GPU kinds: shares within them (fabric kinds are drawn where listed)
    gpu_kinds = [k for k in FAULT_KINDS if k not in FABRIC_KINDS]
    shares = {k: FIELD_SHARES[k] / sum(FIELD_SHARES[j] for j in gpu_kinds) for k in gpu_kinds}
    for kind, share in shares.items():
        assert abs(kinds[kind] / total - share) < 0.06, kind
    assert kinds["hbm_degradation"] > kinds["gsp_timeout"] > kinds["thermal_runaway"]


def test_tuning_differs_from_the_reference_in_its_generator_not_only_its_seed() -> None:
    def generator(name: str) -> dict:
        data = yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())
        return data["random"]

    tuning, reference = generator("tuning"), generator("reference")
    assert tuning["failures"]["precursor"] != reference["failures"]["precursor"]
    assert tuning["failures"]["shapes"] != reference["failures"]["shapes"]
    assert tuning["noise"]["kinds"] != reference["noise"]["kinds"]


def test_thermal_tuning_fleet_is_the_tuning_generator_with_thermal_faults_among_benign_heat() -> None:
    """Tuned on, so it must stay of the tuning family (its precursors, not the reference's) and hold
    every benign kind that warms a GPU or its node, several times a fleet."""
    thermal = load_scenario(SCENARIOS / "tuning-thermal.yaml")
    tuning = load_scenario(SCENARIOS / "tuning.yaml")
    assert {f.kind for f in thermal.failures} == {"thermal_runaway"}
    assert (thermal.fleet, thermal.duration) == (tuning.fleet, tuning.duration)
    def failures(name: str) -> dict:
        return yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())["random"]["failures"]

    assert failures("tuning-thermal")["precursor"] == failures("tuning")["precursor"]
    heat = Counter(n.kind for n in thermal.noise)
    assert all(heat[kind] >= 5 for kind in ("warm_gpu", "hot_aisle", "rack_cooling", "load_imbalance",
                                            "power_cap", "power_brake", "idle_node")), heat


def test_seed_changes_the_draws_and_is_reproducible() -> None:
    path = SCENARIOS / "reference.yaml"
    assert load_scenario(path, seed=5).failures == load_scenario(path, seed=5).failures
    assert load_scenario(path, seed=5).failures != load_scenario(path, seed=6).failures
    assert load_scenario(path, seed=5).seed == 5


def test_draws_mix_slow_and_fast_weak_and_strong_degradations() -> None:
    failures = [f for f in load_scenario(SCENARIOS / "reference.yaml").failures if f.has_precursor]
    leads = sorted(f.precursor_seconds for f in failures)
    strengths = sorted(f.strength for f in failures)
    assert leads[0] < 3 * 3600 and leads[-1] > 24 * 3600
    assert strengths[0] < 0.2 and strengths[-1] > 0.6


# the tuning scenario as it was before precursor shapes, repairs and field mixes existed
OLD_FORMAT = """
name: tuning
seed: 11
start: 2026-01-05T00:00:00Z
duration: 4d
warmup: 1d
step: 60s
fused_step: 5m
fleet: {nodes: 16, gpus_per_node: 8, model: NVIDIA H100 80GB HBM3, nvlinks: 18}
workload: {job_nodes: [2, 8], job_duration: [3h, 36h], idle_gap: [5m, 2h], checkpoint_every: 1h,
           checkpoint_duration: 4m}
random:
  failures:
    count: 12
    kinds: [hbm_degradation, thermal_runaway, pcie_degradation, nvlink_errors, gsp_timeout, fell_off_bus]
    precursor: [30m, 3d]
  noise:
    count: 50
    kinds: [sbe_burst, hot_aisle, boot_replay_burst, power_cap, idle_node, checkpoint_burst]
"""


def test_old_scenario_files_still_parse_with_todays_defaults() -> None:
    old = parse_scenario(yaml.safe_load(OLD_FORMAT), "old.yaml")
    assert len(old.failures) == 12 and len(old.noise) == 50
    assert Counter(f.kind for f in old.failures) == dict.fromkeys(FAULT_KINDS[:6], 2)
    assert Counter(n.kind for n in old.noise) == dict.fromkeys(NOISE_KINDS[:6], 8) | {
        "sbe_burst": 9,
        "hot_aisle": 9,
    }
    assert len({f.node for f in old.failures}) == 12  # a failed node never returns
    for f in old.failures:
        assert f.repaired is None and f.first_xid is None
        assert f.shape == ("none" if f.kind in SUDDEN_KINDS else "ramp")
        assert 0.25 <= f.strength <= 1.0
    assert (old.min_lead, old.field_rate) == (900, 0.17)
    small = load_scenario(SCENARIOS / "small.yaml")
    assert small.failures[0].shape == "ramp" and small.failures[0].instant == 14 * 3600


def test_a_node_fails_again_only_after_its_repair() -> None:
    base = yaml.safe_load((SCENARIOS / "small.yaml").read_text())
    again = {"node": "gpu-001", "gpu": 1, "kind": "fell_off_bus", "failure": "20h"}
    with pytest.raises(ScenarioError, match="out of service"):
        parse_scenario(base | {"failures": [*base["failures"], again]})
    base["failures"][0]["repaired"] = "16h"
    scenario = parse_scenario(base | {"failures": [*base["failures"], again]})
    assert [f.node for f in scenario.failures].count("gpu-001") == 2


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
        "random.failures.kinds[0]: 'gremlins' is not one of 'hbm_degradation'",
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
        "scenario.failures[0].failure: '14 hours' is not a duration (whole numbers with units y, w, d, h, "
        "m, s, ms, largest first, e.g. 30s, 1h30m, 500ms, 1w)"
    ]


def test_cli_rejects_a_lemon_pattern_that_is_not_a_regular_expression(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["eval", "--scenario", str(SCENARIOS / "small.yaml"), "--lemon-alerts", "("])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "not a regular expression" in err and "Traceback" not in err


def test_plain_seconds_and_prometheus_durations_mean_the_same() -> None:
    base = yaml.safe_load((SCENARIOS / "small.yaml").read_text())
    words = parse_scenario(base | {"duration": "1d", "step": "1m", "warmup": "2h"})
    numbers = parse_scenario(base | {"duration": 86400, "step": 60, "warmup": 7200})
    assert (words.duration, words.step, words.warmup) == (numbers.duration, numbers.step, numbers.warmup)
    assert words.failures == numbers.failures and words.noise == numbers.noise
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(base | {"warmup": -1, "step": 1.5, "duration": True})
    assert caught.value.problems == [
        "scenario.duration: expected a duration such as 30s or 1h30m, or a number of seconds, got True",
        "scenario.warmup: must be >= 0",
        "scenario.step: must be a whole number of seconds >= 1, got 1.5s",
    ]


def test_the_scenario_schema_agrees_with_the_loader() -> None:
    """As an editor sees the file: YAML timestamps are text there."""
    schema = json.loads((SCENARIOS.parents[1] / "docs" / "schema" / "evaluation-scenario.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for path in sorted(SCENARIOS.glob("*.yaml")):
        document = json.loads(json.dumps(yaml.safe_load(path.read_text()), default=str))
        assert list(validator.iter_errors(document)) == [], path.name
    base = yaml.safe_load((SCENARIOS / "small.yaml").read_text())
    for broken in ({"duration": "1.5h"}, {"colour": 1}, {"fleet": {"nodes": 0}},
                   {"random": {"failures": {"kinds": ["gremlins"]}}}, {"workload": {"job_nodes": [1]}}):
        assert not validator.is_valid(base | broken), broken
        with pytest.raises(ScenarioError):
            parse_scenario(base | broken)
