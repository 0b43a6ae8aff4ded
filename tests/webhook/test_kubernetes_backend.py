"""The Kubernetes backend against a fake API server that answers like kube-apiserver."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from fake_kube import FakeKube, Pki, make_pki
from gpuhealth.webhook.backends.base import BackendError
from gpuhealth.webhook.backends.kubernetes import (
    ACTION_ANNOTATION,
    ACTION_GPU_ANNOTATION,
    PRIOR_TAINTS_ANNOTATION,
    REASON_ANNOTATION,
    TAINT_KEY,
    KubernetesBackend,
)

REASON = "gpuhealth: GPUHealthXidFatal: XID 79 on gpu 3"
FOREIGN_TAINT = {"key": "example.com/maintenance", "value": "rack-7", "effect": "NoSchedule"}


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as fake:
        yield fake


def _backend(kube: FakeKube, tmp_path: Path, **settings: Any) -> KubernetesBackend:
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    return KubernetesBackend.from_config({"kubeconfig": str(config), **settings})


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _patches(kube: FakeKube) -> list[str]:
    return [ctype for method, _, ctype in kube.requests if method == "PATCH"]


async def test_drain_cordons_taints_and_annotates_once(kube, tmp_path):
    kube.add_node("gpu01", taints=[FOREIGN_TAINT], annotations={"team": "ml"})
    backend = _backend(kube, tmp_path)
    await backend.drain("gpu01", REASON)
    node = kube.nodes["gpu01"]
    assert node["spec"]["unschedulable"] is True
    ours = {"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}
    assert node["spec"]["taints"] == [FOREIGN_TAINT, ours]
    assert node["metadata"]["annotations"] == {"team": "ml", REASON_ANNOTATION: REASON,
                                               PRIOR_TAINTS_ANNOTATION: FOREIGN_TAINT["key"]}
    assert _patches(kube) == ["application/strategic-merge-patch+json"]
    state = await backend.node_state("gpu01")
    assert (state.exists, state.drained, state.reason) == (True, True, REASON)
    await backend.drain("gpu01", REASON)
    assert len(_patches(kube)) == 1, "draining a drained node must not write again"


async def test_a_cordon_set_by_someone_else_is_not_ours(kube, tmp_path):
    kube.add_node("gpu02", unschedulable=True,
                  taints=[{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}])
    kube.add_node("gpu03")
    backend = _backend(kube, tmp_path)
    foreign = await backend.node_state("gpu02")
    assert foreign.drained and foreign.exists
    assert not foreign.reason.startswith("gpuhealth:")
    assert "node.kubernetes.io/unschedulable" in foreign.reason
    healthy = await backend.node_state("gpu03")
    assert (healthy.drained, healthy.reason) == (False, "")
    missing = await backend.node_state("gpu99")
    assert (missing.exists, missing.drained) == (False, False)


async def test_resume_takes_back_only_our_changes(kube, tmp_path):
    kube.add_node("gpu01", taints=[FOREIGN_TAINT], annotations={"team": "ml"})
    backend = _backend(kube, tmp_path)
    await backend.drain("gpu01", REASON)
    await backend.reset_gpu("gpu01", "3", REASON)
    await backend.resume("gpu01")
    node = kube.nodes["gpu01"]
    assert node["spec"]["unschedulable"] is False
    assert node["spec"]["taints"] == [FOREIGN_TAINT]
    assert node["metadata"]["annotations"] == {"team": "ml"}
    assert not (await backend.node_state("gpu01")).drained
    writes = len(_patches(kube))
    await backend.resume("gpu01")
    await backend.resume("gone")
    assert len(_patches(kube)) == writes


async def test_resume_leaves_a_cordon_that_was_there_before_us(kube, tmp_path):
    kube.add_node("gpu01", unschedulable=True)
    backend = _backend(kube, tmp_path)
    await backend.drain("gpu01", REASON)
    assert (await backend.node_state("gpu01")).reason == REASON
    await backend.resume("gpu01")
    node = kube.nodes["gpu01"]
    assert node["spec"]["unschedulable"] is True
    assert "taints" not in node["spec"] or node["spec"]["taints"] == []
    assert node["metadata"]["annotations"] == {}
    assert not (await backend.node_state("gpu01")).reason.startswith("gpuhealth:")


async def test_a_node_a_human_put_back_in_service_is_not_drained(kube, tmp_path):
    kube.add_node("gpu01")
    backend = _backend(kube, tmp_path)
    await backend.drain("gpu01", REASON)
    kube.modify_node("gpu01", lambda node: node["spec"].update(unschedulable=False))
    assert (await backend.node_state("gpu01")).reason == REASON, "our taint still keeps GPU pods away"
    kube.modify_node("gpu01", lambda node: node["spec"].update(taints=[]))
    assert not (await backend.node_state("gpu01")).drained


async def test_a_blocking_taint_set_after_our_drain_makes_the_node_the_operators(kube, tmp_path):
    """The operator's ``kubectl taint`` on a node we drained: it is theirs now, as a Slurm drain with
    their reason would be; taints Kubernetes sets itself (a cordon's, a reboot's) change nothing."""
    kube.add_node("gpu01", taints=[FOREIGN_TAINT])
    backend = _backend(kube, tmp_path)
    await backend.drain("gpu01", REASON)
    system = [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
              {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
              {"key": "example.com/soft", "effect": "PreferNoSchedule"}]
    kube.modify_node("gpu01", lambda node: node["spec"]["taints"].extend(system))
    assert (await backend.node_state("gpu01")).reason == REASON
    repair = {"key": "example.com/repair", "value": "ticket-77", "effect": "NoExecute"}
    kube.modify_node("gpu01", lambda node: node["spec"]["taints"].append(repair))
    state = await backend.node_state("gpu01")
    assert state.drained
    assert state.reason == "tainted outside gpuhealth after its drain (taints: example.com/repair)"


async def test_merge_patch_is_available_too(kube, tmp_path):
    kube.add_node("gpu01")
    backend = _backend(kube, tmp_path, patch_type="merge")
    await backend.drain("gpu01", "XID 48")
    assert _patches(kube) == ["application/merge-patch+json"]
    assert (await backend.node_state("gpu01")).reason == "gpuhealth: XID 48"


async def test_a_concurrent_change_is_kept_through_a_409_conflict(kube, tmp_path):
    kube.add_node("gpu01")
    raced = []

    def operator_adds_a_taint(name: str) -> None:
        if not raced:
            raced.append(name)
            kube.modify_node(name, lambda node: node["spec"].setdefault("taints", []).append(FOREIGN_TAINT))

    kube.before_patch = operator_adds_a_taint
    await _backend(kube, tmp_path).drain("gpu01", REASON)
    assert len(_patches(kube)) == 2, "the first PATCH must have met a 409 and been recomputed"
    assert [t["key"] for t in kube.nodes["gpu01"]["spec"]["taints"]] == [FOREIGN_TAINT["key"], TAINT_KEY]


async def test_fleet_size_honours_the_selector_across_pages(kube, tmp_path):
    for i in range(1100):
        kube.add_node(f"n{i:04d}", labels={"nvidia.com/gpu.present": "true"} if i % 2 else {})
    backend = _backend(kube, tmp_path, node_selector="nvidia.com/gpu.present=true")
    assert await backend.fleet_size() == 550
    lists = [path for method, path, _ in kube.requests
             if method == "GET" and path.startswith("/api/v1/nodes?")]
    assert len(lists) == 2 and "continue=" in lists[1]
    assert await _backend(kube, tmp_path).fleet_size() == 1100


async def test_jobs_on_node_are_the_movable_gpu_pods_with_jobs_collapsed(kube, tmp_path):
    kube.add_node("gpu01")
    kube.add_node("gpu02")
    kube.add_pod("ml", "train-0", "gpu01", gpus=8, job="train")
    kube.add_pod("ml", "train-1", "gpu01", gpus=8, job="train")
    kube.add_pod("ml", "notebook", "gpu01", gpus=1)
    kube.add_pod("ml", "serve-0", "gpu01", gpus=2, owner_kind="StatefulSet")
    kube.add_pod("ml", "cpu-only", "gpu01")
    kube.add_pod("ml", "finished", "gpu01", gpus=8, phase="Succeeded")
    kube.add_pod("ml", "elsewhere", "gpu02", gpus=8)
    kube.add_pod("gpuhealth", "node-agent-x1", "gpu01", gpus=1, owner_kind="DaemonSet")
    static = kube.add_pod("kube-system", "gpu-burn-gpu01", "gpu01", gpus=8)
    static["metadata"]["annotations"] = {"kubernetes.io/config.mirror": "abc123"}
    jobs = await _backend(kube, tmp_path).jobs_on_node("gpu01")
    assert jobs == ["ml/job/train", "ml/notebook", "ml/serve-0"]
    assert ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu01&limit=500", "") in kube.requests


async def test_eviction_is_retried_through_disruption_budget_429s(kube, tmp_path):
    kube.add_node("gpu01")
    kube.add_pod("ml", "notebook", "gpu01", gpus=1)
    kube.pdb_blocks[("ml", "notebook")] = 2
    await _backend(kube, tmp_path, eviction_backoff_seconds=0.01).requeue("ml/notebook", [])
    assert ("ml", "notebook") not in kube.pods
    posts = [path for method, path, _ in kube.requests if method == "POST"]
    assert posts == ["/api/v1/namespaces/ml/pods/notebook/eviction"] * 3


async def test_eviction_gives_up_after_the_deadline(kube, tmp_path):
    kube.add_node("gpu01")
    kube.add_pod("ml", "notebook", "gpu01", gpus=1)
    kube.pdb_blocks[("ml", "notebook")] = float("inf")
    backend = _backend(kube, tmp_path, eviction_backoff_seconds=0.02, eviction_deadline_seconds=0.2)
    with pytest.raises(BackendError) as exc:
        await backend.requeue("ml/notebook", [])
    assert exc.value.retryable
    assert "disruption budget" in str(exc.value) and "0.2s" in str(exc.value)
    assert ("ml", "notebook") in kube.pods
    assert sum(method == "POST" for method, _, _ in kube.requests) >= 3


async def test_evicting_a_pod_that_is_gone_is_done(kube, tmp_path):
    await _backend(kube, tmp_path).requeue("ml/vanished", ["gpu01"])
    assert ("POST", "/api/v1/namespaces/ml/pods/vanished/eviction", "application/json") in kube.requests


async def test_restarting_a_job_recreates_its_pods_off_the_drained_node(kube, tmp_path):
    for name in ("gpu01", "gpu02", "gpu03"):
        kube.add_node(name)
    kube.add_pod("ml", "train-0", "gpu01", gpus=8, job="train")
    kube.add_pod("ml", "train-1", "gpu02", gpus=8, job="train")
    kube.add_pod("ml", "other-0", "gpu01", gpus=8, job="other")
    backend = _backend(kube, tmp_path)
    await backend.drain("gpu01", REASON)
    await backend.requeue("ml/job/train", ["gpu01"])
    pods = kube.pods_of_job("ml", "train")
    # train-0's replacement finds gpu02 still full; train-1's takes the GPUs it freed
    assert [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in pods] == [("train-r1", "gpu03"),
                                                                              ("train-r2", "gpu02")]
    assert [p["metadata"]["name"] for p in kube.pods_of_job("ml", "other")] == ["other-0"]


async def test_restart_can_be_limited_to_the_pods_on_the_excluded_nodes(kube, tmp_path):
    for name in ("gpu01", "gpu02"):
        kube.add_node(name)
    kube.add_pod("ml", "train-0", "gpu01", gpus=8, job="train")
    kube.add_pod("ml", "train-1", "gpu02", gpus=8, job="train")
    backend = _backend(kube, tmp_path, job_pods="on_excluded_nodes")
    await backend.drain("gpu01", REASON)
    await backend.requeue("ml/job/train", ["gpu01"])
    assert sorted(p["metadata"]["name"] for p in kube.pods_of_job("ml", "train")) == ["train-1", "train-r1"]


async def test_a_job_id_of_another_backend_is_refused(kube, tmp_path):
    with pytest.raises(BackendError, match="not a Kubernetes job id") as exc:
        await _backend(kube, tmp_path).requeue("12345", [])
    assert not exc.value.retryable


async def test_reboot_and_gpu_reset_are_requested_from_the_node_agent(kube, tmp_path):
    kube.add_node("gpu01")
    backend = _backend(kube, tmp_path)
    await backend.reset_gpu("gpu01", "3", REASON)
    annotations = kube.nodes["gpu01"]["metadata"]["annotations"]
    assert (annotations[ACTION_ANNOTATION], annotations[ACTION_GPU_ANNOTATION]) == ("reset-gpu", "3")
    await backend.reset_gpu("gpu01", "3", REASON)
    assert len(_patches(kube)) == 1
    await backend.reboot("gpu01", REASON)
    annotations = kube.nodes["gpu01"]["metadata"]["annotations"]
    assert annotations[ACTION_ANNOTATION] == "reboot" and ACTION_GPU_ANNOTATION not in annotations
    with pytest.raises(BackendError, match="node_actions is 'none'") as exc:
        await _backend(kube, tmp_path, node_actions="none").reboot("gpu01", REASON)
    assert not exc.value.retryable


async def test_reboot_and_gpu_reset_can_run_a_site_command_instead(kube, tmp_path):
    kube.add_node("gpu01")
    backend = _backend(kube, tmp_path, node_actions="command", node_commands={
        "reset_gpu": ["touch", str(tmp_path / "reset-{node}-{gpu}-{alertname}")],
        "reboot": ["false"]})
    await backend.reset_gpu("gpu01", "3", REASON, alertname="GPUHealthXidFatal")
    assert (tmp_path / "reset-gpu01-3-GPUHealthXidFatal").exists()
    assert kube.requests == [], "a command replaces the node annotation"
    with pytest.raises(BackendError, match="false: exit 1") as exc:
        await backend.reboot("gpu01", REASON)
    assert exc.value.retryable


async def test_api_errors_say_whether_a_retry_can_help(kube, tmp_path):
    kube.add_node("gpu01")
    backend = _backend(kube, tmp_path, request_timeout_seconds=0.2)
    kube.forbidden.add(("patch", "nodes"))
    with pytest.raises(BackendError, match='cannot patch resource "nodes"') as exc:
        await backend.drain("gpu01", REASON)
    assert not exc.value.retryable
    with pytest.raises(BackendError, match="404 NotFound") as exc:
        await backend.drain("gpu99", REASON)
    assert not exc.value.retryable
    kube.fail_next.append(503)
    with pytest.raises(BackendError, match="503") as exc:
        await backend.jobs_on_node("gpu01")
    assert exc.value.retryable
    kube.delay_s = 0.5
    with pytest.raises(BackendError, match=r"no answer within 0\.2s") as exc:
        await backend.fleet_size()
    assert exc.value.retryable
    kube.delay_s = 0.0
    kube.token = "rotated"
    with pytest.raises(BackendError, match="401 Unauthorized"):
        await backend.fleet_size()


async def test_the_fake_refuses_what_the_real_api_server_refuses(kube):
    kube.add_node("gpu01")
    headers = {"Authorization": f"Bearer {kube.token}"}
    async with aiohttp.ClientSession() as http:
        async with http.patch(f"{kube.url}/api/v1/nodes/gpu01", json={"spec": {"unschedulable": True}},
                              headers=headers) as resp:
            body = await resp.json()
            assert (resp.status, body["kind"], body["reason"]) == (415, "Status", "UnsupportedMediaType")
        eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "y"}}
        async with http.post(f"{kube.url}/api/v1/namespaces/ml/pods/x/eviction", headers=headers,
                             json=eviction) as resp:
            assert resp.status == 400
        async with http.get(f"{kube.url}/api/v1/nodes") as resp:
            assert (resp.status, (await resp.json())["reason"]) == (401, "Unauthorized")


async def test_client_certificate_over_verified_tls(pki, tmp_path):
    async with FakeKube(tls=pki.server_context()) as kube:
        kube.add_node("gpu01")
        config = kube.write_kubeconfig(tmp_path / "cert.yaml",
                                       {"client-certificate-data": _b64(pki.client_cert),
                                        "client-key-data": _b64(pki.client_key)},
                                       {"certificate-authority-data": _b64(pki.ca)})
        await KubernetesBackend.from_config({"kubeconfig": str(config)}).drain("gpu01", REASON)
        assert kube.nodes["gpu01"]["spec"]["unschedulable"] is True

        other_ca = make_pki(tmp_path / "other").ca
        wrong = kube.write_kubeconfig(tmp_path / "wrong.yaml",
                                      cluster={"certificate-authority": str(other_ca)})
        with pytest.raises(BackendError, match="TLS verification failed") as exc:
            await KubernetesBackend.from_config({"kubeconfig": str(wrong)}).fleet_size()
        assert not exc.value.retryable
        skip = kube.write_kubeconfig(tmp_path / "skip.yaml", cluster={"insecure-skip-tls-verify": True})
        assert await KubernetesBackend.from_config({"kubeconfig": str(skip)}).fleet_size() == 1


async def test_in_cluster_service_account_with_a_rotating_token(pki, tmp_path, monkeypatch):
    async with FakeKube(token="sa-1", tls=pki.server_context()) as kube:
        kube.add_node("gpu01")
        sa = tmp_path / "serviceaccount"
        sa.mkdir()
        (sa / "token").write_text("sa-1")
        (sa / "ca.crt").write_bytes(pki.ca.read_bytes())
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", kube.url.rsplit(":", 1)[1])
        backend = KubernetesBackend.from_config({"service_account_dir": str(sa)})
        assert await backend.fleet_size() == 1
        kube.token = "sa-2"
        (sa / "token").write_text("sa-2")
        assert (await backend.node_state("gpu01")).exists


def _documented_cluster_role() -> set[tuple[str, str]]:
    text = (Path(__file__).parents[2] / "webhook" / "KUBERNETES.md").read_text()
    for block in text.split("```yaml")[1:]:
        for doc in yaml.safe_load_all(block.split("```")[0]):
            if doc and doc.get("kind") == "ClusterRole":
                return {(verb, resource) for rule in doc["rules"] if rule["apiGroups"] == [""]
                        for resource in rule["resources"] for verb in rule["verbs"]}
    raise AssertionError("no ClusterRole in webhook/KUBERNETES.md")


async def test_the_documented_cluster_role_is_exactly_what_the_backend_uses(kube, tmp_path):
    for name in ("gpu01", "gpu02"):
        kube.add_node(name)
    kube.add_pod("ml", "train-0", "gpu01", gpus=8, job="train")
    kube.add_pod("ml", "notebook", "gpu01", gpus=1)
    backend = _backend(kube, tmp_path)
    await backend.fleet_size()
    await backend.drain("gpu01", REASON)
    for job in await backend.jobs_on_node("gpu01"):
        await backend.requeue(job, ["gpu01"])
    await backend.reset_gpu("gpu01", "0", REASON)
    await backend.reboot("gpu01", REASON)
    await backend.resume("gpu01")
    assert kube.used == _documented_cluster_role()
