"""The simulator's fabric: NICs per profile beside the GPUs, written as a sysfs tree that the real
fabric collector reads, and each fabric fault moving the files (and kernel lines) it should."""

from __future__ import annotations

from pathlib import Path

import pytest
from exporter_helpers import FakeClock, assert_golden, make_collector, promtool_check, samples, scrape, value
from gpuhealth.exporter.collector import Context
from gpuhealth.exporter.fabric_settings import FabricSettings
from gpuhealth.exporter.inventory_step import InventoryStep
from gpuhealth.exporter.kmsg import parse_line
from gpuhealth.exporter.sim.nvml import SimulatedNvml
from gpuhealth.exporter.sim.profiles import PROFILES
from gpuhealth.exporter.sim.scenario import ScenarioError, parse_scenario


class SimNode:
    """A simulated node with its sysfs tree, read by the real fabric collector."""

    def __init__(self, tmp_path: Path, scenario: dict, profile: str = "h100-sxm") -> None:
        self.clock = FakeClock()
        self.kmsg = tmp_path / "kmsg"
        self.nvml = SimulatedNvml(parse_scenario(scenario), self.kmsg, clock=self.clock,
                                  profile=PROFILES[profile], sysfs=tmp_path / "sys")
        self.nvml.nvmlInit()
        fabric = FabricSettings(expected_rate_gbps=400, systemctl=(),
                                manager_pid_file=self.nvml.fabric_manager_pid_file)
        self.ctx = Context(nvml=self.nvml, sysfs=tmp_path / "sys", clock=self.clock, fabric=fabric,
                           nvml_timeout_seconds=10.0)
        InventoryStep(self.ctx).run()
        self.collector = make_collector("fabric", self.ctx)
        self.origin = self.clock.now  # scenario time 0

    def at(self, t: float) -> str:
        """The fabric scrape at scenario time ``t`` (calls 5 s apart at least: sysfs is read every 5 s)."""
        self.clock.now = self.origin + t
        self.nvml.nvmlDeviceGetCount()  # the simulator moves when NVML is read
        return scrape(self.collector)

    def reload(self, scenario: dict) -> None:
        self.nvml.reload(parse_scenario(scenario))
        self.origin = self.clock.now

    def sxids(self) -> list[tuple[str, int]]:
        lines = self.kmsg.read_text().splitlines() if self.kmsg.exists() else []
        events = [parse_line(line) for line in lines]
        return [(event.severity, event.code) for event in events if event.kind == "sxid"]


def _ports(text: str, name: str) -> dict[str, float]:
    return {dict(labels)["device"]: v for labels, v in samples(text, name).items()}


