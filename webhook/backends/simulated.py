"""A simulated cluster: try the webhook's decisions end to end with no scheduler at hand.

It keeps node drains, running jobs and a history of every call the webhook made, optionally in a
JSON file that survives restarts (replaced atomically, so a killed webhook never leaves it torn).
Like a real scheduler it is idempotent: draining a drained node, requeueing a job that is already
pending, or asking again for a reboot or GPU reset still pending (until the node is resumed) changes
nothing and adds no history.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from gpuhealth.contract.validation import Model, problems
from gpuhealth.webhook.backends.base import BackendError, JobState, NodeState
from pydantic import BeforeValidator, Field, ValidationError, WithJsonSchema
from pydantic_core import PydanticCustomError

_RANGE = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<first>\d+)-(?P<last>\d+)\](?P<suffix>[^\[\]]*)$")


def expand_hostlist(pattern: str) -> list[str]:
    """``gpu[01-04]`` -> gpu01..gpu04 (the one Slurm hostlist form worth supporting here)."""
    match = _RANGE.match(pattern)
    if not match:
        return [pattern]
    first, last = match["first"], match["last"]
    width = len(first) if first.startswith("0") else 0
    return [f"{match['prefix']}{i:0{width}d}{match['suffix']}" for i in range(int(first), int(last) + 1)]


def _node_list(value: Any) -> Any:
    if value == []:
        raise PydanticCustomError("nodes", "expected at least one node name or hostlist like 'gpu[01-08]'")
    return [value] if isinstance(value, str) else value


class SimulatedSettings(Model):
    """The ``backend:`` section for ``type: simulated`` (without ``type``)."""

    nodes: Annotated[list[Annotated[str, Field(min_length=1)]], BeforeValidator(_node_list),
                     WithJsonSchema({"anyOf": [{"type": "string", "minLength": 1},
                                               {"type": "array", "minItems": 1,
                                                "items": {"type": "string", "minLength": 1}}]})]
    jobs: dict[str, list[str | int]] = Field(default_factory=dict)  # node name: running job ids
    state_file: Annotated[Path, Field(strict=False)] | None = None  # survives restarts when set
    latency_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0  # added to every call


class SimulatedBackend:
    name = "simulated"

    def __init__(self, nodes: list[str], jobs: dict[str, list[str]] | None = None,
                 state_file: Path | None = None, latency_seconds: float = 0.0) -> None:
        self.state_file = state_file
        self.latency_seconds = latency_seconds
        if state_file is not None and state_file.exists():
            self.state = json.loads(state_file.read_text())
        else:
            self.state = {
                "nodes": {n: {"drained": False, "reason": ""} for n in nodes},
                "jobs": {job: {"node": node, "requeues": 0, "excluded": []}
                         for node, ids in (jobs or {}).items() for job in ids},
                "history": [],
            }

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> SimulatedBackend:
        try:
            settings = SimulatedSettings.model_validate(section)
        except ValidationError as exc:
            raise ValueError("; ".join(problems(exc, "backend"))) from None
        nodes = [n for pattern in settings.nodes for n in expand_hostlist(pattern)]
        return cls(nodes, {node: [str(j) for j in ids] for node, ids in settings.jobs.items()},
                   settings.state_file, settings.latency_seconds)

    @contextlib.contextmanager
    def _shared(self) -> Iterator[None]:
        """Read the state file again under a lock for one operation, so that webhook replicas sharing
        the file act on one cluster and its history counts every call of each of them."""
        if self.state_file is None:
            yield
            return
        with self.state_file.with_suffix(".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.state_file.exists():
                self.state = json.loads(self.state_file.read_text())
            yield

    async def _latency(self) -> None:
        if self.latency_seconds:
            await asyncio.sleep(self.latency_seconds)

    def _record(self, op: str, *args: Any) -> None:
        self.state["history"].append([op, *args])
        self._save()

    def _save(self) -> None:
        if self.state_file is None:
            return
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.state_file)

    def _node(self, node: str) -> dict[str, Any]:
        if node not in self.state["nodes"]:
            raise BackendError(f"node {node} not found", retryable=False)
        entry: dict[str, Any] = self.state["nodes"][node]
        return entry

    @property
    def history(self) -> list[list[Any]]:
        history: list[list[Any]] = self.state["history"]
        return history

    async def node_state(self, node: str) -> NodeState:
        with self._shared():
            entry = self.state["nodes"].get(node)
            if entry is None:
                return NodeState(node, exists=False, drained=False)
            return NodeState(node, exists=True, drained=entry["drained"], reason=entry["reason"])

    async def fleet_size(self) -> int:
        return len(self.state["nodes"])

    async def drain(self, node: str, reason: str, *, alertname: str = "") -> None:
        await self._latency()
        with self._shared():
            entry = self._node(node)
            if entry["drained"]:
                return
            entry.update(drained=True, reason=reason)
            self._record("drain", node, reason)

    async def resume(self, node: str) -> None:
        await self._latency()
        with self._shared():
            entry = self._node(node)
            if not entry["drained"]:
                return
            entry.update(drained=False, reason="", pending=[])
            self._record("resume", node)

    async def jobs_on_node(self, node: str) -> list[str]:
        with self._shared():
            self._node(node)
            return sorted(job for job, entry in self.state["jobs"].items() if entry["node"] == node)

    async def requeue(self, job_id: str, exclude_nodes: list[str]) -> None:
        await self._latency()
        with self._shared():
            job = self.state["jobs"].get(job_id)
            if job is None:
                raise BackendError(f"job {job_id} not found", retryable=False)
            if job["node"] is None:
                return
            job.update(node=None, requeues=job["requeues"] + 1,
                       excluded=sorted(set(job["excluded"]) | set(exclude_nodes)))
            self._record("requeue", job_id, sorted(exclude_nodes))

    async def signal_job(self, job_id: str, signal: str, target: str) -> None:
        await self._latency()
        if job_id not in self.state["jobs"]:
            raise BackendError(f"job {job_id} not found", retryable=False)
        self._record("signal", job_id, signal, target)

    async def job_state(self, job_id: str) -> JobState:
        job = self.state["jobs"].get(job_id)
        if job is None:
            return JobState(active=False)
        return JobState(active=job["node"] is not None, comment=job.get("comment", ""),
                        state="RUNNING" if job["node"] is not None else "PENDING")

    def set_comment(self, job_id: str, comment: str) -> None:
        """What a job does to confirm its checkpoint (Slurm: ``scontrol update JobId=J Comment=...``)."""
        self.state["jobs"][job_id]["comment"] = comment
        self._save()

    async def reset_gpu(self, node: str, gpu: str | None, reason: str, *, alertname: str = "") -> None:
        await self._latency()
        self._request(node, f"reset_gpu:{gpu}", "reset_gpu", node, gpu, reason)

    async def reboot(self, node: str, reason: str, *, alertname: str = "") -> None:
        await self._latency()
        self._request(node, "reboot", "reboot", node, reason)

    def _request(self, node: str, what: str, *record: Any) -> None:
        with self._shared():
            pending = self._node(node).setdefault("pending", [])
            if what not in pending:
                pending.append(what)
                self._record(*record)

    def start_job(self, job_id: str, node: str) -> None:
        """Run ``job_id`` on ``node`` (again): how a requeued job lands on a new node."""
        job = self.state["jobs"].setdefault(job_id, {"node": None, "requeues": 0, "excluded": []})
        job["node"] = node
        self._save()
