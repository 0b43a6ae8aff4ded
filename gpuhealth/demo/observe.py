"""Watch the loop close: poll Prometheus, the webhook and Slurm, and turn changes into a timeline.

Everything shown comes from the real components' own APIs (Prometheus queries, the webhook's
``/actions``, ``scontrol``), so the demo and the end-to-end test check what an operator would see.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass, field

from gpuhealth.demo.stack import ClosedLoopStack, Fault
from gpuhealth.local.training_job import Checkpoint, newest_checkpoint

log = logging.getLogger(__name__)

@dataclass
class Injection:
    fault: Fault
    at: float  # wall-clock injection time (precursor onset)
    jobs: tuple[str, ...] = ()  # jobs running on the node when the fault began

    @property
    def is_fault(self) -> bool:
        return not self.fault.is_noise

    @property
    def hard_failure_at(self) -> float:
        """When a fault's precursor ends in the hard failure (meaningless for noise)."""
        return self.at + self.fault.duration


@dataclass
class Snapshot:
    at: float
    node_states: dict[str, tuple[str, str]] = field(default_factory=dict)  # node -> (state, reason)
    # job id -> (state, nodes, restarts)
    jobs: dict[str, tuple[str, tuple[str, ...], int]] = field(default_factory=dict)
    risk: dict[tuple[str, str], float] = field(default_factory=dict)  # (node, gpu) -> score
    contributions: dict[tuple[str, str], list[tuple[str, float]]] = field(default_factory=dict)
    alerts: set[tuple[str, str, str, str]] = field(default_factory=set)  # alertname, node, gpu, action
    actions: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # id -> action, node, state
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)  # job id -> its newest checkpoint

    def drained(self, node: str) -> bool:
        return "DRAIN" in self.node_states.get(node, ("", ""))[0]


@dataclass
class Event:
    at: float
    text: str


# slurmctld's lines for a job given nodes: by its main scheduler, and by the backfill scheduler
ALLOCATED = (r"(?:sched: Allocate JobId=\S+ NodeList=|sched/backfill: _start_job: Started JobId=\S+ in \S+ "
             r"on )(\S+)")


@dataclass(frozen=True)
class Reboot:
    """A reboot the webhook asked for, played by the stack, and what followed, from the logs."""

    node: str
    rebooted_at: float
    validated_at: float | None  # the webhook logged gpuhealth-validate passing on the node
    allocated_at: float | None  # slurmctld allocated the node to a job

    @property
    def validated_before_running(self) -> bool | None:
        """None when no job ran on the node: nothing to judge."""
        if self.allocated_at is None:
            return None
        return self.validated_at is not None and self.validated_at <= self.allocated_at


def reboot_with_a_job_waiting(stack: ClosedLoopStack, node: str, timeout: float = 120.0) -> Reboot:
    """Play the reboot of ``node`` the webhook asked Slurm for while a job waits for exactly that node,
    then read from slurmctld's log when the node was first allocated after the reboot, and from the
    webhook's when ``gpuhealth-validate`` first passed on it."""
    waiting = stack.slurm.sbatch("--nodes=1", f"--nodelist={node}", "--job-name=after-reboot",
                                 "--wrap", "sleep 600")
    rebooted_at = time.time()  # from here on the node may come back: a job may land on it at once
    stack.complete_reboot(node)
    with contextlib.suppress(TimeoutError):
        stack.slurm.wait_job(waiting, lambda job: job.state == "RUNNING", timeout=timeout,
                             what=f"a job on {node} after its reboot")
    allocated = [at for at, match in stack.slurm.logged(ALLOCATED) if at >= rebooted_at
                 and node in stack.slurm.hostnames(match[1])]
    passed = [at for at in stack.webhook_logged(rf"event=health_check node={re.escape(node)} ok=true")
              if at >= rebooted_at]
    return Reboot(node, rebooted_at, min(passed, default=None), min(allocated, default=None))


