"""The Slurm backend, and the webhook acting through it, on a real slurmctld and four slurmd on loopback."""

from __future__ import annotations

import asyncio
import datetime
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from gpuhealth.webhook.backends import create_backend
from gpuhealth.webhook.backends.base import BackendError, NodeState
from gpuhealth.webhook.backends.slurm import MAX_REASON_CHARS, SlurmBackend, parse_node
from waiting import eventually
from webhook_helpers import alert, recorded, resolved

from gpuhealth.local.process import free_port, wait_until
from gpuhealth.local.slurm import SlurmCluster
from gpuhealth.local.training_job import newest_checkpoint

pytestmark = pytest.mark.slow

REASON = "gpuhealth: GPUHealthXidResetGpu: XID 48 on gpu01 GPU 3: reset the GPU"
# A node returns to IDLE once slurmctld's ping reaches its slurmd; on a loaded 2-core machine (the
# suite's other worker backfilling a fleet) a ping can time out and the node shows NOT_RESPONDING for
# a while: the waits for a node's return poll this long (they end as soon as it is back).
RETURN_SECONDS = 90


@pytest.fixture(scope="module")
def cluster():
    with SlurmCluster(nodes=4, prefix="gpu") as running:
        yield running


@pytest.fixture
def slurm(cluster):
    """A clean cluster for every test: no jobs, every node IDLE with no reason."""
    cluster.reset(timeout=RETURN_SECONDS)
    return cluster


@pytest.fixture
def backend(slurm):
    return SlurmBackend.from_config({"slurm_conf": str(slurm.conf_path), "timeout_seconds": 20})


def show_node(cluster: SlurmCluster, node: str) -> str:
    return cluster.scontrol("show", "node", node, "-o")


def reason_updates(cluster: SlurmCluster, node: str) -> int:
    log = (cluster.workdir / "slurmctld.log").read_text()
    return log.count(f"update_node: node {node} reason set to")


async def test_node_state_of_idle_and_unknown_nodes(backend):
    assert await backend.node_state("gpu01") == NodeState("gpu01", exists=True, drained=False)
    assert await backend.node_state("gpu99") == NodeState("gpu99", exists=False, drained=False)
    assert await backend.fleet_size() == 4


async def test_fleet_size_of_a_partition(slurm):
    assert await SlurmBackend.from_config({"slurm_conf": str(slurm.conf_path),
                                           "partition": "gpu"}).fleet_size() == 4
    with pytest.raises(BackendError) as err:
        await SlurmBackend.from_config({"slurm_conf": str(slurm.conf_path), "partition": "nope"}).fleet_size()
    assert not err.value.retryable


async def test_drain_sets_drain_with_our_reason_once(slurm, backend):
    job = slurm.submit_training_job(nodes=2)
    await backend.drain("gpu01", REASON)
    line = show_node(slurm, "gpu01")
    assert "+DRAIN" in line and f"Reason={REASON} [" in line
    assert slurm.jobs_on("gpu01") == [job], "draining lets the running job finish"
    assert await backend.node_state("gpu01") == NodeState("gpu01", exists=True, drained=True, reason=REASON)
    updates = reason_updates(slurm, "gpu01")
    await backend.drain("gpu01", REASON)
    await backend.drain("gpu01", "gpuhealth: GPUHealthXidRebootNode: a later alert")
    assert reason_updates(slurm, "gpu01") == updates, "draining a drained node is a no-op"
    assert (await backend.node_state("gpu01")).reason == REASON, "the first reason stays"
    slurm.run("sinfo")  # the client still answers after our updates
    assert "drng" in slurm.run("sinfo", "-h", "-n", "gpu01", "-o", "%t")


async def test_a_foreign_drain_is_visible_as_not_ours(slurm, backend):
    slurm.scontrol("update", "NodeName=gpu02", "Comment=rack B7", "Extra=owner=ops team")
    slurm.scontrol("update", "NodeName=gpu02", "State=DRAIN", "Reason=hardware maintenance, ticket 123")
    state = await backend.node_state("gpu02")
    assert state.drained and state.reason == "hardware maintenance, ticket 123"
    assert not state.reason.startswith("gpuhealth:")
    await backend.drain("gpu02", REASON)  # the engine would not ask; if it did, nothing changes
    assert (await backend.node_state("gpu02")).reason == "hardware maintenance, ticket 123"


@pytest.mark.parametrize(("tail", "reason"), [
    (" Reason=gpuhealth: A: b [root@2026-11-30T05:56:21]", "gpuhealth: A: b"),
    (" Reason=gpuhealth: A: b [root@2026-11-30T05:56:21] Comment=rack B7 Extra=x=y z", "gpuhealth: A: b"),
    (" Reason=Not responding [slurm@2026-11-30T05:56:21] Extra=1", "Not responding"),
    (" Reason=set in slurm.conf", "set in slurm.conf"),
    (" Comment=rack B7", ""),
])
def test_reason_parsing(tail, reason):
    line = "NodeName=gpu01 OS=Linux 6.1 #1 SMP @0  State=IDLE+DRAIN ThreadsPerCore=1" + tail
    assert parse_node("gpu01", line) == NodeState("gpu01", exists=True, drained=True, reason=reason)


