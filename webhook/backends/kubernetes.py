"""Kubernetes backend: cordon and taint nodes, evict or restart the pods that use their GPUs.

Everything we change on a node is marked as ours (the ``gpuhealth.io/unhealthy`` taint and
``gpuhealth.io/*`` annotations), so that a cordon someone else set is reported as theirs and
``resume`` takes back only what we added. Node updates carry the ``resourceVersion`` they were
computed from: the taint list is replaced as a whole, and a concurrent change must not be lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

from gpuhealth.contract.validation import Location, Model, problems
from pydantic import Field, ValidationError

from ..labels import clean_text
from .base import BackendError, JobState, NodeState
from .command import (
    RebootTemplate,
    ResetGpuTemplate,
    alert_fields,
    check_gpu,
    check_node,
    environment,
    fill,
    run_argv,
)
from .helpers import TracksHelpers
from .kubernetes_api import KubeAPIError, KubeClient, KubeSession
from .kubernetes_config import SERVICE_ACCOUNT_DIR, Connection, from_kubeconfig, in_cluster

log = logging.getLogger(__name__)

TAINT_KEY = "gpuhealth.io/unhealthy"
REASON_ANNOTATION = "gpuhealth.io/drain-reason"
PRIOR_CORDON_ANNOTATION = "gpuhealth.io/cordoned-before-drain"
# The keys of the blocking taints others had set when we drained: one set later is an operator taking
# the node over, and wins as a cordon set before us does.
PRIOR_TAINTS_ANNOTATION = "gpuhealth.io/taints-before-drain"
ACTION_ANNOTATION = "gpuhealth.io/requested-action"
ACTION_GPU_ANNOTATION = "gpuhealth.io/requested-action-gpu"
ACTION_REASON_ANNOTATION = "gpuhealth.io/requested-action-reason"
ACTION_AT_ANNOTATION = "gpuhealth.io/requested-action-at"
OUR_ANNOTATIONS = (REASON_ANNOTATION, PRIOR_CORDON_ANNOTATION, PRIOR_TAINTS_ANNOTATION, ACTION_ANNOTATION,
                   ACTION_GPU_ANNOTATION, ACTION_REASON_ANNOTATION, ACTION_AT_ANNOTATION)
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
# Taints Kubernetes sets itself (a cordon's node.kubernetes.io/unschedulable, not-ready while a node
# reboots): never an operator's hold.
SYSTEM_TAINT_PREFIXES = ("node.kubernetes.io/", "node.cloudprovider.kubernetes.io/")
REASON_PREFIX = "gpuhealth:"
CONFLICT_ATTEMPTS = 5
MAX_EVICTION_BACKOFF_S = 30.0
TERMINAL_PHASES = {"Succeeded", "Failed"}

NodePatch = Callable[[Mapping[str, Any]], dict[str, Any] | None]


Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class NodeCommands(Model):
    """With ``node_actions: command``: the site's programs for what the API cannot do."""

    reset_gpu: ResetGpuTemplate | None = None
    reboot: RebootTemplate | None = None


class ConnectionSettings(Model):
    """Where the API server is: a kubeconfig (kubectl's rules), or the pod's service account."""

    kubeconfig: Annotated[str, Field(min_length=1)] | None = None
    context: str | None = None  # a kubeconfig context; its current-context by default
    service_account_dir: Annotated[str, Field(min_length=1)] = str(SERVICE_ACCOUNT_DIR)
    insecure_skip_tls_verify: bool = False  # only ever off by this explicit setting

    def connect(self, errors: list[str]) -> Connection | None:
        if self.kubeconfig:
            return from_kubeconfig(Path(self.kubeconfig).expanduser(), self.context,
                                   self.insecure_skip_tls_verify, errors)
        return in_cluster(Path(self.service_account_dir), self.insecure_skip_tls_verify, errors)


