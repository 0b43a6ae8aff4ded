"""The fabric of a fleet with NICs, read straight from the generator: each fabric fault shows its hard
signal at the failure instant (never an XID) and the precursor physics gives it; each fabric noise kind
fools a naive rule; a fleet without NICs, every scenario written before them, is what it was."""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import yaml

from gpuhealth.evaluation.nics import RATE_BYTES
from gpuhealth.evaluation.scenario import ScenarioError, load_scenario, parse_scenario
from gpuhealth.evaluation.signals import FleetSignals

HOUR = 3600
SCENARIOS = Path(__file__).resolve().parents[2] / "bench" / "scenarios"
BASE = {"duration": "2d", "warmup": "1h", "step": "60s", "repair": ["2h", "6h"],
        "fleet": {"nodes": 8, "gpus_per_node": 8, "nics_per_node": 8, "rack_nodes": 4}}
FAULTS = [
    {"node": "gpu-000", "gpu": 2, "kind": "ib_link_flap", "onset": "4h", "failure": "14h", "strength": 0.7},
    {"node": "gpu-001", "gpu": 5, "kind": "ib_symbol_errors", "onset": "6h", "failure": "20h",
     "strength": 0.6},
    {"node": "gpu-002", "gpu": 0, "kind": "ib_rate_downgrade", "failure": "10h"},
    {"node": "gpu-003", "gpu": 0, "kind": "nvswitch_fatal", "onset": "16h", "failure": "22h",
     "strength": 0.8},
]
NOISE = [
    {"node": "gpu-000", "gpu": 3, "kind": "ib_boot_flap", "at": "30h"},
    {"node": "gpu-005", "kind": "switch_reboot", "at": "30h", "duration": "12m"},
]


@cache
def fleet() -> FleetSignals:
    return FleetSignals(parse_scenario({**BASE, "failures": FAULTS, "noise": NOISE}))


@cache
def series(name: str) -> dict[str, np.ndarray]:
    families = fleet().families(lambda n: n == name)
    return {labels: values for family in families for labels, values in family.series}


def port(name: str, node: str, nic: int, error: str | None = None) -> np.ndarray:
    want = [f'device="mlx5_{nic}"', f'node="{node}"', *([f'error="{error}"'] if error else [])]
    (values,) = [v for labels, v in series(name).items() if all(w in labels for w in want)]
    return values


def at(seconds: float) -> int:
    return fleet().at(seconds)


def test_port_faults_show_their_hard_signal_at_the_failure_and_log_no_xid():
    up = port("gpuhealth_nic_port_up", "gpu-000", 2)
    downed = port("gpuhealth_nic_port_link_downed_total", "gpu-000", 2)
    # ib_link_flap: flaps more and more often before the failure, down for good from it until repair
    assert downed[at(14 * HOUR) - 1] >= 2 and up[at(14 * HOUR) - 1] == 1
    assert downed[at(9 * HOUR)] < downed[at(14 * HOUR) - 1]
    assert (up[at(14 * HOUR): at(15 * HOUR)] == 0).all()
    # ib_symbol_errors: symbol errors grow over hours (far above infiniband-diags' 10 an hour), then down
    symbols = port("gpuhealth_nic_port_errors_total", "gpu-001", 5, "symbol_error")
    assert symbols[at(20 * HOUR) - 1] - symbols[at(19 * HOUR)] > 100
    assert symbols[at(8 * HOUR)] - symbols[at(7 * HOUR)] < symbols[at(20 * HOUR) - 1] - symbols[at(19 * HOUR)]
    assert port("gpuhealth_nic_port_up", "gpu-001", 5)[at(20 * HOUR)] == 0
    # ib_rate_downgrade: no warning, the rate drops at the failure and the port stays up
    rate = port("gpuhealth_nic_port_rate_bytes_per_second", "gpu-002", 0)
    assert rate[at(10 * HOUR) - 1] == RATE_BYTES
    assert rate[at(10 * HOUR) + 1] in (RATE_BYTES / 2, RATE_BYTES / 4)
    assert port("gpuhealth_nic_port_up", "gpu-002", 0)[at(10 * HOUR) + 1] == 1
    # none of them logs an XID: the GPUs are fine
    xids = series("gpuhealth_xid_events_total")
    assert not [labels for labels in xids if any(f'node="gpu-00{n}"' in labels for n in range(4))]


