"""The benchmark's simulator speaks the shared vocabulary: the exporter's metric table, its collector
names, every fault and noise kind, and XID 154 where the vocabulary says the driver asks for a reset."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
from gpuhealth.contract.faults import (
    FABRIC_FAULT_KINDS,
    FALLS_OFF_BUS_KINDS,
    FAULT_KINDS,
    NOISE_KINDS,
    RECOVERY_ACTION_KINDS,
    RECOVERY_ACTION_XID,
)
from gpuhealth.contract.metrics import COLLECTORS, SPECS

from gpuhealth.evaluation.effects import FOLD_ORDER
from gpuhealth.evaluation.faults import FAULTS
from gpuhealth.evaluation.noise import NOISE
from gpuhealth.evaluation.scenario import load_scenario
from gpuhealth.evaluation.signals import Family, FleetSignals

KINDS = Path(__file__).resolve().parents[2] / "bench" / "scenarios" / "kinds.yaml"
TARGET_LABELS = {"instance", "job", "node"}  # set by the scrape, not by the exporter
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@cache
def signals() -> FleetSignals:
    """Every fault kind and every noise kind once, on a small fleet."""
    return FleetSignals(load_scenario(KINDS))


@cache
def families() -> dict[str, Family]:
    return {family.name: family for family in signals().families()}


def test_every_kind_of_the_vocabulary_has_one_class_and_one_place_in_the_fold() -> None:
    assert set(FAULTS) == set(FAULT_KINDS)
    assert set(NOISE) == set(NOISE_KINDS)
    folded = [kind for kinds in FOLD_ORDER for kind in kinds]
    assert sorted(folded) == sorted((*FAULT_KINDS, *NOISE_KINDS))


def test_the_kinds_scenario_holds_every_kind() -> None:
    scenario = signals().scenario
    assert {f.kind for f in scenario.failures} == set(FAULT_KINDS)
    assert {n.kind for n in scenario.noise} == set(NOISE_KINDS)


def test_every_family_is_in_the_exporters_table_with_its_type() -> None:
    published = families()
    assert set(signals().builders) == set(published)
    for name, family in published.items():
        if name == "up":  # Prometheus's own, for the scrape
            assert family.kind == "gauge"
            continue
        assert name in SPECS, f"{name} is not a metric the exporter publishes"
        assert family.kind == SPECS[name].kind, name


@pytest.mark.parametrize("name", sorted(n for n in SPECS if n in {f for f in families()}))
def test_every_series_has_exactly_the_exporters_labels(name: str) -> None:
    for labels, _ in families()[name].series:
        names = {key for key, _ in LABEL.findall(labels)}
        assert names - TARGET_LABELS == set(SPECS[name].labels), (name, labels)


def test_collector_values_are_the_exporters_collectors() -> None:
    values = {
        dict(LABEL.findall(labels))["collector"]
        for labels, _ in families()["gpuhealth_collector_success"].series
    }
    assert values == set(COLLECTORS)


def test_xid_154_comes_with_the_failures_that_ask_for_a_gpu_reset_and_no_others() -> None:
    s = signals()
    ended = [f for f in s.scenario.failures if s.at(f.failure) < s.timeline.count]
    for failure in (f for f in ended if f.kind not in FABRIC_FAULT_KINDS):  # those log no XID (test_fabric)
        row, at = s.gpu_index(failure.node, failure.gpu), s.at(failure.failure)
        logged = {xid for (i, xid), increments in s.xid_events.items() if i == row and increments[at] > 0}
        assert failure.xid in logged
        assert (RECOVERY_ACTION_XID in logged) == (failure.kind in RECOVERY_ACTION_KINDS), failure
    asking = {s.gpu_index(f.node, f.gpu) for f in ended if f.kind in RECOVERY_ACTION_KINDS}
    assert asking, "the scenario has failures that ask for a reset"
    assert {i for i, xid in s.xid_events if xid == RECOVERY_ACTION_XID} == asking


def test_faults_that_fall_off_the_bus_lose_the_gpu_in_nvml() -> None:
    for kind, cls in FAULTS.items():
        assert (cls.lost_error == "gpu_is_lost") == (kind in FALLS_OFF_BUS_KINDS), kind
