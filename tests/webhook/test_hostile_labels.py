"""Hostile alert values: nothing outside its grammar is journaled as actionable or reaches a backend argv,
not even through a remote shell behind ``ssh``; free text reaches reasons and logs cleaned."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpuhealth.contract.gpu import GPU
from gpuhealth.webhook.backends import create_backend
from gpuhealth.webhook.backends.base import BackendError
from gpuhealth.webhook.backends.command import CommandBackend, alert_fields, check_gpu
from gpuhealth.webhook.config import ACTIONS
from gpuhealth.webhook.labels import ALERT_NAME, clean_text, label_problem, valid_node
from gpuhealth.webhook.main import LOG_FORMAT, OneLineFormatter
from gpuhealth.webhook.policy import drain_reason
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from webhook_helpers import NODES, alert

# What an attacker or a careless rule would put in a label.
GPU_ATTACKS = ["0; touch PWNED", "$(touch PWNED)", "`touch PWNED`", "0\ntouch PWNED", "0 && touch PWNED",
               "0|touch PWNED", "0,1,2,3", "all", "--all", "-h", "0 -r", " 0", "0\x00", "\uff10", "٣", "0'",
               "GPU-12345678-1234-1234-1234-123456789abc; touch PWNED", "1" * 5000, "gpu0", ""]
NODE_ATTACKS = ["ALL", "all", "gpu[01-64]", "gpu01,gpu02", "-h", "--all", "gpu01\nevent=forged", "gpu01 x",
                "gpu01;id", "\uff47\uff50\uff5501", "gpu01\x00", "$(id)", "a" * 300]
ALERTNAME_ATTACKS = ["X; touch PWNED", "$(touch PWNED)", "-h", "A B", "A\nB", "A\x1b[2J", "Ä", "1abc"]

# OpenSSH joins the words after the host with single spaces and the remote shell parses the line.
SSH_STANDIN = """\
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-") and args[0] != "--":
    args = args[2:] if args[0] in ("-p", "-l", "-i", "-o", "-F", "-J") else args[1:]
if args and args[0] == "--":
    args = args[1:]
host, line = args[0], " ".join(args[1:])
with open(os.environ["SSH_LOG"], "a") as log:
    log.write(host + "\\n")
