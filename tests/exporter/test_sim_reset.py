"""A simulated GPU reset: what ``nvidia-smi -r`` does and does not do, in the simulator and through
``gpuhealth-sim-reset`` against a running exporter's control socket."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pynvml
import pytest
import yaml
from exporter_helpers import FakeClock, value
from gpuhealth.contract.faults import FALLS_OFF_BUS_KINDS, RECOVERY_ACTION_KINDS, RESET_REPAIRS_KINDS
from gpuhealth.exporter import validate
from gpuhealth.exporter.sim import reset_cli
from gpuhealth.exporter.sim.control import ControlServer, Unreachable, reset_gpu
from gpuhealth.exporter.sim.gpu import ResetRefused
from gpuhealth.exporter.sim.nvml import SimulatedNvml
from gpuhealth.exporter.sim.scenario import parse_scenario

from gpuhealth.local.process import ManagedProcess, free_port, http_ok, wait_until

BIN = Path(sys.executable).parent
VOLATILE = (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)
AGGREGATE = (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC)


def sim(scenario: dict, clock: FakeClock, kmsg: Path | None = None) -> SimulatedNvml:
    nvml = SimulatedNvml(parse_scenario(scenario), kmsg, clock=clock)
    nvml.nvmlInit()
    return nvml


def test_reset_applies_the_pending_remap_and_ends_the_memory_fault(clock: FakeClock, tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    nvml = sim({"gpus": 2, "faults": [{"kind": "hbm_degradation", "gpu": 1, "precursor": 10}]}, clock, kmsg)
    handle = nvml.nvmlDeviceGetHandleByIndex(1)
    clock.advance(11)
    corrected, uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
    assert pending == 1 and uncorrected == 1
    assert nvml.nvmlDeviceGetTotalEccErrors(handle, *VOLATILE) > 0
    assert nvml._node.gpus[1].recovery_action == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    aggregate = nvml.nvmlDeviceGetTotalEccErrors(handle, *AGGREGATE)

    assert nvml.reset_gpu("1") == "GPU 00000000:2A:00.0 was successfully reset."
    clock.advance(30)
    # the remap is applied: no longer pending, still counted; volatile counts cleared, aggregate kept
    assert nvml.nvmlDeviceGetRemappedRows(handle) == (corrected, uncorrected, 0, failed)
    assert nvml.nvmlDeviceGetTotalEccErrors(handle, *VOLATILE) == 0
    assert nvml.nvmlDeviceGetTotalEccErrors(handle, *AGGREGATE) == aggregate
    assert nvml._node.gpus[1].recovery_action == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    assert "154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)" in kmsg.read_text()


def _recovery_action(nvml: SimulatedNvml, gpu: int) -> int:
    """The driver's recovery action as NVML reports it (R565+), the field the exporter reads."""
    handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
    (field,) = nvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    assert field.nvmlReturn == pynvml.NVML_SUCCESS
    return int(field.value.ullVal)


@pytest.mark.parametrize("kind", RECOVERY_ACTION_KINDS)
def test_an_uncorrectable_error_makes_the_driver_ask_for_a_reset_until_one_is_done(
        clock: FakeClock, tmp_path: Path, kind: str) -> None:
    kmsg = tmp_path / "kmsg"
    nvml = sim({"gpus": 2, "driver_version": "570.133.20",  # R565+: the field exists
                "faults": [{"kind": kind, "gpu": 1, "precursor": 10}]}, clock, kmsg)
    clock.advance(5)
    assert _recovery_action(nvml, 1) == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    clock.advance(6)
    # NVIDIA: the recovery action flag is set for uncorrectable errors, "Reset" for one nvidia-smi -r
    # recovers; the field says so, and XID 154 announces it
    assert _recovery_action(nvml, 1) == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert "154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)" in kmsg.read_text()
    assert _recovery_action(nvml, 0) == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    nvml.reset_gpu("1")
    assert _recovery_action(nvml, 1) == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    assert "154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)" in kmsg.read_text()