async def test_long_reasons_become_one_bounded_line(slurm, backend):
    reason = "gpuhealth: GPUHealthGpuFailureRisk: " + "very\nlong  summary " * 40
    await backend.drain("gpu03", reason)
    stored = (await backend.node_state("gpu03")).reason
    assert len(stored) == MAX_REASON_CHARS and stored.endswith("...") and "\n" not in stored
    assert stored.startswith("gpuhealth: GPUHealthGpuFailureRisk: very long summary very")


async def test_resume_only_acts_on_a_drained_node(slurm, backend):
    await backend.drain("gpu04", REASON)
    await backend.resume("gpu04")
    assert "Reason=" not in show_node(slurm, "gpu04")
    slurm.wait_node("gpu04", lambda n: n.state == "IDLE", RETURN_SECONDS,
                    what="gpu04 to answer its first ping")
    await backend.resume("gpu04")  # already in service: nothing to do, no error
    with pytest.raises(BackendError) as err:
        await backend.resume("gpu99")
    assert not err.value.retryable


async def test_jobs_on_node_lists_running_jobs(slurm, backend):
    job = slurm.submit_training_job(nodes=2)
    nodes = slurm.job(job).nodes
    idle = next(n for n in slurm.node_names if n not in nodes)
    assert await backend.jobs_on_node(nodes[0]) == [job]
    assert await backend.jobs_on_node(nodes[1]) == [job]
    assert await backend.jobs_on_node(idle) == []
    assert slurm.squeue("-h", "-w", nodes[0], "-o", "%i").split() == [job]


async def test_requeue_moves_a_two_node_job_off_the_excluded_node(slurm, backend):
    job = slurm.sbatch("--requeue", "--nodes=2", "--exclude=gpu04", "--comment=x JobState=PENDING Reason=y",
                       "--wrap", "sleep 600")
    info = slurm.wait_job(job, lambda j: j.state == "RUNNING")
    bad = info.nodes[0]
    await backend.drain(bad, REASON)
    await backend.requeue(job, [bad])
    info = slurm.job(job)
    assert info.restarts == 1
    assert set(info.excluded) == {bad, "gpu04"}, "our exclusion is merged with the job's own"
    # no wait for Slurm's two-minute requeue delay: the job may start at once (within wait_job's 30 s)
    info = slurm.wait_job(job, lambda j: j.state == "RUNNING", what="the requeued job to run again at once")
    assert len(info.nodes) == 2 and bad not in info.nodes and "gpu04" not in info.nodes
    assert slurm.squeue("-h", "-w", bad, "-o", "%i").split() == []


async def test_a_requeued_job_starts_again_on_the_healthy_node_of_its_allocation(slurm, backend, tmp_path):
    """Only two nodes are left to it, one of them its old one, whose slurmd revoked the job's credential
    when it was killed for the requeue: launched in that same second, the batch job would fail ("Job
    credential revoked"), so its script must really run a second time."""
    starts = tmp_path / "starts"
    job = slurm.sbatch("--requeue", "--nodes=2", "--exclude=gpu04", "--wrap",
                       f"echo start >> {starts}; exec sleep 600")
    info = slurm.wait_job(job, lambda j: j.state == "RUNNING")
    bad = info.nodes[1]  # its batch host stays healthy, and is where the batch script starts again
    wait_until(lambda: starts.exists() and starts.read_text().count("start") == 1, 10, interval=0.1,
               what="the first run's script")
    await backend.drain(bad, REASON)
    # at the start of a second, so that the kill, the end of the old allocation and (without the
    # margin) the new launch all fall within it, as they do when the webhook acts on a quiet cluster
    wait_until(lambda: time.time() % 1 < 0.05, 2, interval=0.005, what="a new second")
    await backend.requeue(job, [bad])
    wait_until(lambda: starts.read_text().count("start") == 2 or slurm.job(job).state == "FAILED", 30,
               interval=0.1, what="the second run's script, or the job's failure")
    info = slurm.job(job)
    assert (info.state, info.restarts) == ("RUNNING", 1), info
    assert sorted(info.nodes) == sorted({"gpu01", "gpu02", "gpu03"} - {bad})
    # whether the scheduler would have run within that second is up to it; the margin is ours to keep
    log = (slurm.workdir / "slurmctld.log").read_text()
    ended = _logged_at(log, rf"Requeuing JobId={job}\b")
    eligible = _logged_at(log, rf"setting begin to \S+ for JobId={job}\b")
    assert eligible - ended >= 2.0, (ended, eligible)


def _logged_at(log: str, pattern: str) -> float:
    """When slurmctld last logged a line matching ``pattern``, from its ``[ISO time.ms]`` prefix."""
    stamps = [m[1] for line in log.splitlines() if re.search(pattern, line)
              and (m := re.match(r"\[(\S+)\]", line))]
    assert stamps, pattern
    return datetime.datetime.fromisoformat(stamps[-1]).timestamp()


async def test_requeue_completes_after_a_crash_between_its_steps(slurm, backend):
    job = slurm.submit_training_job(nodes=2)
    bad = slurm.job(job).nodes[1]
    slurm.scontrol("requeuehold", job)  # the first step ran, then the webhook died
    await backend.requeue(job, [bad])
    info = slurm.job(job)
    assert info.restarts == 1 and bad in info.excluded
    assert info.reason != "job_requeued_in_held_state", "the job was released"
    info = slurm.wait_job(job, lambda j: j.state == "RUNNING", what="the requeued job to run again")
    assert bad not in info.nodes