class KubernetesSettings(ConnectionSettings):
    """The ``backend:`` section for ``type: kubernetes`` (without ``type``)."""

    gpu_resource: Annotated[str, Field(min_length=1)] = "nvidia.com/gpu"  # the extended resource of a GPU
    node_selector: str = ""  # a label selector: the nodes that count as the fleet
    request_timeout_seconds: Seconds = 10.0
    eviction_deadline_seconds: Seconds = 120.0  # then a drain fails; a disruption budget may block it
    eviction_backoff_seconds: Seconds = 1.0
    patch_type: Literal["strategic", "merge"] = "strategic"
    node_actions: Literal["annotate", "command", "none"] = "annotate"  # how reset_gpu and reboot are done
    node_commands: NodeCommands | None = None  # with node_actions: command, and only then
    node_command_timeout_seconds: Seconds = 300.0
    job_pods: Literal["all", "on_excluded_nodes"] = "all"  # which pods of a Job a requeue restarts

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> list[tuple[Location, str]]:
        found: list[tuple[Location, str]] = []
        if data.get("context") is not None and not data.get("kubeconfig"):
            found.append((("context",), "only meaningful with backend.kubeconfig"))
        if (data.get("node_actions") == "command") != bool(data.get("node_commands")):
            found.append((("node_commands",), "required with node_actions: command, and only used with it"))
        return found

    def node_command(self, operation: str) -> list[str] | None:
        found: list[str] | None = getattr(self.node_commands, operation, None)
        return found