def test_nvswitch_fatal_sxid_at_the_failure_after_non_fatal_ones():
    sxids = series("gpuhealth_sxid_events_total")
    (fatal,) = [v for labels, v in sxids.items()
                if 'node="gpu-003"' in labels and 'severity="fatal"' in labels]
    assert np.isnan(fatal[at(22 * HOUR) - 1]) and fatal[at(22 * HOUR)] == 1
    non_fatal = [v for labels, v in sxids.items() if 'node="gpu-003"' in labels and "non_fatal" in labels]
    drawn = fleet().failure_params[fleet().scenario.failures[3]]["extra"] < 0.5
    assert bool(non_fatal) == drawn   # about half are preceded by non-fatal SXIDs


def test_boot_flap_fools_a_naive_rule_then_the_port_stays_up():
    """A naive rule drains on any link_downed increase; the boot flap raises it, once, and the port
    stays up after it (the rules want two losses within an hour)."""
    downed = port("gpuhealth_nic_port_link_downed_total", "gpu-000", 3)
    up = port("gpuhealth_nic_port_up", "gpu-000", 3)
    naive = np.flatnonzero(np.diff(downed) > 0)
    assert naive.size == 1 and naive[0] + 1 == at(30 * HOUR)
    assert (up[at(30 * HOUR) + 1:] == 1).all()


def test_switch_reboot_fools_a_naive_rule_on_every_node_of_the_rack():
    """A naive rule drains a node whose port is down for 2 minutes: a switch reboot raises it on every
    node of the rack at once, and every port returns; the other rack is untouched."""
    s, nodes = fleet(), [f"gpu-00{n}" for n in range(8)]
    window = slice(at(30 * HOUR), at(30 * HOUR + 720))
    naive = {node for node in nodes for nic in range(8)
             if (port("gpuhealth_nic_port_up", node, nic)[window] == 0).sum() >= 2}
    rack = {s.fleet.node(n) for n in s.rack("gpu-005")}
    assert naive == rack == {"gpu-004", "gpu-005", "gpu-006", "gpu-007"}
    for node in naive:
        assert (port("gpuhealth_nic_port_up", node, 1)[at(30 * HOUR + 900):] == 1).all()
    info = series("gpuhealth_nic_port_info")
    assert {labels.split('switch="')[1].split('"')[0] for labels in info} == {"leaf-r00", "leaf-r01"}


def test_unnamed_switches_leave_the_label_empty():
    unnamed = {**BASE, "fleet": {**BASE["fleet"], "switch_names": False}}
    signals = FleetSignals(parse_scenario(unnamed))
    (info,) = signals.families(lambda n: n == "gpuhealth_nic_port_info")
    assert all('switch=""' in labels for labels, _ in info.series)


def test_port_kinds_need_nics_and_fabric_faults_log_no_xid():
    no_nics = {**BASE, "fleet": {"nodes": 8}, "failures": FAULTS[:1], "noise": NOISE}
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(no_nics)
    assert sum("needs NICs" in p for p in caught.value.problems) == 3
    with_xid = {**BASE, "failures": [{**FAULTS[2], "xid": 79}, {**FAULTS[0], "gpu": 8}]}
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(with_xid)
    assert any("logs no XID" in p for p in caught.value.problems)
    assert any("8 NICs per node" in p for p in caught.value.problems)


def _fingerprint(data: dict) -> str:
    digest = hashlib.sha256()
    for family in FleetSignals(parse_scenario(data)).families():
        digest.update(f"{family.name} {family.kind}\n".encode())
        for labels, values in family.series:
            digest.update(labels.encode())
            digest.update(values.tobytes())
    return digest.hexdigest()


# Fingerprints of every generated series before fleets had NICs (the same code without the fabric).
BEFORE_NICS = {
    "small": "9cb42893b9d3ec0702db68a2facb7bc52567ec849f9a301175e24d756ffe6f6f",
    "tuning": "9fd7b5ed210ed5c99693080a480a9c6a4cb2a1dde326f476263f5d864c614246",
}


@pytest.mark.parametrize("name", sorted(BEFORE_NICS))
def test_scenarios_without_nics_generate_the_same_series_as_before(name: str):
    data = yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())
    data["fleet"].pop("nics_per_node", None)   # small.yaml has NICs for the dashboards since
    assert _fingerprint(data) == BEFORE_NICS[name]


def test_the_fabric_scenario_holds_every_fabric_kind():
    scenario = load_scenario(SCENARIOS / "fabric.yaml")
    assert {f.kind for f in scenario.failures} >= {"ib_link_flap", "ib_symbol_errors", "ib_rate_downgrade",
                                                     "nvswitch_fatal"}
    assert {n.kind for n in scenario.noise} >= {"ib_boot_flap", "switch_reboot"}


