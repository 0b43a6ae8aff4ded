"""The escalation chain on the simulated cluster: restart -> reset -> reboot -> replace, each step verified,
every step an ordinary action through every guardrail, journaled so a restart resumes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gpuhealth.webhook.backends.base import BackendError
from gpuhealth.webhook.backends.simulated import SimulatedBackend
from gpuhealth.webhook.config import ConfigError, parse_config
from waiting import eventually
from webhook_helpers import NODES, alert, resolved

CHAIN = ["restart_job", "drain_reset_gpu", "drain_reboot", "replace"]
CHAIN_STATES = ("running", "verifying", "succeeded", "exhausted", "cancelled")


def health_check(tmp_path: Path, passing: bool) -> tuple[list[str], Path]:
    """A stand-in for ``ssh {node} gpuhealth-validate``: its exit status is the verdict file's content."""
    verdict = tmp_path / "verdict"
    verdict.write_text("0" if passing else "1")
    script = tmp_path / "validate"
    script.write_text(f'#!/bin/sh\necho "validated $1"\nexit "$(cat {verdict})"\n')
    script.chmod(0o755)
    return [str(script), "{node}"], verdict


def escalation(**overrides: Any) -> dict[str, Any]:
    return {"enabled": True, "settle_seconds": 0, "poll_seconds": 0.05,
            "step_timeout_seconds": {"restart_job": 0.5, "drain_reset_gpu": 0.5, "drain_reboot": 0.5},
            **overrides}


async def listing(hook) -> dict[str, Any]:
    resp = await hook.client.get("/actions")
    assert resp.status == 200
    return await resp.json()


async def chain_in(hook, *states: str, timeout: float = 20.0) -> dict[str, Any]:
    """Wait for the one chain to be in one of ``states``; return it."""
    body = await eventually(lambda: listing(hook), lambda b: [c["state"] for c in b["chains"]][:1] in
                            [[s] for s in states], timeout=timeout, what=f"a chain {' or '.join(states)}")
    assert len(body["chains"]) == 1, body["chains"]
    return body["chains"][0]


def audit(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "state" / "audit.jsonl").read_text().splitlines()]


def kinds(actions: list[dict[str, Any]]) -> list[str]:
    return [a["kind"] for a in sorted(actions, key=lambda a: a["id"])]


async def test_a_failing_verification_at_every_step_escalates_until_the_chain_is_exhausted(webhook, tmp_path):
    check, _ = health_check(tmp_path, passing=False)
    hook = await webhook(jobs={"gpu01": ["101"]}, escalation=escalation(), undrain={"health_check": check},
                         guardrails={"node_cooldown_seconds": 3600})  # a stronger step is never held by it
    assert {s: await hook.metric("gpuhealth_webhook_chains", state=s) for s in CHAIN_STATES} == dict.fromkeys(
        CHAIN_STATES, 0.0), "every state is exported from the start"
    await hook.post(alert("gpu01", action="restart_job", gpu="3", alertname="GPUHealthXidRestartJob"))
    chain = await chain_in(hook, "exhausted")
    actions = await hook.settle()
    assert kinds(actions) == CHAIN, actions
    assert [(a["state"], a["reason"]) for a in actions] == [("done", "ok")] * 4, "none held by the cooldown"
    assert chain["step"] == "replace" and chain["action_id"] == actions[-1]["id"]
    assert {a["fingerprint"] for a in actions} == {actions[0]["fingerprint"]}, "every step answers one alert"
    assert [op[0] for op in hook.backend.history] == ["requeue", "drain", "reset_gpu", "reboot"]
    assert hook.backend.history[2][2] == "3", "the reset is of the alert's GPU"
    [drained] = (await hook.call("GET", "/status"))["drained_by_us"]
    assert (drained["node"], drained["left_for_human"]) == ("gpu01", True), "after replace a person decides"
    async def events() -> list[str]:  # each line lands just after the journal's commit
        return [r["event"] for r in audit(tmp_path) if r["event"].startswith("chain_")]
    assert await eventually(events, lambda got: "chain_exhausted" in got, timeout=10, what="the audit") == [
        "chain_opened", *["chain_verifying", "chain_escalated"] * 3, "chain_exhausted"]
    escalations = [r["detail"] for r in audit(tmp_path) if r["event"] == "chain_escalated"]
    assert "job 101 is PENDING, not running again yet" in escalations[0]
    assert "health check failed: exit 1: validated gpu01" in escalations[1]
    assert await hook.metric("gpuhealth_webhook_chains", state="exhausted") == 1
    assert await hook.metric("gpuhealth_webhook_chains", state="verifying") == 0
    status = await hook.call("GET", "/status")
    assert status["chains"]["exhausted"] == 1
    page = await (await hook.client.get("/")).text()
    assert 'id="chains"' in page and "exhausted" in page


