"""The whole webhook on the Kubernetes backend: an alert in, a cordoned node and moved GPU work out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from fake_kube import FakeKube
from gpuhealth.webhook.backends.kubernetes import REASON_ANNOTATION, TAINT_KEY, KubernetesBackend
from webhook_helpers import alert, resolved


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as fake:
        yield fake


async def test_alert_to_cordon_eviction_job_restart_and_back(webhook, kube, tmp_path):
    for name in ("gpu01", "gpu02", "gpu03"):
        kube.add_node(name, labels={"nvidia.com/gpu.present": "true"})
    kube.add_node("gpu04", labels={"nvidia.com/gpu.present": "true"}, unschedulable=True)
    kube.add_node("cpu01", gpus=0)
    kube.add_pod("ml", "train-0", "gpu01", gpus=8, job="train")
    kube.add_pod("ml", "train-1", "gpu02", gpus=8, job="train")
    kube.add_pod("ml", "notebook", "gpu01", gpus=1)
    kube.add_pod("ml", "infer", "gpu04", gpus=1)
    kube.pdb_blocks[("ml", "notebook")] = 1
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    backend = KubernetesBackend.from_config({"kubeconfig": str(config), "eviction_backoff_seconds": 0.01,
                                             "node_selector": "nvidia.com/gpu.present=true"})
    hook = await webhook(backend=backend)

    firing = alert("gpu01", action="drain", summary="row remap failure")
    await hook.post(firing, alert("gpu04", action="drain_reboot"))
    actions = await hook.settle()
    assert [(a["node"], a["state"], a["reason"]) for a in actions] == [
        ("gpu01", "done", "ok"), ("gpu04", "skipped", "drained_by_other")]

    node = kube.nodes["gpu01"]
    assert node["spec"]["unschedulable"] is True
    assert [t["key"] for t in node["spec"]["taints"]] == [TAINT_KEY]
    reason = node["metadata"]["annotations"][REASON_ANNOTATION]
    assert reason == "gpuhealth: GPUHealthXidFatal: row remap failure"
    assert ("ml", "notebook") not in kube.pods
    evictions = [path for _, path, _ in kube.requests if path.endswith("/notebook/eviction")]
    assert len(evictions) == 2  # one 429 from the disruption budget, then evicted
    train = kube.pods_of_job("ml", "train")
    assert [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in train] == [("train-r1", "gpu03"),
                                                                               ("train-r2", "gpu02")]
    assert kube.nodes["gpu04"]["metadata"]["annotations"] == {}
    assert ("ml", "infer") in kube.pods
    assert not any(method == "PATCH" and "gpu04" in path for method, path, _ in kube.requests)
    assert [d["node"] for d in (await hook.call("GET", "/status"))["drained_by_us"]] == ["gpu01"]

    await hook.post(resolved(firing))
    actions = await hook.settle()
    assert (actions[-1]["kind"], actions[-1]["state"]) == ("undrain", "done")
    node = kube.nodes["gpu01"]
    assert node["spec"]["unschedulable"] is False and not node["spec"]["taints"]
    assert node["metadata"]["annotations"] == {}
    assert kube.nodes["gpu04"]["spec"]["unschedulable"] is True


async def test_an_operators_taint_after_our_drain_is_never_undone(webhook, kube, tmp_path):
    kube.add_node("gpu01", labels={"nvidia.com/gpu.present": "true"})
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    hook = await webhook(backend=KubernetesBackend.from_config({"kubeconfig": str(config)}))
    firing = alert("gpu01", action="drain")
    await hook.post(firing)
    assert [a["reason"] for a in await hook.settle()] == ["ok"]
    repair = {"key": "example.com/repair", "value": "psu", "effect": "NoSchedule"}
    kube.modify_node("gpu01", lambda node: node["spec"]["taints"].append(repair))
    await hook.post(resolved(firing))
    undrain = (await hook.settle())[-1]
    assert (undrain["kind"], undrain["state"], undrain["reason"]) == ("undrain", "skipped",
                                                                      "drained_by_other")
    node = kube.nodes["gpu01"]
    assert node["spec"]["unschedulable"] is True and repair in node["spec"]["taints"]
    assert [d["node"] for d in (await hook.call("GET", "/status"))["drained_by_us"]] == []