class Observer:
    """Polls the stack; ``events`` is the timeline, ``first`` the first time of each milestone."""

    def __init__(self, stack: ClosedLoopStack) -> None:
        self.stack = stack
        self.started = time.time()
        self.injections: list[Injection] = []
        self.events: list[Event] = []
        self.first: dict[tuple[str, str], float] = {}  # (milestone, node) -> time
        self.last = Snapshot(self.started)

    def inject(self, fault: Fault) -> Injection:
        jobs = tuple(job for job, (_, nodes, _) in self.last.jobs.items() if fault.node in nodes)
        injection = Injection(fault, self.stack.inject(fault), jobs)
        self.injections.append(injection)
        what = f"precursor {fault.duration:.0f}s, then hard failure" if injection.is_fault else "benign noise"
        self._event(injection.at, f"injected {fault.kind} on {fault.node} GPU {fault.gpu} ({what})")
        return injection

    def note(self, text: str) -> None:
        """Something the caller did to the stack, for the timeline."""
        self._event(time.time(), text)

    def _event(self, at: float, text: str) -> None:
        self.events.append(Event(at, text))
        log.info("demo event t=%.1f %s", at - self.started, text)

    def _milestone(self, name: str, node: str, at: float) -> None:
        self.first.setdefault((name, node), at)

    def poll(self) -> Snapshot:
        now = time.time()
        snap = Snapshot(now)
        for node in self.stack.nodes:
            info = self.stack.slurm.node(node)
            snap.node_states[node] = (info.state, info.reason)
        for job_id in self.stack.jobs:
            job = self.stack.slurm.job(job_id)
            snap.jobs[job_id] = (job.state, tuple(job.nodes), job.restarts)
            if (saved := newest_checkpoint(self.stack.slurm.checkpoint_dir(job_id))) is not None:
                snap.checkpoints[job_id] = saved
        self._poll_prometheus(snap)
        self._poll_webhook(snap)
        self._diff(self.last, snap)
        self.last = snap
        return snap

    def _poll_prometheus(self, snap: Snapshot) -> None:
        api = self.stack.fleet_api
        for sample in api.query("gpuhealth:gpu_failure_risk:score"):
            labels = sample["metric"]
            snap.risk[(labels.get("node", ""), labels.get("gpu", ""))] = float(sample["value"][1])
        for sample in api.query("gpuhealth:gpu_failure_risk:contribution"):
            labels = sample["metric"]
            key = (labels.get("node", ""), labels.get("gpu", ""))
            value = float(sample["value"][1])
            snap.contributions.setdefault(key, []).append((labels.get("signal", "?"), value))
        for values in snap.contributions.values():
            values.sort(key=lambda item: -item[1])
        for sample in api.query('ALERTS{alertstate="firing",alertname=~"GPUHealth.+"}'):
            labels = sample["metric"]
            snap.alerts.add((labels["alertname"], labels.get("node", ""), labels.get("gpu", ""),
                             labels.get("action", "")))

    def _poll_webhook(self, snap: Snapshot) -> None:
        for action in self.stack.webhook_get("/actions")["actions"]:
            state = action["state"] + (f" ({action['reason']})" if action.get("reason") else "")
            snap.actions[str(action["id"])] = (action["kind"], action["node"], state)

    def _diff(self, old: Snapshot, new: Snapshot) -> None:
        at = new.at
        for key, score in new.risk.items():
            if score >= 0.3 > old.risk.get(key, 0.0):
                top = ", ".join(f"{s}={v:.2f}" for s, v in new.contributions.get(key, [])[:3])
                self._event(at, f"risk of {key[0]} GPU {key[1]} rising: {score:.2f} ({top})")
        for alert in sorted(new.alerts - old.alerts):
            name, node, gpu, action = alert
            self._event(at, f"alert {name} firing for {node}{' GPU ' + gpu if gpu else ''} (action {action})")
            self._milestone(f"alert {name}", node, at)
        for action_id, (action, node, state) in sorted(new.actions.items()):
            self._milestone(f"webhook {action}", node, at)
            if old.actions.get(action_id, ("", "", ""))[2] != state:
                self._event(at, f"webhook action {action_id} {action} on {node}: {state}")
        for node, (state, reason) in new.node_states.items():
            if state != old.node_states.get(node, ("", ""))[0] and old.node_states:
                self._event(at, f"Slurm node {node}: {state}" + (f" ({reason})" if reason else ""))
            if new.drained(node):
                self._milestone("drained", node, at)
        for job_id, (state, nodes, restarts) in new.jobs.items():
            before = old.jobs.get(job_id)
            if before is None or before[:2] != (state, nodes):
                self._event(at, f"job {job_id}: {state} on {','.join(nodes) or '-'}")
            if before is not None and restarts > before[2]:
                for node in before[1]:
                    self._milestone("requeued", node, at)
        for job_id, saved in new.checkpoints.items():
            if saved.reason == "signal" and saved != old.checkpoints.get(job_id):
                self._event(saved.written_at, f"job {job_id}: checkpoint at step {saved.step} on request")

    # --- verdict ---------------------------------------------------------------------------------

    def faulty_nodes(self) -> set[str]:
        return {i.fault.node for i in self.injections if i.is_fault}

    def loop_closed(self) -> bool:
        """Every faulty node drained, the jobs it ran requeued off it; no other node drained."""
        snap = self.last
        for injection in self.injections:
            node = injection.fault.node
            if not injection.is_fault:
                continue
            if not snap.drained(node) or any(node in nodes for _, nodes, _ in snap.jobs.values()):
                return False
            if injection.jobs and ("requeued", node) not in self.first:
                return False
        return not self.healthy_nodes_touched()

    def healthy_nodes_touched(self) -> list[str]:
        faulty = self.faulty_nodes()
        return [n for n in self.stack.nodes if n not in faulty and self.last.drained(n)]

    def summary(self) -> list[str]:
        latencies = self.latencies()
        lines = []
        for injection in self.injections:
            node = injection.fault.node
            head = f"{injection.fault.kind} on {node} GPU {injection.fault.gpu}"
            if not injection.is_fault:
                drained = self.last.drained(node)
                verdict = "DRAINED - false alarm" if drained else "no action, as expected"
                lines.append(f"{head} (noise): {verdict}")
                continue
            latency = latencies[node]
            onset, hard = latency["drain_from_onset_seconds"], latency["drain_from_hard_failure_seconds"]
            if onset is None or hard is None:
                lines.append(f"{head}: NOT drained")
                continue
            requeued = latency["requeue_from_onset_seconds"]
            requeue = f"; job requeued {requeued:.1f}s after onset" if requeued is not None else ""
            lines.append(f"{head}: drained {onset:.1f}s after precursor onset, "
                         f"{abs(hard):.1f}s {'before' if hard < 0 else 'after'} the hard failure{requeue}")
        touched = self.healthy_nodes_touched()
        lines.append(f"healthy nodes drained: {', '.join(touched) if touched else 'none'}")
        lines.append(f"loop closed: {'yes' if self.loop_closed() else 'NO'}")
        return lines

    def latencies(self) -> dict[str, dict[str, float | None]]:
        """Per faulty node: drain latency from onset and from the hard failure (negative: before it)."""
        result: dict[str, dict[str, float | None]] = {}
        for injection in self.injections:
            if not injection.is_fault:
                continue
            node = injection.fault.node
            drained = self.first.get(("drained", node))
            requeued = self.first.get(("requeued", node))
            hard = injection.hard_failure_at
            result[node] = {
                "drain_from_onset_seconds": None if drained is None else drained - injection.at,
                "drain_from_hard_failure_seconds": None if drained is None else drained - hard,
                "requeue_from_onset_seconds": None if requeued is None else requeued - injection.at,
                "requeue_from_hard_failure_seconds": None if requeued is None else requeued - hard,
            }
        return result