async def test_a_passing_verification_closes_the_chain_at_its_second_step(webhook, tmp_path):
    check, verdict = health_check(tmp_path, passing=False)
    hook = await webhook(jobs={"gpu02": ["201"]}, undrain={"health_check": check},
                         escalation=escalation(step_timeout_seconds={"restart_job": 0.5,
                                                                     "drain_reset_gpu": 60}))
    firing = alert("gpu02", action="restart_job", gpu="1", alertname="GPUHealthXidRestartJob")
    await hook.post(firing)
    await eventually(lambda: listing(hook), lambda b: b["chains"] and b["chains"][0]["step"] ==
                     "drain_reset_gpu" and "health check failed" in b["chains"][0]["detail"], timeout=20,
                     what="the reset step's verification failing")
    verdict.write_text("0")
    await hook.post(resolved(firing))
    chain = await chain_in(hook, "succeeded")
    assert chain["step"] == "drain_reset_gpu"
    assert "health check passed" in chain["detail"] and chain["finished_at"] is not None
    actions = await hook.settle()
    assert kinds(actions) == ["restart_job", "drain_reset_gpu", "undrain"], "no reboot, the node resumed"
    assert [op[0] for op in hook.backend.history] == ["requeue", "drain", "reset_gpu", "resume"]
    assert await hook.metric("gpuhealth_webhook_chains", state="succeeded") == 1


async def test_a_restart_that_runs_the_jobs_again_and_resolves_succeeds_at_once(webhook):
    hook = await webhook(jobs={"gpu03": ["301"]},
                         escalation=escalation(step_timeout_seconds={"restart_job": 60}))
    firing = alert("gpu03", action="restart_job", alertname="GPUHealthXidRestartJob")
    await hook.post(firing)
    await chain_in(hook, "verifying")
    await hook.post(resolved(firing))
    chain = await eventually(lambda: listing(hook), lambda b: "job 301 is PENDING" in
                             b["chains"][0]["detail"], timeout=20, what="the requeued job still pending")
    assert chain["chains"][0]["state"] == "verifying", "resolved alone is not enough: the job must run again"
    hook.backend.start_job("301", "gpu05")
    chain = await chain_in(hook, "succeeded")
    assert chain["step"] == "restart_job" and "requeued jobs running (301)" in chain["detail"]
    assert kinds(await hook.settle()) == ["restart_job"]


async def test_the_same_alert_firing_again_during_verification_escalates_at_once(webhook, tmp_path):
    hook = await webhook(jobs={"gpu04": ["401"]},
                         escalation=escalation(step_timeout_seconds={"restart_job": 600}))
    await hook.post(alert("gpu04", action="restart_job", alertname="GPUHealthXidRestartJob"))
    await chain_in(hook, "verifying")
    # another instance of the same alert (its own fingerprint) while the restart is being verified
    await hook.post(alert("gpu04", action="restart_job", alertname="GPUHealthXidRestartJob"))
    await eventually(lambda: listing(hook), lambda b: b["chains"][0]["step"] == "drain_reset_gpu",
                     timeout=20, what="the chain at its reset step")

    async def escalations() -> list[dict[str, Any]]:
        return [r for r in audit(tmp_path) if r["event"] == "chain_escalated"]
    [escalated] = await eventually(escalations, bool, timeout=10, what="the escalation in the audit log")
    assert "GPUHealthXidRestartJob fired again on gpu04 after restart_job" in escalated["detail"]


