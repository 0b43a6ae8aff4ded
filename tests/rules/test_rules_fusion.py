"""Precursor evidence and fusion: signals of independent causes together raise GPUHealthGpuFailureRisk;
one signal alone, several signals of one cause, or benign noise (SBE burst, hot aisle, replay burst at
boot, power cap, idle node) do not."""

from __future__ import annotations

import pytest
from rules_promtool import SOURCES, Fleet, alert, run_promtool

GROUPS = ["evidence", "fusion"]
RISK = "GPUHealthGpuFailureRisk"


def _risk_alert(node: str, gpu: int, risk: str, contributions: str) -> dict:
    return alert(RISK, {"alertname": RISK, "node": node, "gpu": str(gpu)},
                 f"GPU {gpu} on {node} is likely to fail (risk {risk})",
                 f"Several precursor signals of GPU {gpu} on {node} together put its failure risk at {risk}. "
                 f"Top contributions: {contributions}.", "warning", "checkpoint_drain")


def _score(node: str, gpu: int, at: str, value: float) -> dict:
    expr = f'gpuhealth:gpu_failure_risk:score{{node="{node}", gpu="{gpu}"}}'
    return {"expr": expr, "eval_time": at, "exp_samples": [{"labels": expr, "value": value}]}


@pytest.mark.parametrize("source", SOURCES)
def test_several_weak_signals_raise_the_risk_alert(tmp_path, source):
    minutes = 250
    fleet = Fleet(source)
    for node in ("n1", "n2", "n3"):
        collapsed = node == "n2"
        fleet.node(node, minutes, interrupts_per_s=1500 if collapsed else 10_000,
                   procs=2 if collapsed else 40)
    # n2 hangs in a collective (interrupts and runnable processes collapse); GPU 3's NVLink errs from 150 min.
    fleet.add("nvlink_crc", "n2", 3, (0, 0, 149), (0, 60, minutes - 150))
    # Thermal runaway on n3 GPU 6 from 200 min: hotter than its node mates and thermally slowed down.
    fleet.add("temperature", "n3", 6, (60, 0, 199), (70, 0, minutes - 200))
    fleet.add("thermal_seconds", "n3", 6, (0, 0, 199), (0, 30, minutes - 200))
    # n1 GPU 5 is thermally slowed down (0.3) beside a healing NVLink flap, heavy bursts one minute in
    # three: the bursts leave clean scrapes between, so the flap adds nothing.
    fleet.add("thermal_seconds", "n1", 5, (0, 30, minutes))
    flap = " ".join(str(300 * (m // 3)) if m >= 100 else "0" for m in range(minutes + 1))
    fleet.add("nvlink_crc", "n1", 5, flap)
    # NVLink (0.45) and the host collapse (interrupts 0.30; runnable processes, the same cause, adds nothing).
    nvlink = _risk_alert("n2", 3, "0.75",
                         "nvlink_errors=0.45, interrupt_collapse=0.30, procs_running_collapse=0.20")
    checks = [
        # Quiet while pending (the condition cannot hold before its onset + `for`), then firing: the NVLink
        # evidence passes 2/3 once the errors grew between 16 of 20 scrapes (minute 166), 15 min of `for`.
        {"eval_time": "160m", "alertname": RISK, "exp_alerts": []},
        {"eval_time": "178m", "alertname": RISK, "exp_alerts": []},
        {"eval_time": "185m", "alertname": RISK, "exp_alerts": [nvlink]},
        {"eval_time": "210m", "alertname": RISK, "exp_alerts": [nvlink]},
        # Three thermal signals of n3 GPU 6 are one cause: the largest (0.45) counts, below the threshold.
        {"eval_time": "240m", "alertname": RISK, "exp_alerts": [nvlink]},
    ]
    exprs = [
        _score("n3", 6, "240m", 0.45),
        _score("n1", 5, "240m", 0.3),
        # Node evidence counts for every GPU of the node: n2's other GPUs carry the collapse alone.
        _score("n2", 5, "240m", 0.3),
        # A healthy GPU without ECC, PCIe or NVLink series at all still scores 0.
        _score("n1", 7, "240m", 0),
    ]
    run_promtool(tmp_path, source, GROUPS, [{"interval": "1m", "input_series": fleet.input_series(),
                                             "alert_rule_test": checks, "promql_expr_test": exprs}])


def _evidence(signal: str, node: str, gpu: int | None, at: str, above: float | None = None) -> dict:
    """The evidence of one GPU (node) at ``at``: absent (0) when ``above`` is None, else above that value."""
    level = "node_evidence" if gpu is None else "gpu_evidence"
    selector = f'node="{node}"' + ("" if gpu is None else f', gpu="{gpu}"')
    expr = f"gpuhealth:{level}:{signal}{{{selector}}}"
    if above is None:
        return {"expr": expr, "eval_time": at, "exp_samples": []}
    return {"expr": f"{expr} > bool {above}", "eval_time": at,
            "exp_samples": [{"labels": "{" + selector + "}", "value": 1}]}


@pytest.mark.parametrize("source", SOURCES)
def test_memory_signals_and_an_isolated_sbe_burst(tmp_path, source):
    """HBM signals need hours of history: one node, 400 minutes."""
    minutes = 400
    fleet = Fleet(source).node("n1", minutes)
    fleet.add("ecc_corrected", "n1", 0, (0, 1, minutes))                         # keeps growing
    fleet.add("ecc_corrected", "n1", 1, (0, 0, 99), (500, 0, minutes - 100))     # isolated SBE burst
    fleet.add("rows_correctable", "n1", 2, (0, 0, 299), (12, 0, minutes - 300))
    fleet.add("remap_pending", "n1", 3, (0, 0, 379), (1, 0, minutes - 380))
    fleet.add("remap_failure", "n1", 3, (0, 0, minutes))
    # HBM degradation on GPU 5: corrected ECC keeps growing, then remapped rows step up at 6h.
    fleet.add("ecc_corrected", "n1", 5, (0, 1, minutes))
    fleet.add("rows_correctable", "n1", 5, (0, 0, 359), (10, 0, minutes - 360))
    # Two chronic causes on GPU 6: SBE chatter and steady PCIe replays at 6 a minute (over half the
    # driver's limit, so they count).
    fleet.add("ecc_corrected", "n1", 6, (0, 1, minutes))
    fleet.add("pcie_replays", "n1", 6, (0, 6, minutes))
    # A pending remap next to steady replays on a healthy link: two routine states, not a failure.
    fleet.add("remap_pending", "n1", 7, (0, 0, 99), (1, 0, minutes - 100))
    fleet.add("pcie_replays", "n1", 7, (0, 6, minutes))
    at = "390m"
    exprs = [
        _evidence("ecc_corrected_growth", "n1", 0, at, 0.99),
        _evidence("ecc_corrected_acceleration", "n1", 0, at),
        _evidence("ecc_corrected_growth", "n1", 1, at),
        _evidence("ecc_corrected_acceleration", "n1", 1, "130m"),
        _evidence("remapped_rows_growth", "n1", 2, at, 0.99),
        _evidence("remap_pending", "n1", 3, at, 0.99),
        _evidence("remap_pending", "n1", 3, "370m"),
        _score("n1", 5, "350m", 0.2),     # ECC growth alone stays below the threshold
        _score("n1", 5, "390m", 0.4),     # ...and with the rows it remaps, one memory fault counts once
        _score("n1", 3, "390m", 0.1),     # a pending remap alone: its own low-severity alert, little risk
        _score("n1", 6, "390m", 0.55),    # chatter (0.2) and steady replays (0.35): below the threshold
        _score("n1", 7, "390m", 0.1 + 0.35),   # pending and steady replays: below it too
    ]
    # Memory signals alone never fire, however many: the HBM's failure is announced by its definitive
    # signals (remap failure, uncorrectable errors), or predicted with evidence of another cause.
    checks = [{"eval_time": t, "alertname": RISK, "exp_alerts": []} for t in ("150m", "310m", "376m", "399m")]
    run_promtool(tmp_path, source, GROUPS, [{"interval": "1m", "input_series": fleet.input_series(),
                                             "alert_rule_test": checks, "promql_expr_test": exprs}])


@pytest.mark.parametrize("source", SOURCES)
def test_each_signal_and_benign_noise(tmp_path, source):
    minutes = 150
    fleet = Fleet(source)
    for node in ("n1", "n2", "n4", "n5"):
        fleet.node(node, minutes)
    fleet.node("n6", minutes, gpus=7)                     # one GPU gone from the bus
    fleet.node("n7", minutes)
    for gpu in range(5):                                  # five neighbours power-capped from 50 min
        fleet.add("power_cap_seconds", "n7", gpu, (0, 0, 49), (0, 60, minutes - 50))
        fleet.add("temperature", "n7", gpu, (60, 0, 49), (40, 0, minutes - 50))
    for gpu in range(5, 8):
        fleet.add("temperature", "n7", gpu, (58 + gpu % 2, 0, minutes))
    fleet.add("gpus_expected", "n6", None, (8, 0, minutes))
    fleet.add("gpus_visible", "n6", None, (7, 0, minutes))
    fleet.node("n3", minutes, utilization=0, interrupts_per_s=800, procs=1)   # idle between jobs
    for gpu in range(8):
        fleet.add("temperature", "n3", gpu, (35, 0, minutes))
        fleet.add("pcie_gen", "n3", gpu, (1, 0, minutes))           # idle links drop to gen 1
        fleet.add("pcie_gen_max", "n3", gpu, (5, 0, minutes))
        fleet.add("temperature", "n5", gpu, (60, 0, 49), (75, 0, minutes - 50))   # hot aisle
    fleet.add("interrupts", "n4", None, (0, 1500 * 60, minutes))    # hung in a collective, still busy
    fleet.add("procs_running", "n4", None, (2, 0, minutes))
    for node, rate in (("n1", 100), ("n2", 100), ("n3", 100_000), ("n4", 100), ("n5", 100), ("n6", 100),
                       ("n7", 100)):
        fleet.add("page_outs", node, None, (0, rate * 60, minutes))
        latency = 0.2 if node == "n6" else 0.002
        fleet.nfs(node, "/home", "GETATTR", {"operations": 50, "execute": 50 * latency}, minutes)
    fleet.node("n10", minutes)   # GPU 0 works harder from 50 min (load imbalance), GPU 3's cooling fails
    for gpu in range(8):
        fleet.add("power", "n10", gpu, (500, 0, minutes))
    fleet.add("power", "n10", 0, (500, 0, 49), (650, 0, minutes - 50))
    fleet.add("temperature", "n10", 0, (60, 0, 49), (70.5, 0, minutes - 50))   # 0.07 C per extra watt
    fleet.add("temperature", "n10", 3, (60, 0, 49), (70, 0, minutes - 50))     # warmer at the same power
    fleet.add("nvml_latency", "n1", 4, (0.05, 0, 99), (3, 0, minutes - 100))
    fleet.add("nvlink_crc", "n1", 4, (0, 60, minutes))       # slow NVML (a busy node) and NVLink errors
    fleet.add("temperature", "n2", 0, (72, 0, minutes))        # always ran hotter than its peers...
    fleet.add("pcie_replays", "n2", 0, (0, 20, minutes))       # ...plus a small signal of another cause
    fleet.add("thermal_seconds", "n2", 1, (0, 30, minutes))
    fleet.add("power_cap_seconds", "n2", 2, (0, 60, minutes))                    # operator's power cap
    fleet.add("temperature", "n2", 2, (50, 0, minutes))
    fleet.add("power_brake_seconds", "n2", 3, (0, 6, minutes))
    for gpu in range(7):                                     # the facility brakes the whole node (a rack)
        fleet.add("power_brake_seconds", "n6", gpu, (0, 6, minutes))
    fleet.add("pcie_replays", "n2", 4, (0, 20, minutes))                         # replays keep coming
    fleet.add("pcie_replays", "n2", 5, (0, 150, 2), (300, 0, minutes - 3))       # one burst at boot
    fleet.add("pcie_width", "n2", 6, (16, 0, 49), (8, 0, minutes - 50))
    fleet.add("pcie_width_max", "n2", 6, (16, 0, minutes))
    fleet.add("pcie_downgraded", "n2", 6, (0, 0, 49), (1, 0, minutes - 50))   # the exporter's own flag
    fleet.add("nvlink_crc", "n2", 7, (0, 60, minutes))
    # ...beside a healthy link that replays steadily below half the driver's limit (3 a minute), with the
    # AER errors the kernel logs for it: both under their floor, so the NVLink errors stand alone.
    fleet.add("pcie_replays", "n2", 7, (0, 3, minutes))
    fleet.add("pcie_aer", "n2", 7, (0, 1, minutes), pci_bus_id="00000000:1F:00.0")
    fleet.node("n8", minutes)                    # the rack's cooling fails: each GPU warms by its place
    for gpu, hot in enumerate((63, 64, 66, 68, 69, 70, 73, 76)):
        fleet.add("temperature", "n8", gpu, (60, 0, 109), (hot, 0, minutes - 110))
    fleet.add("pcie_replays", "n8", 7, (0, 20, minutes))     # plus a small signal of another cause
    fleet.node("n9", minutes)                    # a checkpoint storm: the NFS client queues its writes
    fleet.add("page_outs", "n9", None, (0, 100_000 * 60, minutes))
    fleet.nfs("n9", "/home", "GETATTR", {"operations": 50, "execute": 50 * 0.2}, minutes)
    fleet.nfs("n9", "/ckpt", "WRITE", {"operations": 40, "queue": 24, "execute": 40}, minutes)

    at = "140m"
    exprs = [
        # Always warmer than its peers, as it always was: no drift, not failing, so no thermal evidence;
        # with a small signal of another cause it stays below the threshold.
        _evidence("temperature_peer", "n2", 0, at),
        _evidence("temperature_baseline", "n2", 0, at),
        _score("n2", 0, at, 0.35),
        _evidence("thermal_slowdown", "n2", 1, at, 0.99),
        _evidence("pcie_replay", "n2", 4, at, 0.99),
        _evidence("pcie_replay", "n2", 5, "30m"),
        _evidence("pcie_replay", "n2", 5, at),
        _evidence("pcie_link_downgrade", "n2", 6, at, 0.99),
        _evidence("pcie_link_downgrade", "n2", 6, "55m"),   # not yet for the whole window
        _evidence("nvlink_errors", "n2", 7, at, 0.99),
        _evidence("pcie_replay", "n2", 7, at),
        _evidence("pcie_aer_errors", "n2", 7, at),
        _score("n2", 7, at, 0.45),
        _evidence("interrupt_collapse", "n4", None, at, 0.99),
        _evidence("procs_running_collapse", "n4", None, at, 0.99),
        _evidence("interrupt_collapse", "n1", None, at),
        _evidence("page_out_spike", "n3", None, at, 0.99),
        _evidence("nfs_latency_spike", "n6", None, at, 0.99),
        _evidence("gpus_missing", "n6", None, at, 0.99),
        _evidence("gpus_missing", "n1", None, at),
    ]
    if fleet.supports("power_brake_seconds"):
        exprs.append(_evidence("power_brake", "n2", 3, at, 0.99))
        exprs.append(_evidence("power_brake", "n2", 2, at))
        exprs.extend(_evidence("power_brake", "n6", gpu, at) for gpu in range(7))
    if fleet.supports("nvml_latency"):
        exprs.append(_evidence("nvml_latency", "n1", 4, at, 0.99))
    # Slow NVML names no GPU (a GSP stall or a busy node slows all of them): 0.1 beside NVLink's 0.45.
    exprs.append(_score("n1", 4, at, 0.55 if fleet.supports("nvml_latency") else 0.45))
    # Benign noise raises no evidence at all.
    for gpu in range(8):
        for signal in ("temperature_peer", "temperature_baseline"):
            exprs.append(_evidence(signal, "n5", gpu, at))                 # hot aisle
            exprs.append(_evidence(signal, "n3", gpu, at))                 # idle node
        exprs.append(_evidence("pcie_link_downgrade", "n3", gpu, at))
    for signal in ("temperature_peer", "thermal_slowdown", "temperature_baseline"):
        exprs.append(_evidence(signal, "n2", 2, at))                        # power-capped GPU
    for gpu in range(8):     # capped neighbours leave the peer set: the others' centre does not move
        for signal in ("temperature_peer", "temperature_baseline"):
            exprs.append(_evidence(signal, "n7", gpu, at))
        exprs.append(_score("n7", gpu, at, 0))
    for signal in ("interrupt_collapse", "procs_running_collapse"):
        exprs.append(_evidence(signal, "n3", None, at))                     # idle, not collapsed
    for signal in ("temperature_peer", "temperature_baseline"):
        exprs.append(_evidence(signal, "n10", 0, at))           # warmer only by what its power explains
        exprs.append(_evidence(signal, "n10", 3, "90m", 0.5))   # warmer at the same power: its cooling
        # ...until it has held that offset for most of its samples of `rise_window` (90 of 140 minutes):
        # a cooling that fails keeps warming, a GPU that settled warm is at its steady offset.
        exprs.append(_evidence(signal, "n10", 3, at))
    for gpu in range(8):     # most GPUs of the node drifted, either way: the rack's air, no GPU's
        for signal in ("temperature_peer", "temperature_baseline"):
            exprs.append(_evidence(signal, "n8", gpu, at))
    exprs.append(_score("n8", 7, at, 0.35))
    for signal in ("page_out_spike", "nfs_latency_spike"):   # the checkpoint's paging and slow metadata
        exprs.append(_evidence(signal, "n9", None, at))
    # One signal alone never raises the alert, and neither does noise.
    checks = [{"eval_time": t, "alertname": RISK, "exp_alerts": []} for t in ("30m", "60m", "100m", at)]
    run_promtool(tmp_path, source, GROUPS, [{"interval": "1m", "input_series": fleet.input_series(),
                                             "alert_rule_test": checks, "promql_expr_test": exprs}])


def test_pcie_seen_from_both_ends_counts_once(tmp_path):
    """Replays (the GPU's view of its link) and AER errors (the kernel's, gpuhealth source only) are one
    PCIe fault seen from both ends: together they count as the larger, below the threshold. AER of a
    device that is no GPU counts for no GPU."""
    minutes = 120
    fleet = Fleet("gpuhealth").node("n1", minutes)
    for gpu in (2, 3):
        fleet.add("pcie_replays", "n1", gpu, (0, 20, minutes))
    for gpu in (2, 4):
        fleet.add("pcie_aer", "n1", gpu, (0, 5, minutes), pci_bus_id=f"00000000:{0x18 + gpu:02X}:00.0")
    fleet.add("pcie_aer", "n1", None, (0, 50, minutes), pci_bus_id="00000000:03:00.0")   # a NIC, say
    at = "100m"
    exprs = [
        _evidence("pcie_aer_errors", "n1", 2, at, 0.99),
        _evidence("pcie_aer_errors", "n1", 4, at, 0.99),
        _evidence("pcie_aer_errors", "n1", 3, at),
        _score("n1", 4, at, 0.3),
        _score("n1", 3, at, 0.35),
        _score("n1", 2, at, 0.35),
    ]
    checks = [{"eval_time": t, "alertname": RISK, "exp_alerts": []} for t in ("50m", at)]
    run_promtool(tmp_path, "gpuhealth", GROUPS, [{"interval": "1m", "input_series": fleet.input_series(),
                                                 "alert_rule_test": checks, "promql_expr_test": exprs}])
