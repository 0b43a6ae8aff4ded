"""XID classification: one alert per action class, escalation on repetition, XID 154's recovery action."""

from __future__ import annotations

import pytest
from gpuhealth.rules import catalogue
from rules_promtool import SOURCES, Fleet, alert, run_promtool, values

MINUTES = 90


def _xid_alert(name: str, node: str, gpu: int, xid: int, value: str, severity: str, action: str,
               summary_tail: str, description: str, **extra: str) -> dict:
    labels = {"alertname": name, "node": node, "gpu": str(gpu), "xid": str(xid), **extra}
    return alert(name, labels, f"XID {xid} on {node} GPU {gpu}: {summary_tail}",
                 description.format(node=node, gpu=gpu, xid=xid, value=value), severity, action)


RESTART = ("The driver reported XID {xid} on GPU {gpu} of {node} ({value} in the last window), an "
           "application-level fault: restart the job, the GPU stays in service.")
RESET = ("GPU {gpu} of {node} reported XID {xid} ({value} in the last window); the GPU needs a reset before "
         "it is trusted again. Drain the node, requeue its jobs, reset.")
REBOOT = ("GPU {gpu} of {node} reported XID {xid} ({value} in the last window): the GPU is off the bus or "
          "the driver asks for a reboot. Drain, requeue, reboot the node.")


def _case(fleet: Fleet, checks: list[dict]) -> dict:
    return {"interval": "1m", "input_series": fleet.input_series(), "alert_rule_test": checks}


@pytest.mark.parametrize("source", SOURCES)
def test_action_classes(tmp_path, source):
    fleet = Fleet(source)
    fleet.xid("n1", 0, [(5, 13)], MINUTES)      # restart the job
    fleet.xid("n1", 1, [(5, 43)], MINUTES)      # ignorable: raises nothing
    fleet.xid("n1", 2, [(5, 48)], MINUTES)      # reset the GPU
    fleet.xid("n2", 4, [(5, 79)], MINUTES)      # fell off the bus: reboot
    restart = _xid_alert("GPUHealthXidRestartJob", "n1", 0, 13, "1", "warning", "restart_job",
                         "restart the job", RESTART)
    reset = _xid_alert("GPUHealthXidResetGpu", "n1", 2, 48, "1", "critical", "drain_reset_gpu",
                       "reset the GPU", RESET)
    reboot = _xid_alert("GPUHealthXidRebootNode", "n2", 4, 79, "1", "critical", "drain_reboot",
                        "reboot the node", REBOOT)
    checks = []
    for name, expected in (("GPUHealthXidRestartJob", restart), ("GPUHealthXidResetGpu", reset),
                           ("GPUHealthXidRebootNode", reboot)):
        checks += [
            {"eval_time": "4m", "alertname": name, "exp_alerts": []},           # the minute before the XID
            {"eval_time": "6m", "alertname": name, "exp_alerts": [expected]},   # fires at once (no `for`)
            {"eval_time": "64m", "alertname": name, "exp_alerts": [expected]},  # still within the window
            {"eval_time": "66m", "alertname": name, "exp_alerts": []},          # window passed: resolved
        ]
    checks.append({"eval_time": "6m", "alertname": "GPUHealthXidDrain", "exp_alerts": []})
    run_promtool(tmp_path, source, ["xid"], [_case(fleet, checks)])


