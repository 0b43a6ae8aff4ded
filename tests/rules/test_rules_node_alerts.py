"""Lemon nodes, NFS queueing, and monitoring of monitoring, for both input sources."""

from __future__ import annotations

import pytest
from rules_promtool import JOBS, SOURCES, Fleet, alert, run_promtool


def _firing(node: str, alertname: str, action: str, hours: list[int], total_hours: int,
            severity: str = "critical", minutes: tuple[int, int] = (0, 60)) -> tuple[str, str]:
    """An ALERTS series as Prometheus writes it (10-minute samples), firing from ``minutes[0]`` to
    ``minutes[1]`` past each of ``hours``."""
    labels = (f'ALERTS{{alertname="{alertname}", alertstate="firing", node="{node}", gpu="0", '
              f'severity="{severity}", action="{action}"}}')
    first, last = minutes[0] // 10, minutes[1] // 10
    points = ["1" if any(h * 6 + first <= t < h * 6 + last for h in hours) else "_"
              for t in range(total_hours * 6 + 1)]
    return labels, " ".join(points)


@pytest.mark.parametrize("source", SOURCES)
def test_lemon_node(tmp_path, source):
    hours = 100
    fleet = Fleet(source)
    fleet.raw(*_firing("n1", "GPUHealthXidResetGpu", "drain_reset_gpu", [2, 30, 60], hours))   # 3 failures
    fleet.raw(*_firing("n2", "GPUHealthXidResetGpu", "drain_reset_gpu", [2, 60], hours))       # 2 failures
    fleet.raw(*_firing("n3", "GPUHealthXidRestartJob", "restart_job", [2, 30, 60], hours))     # job restarts
    fleet.raw(*_firing("n3", "GPUHealthNfsQueueingDominates", "none", [10, 40, 70], hours))
    fleet.raw(*_firing("n4", "GPUHealthRowRemapPending", "drain_reset_gpu", [2, 30, 60], hours,
                       severity="info"))                                                     # routine resets
    # Three 20-minute drains between hourly grid points: no instant lookup at a grid point sees them.
    fleet.raw(*_firing("n5", "GPUHealthXidResetGpu", "drain_reset_gpu", [3, 31, 59], hours, minutes=(20, 40)))
    lemon = alert("GPUHealthLemonNode", {"alertname": "GPUHealthLemonNode", "node": "n1"},
                  "n1 failed 3 times recently: take it out of rotation",
                  "n1 had 3 separate failures or exclusions in the lemon window. A few nodes cause most "
                  "failures; keep this one out of rotation until it is repaired.", "warning", "replace")
    short = alert("GPUHealthLemonNode", {"alertname": "GPUHealthLemonNode", "node": "n5"},
                  "n5 failed 3 times recently: take it out of rotation",
                  "n5 had 3 separate failures or exclusions in the lemon window. A few nodes cause most "
                  "failures; keep this one out of rotation until it is repaired.", "warning", "replace")
    checks = [
        {"eval_time": "59h", "alertname": "GPUHealthLemonNode", "exp_alerts": []},
        {"eval_time": "61h", "alertname": "GPUHealthLemonNode", "exp_alerts": [lemon, short]},
        {"eval_time": "99h", "alertname": "GPUHealthLemonNode", "exp_alerts": [lemon, short]},
    ]
    run_promtool(tmp_path, source, ["lemon"], [{"interval": "10m", "input_series": fleet.input_series(),
                                                "alert_rule_test": checks}], evaluation_interval="10m")


