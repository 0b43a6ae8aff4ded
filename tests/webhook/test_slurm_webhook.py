"""The webhook app on a real Slurm cluster: recorded notifications in, Slurm state checked with its tools."""

from __future__ import annotations

import pytest
from conftest import recorded
from gpuhealth.webhook.backends import create_backend

from gpuhealth.local.slurm import SlurmCluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with SlurmCluster(nodes=4, prefix="gpu") as running:
        yield running


@pytest.fixture
def slurm(cluster):
    cluster.reset()
    return cluster


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
    slurm.wait_node("gpu02", lambda n: n.state == "IDLE", what="gpu02 back in service")
    assert slurm.job(job).excluded == ["gpu02"], "the requeued job still avoids the node"


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
    assert "NextState=RESUME" in slurm.scontrol("show", "node", "gpu03", "-o")
    slurm.complete_reboot("gpu03")
    slurm.wait_node("gpu03", lambda n: n.state == "IDLE", what="gpu03 back after its reboot")
