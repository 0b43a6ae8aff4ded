"""small.yaml end to end: real promtool backfill, real Prometheus, a small rule set with a recording
rule, ``for:``, an XID alert, a node alert, an informational alert and an ALERTS-reading alert."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuhealth.cli import main
from gpuhealth.evaluation.fleet import backfilled_prometheus
from gpuhealth.local.process import wait_until

SMALL = Path(__file__).resolve().parents[2] / "bench" / "scenarios" / "small.yaml"

ECC = 'gpuhealth_gpu_ecc_errors_total{type="corrected", counter="volatile"}'
XID = 'gpuhealth_xid_events_total{xid=~"48|64|79|94|95"}'
NFS = 'sum by (node) (rate(gpuhealth_nfs_rpc_{}_seconds_total{{op="WRITE"}}[5m]))'
RULES = {
    "groups": [
        {
            "name": "evidence",
            "interval": "1m",
            "rules": [
                {
                    "record": "test:gpu_evidence:ecc",
                    "expr": f"clamp_max(sum by (node, gpu) (rate({ECC}[30m])) * 60 / 5, 1)",
                },
                {
                    "record": "gpuhealth:gpu_failure_risk:score",
                    "expr": "test:gpu_evidence:ecc",
                    "labels": {"source": "test"},
                },
            ],
        },
        {
            "name": "alerts",
            "interval": "1m",
            "rules": [
                {
                    "alert": "TestRisk",
                    "for": "10m",
                    "labels": {"severity": "warning", "action": "drain"},
                    "expr": "gpuhealth:gpu_failure_risk:score > 0.5 "
                    "and on (node, gpu) max_over_time(test:gpu_evidence:ecc[10m]) > 0.5",
                },
                {
                    "alert": "TestXid",
                    "labels": {"severity": "critical", "action": "drain_reset_gpu"},
                    "expr": f"(sum by (node, gpu, xid) (increase({XID}[1h])) > 0) "
                    f"or (sum by (node, gpu, xid) ({XID}) unless sum by (node, gpu, xid) ({XID} offset 1h))",
                },
                {
                    "alert": "TestGpusMissing",
                    "labels": {"severity": "critical", "action": "drain_reboot"},
                    "expr": "max by (node) (gpuhealth_gpus_expected - gpuhealth_gpus_visible) > 0",
                },
                {
                    "alert": "TestNfsQueueing",
                    "for": "10m",
                    "labels": {"severity": "warning", "action": "none"},
                    "expr": f"{NFS.format('queue')} / {NFS.format('execute')} > 0.5",
                },
            ],
        },
        {
            "name": "lemon",
            "interval": "1m",
            "rules": [
                {
                    "alert": "TestLemon",
                    "labels": {"severity": "warning", "action": "replace"},
                    "expr": 'count by (node) (ALERTS{alertstate="firing", action=~"drain.*"}) >= 2',
                },
            ],
        },
    ]
}


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "rules"
    directory.mkdir()
    (directory / "test.yml").write_text(yaml.safe_dump(RULES))
    return directory


def processes_using(path: Path) -> list[int]:
    """Processes whose command line names ``path`` (other tests' Prometheus servers do not)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(path).encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_eval_on_small_scenario(tmp_path: Path, rules_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png, keep = tmp_path / "result.json", tmp_path / "timeline.png", tmp_path / "tsdb"
    assert (
        main(
            [
                "eval",
                "--scenario",
                str(SMALL),
                "--rules",
                str(rules_dir),
                "--json",
                str(out),
                "--plot",
                str(png),
                "--keep",
                str(keep),
                "--fused-step",
                "5m",
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    for key in (
        "recall",
        "predicted_fraction",
        "median_lead_seconds",
        "false_alarms_per_day",
        "per_kind",
        "per_alert",
    ):
        assert key in result
    details = {d["kind"]: d for d in result["failures_detail"]}
    # the HBM degradation ramps corrected ECC errors up for hours: the risk alert sees it coming
    assert details["hbm_degradation"]["status"] == "predicted"
    assert "TestRisk" in details["hbm_degradation"]["alerts"]
    assert details["hbm_degradation"]["lead_seconds"] > 3600
    # a GPU falling off the bus gives no warning: it is only detected, by the node's missing GPU
    assert details["fell_off_bus"]["status"] == "detected"
    assert set(details["fell_off_bus"]["alerts"]) & {"TestGpusMissing", "TestXid"}
    assert result["recall"] == 1.0 and result["predicted_fraction"] == 0.5
    assert (result["evaluation_step_seconds"], result["fused_alert_step_seconds"]) == (60, 300)
    assert result["per_kind"]["hbm_degradation"]["predicted"] == 1
    # the isolated SBE burst on gpu-000 GPU 2 trips the naive ECC rule: a false alarm, blamed on the burst
    alarms = result["false_alarm_episodes"]
    assert any(
        a["alert"] == "TestRisk"
        and a["node"] == "gpu-000"
        and a["gpu"] == "2"
        and a["near_noise"] == "sbe_burst"
        for a in alarms
    )
    assert result["false_alarms_per_day"] == pytest.approx(len(alarms) * 64 / 4, rel=0.01)
    # checkpoint queueing is informational: counted apart, never a false alarm
    assert result["per_alert"]["TestNfsQueueing"]["informational"] >= 1
    assert result["per_alert"]["TestNfsQueueing"]["false_alarms"] == 0
    # the ALERTS-reading rule ran on the backfilled ALERTS: gpu-001 had two drain alerts at its failure;
    # a lemon alert on a node already out of service is counted apart, neither right nor wrong
    assert result["per_alert"]["TestLemon"]["error"] is None
    assert result["per_alert"]["TestLemon"]["after_failure"] >= 1
    assert result["lemon_alerts"] == {"right": 0, "wrong": 0, "precision": None}
    for key in (
        "detected_fraction",
        "detection_latency_seconds",
        "predicted_long_precursor_fraction",
        "predicted_long_precursor_fraction_ci95",
        "late_warnings",
        "false_drains_per_day",
        "precision_at_field_rate",
    ):
        assert key in result, key
    assert result["detected_fraction"] == 1.0  # both XIDs alerted within a minute of the instant
    assert result["predicted_fraction_ci95"][0] < 0.5 < result["predicted_fraction_ci95"][1]
    assert result["false_drains"] >= 1 and result["precision_at_field_rate"] < 0.5
    assert png.stat().st_size > 10_000
    assert "recall" in capsys.readouterr().out
    assert processes_using(keep) == []


@pytest.mark.slow
def test_backfilled_prometheus_serves_raw_and_recorded_series(tmp_path: Path, rules_dir: Path) -> None:
    with backfilled_prometheus(SMALL, tmp_path, rules_dir=rules_dir) as fleet:
        api = fleet.server.api
        at = fleet.start + 13 * 3600  # an hour before the HBM failure on gpu-001 GPU 3
        gpus = api.query("count(gpuhealth_gpu_up)", time=at)
        assert float(gpus[0]["value"][1]) == 32
        info = api.query('gpuhealth_gpu_info{node="gpu-001", gpu="3"}', time=at)
        assert info[0]["metric"]["model"] == "NVIDIA H100 80GB HBM3"
        assert info[0]["metric"]["job"] == "gpuhealth-exporter"
        risk = api.query('gpuhealth:gpu_failure_risk:score{node="gpu-001", gpu="3"}', time=at)
        assert risk[0]["metric"]["source"] == "test"
        assert float(risk[0]["value"][1]) == 1.0
        quiet = api.query('gpuhealth:gpu_failure_risk:score{node="gpu-003"}', time=at)
        assert len(quiet) == 8 and all(float(r["value"][1]) < 0.5 for r in quiet)
        lost = api.query('gpuhealth_gpus_visible{node="gpu-002"}', time=fleet.start + 19 * 3600)
        assert float(lost[0]["value"][1]) == 7
        assert processes_using(tmp_path)
    assert processes_using(tmp_path) == []


@pytest.mark.slow
def test_interrupted_eval_leaves_no_prometheus_or_tsdb(tmp_path: Path, rules_dir: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    command = [
        sys.executable,
        "-m",
        "gpuhealth.cli",
        "eval",
        "--scenario",
        str(SMALL),
        "--rules",
        str(rules_dir),
    ]
    proc = subprocess.Popen(
        command, env={**os.environ, "TMPDIR": str(temp)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_until(
            lambda: any(b"prometheus" in cmdline(pid) for pid in processes_using(temp)),
            120,
            what="Prometheus on the backfilled fleet",
        )
        proc.send_signal(signal.SIGTERM)  # handled like Ctrl-C
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert b"Traceback" not in err
    assert processes_using(temp) == []
    assert list(temp.iterdir()) == []


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
def test_the_shipped_rules_evaluate_cleanly_on_small_scenario_whatever_the_jobs(tmp_path: Path) -> None:
    """The generated rules, as shipped, through the whole benchmark: Prometheus accepts every record and
    alert over the period (a rule that errors in a range query records nothing), and both failures are
    found. One query at a time or two, the JSON is the same to the byte but for the wall time."""
    shipped = Path(__file__).resolve().parents[2] / "rules" / "generated" / "gpuhealth"
    texts = []
    for jobs in ("1", "2"):
        out = tmp_path / f"result-{jobs}.json"
        options = ["--rules", str(shipped), "--json", str(out), "--jobs", jobs]
        assert main(["eval", "--scenario", str(SMALL), *options]) == 0
        texts.append(re.sub(r'"wall_seconds": [0-9.]+', "", out.read_text()))
    result = json.loads(out.read_text())
    assert result["rule_errors"] == {}
    assert result["recall"] == 1.0
    assert "GPUHealthGpuFailureRisk" in result["per_alert"]
    assert texts[0] == texts[1]


@pytest.mark.parametrize(("jobs", "error"), [("0", "not between 1 and 64"), ("two", "not a whole number")])
def test_jobs_must_be_a_sane_count(jobs: str, error: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_status:
        main(["eval", "--scenario", str(SMALL), "--jobs", jobs])
    assert exit_status.value.code == 2
    assert error in capsys.readouterr().err


@pytest.mark.slow
def test_every_kind_runs_end_to_end_and_plots_a_false_alarm(tmp_path: Path, rules_dir: Path) -> None:
    """kinds.yaml holds every fault kind, precursor shape and benign kind: it runs through the real
    Prometheus, and a false alarm a naive rule raises on a benign event can be drawn."""
    from gpuhealth.evaluation.scenario import FAULT_KINDS, NOISE_KINDS

    kinds = SMALL.parent / "kinds.yaml"
    out, png = tmp_path / "result.json", tmp_path / "false-alarm.png"
    argv = ["eval", "--scenario", str(kinds), "--rules", str(rules_dir), "--json", str(out)]
    assert main([*argv, "--plot", str(png), "--plot-false-alarm"]) == 0
    result = json.loads(out.read_text())
    assert result["rule_errors"] == {}
    assert {d["kind"] for d in result["failures_detail"]} == set(FAULT_KINDS)
    assert set(result["noise_by_kind"]) == set(NOISE_KINDS)
    details = {(d["node"], d["gpu"]): d for d in result["failures_detail"]}
    # the HBM fault that logs a contained XID 94 at 42 h: its instant is that XID, not the death at 44 h
    early = details[("gpu-000", 4)]
    assert early["instant_seconds"] == 42 * 3600 and early["failure_seconds"] == 44 * 3600
    assert details[("gpu-009", 2)]["precursor_seconds"] == 0
    # the node that failed at 20 h was repaired and failed again at 44 h: both scored
    assert sum(d["node"] == "gpu-000" for d in result["failures_detail"]) == 2
    # the naive XID rule drains on the contained XID 94, the naive ECC rule on the SBE burst: false
    # drains, each blamed on its benign event
    causes = {(a["alert"], a["near_noise"]) for a in result["false_alarm_episodes"]}
    assert {("TestXid", "contained_xid94"), ("TestRisk", "sbe_burst")} <= causes
    assert result["false_drains"] >= 2
    assert png.stat().st_size > 10_000