@pytest.mark.parametrize("source", SOURCES)
def test_repetition_escalates(tmp_path, source):
    fleet = Fleet(source)
    fleet.xid("n1", 1, [(5, 31), (15, 13), (25, 31)], MINUTES)   # app faults repeating on one GPU
    fleet.xid("n4", 5, [(5, 31)], MINUTES)                       # once only: just restart
    for gpu in (0, 3, 6):                                        # a buggy job faults on every GPU it uses
        fleet.xid("n5", gpu, [(5, 13), (15, 31), (25, 13)], MINUTES)
    fleet.xid("n2", 2, [(5, 64), (15, 48), (30, 64)], MINUTES)   # remap failure back after a reset
    fleet.xid("n3", 0, [(5, 79)], MINUTES)                       # two GPUs of n3 fall off the bus
    fleet.xid("n3", 6, [(40, 79)], MINUTES)
    drain = alert("GPUHealthXidDrain", {"alertname": "GPUHealthXidDrain", "node": "n1", "gpu": "1",
                                        "reason": "XID 13/31 repeated on this GPU"},
                  "GPU 1 on n1 needs diagnostics (XID 13/31 repeated on this GPU)",
                  "GPU 1 of n1: XID 13/31 repeated on this GPU (3). Drain the node and run diagnostics "
                  "before it takes more jobs.", "warning", "drain")
    replace = alert("GPUHealthXidReplaceGpu",
                    {"alertname": "GPUHealthXidReplaceGpu", "node": "n2", "gpu": "2"},
                    "GPU 2 on n2 keeps failing row remapping: replace it",
                    "GPU 2 of n2 reported a row-remap failure 2 times in the repeat window; "
                    "resets no longer help. Take the node out of rotation and replace the GPU.",
                    "critical", "replace")
    bus = alert("GPUHealthNodeRepeatedFallOffBus",
                {"alertname": "GPUHealthNodeRepeatedFallOffBus", "node": "n3"},
                "GPUs of n3 fell off the bus 2 times: repair the node",
                "n3 lost a GPU from the PCIe bus 2 times in the repeat window. Reboots are not fixing it: "
                "take the node out of rotation and check risers, board and power.", "critical", "replace")
    checks = [
        {"eval_time": "24m", "alertname": "GPUHealthXidDrain", "exp_alerts": []},
        {"eval_time": "26m", "alertname": "GPUHealthXidDrain", "exp_alerts": [drain]},   # n5: the job's fault
        {"eval_time": "29m", "alertname": "GPUHealthXidReplaceGpu", "exp_alerts": []},
        {"eval_time": "31m", "alertname": "GPUHealthXidReplaceGpu", "exp_alerts": [replace]},
        {"eval_time": "39m", "alertname": "GPUHealthNodeRepeatedFallOffBus", "exp_alerts": []},
        {"eval_time": "41m", "alertname": "GPUHealthNodeRepeatedFallOffBus", "exp_alerts": [bus]},
        {"eval_time": "90m", "alertname": "GPUHealthNodeRepeatedFallOffBus", "exp_alerts": [bus]},
    ]
    run_promtool(tmp_path, source, ["xid"], [_case(fleet, checks)])


