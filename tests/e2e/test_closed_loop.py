"""The closed loop on the real stack: simulated GPUs -> Prometheus -> Alertmanager -> webhook -> Slurm.

First `gpuhealth demo` as a user runs it, interrupted with Ctrl-C mid-run; then one stack, three
events at once on different nodes: a sudden hard failure (XID 79), a slow HBM precursor, and benign
noise. The demo test comes first so that the two whole stacks never share the machine's cores.
Everything is checked in Slurm itself (``scontrol show node``, ``squeue``), the way an operator
would check it.
"""

from __future__ import annotations

import re
import time

import pytest
import yaml
from demo_process import demo_at_baseline, interrupt, processes_under

from gpuhealth.demo.observe import Observer, reboot_with_a_job_waiting
from gpuhealth.demo.stack import ClosedLoopStack, Fault, StackOptions
from gpuhealth.local.process import wait_until
from gpuhealth.local.training_job import logged

pytestmark = pytest.mark.slow

PRECURSOR_SECONDS = 90.0
STEP_SECONDS = 0.2  # the training job's step (SlurmCluster.submit_training_job's default)


def test_ctrl_c_mid_run_stops_every_process(tmp_path):
    workdir = tmp_path / "demo"
    with demo_at_baseline(workdir) as (proc, lines):
        assert any("Prometheus" in line for line in lines), "".join(lines)
        # slurmctld, slurmd, exporters, Prometheus, ...
        assert len(processes_under(workdir)) >= 5, "".join(lines)
        interrupt(proc)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    options = StackOptions(nodes=6, jobs=2, job_nodes=2, breaker_max_nodes=3)
    with ClosedLoopStack(options, workdir=tmp_path_factory.mktemp("loop")) as stack:
        stack.start()
        observer = Observer(stack)
        observer.poll()
        job_nodes = {job: observer.last.jobs[job][1] for job in stack.jobs}
        busy = {node for nodes in job_nodes.values() for node in nodes}
        idle = [node for node in stack.nodes if node not in busy]
        hard_node = job_nodes[stack.jobs[0]][-1]
        slow_node = job_nodes[stack.jobs[1]][-1]
        noise_node = idle[0]
        observer.inject(Fault(hard_node, "fell_off_bus", gpu=2, duration=0.0))
        observer.inject(Fault(slow_node, "hbm_degradation", gpu=5, duration=PRECURSOR_SECONDS))
        observer.inject(Fault(noise_node, "sbe_burst", gpu=1, duration=30.0))

        def settled() -> bool:
            observer.poll()
            return observer.loop_closed()
        wait_until(settled, timeout=PRECURSOR_SECONDS + 90, interval=1.0, what="the loop to close")
        # Let the noise run its course and any late action land before judging the quiet nodes.
        deadline = observer.injections[-1].at + 45
        while time.time() < deadline:
            observer.poll()
            time.sleep(1)
        yield stack, observer, {"hard": hard_node, "slow": slow_node, "noise": noise_node,
                                "jobs": job_nodes}


def test_hard_xid_drains_node_and_requeues_job(loop):
    stack, observer, where = loop
    node = stack.slurm.node(where["hard"])
    assert "DRAIN" in node.state
    assert node.reason.startswith("gpuhealth:")
    job = stack.jobs[0]
    assert job not in stack.slurm.jobs_on(where["hard"])
    info = stack.slurm.job(job)
    assert info.restarts >= 1
    assert where["hard"] in info.excluded
    assert observer.latencies()[where["hard"]]["drain_from_hard_failure_seconds"] is not None


def test_slow_precursor_drains_before_the_hard_failure(loop):
    stack, observer, where = loop
    node = stack.slurm.node(where["slow"])
    assert "DRAIN" in node.state
    # Memory evidence alone is one cause, below the risk threshold; in the demo's compressed time the
    # HBM precursor's corrected errors come at storm rates, which drain it ahead of its XID.
    assert "GPUHealthEccCorrectedStorm" in node.reason, node.reason
    latency = observer.latencies()[where["slow"]]
    assert latency["drain_from_hard_failure_seconds"] < 0, latency
    job = stack.jobs[1]
    assert job not in stack.slurm.jobs_on(where["slow"])
    assert where["slow"] in stack.slurm.job(job).excluded