def test_a_reset_in_the_precursor_ends_a_gsp_hang_before_its_hard_failure(clock: FakeClock,
                                                                         tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    nvml = sim({"gpus": 1, "faults": [{"kind": "gsp_timeout", "gpu": 0, "precursor": 60}]}, clock, kmsg)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    clock.advance(50)
    nvml.reset_gpu("0")
    clock.advance(20)  # past the hang's hard failure: the reset reloaded the GSP firmware
    assert not kmsg.exists() or ": 119," not in kmsg.read_text()  # nothing logged: no XID at all
    assert nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) > 0  # not hung


def test_a_reset_applies_the_remaps_but_a_wearing_hbm_goes_on(clock: FakeClock, tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    nvml = sim({"gpus": 1, "faults": [{"kind": "hbm_degradation", "gpu": 0, "precursor": 60}]}, clock, kmsg)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    clock.advance(50)
    nvml.reset_gpu("0")
    assert nvml.nvmlDeviceGetTotalEccErrors(handle, *VOLATILE) == 0
    assert nvml.nvmlDeviceGetRemappedRows(handle)[2] == 0
    clock.advance(20)  # past the hard failure: the stack kept wearing after its bad rows were remapped
    assert nvml.nvmlDeviceGetTotalEccErrors(handle, *VOLATILE) > 0
    assert any(f": {xid}," in kmsg.read_text() for xid in (48, 94, 95))


def test_reset_ends_a_pending_remap_noise_and_retrains_links(clock: FakeClock) -> None:
    nvml = sim({"gpus": 1, "faults": [{"kind": "benign_remap", "gpu": 0, "duration": 100},
                                      {"kind": "nvlink_errors", "gpu": 0, "link": 3, "precursor": 1}]}, clock)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    clock.advance(5)
    assert nvml.nvmlDeviceGetRemappedRows(handle)[2] == 1
    assert nvml.nvmlDeviceGetNvLinkState(handle, 3) == pynvml.NVML_FEATURE_DISABLED
    nvml.reset_gpu(nvml.nvmlDeviceGetUUID(handle))  # by UUID, as an alert's gpu label may name it
    clock.advance(5)
    assert nvml.nvmlDeviceGetRemappedRows(handle)[2] == 0
    assert nvml.nvmlDeviceGetNvLinkState(handle, 3) == pynvml.NVML_FEATURE_ENABLED


@pytest.mark.parametrize("kind", FALLS_OFF_BUS_KINDS)
def test_reset_fails_on_a_gpu_off_the_bus(clock: FakeClock, kind: str) -> None:
    assert kind not in RESET_REPAIRS_KINDS
    nvml = sim({"gpus": 1, "faults": [{"kind": kind, "gpu": 0, "precursor": 1}]}, clock)
    clock.advance(2)
    with pytest.raises(ResetRefused, match="fallen off the bus"):
        nvml.reset_gpu("0")


def test_reset_fails_while_processes_use_the_gpu_and_for_an_unknown_gpu(clock: FakeClock) -> None:
    nvml = sim({"gpus": 2, "processes": [{"pid": 4242, "gpus": [1]}]}, clock)
    with pytest.raises(ResetRefused, match=r"in use by process.*4242"):
        nvml.reset_gpu("1")
    nvml.reset_gpu("0")
    for gpu in ("2", "GPU-00000000-0000-0000-0000-000000000000", "-1"):
        with pytest.raises(ResetRefused, match="no GPU"):
            nvml.reset_gpu(gpu)


def test_the_control_socket_answers_bad_requests_and_is_private(clock: FakeClock, tmp_path: Path) -> None:
    nvml = sim({"gpus": 1}, clock)
    server = ControlServer(tmp_path / "ctl.sock", nvml)
    try:
        assert (tmp_path / "ctl.sock").stat().st_mode & 0o777 == 0o600
        for request in (b"not json\n", b'{"op": "reboot"}\n', b'["reset_gpu"]\n'):
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(tmp_path / "ctl.sock"))
                sock.sendall(request)
                answer = json.loads(sock.makefile("rb").readline())
            assert answer["ok"] is False and answer["error"], request
        assert reset_gpu(tmp_path / "ctl.sock", "0") == (0, "GPU 00000000:18:00.0 was successfully reset.")
    finally:
        server.close()
    assert not (tmp_path / "ctl.sock").exists()
    with pytest.raises(Unreachable, match="cannot reach"):
        reset_gpu(tmp_path / "ctl.sock", "0")