def test_an_h100_node_has_eight_ndr_nics_each_beside_two_gpus(tmp_path: Path) -> None:
    node = SimNode(tmp_path, {})
    text = node.at(0)
    assert_golden("sim_fabric_h100-sxm", text)
    promtool_check(text)
    assert _ports(text, "gpuhealth_nic_port_up") == {f"mlx5_{i}": 1 for i in range(8)}
    assert set(_ports(text, "gpuhealth_nic_port_rate_bytes_per_second").values()) == {5e10}
    affinity = [dict(labels) for labels in samples(text, "gpuhealth_nic_gpu_affinity_info")]
    switch = {(pair["device"], pair["gpu"]) for pair in affinity if pair["scope"] == "pcie_switch"}
    assert switch == {(f"mlx5_{i}", str(g)) for i in range(8) for g in (i // 2 * 2, i // 2 * 2 + 1)}
    assert value(text, "gpuhealth_nic_gpu_affinity_info", device="mlx5_0", gpu="3", scope="numa_node") == 1
    assert value(text, "gpuhealth_nic_gpu_affinity_info", device="mlx5_0", gpu="4", scope="numa_node") is None
    assert "gpuhealth_fabric_read_errors_total{" not in text


def test_the_fabric_manager_polls_in(tmp_path: Path) -> None:
    node = SimNode(tmp_path, {})
    node.at(0)
    assert node.collector.manager.probe() is True  # the simulator's pid file names a live process
    assert SimNode(tmp_path / "gb", {}, "gb200").nvml.fabric_manager_pid_file is None


@pytest.mark.parametrize(("profile", "nics"), [("h200", 8), ("b200", 4), ("gb200", 4)])
def test_nics_per_profile(tmp_path: Path, profile: str, nics: int) -> None:
    text = SimNode(tmp_path, {}, profile).at(0)
    assert len(_ports(text, "gpuhealth_nic_port_up")) == nics
    pairs = samples(text, "gpuhealth_nic_gpu_affinity_info")
    assert {dict(k)["gpu"] for k in pairs if dict(k)["scope"] == "pcie_switch"} == {str(g) for g in range(8)}


def test_a_scenario_sets_the_nic_count(tmp_path: Path) -> None:
    assert len(_ports(SimNode(tmp_path, {"nics": 2}).at(0), "gpuhealth_nic_port_up")) == 2


def test_ib_link_flap_flaps_more_and_more_often_then_stays_down(tmp_path: Path) -> None:
    flap = {"kind": "ib_link_flap", "nic": 3, "start": 100, "precursor": 3600}
    node = SimNode(tmp_path, {"faults": [flap]})
    downed = []
    for t in (50, 1900, 2900, 3400, 3690):
        downed.append(value(node.at(t), "gpuhealth_nic_port_link_downed_total", device="mlx5_3", port="1"))
    assert downed[0] == 0 and downed == sorted(downed) and downed[-1] >= 10
    assert downed[2] - downed[1] < downed[4] - downed[2]  # the later flaps come faster
    text = node.at(3800)
    assert value(text, "gpuhealth_nic_port_up", device="mlx5_3", port="1") == 0
    assert value(text, "gpuhealth_nic_port_state", device="mlx5_3", port="1") == 1
    assert value(node.at(7200), "gpuhealth_nic_port_up", device="mlx5_3", port="1") == 0  # for good
    assert value(text, "gpuhealth_nic_port_up", device="mlx5_2", port="1") == 1
    assert value(text, "gpuhealth_nic_port_link_downed_total", device="mlx5_2", port="1") == 0


def test_ib_symbol_errors_rise_then_the_link_goes_down(tmp_path: Path) -> None:
    node = SimNode(tmp_path, {"faults": [{"kind": "ib_symbol_errors", "nic": 1, "precursor": "2h"}]})
    port = {"device": "mlx5_1", "port": "1"}
    errors = [value(node.at(t), "gpuhealth_nic_port_errors_total", **port, error="symbol_error")
              for t in (0, 3600, 5400, 7000)]
    assert errors[0] == 0 and errors[1] > 0 and errors[3] - errors[2] > errors[2] - errors[1]  # BER worsens
    text = node.at(7300)
    assert value(text, "gpuhealth_nic_port_errors_total", device="mlx5_1", port="1",
                 error="link_error_recovery") > 0
    assert value(text, "gpuhealth_nic_port_up", device="mlx5_1", port="1") == 0
    assert value(text, "gpuhealth_nic_port_link_downed_total", device="mlx5_1", port="1") == 1


def test_ib_rate_downgrade_retrains_the_port_lower(tmp_path: Path) -> None:
    node = SimNode(tmp_path, {"faults": [{"kind": "ib_rate_downgrade", "nic": 6, "precursor": 60,
                                          "rate_gbps": 100}]})
    assert value(node.at(30), "gpuhealth_nic_port_rate_bytes_per_second", device="mlx5_6", port="1") == 5e10
    text = node.at(90)
    assert value(text, "gpuhealth_nic_port_rate_bytes_per_second", device="mlx5_6", port="1") == 1.25e10
    assert value(text, "gpuhealth_nic_port_expected_rate_bytes_per_second", device="mlx5_6", port="1") == 5e10
    assert value(text, "gpuhealth_nic_port_up", device="mlx5_6", port="1") == 1  # up, at the lower rate


def test_ib_boot_flap_flaps_once_then_stays_up(tmp_path: Path) -> None:
    node = SimNode(tmp_path, {"faults": [{"kind": "ib_boot_flap", "nic": 0, "start": 10, "duration": 60}]})
    assert value(node.at(11), "gpuhealth_nic_port_up", device="mlx5_0", port="1") == 0
    for t in (30, 300, 3600):
        text = node.at(t)
        assert value(text, "gpuhealth_nic_port_up", device="mlx5_0", port="1") == 1
        assert value(text, "gpuhealth_nic_port_link_downed_total", device="mlx5_0", port="1") == 1


def test_switch_reboot_takes_every_port_down_together_and_back(tmp_path: Path) -> None:
    node = SimNode(tmp_path, {"faults": [{"kind": "switch_reboot", "start": 60, "duration": "5m"}]})
    text = node.at(120)
    assert set(_ports(text, "gpuhealth_nic_port_up").values()) == {0}
    text = node.at(400)
    assert set(_ports(text, "gpuhealth_nic_port_up").values()) == {1}
    assert set(_ports(text, "gpuhealth_nic_port_link_downed_total").values()) == {1}


def test_nvswitch_fatal_logs_non_fatal_sxids_then_a_fatal_one(tmp_path: Path) -> None:
    node = SimNode(tmp_path, {"faults": [{"kind": "nvswitch_fatal", "precursor": 600, "count": 2}]})
    node.at(400)
    assert node.sxids() == [("non_fatal", 12028)]
    node.at(700)
    assert node.sxids() == [("non_fatal", 12028), ("non_fatal", 12028), ("fatal", 20034)]
    assert ": Xid " not in node.kmsg.read_text()
    sudden = SimNode(tmp_path / "sudden", {"faults": [{"kind": "nvswitch_fatal", "precursor": 0,
                                                       "count": 0}]})
    sudden.at(1)
    assert sudden.sxids() == [("fatal", 20034)]


def test_a_reload_brings_the_links_back_and_keeps_the_counters(tmp_path: Path) -> None:
    node = SimNode(tmp_path, {"faults": [{"kind": "ib_link_flap", "nic": 0, "precursor": 60}]})
    assert value(node.at(100), "gpuhealth_nic_port_up", device="mlx5_0", port="1") == 0
    node.reload({})
    text = node.at(10)
    assert value(text, "gpuhealth_nic_port_up", device="mlx5_0", port="1") == 1
    assert value(text, "gpuhealth_nic_port_link_downed_total", device="mlx5_0", port="1") == 13


@pytest.mark.parametrize(("fault", "problem"), [
    ({"kind": "ib_link_flap"}, "faults[0].nic: ib_link_flap needs 'nic'"),
    ({"kind": "ib_rate_downgrade", "nic": 0, "gpu": 1}, "faults[0].gpu: unknown key for ib_rate_downgrade "
                                                        "(known: kind, nic, precursor, rate_gbps, start)"),
    ({"kind": "ib_symbol_errors", "nic": 2}, "faults[0].nic: NIC 2 does not exist (the scenario has 2)"),
    ({"kind": "switch_reboot", "precursor": 5}, "faults[0].precursor: unknown key for switch_reboot "
                                                "(known: duration, kind, start)"),
])
def test_fabric_faults_are_validated(fault: dict, problem: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario({"nics": 2, "faults": [fault]})
    assert problem in caught.value.problems


def test_a_nic_beyond_the_profiles_is_refused(tmp_path: Path) -> None:
    scenario = parse_scenario({"faults": [{"kind": "ib_link_flap", "nic": 5}]})
    with pytest.raises(ScenarioError) as caught:
        SimulatedNvml(scenario, profile=PROFILES["b200"], sysfs=tmp_path)
    assert caught.value.problems == ["faults[0].nic: NIC 5 does not exist (the node has 4)"]