async def test_a_failed_job_is_requeued_a_completed_one_is_not(slurm, backend):
    failed = slurm.sbatch("--requeue", "--nodes=1", "--nodelist=gpu02", "--wrap", "exit 3")
    done = slurm.sbatch("--requeue", "--nodes=1", "--nodelist=gpu03", "--wrap", "true")
    slurm.wait_job(failed, lambda j: j.state == "FAILED")
    slurm.wait_job(done, lambda j: j.state == "COMPLETED")
    await backend.requeue(failed, ["gpu01"])
    await backend.requeue(done, ["gpu01"])
    info = slurm.job(failed)  # eligible at once: it may be running (and failing) again already
    assert info.restarts == 1 and info.excluded == ["gpu01"]
    info = slurm.job(done)
    assert info.state == "COMPLETED" and info.restarts == 0 and info.excluded == []


async def test_requeue_of_an_unknown_job_is_permanent(backend):
    with pytest.raises(BackendError) as err:
        await backend.requeue("999999", ["gpu01"])
    assert not err.value.retryable and "Invalid job id" in str(err.value)


async def test_reboot_is_requested_and_the_node_stays_out_until_resumed(slurm, backend):
    reason = "gpuhealth: GPUHealthGpusMissing: 7 of 8 GPUs visible"
    before = slurm.reboot_requests().count("gpu03")
    await backend.reboot("gpu03", reason)
    info = slurm.wait_node("gpu03", lambda n: "REBOOT_ISSUED" in n.flags, what="the reboot to be issued")
    line = show_node(slurm, "gpu03")
    assert "NextState=DOWN" in line and f"Reason={reason}" in line and "DRAIN" in info.flags
    await backend.reboot("gpu03", reason)  # already rebooting: not asked twice
    slurm.complete_reboot("gpu03")
    assert slurm.reboot_requests().count("gpu03") == before + 1, "one reboot, though asked twice"
    state = await backend.node_state("gpu03")
    assert state.drained and state.reason.startswith(reason), "down after the reboot, our reason kept"
    await backend.resume("gpu03")
    slurm.wait_node("gpu03", lambda n: n.state == "IDLE", RETURN_SECONDS, what="gpu03 back in service")
    assert await backend.node_state("gpu03") == NodeState("gpu03", exists=True, drained=False)


async def test_no_reboot_where_return_to_service_would_skip_the_validation(slurm, tmp_path):
    """ReturnToService=2 resumes any DOWN node when its slurmd registers: the reboot is refused, the
    node stays drained. The controller's answer is rewritten by a wrapper, as the test cluster runs 1."""
    wrapper = tmp_path / "scontrol"
    wrapper.write_text('#!/bin/sh\nif [ "$1 $2" = "show config" ]; then echo "ReturnToService         = 2"; '
                       'exit 0; fi\nexec scontrol "$@"\n')
    wrapper.chmod(0o755)
    backend = SlurmBackend.from_config({"slurm_conf": str(slurm.conf_path), "scontrol": str(wrapper)})
    before = slurm.reboot_requests().count("gpu02")
    await backend.drain("gpu02", REASON)
    with pytest.raises(BackendError, match="ReturnToService=2") as err:
        await backend.reboot("gpu02", REASON)
    assert not err.value.retryable
    assert not {"REBOOT_REQUESTED", "REBOOT_ISSUED"} & slurm.node("gpu02").flags
    assert slurm.reboot_requests().count("gpu02") == before
    assert "ReturnToService         = 1" in slurm.scontrol("show", "config"), "the cluster itself keeps it"


async def test_a_reboot_with_nextstate_resume_returns_the_node_unchecked(slurm):
    backend = SlurmBackend.from_config({"slurm_conf": str(slurm.conf_path), "reboot_next_state": "RESUME"})
    await backend.reboot("gpu04", "gpuhealth: GPUHealthGpusMissing: x")
    assert "NextState=RESUME" in show_node(slurm, "gpu04")
    slurm.complete_reboot("gpu04")
    slurm.wait_node("gpu04", lambda n: n.state == "IDLE", RETURN_SECONDS, what="gpu04 back in service")


async def test_reset_gpu_without_a_command(slurm, backend):
    with pytest.raises(BackendError, match="no reset_gpu_command") as err:
        await backend.reset_gpu("gpu02", "1", REASON)
    assert not err.value.retryable
    rebooting = SlurmBackend.from_config({"slurm_conf": str(slurm.conf_path), "reset_gpu_fallback": "reboot"})
    await rebooting.reset_gpu("gpu02", "1", REASON)
    assert {"REBOOT_REQUESTED", "REBOOT_ISSUED"} & slurm.node("gpu02").flags


async def test_reset_gpu_runs_the_site_command(slurm, tmp_path):
    out = tmp_path / "reset.txt"
    script = tmp_path / "reset.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(' '.join(sys.argv[2:]) + ' '"
                      " + os.environ['GPUHEALTH_ALERTNAME'] + ' ' + os.environ['SLURM_CONF'])\n")
    backend = SlurmBackend.from_config({
        "slurm_conf": str(slurm.conf_path),
        "reset_gpu_command": [sys.executable, str(script), str(out), "{node}", "{gpu}"]})
    await backend.reset_gpu("gpu01", "5", REASON, alertname="GPUHealthXidResetGpu")
    assert out.read_text() == f"gpu01 5 GPUHealthXidResetGpu {slurm.conf_path}"


