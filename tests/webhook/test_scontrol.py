"""The one parser of what scontrol prints, as both the Slurm backend and the local test cluster read it."""

from __future__ import annotations

from gpuhealth.webhook.backends.scontrol import job_fields, parse_node_line

LINE = ("NodeName=gpu01 Arch=x86_64 CoresPerSocket=1 State=IDLE+DRAIN ThreadsPerCore=1 "
        "Reason=gpuhealth: GPUHealthXidFatal: XID 79 [slurm@2026-12-01T10:00:00] Comment=see [a@b] Extra=x")


def test_a_node_reason_as_set_and_as_printed():
    parsed = parse_node_line(LINE)
    assert parsed.state == "IDLE+DRAIN" and parsed.flags == {"IDLE", "DRAIN"}
    assert parsed.reason == "gpuhealth: GPUHealthXidFatal: XID 79"
    assert parsed.printed_reason == "gpuhealth: GPUHealthXidFatal: XID 79 [slurm@2026-12-01T10:00:00]"


def test_a_node_without_reason_or_state():
    parsed = parse_node_line("NodeName=gpu02 Arch=x86_64")
    assert (parsed.state, parsed.flags, parsed.reason, parsed.printed_reason) == ("", set(), "", "")


def test_job_fields_are_the_jobs_own_not_look_alikes_printed_later():
    text = ("JobId=7 JobName=train JobState=RUNNING Reason=None ExcNodeList=(null) NodeList=gpu[01-02] "
            "Restarts=1 Comment=JobState=COMPLETED Command=/x Reason=forged")
    assert job_fields(text, ("JobState", "Reason", "ExcNodeList", "NodeList", "Restarts")) == {
        "JobState": "RUNNING", "Reason": "None", "ExcNodeList": "(null)", "NodeList": "gpu[01-02]",
        "Restarts": "1"}
