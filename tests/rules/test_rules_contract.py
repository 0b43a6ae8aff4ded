"""The rules, their test inputs and the synthetic load-test fleet read only what the exporter publishes:
metric names of the shared table (gpuhealth.contract.metrics), its label names, and collector values
the exporter really has. Collector values anywhere in the repository are held to the same list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from gpuhealth.contract.metrics import COLLECTORS, SPECS
from rules_promtool import GENERATED, INPUTS

from gpuhealth.local import synthetic_fleet as fleet

REPO = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\b(gpuhealth_[a-z0-9_]+)")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
COLLECTOR_VALUE = re.compile(r"""["']?collector["']?\s*(?:=~?|:)\s*\\?["']([^"'\\]*)\\?["']""")


def _exprs() -> list[str]:
    out = []
    for path in sorted((GENERATED / "gpuhealth").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            out += [rule["expr"] for rule in group["rules"]]
    return out


def test_the_generated_rules_read_only_published_metrics() -> None:
    read = {name for expr in _exprs() for name in METRIC.findall(expr)}
    assert read, "the rules read exporter metrics"
    assert read - set(SPECS) == set()


def test_the_rule_tests_spell_exporter_inputs_as_the_exporter_publishes_them() -> None:
    for name, labels, _ in INPUTS["gpuhealth"].values():
        if name == "up":   # Prometheus's own scrape health of the exporter, not a metric it publishes
            continue
        assert name in SPECS, name
        assert set(labels) <= set(SPECS[name].labels), (name, labels)
        if "collector" in labels:
            assert labels["collector"] in COLLECTORS


@pytest.mark.parametrize("collapsed", [False, True])
def test_the_synthetic_fleet_publishes_only_table_metrics_and_real_collectors(collapsed: bool) -> None:
    series = [*fleet._node_series(collapsed), *fleet._gpu_series("n1", 0, 2, sick=True)]
    for s in series:
        name = s.text.split("{", 1)[0]
        assert name in SPECS, name
        labels = dict(LABEL.findall(s.text))
        assert set(labels) <= set(SPECS[name].labels), s.text
        if "collector" in labels:
            assert labels["collector"] in COLLECTORS, s.text


# Where a collector value would be the exporter's: every component, and the tests that feed rules,
# the webhook and the benchmark (the exporter's own tests register fake collectors on purpose).
SCANNED = ("exporter", "rules", "webhook", "dashboards", "gpuhealth", "contract", "ansible", "bench", "docs",
           "tests/rules", "tests/webhook", "tests/evaluation", "tests/dashboards")


def _sources() -> list[Path]:
    return [
        path
        for folder in SCANNED
        for path in (REPO / folder).rglob("*")
        if path.suffix in {".py", ".yml", ".yaml", ".j2", ".md", ".json"} and path.is_file()
    ]


def test_every_collector_value_in_the_repository_is_one_the_exporter_has() -> None:
    found = {
        (path.relative_to(REPO).as_posix(), value)
        for path in _sources()
        for value in COLLECTOR_VALUE.findall(path.read_text(errors="replace"))
        if not value.startswith("{")  # formatted from the shared list itself
    }
    assert found, "the scan finds the collector values the rules tests use"
    assert {(path, value) for path, value in found if value not in COLLECTORS} == set()