def test_the_predictive_drain_came_after_the_jobs_checkpoint(loop):
    """The storm alert is predictive: the job checkpoints on the webhook's signal (its own log) before
    slurmctld drains the node (slurmctld's log), and loses under a tenth of its checkpoint interval."""
    stack, _, where = loop
    output = stack.slurm.workdir / f"job-{stack.jobs[1]}.out"
    saved = logged(output, "checkpoint", reason="signal")
    drained = [at for at, _ in stack.slurm.logged(rf"update_node: node {where['slow']} state set to DRAIN")]
    assert saved and drained and saved[0] <= drained[0], (saved, drained)
    lost = re.search(r"event=terminated .*?lost_steps=(\d+)", output.read_text())
    assert lost is not None and int(lost[1]) * STEP_SECONDS < 0.1 * stack.options.checkpoint_interval, lost


def test_noise_and_healthy_nodes_are_left_alone(loop):
    stack, observer, where = loop
    assert "DRAIN" not in stack.slurm.node(where["noise"]).state
    faulty = {where["hard"], where["slow"]}
    for name in stack.nodes:
        if name not in faulty:
            assert "DRAIN" not in stack.slurm.node(name).state, name
    assert observer.healthy_nodes_touched() == []


def test_training_jobs_checkpoint_and_the_demo_sees_it(loop):
    stack, observer, _ = loop
    assert set(observer.last.checkpoints) == set(stack.jobs)
    for job_id, saved in observer.last.checkpoints.items():  # the slow node's job's may be on request
        assert saved.reason in ("interval", "signal") and saved.step > 0, (job_id, saved)
        assert saved.path.parent == stack.slurm.checkpoint_dir(job_id)


def test_the_gpu_reset_step_succeeded_and_repaired_the_memory_fault(loop):
    """The predictive action's last step resets the GPU through ``gpuhealth-sim-reset``: the action is
    done, and the exporter shows the volatile ECC count cleared while the aggregate kept every error
    (the wearing HBM goes on counting from 0: a reset applies remaps, it does not stop wear). The reset
    rewrote the node's hardware file that gpuhealth-validate reads, and the wearing HBM stays in it:
    the node stays drained."""
    stack, observer, where = loop
    node = where["slow"]

    def resets() -> list[dict]:
        return [a for a in stack.webhook_get("/actions")["actions"]
                if a["node"] == node and a["kind"].endswith("drain_reset_gpu")]
    # the loop closes at the requeue; the reset comes after it
    ended = ("done", "failed", "skipped", "cancelled")
    wait_until(lambda: resets() and resets()[0]["state"] in ended, timeout=60, interval=0.5,
               what="the reset action to end")
    first = resets()[0]
    assert first["gpu"] == "5" and first["state"] == "done", first
    assert not [a for a in resets() if a["state"] == "failed"], resets()
    assert stack.webhook_logged(rf"event=slurm_reset_gpu node={node} gpu=5\b")
    ecc = f'gpuhealth_gpu_ecc_errors_total{{node="{node}",gpu="5",type="corrected",counter="%s"}}'

    def cleared() -> bool:
        volatile, aggregate = (stack.fleet_api.query(ecc % c) for c in ("volatile", "aggregate"))
        return bool(volatile and aggregate) and (float(volatile[0]["value"][1])
                                                 < float(aggregate[0]["value"][1]))
    wait_until(cleared, timeout=30, interval=1.0, what="the reset GPU's volatile count below its aggregate")
    hardware = stack.root / "nodes" / node / "hardware.yml"
    assert hardware.stat().st_mtime > observer.injections[-1].at, "rewritten by the reset, after injections"
    assert [(f["kind"], f["gpu"]) for f in yaml.safe_load(hardware.read_text())["faults"]] == \
        [("hbm_degradation", 5)]
    assert "DRAIN" in stack.slurm.node(node).flags


def test_a_rebooted_node_takes_a_job_only_after_gpuhealth_validate_passed(loop):
    """Last: it returns the hard-failure node to service. The webhook asked Slurm to reboot it; the
    reboot is played with a job waiting for exactly that node, and Slurm's own log must not allocate
    the node before the webhook's gpuhealth-validate passed on it."""
    stack, _, where = loop
    node = where["hard"]
    assert stack.slurm.reboot_issued(node), "the XID 79 action asked Slurm for a reboot"
    reboot = reboot_with_a_job_waiting(stack, node)
    assert reboot.allocated_at is not None, "the waiting job ran on the node once it was validated"
    assert reboot.validated_before_running, reboot