async def test_scontrol_can_run_through_a_wrapper(slurm, tmp_path):
    calls = tmp_path / "calls"
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text("import os, sys\n"
                       f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                       "os.execvp(sys.argv[1], sys.argv[1:])\n")
    backend = SlurmBackend.from_config({"slurm_conf": str(slurm.conf_path),
                                        "scontrol": [sys.executable, str(wrapper), "scontrol"]})
    await backend.drain("gpu01", REASON)
    assert (await backend.node_state("gpu01")).reason == REASON
    assert f"scontrol update NodeName=gpu01 State=DRAIN Reason={REASON}" in calls.read_text().splitlines()


async def test_errors_carry_slurms_message(backend):
    with pytest.raises(BackendError) as err:
        await backend.drain("gpu99", REASON)
    assert not err.value.retryable and "Invalid node name" in str(err.value)


@pytest.mark.parametrize("node", ["gpu[01-04]", "gpu01,gpu02", "ALL", "gpu01 gpu02", "-gpu01", ""])
async def test_a_label_naming_many_nodes_acts_on_none(slurm, backend, node):
    assert not (await backend.node_state(node)).exists
    for act in (lambda: backend.drain(node, REASON), lambda: backend.reboot(node, REASON),
                lambda: backend.resume(node), lambda: backend.jobs_on_node(node),
                lambda: backend.requeue("1", [node]), lambda: backend.reset_gpu(node, "0", REASON)):
        with pytest.raises(BackendError, match=r"not a single node name|not found") as err:
            await act()
        assert not err.value.retryable
    assert slurm.run("sinfo", "-h", "-o", "%t %D").split() == ["idle", "4"]


@pytest.mark.parametrize("job_id", ["1,2", "1 2", "", "all"])
async def test_a_job_list_is_refused(backend, job_id):
    with pytest.raises(BackendError, match="not a single Slurm job id") as err:
        await backend.requeue(job_id, ["gpu01"])
    assert not err.value.retryable


async def test_an_unreachable_controller_is_retryable(slurm, tmp_path):
    conf = tmp_path / "slurm.conf"
    text = slurm.conf_path.read_text()
    conf.write_text(text.replace(f"SlurmctldPort={slurm.controller_port}", f"SlurmctldPort={free_port()}"))
    backend = SlurmBackend.from_config({"slurm_conf": str(conf), "timeout_seconds": 1.5})
    started = time.monotonic()
    with pytest.raises(BackendError) as err:
        await backend.drain("gpu01", REASON)
    assert err.value.retryable
    assert time.monotonic() - started < 15


def test_config_lists_every_problem_at_once():
    with pytest.raises(ValueError) as err:
        SlurmBackend.from_config({"timeout_seconds": -1, "reset_gpu_command": ["x", "{job_id}"],
                                  "reset_gpu_fallback": "pray", "reboot_next_state": "UP", "scontrol": "",
                                  "colour": 1})
    message = str(err.value)
    for expected in ("timeout_seconds", "{job_id}", "reset_gpu_fallback", "reboot_next_state",
                     "backend.scontrol", "backend.colour"):
        assert expected in message, expected


def test_registry_builds_the_slurm_backend():
    assert isinstance(create_backend({"type": "slurm"}), SlurmBackend)


# --- the whole webhook on Slurm: recorded notifications in, Slurm state checked with its tools ---

@pytest.fixture
def on_slurm(webhook, slurm):
    """``await on_slurm(**settings)``: the app acting through the Slurm backend on the test cluster."""
    async def make(**settings):
        section = {"type": "slurm", "slurm_conf": str(slurm.conf_path), "timeout_seconds": 20,
                   **settings.pop("slurm", {})}
        return await webhook(backend=create_backend(section), **settings)
    return make


async def deliver(hook, fixture: str) -> dict:
    resp = await hook.client.post("/alerts", json=recorded(fixture), headers=hook.auth)
    body = await resp.json()
    assert resp.status == 200, body
    return body


async def test_a_drain_notification_drains_the_node_and_requeues_its_job(on_slurm, slurm):
    job = slurm.sbatch("--requeue", "--nodes=2", "--nodelist=gpu02", "--wrap", "sleep 600")
    slurm.wait_job(job, lambda j: j.state == "RUNNING")
    hook = await on_slurm()
    await deliver(hook, "firing_node_group")
    actions = await hook.settle(timeout=60)
    assert sorted((a["state"], a["reason"]) for a in actions) == [
        ("done", "ok"), ("skipped", "already_drained"), ("skipped", "already_drained")], actions
    line = slurm.scontrol("show", "node", "gpu02", "-o")
    assert "+DRAIN" in line and "Reason=gpuhealth: GPUHealth" in line
    info = slurm.wait_job(job, lambda j: j.state == "PENDING", what="the job to be requeued")
    assert info.restarts == 1 and info.excluded == ["gpu02"]
    assert slurm.squeue("-h", "-w", "gpu02", "-o", "%i").split() == []

    await deliver(hook, "resolved_node_group")
    await hook.settle(timeout=60)
    assert "Reason=" not in slurm.scontrol("show", "node", "gpu02", "-o")
    slurm.wait_node("gpu02", lambda n: n.state == "IDLE", RETURN_SECONDS, what="gpu02 back in service")
    assert slurm.job(job).excluded == ["gpu02"], "the requeued job still avoids the node"