sys.exit(subprocess.run(["sh", "-c", line], cwd=os.environ["REMOTE_HOME"]).returncode)
"""
REMOTE_TOOL = """\
import json, os, sys
with open(os.environ["REMOTE_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
"""
SAFE_TEMPLATES = {  # as webhook/SLURM.md documents them for remote execution
    "reset_gpu": ["ssh", "--", "{node}", "nvidia-smi", "-r", "-i", "{gpu}"],
    "reboot": ["ssh", "--", "{node}", "site-reboot", "--alert", "{alertname}", "--", "{reason!q}"],
}


class Remote:
    """A stand-in ``ssh`` on PATH, a remote home, and the argv every remote tool received."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.home = root / "remote-home"
        self.bin.mkdir()
        self.home.mkdir()
        self._script("ssh", SSH_STANDIN)
        for tool in ("nvidia-smi", "site-reboot", "touch", "id"):  # remote "touch" logs, never creates
            self._script(tool, REMOTE_TOOL)
        self.env = {"PATH": f"{self.bin}:{os.environ['PATH']}", "SSH_LOG": str(root / "ssh.log"),
                    "REMOTE_LOG": str(root / "remote.log"), "REMOTE_HOME": str(self.home)}

    def _script(self, name: str, body: str) -> None:
        path = self.bin / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)

    def calls(self) -> list[list[str]]:
        path = self.root / "remote.log"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def backend(self, commands: dict[str, list[str]]) -> CommandBackend:
        return CommandBackend.from_config({"commands": {"node_state": ["false"], **commands}, "fleet_size": 4,
                                           "timeout_seconds": 20, "env": self.env})


@pytest.fixture
def remote(tmp_path: Path) -> Remote:
    return Remote(tmp_path)


def test_the_ssh_standin_really_lets_the_remote_shell_parse_a_verbatim_argument(remote):
    """The stand-in is only proof if a naive template is exploitable through it."""
    env = {**os.environ, **remote.env}
    subprocess.run(["ssh", "gpu01", "nvidia-smi", "-i", "0; touch PWNED"], env=env, check=True)
    assert remote.calls() == [["-i", "0"], ["PWNED"]]


@pytest.mark.parametrize("gpu", GPU_ATTACKS)
def test_hostile_gpu_labels_are_refused(gpu):
    problem = label_problem("gpu01", gpu, "GPUHealthXid")
    if gpu == "":
        assert problem is None  # no gpu label: the whole node
        return
    assert problem is not None and problem[0] == "invalid_label"
    assert "\n" not in problem[1] and "\x00" not in problem[1] and len(problem[1]) < 200
    with pytest.raises(BackendError, match="neither a GPU index nor a GPU-<uuid>"):
        check_gpu(gpu)


@pytest.mark.parametrize("node", NODE_ATTACKS)
def test_hostile_node_labels_are_refused(node):
    problem = label_problem(node, "0", "GPUHealthXid")
    assert problem is not None and problem[0] == "invalid_node"
    assert "\n" not in problem[1] and "\x00" not in problem[1]


@pytest.mark.parametrize("name", ALERTNAME_ATTACKS)
def test_hostile_alert_names_are_refused(name):
    problem = label_problem("gpu01", "0", name)
    assert problem is not None and problem[0] == "invalid_label"


async def test_documented_remote_templates_run_exactly_the_tool_asked_for(remote):
    backend = remote.backend(SAFE_TEMPLATES)
    uuid = "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789"
    reason = drain_reason("GPUHealthXidFatal", "XID 79 $(touch PWNED); `id` && rm -rf / 'quoted' \"x\"")
    await backend.reset_gpu("gpu01", "3", reason, alertname="GPUHealthXidFatal")
    await backend.reset_gpu("gpu02", uuid, reason, alertname="GPUHealthXidFatal")
    await backend.reboot("gpu03", reason, alertname="GPUHealthXidFatal")
    assert remote.calls() == [["-r", "-i", "3"], ["-r", "-i", uuid],
                              ["--alert", "GPUHealthXidFatal", "--", reason]]
    assert list(remote.home.iterdir()) == []


_text = st.text(st.characters(codec="utf-8"), max_size=40)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gpu=st.one_of(_text, st.from_regex(GPU, fullmatch=True), st.sampled_from(GPU_ATTACKS)),
       name=st.one_of(_text, st.from_regex(ALERT_NAME, fullmatch=True), st.sampled_from(ALERTNAME_ATTACKS)),
       summary=_text)
def test_fuzzed_values_reach_a_remote_shell_only_as_the_arguments_they_are(tmp_path_factory, gpu, name,
                                                                             summary):
    """The rule: a value outside its grammar never reaches an argv; one inside reaches the remote tool
    as exactly one argument, whatever the remote shell makes of the joined line."""
    remote = Remote(tmp_path_factory.mktemp("remote"))
    backend = remote.backend(SAFE_TEMPLATES)
    problem = label_problem("gpu01", gpu, name)
    reason = drain_reason(name, summary)
    if problem is not None:  # a value the engine refused: the backend refuses it on its own too
        with pytest.raises(BackendError):
            alert_fields("gpu01", reason, gpu, alertname=name)
        return
    asyncio.run(backend.reset_gpu("gpu01", gpu, reason, alertname=name))
    asyncio.run(backend.reboot("gpu01", reason, alertname=name))
    fields = alert_fields("gpu01", reason, gpu, alertname=name)
    assert fields["alertname"] == (name or "alert")
    assert remote.calls() == [["-r", "-i", gpu] if gpu else ["-r", "-i"],
                              ["--alert", fields["alertname"], "--", fields["reason"]]]
    assert list(remote.home.iterdir()) == []


def test_free_text_is_cleaned_of_controls_escapes_and_nul():
    text = "XID 79\x00 on \x1b[31mGPU 0\x1b[0m\x1b]0;title\x07 line\nforged=1\r\x9b2J \u202eevil\u2028x\ud800"
    cleaned = clean_text(text)
    assert cleaned == "XID 79 on GPU 0 line forged=1 evil x"
    assert drain_reason("A", "\x00\x1b[2J") == "gpuhealth: A"