async def test_the_same_alert_firing_again_within_the_window_reopens_a_succeeded_chain(webhook, tmp_path):
    hook = await webhook(escalation=escalation(step_timeout_seconds={"restart_job": 600}),
                         guardrails={"node_cooldown_seconds": 3600})
    first = alert("gpu04", action="restart_job", alertname="GPUHealthXidRestartJob",
                  fingerprint="00000000000000aa")
    await hook.post(first)
    await chain_in(hook, "verifying")
    await hook.post(resolved(first))
    succeeded = await chain_in(hook, "succeeded")
    await hook.post(alert("gpu04", action="restart_job", alertname="GPUHealthXidRestartJob",
                          fingerprint="00000000000000aa", starts_at="2026-11-30T05:10:00Z"))
    body = await eventually(lambda: listing(hook), lambda b: b["chains"][0]["step"] == "drain_reset_gpu",
                            timeout=20, what="the chain reopened at its reset step")
    assert [c["id"] for c in body["chains"]] == [succeeded["id"]], "the same chain, reopened"

    async def escalations() -> list[dict[str, Any]]:
        return [r for r in audit(tmp_path) if r["event"] == "chain_escalated"]
    [escalated] = await eventually(escalations, bool, timeout=10, what="the escalation in the audit log")
    assert "fired again on gpu04 within 3600s of restart_job" in escalated["detail"]
    actions = await hook.until(lambda acts: acts[-1]["kind"] == "drain_reset_gpu" and
                               acts[-1]["state"] == "done", "the reset step done")
    own = [a for a in actions if a["starts_at"].startswith("2026-11-30T05:10")]
    assert [(a["kind"], a["state"], a["reason"]) for a in own] == [("restart_job", "pending", "cooldown")], \
        "the new alert's own restart is held by the cooldown, not run again"


async def test_a_hard_xid_after_a_predictive_drain_is_not_held_by_the_cooldown(webhook):
    hook = await webhook(jobs={"gpu05": ["501"]}, escalation=escalation(),
                         guardrails={"node_cooldown_seconds": 3600},
                         checkpoint={"grace_seconds": 0})
    await hook.post(alert("gpu05", action="checkpoint_drain", alertname="GPUHealthGpuFailureRisk",
                          severity="warning", summary="risk 0.8"))
    await hook.until(lambda acts: acts[0]["state"] == "done", "the predictive drain")
    await hook.post(alert("gpu05", action="drain_reset_gpu", gpu="2", alertname="GPUHealthXidResetGpu"))
    actions = await hook.until(lambda acts: len(acts) == 2 and acts[1]["state"] == "done", "the reset")
    assert (actions[1]["kind"], actions[1]["reason"]) == ("drain_reset_gpu", "ok"), actions
    assert hook.backend.history[-1][:3] == ["reset_gpu", "gpu05", "2"]
    chain = (await listing(hook))["chains"][0]
    assert chain["step"] in ("drain_reset_gpu", "drain_reboot"), "the chain starts at the alert's step"
    assert chain["alertname"] == "GPUHealthXidResetGpu" and chain["gpu"] == "2"


async def test_a_restarted_webhook_resumes_a_chain_mid_verification(webhook, tmp_path):
    sim = SimulatedBackend(NODES, {"gpu06": ["601"]})
    settings = {"backend": sim, "escalation": escalation(step_timeout_seconds={"restart_job": 3})}
    hook = await webhook(**settings)
    await hook.post(alert("gpu06", action="restart_job", alertname="GPUHealthXidRestartJob"))
    before = await chain_in(hook, "verifying")
    await hook.client.close()  # the worker stops; the chain stays journaled as it was
    assert sim.history[-1][0] == "requeue"

    hook = await webhook(**settings)
    after = await chain_in(hook, "verifying", "running")
    assert (after["id"], after["deadline"], after["step_done_at"]) == (
        before["id"], before["deadline"], before["step_done_at"]), "the journaled deadline is kept"
    chain = await eventually(lambda: listing(hook), lambda b: b["chains"][0]["step"] == "drain_reset_gpu",
                             timeout=30, what="the restarted webhook to escalate at the deadline")
    assert chain["chains"][0]["updated_at"] >= before["deadline"]
    actions = await hook.until(lambda acts: acts[-1]["state"] == "done", "the reset step")
    assert kinds(actions) == ["restart_job", "drain_reset_gpu"]


async def test_cancel_between_steps_stops_the_chain(webhook, tmp_path):
    hook = await webhook(escalation=escalation(step_timeout_seconds={"restart_job": 600}))
    await hook.post(alert("gpu07", action="restart_job", alertname="GPUHealthXidRestartJob"))
    chain = await chain_in(hook, "verifying")
    answer = await hook.call("POST", f"/actions/{chain['action_id']}/cancel")
    assert answer["state"] == "done", "the step itself had ended"
    assert answer["chain"]["state"] == "cancelled" and "cancelled by" in answer["chain"]["detail"]
    assert (await listing(hook))["chains"][0]["state"] == "cancelled"
    await hook.call("POST", f"/actions/{chain['action_id']}/cancel", expect=409)
    assert kinds(await hook.settle()) == ["restart_job"]
    assert await hook.metric("gpuhealth_webhook_chains", state="cancelled") == 1
    assert any(r["event"] == "chain_cancelled" and r["by"] for r in audit(tmp_path))