async def test_a_predictive_drain_saves_the_jobs_work_before_draining(on_slurm, slurm):
    job = slurm.submit_training_job(nodes=2, checkpoint_interval=600)  # no interval checkpoint in the test
    bad = slurm.job(job).nodes[0]

    async def output() -> str:
        path = slurm.workdir / f"job-{job}.out"  # written once slurmd starts the job, not at submission
        return path.read_text() if path.exists() else ""
    # until its handler is in place, SIGUSR1 would end the trainer (an exit, which also confirms)
    await eventually(output, lambda text: "event=start" in text, timeout=30, what="the trainer to start")
    hook = await on_slurm(checkpoint={"confirm": "file", "grace_seconds": 30, "poll_seconds": 0.1,
                                      "path": str(slurm.workdir / "checkpoints" / "job-{job_id}")})
    await hook.post(alert(bad, action="checkpoint_drain", alertname="GPUHealthGpuFailureRisk",
                          severity="warning", summary="risk 0.8"))
    [action] = await hook.until(lambda acts: acts[0]["state"] == "done", "the drain to end", timeout=60)
    saved = newest_checkpoint(slurm.checkpoint_dir(job))
    assert saved is not None and saved.reason == "signal", "scancel --signal=USR1 --batch reached the job"
    checkpoint = action["progress"]["checkpoint"]
    assert checkpoint["confirmed"] == [job]
    assert checkpoint["signalled_at"] <= saved.written_at <= checkpoint["ended_at"], "saved before the drain"
    assert slurm.node(bad).reason.startswith("gpuhealth: GPUHealthGpuFailureRisk")
    info = slurm.wait_job(job, lambda j: j.state == "RUNNING" and j.restarts == 1,
                          what="the job running again at once, away from the node")
    assert bad not in info.nodes and bad in info.excluded
    await eventually(output, lambda text: f"event=resume step={saved.step} " in text, timeout=30,
                     what="the requeued run to resume from the saved step")


async def test_a_node_drained_by_someone_else_is_left_alone(on_slurm, slurm):
    slurm.scontrol("update", "NodeName=gpu03", "State=DRAIN", "Reason=maintenance: ticket 42")
    hook = await on_slurm()
    await deliver(hook, "firing_node_and_gpu")
    actions = await hook.settle(timeout=60)
    assert {a["reason"] for a in actions} == {"drained_by_other"}, actions
    assert slurm.node("gpu03").reason.startswith("maintenance: ticket 42 [")


async def test_a_reboot_notification_requests_a_slurm_reboot(on_slurm, slurm):
    hook = await on_slurm()
    await deliver(hook, "firing_same_node_other_action")
    [action] = await hook.settle(timeout=60)
    assert action["state"] == "done", action
    info = slurm.node("gpu03")
    assert {"REBOOT_REQUESTED", "REBOOT_ISSUED"} & info.flags and info.reason.startswith(
        "gpuhealth: GPUHealthGpusMissing: gpu03 sees 1 fewer GPUs")
    assert "NextState=DOWN" in slurm.scontrol("show", "node", "gpu03", "-o")
    slurm.complete_reboot("gpu03")
    info = slurm.wait_node("gpu03", lambda n: "DOWN" in n.flags, what="gpu03 kept out after its reboot")
    assert info.reason.startswith("gpuhealth: GPUHealthGpusMissing"), "our reason stays: the undrain may act"


async def test_a_rebooted_node_returns_only_once_its_health_check_passed(on_slurm, slurm, tmp_path):
    verdict = tmp_path / "verdict"
    verdict.write_text("1")
    runs = tmp_path / "runs"
    check = tmp_path / "validate"  # stands in for ssh {node} gpuhealth-validate
    check.write_text(f'#!/bin/sh\necho "$1" >> {runs}\nexit "$(cat {verdict})"\n')
    check.chmod(0o755)
    hook = await on_slurm(undrain={"health_check": [str(check), "{node}"], "health_check_retry_seconds": 0.2,
                                   "health_check_max_attempts": 100})
    await deliver(hook, "firing_same_node_other_action")
    await hook.settle(timeout=60)
    slurm.complete_reboot("gpu03")
    slurm.wait_node("gpu03", lambda n: "DOWN" in n.flags, what="gpu03 kept out after its reboot")
    firing = recorded("firing_same_node_other_action")
    await hook.post(*[resolved(a) for a in firing["alerts"]])

    async def checks() -> list[str]:
        return runs.read_text().split() if runs.exists() else []
    await eventually(checks, lambda seen: len(seen) >= 2, timeout=30, what="failing health checks")
    assert "DOWN" in slurm.node("gpu03").flags, "a failed check leaves the node out"
    verdict.write_text("0")

    async def state() -> str:  # polled without blocking the loop the webhook's health check runs on
        return slurm.node("gpu03").state
    await eventually(state, lambda now: now == "IDLE", timeout=RETURN_SECONDS,
                     what="gpu03 resumed once it passed")
    assert (await checks())[-1] == "gpu03"


# --- an operator's drain always wins: races against a real `scontrol update` from the test ---

OPERATOR_REASON = "ops: replacing the PSU, ticket 77"