async def test_hostile_labels_through_the_app_are_skipped_at_intake_and_logged_quoted(webhook, caplog):
    hook = await webhook()
    alerts = [alert("gpu01", action="drain_reset_gpu", gpu=g) for g in GPU_ATTACKS if g] + \
             [alert(n, action="drain", gpu="0") for n in NODE_ATTACKS] + \
             [alert("gpu02", action="drain_reboot", alertname=a) for a in ALERTNAME_ATTACKS]
    with caplog.at_level(logging.INFO, logger="gpuhealth.webhook"):
        body = await hook.post(*alerts)
        actions = await hook.settle()
    assert body["new_actions"] == []  # nothing was queued
    assert {(a["state"], a["reason"]) for a in actions} == {("skipped", "invalid_label"),
                                                             ("skipped", "invalid_node")}
    assert len(actions) == len(alerts)
    assert hook.backend.history == [] and hook.drained == {}
    assert await hook.metric("gpuhealth_webhook_actions_total", action="drain_reset_gpu", outcome="skipped",
                             reason="invalid_label") == len(GPU_ATTACKS) - 1
    for action in actions:
        for key in ("node", "gpu", "alertname", "detail"):
            assert action[key].isascii() and action[key].isprintable(), action
    for record in caplog.records:
        message = record.getMessage()
        assert "\n" not in message and "\x00" not in message and "\x1b" not in message, message
        assert "event=forged" not in message.replace("\\nevent=forged", "")


async def test_a_nul_or_escape_in_the_summary_still_drains_with_a_clean_reason(webhook):
    hook = await webhook()
    await hook.post(alert("gpu04", action="drain", summary="XID 79\x00 \x1b[2J\x1b[31mfell off\nthe bus"))
    [action] = await hook.settle()
    assert (action["state"], action["reason"]) == ("done", "ok")
    assert hook.drained == {"gpu04": "gpuhealth: GPUHealthXidFatal: XID 79 fell off the bus"}


async def test_fuzzed_alerts_through_the_app_never_give_a_backend_an_invalid_value(webhook):
    """The rule end to end: whatever the labels, every value a backend receives is in its grammar."""
    hook = await webhook()
    alerts: list[dict] = []

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(node=st.one_of(st.sampled_from(NODES), st.sampled_from(NODE_ATTACKS), _text),
           gpu=st.one_of(st.none(), st.from_regex(GPU, fullmatch=True), st.sampled_from(GPU_ATTACKS),
                         _text),
           name=st.one_of(st.from_regex(ALERT_NAME, fullmatch=True), st.sampled_from(ALERTNAME_ATTACKS),
                          _text),
           summary=_text, action=st.sampled_from(ACTIONS))
    def draw(node, gpu, name, summary, action):  # hypothesis drives a sync function; sent afterwards
        alerts.append(alert(node, gpu=gpu, alertname=name, summary=summary, action=action))

    draw()
    # alongside the fuzzed ones, valid alerts of every action, so the backend surely acts
    alerts += [alert(NODES[-1 - i], gpu="1", alertname="GPUHealthXid", action=action)
               for i, action in enumerate(ACTIONS[1:])]
    for start in range(0, len(alerts), 10):
        await hook.post(*alerts[start:start + 10])
    await hook.settle(timeout=30)
    assert hook.backend.history, "the fuzzing never reached the backend: it proves nothing"
    for op, *args in hook.backend.history:
        if op == "requeue":
            continue  # job ids come from the cluster, not from alerts
        node, rest = args[0], args[1:]
        assert valid_node(node), (op, args)
        if op == "reset_gpu":
            gpu, rest = rest[0], rest[1:]
            assert gpu is None or GPU.fullmatch(gpu), (op, args)
        for reason in rest:
            assert reason == clean_text(reason) and reason.isprintable(), (op, args)