@pytest.mark.parametrize("source", SOURCES)
def test_nfs_queueing(tmp_path, source):
    minutes = 30
    fleet = Fleet(source)
    # A checkpoint burst: 60% of WRITE execute time queued in the client.
    fleet.nfs("n1", "/ckpt", "WRITE", {"operations": 40, "queue": 24, "execute": 40}, minutes)
    # Busy but healthy: the server, not the client queue, takes the time.
    fleet.nfs("n2", "/ckpt", "WRITE", {"operations": 40, "queue": 2, "execute": 40}, minutes)
    # Queued, but too few operations to matter.
    fleet.nfs("n3", "/ckpt", "WRITE", {"operations": 1, "queue": 0.9, "execute": 1}, minutes)
    mount = "/ckpt"
    nfs = alert("GPUHealthNfsQueueingDominates",
                {"alertname": "GPUHealthNfsQueueingDominates", "node": "n1", "mount": mount},
                f"NFS RPC queueing dominates latency on n1 {mount}",
                f"60% of NFS execute time on {mount} of n1 is spent queued in the client (RPC slot table "
                "exhausted). Checkpoints stall; raise sunrpc.tcp_max_slot_table_entries or nconnect, or "
                "stagger checkpoints.", "warning", "none")
    checks = [
        {"eval_time": "10m", "alertname": "GPUHealthNfsQueueingDominates", "exp_alerts": []},
        {"eval_time": "11m", "alertname": "GPUHealthNfsQueueingDominates", "exp_alerts": [nfs]},
        {"eval_time": "30m", "alertname": "GPUHealthNfsQueueingDominates", "exp_alerts": [nfs]},
    ]
    run_promtool(tmp_path, source, ["storage"], [{"interval": "1m", "input_series": fleet.input_series(),
                                                  "alert_rule_test": checks}])


@pytest.mark.parametrize("source", SOURCES)
def test_monitoring_of_monitoring(tmp_path, source):
    minutes = 30
    fleet = Fleet(source)
    job, port = JOBS[source]
    fleet.raw(f'up{{job="{job}", instance="n1:{port}", node="n1"}}', "1x4 0x26")
    fleet.raw(f'up{{job="{job}", instance="n2:{port}", node="n2"}}', "1x30")
    for gpu in range(8):
        fleet.gpu("n2", gpu, minutes)
    for gpu in range(7):                                          # n3 lost one of its 8 GPUs
        fleet.gpu("n3", gpu, minutes)
    fleet.add("gpus_expected", "n3", None, (8, 0, minutes))
    fleet.add("gpus_visible", "n3", None, (7, 0, minutes))
    fleet.add("collector_success", "n2", None, (1, 0, 4), (0, 0, minutes - 5))
    down = alert("GPUHealthExporterDown",
                 {"alertname": "GPUHealthExporterDown", "node": "n1", "job": job, "instance": f"n1:{port}"},
                 f"GPU exporter {job} on n1 is down",
                 f"Prometheus cannot scrape {job} at n1:{port} (n1): no GPU health is known for this node "
                 "and none of its failures will be detected.", "warning", "none")
    missing = alert("GPUHealthGpusMissing", {"alertname": "GPUHealthGpusMissing", "node": "n3"},
                    "n3 is missing 1 GPU(s)",
                    "1 GPU(s) of n3 are not enumerated by the driver. A GPU that vanished needs a node "
                    "reboot at least; drain first.", "critical", "drain_reboot")
    checks = [
        {"eval_time": "9m", "alertname": "GPUHealthExporterDown", "exp_alerts": []},
        {"eval_time": "10m", "alertname": "GPUHealthExporterDown", "exp_alerts": [down]},
        {"eval_time": "1m", "alertname": "GPUHealthGpusMissing", "exp_alerts": []},
        {"eval_time": "2m", "alertname": "GPUHealthGpusMissing", "exp_alerts": [missing]},
    ]
    if fleet.supports("collector_success"):
        failing = alert("GPUHealthCollectorFailing",
                        {"alertname": "GPUHealthCollectorFailing", "node": "n2", "collector": "gpu"},
                        "Collector gpu failing on n2",
                        "The gpu collector of gpuhealth-exporter on n2 has failed every run; the signals it "
                        "feeds are missing and fusion treats them as 0.", "warning", "none")
        checks += [
            {"eval_time": "4m", "alertname": "GPUHealthCollectorFailing", "exp_alerts": []},
            {"eval_time": "19m", "alertname": "GPUHealthCollectorFailing", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "GPUHealthCollectorFailing", "exp_alerts": [failing]},
        ]
    run_promtool(tmp_path, source, ["meta"], [{"interval": "1m", "input_series": fleet.input_series(),
                                               "alert_rule_test": checks}])