def _ask(path: Path, request: bytes) -> dict:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        sock.sendall(request)
        return json.loads(sock.makefile("rb").readline())


def test_the_control_socket_refuses_hostile_requests(clock: FakeClock, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Deep nesting once killed the handler (no answer, a traceback); an Arabic-Indic digit reset GPU
    3 ("\u0663".isdecimal()); a newline in the GPU forged a log line."""
    nvml = sim({"gpus": 4}, clock)
    server = ControlServer(tmp_path / "ctl.sock", nvml)
    try:
        nested = b"[" * 4000 + b"\n"
        assert _ask(tmp_path / "ctl.sock", nested) == {"ok": False, "error": "the request is not JSON"}
        for gpu in ("\u0663", "3\nevent=sim_gpu_reset gpu=0 ok=true", "0,1", "all", " 1", "-1", "1234"):
            answer = _ask(tmp_path / "ctl.sock", json.dumps({"op": "reset_gpu", "gpu": gpu}).encode() + b"\n")
            assert answer["ok"] is False, gpu
        assert not any("\n" in r.getMessage() for r in caplog.records)
        assert "successfully reset" in reset_gpu(tmp_path / "ctl.sock", "3").detail
    finally:
        server.close()


def _validates(hardware: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The checks gpuhealth-validate fails on the node's hardware, as the demo runs it."""
    code = validate.main(["--backend", "sim", "--sim-scenario", str(hardware)])
    failed = json.loads(capsys.readouterr().out)["failed"]
    assert code == (1 if failed else 0), failed
    return failed


def test_a_reset_recorded_in_the_nodes_hardware_lets_the_node_validate(
        clock: FakeClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's return to service: gpuhealth-validate builds the node's hardware from a scenario file
    (every fault struck), so ``gpuhealth-sim-reset --scenario`` takes out what the reset ended there;
    what it did not end (a wearing HBM stack on another GPU) still fails the check."""
    hardware = tmp_path / "hardware.yml"
    struck = {"gpus": 4, "driver_version": "570.133.20",
              "faults": [{"kind": "sram_uncorrectable", "gpu": 1},
                         {"kind": "benign_remap", "gpu": 1, "duration": 60},
                         {"kind": "hbm_degradation", "gpu": 2, "precursor": 0}]}
    hardware.write_text(yaml.safe_dump(struck))
    nvml = sim(struck, clock)
    server = ControlServer(tmp_path / "ctl.sock", nvml)

    def sim_reset(gpu: str) -> tuple[int, str]:
        code = reset_cli.main(["--control", str(server.path), "-i", gpu, "--scenario", str(hardware)])
        return code, capsys.readouterr().err
    try:
        clock.advance(1)
        assert {"recovery_action", "xid"} <= set(_validates(hardware, capsys))
        uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(1))  # named as an alert may name it
        assert sim_reset(uuid) == (0, "")
        written = yaml.safe_load(hardware.read_text())
        assert written == {**struck, "faults": [struck["faults"][2]]}
        assert {"row_remap", "xid"} <= set(_validates(hardware, capsys))  # the HBM of GPU 2 is still bad
        assert sim_reset("2") == (0, "")
        assert yaml.safe_load(hardware.read_text()) == written, "a reset does not stop HBM wear"
        hardware.write_text(yaml.safe_dump({**struck, "faults": struck["faults"][:2]}))
        assert sim_reset("1") == (0, "")
        assert _validates(hardware, capsys) == []
        hardware.write_text("- not a mapping\n")
        code, err = sim_reset("0")
        assert code == 2 and "the GPU was reset, but" in err and "Traceback" not in err
    finally:
        server.close()


def test_the_control_socket_answers_only_its_own_user_even_if_its_mode_is_loosened(clock: FakeClock,
                                                                                  tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another user")
    shared = Path(tempfile.mkdtemp(prefix="gpuhealth-ctl-"))  # pytest's tmp_path is root's alone
    shared.chmod(0o755)
    server = ControlServer(shared / "ctl.sock", sim({"gpus": 1}, clock))
    try:
        (shared / "ctl.sock").chmod(0o666)  # an operator's chmod, or a umask race: the uid check holds
        client = ("import socket, sys\n"
                  "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
                  "try:\n    s.sendall(b'{\"op\": \"reset_gpu\", \"gpu\": \"0\"}\\n')\n"
                  "except BrokenPipeError:\n    pass  # refused before it was read\n"
                  "print(s.makefile('rb').readline().decode(), end='')\n")
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        done = subprocess.run([*nobody, "/usr/bin/python3", "-c", client, str(shared / "ctl.sock")],
                              capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["ok"] is False and "only the exporter's user" in answer["error"]
    finally:
        server.close()
        shared.rmdir()


def test_the_control_socket_never_replaces_a_file_that_is_not_a_socket(clock: FakeClock,
                                                                       tmp_path: Path) -> None:
    precious = tmp_path / "scenario.yml"
    precious.write_text("gpus: 1\n")
    with pytest.raises(FileExistsError, match="not a socket"):
        ControlServer(precious, sim({"gpus": 1}, clock))
    assert precious.read_text() == "gpus: 1\n"


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _run_reset(control: Path, gpu: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BIN / "gpuhealth-sim-reset", "--control", str(control), "-i", gpu],
                          capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.slow
def test_gpuhealth_sim_reset_against_a_running_exporter(tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.yml"
    scenario.write_text(yaml.safe_dump({"gpus": 4, "faults": [
        {"kind": "hbm_degradation", "gpu": 1, "precursor": 0},
        {"kind": "fell_off_bus", "gpu": 3}]}))
    port, control = free_port(), tmp_path / "sim.sock"
    exporter = ManagedProcess("exporter", [
        BIN / "gpuhealth-exporter", "--backend", "sim", "--sim-scenario", scenario, "--sim-control", control,
        "--kmsg-path", tmp_path / "kmsg", "--listen", f"127.0.0.1:{port}", "--sampling.interval", "0.2",
        "--sampling.window", "3"], tmp_path / "exporter.log").start()
    try:
        exporter.wait_ready(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"))
        pending = "gpuhealth_gpu_remap_pending"
        wait_until(lambda: value(_metrics(port), pending, gpu="1") == 1, timeout=30,
                   what="the pending remap to show")
        done = _run_reset(control, "1")
        assert done.returncode == 0 and "successfully reset" in done.stdout, done
        wait_until(lambda: value(_metrics(port), pending, gpu="1") == 0, timeout=30,
                   what="the remap to be applied")
        # the driver's XID 154 back to "None", read by the exporter's own kernel log follower
        recovery = "gpuhealth_gpu_recovery_action"
        wait_until(lambda: value(_metrics(port), recovery, gpu="1", action="none") == 1, timeout=30,
                   what="the recovery action to be carried out")
        lost = _run_reset(control, "3")
        assert lost.returncode == 1 and "fallen off the bus" in lost.stderr, lost
        assert "Traceback" not in lost.stderr
    finally:
        exporter.stop()
    assert not control.exists()
    gone = _run_reset(control, "1")
    assert gone.returncode == 2 and "--sim-control" in gone.stderr, gone


def test_gpuhealth_sim_reset_help() -> None:
    result = subprocess.run([BIN / "gpuhealth-sim-reset", "--help"], capture_output=True, text=True,
                            check=True)
    assert "--control" in result.stdout and "fell" in result.stdout
