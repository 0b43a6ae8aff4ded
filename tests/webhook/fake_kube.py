"""A fake Kubernetes API server for the backend's tests: the real paths, bodies and status codes.

No API server can run here, so this one keeps Nodes and Pods in memory and answers the calls the
backend makes the way kube-apiserver does: ``Status`` objects with ``reason`` and ``code``, 404
NotFound, 409 Conflict on a stale ``resourceVersion``, 415 for a PATCH content type it does not
accept, 401 without a valid bearer token or client certificate, 403 for verbs the test forbids,
and 429 TooManyRequests from the Eviction API while a PodDisruptionBudget blocks. Two controllers
whose effects the backend relies on are simulated: the Job controller replaces a deleted Job pod,
and the scheduler places a new pod on a schedulable node with the GPUs free whose NoSchedule
taints it tolerates.

Simplifications: deletion is immediate (no grace period), and PATCH accepts merge and strategic
merge patches only; for the Node fields involved (annotations, ``unschedulable``, ``taints``,
which has no patch merge key) the two behave the same, so both are applied as RFC 7386 merges.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import ssl
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

ACCEPTED_PATCH_TYPES = {"application/merge-patch+json", "application/strategic-merge-patch+json"}
POD_FIELDS = {"spec.nodeName", "status.phase", "metadata.name", "metadata.namespace"}
TAINT_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}
GPU = "nvidia.com/gpu"


class StatusError(Exception):
    """Ends a request with a ``Status`` body, as the API server does for every failure."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                     "message": message, "reason": reason, "code": code}
        if details:
            self.body["details"] = details
        self.code = code


def _not_found(kind: str, name: str) -> StatusError:
    return StatusError(404, "NotFound", f'{kind} "{name}" not found', {"name": name, "kind": kind})