async def test_a_step_waiting_for_approval_can_be_refused_which_ends_the_chain(webhook):
    hook = await webhook(escalation=escalation(), guardrails={"require_approval": ["drain_reset_gpu"]})
    await hook.post(alert("gpu08", action="restart_job", gpu="0", alertname="GPUHealthXidRestartJob"))
    chain = await eventually(lambda: listing(hook), lambda b: b["chains"] and b["chains"][0]["step"] ==
                             "drain_reset_gpu", timeout=20, what="the reset step asked for")
    step = chain["chains"][0]["action_id"]
    assert (await hook.call("GET", f"/actions/{step}"))["state"] == "awaiting_approval", "approval applies"
    answer = await hook.call("POST", f"/actions/{step}/cancel")
    assert answer["state"] == "cancelled" and answer["chain"]["state"] == "cancelled"
    assert [op[0] for op in hook.backend.history] == [], "nothing reset"


async def test_dry_run_applies_to_every_step(webhook):
    hook = await webhook(escalation=escalation(), dry_run=True)
    await hook.post(alert("gpu09", action="restart_job", gpu="0", alertname="GPUHealthXidRestartJob"))
    chain = await chain_in(hook, "exhausted")
    actions = await hook.settle()
    assert kinds(actions) == CHAIN and {a["reason"] for a in actions} == {"dry_run"}, actions
    assert hook.backend.history == [] and chain["step"] == "replace"


async def test_an_operators_drain_during_verification_ends_the_chain(webhook):
    hook = await webhook(escalation=escalation())
    await hook.post(alert("gpu10", action="restart_job", gpu="0", alertname="GPUHealthXidRestartJob"))
    await chain_in(hook, "verifying", "running")
    hook.backend.state["nodes"]["gpu10"].update(drained=True, reason="ops: ticket 9")
    chain = await chain_in(hook, "cancelled")
    assert "drained_by_other" in chain["detail"]
    assert [op[0] for op in hook.backend.history] == [], "the operator's drain wins"


async def test_a_step_held_by_the_breaker_waits_and_a_drop_at_reset_ends_the_chain(webhook):
    hook = await webhook(escalation=escalation(), guardrails={"breaker_max_nodes": 1})
    await hook.post(alert("gpu11", action="drain", alertname="GPUHealthXidFatal"))
    await hook.post(alert("gpu12", action="restart_job", gpu="0", alertname="GPUHealthXidRestartJob"))
    chain = await eventually(lambda: listing(hook), lambda b: b["chains"] and b["chains"][0]["step"] ==
                             "drain_reset_gpu" and "breaker" in b["chains"][0]["detail"], timeout=20,
                             what="the reset step held by the breaker")
    assert chain["chains"][0]["state"] == "running"
    await hook.call("POST", "/breaker/reset?held=drop")
    chain = await chain_in(hook, "cancelled")
    assert "dropped_at_reset" in chain["detail"]


def test_the_default_chain_is_off_until_enabled():
    config = parse_config({"backend": {"type": "simulated"}, "escalation": {"enabled": True}})
    assert config.escalation.steps == tuple(CHAIN) and not parse_config(
        {"backend": {"type": "simulated"}}).escalation.enabled, "off unless asked for"


async def test_without_a_gpu_the_chain_goes_from_restart_to_reboot(webhook):
    """A GPU reset needs the alert to name one: such a chain skips it."""
    hook = await webhook(escalation=escalation())
    await hook.post(alert("gpu13", action="restart_job", gpu=None, alertname="GPUHealthNodeRestartJob"))
    chain = await eventually(lambda: listing(hook), lambda b: b["chains"] and b["chains"][0]["step"] ==
                             "drain_reboot", timeout=20, what="the reboot step")
    assert chain["chains"][0]["gpu"] == ""
    assert "drain_reset_gpu" not in kinds((await listing(hook))["actions"])