@pytest.mark.parametrize("source", SOURCES)
def test_nvlink_flap_restarts_the_job_a_failing_link_drains(tmp_path, source):
    """A flap logs one NVLink XID, its link retrains within two minutes and its errors stop: the job
    restarts, nothing drains. A link that stays down (gpuhealth) or keeps erroring (dcgm), or XIDs that
    repeat, drain after the `for`."""
    fleet = Fleet(source)
    fleet.xid("n1", 0, [(5, 74)], MINUTES)                       # a flap that heals
    fleet.add("nvlink_up", "n1", 0, "1x4 0 0 1x84", link="3")
    fleet.add("nvlink_crc", "n1", 0, (0, 50, 5), (250, 0, MINUTES - 5))
    fleet.xid("n1", 1, [(5, 74)], MINUTES)                       # a link that fails and stays down
    fleet.add("nvlink_up", "n1", 1, "1x4 0x86", link="7")
    fleet.add("nvlink_crc", "n1", 1, (0, 50, MINUTES))
    if source == "dcgm":   # DCGM's other NVLink fields of the GPU: read one by one, they never collide
        fleet.raw('DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL{job="dcgm-exporter", instance="n1:9400", '
                  'node="n1", gpu="1"}', values((0, 10, MINUTES)))
    fleet.xid("n2", 2, [(5, 74), (6, 43), (7, 74)], MINUTES)    # repeats (43 between, for dcgm's gauge)
    fleet.add("nvlink_up", "n2", 2, (1, 0, MINUTES), link="0")

    def error(node: str, gpu: int, value: str) -> dict:
        return alert("GPUHealthXidNvlinkError",
                     {"alertname": "GPUHealthXidNvlinkError", "node": node, "gpu": str(gpu), "xid": "74"},
                     f"NVLink XID 74 on {node} GPU {gpu}: restart the job",
                     f"GPU {gpu} of {node} logged NVLink XID 74 ({value} in the last window): the job's "
                     "transfers over that link failed, restart it. A link that flaps once retrains and "
                     "heals; a repeat or a link that stays down drains the GPU (GPUHealthXidNvlinkFailing).",
                     "warning", "restart_job")

    def failing(node: str, gpu: int, reason: str, value: str) -> dict:
        return alert("GPUHealthXidNvlinkFailing",
                     {"alertname": "GPUHealthXidNvlinkFailing", "node": node, "gpu": str(gpu),
                      "reason": reason},
                     f"NVLink of {node} GPU {gpu} is failing: reset the GPU",
                     f"GPU {gpu} of {node}: {reason} ({value} in the last window), not a flap that healed. "
                     "Drain the node, requeue its jobs, reset the GPU; if the link fails again, have the "
                     "NVLink path (GPU, cable or NVSwitch tray) serviced.", "critical", "drain_reset_gpu")

    down = "NVLink XID with " + ("a link down" if source == "gpuhealth" else "link errors still counting")
    checks = [
        {"eval_time": "4m", "alertname": "GPUHealthXidNvlinkError", "exp_alerts": []},
        {"eval_time": "6m", "alertname": "GPUHealthXidNvlinkError",
         "exp_alerts": [error("n1", 0, "1"), error("n1", 1, "1"), error("n2", 2, "1")]},
        {"eval_time": "9m", "alertname": "GPUHealthXidNvlinkFailing", "exp_alerts": []},   # just before `for`
        {"eval_time": "10m", "alertname": "GPUHealthXidNvlinkFailing",
         "exp_alerts": [failing("n1", 1, down, "1")]},
        {"eval_time": "11m", "alertname": "GPUHealthXidNvlinkFailing",
         "exp_alerts": [failing("n1", 1, down, "1")]},
        {"eval_time": "12m", "alertname": "GPUHealthXidNvlinkFailing",
         "exp_alerts": [failing("n1", 1, down, "1"), failing("n2", 2, "NVLink XIDs repeated", "2")]},
        {"eval_time": "12m", "alertname": "GPUHealthXidResetGpu", "exp_alerts": []},
        {"eval_time": "30m", "alertname": "GPUHealthXidNvlinkFailing",
         "exp_alerts": [failing("n1", 1, down, "1"), failing("n2", 2, "NVLink XIDs repeated", "2")]},
        {"eval_time": "66m", "alertname": "GPUHealthXidNvlinkFailing", "exp_alerts": []},  # window passed
    ]
    run_promtool(tmp_path, source, ["xid"], [_case(fleet, checks)])


