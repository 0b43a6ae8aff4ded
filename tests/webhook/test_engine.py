"""The decision engine through the real app: every action and guardrail, on a simulated cluster."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest
from gpuhealth.webhook.backends.base import BackendError
from gpuhealth.webhook.backends.simulated import SimulatedBackend
from gpuhealth.webhook.config import VALIDATE_OVER_SSH, parse_config
from webhook_helpers import alert, recorded, resolved


async def test_drain_requeues_jobs_excluding_the_node(webhook):
    hook = await webhook(jobs={"gpu03": ["101", "102"], "gpu04": ["103"]})
    await hook.post(alert("gpu03", action="drain", summary="row remap failure"))
    [action] = await hook.settle()
    assert (action["kind"], action["state"], action["outcome"]) == ("drain", "done", "done")
    assert hook.drained == {"gpu03": "gpuhealth: GPUHealthXidFatal: row remap failure"}
    assert hook.backend.history[1:] == [["requeue", "101", ["gpu03"]], ["requeue", "102", ["gpu03"]]]
    assert hook.backend.state["jobs"]["103"]["node"] == "gpu04"
    status = await hook.call("GET", "/status")
    assert [d["node"] for d in status["drained_by_us"]] == ["gpu03"]
    done = await hook.metric("gpuhealth_webhook_actions_total", action="drain", outcome="done", reason="ok")
    assert done == 1
    assert await hook.metric("gpuhealth_webhook_nodes_drained") == 1
    assert await hook.metric("gpuhealth_webhook_notification_to_action_seconds_count") == 1


async def test_each_action_runs_its_chain(webhook):
    hook = await webhook(jobs={"gpu01": ["1"], "gpu02": ["2"], "gpu03": ["3"], "gpu04": ["4"]})
    await hook.post(alert("gpu01", action="restart_job"), alert("gpu02", action="drain_reset_gpu", gpu="5"),
                    alert("gpu03", action="drain_reboot"), alert("gpu04", action="replace"),
                    alert("gpu05", action="none"))
    actions = await hook.settle()
    assert [(a["kind"], a["state"], a["reason"]) for a in actions] == [
        ("restart_job", "done", "ok"), ("drain_reset_gpu", "done", "ok"), ("drain_reboot", "done", "ok"),
        ("replace", "done", "ok"), ("none", "done", "record_only")]
    ops = sorted((op[0], op[1]) for op in hook.backend.history)
    assert ops == [("drain", "gpu02"), ("drain", "gpu03"), ("drain", "gpu04"), ("reboot", "gpu03"),
                   ("requeue", "1"), ("requeue", "2"), ("requeue", "3"), ("requeue", "4"),
                   ("reset_gpu", "gpu02")]
    assert ["reset_gpu", "gpu02", "5", hook.drained["gpu02"]] in hook.backend.history
    assert "gpu01" not in hook.drained  # restart_job never drains
    assert hook.drained["gpu04"].startswith("gpuhealth: GPUHealthXidFatal: replace requested")


async def test_recorded_notification_is_acted_on_once_across_duplicate_deliveries(webhook):
    hook = await webhook()
    first = await hook.post(*recorded("firing_node_group")["alerts"])
    again = await hook.post(*recorded("firing_node_group")["alerts"])  # the HA peer, or a retry
    assert len(first["new_actions"]) == 3 and again["new_actions"] == [] and again["duplicates"] == 3
    actions = await hook.settle()
    assert len(actions) == 3
    assert [op[0] for op in hook.backend.history].count("drain") == 1
    assert await hook.metric("gpuhealth_webhook_notifications_total", outcome="duplicate") == 1


async def test_resolution_undrains_only_when_every_draining_alert_resolved(webhook):
    hook = await webhook()
    firing = recorded("firing_node_group")["alerts"]
    await hook.post(*firing)
    await hook.settle()
    assert "gpu02" in hook.drained
    await hook.post(*recorded("partly_resolved_node_group")["alerts"])
    actions = await hook.settle()
    assert "gpu02" in hook.drained
    assert actions[-1]["kind"] == "undrain" and actions[-1]["reason"] == "still_firing"
    await hook.post(*recorded("resolved_node_group")["alerts"])
    await hook.settle()
    assert hook.drained == {}
    assert hook.backend.history[-1] == ["resume", "gpu02"]
    assert (await hook.call("GET", "/status"))["drained_by_us"] == []


async def test_undrain_waits_for_a_passing_health_check(webhook, tmp_path):
    flag = tmp_path / "healthy"
    hook = await webhook(undrain={"health_check": ["test", "-e", str(flag)],
                                  "health_check_retry_seconds": 0.2, "health_check_max_attempts": 50})
    first = alert("gpu07", action="drain")
    await hook.post(first)
    await hook.settle()
    await hook.post(resolved(first))
    actions = await hook.settle()
    assert actions[-1]["state"] == "running" and actions[-1]["reason"] == "health_check_failed"
    assert "gpu07" in hook.drained
    flag.touch()
    await hook.until(lambda a: a[-1]["state"] == "done", "the undrain after the health check passed", 10)
    assert hook.drained == {}


async def test_manual_undrain_mode_leaves_the_node_for_a_human(webhook):
    hook = await webhook(undrain={"mode": "manual"})
    first = alert("gpu07", action="drain")
    await hook.post(first)
    await hook.settle()
    await hook.post(resolved(first))
    actions = await hook.settle()
    assert (actions[-1]["kind"], actions[-1]["reason"]) == ("undrain", "left_for_human")
    assert "gpu07" in hook.drained


async def test_resolution_before_the_action_started_cancels_it(webhook):
    hook = await webhook(guardrails={"require_approval": ["drain"]})
    first = alert("gpu09", action="drain")
    await hook.post(first)
    [waiting] = await hook.settle()
    assert waiting["state"] == "awaiting_approval"
    await hook.post(resolved(first))
    [action] = await hook.settle()
    assert (action["state"], action["reason"]) == ("cancelled", "resolved")
    assert hook.backend.history == []
    assert await hook.metric("gpuhealth_webhook_actions_total", action="drain", outcome="cancelled",
                             reason="resolved") == 1


async def test_storm_over_half_the_fleet_trips_the_breaker_at_the_cap(webhook):
    hook = await webhook(guardrails={"breaker_max_nodes": 3, "breaker_max_fraction": 0.5})
    storm = [alert(f"gpu{i:02d}", action="drain") for i in range(1, 9)]
    await hook.post(*storm)
    actions = await hook.settle()
    assert len(hook.drained) == 3
    assert sum(a["reason"] == "breaker_open" for a in actions) == 5
    status = await hook.call("GET", "/status")
    assert status["breaker"]["open"] and "cap is 3" in status["breaker"]["reason"]
    assert await hook.metric("gpuhealth_webhook_breaker_open") == 1
    # Tripped: nothing acts any more, not even a job restart, until an operator resets it.
    await hook.post(alert("gpu12", action="restart_job"), resolved(storm[0]))
    held = await hook.settle()
    assert [(a["kind"], a["reason"]) for a in held[-2:]] == [("restart_job", "breaker_open"),
                                                           ("undrain", "breaker_open")]
    assert "gpu01" in hook.drained
    await hook.client.post("/breaker/reset")  # no credentials
    assert (await hook.call("GET", "/status"))["breaker"]["open"]
    await hook.call("POST", "/breaker/reset")
    assert not (await hook.call("GET", "/status"))["breaker"]["open"]
    undrain = (await hook.settle())[-1]
    assert (undrain["kind"], undrain["state"]) == ("undrain", "done")  # re-armed by the reset
    assert "gpu01" not in hook.drained
    await hook.post(alert("gpu13", action="restart_job"))
    assert (await hook.settle())[-1]["reason"] == "ok"


async def test_breaker_fraction_counts_against_the_fleet(webhook):
    hook = await webhook(guardrails={"breaker_max_nodes": 100, "breaker_max_fraction": 0.125})
    await hook.post(*[alert(f"gpu{i:02d}", action="drain_reboot") for i in range(1, 9)])
    await hook.settle()
    assert len(hook.drained) == 2  # 12.5 % of 16 nodes


async def test_the_breaker_counts_our_drains_from_the_journal_until_their_alerts_resolve(webhook):
    """What the cluster reports does not shrink the count: a node a human resumed while its alert
    still fires stays counted, and leaves the count once the alert resolves."""
    hook = await webhook(guardrails={"breaker_max_nodes": 1})
    first = alert("gpu01", action="drain")
    await hook.post(first)
    await hook.settle()
    await hook.backend.resume("gpu01")  # an operator put it back in service
    await hook.post(alert("gpu02", action="drain"))
    assert (await hook.settle())[-1]["reason"] == "breaker_open"
    await hook.call("POST", "/breaker/reset")
    await hook.post(resolved(first))
    undrain = (await hook.settle())[-1]
    assert (undrain["kind"], undrain["reason"]) == ("undrain", "already_resumed")
    await hook.post(alert("gpu03", action="drain"))
    assert (await hook.settle())[-1]["reason"] == "ok" and set(hook.drained) == {"gpu03"}


async def test_manual_approval(webhook):
    hook = await webhook(guardrails={"require_approval": ["drain_reboot"]})
    await hook.post(alert("gpu05", action="drain_reboot"), alert("gpu06", action="drain_reboot"))
    first, second = await hook.settle()
    assert first["state"] == second["state"] == "awaiting_approval"
    assert hook.backend.history == []
    assert await hook.metric("gpuhealth_webhook_queue_depth") == 2
    resp = await hook.client.post(f"/actions/{first['id']}/approve")
    assert resp.status == 401
    await hook.call("POST", f"/actions/{first['id']}/approve")
    await hook.call("POST", f"/actions/{second['id']}/cancel")
    first, second = await hook.settle()
    assert (first["state"], second["state"], second["reason"]) == ("done", "cancelled", "operator")
    assert set(hook.drained) == {"gpu05"}
    await hook.call("POST", f"/actions/{first['id']}/approve", expect=409)
    await hook.call("POST", "/actions/999/cancel", expect=404)
    detail = await hook.call("GET", f"/actions/{first['id']}")
    assert [t["state"] for t in detail["transitions"]] == ["awaiting_approval", "pending", "running", "done"]
    assert "approved by intake token" in detail["transitions"][1]["detail"]


async def test_cooldown_defers_and_never_holds_back_an_escalation_or_a_redrain(webhook):
    hook = await webhook(guardrails={"node_cooldown_seconds": 3600})
    await hook.post(alert("gpu01", action="restart_job"))
    first = (await hook.settle())[0]
    again = alert("gpu01", action="restart_job")
    await hook.post(again, alert("gpu02", action="restart_job"))
    actions = await hook.settle()
    assert [(a["node"], a["state"], a["reason"]) for a in actions] == [
        ("gpu01", "done", "ok"), ("gpu01", "pending", "cooldown"), ("gpu02", "done", "ok")]
    assert actions[1]["next_at"] == pytest.approx(first["started_at"] + 3600)
    drain = alert("gpu01", action="drain")  # stronger than a requeue: neither the cooldown nor the
    await hook.post(drain)                  # requeue waiting it out ahead of it hold it back
    assert (await hook.settle())[-1]["reason"] == "ok" and "gpu01" in hook.drained
    await hook.post(resolved(again))  # resolved while it waited: it never runs
    assert (await hook.settle())[1]["state"] == "cancelled"
    await hook.post(resolved(drain))
    assert (await hook.settle())[-1]["kind"] == "undrain" and "gpu01" not in hook.drained
    await hook.post(alert("gpu01", action="drain"))  # flapping after our own undrain: drained again
    assert (await hook.settle())[-1]["reason"] == "ok" and "gpu01" in hook.drained


async def test_global_rate_limit_defers_the_excess(webhook):
    hook = await webhook(guardrails={"rate_limit_actions": 2, "rate_limit_window_seconds": 3600})
    await hook.post(*[alert(f"gpu{i:02d}", action="restart_job") for i in range(1, 5)])
    actions = await hook.settle()
    assert [a["state"] for a in actions] == ["done", "done", "pending", "pending"]
    assert {a["reason"] for a in actions[2:]} == {"rate_limited"}
    assert all(a["next_at"] > time.time() + 3000 for a in actions[2:])
    assert await hook.metric("gpuhealth_webhook_actions_total", action="restart_job", outcome="deferred",
                             reason="rate_limited") >= 2


async def test_nodes_drained_by_someone_else_are_never_touched(webhook):
    hook = await webhook(jobs={"gpu04": ["7"]})
    await hook.backend.drain("gpu04", "rack maintenance, ticket 4711")
    await hook.post(alert("gpu04", action="drain_reboot"), alert("gpu05", action="drain"))
    await hook.settle()
    await hook.backend.resume("gpu05")
    await hook.backend.drain("gpu05", "firmware update")  # re-drained by an operator meanwhile
    actions = await hook.settle()
    assert actions[0]["reason"] == "drained_by_other"
    assert hook.drained["gpu04"] == "rack maintenance, ticket 4711"
    assert hook.backend.state["jobs"]["7"]["node"] == "gpu04"
    await hook.post(resolved(alert("gpu05", action="drain", fingerprint=actions[1]["fingerprint"],
                                   starts_at="2026-11-30T05:00:00.5Z")))
    assert (await hook.settle())[-1]["reason"] == "drained_by_other"
    assert hook.drained["gpu05"] == "firmware update"


async def test_dry_run_journals_what_would_be_done_and_changes_nothing(webhook):
    hook = await webhook(dry_run=True, jobs={"gpu02": ["9"]})
    await hook.post(alert("gpu02", action="drain_reset_gpu", gpu="1"))
    [action] = await hook.settle()
    assert (action["state"], action["outcome"], action["reason"]) == ("done", "dry_run", "dry_run")
    assert action["detail"].startswith("would drain gpu02") and "reset GPU 1 on gpu02" in action["detail"]
    assert hook.backend.history == [] and hook.drained == {}
    assert (await hook.call("GET", "/status"))["dry_run"] is True


async def test_dry_run_tolerates_an_unreachable_cluster(webhook):
    class Unreachable(SimulatedBackend):
        async def node_state(self, node):
            raise BackendError("scontrol: cannot reach slurmctld")

    hook = await webhook(dry_run=True, backend=Unreachable(["gpu01"]))
    await hook.post(alert("gpu01"))
    [action] = await hook.settle()
    assert action["outcome"] == "dry_run"


async def test_allow_and_deny_lists(webhook):
    hook = await webhook(guardrails={"allow_nodes": ["gpu0*"], "deny_nodes": ["gpu02"]})
    await hook.post(alert("gpu01", action="restart_job"), alert("gpu02", action="restart_job"),
                    alert("gpu11", action="restart_job"), alert(None, action="drain"),
                    alert("nosuch", action="drain", fingerprint="f" * 16))
    actions = await hook.settle()
    assert [a["reason"] for a in actions] == ["ok", "denied", "not_allowed", "no_node", "not_allowed"]


async def test_unknown_or_multi_node_labels_are_skipped(webhook):
    hook = await webhook()
    await hook.post(alert("gpu99", action="drain"), alert("gpu[01-16]", action="drain"),
                    alert("ALL,gpu01", action="drain"), alert("-h", action="drain"))
    actions = await hook.settle()
    assert [a["reason"] for a in actions] == ["unknown_node", "invalid_node", "invalid_node", "invalid_node"]
    assert hook.backend.history == []


async def test_policy_rules_override_the_action_label(webhook):
    hook = await webhook(policy={"rules": [{"match": {"severity": "info"}, "action": "none"},
                                           {"match": {"alertname": "GPUHealthXid.*"}, "action": "replace"}]})
    await hook.post(alert("gpu01", action="drain", severity="info"),
                    alert("gpu02", action="drain", alertname="GPUHealthXidFatal"),
                    alert("gpu03", action="bogus", alertname="Other"),
                    alert("gpu04", action="", alertname="Other"))
    actions = await hook.settle()
    assert [a["kind"] for a in actions] == ["none", "replace", "unknown", "none"]
    # an action label the webhook does not know is refused, never mistaken for a deliberate "none";
    # an empty one falls back to default_action
    assert (actions[2]["state"], actions[2]["reason"]) == ("skipped", "unknown_action")
    assert "'bogus'" in actions[2]["detail"] and actions[3]["reason"] == "record_only"
    assert await hook.metric("gpuhealth_webhook_actions_total", action="unknown", outcome="skipped",
                             reason="unknown_action") == 1
    assert hook.backend.history == [["drain", "gpu02", hook.drained["gpu02"]]]


async def test_backend_errors_are_retried_with_backoff_then_failed(webhook):
    class Flaky(SimulatedBackend):
        failures = 2

        async def drain(self, node, reason, **alert):
            if self.failures:
                self.failures -= 1
                raise BackendError("slurm_update error: Socket timed out")
            await super().drain(node, reason, **alert)

        async def reboot(self, node, reason, **alert):
            raise BackendError("Invalid node name specified", retryable=False)

    hook = await webhook(backend=Flaky(["gpu01", "gpu02"]), retry={"backend_max_attempts": 5})
    await hook.post(alert("gpu01", action="drain"))
    actions = await hook.until(lambda a: a[0]["state"] == "done", "the drain after two failures")
    assert actions[0]["attempts"] == 2
    await hook.post(alert("gpu02", action="drain_reboot"))
    actions = await hook.settle()
    assert (actions[1]["state"], actions[1]["reason"]) == ("failed", "backend_error")
    assert "Invalid node name" in actions[1]["detail"]
    assert await hook.metric("gpuhealth_webhook_actions_total", action="drain", outcome="deferred",
                             reason="backend_error") == 2


async def test_a_job_that_keeps_failing_is_no_longer_requeued(webhook):
    hook = await webhook(jobs={"gpu01": ["42"]}, retry={"job_max_attempts": 2})
    for node in ("gpu01", "gpu02", "gpu03"):
        hook.backend.start_job("42", node)
        await hook.post(alert(node, action="drain"))
        await hook.settle()
    requeues = [op for op in hook.backend.history if op[0] == "requeue"]
    assert requeues == [["requeue", "42", ["gpu01"]], ["requeue", "42", ["gpu01", "gpu02"]]]
    status = await hook.call("GET", "/status")
    assert status["jobs_out_of_retries"][0]["job_id"] == "42"
    assert (await hook.actions())[-1]["progress"]["exhausted"] == ["42"]


async def test_job_retry_interval_paces_requeues(webhook):
    hook = await webhook(jobs={"gpu01": ["42"]}, retry={"job_retry_interval_seconds": 3600})
    await hook.post(alert("gpu01", action="restart_job"))
    await hook.settle()
    hook.backend.start_job("42", "gpu02")
    await hook.post(alert("gpu02", action="restart_job"))
    action = (await hook.settle())[-1]
    assert (action["state"], action["reason"]) == ("running", "job_retry_interval")
    assert action["next_at"] > time.time() + 3000


async def test_action_list_filters(webhook):
    hook = await webhook(guardrails={"deny_nodes": ["gpu02"]})
    before = time.time()
    await hook.post(alert("gpu01", action="restart_job"), alert("gpu02", action="restart_job"))
    await hook.settle()
    assert [a["node"] for a in await hook.actions(node="gpu02")] == ["gpu02"]
    assert [a["node"] for a in await hook.actions(state="skipped")] == ["gpu02"]
    assert len(await hook.actions(since=str(before - 1))) == 2
    assert await hook.actions(since="2999-01-01T00:00:00Z") == []
    for bad in ({"state": "bogus"}, {"since": "yesterday"}, {"limit": "0"}):
        assert (await hook.client.get("/actions", params=bad)).status == 400


async def test_cancel_while_the_worker_decides_wins(webhook):
    class Slow(SimulatedBackend):
        """Holds node_state until released, so that the operator's cancel lands mid-admission."""

        def __init__(self, nodes):
            super().__init__(nodes)
            self.asked, self.release = asyncio.Event(), asyncio.Event()

        async def node_state(self, node):
            self.asked.set()
            await self.release.wait()
            return await super().node_state(node)

    sim = Slow(["gpu01", "gpu02"])
    await sim.drain("gpu02", "maintenance by a human")
    hook = await webhook(backend=sim)
    for node in ("gpu01", "gpu02"):  # admitted to run / to be skipped, each cancelled meanwhile
        [action_id] = (await hook.post(alert(node, action="drain")))["new_actions"]
        await asyncio.wait_for(sim.asked.wait(), 10)
        await hook.call("POST", f"/actions/{action_id}/cancel")
        sim.asked.clear()
        sim.release.set()
        await hook.settle()
        sim.release.clear()
    actions = await hook.actions()
    assert [(a["state"], a["reason"]) for a in actions] == [("cancelled", "operator")] * 2
    assert hook.drained == {"gpu02": "maintenance by a human"}


