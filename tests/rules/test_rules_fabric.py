"""InfiniBand/RoCE port alerts (gpuhealth source: DCGM reads no NIC): a port down, flapping or slower than
expected drains its node; a switch's ports going down together are one switch event and drain no node,
whether the inventory names the switch or not; symbol errors are network evidence of the fusion."""

from __future__ import annotations

import pytest
import yaml
from rules_promtool import GENERATED, Fleet, alert, run_promtool

GROUPS = ["fabric", "evidence", "fusion"]
MINUTES = 100
FABRIC = yaml.safe_load((GENERATED / "gpuhealth" / "fabric.yml").read_text())
LOSS_GROUPS = [group["name"] for group in FABRIC["groups"]
               if group["name"].startswith("gpuhealth-fabric-losses")]
# Where the groups recording the ports' link losses run within an evaluation interval, relative to the
# group that reads them: Prometheus starts each group at a fixed offset of its own, so either can happen.
PHASES = {"losses-before": [*LOSS_GROUPS, "gpuhealth-fabric"],
          "losses-after": ["gpuhealth-fabric", *LOSS_GROUPS]}


@pytest.fixture(params=sorted(PHASES))
def phase(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _port(fleet: Fleet, node: str, device: str, *, up: str | None = None, downed: str | None = None,
          switch: str = "", netdev: str = "") -> Fleet:
    """One port: up and never down unless ``up``/``downed`` (promtool notation) say otherwise."""
    labels = {"device": device, "port": "1"}
    fleet.add("nic_info", node, None, (1, 0, MINUTES), **labels, netdev=netdev, switch=switch)
    fleet.add("nic_up", node, None, up or f"1x{MINUTES}", **labels)
    return fleet.add("nic_link_downed", node, None, downed or f"0x{MINUTES}", **labels)


def _port_alert(name: str, node: str, device: str, value: str, severity: str, action: str, summary: str,
                description: str) -> dict:
    return alert(name, {"alertname": name, "node": node, "device": device, "port": "1"}, summary,
                 description, severity, action)


def _down(node: str, device: str, gpus: tuple[str, ...] = ()) -> dict:
    """``gpus``: the GPUs of the node closest to the port (gpuhealth_nic_gpu_affinity_info), named last."""
    near = f" Its GPUs (the closest, by PCIe switch or NUMA node): {', '.join(gpus)}." if gpus else ""
    return _port_alert(
        "GPUHealthNicPortDown", node, device, "0", "critical", "drain",
        f"NIC port {device}/1 of {node} is down",
        f"InfiniBand/RoCE port 1 of {device} on {node} has been down (not ACTIVE and LinkUp) for longer "
        "than a retrain takes, while its switch is up: jobs whose collectives use it hang or fail. Drain the "
        f"node and check the cable, transceiver and HCA.{near}")


def _flapping(node: str, device: str, losses: int) -> dict:
    return _port_alert(
        "GPUHealthNicPortFlapping", node, device, str(losses), "critical", "drain",
        f"NIC port {device}/1 of {node} is flapping ({losses} losses)",
        f"InfiniBand/RoCE port 1 of {device} on {node} lost its link {losses} times in the last window: "
        "every loss breaks the collectives running over it, and a flapping link usually stays down next. "
        "Drain the node and have the cable or transceiver replaced.")


def _run(tmp_path, fleet: Fleet, alert_checks: list[dict], expr_checks: list[dict] | None = None,
         phase: str | None = None) -> None:
    test = {"interval": "1m", "input_series": fleet.input_series(), "alert_rule_test": alert_checks}
    if expr_checks:
        test["promql_expr_test"] = expr_checks
    run_promtool(tmp_path, "gpuhealth", GROUPS, [test], group_eval_order=PHASES[phase] if phase else None)


def _late(phase: str) -> int:
    """Evaluations after its scrape at which a loss is read: one more when its group runs after the
    reading one."""
    return 1 if phase == "losses-after" else 0


def _quiet(minute: int, *names: str) -> list[dict]:
    return [{"eval_time": f"{minute}m", "alertname": name, "exp_alerts": []} for name in names]


NODE_ALERTS = ("GPUHealthNicPortDown", "GPUHealthNicPortFlapping", "GPUHealthNicRateDegraded")


def test_port_lost_in_service_drains_within_a_minute_boot_and_retrain_do_not(tmp_path, phase):
    """A port that lost its link on a node in service drains once it stays down past the one-minute
    debounce; one that retrains within it, or comes up a few minutes after boot, drains nothing; one that
    never comes up after boot drains once the exporter has published it down for the boot grace (5 min),
    counted from the boot, not from before a reboot."""
    fleet = Fleet("gpuhealth")
    _port(fleet, "n1", "mlx5_0", up=f"1x9 0x{MINUTES - 10}", downed=f"0x9 1x{MINUTES - 10}")  # lost at 10
    near = {"n1": ("0", "1")}              # n1's GPUs 0 and 1 reach other nodes through its port
    for gpu in near["n1"]:
        fleet.add("nic_affinity", "n1", int(gpu), (1, 0, MINUTES), device="mlx5_0")
    _port(fleet, "n2", "mlx5_0", up=f"0x2 1x{MINUTES - 3}")                  # boot: ACTIVE after 3 minutes
    _port(fleet, "n3", "mlx5_0", up=f"1x19 0 1x{MINUTES - 21}", downed=f"0x19 1x{MINUTES - 20}")  # retrains
    _port(fleet, "n4", "mlx5_0", up=f"0x{MINUTES}")                          # never up since boot
    # Up before a reboot (no scrape from 20 to 25), never up after it; the reboot reset the counter.
    _port(fleet, "n5", "mlx5_0", up=f"1x19 _x6 0x{MINUTES - 26}", downed=f"2x19 _x6 0x{MINUTES - 26}")
    # A RoCE port lost at 30: its netdev's carrier changed, the InfiniBand counter did not.
    _port(fleet, "n6", "mlx5_2", netdev="eth2", up=f"1x29 0x{MINUTES - 30}")
    fleet.add("carrier_changes", "n6", None, f"0x29 1x{MINUTES - 30}", netdev="eth2")
    firing = {   # minute -> ports down past their debounce or grace
        5: [],                                   # n4 down since boot for 5 minutes: just before its grace
        6: [("n4", "mlx5_0")],
        10: [("n4", "mlx5_0")],                  # n1 down for one evaluation: a retrain yet
        11: [("n1", "mlx5_0"), ("n4", "mlx5_0")],
        20: [("n1", "mlx5_0"), ("n4", "mlx5_0")],
        21: [("n1", "mlx5_0"), ("n4", "mlx5_0")],  # n3 retrained within the debounce
        30: [("n1", "mlx5_0"), ("n4", "mlx5_0")],  # n5 down at every scrape since 26, but booted then
        31: [("n1", "mlx5_0"), ("n4", "mlx5_0"), ("n6", "mlx5_2")],  # n5 published 5 minutes since its boot
        32: [("n1", "mlx5_0"), ("n4", "mlx5_0"), ("n5", "mlx5_0"), ("n6", "mlx5_2")],
        # Past the grace n1's loss has left the window: it has been down at every scrape since.
        60: [("n1", "mlx5_0"), ("n4", "mlx5_0"), ("n5", "mlx5_0"), ("n6", "mlx5_2")],
    }
    checks = [{"eval_time": f"{minute}m", "alertname": "GPUHealthNicPortDown",
               "exp_alerts": [_down(node, device, near.get(node, ())) for node, device in ports]}
              for minute, ports in firing.items()]
    checks += _quiet(30, "GPUHealthNicPortFlapping")          # one loss each: no flapping
    _run(tmp_path, fleet, checks, phase=phase)


def test_flapping_ib_link_downed_and_roce_carrier_changes(tmp_path, phase):
    """Two losses within the hour flap a port, counted once each in either phase of the loss groups: a
    loss recorded just after the reading group ran is counted at its next evaluation."""
    late = _late(phase)
    fleet = Fleet("gpuhealth")
    # Down for one sample at minutes 10, 20 and 30: link_downed counts each loss.
    up = " ".join("0" if minute in (10, 20, 30) else "1" for minute in range(MINUTES + 1))
    _port(fleet, "n1", "mlx5_0", up=up, downed=f"0x9 1x9 2x9 3x{MINUTES - 30}")
    # One loss, at 5: apart from the others (three nodes losing a link together are a switch's event).
    _port(fleet, "n2", "mlx5_0", up=f"1x4 0 1x{MINUTES - 6}", downed=f"0x4 1x{MINUTES - 5}")
    # A RoCE port whose netdev's carrier changed twice per flap (down, up) at minutes 10 and 20.
    _port(fleet, "n3", "mlx5_2", netdev="eth2")
    fleet.add("carrier_changes", "n3", None, f"0x9 2x9 4x{MINUTES - 20}", netdev="eth2")
    checks = [
        *_quiet(19 + late, "GPUHealthNicPortFlapping"),        # one loss each so far
        {"eval_time": f"{20 + late}m", "alertname": "GPUHealthNicPortFlapping",
         "exp_alerts": [_flapping("n1", "mlx5_0", 2), _flapping("n3", "mlx5_2", 2)]},
        {"eval_time": f"{30 + late}m", "alertname": "GPUHealthNicPortFlapping",
         "exp_alerts": [_flapping("n1", "mlx5_0", 3), _flapping("n3", "mlx5_2", 2)]},
        *_quiet(30, "GPUHealthNicPortDown"),                   # each loss lasted a minute
        # An hour after the second loss the window holds one: n3 quiet again, n1 (losses at 20, 30) too.
        *_quiet(MINUTES, "GPUHealthNicPortFlapping"),
    ]
    _run(tmp_path, fleet, checks, phase=phase)


def test_exporter_start_counts_losses_from_its_second_scrape(tmp_path, phase):
    """Where the exporters start (first deployed, or back after an outage), a counter's first value counts
    the losses since the HCA's driver loaded, at times nothing tells: three nodes whose ports lost their
    links before raise no flap and no switch event. A loss after the start is seen from the next
    evaluation: a port lost two minutes after its exporter started drains after the one-minute
    debounce, as on any node in service."""
    fleet = Fleet("gpuhealth")
    labels = {"device": "mlx5_0", "port": "1"}
    after = MINUTES - 10
    # node -> (up, link_downed) from minute 10 on, when the exporters start (no series before)
    ports = {"n1": ("1x90", "3x90"), "n2": ("1x90", "3x90"), "n3": ("1x90", "2x90"),
             "n4": (f"1x1 0x{after - 2}", f"0x1 1x{after - 2}")}      # lost at 12, stays down
    for node, (up, downed) in ports.items():
        fleet.add("nic_info", node, None, f"_x10 1x{after}", **labels, netdev="", switch="")
        fleet.add("nic_up", node, None, f"_x10 {up}", **labels)
        fleet.add("nic_link_downed", node, None, f"_x10 {downed}", **labels)
    checks = [check for minute in (10, 11, 15, 30, 70)
              for check in _quiet(minute, "GPUHealthNicPortFlapping", "GPUHealthFabricSwitchEvent")]
    checks += _quiet(12, "GPUHealthNicPortDown")        # n4 lost its port at 12: within the debounce
    checks += [{"eval_time": f"{minute}m", "alertname": "GPUHealthNicPortDown",
                "exp_alerts": [_down("n4", "mlx5_0")]} for minute in (13, 30)]
    _run(tmp_path, fleet, checks, phase=phase)


def test_port_retrained_below_expected_rate_drains_at_once(tmp_path, phase):
    """Width and speed are fixed when a link trains: an ACTIVE port below its expected rate drains at the
    first evaluation that sees it; a port that is down reports no trained rate and raises nothing here."""
    fleet = Fleet("gpuhealth")
    labels = {"device": "mlx5_0", "port": "1"}
    # n1 loses its link at 10 and is ACTIVE again at 11 at half its rate; n4's port is down from 10 on and
    # sysfs shows the lowest rate for it.
    _port(fleet, "n1", "mlx5_0", up=f"1x9 0 1x{MINUTES - 11}", downed=f"0x9 1x{MINUTES - 10}")
    _port(fleet, "n4", "mlx5_0", up=f"1x9 0x{MINUTES - 10}", downed=f"0x9 1x{MINUTES - 10}")
    for node in ("n2", "n3"):
        _port(fleet, node, "mlx5_0")
    # n5's HCA has an odd number (the other half of the rate groups); it retrains slower at 40.
    _port(fleet, "n5", "mlx5_1", up=f"1x39 0 1x{MINUTES - 41}", downed=f"0x39 1x{MINUTES - 40}")
    fleet.add("nic_rate", "n5", None, f"5e10x39 2.5e10x{MINUTES - 40}", device="mlx5_1", port="1")
    fleet.add("nic_expected_rate", "n5", None, f"5e10x{MINUTES}", device="mlx5_1", port="1")
    fleet.add("nic_rate", "n1", None, f"5e10x9 2.5e10x{MINUTES - 10}", **labels)
    fleet.add("nic_rate", "n2", None, f"5e10x{MINUTES}", **labels)                   # at its expected rate
    fleet.add("nic_rate", "n3", None, f"2.5e10x{MINUTES}", **labels)                 # nothing expected: quiet
    fleet.add("nic_rate", "n4", None, f"5e10x9 2.5e9x{MINUTES - 10}", **labels)
    for node in ("n1", "n2", "n4"):
        fleet.add("nic_expected_rate", node, None, f"5e10x{MINUTES}", **labels)
    degraded = [_port_alert(
        "GPUHealthNicRateDegraded", node, device, "2.5e10", "warning", "drain",
        f"NIC port {device}/1 of {node} runs below its expected rate",
        f"InfiniBand/RoCE port 1 of {device} on {node} trained at 25GB/s, below the rate configured as "
        "expected: every collective over it, and so every job spanning the node, runs at that speed until "
        "the link retrains. Drain the node and have the cable, transceiver or HCA replaced.")
        for node, device in (("n1", "mlx5_0"), ("n5", "mlx5_1"))]
    checks = [
        *_quiet(10, "GPUHealthNicRateDegraded"),               # n1 down while it retrains
        *[{"eval_time": f"{minute}m", "alertname": "GPUHealthNicRateDegraded", "exp_alerts": degraded[:1]}
          for minute in (11, 40)],
        {"eval_time": "41m", "alertname": "GPUHealthNicRateDegraded", "exp_alerts": degraded},
        {"eval_time": "11m", "alertname": "GPUHealthNicPortDown", "exp_alerts": [_down("n4", "mlx5_0")]},
    ]
    _run(tmp_path, fleet, checks, phase=phase)


# A leaf switch rebooting: its ports go down at minute 10, return at 16 while it boots (more than the
# switch event's 5-minute window after they went down), go down again at 17 and return for good at
# 23, on every node it serves. Alone, each port would be down for 12 minutes and flap twice: both
# drain alerts would fire.
SWITCH_UP = f"1x9 0x5 1 0x5 1x{MINUTES - 23}"
SWITCH_DOWNED = f"0x9 1x6 2x{MINUTES - 17}"


def _switch_event(value: int, switch: str = "") -> dict:
    where = f"on switch {switch}" if switch else "of several nodes"
    served = (f"served by leaf switch {switch}" if switch
              else "of several nodes (no switch named in their inventory)")
    labels = {"alertname": "GPUHealthFabricSwitchEvent", **({"switch": switch} if switch else {})}
    return alert("GPUHealthFabricSwitchEvent", labels, f"{value} NIC ports {where} went down together",
                 f"{value} InfiniBand/RoCE ports {served} are down or went down together: the switch "
                 "rebooted or failed, not the nodes. No node is drained for it; check the switch (a planned "
                 "reboot ends by itself) and its uplinks.", "warning", "none")


def test_named_switch_reboot_is_one_event_and_drains_no_node(tmp_path, phase):
    fleet = Fleet("gpuhealth")
    for node in ("n1", "n2", "n3", "n4", "n5"):
        rebooting = node != "n5"
        _port(fleet, node, "mlx5_0", switch="leaf-a", up=SWITCH_UP if rebooting else None,
              downed=SWITCH_DOWNED if rebooting else None)
        # leaf-b is up; one of its ports fails on its own at minute 14: a node fault, drained.
        failing = node == "n5"
        _port(fleet, node, "mlx5_1", switch="leaf-b", up=f"1x13 0x{MINUTES - 14}" if failing else None,
              downed=f"0x13 1x{MINUTES - 14}" if failing else None)
    checks = [
        *_quiet(9, "GPUHealthFabricSwitchEvent"),
        # One alert through the whole reboot, also at 16, when the ports are up for a moment.
        *[{"eval_time": f"{minute}m", "alertname": "GPUHealthFabricSwitchEvent",
           "exp_alerts": [_switch_event(4, "leaf-a")]} for minute in range(10, 26)],
        *_quiet(14, "GPUHealthNicPortDown"),                   # n5's port down for one evaluation
        {"eval_time": "15m", "alertname": "GPUHealthNicPortDown", "exp_alerts": [_down("n5", "mlx5_1")]},
        *_quiet(23, "GPUHealthNicPortFlapping"),
        *_quiet(40, "GPUHealthFabricSwitchEvent", "GPUHealthNicPortFlapping"),
    ]
    checks += [check for minute in (12, 16, 21, 30, 60) for check in _quiet(minute, *NODE_ALERTS[1:])]
    checks += [{"eval_time": f"{minute}m", "alertname": "GPUHealthNicPortDown",
                "exp_alerts": [_down("n5", "mlx5_1")]} for minute in (21, 30)]
    _run(tmp_path, fleet, checks, phase=phase)


def test_unnamed_switch_reboot_by_simultaneity(tmp_path, phase):
    """No switch in the inventory: ports of three nodes going down within two minutes are one event,
    held while they stay down (up to 30 minutes); a port that failed before it or goes down after it is
    the node's fault. Where the loss groups run after the reading group the event forms one evaluation
    later, still before the rebooted ports' one-minute debounce ends."""
    late = _late(phase)
    fleet = Fleet("gpuhealth")
    # The reboot 30 minutes later than the named one: the hold reads 30 minutes of each port's counter.
    for node in ("n1", "n2", "n3"):
        _port(fleet, node, "mlx5_0", up=f"1x39 0x2 1 0x7 1x{MINUTES - 52}",
              downed=f"0x39 1x3 2x{MINUTES - 44}")
    _port(fleet, "n4", "mlx5_0", up=f"1x79 0x{MINUTES - 80}", downed=f"0x79 1x{MINUTES - 80}")
    # Failed on its own five minutes before the reboot: not part of it, it keeps alerting.
    _port(fleet, "n5", "mlx5_0", up=f"1x34 0x{MINUTES - 35}", downed=f"0x34 1x{MINUTES - 35}")
    checks = [
        *_quiet(39 + late, "GPUHealthFabricSwitchEvent"),
        *[{"eval_time": f"{minute}m", "alertname": "GPUHealthNicPortDown",
           "exp_alerts": [_down("n5", "mlx5_0")]} for minute in (36, 40, 41, 42, 46, 51, 55)],
        {"eval_time": f"{40 + late}m", "alertname": "GPUHealthFabricSwitchEvent",
         "exp_alerts": [_switch_event(3)]},
        {"eval_time": "50m", "alertname": "GPUHealthFabricSwitchEvent", "exp_alerts": [_switch_event(3)]},
        *_quiet(80, "GPUHealthFabricSwitchEvent"),
        {"eval_time": "80m", "alertname": "GPUHealthNicPortDown", "exp_alerts": [_down("n5", "mlx5_0")]},
        {"eval_time": "81m", "alertname": "GPUHealthNicPortDown",
         "exp_alerts": [_down("n4", "mlx5_0"), _down("n5", "mlx5_0")]},
        *_quiet(85, "GPUHealthFabricSwitchEvent", "GPUHealthNicPortFlapping"),
    ]
    checks += [check for minute in (41, 42, 46, 51, 55) for check in _quiet(minute, *NODE_ALERTS[1:])]
    _run(tmp_path, fleet, checks, phase=phase)


def test_symbol_errors_are_network_evidence_one_cause(tmp_path):
    """Symbol errors and link error recoveries rising on a port are the node's network evidence, counted
    once (the worst port, one cause) for every GPU of the node; below infiniband-diags' 10 they are none."""
    fleet = Fleet("gpuhealth").node("n1", MINUTES, gpus=2).node("n2", MINUTES, gpus=2)
    for node in ("n1", "n2"):
        for device in ("mlx5_0", "mlx5_1"):
            _port(fleet, node, device)
    for device in ("mlx5_0", "mlx5_1"):   # two bad ports on n1: still one network contribution
        fleet.add("nic_errors", "n1", None, f"0+4x{MINUTES}", device=device, port="1", error="symbol_error")
        fleet.add("nic_errors", "n1", None, f"0+1x{MINUTES}", device=device, port="1",
                  error="link_error_recovery")
    fleet.add("nic_errors", "n2", None, f"0x40 5x{MINUTES - 40}", device="mlx5_0", port="1",
              error="symbol_error")
    contributions = [{"labels": f'gpuhealth:gpu_failure_risk:contribution{{cause="network", gpu="{gpu}", '
                                f'node="n1", signal="nic_link_errors"}}', "value": 0.3} for gpu in (0, 1)]
    scores = [{"labels": f'gpuhealth:gpu_failure_risk:score{{gpu="{gpu}", node="{node}"}}',
               "value": 0.3 if node == "n1" else 0} for node in ("n1", "n2") for gpu in (0, 1)]
    expr_checks = [
        # n1: 5 errors a minute on each port, 300 within the hour (> 100): evidence 1, counted once.
        # n2: 5 symbol errors within the hour, not above infiniband-diags' 10: no evidence.
        {"expr": "gpuhealth:node_evidence:nic_link_errors", "eval_time": "70m",
         "exp_samples": [{"labels": 'gpuhealth:node_evidence:nic_link_errors{node="n1"}', "value": 1}]},
        {"expr": 'gpuhealth:gpu_failure_risk:contribution{cause="network"}', "eval_time": "70m",
         "exp_samples": contributions},
        {"expr": "gpuhealth:gpu_failure_risk:score", "eval_time": "70m", "exp_samples": scores},
    ]
    _run(tmp_path, fleet, _quiet(MINUTES, "GPUHealthGpuFailureRisk"), expr_checks)
