"""gpuhealth-validate: each failing condition injected into the simulated node fails its own check,
every NVML error class gives a verdict (never a traceback), and the exit code says pass/fail/cannot."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml
from exporter_helpers import FakeClock
from gpuhealth.exporter.nvml_errors import UNCOUNTED, Reaction, error_label, reaction
from gpuhealth.exporter.sim.nvml import SimulatedNvml
from gpuhealth.exporter.sim.scenario import parse_scenario
from gpuhealth.exporter.validate import APPLICATION_XIDS, Options, main, seconds_after_boot, validate
from gpuhealth.exporter.validate_checks import MAX_LOG_RECORDS, Check, KernelLog, NicPorts
from gpuhealth.exporter.validate_commands import OUTPUT_KEPT_BYTES, run_command
from test_nvml_errors import ERRORS, GPU_DOWN, NVML_DOWN

PASSED, FAILED, CANNOT = 0, 1, 2
NEW_DRIVER = "570.86.10"  # reports the recovery action (R565+)


def sim(scenario: dict[str, Any], kmsg: Path | None = None, cls: type[SimulatedNvml] = SimulatedNvml
        ) -> SimulatedNvml:
    """A simulated node one second into ``scenario``: faults with precursor 0 have happened."""
    clock = FakeClock()
    nvml = cls(parse_scenario(scenario), kmsg, clock=clock, sleep=lambda seconds: None)
    clock.advance(1.0)
    return nvml


def run(nvml: SimulatedNvml, **options: Any) -> tuple[int, dict[str, Check]]:
    code, checks = validate(nvml, Options(**options))
    return code, {check.name: check for check in checks}


def test_a_healthy_node_passes_every_check() -> None:
    code, checks = run(sim({"driver_version": NEW_DRIVER}))
    assert code == PASSED
    assert list(checks) == ["nvml", "gpus_visible", "row_remap", "recovery_action", "fabric", "nic_ports",
                            "ecc_mode", "temperature", "xid"]
    assert checks["nic_ports"].ok is None  # no port expected
    assert all(check.ok is True for name, check in checks.items() if name not in ("xid", "nic_ports")), checks
    assert checks["xid"].ok is None  # no kernel log given
    assert checks["gpus_visible"].value["answering"] == 8
    assert checks["recovery_action"].value == {str(i): "none" for i in range(8)}


def sim_with_nics(tmp_path: Path, faults: list[dict[str, Any]]) -> SimulatedNvml:
    """A simulated node one second into ``faults``, its sysfs tree (8 NDR NICs) under ``tmp_path``."""
    clock = FakeClock()
    nvml = SimulatedNvml(parse_scenario({"faults": faults}), clock=clock, sleep=lambda seconds: None,
                         sysfs=tmp_path)
    clock.advance(1.0)
    return nvml


def test_every_nic_port_up_at_its_rate_passes(tmp_path: Path) -> None:
    code, checks = run(sim_with_nics(tmp_path, []), nic_ports=NicPorts(tmp_path, (), 400))
    assert code == PASSED
    assert (checks["nic_ports"].ok, checks["nic_ports"].detail) == (True, "8 NIC ports up at 400 Gb/s")
    assert checks["nic_ports"].value["mlx5_7:1"] == {"up": True, "state": 4, "physical_state": 5,
                                                     "rate_gbps": 400.0}


@pytest.mark.parametrize(("fault", "ports", "problem"), [
    ({"kind": "ib_rate_downgrade", "nic": 5, "precursor": 0}, (),
     "mlx5_5 port 1 at 200 Gb/s, expected 400 Gb/s"),
    ({"kind": "ib_link_flap", "nic": 2, "precursor": 0}, (("mlx5_2", "1"), ("mlx5_3", "1")),
     "mlx5_2 port 1 down (state 1, physical state 2)"),
    ({"kind": "switch_reboot", "duration": 600}, (("mlx5_0", "1"),),
     "mlx5_0 port 1 down (state 1, physical state 2)"),
    ({"kind": "ib_boot_flap", "nic": 0, "start": 3600}, (("mlx5_0", "1"), ("mlx5_9", "1")),
     "mlx5_9 port 1 missing"),
])
def test_a_port_down_slow_or_missing_fails(tmp_path: Path, fault: dict[str, Any], ports: tuple,
                                           problem: str) -> None:
    code, checks = run(sim_with_nics(tmp_path, [fault]), nic_ports=NicPorts(tmp_path, ports, 400))
    assert code == FAILED
    assert (checks["nic_ports"].ok, checks["nic_ports"].detail) == (False, problem)


def test_ports_without_a_rate_only_need_to_be_up_and_no_port_at_all_fails(tmp_path: Path) -> None:
    fixture = Path(__file__).parent / "fixtures" / "sysfs-fabric"  # mlx5_2 runs at 200 Gb/s, mlx5_1 is down
    code, checks = run(sim({"gpus": 2}), nic_ports=NicPorts(fixture, (("mlx5_0", "1"), ("mlx5_2", "1"))))
    assert (code, checks["nic_ports"].ok, checks["nic_ports"].detail) == (PASSED, True, "2 NIC ports up")
    code, checks = run(sim({"gpus": 2}), nic_ports=NicPorts(fixture, (), None))
    assert checks["nic_ports"].detail == "mlx5_1 port 1 down (state 1, physical state 2)"
    code, checks = run(sim({"gpus": 2}), nic_ports=NicPorts(tmp_path, (), 400))
    assert code == FAILED and checks["nic_ports"].detail.startswith("no InfiniBand/RoCE port under")


def test_cli_checks_the_simulated_ports(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, verdict, err = cli(capsys, "--backend", "sim", "--nic-rate-gbps", "400")
    assert code == 0, err
    assert {check["name"]: check["detail"] for check in verdict["checks"]}["nic_ports"] == \
        "8 NIC ports up at 400 Gb/s"
    scenario = tmp_path / "faults.yml"
    scenario.write_text(yaml.safe_dump({"faults": [{"kind": "ib_symbol_errors", "nic": 3, "precursor": 0}]}))
    code, verdict, err = cli(capsys, "--backend", "sim", "--sim-profile", "b200", "--scenario", str(scenario),
                             "--nic-ports", "mlx5_0,mlx5_3:1")
    assert code == 1 and verdict["failed"] == ["nic_ports"]


def test_a_driver_before_r565_has_no_recovery_action_to_check() -> None:
    code, checks = run(sim({"gpus": 2, "driver_version": "550.54.15"}))
    assert code == PASSED
    assert checks["recovery_action"].ok is None
    assert "before R565" in checks["recovery_action"].detail


def test_a_gpu_missing_from_nvml_fails_against_the_expected_count() -> None:
    code, checks = run(sim({"gpus": 7}), gpus_expected=8)
    assert code == FAILED
    assert checks["gpus_visible"].ok is False
    assert checks["gpus_visible"].detail == "7 of 8 GPUs answer NVML"


def test_the_expected_count_comes_from_the_pci_bus(tmp_path: Path) -> None:
    devices = tmp_path / "bus" / "pci" / "devices"
    for bus, vendor, pci_class in [(0x18 + i, "0x10de", "0x030200") for i in range(8)] + \
            [(0x05, "0x10de", "0x068000"), (0x60, "0x8086", "0x030000")]:  # an NVSwitch, another VGA
        device = devices / f"0000:{bus:02x}:00.0"
        device.mkdir(parents=True)
        (device / "vendor").write_text(vendor + "\n")
        (device / "class").write_text(pci_class + "\n")
    code, checks = run(sim({"gpus": 7}), sysfs=tmp_path)
    assert code == FAILED
    assert checks["gpus_visible"].value["expected"] == 8
    assert checks["gpus_visible"].value["expected_from"] == "pci"


def test_a_gpu_that_fell_off_the_bus_fails_and_its_xid_is_found(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    code, checks = run(sim({"faults": [{"kind": "fell_off_bus", "gpu": 3}]}, kmsg),
                       kernel_log=KernelLog(kmsg))
    assert code == FAILED
    assert checks["gpus_visible"].detail == "7 of 8 GPUs answer NVML; gpu 3 gpu_is_lost"
    assert checks["xid"].ok is False
    assert checks["xid"].value["xids"] == {"unknown": {"79": 2}}  # the XID line and the driver's notice


@pytest.mark.parametrize(("fault", "problem"), [
    ({"kind": "benign_remap", "gpu": 2, "duration": 600}, "gpu 2 row remap pending (reset the GPU)"),
    ({"kind": "hbm_degradation", "gpu": 5, "precursor": 0, "xid": 64},
     "gpu 5 row remap failure (replace the GPU)"),
])
def test_a_pending_or_failed_row_remap_fails(fault: dict[str, Any], problem: str) -> None:
    code, checks = run(sim({"faults": [fault]}))
    assert code == FAILED
    assert (checks["row_remap"].ok, checks["row_remap"].detail) == (False, problem)


def test_a_requested_recovery_action_fails_and_the_xids_that_announced_it_too(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    scenario = {"driver_version": NEW_DRIVER,
                "faults": [{"kind": "hbm_degradation", "gpu": 4, "precursor": 0}]}
    code, checks = run(sim(scenario, kmsg), kernel_log=KernelLog(kmsg))
    assert code == FAILED
    assert checks["recovery_action"].detail == "gpu 4 recovery action gpu_reset"
    assert checks["xid"].value["xids"] == {"4": {"63": 64, "95": 1, "154": 1}}  # 63: rows marked on the way
    assert checks["xid"].detail == "gpu 4 XID 63, 95, 154 since boot"


class FabricInProgress(SimulatedNvml):
    """GPU 1 has not finished registering with the NVLink fabric; GPU 2 registered with an error."""

    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, info: Any) -> int:
        result = super().nvmlDeviceGetGpuFabricInfoV(device, info)
        if device.index == 1:
            info._obj.state = pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS
        if device.index == 2:
            info._obj.status = pynvml.NVML_ERROR_UNKNOWN
        return int(result)


def test_fabric_registration_not_completed_or_failed_fails() -> None:
    code, checks = run(sim({"gpus": 3}, cls=FabricInProgress))
    assert code == FAILED
    assert checks["fabric"].detail == \
        "gpu 1 fabric registration in_progress; gpu 2 fabric registration failed"
    assert checks["fabric"].value["0"] == \
        {"state": "completed", "status_ok": True, "bandwidth_degraded": False}


def test_no_fabric_is_not_applicable() -> None:
    nvml = sim({"gpus": 2})
    nvml.inject["nvmlDeviceGetGpuFabricInfoV"] = pynvml.NVMLError_NotSupported()
    code, checks = run(nvml)
    assert code == PASSED
    assert checks["fabric"].ok is None


class EccOff(SimulatedNvml):
    """GPU 0: ECC off; GPU 1: on, but turned off at the next reset."""

    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        on, off = pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_DISABLED
        return {0: [off, off], 1: [on, off]}.get(handle.index, [on, on])


def test_ecc_off_now_or_after_the_next_reset_fails() -> None:
    code, checks = run(sim({"gpus": 3}, cls=EccOff))
    assert code == FAILED
    assert checks["ecc_mode"].detail == "gpu 0 ECC off; gpu 1 ECC off after the next reset"


def test_a_hot_idle_gpu_fails_and_a_busy_one_is_judged_against_its_slowdown_temperature() -> None:
    idle = {"gpus": 2, "workload": {"utilization": 0},
            "faults": [{"kind": "warm_gpu", "gpu": 1, "delta_celsius": 30, "duration": 600}]}
    code, checks = run(sim(idle))
    assert code == FAILED
    assert checks["temperature"].detail == "gpu 1 64 °C idle, above 55 °C"
    assert checks["temperature"].value["0"] == {"celsius": 34, "busy": False, "limit_celsius": 55.0}
    assert run(sim(idle), idle_temperature_max=70)[0] == PASSED
    busy = {"gpus": 2, "seed": 1, "faults": [{"kind": "warm_gpu", "gpu": 0, "delta_celsius": 25,
                                              "duration": 600}]}
    code, checks = run(sim(busy))
    assert code == FAILED
    assert checks["temperature"].detail.startswith("gpu 0 ")
    assert checks["temperature"].detail.endswith(" °C busy, above 82 °C")
    assert checks["temperature"].value["1"]["busy"] is True


def kmsg_line(seq: int, seconds: float, text: str) -> str:
    return f"3,{seq},{int(seconds * 1e6)},-;{text}\n"


def test_xids_count_since_the_reset_and_application_xids_do_not(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(kmsg_line(1, 100, "NVRM: Xid (PCI:0000:2a:00): 48, pid=1, An uncorrectable DBE")
                    + kmsg_line(2, 250, "NVRM: Xid (PCI:0000:18:00): 13, pid=7, Graphics Exception")
                    + kmsg_line(3, 260, "user space writes its own line"))
    ignore = frozenset(APPLICATION_XIDS)
    code, checks = run(sim({"gpus": 2}), kernel_log=KernelLog(kmsg, 0.0, ignore))
    assert code == FAILED
    assert checks["xid"].detail == "gpu 1 XID 48 since boot"
    assert checks["xid"].value["ignored"] == 1
    code, checks = run(sim({"gpus": 2}), kernel_log=KernelLog(kmsg, 200.0, ignore))
    assert code == PASSED
    assert checks["xid"].detail == "no XID since 200 s after boot"
    code, checks = run(sim({"gpus": 2}), kernel_log=KernelLog(kmsg, 200.0))
    assert checks["xid"].detail == "gpu 0 XID 13 since 200 s after boot"


def test_an_unreadable_kernel_log_fails_the_xid_check(tmp_path: Path) -> None:
    code, checks = run(sim({"gpus": 1}), kernel_log=KernelLog(tmp_path))  # a directory
    assert code == FAILED
    assert checks["xid"].detail.startswith(f"cannot read the kernel log {tmp_path}: ")


@pytest.mark.parametrize("flood", ["/dev/zero", "records"])
def test_a_kernel_log_that_never_ends_fails_the_xid_check(tmp_path: Path, flood: str) -> None:
    """``--kmsg-path /dev/zero`` (or a years-long syslog) was read into one list until memory ran out."""
    path = Path(flood)
    if flood == "records":  # more short lines than any kernel ring buffer holds, an XID among the last
        path = tmp_path / "syslog"
        path.write_text("x\n" * MAX_LOG_RECORDS + "NVRM: Xid (PCI:0000:18:00): 48, DBE\n")
    code, checks = run(sim({"gpus": 1}), kernel_log=KernelLog(path))
    assert code == FAILED
    assert "not one boot's kernel log (use /dev/kmsg)" in checks["xid"].detail


def test_xid_since_takes_seconds_after_boot_or_a_zoned_time() -> None:
    assert seconds_after_boot("250.5", monotonic=4000) == 250.5
    # booted at 1000 s after the epoch (now 5000, 4000 s since boot); the reset 1 h after the epoch
    assert seconds_after_boot("1970-01-01T01:00:00Z", now=5000, monotonic=4000) == 2600
    for bad in ("-1", "nan", "yesterday", "2026-12-02T01:00:00"):
        with pytest.raises(Exception, match=r"expected|time zone"):
            seconds_after_boot(bad)
    # a time still to come skipped every XID and passed the check (a typo'd year, a wrong clock)
    for future in ("4006", "99999999999999999999", "1970-01-01T01:23:27Z", "9999-12-31T23:59:59-23:59"):
        with pytest.raises(argparse.ArgumentTypeError, match="in the future"):
            seconds_after_boot(future, now=5000, monotonic=4000)
    assert seconds_after_boot("4004", now=5000, monotonic=4000) == 4004  # "now", a clock a little ahead


def fake_tool(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_dcgm_diagnostic_runs_at_the_level_asked_and_its_failure_fails(tmp_path: Path) -> None:
    args = tmp_path / "args"
    good = fake_tool(tmp_path / "dcgmi-good", f'echo "$@" > {args}; echo "Diagnostic Pass"')
    code, checks = run(sim({"gpus": 1}), dcgm_level=2, dcgmi=str(good))
    assert (code, checks["dcgm_diag"].ok) == (PASSED, True)
    assert checks["dcgm_diag"].detail == "dcgmi diag -r 2 passed"
    assert args.read_text() == "diag -r 2\n"
    bad = fake_tool(tmp_path / "dcgmi-bad", 'echo "Memory: Fail - GPU 0"; echo "Run: 1 failed" >&2; exit 226')
    code, checks = run(sim({"gpus": 1}), dcgm_level=1, dcgmi=str(bad))
    assert code == FAILED
    assert checks["dcgm_diag"].detail == "dcgmi diag -r 1 failed (exit 226): Run: 1 failed"
    assert checks["dcgm_diag"].value["exit_code"] == 226


def test_dcgm_not_installed_is_skipped_not_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    code, checks = run(sim({"gpus": 1}), dcgm_level=3)
    assert code == PASSED
    assert (checks["dcgm_diag"].ok, checks["dcgm_diag"].detail) == (None, "dcgmi not installed: DCGM "
                                                                         "diagnostic skipped")


def test_site_command_passes_fails_or_cannot_run(tmp_path: Path) -> None:
    assert run(sim({"gpus": 1}), site_command=("true",))[1]["site_command"].ok is True
    code, checks = run(sim({"gpus": 1}), site_command=("sh", "-c", "echo 'busbw 12.5 GB/s, expected 400'; "
                                                                    "exit 3"))
    assert code == FAILED
    assert checks["site_command"].detail == "sh failed (exit 3): busbw 12.5 GB/s, expected 400"
    code, checks = run(sim({"gpus": 1}), site_command=(str(tmp_path / "missing"),))
    assert code == FAILED
    assert checks["site_command"].detail.startswith("missing: cannot run ")


def test_a_site_command_past_its_deadline_is_killed_with_everything_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = f"sleep 300 & echo $! > {pids}; sleep 300"
    code, checks = run(sim({"gpus": 1}), site_command=("sh", "-c", script), site_timeout=1.0)
    assert code == FAILED
    assert checks["site_command"].detail == "sh: no result within 1 s (killed)"
    child = int(pids.read_text())
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and "zombie" not in _state(child):
        assert time.monotonic() < deadline, "the site command's child outlived its deadline"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


def test_nvml_that_cannot_initialise_cannot_check() -> None:
    nvml = sim({"gpus": 1})
    nvml.driver_loaded = False
    code, checks = run(nvml)
    assert code == CANNOT
    assert [(c.name, c.ok, c.detail) for c in checks.values()] == [
        ("nvml", False, "NVML unavailable: driver_not_loaded")]


def _error_instances() -> list[BaseException]:
    return [cls() for cls in ERRORS] + [pynvml.NVMLLibraryMismatchError("Unversioned function called")]


CHECKED_QUERIES = {  # the query a check reads -> the check it feeds
    "nvmlDeviceGetRemappedRows": "row_remap", "nvmlDeviceGetFieldValues": "recovery_action",
    "nvmlDeviceGetGpuFabricInfoV": "fabric", "nvmlDeviceGetEccMode": "ecc_mode",
    "nvmlDeviceGetTemperatureV": "temperature",
}
CORE = ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo", "nvmlDeviceGetName")


@pytest.mark.parametrize("query", ["nvmlDeviceGetCount", *CORE, *CHECKED_QUERIES])
def test_every_nvml_error_in_every_query_gives_a_verdict(query: str) -> None:
    """NVML gone or no GPU count: cannot check (2). GPU down: fails (1). A checked feature refused:
    its check fails closed, unless the GPU does not offer it (not applicable), and the deprecated
    temperature query stands in for a TemperatureV the driver does not offer."""
    for error in _error_instances():
        nvml = sim({"gpus": 2, "driver_version": NEW_DRIVER})
        nvml.inject[query] = error
        code, checks = run(nvml)  # a traceback would fail the test here
        name, label = type(error).__name__, error_label(error)
        if name in NVML_DOWN or query == "nvmlDeviceGetCount":
            assert code == CANNOT, (query, name)
            assert checks["nvml"].detail == f"NVML unavailable: {label}", (query, name)
        elif name in GPU_DOWN or query in CORE:
            assert code == FAILED, (query, name)
            assert checks["gpus_visible"].detail == f"0 of 2 GPUs answer NVML; gpu 0 {label}; gpu 1 {label}"
        elif query == "nvmlDeviceGetTemperatureV" and reaction(pynvml, error) is Reaction.ABSENT:
            assert (code, checks["temperature"].ok) == (PASSED, True), (query, name)
        else:
            check = checks[CHECKED_QUERIES[query]]
            expected = (PASSED, None) if label in UNCOUNTED else (FAILED, False)
            assert (code, check.ok) == expected, (query, name)
            if check.ok is False:
                assert check.detail == f"gpu 0 could not be read ({label}); gpu 1 could not be read ({label})"


def test_every_nvml_error_during_initialisation_cannot_check() -> None:
    for error in _error_instances():
        nvml = sim({"gpus": 1})
        nvml.nvmlInit = lambda error=error: (_ for _ in ()).throw(error)
        code, checks = run(nvml)
        assert code == CANNOT, type(error).__name__
        assert checks["nvml"].detail == f"NVML unavailable: {error_label(error)}"


# the command line


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any], str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out else {}), err


def test_cli_prints_one_json_verdict_and_exits_by_it(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    code, verdict, err = cli(capsys, "--backend", "sim")
    assert code == 0 and verdict["ok"] is True and verdict["exit_code"] == 0, err
    assert verdict["failed"] == []
    assert {check["name"]: check["ok"] for check in verdict["checks"]}["xid"] is True  # the sim's own log
    assert set(verdict) == {"schema_version", "ok", "exit_code", "node", "backend", "version", "started_at",
                            "duration_seconds", "failed", "checks"}
    assert all(set(check) == {"name", "ok", "detail", "value"} for check in verdict["checks"])
    scenario = tmp_path / "faults.yml"
    scenario.write_text(yaml.safe_dump({"faults": [{"kind": "hbm_degradation", "gpu": 6, "precursor": 0}]}))
    code, verdict, err = cli(capsys, "--backend", "sim", "--scenario", str(scenario),
                             "--site-command", "sh -c 'exit 0'")
    assert code == 1 and verdict["ok"] is False
    assert verdict["failed"] == ["row_remap", "xid"]


def test_cli_without_an_nvidia_driver_cannot_check(capsys: pytest.CaptureFixture[str]) -> None:
    """This machine has no NVIDIA driver: real pynvml fails to initialise, as on a broken node."""
    code, verdict, _ = cli(capsys, "--no-kmsg", "--nvml-timeout", "30")
    assert code == 2
    assert verdict["checks"][0]["name"] == "nvml" and verdict["checks"][0]["ok"] is False
    assert verdict["checks"][0]["detail"] in ("NVML unavailable: library_not_found",
                                              "NVML unavailable: driver_not_loaded")


@pytest.mark.parametrize(("argv", "message"), [
    (["--sim-scenario", "x.yml"], "--sim-scenario, --sim-profile and --sim-mig need --backend sim"),
    (["--backend", "sim", "--no-kmsg", "--kmsg-path", "/dev/kmsg"], "contradict each other"),
    (["--backend", "sim", "--dcgmi", "/bin/true"], "--dcgmi and --dcgm-timeout need --dcgm-level"),
    (["--backend", "sim", "--dcgm-level", "5"], "invalid choice"),
    (["--backend", "sim", "--site-command", "''"], "the site command is empty"),
    (["--backend", "sim", "--site-command", "'unclosed"], "cannot split"),
    (["--backend", "sim", "--site-timeout", "0"], "expected a positive number"),
    (["--backend", "sim", "--gpus-expected", "2.5"], "expected a whole number"),
    (["--backend", "sim", "--gpus-expected", "65"], "expected a whole number from 0 to 64"),
    (["--backend", "sim", "--gpus-expected", "\u0661"], "expected a whole number"),
    (["--backend", "sim", "--xid-ignore", "79,x"], "expected XID numbers"),
    (["--backend", "sim", "--nic-ports", "mlx5_0:x"], "expected HCA[:PORT]"),
    (["--backend", "sim", "--nic-ports", "../etc"], "expected HCA[:PORT]"),
    (["--backend", "sim", "--nic-rate-gbps", "-400"], "expected a positive number"),
])
def test_cli_usage_errors_exit_2_with_a_message(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert message in err and "Traceback" not in err


def test_cli_bad_scenario_lists_every_problem(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    scenario = tmp_path / "bad.yml"
    scenario.write_text(yaml.safe_dump({"gpus": 0, "faults": [{"kind": "meteor", "gpu": 1}]}))
    code, verdict, err = cli(capsys, "--backend", "sim", "--sim-scenario", str(scenario))
    assert code == 2 and verdict == {}
    assert len(err.strip().splitlines()) == 2 and err.count(f"gpuhealth-validate: {scenario}: ") == 2


def test_console_script_help_and_a_verdict_in_a_fresh_process() -> None:
    script = Path(sys.executable).parent / "gpuhealth-validate"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "gpuhealth.exporter.validate"]
    help_text = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=60,
                               check=True).stdout
    for words in ("Exit status: 0", "--dcgm-level", "--site-command", "--xid-since", "--scenario"):
        assert words in help_text
    result = subprocess.run([*argv, "--backend", "sim", "--gpus-expected", "9"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "error"})
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["failed"] == ["gpus_visible"]
    assert "level=WARNING" in result.stderr
    assert "check failed name=gpus_visible detail=8 of 9 GPUs answer NVML" in result.stderr


def test_a_site_command_whose_daemon_holds_its_output_still_gives_its_verdict(tmp_path: Path) -> None:
    """The verdict waited for the output to close: a helper started in a session of its own (outside
    the group killed at the deadline) held it, and the command that had passed was reported killed."""
    pid = tmp_path / "pid"
    script = f"setsid sh -c 'echo $$ > {pid}; exec sleep 600' & echo started; exit 0"
    try:
        code, checks = run(sim({"gpus": 1}), site_command=("sh", "-c", script), site_timeout=120.0)
        site = checks["site_command"]
        assert (code, site.ok, site.value["exit_code"]) == (PASSED, True, 0)
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid.read_text()), signal.SIGKILL)


def test_a_site_command_printing_without_end_keeps_a_bounded_clean_tail(tmp_path: Path) -> None:
    """Its whole output was held in memory, and its last line (terminal escapes included) was logged."""
    script = "head -c 50000000 /dev/zero | tr '\\0' x; printf '\\n\\033]0;owned\\007bad\\n'; exit 4"
    outcome = run_command(["sh", "-c", script], 120.0)
    assert outcome.exit_code == 4 and len(outcome.output) <= OUTPUT_KEPT_BYTES
    assert outcome.tail == "\\x1b]0;owned\\x07bad"