def test_recovery_action_and_fallen_off_bus(tmp_path):
    """XID 154 follows the action it announces; 'fallen off the bus' reboots (gpuhealth source only)."""
    fleet = Fleet("gpuhealth")
    fleet.xid("n1", 0, [(5, 154)], MINUTES)
    fleet.add("recovery_action", "n1", 0, "0x4 1x86", action="gpu_reset")
    fleet.add("recovery_action", "n1", 1, "0x4 1x86", action="drain_p2p")
    fleet.add("recovery_action", "n1", 2, (1, 0, MINUTES), action="none")
    fleet.add("fallen_off_bus", "n2", 3, "_x5 1x85")
    reset = _xid_alert("GPUHealthXidResetGpu", "n1", 0, 154, "1", "critical", "drain_reset_gpu",
                       "reset the GPU", RESET, recovery_action="gpu_reset")
    drain = alert("GPUHealthXidDrain", {"alertname": "GPUHealthXidDrain", "node": "n1", "gpu": "1",
                                        "recovery_action": "drain_p2p",
                                        "reason": "XID 154 recovery action drain_p2p"},
                  "GPU 1 on n1 needs diagnostics (XID 154 recovery action drain_p2p)",
                  "GPU 1 of n1: XID 154 recovery action drain_p2p (1). Drain the node and run diagnostics "
                  "before it takes more jobs.", "warning", "drain")
    reboot = _xid_alert("GPUHealthXidRebootNode", "n2", 3, 79, "1", "critical", "drain_reboot",
                        "reboot the node", REBOOT)
    checks = [
        {"eval_time": "3m", "alertname": "GPUHealthXidResetGpu", "exp_alerts": []},
        {"eval_time": "6m", "alertname": "GPUHealthXidResetGpu", "exp_alerts": [reset]},
        {"eval_time": "3m", "alertname": "GPUHealthXidDrain", "exp_alerts": []},
        {"eval_time": "6m", "alertname": "GPUHealthXidDrain", "exp_alerts": [drain]},
        {"eval_time": "4m", "alertname": "GPUHealthXidRebootNode", "exp_alerts": []},
        {"eval_time": "6m", "alertname": "GPUHealthXidRebootNode", "exp_alerts": [reboot]},
    ]
    run_promtool(tmp_path, "gpuhealth", ["xid"], [_case(fleet, checks)])


def test_counter_growth_and_exporter_restart(tmp_path):
    """A counter the exporter created at 0 counts its growth; one that appeared inside the window counts
    from 0; after an exporter restart (the counter back to 0) the events since the restart count, and
    the restart itself raises nothing."""
    fleet = Fleet("gpuhealth")
    fleet.xid_counter("n1", 0, 48, "0x9 1x80")
    fleet.xid_counter("n1", 1, 48, "2x69 0 0 0 0 0 1x15")

    def reset(gpu: int, value: str) -> dict:
        return _xid_alert("GPUHealthXidResetGpu", "n1", gpu, 48, value, "critical", "drain_reset_gpu",
                          "reset the GPU", RESET)

    checks = [
        {"eval_time": "9m", "alertname": "GPUHealthXidResetGpu", "exp_alerts": [reset(1, "2")]},
        {"eval_time": "30m", "alertname": "GPUHealthXidResetGpu",
         "exp_alerts": [reset(0, "1"), reset(1, "2")]},
        {"eval_time": "71m", "alertname": "GPUHealthXidResetGpu", "exp_alerts": []},
        {"eval_time": "76m", "alertname": "GPUHealthXidResetGpu", "exp_alerts": [reset(1, "1")]},
    ]
    run_promtool(tmp_path, "gpuhealth", ["xid"], [_case(fleet, checks)])


def test_every_xid_of_nvidias_catalogue_has_a_class_or_is_informational():
    """Each XID of the vendored table resolves to an action class, or to `none` through a bucket or an
    override that says so; an XID NVIDIA gives no bucket must be listed by hand, or the catalogue fails."""
    table = catalogue.xid_table()
    assert len(table) >= 172 and table[79] == "RESTART_BM" and table[61] == "CONTACT_SUPPORT"
    builtin = catalogue.load()
    classes = builtin.xid_classes()
    placed = [x for xids in classes.values() for x in xids]
    assert sorted(placed) == sorted(table), set(table) ^ set(placed)
    assert {46, 110, 136, 155, 156, 158} <= set(classes["drain_reset_gpu"])
    assert 54 in classes["drain"] and 151 in classes["drain_reboot"]
    assert 61 in classes["none"] and 45 in classes["none"]     # unused; 45 only alone (fabric manager)
    assert [74, *range(144, 151)] == classes["nvlink"]         # NVIDIA's NVLink workflows
    overrides = dict(builtin.defaults["xid"]["overrides"])
    overrides["none"] = [x for x in overrides["none"] if x != 172]
    with pytest.raises(catalogue.CatalogueError, match="XIDs 172 have no bucket"):
        catalogue.resolve({"defaults": {"xid": {"overrides": overrides}}})
    moved = catalogue.resolve({"defaults": {"xid": {"overrides": {**builtin.defaults["xid"]["overrides"],
                                                                  "restart_job": [48]}}}})
    assert 48 in moved.xid_classes()["restart_job"] and 48 not in moved.xid_classes()["drain_reset_gpu"]


