"""Definitive signals: each raises its own alert without fusion, on both input sources; the noise next
to each (an SBE burst, a slow HBM degradation, a pending remap, a few non-fatal SXIDs) stays quiet."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from gpuhealth.rules import catalogue
from gpuhealth.rules.render import render_all
from rules_promtool import INPUTS, SOURCES, Fleet, alert, run_promtool

GROUPS = ["xid", "definitive", "evidence", "fleet"]


def _gpu_alert(name: str, node: str, gpu: int, value: str, severity: str, action: str, summary: str,
               description: str) -> dict:
    return alert(name, {"alertname": name, "node": node, "gpu": str(gpu)}, summary, description, severity,
                 action)


def _run(tmp_path, source: str, fleet: Fleet, checks: list[dict]) -> None:
    run_promtool(tmp_path, source, GROUPS, [{"interval": "1m", "input_series": fleet.input_series(),
                                             "alert_rule_test": checks}])


@pytest.mark.parametrize("source", SOURCES)
def test_remap_failure_without_xid_and_pending_alone(tmp_path, source):
    minutes = 60
    fleet = Fleet(source).node("n1", minutes)
    fleet.add("remap_failure", "n1", 0, (0, 0, 19), (1, 0, minutes - 20))   # no XID 64 logged at all
    fleet.add("remap_pending", "n1", 0, (0, 0, 19), (1, 0, minutes - 20))   # both alerts: failure leads
    fleet.add("remap_pending", "n1", 1, (0, 0, 19), (1, 0, minutes - 20))   # pending alone
    fleet.add("retired_pending", "n1", 2, (0, 0, 19), (1, 0, minutes - 20))
    fleet.add("remap_failure", "n1", 3, (0, 0, minutes))
    failure = _gpu_alert(
        "GPUHealthRowRemapFailure", "n1", 0, "1", "critical", "drain_reset_gpu",
        "Row remapping failed on n1 GPU 0: reset the GPU",
        "GPU 0 of n1 reports a row-remap failure: a memory bank has no spare row left for a failing address. "
        "Drain the node, requeue its jobs and reset the GPU; if the failure comes back after the reset, "
        "replace it.")

    def pending(gpu: int) -> dict:
        return _gpu_alert(
            "GPUHealthRowRemapPending", "n1", gpu, "1", "info", "none",
            f"Row remap pending on n1 GPU {gpu}: reset when the job ends",
            f"GPU {gpu} of n1 has a row remap (or page retirement) waiting for a reset. Routine: the GPU "
            "works, and the repair takes effect at the next reset. Let the running job finish, then reset "
            "the GPU.")

    checks = [
        {"eval_time": "19m", "alertname": "GPUHealthRowRemapFailure", "exp_alerts": []},
        {"eval_time": "20m", "alertname": "GPUHealthRowRemapFailure", "exp_alerts": []},   # within `for`
        {"eval_time": "21m", "alertname": "GPUHealthRowRemapFailure", "exp_alerts": [failure]},
        {"eval_time": "29m", "alertname": "GPUHealthRowRemapPending", "exp_alerts": []},   # within `for`
    ]
    expected = [pending(0), pending(1)] + ([pending(2)] if fleet.supports("retired_pending") else [])
    checks.append({"eval_time": "31m", "alertname": "GPUHealthRowRemapPending", "exp_alerts": expected})
    _run(tmp_path, source, fleet, checks)


@pytest.mark.parametrize("source", SOURCES)
def test_uncorrectable_ecc_counts_rising(tmp_path, source):
    """A double-bit error alerts without any XID (dcgm input has no XID counter); one the GPU contained
    (XID 94 logged with it) only restarts the job, by the XID's own alert."""
    minutes = 60
    fleet = Fleet(source).node("n1", minutes)
    fleet.add("ecc_uncorrected", "n1", 0, (0, 0, 19), (2, 0, minutes - 20))     # two DBEs at minute 20
    fleet.add("ecc_uncorrected", "n1", 1, (7, 0, minutes))                      # old errors, none new
    fleet.add("ecc_uncorrected", "n1", 2, (3, 0, 29), (0, 0, minutes - 30))     # reset by a GPU reset
    fleet.add("ecc_uncorrected", "n1", 3, (0, 0, 19), (1, 0, minutes - 20))     # contained: XID 94 with it
    fleet.xid("n1", 3, [(20, 94)], minutes)
    dbe = _gpu_alert(
        "GPUHealthUncorrectableEccErrors", "n1", 0, "2", "critical", "drain_reset_gpu",
        "2 uncorrectable ECC error(s) on n1 GPU 0",
        "GPU 0 of n1 counted 2 uncorrectable (double-bit) ECC error(s) in the last window: its memory "
        "returned data it could not correct. Drain the node, requeue its jobs and reset the GPU so that "
        "the row is remapped.")
    checks = [
        {"eval_time": "19m", "alertname": "GPUHealthUncorrectableEccErrors", "exp_alerts": []},
        # One minute of `for`: the XID that says the error was contained may come a scrape later.
        {"eval_time": "20m", "alertname": "GPUHealthUncorrectableEccErrors", "exp_alerts": []},
        {"eval_time": "21m", "alertname": "GPUHealthUncorrectableEccErrors", "exp_alerts": [dbe]},
        {"eval_time": "34m", "alertname": "GPUHealthUncorrectableEccErrors", "exp_alerts": [dbe]},
        {"eval_time": "36m", "alertname": "GPUHealthUncorrectableEccErrors", "exp_alerts": []},
        {"eval_time": "40m", "alertname": "GPUHealthUncorrectableEccErrors", "exp_alerts": []},
    ]
    _run(tmp_path, source, fleet, checks)


