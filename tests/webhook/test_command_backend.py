"""The command backend runs real programs: argv filled verbatim, fields in the environment, errors kept."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from gpuhealth.webhook.backends import create_backend
from gpuhealth.webhook.backends.base import BackendError, NodeState
from gpuhealth.webhook.backends.command import CommandBackend
from waiting import eventually

RECORDER = """\
import json, os, sys
record = {"argv": sys.argv[1:],
          "env": {k: v for k, v in os.environ.items() if k.startswith(("GPUHEALTH_", "SITE_"))}}
with open(os.environ["SITE_RECORD"], "a") as f:
    f.write(json.dumps(record) + "\\n")
sys.stdout.write(os.environ.get("SITE_STDOUT", ""))
sys.stderr.write(os.environ.get("SITE_STDERR", ""))
sys.exit(int(os.environ.get("SITE_EXIT", "0")))
"""


@pytest.fixture
def recorder(tmp_path):
    script = tmp_path / "record.py"
    script.write_text(RECORDER)
    return script


def make(tmp_path: Path, recorder: Path, commands: dict[str, list[str]], **extra) -> CommandBackend:
    """A backend whose commands record their calls; ``node_state`` (required with node-changing
    commands) defaults to one that is never called here."""
    env = {"SITE_RECORD": str(tmp_path / "calls.jsonl"), **extra.pop("env", {})}
    section = {"commands": {"node_state": ["false"],
                            **{op: [sys.executable, str(recorder), *args] for op, args in commands.items()}},
               "fleet_size": 8, "timeout_seconds": 10, "env": env, **extra}
    return CommandBackend.from_config(section)


def calls(tmp_path: Path) -> list[dict]:
    path = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_placeholders_are_filled_verbatim_never_through_a_shell(tmp_path, recorder):
    backend = make(tmp_path, recorder, {"drain": ["--node={node}", "{reason}"]})
    reason = "gpuhealth: GPUHealthXidResetGpu: XID 79 $(touch pwned); `id` > x && echo {gpu}"
    await backend.drain("gpu07", reason, alertname="GPUHealthXidResetGpu")
    [call] = calls(tmp_path)
    assert call["argv"] == ["--node=gpu07", reason]
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
    assert call["env"]["GPUHEALTH_OPERATION"] == "drain"
    assert call["env"]["GPUHEALTH_NODE"] == "gpu07"
    assert call["env"]["GPUHEALTH_REASON"] == reason
    assert call["env"]["GPUHEALTH_ALERTNAME"] == "GPUHealthXidResetGpu"


async def test_every_operation_passes_its_fields(tmp_path, recorder):
    backend = make(tmp_path, recorder, {
        "resume": ["{node}"], "requeue": ["{job_id}", "{exclude_nodes}"],
        "reset_gpu": ["{node}", "{gpu}"], "reboot": ["{node}", "{alertname}"],
    })
    await backend.resume("gpu01")
    await backend.requeue("4242_3", ["gpu01", "gpu05"])
    await backend.reset_gpu("gpu02", "3", "gpuhealth: GPUHealthGpuFailureRisk: high risk",
                            alertname="GPUHealthGpuFailureRisk")
    await backend.reboot("gpu03", "gpuhealth: GPUHealthGpusMissing: 7 of 8 GPUs",
                         alertname="GPUHealthGpusMissing")
    got = calls(tmp_path)
    assert [c["argv"] for c in got] == [["gpu01"], ["4242_3", "gpu01,gpu05"], ["gpu02", "3"],
                                        ["gpu03", "GPUHealthGpusMissing"]]
    assert got[1]["env"]["GPUHEALTH_JOB_ID"] == "4242_3"
    assert got[1]["env"]["GPUHEALTH_EXCLUDE_NODES"] == "gpu01,gpu05"
    assert got[2]["env"]["GPUHEALTH_GPU"] == "3"
    assert [c["env"]["GPUHEALTH_OPERATION"] for c in got] == ["resume", "requeue", "reset_gpu", "reboot"]


async def test_failure_carries_the_stderr_tail_and_is_retryable(tmp_path, recorder):
    noise = "x" * 5000 + " the last words"
    backend = make(tmp_path, recorder, {"drain": ["{node}"]},
                   env={"SITE_EXIT": "3", "SITE_STDERR": noise})
    with pytest.raises(BackendError) as err:
        await backend.drain("gpu01", "gpuhealth: A: b")
    assert err.value.retryable
    assert "exit 3" in str(err.value) and str(err.value).endswith("the last words")
    assert len(str(err.value)) < 2500


async def test_permanent_exit_codes_are_not_retried(tmp_path, recorder):
    backend = make(tmp_path, recorder, {"resume": ["{node}"]}, env={"SITE_EXIT": "2"},
                   permanent_exit_codes=[2])
    with pytest.raises(BackendError) as err:
        await backend.resume("gpu01")
    assert not err.value.retryable


async def test_timeout_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "hang.py"
    script.write_text(
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen(['sleep', '60'])\nopen({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n")
    backend = CommandBackend.from_config({"commands": {"reboot": [sys.executable, str(script), "{node}"],
                                                       "node_state": ["false"]},
                                          "fleet_size": 4, "timeout_seconds": 1.5})
    started = time.monotonic()
    with pytest.raises(BackendError) as err:
        await backend.reboot("gpu01", "gpuhealth: A: b")
    assert err.value.retryable and "timed out" in str(err.value)
    assert time.monotonic() - started < 10
    child = int(pidfile.read_text())

    async def gone() -> bool:
        return not Path(f"/proc/{child}").exists() or "Z" in _proc_state(child)

    await eventually(gone, timeout=5, what="the command's child to be killed with its group")


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


async def test_missing_program_is_not_retryable(tmp_path):
    backend = CommandBackend.from_config({"commands": {"drain": [str(tmp_path / "nope"), "{node}"],
                                                       "node_state": ["false"]}, "fleet_size": 4})
    with pytest.raises(BackendError) as err:
        await backend.drain("gpu01", "gpuhealth: A: b")
    assert not err.value.retryable and "cannot run" in str(err.value)


async def test_unconfigured_operations(tmp_path, recorder):
    backend = CommandBackend.from_config({"commands": {"requeue": ["true"]}, "fleet_size": 8})
    assert await backend.node_state("gpu01") == NodeState("gpu01", exists=True, drained=False)
    assert await backend.jobs_on_node("gpu01") == []
    assert await backend.fleet_size() == 8
    with pytest.raises(BackendError, match=r"no 'reboot' command configured") as err:
        await backend.reboot("gpu01", "gpuhealth: A: b")
    assert not err.value.retryable
    assert calls(tmp_path) == []


async def test_read_operations_parse_program_output(tmp_path, recorder):
    state = {"exists": True, "drained": True, "reason": "maintenance by ops"}
    backend = make(tmp_path, recorder, {"node_state": ["{node}"], "jobs_on_node": ["{node}"],
                                        "fleet_size": []},
                   env={"SITE_STDOUT": json.dumps(state)})
    assert await backend.node_state("gpu02") == NodeState("gpu02", True, True, "maintenance by ops")
    with pytest.raises(BackendError, match="must print an integer") as err:
        await backend.fleet_size()
    assert not err.value.retryable
    jobs = make(tmp_path, recorder, {"jobs_on_node": ["{node}"], "fleet_size": []},
                env={"SITE_STDOUT": "101\n102_7\n"})
    assert await jobs.jobs_on_node("gpu02") == ["101", "102_7"]
    bad = make(tmp_path, recorder, {"node_state": ["{node}"]}, env={"SITE_STDOUT": "drained"})
    with pytest.raises(BackendError, match="must print JSON"):
        await bad.node_state("gpu02")


async def test_fleet_size_from_a_command(tmp_path, recorder):
    backend = make(tmp_path, recorder, {"fleet_size": []}, env={"SITE_STDOUT": "512\n"})
    assert await backend.fleet_size() == 512


@pytest.mark.parametrize("node", ["gpu[01-04]", "gpu01,gpu02", "ALL", "--all", ""])
async def test_a_label_naming_many_nodes_runs_nothing(tmp_path, recorder, node):
    backend = make(tmp_path, recorder, {op: ["{node}"] for op in ("drain", "resume", "node_state",
                                                                    "jobs_on_node", "reboot")})
    for act in (lambda: backend.drain(node, "gpuhealth: A: b"), lambda: backend.resume(node),
                lambda: backend.node_state(node), lambda: backend.jobs_on_node(node),
                lambda: backend.reboot(node, "gpuhealth: A: b"), lambda: backend.requeue("7", [node])):
        with pytest.raises(BackendError, match="not a single node name") as err:
            await act()
        assert not err.value.retryable
    assert calls(tmp_path) == []


def test_config_lists_every_problem_at_once():
    with pytest.raises(ValueError) as err:
        CommandBackend.from_config({
            "commands": {"drain": ["drain-node", "{node}", "{job_id}"], "explode": ["x"],
                         "resume": "resume {node}", "reboot": ["reboot", "{node"]},
            "timeout_seconds": 0, "colour": "blue", "env": {"A": 1}, "permanent_exit_codes": "2",
        })
    message = str(err.value)
    for expected in ("{job_id}", "explode", "backend.commands.resume: a non-empty list",
                     "backend.commands.reboot: bad placeholder", "timeout_seconds", "backend.colour",
                     "backend.env", "permanent_exit_codes", "set fleet_size"):
        assert expected in message, expected


def test_node_changing_commands_need_node_state():
    """Without node_state an operator's drain is invisible: refused at start, not warned about."""
    for op in ("drain", "resume", "reset_gpu", "reboot"):
        with pytest.raises(ValueError, match=rf"node_state: required with {op}: without it a node an"):
            CommandBackend.from_config({"commands": {op: ["true"]}, "fleet_size": 4})


