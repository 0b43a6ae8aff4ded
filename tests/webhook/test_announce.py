"""Telling people: the JSON-lines audit log, cancelling a running action between its steps, and the
GPUHealthRemediation* alerts as a real Alertmanager receives them through its API v2."""

from __future__ import annotations

import json

import aiohttp
import pytest
from waiting import eventually
from webhook_helpers import alert

from gpuhealth.local.prometheus import AlertmanagerServer

PREDICTIVE = {"action": "checkpoint_drain", "alertname": "GPUHealthGpuFailureRisk", "severity": "warning"}


def audit(tmp_path) -> list[dict]:
    path = tmp_path / "state" / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_every_transition_of_an_action_is_in_the_audit_log(webhook, tmp_path):
    hook = await webhook(jobs={"gpu01": ["11"]})
    await hook.post(alert("gpu01", action="drain_reboot"))
    [action] = await hook.until(lambda acts: acts[0]["state"] == "done", "the action to end")
    records = [r for r in audit(tmp_path) if r["id"] == action["id"]]
    assert [(r["event"], r.get("step")) for r in records] == [
        ("started", None), ("step_done", "drain"), ("step_done", "requeue"), ("step_done", "reboot"),
        ("done", None)]
    assert records[-1]["node"] == "gpu01" and records[-1]["kind"] == "drain_reboot"
    assert records[-1]["reason"] == "ok" and records[0]["ts"] <= records[-1]["ts"]


async def test_a_running_action_is_cancelled_between_its_steps(webhook, tmp_path):
    hook = await webhook(jobs={"gpu02": ["12"]}, checkpoint={"grace_seconds": 3, "poll_seconds": 0.05})
    await hook.post(alert("gpu02", **PREDICTIVE))
    [running] = await eventually(hook.actions, lambda acts: acts and acts[0]["state"] == "running",
                                 timeout=20, what="the checkpoint wait")
    cancelled = await hook.call("POST", f"/actions/{running['id']}/cancel")
    assert cancelled["state"] == "cancelled"

    async def events() -> list[str]:
        return [r["event"] for r in audit(tmp_path)]
    seen = await eventually(events, lambda e: e[-1] == "cancelled" and e.count("cancelled") == 2, timeout=20,
                            what="the engine to stop before the drain")
    assert seen[:2] == ["started", "cancelled"], seen
    assert [entry[0] for entry in hook.backend.history] == ["signal"], "the drain never ran"
    assert hook.drained == {}
    assert (await hook.call("GET", f"/actions/{running['id']}"))["state"] == "cancelled"


async def test_a_finished_action_cannot_be_cancelled(webhook):
    hook = await webhook(jobs={"gpu03": ["13"]})
    await hook.post(alert("gpu03"))
    [action] = await hook.until(lambda acts: acts[0]["state"] == "done", "the action to end")
    await hook.call("POST", f"/actions/{action['id']}/cancel", expect=409)


def _am_config() -> dict:
    return {"route": {"receiver": "people", "group_wait": "0s"}, "receivers": [{"name": "people"}]}


async def _am_alerts(session: aiohttp.ClientSession, url: str) -> list[dict]:
    async with session.get(f"{url}/api/v2/alerts") as resp:
        assert resp.status == 200
        return [a for a in await resp.json() if a["labels"]["alertname"].startswith("GPUHealthRemediation")]


@pytest.mark.slow
async def test_outcomes_and_breaker_trips_reach_alertmanager(webhook, tmp_path):
    am = AlertmanagerServer(tmp_path / "am", _am_config())
    am.start()
    try:
        hook = await webhook(jobs={"gpu04": ["14"]}, announce={"alertmanager_urls": [am.url]},
                             guardrails={"breaker_max_nodes": 1})
        await hook.post(alert("gpu04", action="drain", alertname="GPUHealthXidDrain", severity="warning"))
        await hook.until(lambda acts: acts[0]["state"] == "done", "the drain to end")
        async with aiohttp.ClientSession() as session:
            alerts = await eventually(lambda: _am_alerts(session, am.url),
                                      lambda got: any(a["labels"]["alertname"].endswith("Succeeded")
                                                      for a in got),
                                      timeout=20, what="the outcome alert in Alertmanager")
            [done] = [a for a in alerts if a["labels"]["alertname"].endswith("Succeeded")]
            assert done["labels"] | {"action_id": "x"} == {
                "alertname": "GPUHealthRemediationSucceeded", "severity": "info", "node": "gpu04",
                "gpu": "0", "remediation": "drain", "source_alertname": "GPUHealthXidDrain", "action_id": "x"}
            assert "action" not in done["labels"], "never routed back to the webhook as a request to act"

            await hook.post(alert("gpu05", action="drain"))  # a second drained node trips the breaker
            await hook.until(lambda acts: any(a["reason"] == "breaker_open" for a in acts),
                             "the breaker trip")
            alerts = await eventually(lambda: _am_alerts(session, am.url),
                                      lambda got: any(a["labels"]["alertname"].endswith("BreakerOpen")
                                                      for a in got), timeout=20, what="the breaker alert")
            [trip] = [a for a in alerts if a["labels"]["alertname"] == "GPUHealthRemediationBreakerOpen"]
            assert trip["labels"]["severity"] == "critical" and trip["labels"]["node"] == "gpu05"
            assert "circuit breaker tripped" in trip["annotations"]["description"]
            assert not any(a["labels"]["alertname"] == "GPUHealthRemediationStarted" for a in alerts), \
                "the started alert resolves when the action ends"
    finally:
        am.stop()


@pytest.mark.slow
async def test_an_exhausted_escalation_chain_reaches_alertmanager(webhook, tmp_path):
    am = AlertmanagerServer(tmp_path / "am", _am_config())
    am.start()
    try:
        hook = await webhook(announce={"alertmanager_urls": [am.url]},
                             escalation={"enabled": True, "settle_seconds": 0, "poll_seconds": 0.05,
                                         "steps": ["drain_reset_gpu", "replace"],
                                         "step_timeout_seconds": {"drain_reset_gpu": 0.2}})
        await hook.post(alert("gpu06", action="drain_reset_gpu", gpu="4", alertname="GPUHealthXidResetGpu"))
        async with aiohttp.ClientSession() as session:
            alerts = await eventually(lambda: _am_alerts(session, am.url),
                                      lambda got: any(a["labels"]["alertname"].endswith("ChainExhausted")
                                                      for a in got), timeout=30, what="the exhausted chain")
        [exhausted] = [a for a in alerts if a["labels"]["alertname"] == "GPUHealthRemediationChainExhausted"]
        assert exhausted["labels"] | {"action_id": "x"} == {
            "alertname": "GPUHealthRemediationChainExhausted", "severity": "warning", "node": "gpu06",
            "gpu": "4", "remediation": "replace", "source_alertname": "GPUHealthXidResetGpu",
            "action_id": "x"}
        assert "a person decides" in exhausted["annotations"]["description"]
        assert [r["event"] for r in audit(tmp_path) if r["event"].startswith("chain_")] == [
            "chain_opened", "chain_verifying", "chain_escalated", "chain_exhausted"]
    finally:
        am.stop()