@pytest.mark.parametrize("source", SOURCES)
def test_hbm_wear_needs_persistent_errors_and_remaps(tmp_path, source):
    """Corrected errors that keep coming while rows are remapped drain; SBE chatter without remaps, or a
    benign remap without chatter, or one row only (a contained uncorrectable error remaps one row), or
    rows after an isolated SBE burst, stay quiet; errors that began a few hours before the rows count.
    HBM signals need hours of history."""
    minutes = 400
    fleet = Fleet(source).node("n1", minutes)
    fleet.add("ecc_corrected", "n1", 0, (0, 1, minutes))                        # wear: chatter and rows
    fleet.add("rows_correctable", "n1", 0, (0, 0, 359), (3, 0, minutes - 360))
    fleet.add("ecc_corrected", "n1", 1, (0, 1, minutes))                        # chatter alone
    fleet.add("rows_correctable", "n1", 2, (0, 0, 359), (3, 0, minutes - 360))  # remaps alone
    fleet.add("ecc_corrected", "n1", 3, (0, 1, minutes))                        # chatter and one remap
    fleet.add("rows_correctable", "n1", 3, (0, 0, 359), (1, 0, minutes - 360))
    fleet.add("ecc_corrected", "n1", 4, (0, 1, minutes))                        # chatter and a contained
    fleet.add("rows_uncorrectable", "n1", 4, (0, 0, 359), (1, 0, minutes - 360))  # error: its one row
    fleet.add("ecc_corrected", "n1", 5, (0, 0, 219), (0, 1, minutes - 220))    # wear that began 2.5 h
    fleet.add("rows_correctable", "n1", 5, (0, 0, 359), (3, 0, minutes - 360))  # before its rows
    fleet.add("ecc_corrected", "n1", 6, (0, 0, 99), (40, 0, minutes - 100))     # one SBE burst, then rows
    fleet.add("rows_correctable", "n1", 6, (0, 0, 359), (3, 0, minutes - 360))
    wear = _gpu_alert(
        "GPUHealthHbmWear", "n1", 0, "3", "warning", "checkpoint_drain_reset_gpu",
        "HBM of n1 GPU 0 is wearing out",
        "GPU 0 of n1 keeps correcting ECC errors and spends spare rows on them (3 rows remapped within a "
        "day): its memory is degrading. Drain the node, reset the GPU so the remaps take effect, and run a "
        "memory diagnostic; replace it if the remaps go on.")
    young = _gpu_alert(
        "GPUHealthHbmWear", "n1", 5, "3", "warning", "checkpoint_drain_reset_gpu",
        "HBM of n1 GPU 5 is wearing out",
        "GPU 5 of n1 keeps correcting ECC errors and spends spare rows on them (3 rows remapped within a "
        "day): its memory is degrading. Drain the node, reset the GPU so the remaps take effect, and run a "
        "memory diagnostic; replace it if the remaps go on.")
    checks = [
        # Rows remapped at minute 360; the evidence groups run after this one, so the `for` starts a
        # minute or so later.
        {"eval_time": "372m", "alertname": "GPUHealthHbmWear", "exp_alerts": []},   # within `for`
        {"eval_time": "380m", "alertname": "GPUHealthHbmWear", "exp_alerts": [wear, young]},
        {"eval_time": "399m", "alertname": "GPUHealthHbmWear", "exp_alerts": [wear, young]},
    ]
    _run(tmp_path, source, fleet, checks)