def test_registry_builds_the_command_backend(tmp_path):
    backend = create_backend({"type": "command", "fleet_size": 3,
                              "commands": {"drain": ["true"], "node_state": ["true"]}})
    assert isinstance(backend, CommandBackend) and backend.name == "command"


async def test_the_environment_is_inherited(tmp_path, recorder, monkeypatch):
    monkeypatch.setenv("SITE_FROM_PARENT", "yes")
    backend = make(tmp_path, recorder, {"resume": ["{node}"]})
    await backend.resume("gpu01")
    assert calls(tmp_path)[0]["env"]["SITE_FROM_PARENT"] == "yes"


@pytest.mark.parametrize("printed", ["123 -rf", "123 $(touch${IFS}pwned)", "123 ;id", "123 `id`", "123 *"])
async def test_a_job_id_that_is_not_one_job_goes_into_no_command(tmp_path, recorder, printed):
    """Job ids come from the site's jobs_on_node output and went unchecked into {job_id} of the
    requeue, signal and state commands (an ssh template hands them to a remote shell)."""
    backend = make(tmp_path, recorder, {op: ["{job_id}"] for op in ("requeue", "signal_job", "job_state")}
                   | {"jobs_on_node": ["{node}"]}, env={"SITE_STDOUT": printed})
    with pytest.raises(BackendError, match="is not one job id") as err:
        await backend.jobs_on_node("gpu01")
    assert not err.value.retryable
    bad = printed.split(" ", 1)[1]
    for act in (lambda: backend.requeue(bad, ["gpu01"]), lambda: backend.signal_job(bad, "USR1", "batch"),
                lambda: backend.job_state(bad)):
        with pytest.raises(BackendError, match="is not one job id"):
            await act()
    assert [c["argv"] for c in calls(tmp_path)] == [["gpu01"]]  # jobs_on_node only
    await backend.requeue("123_4", ["gpu01"])
    assert calls(tmp_path)[-1]["argv"] == ["123_4"]