class FakeKube:
    """State the tests arrange and inspect, served by an aiohttp app on a loopback port."""

    def __init__(self, token: str = "fake-token", *, tls: ssl.SSLContext | None = None) -> None:
        self.token = token
        self.tls = tls
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.pdb_blocks: dict[tuple[str, str], float] = {}  # 429s left per pod; float("inf") forever
        self.forbidden: set[tuple[str, str]] = set()  # (verb, resource) the caller's role lacks
        self.used: set[tuple[str, str]] = set()  # (verb, resource) the caller needed, for RBAC checks
        self.fail_next: list[int] = []  # answer the next requests with these codes (5xx, 429)
        self.delay_s = 0.0
        self.requests: list[tuple[str, str, str]] = []  # (method, path with query, content type)
        self.before_patch: Callable[[str], None] | None = None
        self._versions = itertools.count(1000)
        self._pod_suffix = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ---- arranging state -------------------------------------------------------------------------

    def add_node(self, name: str, *, labels: dict[str, str] | None = None, unschedulable: bool = False,
                 taints: list[dict[str, str]] | None = None, annotations: dict[str, str] | None = None,
                 gpus: int = 8) -> dict[str, Any]:
        spec: dict[str, Any] = {"podCIDR": "10.244.0.0/24"}
        if unschedulable:
            spec["unschedulable"] = True
        if taints:
            spec["taints"] = taints
        node = {"kind": "Node", "apiVersion": "v1",
                "metadata": {"name": name, "uid": f"uid-node-{name}", "labels": labels or {},
                             "annotations": annotations or {}, "resourceVersion": self._version()},
                "spec": spec,
                "status": {"capacity": {GPU: str(gpus)}, "allocatable": {GPU: str(gpus)}}}
        self.nodes[name] = node
        return node

    def modify_node(self, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Another actor updates the node (kubectl, an operator): a new resourceVersion."""
        change(self.nodes[name])
        self.nodes[name]["metadata"]["resourceVersion"] = self._version()

    def add_pod(self, namespace: str, name: str, node: str | None, *, gpus: int = 0, job: str | None = None,
                owner_kind: str | None = None, phase: str = "Running",
                tolerations: list[dict[str, str]] | None = None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {},
                                    "uid": f"uid-pod-{namespace}-{name}", "resourceVersion": self._version()}
        if job:
            metadata["labels"] = {"job-name": job, "batch.kubernetes.io/job-name": job}
            metadata["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": job,
                                            "uid": f"uid-job-{job}", "controller": True,
                                            "blockOwnerDeletion": True}]
        elif owner_kind:
            metadata["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner_kind, "controller": True,
                                            "name": f"{name}-owner", "uid": f"uid-{name}-owner"}]
        resources = {"limits": {GPU: str(gpus)}} if gpus else {}
        container = {"name": "main", "image": "trainer:1", "resources": resources}
        spec: dict[str, Any] = {"containers": [container], "tolerations": tolerations or []}
        if node:
            spec["nodeName"] = node
        pod = {"kind": "Pod", "apiVersion": "v1", "metadata": metadata, "spec": spec,
               "status": {"phase": phase}}
        self.pods[(namespace, name)] = pod
        return pod

    def pods_of_job(self, namespace: str, job: str) -> list[dict[str, Any]]:
        return [p for (ns, _), p in sorted(self.pods.items())
                if ns == namespace and p["metadata"]["labels"].get("job-name") == job]

    # ---- serving ---------------------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/api/v1/nodes", self._list_nodes)
        app.router.add_get("/api/v1/nodes/{name}", self._get_node)
        app.router.add_patch("/api/v1/nodes/{name}", self._patch_node)
        app.router.add_get("/api/v1/pods", self._list_pods)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._list_pods)
        app.router.add_delete("/api/v1/namespaces/{namespace}/pods/{name}", self._delete_pod)
        app.router.add_post("/api/v1/namespaces/{namespace}/pods/{name}/eviction", self._evict_pod)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.tls)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeKube:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def write_kubeconfig(self, path: Path, user: dict[str, Any] | None = None,
                         cluster: dict[str, Any] | None = None) -> Path:
        """A kubeconfig for this server: its bearer token unless ``user`` says otherwise."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url, **(cluster or {})}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "webhook"}}],
            "users": [{"name": "webhook", "user": user or {"token": self.token}}]}))
        return path

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs, request.headers.get("Content-Type", "")))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        try:
            self._authenticate(request)
            if self.fail_next:
                code = self.fail_next.pop(0)
                raise StatusError(code, "InternalError" if code >= 500 else "TooManyRequests",
                                  "injected failure")
            return await handler(request)
        except StatusError as exc:
            return web.json_response(exc.body, status=exc.code)

    def _authenticate(self, request: web.Request) -> None:
        if request.headers.get("Authorization") == f"Bearer {self.token}":
            return
        ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
        if ssl_object is not None and ssl_object.getpeercert():
            return  # verified against the client CA by the TLS layer
        raise StatusError(401, "Unauthorized", "Unauthorized")

    def _authorize(self, verb: str, resource: str, name: str = "", namespace: str = "") -> None:
        self.used.add((verb, resource))
        if (verb, resource) not in self.forbidden:
            return
        target = f'{resource} "{name}"' if name else resource
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        user = "system:serviceaccount:gpuhealth:gpuhealth-webhook"
        raise StatusError(403, "Forbidden", f'{target} is forbidden: User "{user}" cannot {verb} resource '
                          f'"{resource}" in API group "" {scope}')

    # ---- nodes -----------------------------------------------------------------------------------

    async def _list_nodes(self, request: web.Request) -> web.Response:
        self._authorize("list", "nodes")
        selector = _label_selector(request.query.get("labelSelector", ""))
        items = [n for _, n in sorted(self.nodes.items()) if selector(n["metadata"].get("labels") or {})]
        return self._list_response("NodeList", items, request)

    async def _get_node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self._authorize("get", "nodes", name)
        return web.json_response(self._node(name))

    async def _patch_node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self._authorize("patch", "nodes", name)
        if request.content_type not in ACCEPTED_PATCH_TYPES:
            accepted = ", ".join(sorted(ACCEPTED_PATCH_TYPES))
            raise StatusError(415, "UnsupportedMediaType", "the body of the request was in an unknown format "
                              f"- accepted media types include: {accepted}")
        try:
            patch = json.loads(await request.text())
        except json.JSONDecodeError as exc:
            raise StatusError(400, "BadRequest", f"error decoding patch: {exc}") from None
        if not isinstance(patch, dict):
            raise StatusError(400, "BadRequest", "error decoding patch: not a JSON object")
        if self.before_patch is not None:
            self.before_patch(name)
        node = self._node(name)
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != node["metadata"]["resourceVersion"]:
            raise StatusError(409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": the '
                              "object has been modified; please apply your changes to the latest version and "
                              "try again", {"name": name, "kind": "nodes"})
        updated = _merge(copy.deepcopy(node), patch)
        _validate_node(updated)
        updated["metadata"]["resourceVersion"] = self._version()
        self.nodes[name] = updated
        return web.json_response(updated)

    def _node(self, name: str) -> dict[str, Any]:
        if name not in self.nodes:
            raise _not_found("nodes", name)
        return self.nodes[name]

    # ---- pods ------------------------------------------------------------------------------------

    async def _list_pods(self, request: web.Request) -> web.Response:
        namespace = request.match_info.get("namespace", "")
        self._authorize("list", "pods", namespace=namespace)
        labels = _label_selector(request.query.get("labelSelector", ""))
        fields = _field_selector(request.query.get("fieldSelector", ""))
        items = [p for (ns, _), p in sorted(self.pods.items())
                 if (not namespace or ns == namespace) and labels(p["metadata"]["labels"]) and fields(p)]
        return self._list_response("PodList", items, request)

    async def _delete_pod(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        self._authorize("delete", "pods", name, namespace)
        pod = self._remove_pod(namespace, name)
        return web.json_response(pod)

    async def _evict_pod(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        self._authorize("create", "pods/eviction", name, namespace)
        try:
            body = json.loads(await request.text())
        except json.JSONDecodeError as exc:
            raise StatusError(400, "BadRequest", f"error decoding Eviction: {exc}") from None
        if not isinstance(body, dict) or body.get("kind") != "Eviction" or body.get("apiVersion") not in (
                "policy/v1", "policy/v1beta1"):
            raise StatusError(400, "BadRequest", "the body is not a policy/v1 Eviction")
        if (body.get("metadata") or {}).get("name") != name:
            raise StatusError(400, "BadRequest", "name in URL does not match name in Eviction object")
        if (namespace, name) not in self.pods:
            raise _not_found("pods", name)
        if self.pdb_blocks.get((namespace, name), 0) > 0:
            self.pdb_blocks[(namespace, name)] -= 1
            raise StatusError(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's "
                              "disruption budget.", {"causes": [{
                                  "reason": "DisruptionBudget",
                                  "message": "The disruption budget training-pdb needs 1 healthy pods and "
                                             "has 1 currently"}]})
        self._remove_pod(namespace, name)
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                  "code": 201}, status=201)

    def _remove_pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod = self.pods.pop((namespace, name), None)
        if pod is None:
            raise _not_found("pods", name)
        job = pod["metadata"]["labels"].get("job-name")
        if job and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            self._replace_job_pod(pod, job)
        return pod

    def _replace_job_pod(self, old: dict[str, Any], job: str) -> None:
        """The Job controller creates a replacement; the scheduler picks its node."""
        pod = copy.deepcopy(old)
        name = f"{job}-r{next(self._pod_suffix)}"
        pod["metadata"].update(name=name, uid=f"uid-pod-{name}", resourceVersion=self._version())
        pod["spec"].pop("nodeName", None)
        node = _schedule(pod, self.nodes, list(self.pods.values()))
        if node:
            pod["spec"]["nodeName"] = node
            pod["status"] = {"phase": "Running"}
        else:
            pod["status"] = {"phase": "Pending"}
        self.pods[(pod["metadata"]["namespace"], name)] = pod

    # ---- helpers ---------------------------------------------------------------------------------

    def _list_response(self, kind: str, items: list[dict[str, Any]], request: web.Request) -> web.Response:
        """Pages of ``limit`` items with an opaque ``continue`` token, like the real list calls."""
        start = int(request.query.get("continue") or 0)
        limit = int(request.query.get("limit") or 0) or len(items)
        page, rest = items[start:start + limit], items[start + limit:]
        metadata = {"resourceVersion": str(next(self._versions))}
        if rest:
            metadata["continue"] = str(start + limit)
        return web.json_response({"kind": kind, "apiVersion": "v1", "metadata": metadata,
                                  "items": [{k: v for k, v in i.items() if k not in ("kind", "apiVersion")}
                                            for i in page]})

    def _version(self) -> str:
        return str(next(self._versions))


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` deletes, anything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return patch
    if not isinstance(target, dict):
        target = {}
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = _merge(target.get(key), value)
    return target


def _validate_node(node: dict[str, Any]) -> None:
    problems = []
    spec = node.get("spec") or {}
    if not isinstance(spec.get("unschedulable", False), bool):
        problems.append("spec.unschedulable: must be a boolean")
    seen = set()
    for i, taint in enumerate(spec.get("taints") or []):
        if not taint.get("key"):
            problems.append(f"spec.taints[{i}].key: Required value")
        if taint.get("effect") not in TAINT_EFFECTS:
            problems.append(f"spec.taints[{i}].effect: Unsupported value: {taint.get('effect')!r}")
        if (taint.get("key"), taint.get("effect")) in seen:
            problems.append(f"spec.taints[{i}]: Duplicate value: taints must be unique by key and effect")
        seen.add((taint.get("key"), taint.get("effect")))
    for key, value in ((node.get("metadata") or {}).get("annotations") or {}).items():
        if not isinstance(value, str):
            problems.append(f"metadata.annotations[{key}]: must be a string")
    if problems:
        name = node["metadata"]["name"]
        raise StatusError(422, "Invalid", f'Node "{name}" is invalid: {"; ".join(problems)}',
                          {"name": name, "kind": "Node"})


def _label_selector(text: str) -> Callable[[dict[str, str]], bool]:
    """Equality-based selectors (``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``), comma-separated."""
    tests: list[Callable[[dict[str, str]], bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            tests.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            tests.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif term.startswith("!"):
            tests.append(lambda labels, k=term[1:]: k not in labels)
        elif term.replace("/", "").replace(".", "").replace("-", "").replace("_", "").isalnum():
            tests.append(lambda labels, k=term: k in labels)
        else:
            raise StatusError(400, "BadRequest", f"unable to parse requirement: {term!r}")
    return lambda labels: all(t(labels) for t in tests)


def _field_selector(text: str) -> Callable[[dict[str, Any]], bool]:
    tests: list[Callable[[dict[str, Any]], bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        negate = "!=" in term
        field, _, value = term.replace("!=", "=").replace("==", "=").partition("=")
        if field not in POD_FIELDS:
            raise StatusError(400, "BadRequest", f'field label not supported: {field}')
        section, _, key = field.partition(".")
        tests.append(lambda pod, s=section, k=key, v=value, n=negate:
                     ((pod.get(s) or {}).get(k, "") == v) != n)
    return lambda pod: all(t(pod) for t in tests)


def _schedule(pod: dict[str, Any], nodes: dict[str, dict[str, Any]],
              pods: list[dict[str, Any]]) -> str | None:
    """The first node, by name, that is schedulable, has the GPUs free, and whose taints the pod tolerates."""
    tolerations = pod["spec"].get("tolerations") or []
    for name, node in sorted(nodes.items()):
        spec = node.get("spec") or {}
        if spec.get("unschedulable"):
            continue
        used = sum(_gpus(p) for p in pods if p["spec"].get("nodeName") == name)
        if used + _gpus(pod) > int(node["status"]["allocatable"].get(GPU, "0")):
            continue
        blocking = [t for t in spec.get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
        if all(_tolerated(t, tolerations) for t in blocking):
            return name
    return None


def _gpus(pod: dict[str, Any]) -> int:
    containers = pod["spec"]["containers"]
    return sum(int((c.get("resources") or {}).get("limits", {}).get(GPU, "0")) for c in containers)


def _tolerated(taint: dict[str, str], tolerations: list[dict[str, str]]) -> bool:
    return any((tol.get("key") in (None, "", taint.get("key")))
               and (tol.get("operator") == "Exists" or tol.get("value", "") == taint.get("value", ""))
               and tol.get("effect") in (None, "", taint.get("effect")) for tol in tolerations)


@dataclass(frozen=True)
class Pki:
    """A throwaway CA with a server certificate for 127.0.0.1 and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.server_cert, self.server_key)
        context.load_verify_locations(self.ca)
        context.verify_mode = ssl.CERT_OPTIONAL  # a client certificate authenticates; a token does too
        return context


def make_pki(directory: Path) -> Pki:
    """Generate the certificates with ``openssl`` (EC keys: fast), as a cluster's CA would issue them."""
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=fake-kube-ca", "-days", "2")
    for name, cn, ext in (("server", "kube-apiserver", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                                        "extendedKeyUsage=serverAuth\n"),
                          ("client", "gpuhealth-webhook", "extendedKeyUsage=clientAuth\n")):
        (directory / f"{name}.ext").write_text(
            ext + "authorityKeyIdentifier=keyid,issuer\nbasicConstraints=CA:FALSE\n")
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")
    return Pki(ca=directory / "ca.crt", server_cert=directory / "server.crt",
               server_key=directory / "server.key", client_cert=directory / "client.crt",
               client_key=directory / "client.key")