async def test_undrain_leaves_a_node_the_operator_redrained_during_the_health_check(on_slurm, slurm,
                                                                                   tmp_path):
    healthy = tmp_path / "healthy"
    check = [sys.executable, "-c", f"import os, sys; sys.exit(0 if os.path.exists({str(healthy)!r}) else 1)"]
    hook = await on_slurm(undrain={"health_check": check, "health_check_retry_seconds": 0.3,
                                   "health_check_max_attempts": 20})
    firing = alert("gpu01", action="drain")
    await hook.post(firing)
    assert (await hook.settle(timeout=60))[0]["reason"] == "ok"
    [undrain_id] = (await hook.post(resolved(firing)))["new_actions"]
    await hook.wait_action(undrain_id, lambda a: a["reason"] == "health_check_failed", timeout=60)
    slurm.scontrol("update", "NodeName=gpu01", "State=DRAIN", f"Reason={OPERATOR_REASON}")
    healthy.touch()
    undrain = await hook.wait_action(undrain_id, lambda a: a["state"] not in ("pending", "running"),
                                     timeout=60)
    assert (undrain["state"], undrain["reason"]) == ("skipped", "drained_by_other"), undrain
    node = slurm.node("gpu01")
    assert "DRAIN" in node.flags and node.reason.startswith(OPERATOR_REASON), node


async def test_no_reboot_for_a_node_the_operator_took_over_after_our_drain(on_slurm, slurm, tmp_path):
    """The operator's `scontrol update` lands while the webhook lists the node's jobs (between its
    drain and its reboot): the reboot is never requested."""
    wrapper = tmp_path / "squeue-with-operator"
    wrapper.write_text(
        f"#!{sys.executable}\nimport os, subprocess, sys\n"
        f"subprocess.run(['scontrol', 'update', 'NodeName=gpu02', 'State=DRAIN', "
        f"{'Reason=' + OPERATOR_REASON!r}], check=True)\n"
        "os.execvp('squeue', ['squeue', *sys.argv[1:]])\n")
    wrapper.chmod(0o755)
    hook = await on_slurm(slurm={"squeue": [str(wrapper)]})
    before = slurm.reboot_requests().count("gpu02")  # the module's cluster remembers earlier tests' reboots
    await hook.post(alert("gpu02", action="drain_reboot"))
    [action] = await hook.settle(timeout=60)
    assert (action["state"], action["reason"]) == ("skipped", "drained_by_other"), action
    assert slurm.reboot_requests().count("gpu02") == before
    node = slurm.node("gpu02")
    assert "DRAIN" in node.flags and node.reason.startswith(OPERATOR_REASON), node
    assert not {"REBOOT_REQUESTED", "REBOOT_ISSUED"} & node.flags


async def test_an_operators_drain_while_our_drain_awaits_approval_wins_over_the_approval(on_slurm, slurm):
    hook = await on_slurm(guardrails={"require_approval": ["drain"]})
    firing = alert("gpu01", action="drain")
    [action_id] = (await hook.post(firing))["new_actions"]
    await hook.wait_action(action_id, lambda a: a["state"] == "awaiting_approval")
    slurm.scontrol("update", "NodeName=gpu01", "State=DRAIN", f"Reason={OPERATOR_REASON}")
    await hook.call("POST", f"/actions/{action_id}/approve")
    action = await hook.wait_action(action_id, lambda a: a["state"] not in ("pending", "running"), timeout=60)
    assert (action["state"], action["reason"]) == ("skipped", "drained_by_other"), action
    assert (await hook.post(resolved(firing)))["new_actions"] == []
    await hook.settle(timeout=60)
    node = slurm.node("gpu01")
    assert "DRAIN" in node.flags and node.reason.startswith(OPERATOR_REASON), node


async def test_an_operators_down_after_our_drain_survives_a_restart_and_the_resolution(on_slurm, slurm):
    hook = await on_slurm()
    firing = alert("gpu02", action="drain")
    await hook.post(firing)
    assert [a["reason"] for a in await hook.settle(timeout=60)] == ["ok"]
    slurm.scontrol("update", "NodeName=gpu02", "State=DOWN", f"Reason={OPERATOR_REASON}")
    await hook.client.close()
    restarted = await on_slurm()  # the same journal
    [undrain_id] = (await restarted.post(resolved(firing)))["new_actions"]
    undrain = await restarted.wait_action(undrain_id, lambda a: a["state"] not in ("pending", "running"),
                                          timeout=60)
    assert (undrain["state"], undrain["reason"]) == ("skipped", "drained_by_other"), undrain
    node = slurm.node("gpu02")
    assert "DOWN" in node.flags and node.reason.startswith(OPERATOR_REASON), node
    assert (await restarted.call("GET", "/status"))["drained_by_us"] == []


async def test_hostile_labels_never_reach_scontrol(on_slurm, slurm):
    hook = await on_slurm()
    await hook.post(alert("ALL", action="drain"), alert("gpu[01-04]", action="drain"),
                    alert("gpu03", action="drain_reset_gpu", gpu="0; scontrol update NodeName=ALL"),
                    alert("gpu04", action="drain", alertname="X\x1b[2J"),
                    alert("gpu04", action="drain", summary="XID 79\x00\x1b[31m red\nnext line"))
    actions = await hook.settle(timeout=60)
    assert [a["reason"] for a in actions] == ["invalid_node", "invalid_node", "invalid_label",
                                              "invalid_label", "ok"]
    drained = [n for n in slurm.node_names if "DRAIN" in slurm.node(n).flags]
    assert drained == ["gpu04"]
    assert slurm.node("gpu04").reason.startswith("gpuhealth: GPUHealthXidFatal: XID 79 red next line [")