@pytest.mark.parametrize("source", SOURCES)
def test_catalogue_classes_and_fabric_manager(tmp_path, source):
    fleet = Fleet(source)
    fleet.xid("n1", 0, [(5, 46)], MINUTES)           # RESET_GPU bucket, missing from the old hand list
    fleet.xid("n1", 1, [(5, 61)], MINUTES)           # unused in NVIDIA's catalogue: nothing
    fleet.xid("n1", 2, [(5, 54)], MINUTES)           # auxiliary power: drain, someone checks the board
    fleet.xid("n2", 3, [(5, 45)], MINUTES)           # 45 alone: restart the fabric manager (no drain)
    fleet.xid("n2", 4, [(5, 48), (6, 45)], MINUTES)  # 45 cleaning up after a DBE: follow the 48
    reset = _xid_alert("GPUHealthXidResetGpu", "n1", 0, 46, "1", "critical", "drain_reset_gpu",
                       "reset the GPU", RESET)
    dbe = _xid_alert("GPUHealthXidResetGpu", "n2", 4, 48, "1", "critical", "drain_reset_gpu",
                     "reset the GPU", RESET)

    def drain(node: str, gpu: int, xid: int, reason: str) -> dict:
        return alert("GPUHealthXidDrain", {"alertname": "GPUHealthXidDrain", "node": node, "gpu": str(gpu),
                                           "xid": str(xid), "reason": reason},
                     f"GPU {gpu} on {node} needs diagnostics ({reason})",
                     f"GPU {gpu} of {node}: {reason} (1). Drain the node and run diagnostics before it takes "
                     "more jobs.", "warning", "drain")

    fabric = alert("GPUHealthXidFabricManager", {"alertname": "GPUHealthXidFabricManager", "node": "n2",
                                                 "gpu": "3", "xid": "45"},
                   "XID 45 alone on n2 GPU 3: restart the fabric manager",
                   "GPU 3 of n2 logged XID 45 (preemptive cleanup) with no other XID in the last window. "
                   "NVIDIA's workflow for a lone XID 45 is to restart the fabric manager; if a job's code "
                   "faults, fix the job instead.", "warning", "none")

    checks = [
        {"eval_time": "4m", "alertname": "GPUHealthXidDrain", "exp_alerts": []},
        {"eval_time": "10m", "alertname": "GPUHealthXidResetGpu", "exp_alerts": [reset, dbe]},
        {"eval_time": "10m", "alertname": "GPUHealthXidDrain", "exp_alerts": [drain("n1", 2, 54, "XID 54")]},
        {"eval_time": "4m", "alertname": "GPUHealthXidFabricManager", "exp_alerts": []},
        {"eval_time": "10m", "alertname": "GPUHealthXidFabricManager", "exp_alerts": [fabric]},
        {"eval_time": "10m", "alertname": "GPUHealthXidRestartJob", "exp_alerts": []},
        {"eval_time": "10m", "alertname": "GPUHealthXidRebootNode", "exp_alerts": []},
    ]
    run_promtool(tmp_path, source, ["xid"], [_case(fleet, checks)])