@pytest.mark.parametrize("section", [
    {"type": "command", "fleet_size": 4,
     "commands": {"node_state": ["false"], "drain": ["ssh", "--", "{node}", "site-drain", "{reason}"]}},
    {"type": "command", "fleet_size": 4,
     "commands": {"node_state": ["false"],
                  "reboot": ["sudo", "/bin/sh", "-c", "site-reboot {node} {reason}"]}},
    {"type": "slurm",
     "reset_gpu_command": ["ssh", "{node}", "nvidia-smi", "-r", "-i", "{gpu}", "--why={reason}"]},
    {"type": "kubernetes", "node_actions": "command",
     "node_commands": {"reboot": ["/usr/bin/pdsh", "-w", "{node}", "site-reboot", "{reason}"]}},
    *[{"type": "command", "fleet_size": 4, "commands": {"node_state": ["false"], "drain": template}}
      for template in (["/bin/tcsh", "-c", "site-drain {node} {reason}"],
                       ["csh", "-c", "site-drain {node} {reason}"],
                       ["fish", "-c", "site-drain {node} {reason}"],
                       ["su", "slurm", "-c", "site-drain {node} {reason}"],
                       ["runuser", "-u", "slurm", "--", "sh", "-c", "site-drain {reason}"],
                       ["flock", "/run/lock/drain", "-c", "site-drain {node} {reason}"],
                       ["/usr/bin/env", "-S", "sh -c 'site-drain {node} {reason}'"],
                       ["dbclient", "{node}", "site-drain", "{reason}"])],
])
def test_a_template_that_hands_unquoted_free_text_to_a_shell_is_refused_at_start(section):
    """A careless site template: ``ssh`` (or ``sh -c``) would let the remote shell parse the summary."""
    shell = r"\{reason\} is free text and .* hands it to a shell: write \{reason!q\}"
    with pytest.raises(ValueError, match=shell):
        create_backend(section)


@pytest.mark.parametrize("template", [
    ["sh", "-c", "logger 'gpuhealth {reason!q}'"],
    ["sh", "-c", 'logger "{reason!q}"'],
    ["ssh", "{node}", "logger", "'gpuhealth", "{reason!q}'"],
    ["/usr/bin/env", "-S", "sh -c 'site-drain {node} {reason!q}'"],
])
def test_a_quoted_value_inside_the_templates_own_quotes_is_refused_at_start(template):
    """shlex's quotes inside the template's would end them: ``'a '$(id)''`` leaves the value bare."""
    section = {"type": "command", "fleet_size": 4, "commands": {"node_state": ["false"], "drain": template}}
    with pytest.raises(ValueError, match=r"\{reason!q\} stands inside the template's own"):
        create_backend(section)


async def test_the_quoted_form_of_the_same_template_passes_free_text_as_one_argument(remote):
    backend = remote.backend({"drain": ["ssh", "--", "{node}", "site-reboot", "--", "{reason!q}"]})
    reason = drain_reason("GPUHealthXidFatal", "$(touch PWNED); `id` 'x' \"y\" \\ * ~ #")
    await backend.drain("gpu01", reason)
    assert remote.calls() == [["--", reason]]
    assert list(remote.home.iterdir()) == []


def test_no_logged_value_or_exception_text_can_forge_a_line_or_send_a_terminal_escape():
    """Values logged with %s and exception text (a backend's stderr, a library's message) reached the
    log as they were: a newline started a line that looked like the webhook's own."""
    forged = ("gpu01\nts=2026-01-01 level=INFO logger=gpuhealth.webhook.engine event=action_done "
              "\x1b]0;x\x07\x1b[2J")
    formatter = OneLineFormatter(LOG_FORMAT)
    record = logging.LogRecord("gpuhealth.webhook.engine", logging.ERROR, __file__, 1, "event=x node=%s",
                               (forged,), None)
    try:
        raise BackendError(f"scontrol: exit 1: {forged}")
    except BackendError:
        record.exc_info = sys.exc_info()
    text = formatter.format(record)
    lines = text.split("\n")
    assert lines[0].startswith("ts=") and "event=x node=gpu01\\nts=2026" in lines[0]
    assert all(line.startswith("  ") for line in lines[1:]), lines
    assert "\x1b" not in text and "\x07" not in text and "\\x1b]0;x\\x07" in text