async def test_a_summary_written_to_fool_scontrol_leaves_our_reason_ours_and_undrains(on_slurm, slurm):
    """Quotes Slurm strips, key=value text and a forged "[user@time]" stamp that its -o listing could
    be read by, and a summary far over the reason's length: the reason Slurm keeps is still ours (so
    the resolution undrains the node), one line, at most MAX_REASON_CHARS before Slurm's stamp."""
    hook = await on_slurm()
    summary = ('"quoted" State=IDLE Reason=ops: mine Comment=x [root@2026-01-01T00:00:00] '
               + "y" * 500 + '"')
    firing = alert("gpu03", action="drain", summary=summary)
    await hook.post(firing)
    await hook.settle(timeout=60)
    node = slurm.node("gpu03")
    assert "DRAIN" in node.flags, node
    assert node.reason.startswith('gpuhealth: GPUHealthXidFatal: "quoted" State=IDLE Reason=ops: mine'), node
    assert len(node.reason) <= MAX_REASON_CHARS and "\n" not in node.reason
    await hook.post(resolved(firing))
    actions = await hook.settle(timeout=60)
    assert [(a["kind"], a["state"], a["reason"]) for a in actions] == [("drain", "done", "ok"),
                                                                         ("undrain", "done", "ok")]
    assert "DRAIN" not in slurm.node("gpu03").flags


async def test_a_full_journal_disk_never_sends_a_drain_twice(on_slurm, slurm, tmp_path, small_disk):
    """scontrol, through a wrapper that logs its argv, fills the journal's 2 MiB tmpfs as it sends the
    drain: the write recording the drain is refused, and while it is, no step runs again."""
    calls, filler = tmp_path / "scontrol.calls", small_disk / "filler"
    wrapper = tmp_path / "scontrol-filling-the-disk"
    wrapper.write_text(
        f"#!{sys.executable}\nimport os, subprocess, sys\n"
        f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "if 'State=DRAIN' in sys.argv:\n"
        f"    subprocess.run(['dd', 'if=/dev/zero', 'of={filler}', 'bs=64k'], stderr=subprocess.DEVNULL)\n"
        "os.execvp('scontrol', ['scontrol', *sys.argv[1:]])\n")
    wrapper.chmod(0o755)
    hook = await on_slurm(state_dir=str(small_disk), slurm={"scontrol": [str(wrapper)]})
    drains = reason_updates(slurm, "gpu01")
    [action_id] = (await hook.post(alert("gpu01", action="drain")))["new_actions"]

    failures = "gpuhealth_webhook_journal_write_failures_total"
    await hook.until_metric(failures, 2, "the journal to report a refused write")
    seen = calls.read_text().splitlines()
    await hook.until_metric(failures, await hook.metric(failures) + 3,  # retry rounds
                            "the worker to go on probing the journal")
    assert calls.read_text().splitlines() == seen, "scontrol was called again while the journal was full"
    assert [c for c in seen if "State=DRAIN" in c] == [c for c in seen if c.startswith("update")]
    assert len([c for c in seen if "State=DRAIN" in c]) == 1, seen
    assert reason_updates(slurm, "gpu01") == drains + 1, "slurmctld got the drain exactly once"
    assert "DRAIN" in slurm.node("gpu01").flags
    assert (await hook.client.get("/healthz")).status == 503

    filler.unlink()  # space returns: the action finishes without draining again
    action = await hook.wait_action(action_id, lambda a: a["state"] == "done", timeout=60)
    assert (action["reason"], action["progress"]["done"]) == ("ok", ["drain", "requeue"]), action
    assert len([c for c in calls.read_text().splitlines() if "State=DRAIN" in c]) == 1
    assert reason_updates(slurm, "gpu01") == drains + 1
    assert (await hook.client.get("/healthz")).status == 200


# --- the escalation chain on Slurm: each step a real scontrol/squeue action, verified before the next ---

ESCALATION_STEPS = ["restart_job", "drain_reset_gpu", "drain_reboot", "replace"]


@dataclass
class EscalationSite:
    """A job running on the node an alert will name, the site's scripts, and the reboots so far."""

    job: str
    node: str
    reset: list[str]  # reset_gpu_command: records "{node} {gpu}" in files["resets"]
    check: list[str]  # undrain health check (stands in for ssh {node} gpuhealth-validate)
    files: dict[str, Path]
    reboots: list[str]


def escalation_site(slurm: SlurmCluster, tmp_path: Path, *, passing: bool) -> EscalationSite:
    """A one-node job running (no --nodelist: it may run anywhere, its node is the one the alert
    names), a reset command that records its arguments, a health check whose verdict is a file's
    content (``passing`` or not), and the reboot requests made before the test."""
    job = slurm.sbatch("--requeue", "--nodes=1", "--wrap", "sleep 600")
    [node] = slurm.wait_job(job, lambda j: j.state == "RUNNING").nodes
    files = {"resets": tmp_path / "resets", "checks": tmp_path / "checks", "verdict": tmp_path / "verdict"}
    files["verdict"].write_text("0" if passing else "1")
    reset = tmp_path / "reset-gpu"
    reset.write_text(f'#!/bin/sh\necho "$1 $2" >> {files["resets"]}\n')
    check = tmp_path / "validate"
    check.write_text(f'#!/bin/sh\necho "$1" >> {files["checks"]}\nexit "$(cat {files["verdict"]})"\n')
    for script in (reset, check):
        script.chmod(0o755)
    return EscalationSite(job, node, [str(reset), "{node}", "{gpu}"], [str(check), "{node}"], files,
                          slurm.reboot_requests())