async def test_a_gpu_step_needs_a_real_gpu_and_a_node_step_does_not(webhook):
    """``gpu="unknown"`` is the exporter's label for a kernel-log event it matched to no GPU: a reset
    cannot be aimed at it, a drain or reboot of the node still can."""
    hook = await webhook()
    body = await hook.post(alert("gpu01", action="drain_reset_gpu", gpu="unknown"),
                           alert("gpu02", action="drain_reset_gpu", gpu=None),
                           alert("gpu03", action="drain_reboot", gpu="unknown"))
    actions = await hook.settle()
    assert [(a["node"], a["state"], a["reason"]) for a in actions] == [
        ("gpu01", "skipped", "no_gpu"), ("gpu02", "skipped", "no_gpu"), ("gpu03", "done", "ok")]
    assert body["new_actions"] == [actions[2]["id"]]
    assert "drain_reset_gpu acts on one GPU and the alert names none (its gpu label is 'unknown')" in \
        actions[0]["detail"]
    assert [op[:2] for op in hook.backend.history] == [["drain", "gpu03"], ["reboot", "gpu03"]]
    assert await hook.metric("gpuhealth_webhook_actions_total", action="drain_reset_gpu", outcome="skipped",
                             reason="no_gpu") == 2


async def test_by_default_the_undrain_runs_gpuhealth_validate_on_the_node_over_ssh(webhook, tmp_path,
                                                                                  monkeypatch):
    """The default check, with a stand-in ssh on PATH that records its argv and answers as the node."""
    calls, verdict = tmp_path / "ssh-calls", tmp_path / "exit-code"
    ssh = tmp_path / "bin" / "ssh"
    ssh.parent.mkdir()
    ssh.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {calls}\necho ---- >> {calls}\n'
                   f'exit "$(cat {verdict})"\n')
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{ssh.parent}:{os.environ['PATH']}")
    verdict.write_text("1")
    # the test factory turns the check off (its simulated nodes have no ssh): ask for the shipped default
    assert parse_config({"backend": {"type": "simulated"}}).undrain.health_check == VALIDATE_OVER_SSH
    hook = await webhook(undrain={"health_check": list(VALIDATE_OVER_SSH), "health_check_retry_seconds": 0.2,
                                  "health_check_max_attempts": 50})
    first = alert("gpu07", action="drain")
    await hook.post(first)
    await hook.settle()
    await hook.post(resolved(first))
    await hook.until(lambda a: a[-1]["reason"] == "health_check_failed", "a failing validation", 10)
    assert "gpu07" in hook.drained
    runs = calls.read_text().split("----\n")
    assert runs[0].splitlines() == ["-o", "BatchMode=yes", "--", "gpu07", "gpuhealth-validate"]
    verdict.write_text("0")
    await hook.until(lambda a: a[-1]["state"] == "done", "the undrain once validation passed", 10)
    assert hook.drained == {}


async def test_the_health_check_gets_the_node_as_one_argument_or_quoted_for_a_remote_shell(webhook, tmp_path):
    seen = tmp_path / "argv"
    hook = await webhook(backend=SimulatedBackend(["gpu-7.rack_2", "gpu08"]),
                         undrain={"health_check": [sys.executable, "-c", RECORD_ARGV, str(seen), "{node}",
                                                   "check --node={node!q}"]})
    first = alert("gpu-7.rack_2", action="drain")
    await hook.post(first)
    await hook.settle()
    await hook.post(resolved(first))
    await hook.until(lambda a: a[-1]["state"] == "done", "the undrain", 10)
    assert json.loads(seen.read_text()) == ["gpu-7.rack_2", "check --node=gpu-7.rack_2"]


RECORD_ARGV = "import json, sys; open(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))"