@pytest.mark.parametrize("source", SOURCES)
def test_hbm_error_rate_needs_every_slice_at_the_floor(tmp_path, source):
    """Corrected errors at 3 a minute for half an hour drain, rows or not, until a GPU reset ends them (the
    volatile counter back to 0, no new errors); chatter (0.5 a minute), a burst of 300 on top of chatter
    and errors just under the floor (1.9 a minute) stay quiet."""
    minutes = 100
    fleet = Fleet(source).node("n1", minutes)
    fleet.add("ecc_corrected", "n1", 0, (0, 0, 29), (3, 3, minutes - 31))        # wear from minute 30
    fleet.add("ecc_corrected", "n1", 1, (0, 0.5, minutes))                      # chatter
    fleet.add("ecc_corrected", "n1", 2, (0, 0.5, 39), (320, 0.5, minutes - 41))  # chatter and a burst
    fleet.add("ecc_corrected", "n1", 3, (0, 1.9, minutes))                      # just under the floor
    fleet.add("ecc_corrected", "n1", 4, (0, 3, 59), (0, 0, minutes - 61))       # reset at minute 60 ends them
    wear = _gpu_alert(
        "GPUHealthHbmErrorRate", "n1", 0, "3", "warning", "checkpoint_drain_reset_gpu",
        "HBM of n1 GPU 0 corrects errors without pause (3/min)",
        "GPU 0 of n1 corrects 3 ECC errors a minute, and has at the floor's rate or more in every slice of "
        "the last window: far above the chatter a healthy part lives with, and not a burst that stopped. Its "
        "memory is degrading. Let the jobs checkpoint, drain the node, reset the GPU and run a memory "
        "diagnostic; replace it if the errors come back.")
    before_reset = _gpu_alert(
        "GPUHealthHbmErrorRate", "n1", 4, "3", "warning", "checkpoint_drain_reset_gpu",
        "HBM of n1 GPU 4 corrects errors without pause (3/min)",
        "GPU 4 of n1 corrects 3 ECC errors a minute, and has at the floor's rate or more in every slice of "
        "the last window: far above the chatter a healthy part lives with, and not a burst that stopped. Its "
        "memory is degrading. Let the jobs checkpoint, drain the node, reset the GPU and run a memory "
        "diagnostic; replace it if the errors come back.")
    checks = [
        # GPU 0's oldest slice reaches the floor at minute 56 (21 errors from minute 26 to 36), then 15
        # minutes of `for`; GPU 4 fires until its reset, and its last slice falls under the floor after it.
        {"eval_time": "55m", "alertname": "GPUHealthHbmErrorRate", "exp_alerts": [before_reset]},
        {"eval_time": "70m", "alertname": "GPUHealthHbmErrorRate", "exp_alerts": []},   # within `for`
        {"eval_time": "72m", "alertname": "GPUHealthHbmErrorRate", "exp_alerts": [wear]},
        {"eval_time": "99m", "alertname": "GPUHealthHbmErrorRate", "exp_alerts": [wear]},
    ]
    _run(tmp_path, source, fleet, checks)


@pytest.mark.parametrize("source", SOURCES)
def test_pcie_replay_rate_above_the_driver_limit(tmp_path, source):
    """Replays above 8 a minute for half an hour drain; a steady rate below it, a burst at boot far
    above it for one sample, or the bursts of a node in a reboot loop (its exporter down for a few
    minutes before each boot, every boot retraining the link) stay quiet."""
    minutes = 90
    fleet = Fleet(source).node("n1", minutes).node("n2", minutes)
    fleet.add("pcie_replays", "n1", 0, (0, 0, 9), (0, 20, minutes - 10))      # 20 a minute from minute 10
    fleet.add("pcie_replays", "n1", 1, (0, 6, minutes))                        # steady 6 a minute
    fleet.add("pcie_replays", "n1", 2, (0, 0, 9), (2000, 0, minutes - 10))    # one burst at minute 10
    fleet.add("up", "n1", None, (1, 0, minutes))
    # n2 reboots every 12 minutes from minute 5: its exporter is down for 3 minutes, then the counter
    # starts again from 0 and counts the 200 replays of the boot's link training.
    up, replays_n2 = [], []
    for minute in range(minutes + 1):
        down = minute >= 5 and (minute - 5) % 12 < 3
        booting = minute >= 8 and (minute - 8) % 12 == 0
        up.append("0" if down else "1")
        replays_n2.append("_" if down else ("0" if minute < 5 or booting else "200"))
    fleet.add("up", "n2", None, " ".join(up))
    fleet.add("pcie_replays", "n2", 0, " ".join(replays_n2))
    replays = _gpu_alert(
        "GPUHealthPcieReplayRate", "n1", 0, "20", "warning", "checkpoint_drain",
        "PCIe link of n1 GPU 0 keeps replaying (20/min)",
        "The PCIe link of GPU 0 on n1 replays 20 packets a minute, above the 8 a minute NVIDIA's driver "
        "allows a healthy link (DCGM's limit), and has for half an hour: the link is degrading. Let its "
        "jobs checkpoint, drain the node and have the link checked (reseat, riser, retimer) before it drops "
        "the GPU.")
    checks = [
        # Above the limit once the 15-minute rate passes 8 a minute (minute 17), firing 30 minutes later.
        {"eval_time": "46m", "alertname": "GPUHealthPcieReplayRate", "exp_alerts": []},   # within `for`
        {"eval_time": "48m", "alertname": "GPUHealthPcieReplayRate", "exp_alerts": [replays]},
        {"eval_time": "89m", "alertname": "GPUHealthPcieReplayRate", "exp_alerts": [replays]},
    ]
    # The reboot loop's replays alone are above the limit over 15 minutes (200 every 12 minutes).
    loop_rate = f'rate({INPUTS[source]["pcie_replays"][0]}{{node="n2"}}[15m]) * 60 > 8'
    exprs = [{"expr": f"count({loop_rate})", "eval_time": "60m",
              "exp_samples": [{"labels": "{}", "value": 1}]}]
    run_promtool(tmp_path, source, GROUPS, [{"interval": "1m", "input_series": fleet.input_series(),
                                             "alert_rule_test": checks, "promql_expr_test": exprs}])