ROCE = {**BASE, "fleet": {**BASE["fleet"], "nic_link_layer": "Ethernet", "switch_names": False}}


@cache
def roce_series(name: str) -> dict[str, np.ndarray]:
    signals = roce_fleet()
    return {labels: values for family in signals.families(lambda n: n == name)
            for labels, values in family.series}


@cache
def roce_fleet() -> FleetSignals:
    return FleetSignals(parse_scenario({**ROCE, "failures": FAULTS, "noise": NOISE}))


def roce(name: str, node: str, nic: int) -> np.ndarray:
    want = [f'node="{node}"', f'netdev="ens{nic}np0"' if name.startswith("gpuhealth_netdev") else
            f'device="mlx5_{nic}"']
    (values,) = [v for labels, v in roce_series(name).items() if all(w in labels for w in want)]
    return values


def carrier_flips(node: str, nic: int, start: float, end: float) -> float:
    changes = roce("gpuhealth_netdev_carrier_changes_total", node, nic)
    return float(changes[at(end)] - changes[at(start)])


def test_roce_ports_publish_their_netdev_as_the_exporter_does():
    info = roce_series("gpuhealth_nic_port_info")
    assert all('link_layer="Ethernet"' in labels and 'switch=""' in labels for labels in info)
    assert sum('device="mlx5_3",' in labels and 'netdev="ens3np0"' in labels for labels in info) == 8
    # a healthy port: up at its rate, its carrier changed twice when the driver brought it up
    assert (roce("gpuhealth_netdev_up", "gpu-003", 7) == 1).all()
    assert (roce("gpuhealth_netdev_speed_bytes_per_second", "gpu-003", 7) == RATE_BYTES).all()
    assert (roce("gpuhealth_netdev_carrier_changes_total", "gpu-003", 7) == 2).all()


def test_roce_link_flap_shows_in_carrier_changes_not_in_link_downed():
    """ib_link_flap on a RoCE port: each flap is two carrier changes, the final loss one; the
    InfiniBand counter stays at zero, so a rule reading only link_downed misses the fault."""
    assert carrier_flips("gpu-000", 2, 4 * HOUR, 14 * HOUR - 60) >= 4
    assert carrier_flips("gpu-000", 2, 14 * HOUR - 60, 14 * HOUR) == 1
    assert (roce("gpuhealth_nic_port_link_downed_total", "gpu-000", 2) == 0).all()
    up = roce("gpuhealth_netdev_up", "gpu-000", 2)
    assert (up[at(14 * HOUR): at(15 * HOUR)] == 0).all()
    speed = roce("gpuhealth_netdev_speed_bytes_per_second", "gpu-000", 2)
    assert np.isnan(speed[at(14 * HOUR): at(15 * HOUR)]).all()


def test_roce_symbol_errors_stay_invisible_until_the_link_goes_down():
    errors = [v for labels, v in roce_series("gpuhealth_nic_port_errors_total").items()
              if 'node="gpu-001"' in labels and 'device="mlx5_5"' in labels]
    assert errors and all((values == 0).all() for values in errors)
    assert carrier_flips("gpu-001", 5, 6 * HOUR, 20 * HOUR - 60) == 0
    assert carrier_flips("gpu-001", 5, 20 * HOUR - 60, 20 * HOUR) == 1


def test_roce_rate_downgrade_drops_the_netdev_speed_after_one_flap():
    speed = roce("gpuhealth_netdev_speed_bytes_per_second", "gpu-002", 0)
    assert speed[at(10 * HOUR) - 1] == RATE_BYTES
    assert speed[at(10 * HOUR) + 1] in (RATE_BYTES / 2, RATE_BYTES / 4)
    assert carrier_flips("gpu-002", 0, 10 * HOUR - 60, 10 * HOUR + 60) == 2


def test_roce_boot_flap_and_switch_reboot():
    """The boot flap is one flap (two changes); the unnamed switch's reboot takes every netdev of the
    rack down together and brings them back, a few changes each, the other rack untouched."""
    assert carrier_flips("gpu-000", 3, 30 * HOUR - 60, 30 * HOUR + 60) == 2
    rack = {"gpu-004", "gpu-005", "gpu-006", "gpu-007"}
    for node in [f"gpu-00{n}" for n in range(8)]:
        flips = carrier_flips(node, 1, 30 * HOUR - 60, 30 * HOUR + 900)
        assert (flips >= 2) == (node in rack), (node, flips)
        if node in rack:
            assert roce("gpuhealth_netdev_up", node, 1)[at(30 * HOUR)] == 0
            assert roce("gpuhealth_netdev_up", node, 1)[at(30 * HOUR + 900)] == 1