def test_escalation_settings_are_checked_all_at_once():
    with pytest.raises(ConfigError) as caught:
        parse_config({"backend": {"type": "simulated"},
                      "escalation": {"steps": ["drain_reboot", "restart_job", "none"], "settle_seconds": -1,
                                     "step_timeout_seconds": {"drain": 5, "restart_job": 0}}})
    errors = "\n".join(caught.value.errors)
    for expected in ("escalation.settle_seconds", "none is not a step", "stronger than the one before it",
                     "escalation.step_timeout_seconds.drain: not one of the steps",
                     "escalation.step_timeout_seconds.restart_job"):
        assert expected in errors, errors


class FlakyJobs(SimulatedBackend):
    """A cluster whose job queries fail until told otherwise (a controller that does not answer)."""

    answering = False

    async def job_state(self, job_id: str) -> Any:
        if not self.answering:
            raise BackendError("squeue: slurm_load_jobs error: Unable to contact slurm controller")
        return await super().job_state(job_id)


async def test_a_cluster_that_does_not_answer_delays_the_verification_without_ending_the_chain(webhook):
    sim = FlakyJobs(NODES, {"gpu14": ["1401"]})
    hook = await webhook(backend=sim, escalation=escalation(step_timeout_seconds={"restart_job": 60}))
    await hook.post(alert("gpu14", action="restart_job", alertname="GPUHealthXidRestartJob"))
    chain = await eventually(lambda: listing(hook), lambda b: b["chains"] and "Unable to contact" in
                             b["chains"][0]["detail"], timeout=20, what="the failing job query recorded")
    assert chain["chains"][0]["state"] == "verifying"
    sim.answering = True
    sim.start_job("1401", "gpu15")
    await eventually(lambda: listing(hook), lambda b: b["chains"][0]["detail"] ==
                     "verifying restart_job: GPUHealthXidRestartJob still firing", timeout=20,
                     what="the job check passing once the cluster answers again")


async def test_a_node_a_late_step_drained_returns_once_the_chain_succeeded(webhook, tmp_path):
    """The alert resolved before the step that drained the node: its undrain is asked for by the chain."""
    check, _ = health_check(tmp_path, passing=True)
    timeouts = {"restart_job": 0.5, "drain_reset_gpu": 60}
    hook = await webhook(jobs={"gpu16": ["1601"]}, undrain={"health_check": check},
                         escalation=escalation(step_timeout_seconds=timeouts))
    firing = alert("gpu16", action="restart_job", gpu="5", alertname="GPUHealthXidRestartJob")
    await hook.post(firing)
    await chain_in(hook, "verifying")
    await hook.post(resolved(firing))  # resolved, but job 1601 never runs again: the restart did not work
    chain = await chain_in(hook, "succeeded", timeout=30)
    assert chain["step"] == "drain_reset_gpu"
    actions = await hook.until(lambda acts: acts[-1]["kind"] == "undrain" and acts[-1]["state"] == "done",
                               "the undrain the chain asked for")
    assert kinds(actions) == ["restart_job", "drain_reset_gpu", "undrain"]
    assert [op[0] for op in hook.backend.history] == ["requeue", "drain", "reset_gpu", "resume"]
    assert hook.drained == {} and (await hook.call("GET", "/status"))["drained_by_us"] == []


async def test_a_stronger_alert_action_on_the_node_becomes_the_chains_step(webhook):
    timeouts = {"restart_job": 600, "drain_reset_gpu": 600}
    hook = await webhook(escalation=escalation(step_timeout_seconds=timeouts),
                         guardrails={"node_cooldown_seconds": 3600})
    await hook.post(alert("gpu12", action="restart_job", gpu="7", alertname="GPUHealthXidRestartJob"))
    await chain_in(hook, "verifying")
    await hook.post(alert("gpu12", action="drain_reset_gpu", gpu="7", alertname="GPUHealthXidResetGpu"))
    body = await eventually(lambda: listing(hook), lambda b: b["chains"][0]["step"] == "drain_reset_gpu" and
                            b["chains"][0]["state"] == "verifying", timeout=20, what="the reset adopted")
    [chain] = body["chains"]
    reset = [a for a in body["actions"] if a["kind"] == "drain_reset_gpu"]
    assert [a["alertname"] for a in reset] == ["GPUHealthXidResetGpu"], "the alert's own reset, no second one"
    assert chain["action_id"] == reset[0]["id"]
    assert [op[0] for op in hook.backend.history] == ["drain", "reset_gpu"]