class KubernetesBackend(TracksHelpers):
    """Acts through the API server with the rights of the ClusterRole in ``KUBERNETES.md``."""

    name = "kubernetes"

    def __init__(self, connection: Connection, settings: KubernetesSettings | None = None) -> None:
        self.connection = connection
        self.settings = settings or KubernetesSettings()
        self._client = KubeClient(connection, self.settings.request_timeout_seconds)

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> KubernetesBackend:
        """Build from the ``backend:`` section; raises ``ValueError`` listing every problem."""
        errors: list[str] = []
        settings: KubernetesSettings | None = None
        try:
            settings = KubernetesSettings.model_validate(dict(section))
        except ValidationError as exc:
            errors = problems(exc, "backend")
        # The connection is checked even when another setting is wrong, so that every problem is listed.
        own = {key: value for key, value in section.items() if key in ConnectionSettings.model_fields}
        try:
            connection = (settings or ConnectionSettings.model_validate(own)).connect(errors)
        except ValidationError:
            connection = None  # its problems are listed already
        if errors or connection is None or settings is None:
            raise ValueError("kubernetes backend:\n  " + "\n  ".join(errors))
        return cls(connection, settings)

    async def node_state(self, node: str) -> NodeState:
        async with self._client.session() as api:
            obj = await _get_node(api, node, missing_ok=True)
        if obj is None:
            return NodeState(node, exists=False, drained=False)
        spec, annotations = obj.get("spec") or {}, _annotations(obj)
        if not (spec.get("unschedulable") is True or _has_our_taint(spec)):
            return NodeState(node, exists=True, drained=False)
        if REASON_ANNOTATION in annotations or _has_our_taint(spec):
            late = _taints_set_since_our_drain(spec, annotations)
            if late:
                reason = f"tainted outside gpuhealth after its drain (taints: {','.join(late)})"
                return NodeState(node, exists=True, drained=True, reason=reason)
            return NodeState(node, exists=True, drained=True, reason=_our_reason(annotations))
        taints = ",".join(str(t.get("key")) for t in spec.get("taints") or []) or "none"
        return NodeState(node, exists=True, drained=True,
                         reason=f"cordoned outside gpuhealth (taints: {taints})")

    async def fleet_size(self) -> int:
        params = {"labelSelector": self.settings.node_selector} if self.settings.node_selector else {}
        async with self._client.session() as api:
            return len(await api.list_all("/api/v1/nodes", params))

    async def drain(self, node: str, reason: str, *, alertname: str = "") -> None:
        def patch(obj: Mapping[str, Any]) -> dict[str, Any] | None:
            spec, annotations = obj.get("spec") or {}, _annotations(obj)
            body: dict[str, Any] = {}
            new_annotations: dict[str, str] = {}
            if annotations.get(REASON_ANNOTATION) != reason:
                new_annotations[REASON_ANNOTATION] = reason
            if PRIOR_TAINTS_ANNOTATION not in annotations:
                new_annotations[PRIOR_TAINTS_ANNOTATION] = ",".join(_others_blocking_taints(spec))
            if spec.get("unschedulable") is True:
                if REASON_ANNOTATION not in annotations and PRIOR_CORDON_ANNOTATION not in annotations:
                    new_annotations[PRIOR_CORDON_ANNOTATION] = "true"
            else:
                body["spec"] = {"unschedulable": True}
            if not _has_our_taint(spec):
                taint = {"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}
                body.setdefault("spec", {})["taints"] = [*(spec.get("taints") or []), taint]
            if new_annotations:
                body["metadata"] = {"annotations": new_annotations}
            return body or None

        if await self._update_node(node, patch, what="drain"):
            log.info("event=kube_drained node=%s taint=%s reason=%r", node, TAINT_KEY, reason)

    async def resume(self, node: str) -> None:
        def patch(obj: Mapping[str, Any]) -> dict[str, Any] | None:
            spec, annotations = obj.get("spec") or {}, _annotations(obj)
            body: dict[str, Any] = {}
            drop = {key: None for key in OUR_ANNOTATIONS if key in annotations}
            if drop:
                body["metadata"] = {"annotations": drop}
            if _has_our_taint(spec):
                body["spec"] = {"taints": [t for t in spec["taints"] if t.get("key") != TAINT_KEY]}
            ours = REASON_ANNOTATION in annotations or _has_our_taint(spec)
            if ours and spec.get("unschedulable") is True and PRIOR_CORDON_ANNOTATION not in annotations:
                body.setdefault("spec", {})["unschedulable"] = False
            return body or None

        if await self._update_node(node, patch, what="resume", missing_ok=True):
            log.info("event=kube_resumed node=%s", node)

    async def jobs_on_node(self, node: str) -> list[str]:
        async with self._client.session() as api:
            pods = await api.list_all("/api/v1/pods", {"fieldSelector": f"spec.nodeName={node}"})
        jobs = {_job_id(pod) for pod in pods if _active(pod) and _movable(pod) and self._uses_gpus(pod)}
        return sorted(jobs)

    async def requeue(self, job_id: str, exclude_nodes: list[str]) -> None:
        """Evict a pod (its controller recreates it) or restart a Job by deleting its pods.

        The exclusion is the cordon and taint that ``drain`` set: Kubernetes cannot pin a
        recreated pod away from a node that is still schedulable, so that case is logged.
        """
        parts = job_id.split("/")
        if len(parts) == 2 and all(parts):
            namespace, pod, job = parts[0], parts[1], None
        elif len(parts) == 3 and parts[1] == "job" and parts[0] and parts[2]:
            namespace, pod, job = parts[0], None, parts[2]
        else:
            raise BackendError(f"{job_id!r} is not a Kubernetes job id (namespace/pod or "
                               "namespace/job/name)", retryable=False)
        for node in exclude_nodes:
            state = await self.node_state(node)
            if not state.drained:
                log.warning("event=kube_exclusion_not_enforced job=%s node=%s detail=%r", job_id, node,
                            "the node is schedulable; the scheduler may place the work there again")
        async with self._client.session() as api:
            if job is None:
                await self._evict(api, namespace, str(pod))
            else:
                await self._restart_job(api, namespace, job, exclude_nodes)

    async def signal_job(self, job_id: str, signal: str, target: str) -> None:
        raise BackendError("the kubernetes backend cannot ask a pod to checkpoint (use a preStop hook "
                           "or the pod's own SIGTERM handling)", retryable=False)

    async def job_state(self, job_id: str) -> JobState:
        return JobState(active=False)

    async def reset_gpu(self, node: str, gpu: str | None, reason: str, *, alertname: str = "") -> None:
        if self.settings.node_actions == "command":
            fields = alert_fields(node, reason, gpu or "", alertname=alertname)
            await self._run_node_command("reset_gpu", fields)
        else:
            await self._request_node_action(check_node(node), "reset-gpu", check_gpu(gpu or "") or "all",
                                            clean_text(reason))

    async def reboot(self, node: str, reason: str, *, alertname: str = "") -> None:
        if self.settings.node_actions == "command":
            await self._run_node_command("reboot", alert_fields(node, reason, alertname=alertname))
        else:
            await self._request_node_action(check_node(node), "reboot", None, clean_text(reason))

    async def _run_node_command(self, operation: str, fields: Mapping[str, str]) -> None:
        """The site's own way to reach the machine (ssh, a BMC, a job), as the command backend runs it."""
        template = self.settings.node_command(operation)
        if template is None:
            raise BackendError(f"kubernetes backend: no node_commands.{operation} configured",
                               retryable=False)
        argv = fill(template, fields)
        log.info("event=kube_node_command operation=%s node=%s argv=%r", operation, fields["node"], argv)
        await run_argv(argv, env=environment(operation, fields, {}),
                       timeout=self.settings.node_command_timeout_seconds, helpers=self.helpers)

    async def _request_node_action(self, node: str, action: str, gpu: str | None, reason: str) -> None:
        """Record the request on the node for the node-local agent, which clears it when done."""
        if self.settings.node_actions == "none":
            raise BackendError(f"kubernetes backend: node_actions is 'none', cannot {action} on {node}",
                               retryable=False)

        def patch(obj: Mapping[str, Any]) -> dict[str, Any] | None:
            annotations = _annotations(obj)
            if annotations.get(ACTION_ANNOTATION) == action and annotations.get(ACTION_GPU_ANNOTATION) == gpu:
                return None
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            return {"metadata": {"annotations": {
                ACTION_ANNOTATION: action, ACTION_GPU_ANNOTATION: gpu, ACTION_REASON_ANNOTATION: reason,
                ACTION_AT_ANNOTATION: stamp}}}

        if await self._update_node(node, patch, what=action):
            log.info("event=kube_node_action_requested node=%s action=%s gpu=%s", node, action, gpu or "")

    async def _update_node(self, node: str, patch: NodePatch, *, what: str, missing_ok: bool = False) -> bool:
        """Read, compute and PATCH with the read ``resourceVersion``; recompute on a 409 conflict.

        Returns whether the node was changed (False: already as wanted, or gone and ``missing_ok``).
        """
        async with self._client.session() as api:
            for _ in range(CONFLICT_ATTEMPTS):
                obj = await _get_node(api, node, missing_ok=missing_ok)
                if obj is None:
                    log.warning("event=kube_node_missing node=%s operation=%s", node, what)
                    return False
                body = patch(obj)
                if body is None:
                    return False
                body.setdefault("metadata", {})["resourceVersion"] = obj["metadata"].get("resourceVersion")
                try:
                    await api.patch(_node_path(node), body, self.settings.patch_type)
                    return True
                except KubeAPIError as exc:
                    if exc.code != 409:
                        raise
                    log.info("event=kube_conflict node=%s operation=%s", node, what)
        raise BackendError(f"{what} {node}: the node kept changing under us ({CONFLICT_ATTEMPTS} conflicts)")

    async def _evict(self, api: KubeSession, namespace: str, pod: str) -> None:
        """Evict through the Eviction API, waiting out PodDisruptionBudgets up to the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.eviction_deadline_seconds
        delay = self.settings.eviction_backoff_seconds
        body = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": pod, "namespace": namespace}}
        path = f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(pod)}/eviction"
        while True:
            try:
                await api.post(path, body)
            except KubeAPIError as exc:
                if exc.code == 404:
                    log.info("event=kube_evict_gone pod=%s/%s", namespace, pod)
                    return
                if exc.code != 429:
                    raise
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise BackendError(f"evicting {namespace}/{pod}: still refused after "
                                       f"{self.settings.eviction_deadline_seconds:g}s: {exc}") from None
                wait = min(max(delay, exc.retry_after or 0.0), remaining)
                log.info("event=kube_evict_blocked pod=%s/%s retry_in=%.1fs detail=%r",
                         namespace, pod, wait, str(exc))
                await asyncio.sleep(wait)
                delay = min(delay * 2, MAX_EVICTION_BACKOFF_S)
                continue
            log.info("event=kube_evicted pod=%s/%s", namespace, pod)
            return

    async def _restart_job(self, api: KubeSession, namespace: str, job: str,
                           exclude_nodes: list[str]) -> None:
        """Delete the Job's pods; the Job controller creates new ones where the scheduler allows."""
        pods = await api.list_all(f"/api/v1/namespaces/{quote(namespace)}/pods",
                                  {"labelSelector": f"job-name={job}"})
        pods = [p for p in pods if _active(p) and _owning_job(p) == job]
        if self.settings.job_pods == "on_excluded_nodes":
            pods = [p for p in pods if (p.get("spec") or {}).get("nodeName") in exclude_nodes]
        if not pods:
            log.info("event=kube_job_no_pods job=%s/%s", namespace, job)
        for pod in pods:
            name = pod["metadata"]["name"]
            try:
                await api.delete(f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}")
            except KubeAPIError as exc:
                if exc.code != 404:
                    raise
            log.info("event=kube_pod_deleted pod=%s/%s job=%s", namespace, name, job)

    def _uses_gpus(self, pod: Mapping[str, Any]) -> bool:
        spec = pod.get("spec") or {}
        for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
            resources = container.get("resources") or {}
            for kind in ("limits", "requests"):
                amount = str((resources.get(kind) or {}).get(self.settings.gpu_resource, "0"))
                if amount.strip() not in ("", "0"):
                    return True
        return False


async def _get_node(api: KubeSession, node: str, *, missing_ok: bool) -> dict[str, Any] | None:
    try:
        return await api.get(_node_path(node))
    except KubeAPIError as exc:
        if exc.code == 404 and missing_ok:
            return None
        raise


def _node_path(node: str) -> str:
    return f"/api/v1/nodes/{quote(node)}"


def _annotations(obj: Mapping[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def _has_our_taint(spec: Mapping[str, Any]) -> bool:
    return any(t.get("key") == TAINT_KEY for t in spec.get("taints") or [])


def _others_blocking_taints(spec: Mapping[str, Any]) -> list[str]:
    """Keys of the NoSchedule/NoExecute taints on the node that neither we nor Kubernetes set."""
    return sorted({str(t.get("key")) for t in spec.get("taints") or []
                   if t.get("effect") in BLOCKING_EFFECTS and t.get("key") != TAINT_KEY
                   and not str(t.get("key")).startswith(SYSTEM_TAINT_PREFIXES)})


def _taints_set_since_our_drain(spec: Mapping[str, Any], annotations: Mapping[str, str]) -> list[str]:
    """Blocking taints someone else set after our drain (none known for a drain that recorded nothing)."""
    prior = annotations.get(PRIOR_TAINTS_ANNOTATION)
    if prior is None:
        return []
    return [key for key in _others_blocking_taints(spec) if key not in prior.split(",")]


def _our_reason(annotations: Mapping[str, str]) -> str:
    reason = annotations.get(REASON_ANNOTATION, "").strip()
    return reason if reason.startswith(REASON_PREFIX) else f"{REASON_PREFIX} {reason}".rstrip()


def _active(pod: Mapping[str, Any]) -> bool:
    """Not finished and not already being deleted: the pods a requeue would still affect."""
    metadata = pod.get("metadata") or {}
    return (pod.get("status") or {}).get("phase") not in TERMINAL_PHASES and not metadata.get(
        "deletionTimestamp")


def _movable(pod: Mapping[str, Any]) -> bool:
    """Not bound to this node by design, as ``kubectl drain`` sees it: no DaemonSet or static pods.

    A DaemonSet pod (the node agent that carries out a GPU reset, say) belongs on its node, and a
    static pod's API object is only a mirror that eviction cannot remove.
    """
    metadata = pod.get("metadata") or {}
    if "kubernetes.io/config.mirror" in (metadata.get("annotations") or {}):
        return False
    return not any(ref.get("controller") is True and ref.get("kind") == "DaemonSet"
                   for ref in metadata.get("ownerReferences") or [])


def _owning_job(pod: Mapping[str, Any]) -> str | None:
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") is True and ref.get("kind") == "Job" and str(
                ref.get("apiVersion", "")).startswith("batch/"):
            return str(ref.get("name"))
    return None


def _job_id(pod: Mapping[str, Any]) -> str:
    """A Job's pods are restarted together; any other pod is evicted for its controller to replace."""
    metadata = pod["metadata"]
    job = _owning_job(pod)
    return f"{metadata['namespace']}/job/{job}" if job else f"{metadata['namespace']}/{metadata['name']}"