def _nvlink_alert(gpu: int, per_minute: str) -> dict:
    return _gpu_alert(
        "GPUHealthNvlinkErrorRate", "n1", gpu, per_minute, "warning", "checkpoint_drain_reset_gpu",
        f"NVLink of n1 GPU {gpu} errs without pause ({per_minute}/min)",
        f"The NVLink error counters of GPU {gpu} on n1 grew between nearly every two scrapes of the last "
        f"window ({per_minute} errors a minute), at least twice the GPU's own average rate in the week "
        "before the last day (its quietest hour, for a GPU seen less than a day) and twice the fleet's "
        "typical GPU: a link whose bit error rate rose, not a flap that healed nor a link that has always "
        "erred a little. Let the jobs checkpoint, drain the node, reset the GPU and check the link "
        "(nvidia-smi nvlink -e, the NVLink cable or tray) before it fails with XID 74.")


def _render(tmp_path, source: str, nvlink_error_rate: dict, **defaults) -> Path:
    """The rules of ``source`` with the NVLink error-rate settings overridden, in a directory of their own."""
    rules_dir = tmp_path / "rules"
    overlay = {"defaults": {"definitive": {"nvlink_error_rate": nvlink_error_rate}, **defaults}}
    for path, text in render_all(catalogue.resolve(overlay), (source,)).items():
        (rules_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (rules_dir / path).write_text(text)
    return rules_dir


@pytest.mark.parametrize("source", SOURCES)
def test_nvlink_error_rate_needs_errors_between_most_scrapes(tmp_path, source):
    """Every setting of the baseline scaled from hours and days to minutes (a sample every 5 minutes, a
    baseline of the hour that ended 30 minutes ago), so that a chronic link has its history within the
    test. A link erring 3 times every minute from minute 70 fires 20 minutes later; so does one whose GPU
    is reset at minute 100 while it degrades (the counter starts again from 0 and keeps growing). Both
    stop once the baseline holds half their rate. A flap erring heavily in one minute of three, a job's
    burst at start (four minutes of thousands) and a link erring at the same rate since minute 0 (chronic:
    its normal) stay quiet; the chronic one is quiet too before it has three slices of history, which is
    no baseline, not a baseline of 0. The node's other three links and node n2's eight are clean, so the
    fleet's typical link is (the median of sixteen): no floor from the fleet. The fused NVLink evidence
    is the same share of scrapes, so a flap's bursts add nothing to the risk score."""
    scaled = {"baseline_step": "5m", "baseline_age": "30m", "baseline_window": "1h"}
    rules_dir = _render(tmp_path, source, scaled)
    minutes = 160
    fleet = Fleet(source).node("n1", minutes)
    fleet.add("nvlink_crc", "n1", 0, (0, 0, 70), (3, 3, minutes - 71))             # degrading from 70
    flap = " ".join(str(300 * ((m - 68) // 3)) if m >= 70 else "0" for m in range(minutes + 1))
    fleet.add("nvlink_crc", "n1", 1, flap)                                          # 1 minute in 3
    fleet.add("nvlink_crc", "n1", 2, (0, 0, 70), (2000, 2000, 3), (8000, 0, minutes - 74))   # burst
    fleet.add("nvlink_crc", "n1", 3, (0, 3, minutes))                               # chronic
    fleet.add("nvlink_crc", "n1", 4, (0, 0, 70), (3, 3, 29), (0, 3, minutes - 100))  # reset at 100
    for node, gpu in [("n1", 5), ("n1", 6), ("n1", 7), *(("n2", gpu) for gpu in range(8))]:
        fleet.add("nvlink_crc", node, gpu, (0, 0, minutes))                              # clean links
    both = [_nvlink_alert(0, "3.0"), _nvlink_alert(4, "3.0")]
    # GPU 0's counter grew between 15 of the 20 scrape intervals at minute 85, then 5 minutes of `for`.
    expected = {"20m": [], "40m": [], "89m": [], "90m": both, "99m": both, "125m": both, "150m": []}
    checks = [{"eval_time": at, "alertname": "GPUHealthNvlinkErrorRate", "exp_alerts": alerts}
              for at, alerts in expected.items()]
    # The fused evidence reads the same share, without the history: the flap and the burst add nothing.
    evidence = [{"labels": f'gpuhealth:gpu_evidence:nvlink_errors{{gpu="{gpu}", node="n1"}}', "value": 1}
                for gpu in (0, 3, 4)]
    exprs = [{"expr": "gpuhealth:gpu_evidence:nvlink_errors", "eval_time": "99m", "exp_samples": evidence}]
    run_promtool(tmp_path, source, ["definitive", "evidence"],
                 [{"interval": "1m", "input_series": fleet.input_series(), "alert_rule_test": checks,
                   "promql_expr_test": exprs}], rules_dir=rules_dir)


def _counter(rates: list[float | None], step_minutes: int) -> str:
    """A counter erring at ``rates[i]`` a minute up to sample ``i`` (promtool values, one sample per step;
    None: not scraped yet, as for a node that has not joined)."""
    count, points = 0.0, []
    for rate in rates:
        if rate is None:
            points.append("_")
            continue
        count += rate * step_minutes
        points.append(f"{count:.1f}")
    return " ".join(points)


def _slow_ramp(steps: int, step_minutes: int, ramp_steps: int, top_per_minute: float) -> str:
    """A counter idle, then erring at a rate that rises linearly to ``top_per_minute`` over the last
    ``ramp_steps`` samples."""
    start = steps - ramp_steps
    return _counter([max(i - start, 0) / ramp_steps * top_per_minute for i in range(steps + 1)], step_minutes)


NVLINK_ALERT = "GPUHealthNvlinkErrorRate"


def _nvlink_rules(tmp_path, source: str) -> Path:
    """The default NVLink groups alone, in one shard (the history and the alert over days of samples)."""
    rules_dir = _render(tmp_path, source, {}, gpu_shards=1)
    groups = yaml.safe_load((rules_dir / source / "definitive.yml").read_text())["groups"]
    nvlink = [g for g in groups if "-nvlink-" in g["name"]]
    (rules_dir / source / "nvlink.yml").write_text(yaml.safe_dump({"groups": nvlink}, sort_keys=False))
    return rules_dir


def _nvlink_firing(gpu: int, at: str, node: str = "n1") -> dict:
    labels = (f'ALERTS{{action="checkpoint_drain_reset_gpu", alertname="{NVLINK_ALERT}", '
              f'alertstate="firing", gpu="{gpu}", node="{node}", severity="warning"}}')
    return {"expr": f'ALERTS{{alertname="{NVLINK_ALERT}", gpu="{gpu}", node="{node}"}}', "eval_time": at,
            "exp_samples": [{"labels": labels, "value": 1}]}


def _nvlink_never(gpu: int, until: str, node: str = "n1") -> dict:
    """No alert, not even pending, from the start until ``until``."""
    selector = f'ALERTS{{alertname="{NVLINK_ALERT}", gpu="{gpu}", node="{node}"}}'
    return {"expr": f"count_over_time({selector}[{until}])", "eval_time": until, "exp_samples": []}


@pytest.mark.parametrize("source", SOURCES)
def test_nvlink_error_rate_over_days(tmp_path, source):
    """The default baseline over nine days, sampled every 5 minutes (one shard, the NVLink groups only).
    A link whose error rate rises steadily for 52 hours fires at its 28th and its 50th hour, where twice
    its own last-day average (t / (t - 12 h): 1.75 and 1.3) would have spared it. A link erring 3 times a
    minute all along is chronic: quiet for the nine days, also after its GPU is reset on day 5 (the
    counter starts again from 0; a growth from two lookups would have been negative). A link that errs
    heavily on day 8 fires and, healed by a GPU reset two hours later, stays quiet after. A node that
    appears on day 8 with a link erring from its first scrape at the chronic link's rate stays quiet: it
    has no history of its own for three hours, then its own slices hold the rate. A link that starts
    erring 6 times a minute on day 8 after a week without errors fills the window's scrapes 10 minutes
    later and fires 5 minutes after that. Node n2's eight clean links make the fleet's typical link
    clean, as most fleets' are: no floor from the fleet."""
    rules_dir = _nvlink_rules(tmp_path, source)
    step, days = 5, 9
    steps, day = days * 24 * 60 // step, 24 * 60 // step
    fleet = Fleet(source)
    fleet.add("nvlink_crc", "n1", 0, (0, 15, 5 * day), (0, 15, steps - 5 * day - 1))    # chronic, reset
    fleet.add("nvlink_crc", "n1", 1, _slow_ramp(steps, step, 52 * 60 // step, 60))      # 52 h ramp
    fleet.add("nvlink_crc", "n1", 2, (0, 0, 8 * day), (150, 150, 23), (0, 0, steps - 8 * day - 24))
    fleet.add("nvlink_crc", "n1", 3, f"_x{8 * day}", (0, 15, steps - 8 * day - 1))      # a new node
    fleet.add("nvlink_crc", "n1", 4, (0, 0, 8 * day - 1), (30, 30, steps - 8 * day))    # from day 8
    for gpu in range(8):
        fleet.add("nvlink_crc", "n2", gpu, (0, 0, steps))                                 # clean links
    ramp_start = days * 24 - 52
    exprs = [_nvlink_firing(1, f"{ramp_start + 28}h"), _nvlink_firing(1, f"{ramp_start + 50}h"),
             _nvlink_never(0, f"{days}d"), _nvlink_firing(2, f"{8 * 24 + 1}h"), _nvlink_never(2, "21h"),
             _nvlink_never(3, f"{days}d"),
             {"expr": f'ALERTS{{alertname="{NVLINK_ALERT}", gpu="4"}}', "eval_time": "8d10m", "exp_samples": [
                 {"labels": f'ALERTS{{action="checkpoint_drain_reset_gpu", alertname="{NVLINK_ALERT}", '
                            f'alertstate="pending", gpu="4", node="n1", severity="warning"}}', "value": 1}]},
             _nvlink_firing(4, "8d15m")]
    run_promtool(tmp_path, source, ["nvlink"],
                 [{"interval": f"{step}m", "input_series": fleet.input_series(), "promql_expr_test": exprs}],
                 evaluation_interval=f"{step}m", rules_dir=rules_dir)


@pytest.mark.parametrize("source", SOURCES)
def test_nvlink_error_rate_without_history(tmp_path, source):
    """Two days from the first scrape: every GPU is young (no slice older than a day) on the first, as on
    the day gpuhealth is installed. Node n0's seven links err 3 times a minute all along (a fleet whose
    links err a little): the fleet's typical rate, and quiet. On n1: a link whose rate rises from the
    first hour (one error a minute more each hour) fires once it is twice the fleet's typical rate, at
    its sixth hour, and keeps firing on day 2 against its own first hours. A node that joins at hour 6
    with a chronic link at the fleet's rate, one whose link is clean (idle) for its first 4 hours and then
    errs at the fleet's rate, and a link erring 10 times a minute from the first scrape (more than the
    fleet, but steady: no own slices to judge it by for 3 hours, then its own) stay quiet for the two
    days. A node that joins at hour 6 with a link already degrading (4 a minute, half a minute more each
    hour) fires once its rate doubled its first hour's, at its ninth hour, and on day 2 against its mean.
    A GPU whose counter is reset at hour 8 as its link starts erring 9 a minute (the old errors gone)
    fires within half an hour, and on day 2. A flap erring in one scrape in three stays quiet."""
    rules_dir = _nvlink_rules(tmp_path, source)
    step, hours = 5, 48
    steps, hour = hours * 60 // step, 60 // step
    fleet = Fleet(source)
    for gpu in range(7):
        fleet.add("nvlink_crc", "n0", gpu, (0, 15, steps))                                 # the fleet
    fleet.add("nvlink_crc", "n1", 0, _slow_ramp(steps, step, steps, hours))               # from the start
    fleet.add("nvlink_crc", "n1", 1, f"_x{6 * hour}", (0, 15, steps - 6 * hour))          # joins, chronic
    fleet.add("nvlink_crc", "n1", 2, f"_x{6 * hour}", (0, 0, 4 * hour), (15, 15, steps - 10 * hour - 1))
    joining = [None] * (6 * hour) + [4 + 0.5 * (i - 6 * hour) / hour for i in range(6 * hour, steps + 1)]
    fleet.add("nvlink_crc", "n1", 3, _counter(joining, step))                             # joins degrading
    fleet.add("nvlink_crc", "n1", 4, (100_000, 0, 8 * hour - 1), (0, 45, steps - 8 * hour))  # reset at 8 h
    flap = " ".join(str(300 * ((i - 22) // 3)) if i >= 24 else "0" for i in range(steps + 1))
    fleet.add("nvlink_crc", "n1", 5, flap)
    fleet.add("nvlink_crc", "n1", 6, (0, 50, steps))                                      # steady, high
    exprs = [*(_nvlink_never(gpu, f"{hours}h", "n0") for gpu in range(7)),
             _nvlink_never(0, "5h30m"), _nvlink_firing(0, "7h"), _nvlink_firing(0, "47h"),
             *(_nvlink_never(gpu, f"{hours}h") for gpu in (1, 2, 5, 6)),
             _nvlink_never(3, "14h30m"), _nvlink_firing(3, "16h"), _nvlink_firing(3, "40h"),
             _nvlink_never(4, "8h"), _nvlink_firing(4, "8h30m"), _nvlink_firing(4, "30h")]
    run_promtool(tmp_path, source, ["nvlink"],
                 [{"interval": f"{step}m", "input_series": fleet.input_series(), "promql_expr_test": exprs}],
                 evaluation_interval=f"{step}m", rules_dir=rules_dir)


@pytest.mark.parametrize("source", SOURCES)
def test_pcie_link_degraded(tmp_path, source):
    """A link that stays at half width drains; one that retrains back within minutes stays quiet."""
    minutes = 60
    fleet = Fleet(source).node("n1", minutes)
    for gpu, segments in ((0, [(16, 0, 9), (8, 0, minutes - 10)]),                       # stays narrow
                          (1, [(16, 0, 9), (8, 0, 9), (16, 0, minutes - 20)])):           # back at 20
        fleet.add("pcie_width", "n1", gpu, *segments)
        fleet.add("pcie_width_max", "n1", gpu, (16, 0, minutes))
        fleet.add("pcie_downgraded", "n1", gpu, *[(1 if w < 16 else 0, 0, n) for w, _, n in segments])
    degraded = _gpu_alert(
        "GPUHealthPcieLinkDegraded", "n1", 0, "1", "warning", "checkpoint_drain",
        "PCIe link of n1 GPU 0 runs below its width or generation",
        "The PCIe link of GPU 0 on n1 has run narrower than its maximum width, or at a lower generation "
        "while busy, for half an hour: it retrained after errors and will not recover on its own. Let its "
        "jobs checkpoint, drain the node and have the link checked (reseat, riser, retimer) before it drops "
        "the GPU.")
    checks = [
        # Narrow from minute 10: at every 5-minute step of the evidence's 15 minutes from minute 20; the
        # evidence group runs after this one, then the 15-minute `for`.
        {"eval_time": "34m", "alertname": "GPUHealthPcieLinkDegraded", "exp_alerts": []},   # within `for`
        {"eval_time": "38m", "alertname": "GPUHealthPcieLinkDegraded", "exp_alerts": [degraded]},
        {"eval_time": "59m", "alertname": "GPUHealthPcieLinkDegraded", "exp_alerts": [degraded]},
    ]
    _run(tmp_path, source, fleet, checks)


@pytest.mark.parametrize("source", SOURCES)
def test_gpu_overheating_at_the_parts_own_limits(tmp_path, source):
    """A GPU at its slowdown temperature, or its HBM at its maximum operating temperature, raises the
    notice; a GPU just below, or several hot GPUs of one node (its air), stay quiet."""
    minutes = 60
    fleet = Fleet(source)
    for node in ("n1", "n2"):
        fleet.node(node, minutes)
        for gpu in range(8):
            fleet.add("slowdown_temperature", node, gpu, (87, 0, minutes))
            fleet.add("memory_temperature_limit", node, gpu, (95, 0, minutes))
            fleet.add("memory_temperature", node, gpu, (70, 0, minutes))
    fleet.add("temperature", "n1", 0, (60, 0, 19), (88, 0, minutes - 20))      # past its slowdown limit
    fleet.add("memory_temperature", "n1", 1, (70, 0, 19), (95, 0, minutes - 20))   # HBM at its limit
    fleet.add("temperature", "n1", 2, (60, 0, 19), (86, 0, minutes - 20))      # just below
    for gpu in range(4):                                                        # n2's air: four hot GPUs
        fleet.add("temperature", "n2", gpu, (60, 0, 19), (88, 0, minutes - 20))

    def hot(gpu: int, sensor: str, value: str) -> dict:
        name = "GPUHealthGpuOverheating"
        return alert(name, {"alertname": name, "node": "n1", "gpu": str(gpu), "sensor": sensor},
                     f"GPU {gpu} on n1 keeps reaching its {sensor} temperature limit",
                     f"The {sensor} temperature of GPU {gpu} on n1 keeps reaching the limit the part "
                     f"reports (its hottest reading of the last minutes {value} C above it), while its node "
                     "mates stay cooler: the GPU is throttled. Check its cooling (fan, heatsink contact, "
                     "blocked airflow) at the next chance; if it keeps climbing towards its shutdown "
                     "temperature, drain the node.", "warning", "none")

    checks = [
        {"eval_time": "29m", "alertname": "GPUHealthGpuOverheating", "exp_alerts": []},   # within `for`
        {"eval_time": "31m", "alertname": "GPUHealthGpuOverheating",
         "exp_alerts": [hot(0, "gpu", "1"), hot(1, "memory", "0")]},
    ]
    _run(tmp_path, source, fleet, checks)


@pytest.mark.parametrize("source", SOURCES)
def test_corrected_ecc_storm_against_the_fleet(tmp_path, source):
    minutes = 60
    fleet = Fleet(source)
    for node in ("n1", "n2"):
        fleet.node(node, minutes)
        for gpu in range(8):     # every GPU reports the counter; most correct nothing
            fleet.add("ecc_corrected", node, gpu, (0, 0, minutes))
    fleet.add("ecc_corrected", "n1", 0, (0, 0, 9), (0, 3000 * 60, minutes - 10))   # 3,000/s from minute 10
    fleet.add("ecc_corrected", "n1", 1, (0, 0, 9), (60_000, 0, minutes - 10))      # one burst that stops
    fleet.add("ecc_corrected", "n1", 2, (0, 60, minutes))                           # slow HBM degradation
    storm = _gpu_alert(
        "GPUHealthEccCorrectedStorm", "n1", 0, "3000", "warning", "checkpoint_drain_reset_gpu",
        "Corrected-ECC storm on n1 GPU 0 (3000/s)",
        "GPU 0 of n1 corrects 3000 ECC errors per second, far above the rest of the fleet. The driver "
        "still reports it healthy, but the storm slows every job on it and often precedes uncorrectable "
        "errors: drain the node and reset the GPU.")
    checks = [
        {"eval_time": "20m", "alertname": "GPUHealthEccCorrectedStorm", "exp_alerts": []},   # within `for`
        {"eval_time": "23m", "alertname": "GPUHealthEccCorrectedStorm", "exp_alerts": [storm]},
        {"eval_time": "50m", "alertname": "GPUHealthEccCorrectedStorm", "exp_alerts": [storm]},
    ]
    _run(tmp_path, source, fleet, checks)


@pytest.mark.parametrize("source", SOURCES)
def test_nvswitch_sxids(tmp_path, source):
    minutes = 90
    fleet = Fleet(source)
    fleet.sxid("n1", "fatal", [10], minutes)
    fleet.sxid("n2", "non_fatal", list(range(20, 40, 2)), minutes)     # ten within the hour: repeating
    fleet.sxid("n3", "non_fatal", [20, 30, 40], minutes)               # a few: quiet
    fatal = alert("GPUHealthNvswitchFatalError", {"alertname": "GPUHealthNvswitchFatalError", "node": "n1"},
                  "Fatal NVSwitch error on n1 (1 in the last window)",
                  "An NVSwitch of n1 reported 1 fatal SXID(s): NVLink traffic through it is lost and jobs "
                  "spanning its GPUs fail. Drain the node; the switch and its GPUs need a reset (usually a "
                  "node reboot) before it takes jobs again.", "critical", "drain")
    repeating = alert(
        "GPUHealthNvswitchErrorsRepeating", {"alertname": "GPUHealthNvswitchErrorsRepeating", "node": "n2"},
        "NVSwitch errors repeating on n2 (10 in the last window)",
        "The NVSwitches of n2 reported 10 non-fatal SXIDs in the last window. Each is recovered, but a link "
        "or switch that keeps erring is degrading: check the SXIDs in the kernel log and plan a maintenance "
        "window.", "warning", "none")
    checks = [
        {"eval_time": "9m", "alertname": "GPUHealthNvswitchFatalError", "exp_alerts": []},
        {"eval_time": "11m", "alertname": "GPUHealthNvswitchFatalError", "exp_alerts": [fatal]},
        {"eval_time": "37m", "alertname": "GPUHealthNvswitchErrorsRepeating", "exp_alerts": []},
        {"eval_time": "39m", "alertname": "GPUHealthNvswitchErrorsRepeating", "exp_alerts": [repeating]},
    ]
    _run(tmp_path, source, fleet, checks)


@pytest.mark.parametrize("source", SOURCES)
def test_gpus_missing_repeatedly(tmp_path, source):
    minutes = 150
    fleet = Fleet(source)
    fleet.node("n1", minutes, gpus=7)                    # GPU 7 shows on and off: missing twice
    fleet.node("n2", minutes, gpus=7)                    # missing once, for long
    for node, gaps in (("n1", [(15, 35), (95, 115)]), ("n2", [(15, minutes + 1)])):
        shape = " ".join("_" if any(a <= m < b for a, b in gaps) else "60" for m in range(minutes + 1))
        fleet.add("temperature", node, 7, shape)
        fleet.add("info", node, 7, shape.replace("60", "1"), uuid=f"GPU-{node}-7")
        fleet.add("utilization", node, 7, shape.replace("60", "0.9"))
        fleet.add("gpus_expected", node, None, (8, 0, minutes))
        visible = " ".join("7" if any(a <= m < b for a, b in gaps) else "8" for m in range(minutes + 1))
        fleet.add("gpus_visible", node, None, visible)
    repeated = alert(
        "GPUHealthGpusMissingRepeatedly", {"alertname": "GPUHealthGpusMissingRepeatedly", "node": "n1"},
        "GPUs of n1 went missing 2 times: repair the node",
        "n1 lost GPUs from the driver on 2 separate occasions in the repeat window. Reboots are not fixing "
        "it: take the node out of rotation and check risers, board and power.", "critical", "replace")
    checks = [
        {"eval_time": "90m", "alertname": "GPUHealthGpusMissingRepeatedly", "exp_alerts": []},
        {"eval_time": "125m", "alertname": "GPUHealthGpusMissingRepeatedly", "exp_alerts": [repeated]},
    ]
    _run(tmp_path, source, fleet, checks)
