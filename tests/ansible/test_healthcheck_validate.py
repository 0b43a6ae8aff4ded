"""The Slurm health check with gpuhealth-validate wired in: rendered from the role's template, run
with the real gpuhealth-validate against the simulator and an scontrol that records what it is asked."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml
from ansible_helpers import COLLECTION
from rendering import role_defaults

NODE = "gpu07"
UNREACHABLE = "file:///nonexistent/metrics"  # no exporter: only the validation speaks


def render(tmp_path: Path, validate_args: list[str], validate: bool = True, scontrol: str = "") -> Path:
    """The installed health check, its venv this test's (where gpuhealth-validate is installed)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(COLLECTION / "roles" / "gpuhealth_exporter" /
                                                            "templates"),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, keep_trailing_newline=True)
    env.filters["comment"] = lambda text: f"# {text}"
    script = tmp_path / "gpuhealth-healthcheck"
    script.write_text(env.get_template("gpuhealth-healthcheck.j2").render({
        **role_defaults("gpuhealth_exporter"), "ansible_managed": "Ansible managed",
        "__gpuhealth_exporter_venv": str(Path(sys.executable).parent.parent),
        "gpuhealth_exporter_slurm_healthcheck_scontrol": scontrol or str(tmp_path / "scontrol"),
        "gpuhealth_exporter_slurm_healthcheck_validate": validate,
        "gpuhealth_exporter_slurm_healthcheck_validate_args": validate_args}))
    script.chmod(0o755)
    return script


def fake_scontrol(tmp_path: Path, state: str) -> Path:
    """Answers ``show node`` with ``state``; records every ``update`` line."""
    calls = tmp_path / "updates"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\nif [ "$1" = show ]; then echo "NodeName={NODE} State={state} '
                        f'CPUTot=1"; else printf "%s|" "$@" >> {calls}; echo >> {calls}; fi\n')
    scontrol.chmod(0o755)
    return calls


def run(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(script), "--node", NODE, "--url", UNREACHABLE], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "error"})


def faults(tmp_path: Path) -> str:
    scenario = tmp_path / "faults.yml"
    scenario.write_text(yaml.safe_dump({"faults": [
        {"kind": "hbm_degradation", "gpu": 2, "precursor": 0, "xid": 64}]}))
    return str(scenario)


def test_a_failed_validation_drains_the_idle_node_with_our_reason(tmp_path: Path) -> None:
    calls = fake_scontrol(tmp_path, "IDLE")
    result = run(render(tmp_path, ["--backend", "sim", "--scenario", faults(tmp_path)]))
    assert result.returncode == 1, result.stderr
    (update,) = calls.read_text().splitlines()
    command, reason = update.rstrip("|").rsplit("|", 1)
    assert command == f"update|NodeName={NODE}|State=DRAIN"
    assert reason.startswith("Reason=gpuhealth-validate: row_remap: gpu 2 row remap failure (replace the "
                             "GPU); xid: gpu 2 XID 63, 64, 154")
    assert len(reason.removeprefix("Reason=")) <= 200
    assert "event=exporter_unreachable" in result.stderr and "Traceback" not in result.stderr


def test_a_passed_validation_drains_nothing(tmp_path: Path) -> None:
    calls = fake_scontrol(tmp_path, "IDLE")
    result = run(render(tmp_path, ["--backend", "sim"]))
    assert (result.returncode, calls.exists()) == (0, False), result.stderr


@pytest.mark.parametrize("state", ["MIXED", "ALLOCATED", "IDLE+DRAIN"])
def test_a_busy_or_drained_node_is_not_validated(tmp_path: Path, state: str) -> None:
    calls = fake_scontrol(tmp_path, state)
    result = run(render(tmp_path, ["--backend", "sim", "--scenario", faults(tmp_path)]))
    assert (result.returncode, calls.exists()) == (0, False), result.stderr


def test_nvml_unavailable_drains_but_a_usage_error_does_not(tmp_path: Path) -> None:
    calls = fake_scontrol(tmp_path, "IDLE")
    result = run(render(tmp_path, ["--no-kmsg"]))  # the real NVML: no driver on this machine
    assert result.returncode == 1, result.stderr
    assert "Reason=gpuhealth-validate: nvml: NVML unavailable: " in calls.read_text()
    calls.unlink()
    result = run(render(tmp_path, ["--dcgm-level", "9"]))
    assert (result.returncode, calls.exists()) == (0, False)
    assert "event=validate_error exit=2" in result.stderr and "invalid choice" in result.stderr


def test_validation_is_off_by_default(tmp_path: Path) -> None:
    calls = fake_scontrol(tmp_path, "IDLE")
    assert role_defaults("gpuhealth_exporter")["gpuhealth_exporter_slurm_healthcheck_validate"] is False
    result = run(render(tmp_path, ["--backend", "sim", "--scenario", faults(tmp_path)], validate=False))
    assert (result.returncode, calls.exists()) == (0, False), result.stderr


@pytest.mark.parametrize(("state", "drains"), [("IDLE", True), ("MIXED+DRAIN", False)])
def test_an_exporter_fault_drains_first_and_validation_is_not_run(tmp_path: Path, state: str,
                                                                  drains: bool) -> None:
    calls = fake_scontrol(tmp_path, state)
    exposition = tmp_path / "metrics"
    exposition.write_text('gpuhealth_gpu_up{gpu="4"} 0.0\n')
    script = render(tmp_path, ["--backend", "sim", "--scenario", faults(tmp_path)])
    result = subprocess.run([str(script), "--node", NODE, "--url", exposition.as_uri()], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    expected = f"update|NodeName={NODE}|State=DRAIN|Reason=gpuhealth-healthcheck: gpu 4 lost|"
    assert (calls.read_text().splitlines() if calls.exists() else []) == ([expected] if drains else [])



def test_the_scontrol_path_is_a_python_string_whatever_it_holds(tmp_path: Path) -> None:
    """The path was pasted between double quotes: a quote in it ended the string and the rest ran as
    Python in every health check."""
    hostile = str(tmp_path / 'sbin" + __import__("os").system("touch pwned") + "\\x')
    tree = ast.parse(render(tmp_path, [], validate=False, scontrol=hostile).read_text())
    [value] = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
               and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["SCONTROL"]]
    assert value == hostile