async def chain_of(hook) -> dict:
    chains = (await (await hook.client.get("/actions")).json())["chains"]
    return chains[0] if chains else {}


async def test_escalation_on_slurm_fails_every_verification_until_the_chain_is_exhausted(on_slurm, slurm,
                                                                                        tmp_path):
    site = escalation_site(slurm, tmp_path, passing=False)
    job, bad, files = site.job, site.node, site.files
    hook = await on_slurm(
        slurm={"reset_gpu_command": site.reset}, undrain={"health_check": site.check},
        guardrails={"node_cooldown_seconds": 3600},  # each step is stronger: never held by it
        escalation={"enabled": True, "settle_seconds": 0, "poll_seconds": 0.2,
                    "step_timeout_seconds": {"restart_job": 2, "drain_reset_gpu": 2, "drain_reboot": 30}})
    await hook.post(alert(bad, action="restart_job", gpu="1", alertname="GPUHealthXidRestartJob",
                          summary="XID 31 on GPU 1"))
    info = await eventually(lambda: asyncio.to_thread(slurm.job, job), lambda j: j.state == "RUNNING" and
                            j.restarts == 1, timeout=60, what="the job running again away from the node")
    assert bad not in info.nodes and bad in info.excluded
    await eventually(lambda: chain_of(hook), lambda c: c.get("step") == "drain_reboot", timeout=60,
                     what="the reboot step")
    await asyncio.to_thread(slurm.complete_reboot, bad, 60)  # slurmd restarts as a rebooted node
    chain = await eventually(lambda: chain_of(hook), lambda c: c.get("state") == "exhausted", timeout=90,
                             what="the chain exhausted")
    actions = await hook.settle(timeout=30)
    assert [a["kind"] for a in actions] == ESCALATION_STEPS
    assert {(a["state"], a["reason"]) for a in actions} == {("done", "ok")}, actions
    assert chain["step"] == "replace" and chain["action_id"] == actions[-1]["id"]
    assert files["resets"].read_text().split() == [bad, "1"], "the alert's GPU was reset, once"
    assert slurm.reboot_requests()[len(site.reboots):] == [bad], "one reboot"
    assert set(files["checks"].read_text().split()) == {bad}, "checked after the reset and the reboot"
    node = slurm.node(bad)
    assert {"DRAIN", "DOWN"} & node.flags, node
    assert node.reason.startswith("gpuhealth: GPUHealthXidRestartJob"), node
    assert await hook.metric("gpuhealth_webhook_chains", state="exhausted") == 1


async def test_escalation_on_slurm_closes_the_chain_when_the_reset_verifies(on_slurm, slurm, tmp_path):
    site = escalation_site(slurm, tmp_path, passing=True)
    job, bad, files = site.job, site.node, site.files
    hook = await on_slurm(
        slurm={"reset_gpu_command": site.reset}, undrain={"health_check": site.check},
        escalation={"enabled": True, "settle_seconds": 0, "poll_seconds": 0.2,
                    "step_timeout_seconds": {"restart_job": 1, "drain_reset_gpu": 120}})
    firing = alert(bad, action="restart_job", gpu="0", alertname="GPUHealthXidRestartJob")
    await hook.post(firing)
    await eventually(lambda: chain_of(hook), lambda c: c.get("step") == "drain_reset_gpu" and
                     c.get("state") == "verifying", timeout=60, what="the reset step verifying")
    assert slurm.node(bad).reason.startswith("gpuhealth: GPUHealthXidRestartJob")
    await hook.post(resolved(firing))
    chain = await eventually(lambda: chain_of(hook), lambda c: c.get("state") == "succeeded", timeout=60,
                             what="the chain closed")
    assert chain["step"] == "drain_reset_gpu" and "health check passed" in chain["detail"]
    await asyncio.to_thread(slurm.wait_node, bad, lambda n: n.state == "IDLE", RETURN_SECONDS,
                            "the node resumed")
    actions = await hook.settle(timeout=30)
    assert [a["kind"] for a in actions] == ["restart_job", "drain_reset_gpu", "undrain"]
    assert slurm.reboot_requests() == site.reboots and files["resets"].read_text().split() == [bad, "0"]
    assert slurm.job(job).state == "RUNNING" and bad not in slurm.job(job).nodes


@pytest.mark.parametrize("node", ["asap", "ASAP"])
async def test_a_node_named_like_a_reboot_keyword_is_never_handed_to_scontrol_reboot(tmp_path, node):
    """``scontrol reboot ASAP nextstate=DOWN reason=... asap`` has no node list left once the last word
    is read as the ASAP keyword."""
    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "NodeName={node} State=IDLE+DRAIN Reason=x"\n')
    fake.chmod(0o755)
    backend = SlurmBackend.from_config({"scontrol": str(fake)})
    with pytest.raises(BackendError, match="its own keyword") as refused:
        await backend.reboot(node, "gpuhealth: GPUHealthXidRebootNode: x")
    assert not refused.value.retryable
    assert not calls.exists() or "reboot" not in calls.read_text()
