"""Each guardrail on its own: a real journal and a simulated cluster, one check called directly.

The app-level tests (test_engine.py, test_operator_wins.py) show the checks composed; these show
that each check says no for its own reason, and only then.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from gpuhealth.webhook import guardrails
from gpuhealth.webhook.backends.base import BackendError
from gpuhealth.webhook.backends.simulated import SimulatedBackend
from gpuhealth.webhook.config import parse_config
from gpuhealth.webhook.guardrails import Admission
from gpuhealth.webhook.intake import resolve, wakes_worker
from gpuhealth.webhook.journal import AsyncJournal
from gpuhealth.webhook.metrics import Metrics
from gpuhealth.webhook.models import parse_notification
from gpuhealth.webhook.policy import decide, drain_reason
from gpuhealth.webhook.store import Action, Decision, DrainedNode, RecordResult
from webhook_helpers import NODES, alert, notification, resolved

BASE = {"backend": {"type": "simulated", "nodes": ["gpu[01-16]"]},
        "guardrails": {"node_cooldown_seconds": 0, "breaker_max_nodes": 16, "breaker_max_fraction": 1.0,
                       "rate_limit_actions": 1000}}


@dataclass
class Env:
    store: AsyncJournal
    backend: SimulatedBackend
    metrics: Metrics
    settings: dict[str, Any]

    def ctx(self, action: Action, **settings: Any) -> Admission:
        data = {**BASE, **self.settings}
        for key, value in settings.items():
            data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
        return Admission(action, parse_config(data), self.backend, self.store, self.metrics)

    async def journal(self, *alerts: dict[str, Any], start: bool = True) -> list[Action]:
        """Journal the alerts' actions as intake would, started (and reserved) as admission would."""
        parsed = parse_notification(notification(*alerts))
        result = await self.store.record(parsed, decide(parsed, parse_config(BASE)))
        actions = []
        for action_id in result.new_actions:
            action = await self.store.get(action_id)
            assert action is not None
            if start:
                drains = action.kind in ("drain", "drain_reset_gpu", "drain_reboot", "replace")
                reserve = DrainedNode(action.node, action.id, time.time(), "gpuhealth: x", False)
                reserve = reserve if drains else None
                assert await self.store.start(action.id, reserve)
                action = await self.store.get(action_id)
                assert action is not None
            actions.append(action)
        return actions


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    store = AsyncJournal(tmp_path / "journal.sqlite3", resolve)
    yield Env(store, SimulatedBackend(NODES), Metrics(), {})
    await store.close()


def pending(kind: str = "drain", node: str = "gpu01", gpu: str = "0", action_id: int = 10_000) -> Action:
    """An action about to be admitted (not journaled: the checks under test read only its fields)."""
    now = time.time()
    return Action(action_id, "f" * 16, "2026-11-30T05:00:00.5Z", kind, node, gpu, "GPUHealthXidFatal", "s",
                  "pending", "", "", "", 0, now, {}, now, None, None, now)


def said(verdict: guardrails.Verdict | None) -> tuple[str, str] | None:
    return None if verdict is None else (verdict.outcome.value, verdict.reason.value)


async def test_record_only_ends_an_action_none_and_nothing_else(env):
    assert said(await guardrails.record_only(env.ctx(pending("none")))) == ("done", "record_only")
    assert await guardrails.record_only(env.ctx(pending("drain"))) is None


@pytest.mark.parametrize(("kind", "node", "gpu", "expected"), [
    ("drain", "gpu01", "0", None),
    ("drain", "gpu01", "unknown", None),  # the exporter's "no GPU known": a node-wide action goes ahead
    ("drain_reboot", "gpu01", "", None),
    ("drain_reset_gpu", "gpu01", "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789", None),
    ("drain_reset_gpu", "gpu01", "unknown", ("skipped", "no_gpu")),
    ("drain_reset_gpu", "gpu01", "", ("skipped", "no_gpu")),
    ("drain", "gpu[01-02]", "0", ("skipped", "invalid_node")),
    ("drain", "gpu01", "all", ("skipped", "invalid_label")),
    ("reboot_everything", "gpu01", "0", ("skipped", "unknown_action")),
])
async def test_labels_hold_every_value_to_its_grammar_and_gpu_steps_to_a_real_gpu(env, kind, node, gpu,
                                                                                   expected):
    verdict = await guardrails.labels(env.ctx(pending(kind, node, gpu)))
    assert said(verdict) == expected
    if expected == ("skipped", "no_gpu"):
        assert "drain_reset_gpu acts on one GPU and the alert names none" in verdict.detail


async def test_deny_list(env):
    deny = {"deny_nodes": ["gpu0*"]}
    verdict = await guardrails.deny_list(env.ctx(pending(node="gpu03"), guardrails=deny))
    assert said(verdict) == ("skipped", "denied")
    assert await guardrails.deny_list(env.ctx(pending(node="gpu13"), guardrails=deny)) is None


async def test_allow_list(env):
    allow = {"allow_nodes": ["gpu1*"]}
    assert said(await guardrails.allow_list(env.ctx(pending(node="gpu03"), guardrails=allow))) == (
        "skipped", "not_allowed")
    assert await guardrails.allow_list(env.ctx(pending(node="gpu13"), guardrails=allow)) is None
    assert await guardrails.allow_list(env.ctx(pending(node="gpu03"))) is None  # no list: all allowed


async def test_breaker_closed(env):
    assert await guardrails.breaker_closed(env.ctx(pending())) is None
    await env.store.set_meta(guardrails.BREAKER, {"open": True, "since": 0, "reason": "test"})
    assert said(await guardrails.breaker_closed(env.ctx(pending()))) == ("skipped", "breaker_open")


async def test_node_state_knows_the_node_and_whose_drain_it_is(env):
    assert said(await guardrails.node_state(env.ctx(pending(node="gpu99")))) == ("skipped", "unknown_node")
    await env.backend.drain("gpu02", "maintenance, ticket 7")
    assert said(await guardrails.node_state(env.ctx(pending(node="gpu02")))) == ("skipped",
                                                                                "drained_by_other")
    await env.backend.drain("gpu03", drain_reason("GPUHealthXidFatal", "XID 79"))
    assert said(await guardrails.node_state(env.ctx(pending(node="gpu03")))) == ("skipped",
                                                                                "already_drained")
    stronger = env.ctx(pending("drain_reboot", node="gpu03"))
    assert await guardrails.node_state(stronger) is None
    assert stronger.drained_by_us  # learnt for the checks after it


async def test_node_state_tolerates_an_unreachable_cluster_only_in_dry_run(env):
    async def unreachable(node: str) -> None:
        raise BackendError("connection refused")

    env.backend.node_state = unreachable
    with pytest.raises(BackendError):
        await guardrails.node_state(env.ctx(pending()))
    ctx = env.ctx(pending(), dry_run=True)
    assert await guardrails.node_state(ctx) is None and ctx.node is None


async def test_cooldown_holds_back_as_strong_an_action_but_not_an_escalation(env):
    [first] = await env.journal(alert("gpu01", action="drain"))
    wait = {"node_cooldown_seconds": 3600}
    verdict = await guardrails.cooldown(env.ctx(pending("drain"), guardrails=wait))
    assert said(verdict) == ("deferred", "cooldown")
    assert verdict.retry_at == pytest.approx(first.started_at + 3600)
    assert await guardrails.cooldown(env.ctx(pending("drain_reboot"), guardrails=wait)) is None
    assert await guardrails.cooldown(env.ctx(pending("drain", node="gpu02"), guardrails=wait)) is None


async def test_cooldown_ends_with_our_own_undrain(env):
    firing = alert("gpu01", action="drain")
    [drain] = await env.journal(firing)
    assert await env.store.update(drain.id, "done", expect="running", outcome="done", reason="ok")
    [undrain] = await env.journal(resolved(firing))
    assert await env.store.update(undrain.id, "done", expect="running", outcome="done", reason="ok")
    wait = {"node_cooldown_seconds": 3600}
    assert await guardrails.cooldown(env.ctx(pending("drain"), guardrails=wait)) is None


async def test_rate_limit(env):
    limit = {"rate_limit_actions": 2, "rate_limit_window_seconds": 600}
    await env.journal(alert("gpu01", action="restart_job"))
    assert await guardrails.rate_limit(env.ctx(pending(node="gpu09"), guardrails=limit)) is None
    [_, second] = await env.journal(alert("gpu02", action="restart_job"), alert("gpu03", action="none"),
                                    start=False)
    await env.store.start(second.id, None)  # "none" never starts in the engine; counted here only if started
    verdict = await guardrails.rate_limit(env.ctx(pending(node="gpu09"), guardrails=limit))
    assert said(verdict) is None, "an action none does not count"
    await env.journal(alert("gpu04", action="drain"))
    verdict = await guardrails.rate_limit(env.ctx(pending(node="gpu09"), guardrails=limit))
    assert said(verdict) == ("deferred", "rate_limited") and verdict.retry_at > time.time() + 590


async def test_breaker_cap_trips_the_breaker_for_one_drain_too_many(env):
    cap = {"breaker_max_nodes": 2}
    await env.journal(alert("gpu01", action="drain"))
    assert await guardrails.breaker_cap(env.ctx(pending(node="gpu02"), guardrails=cap)) is None
    await env.journal(alert("gpu02", action="drain"))
    assert await guardrails.breaker_cap(env.ctx(pending("restart_job", node="gpu03"), guardrails=cap)) is None
    verdict = await guardrails.breaker_cap(env.ctx(pending(node="gpu03"), guardrails=cap))
    assert said(verdict) == ("skipped", "breaker_open") and "would make 3 nodes" in verdict.detail
    assert (await guardrails.breaker_state(env.store))["open"]
    assert env.metrics.registry.get_sample_value("gpuhealth_webhook_breaker_open") == 1


async def test_breaker_cap_counts_a_fraction_of_the_fleet(env):
    await env.journal(alert("gpu01", action="drain"))
    fraction = {"breaker_max_nodes": 16, "breaker_max_fraction": 0.1}  # 16 nodes: at most 1
    verdict = await guardrails.breaker_cap(env.ctx(pending(node="gpu02"), guardrails=fraction))
    assert said(verdict) == ("skipped", "breaker_open") and "of 16 nodes" in verdict.detail


async def test_requeue_cap_trips_the_breaker(env):
    cap = {"requeue_breaker_max_nodes": 2}
    await env.journal(alert("gpu01", action="restart_job"))
    second = env.ctx(pending("restart_job", node="gpu02"), guardrails=cap)
    assert await guardrails.requeue_cap(second) is None
    await env.journal(alert("gpu02", action="restart_job"))
    verdict = await guardrails.requeue_cap(env.ctx(pending("restart_job", node="gpu03"), guardrails=cap))
    assert said(verdict) == ("skipped", "breaker_open")
    assert await guardrails.requeue_cap(env.ctx(pending("drain", node="gpu03"), guardrails=cap)) is None


async def test_drained_by_us_for_an_undrain(env):
    verdict = await guardrails.drained_by_us(env.ctx(pending("undrain")))
    assert said(verdict) == ("skipped", "not_drained_by_us")
    await env.journal(alert("gpu01", action="drain"))
    assert await guardrails.drained_by_us(env.ctx(pending("undrain"))) is None
    await env.store.keep_drained("gpu01")
    assert said(await guardrails.drained_by_us(env.ctx(pending("undrain")))) == ("skipped", "left_for_human")


async def test_all_resolved_waits_for_every_alert_that_keeps_the_node_drained(env):
    await env.journal(alert("gpu01", action="drain"), alert("gpu01", action="restart_job", alertname="Other"))
    undrain = replace(pending("undrain"), fingerprint="0" * 16)
    assert said(await guardrails.all_resolved(env.ctx(undrain))) == ("skipped", "still_firing")
    await env.journal(alert("gpu02", action="restart_job"))  # a requeue keeps nothing drained
    assert await guardrails.all_resolved(env.ctx(replace(undrain, node="gpu02"))) is None


async def test_automatic_undrain(env):
    manual = env.ctx(pending("undrain"), undrain={"mode": "manual"})
    assert said(await guardrails.automatic_undrain(manual)) == ("skipped", "left_for_human")
    assert await guardrails.automatic_undrain(env.ctx(pending("undrain"))) is None


async def test_still_ours_before_a_resume(env):
    assert said(await guardrails.still_ours(env.ctx(pending("undrain")))) == ("done", "already_resumed")
    await env.backend.drain("gpu01", "an operator's drain")
    assert said(await guardrails.still_ours(env.ctx(pending("undrain")))) == ("skipped", "drained_by_other")
    assert await guardrails.still_ours(env.ctx(pending("undrain"), dry_run=True)) is None
    await env.backend.resume("gpu01")
    await env.backend.drain("gpu01", drain_reason("GPUHealthXidFatal", ""))
    assert await guardrails.still_ours(env.ctx(pending("undrain"))) is None


async def admit(ctx: guardrails.Admission) -> guardrails.Verdict | None:
    """Admission as the engine runs it, the lock left out."""
    return await guardrails.before_lock(ctx) or await guardrails.under_lock(ctx)


async def test_admit_runs_the_checks_in_order_and_the_first_no_decides(env):
    await env.store.set_meta(guardrails.BREAKER, {"open": True, "since": 0, "reason": "test"})
    deny: dict[str, Any] = {"deny_nodes": ["gpu01"]}
    assert said(await admit(env.ctx(pending(), guardrails=deny))) == ("skipped", "denied")
    assert said(await admit(env.ctx(pending()))) == ("skipped", "breaker_open")
    no_gpu = env.ctx(pending("drain_reset_gpu", gpu="unknown"))
    assert said(await admit(no_gpu)) == ("skipped", "no_gpu")
    assert [c.__name__ for c in guardrails.ACTION_CHECKS] == [
        "record_only", "labels", "deny_list", "allow_list", "breaker_closed", "node_state", "cooldown",
        "rate_limit", "breaker_cap", "requeue_cap"]
    assert [c.__name__ for c in guardrails.UNDRAIN_CHECKS] == [
        "labels", "drained_by_us", "all_resolved", "automatic_undrain", "breaker_closed", "still_ours"]
    # before the fleet's lock only what reads neither the journal nor the cluster
    assert [c.__name__ for c in guardrails.ACTION_CHECKS_BEFORE_LOCK] == [
        "record_only", "labels", "deny_list", "allow_list"]
    assert [c.__name__ for c in guardrails.UNDRAIN_CHECKS_BEFORE_LOCK] == ["labels"]


class CountingReads:
    """Wraps the backend's reads: how often the cluster was asked, and whether it is reachable."""

    def __init__(self, backend: Any) -> None:
        self.calls: list[str] = []
        self.reachable = True
        node_state, fleet_size = backend.node_state, backend.fleet_size

        async def counted_node_state(node: str) -> Any:
            self.calls.append("node_state")
            if not self.reachable:
                raise BackendError("connection refused")
            return await node_state(node)

        async def counted_fleet_size() -> int:
            self.calls.append("fleet_size")
            if not self.reachable:
                raise BackendError("connection refused")
            return int(await fleet_size())

        backend.node_state, backend.fleet_size = counted_node_state, counted_fleet_size


async def test_the_cluster_is_read_before_the_lock_once_and_the_checks_under_it_reuse_it(env):
    reads = CountingReads(env.backend)
    ctx = env.ctx(pending("drain", node="gpu02"))
    assert await guardrails.before_lock(ctx) is None
    assert reads.calls == ["node_state", "fleet_size"]  # every read the checks will need, before the lock
    await env.backend.drain("gpu02", "an operator's drain")  # after the read: the steps read it again
    assert await guardrails.under_lock(ctx) is None
    assert reads.calls == ["node_state", "fleet_size"]  # nothing read from the cluster under the lock
    undrain = env.ctx(pending("undrain", node="gpu02"), dry_run=True)
    await guardrails.before_lock(undrain)  # a dry-run undrain never asks the cluster
    assert reads.calls == ["node_state", "fleet_size"]


async def test_a_failed_cluster_read_is_raised_by_the_check_that_needs_it_in_its_turn(env):
    reads = CountingReads(env.backend)
    reads.reachable = False
    ctx = env.ctx(pending("drain"))
    assert await guardrails.before_lock(ctx) is None  # kept, not raised before the lock
    await env.store.set_meta(guardrails.BREAKER, {"open": True, "since": 0, "reason": "test"})
    assert said(await guardrails.under_lock(ctx)) == ("skipped", "breaker_open")  # a check before it decides
    await env.store.set_meta(guardrails.BREAKER, {"open": False})
    with pytest.raises(BackendError):
        await guardrails.under_lock(ctx)
    assert reads.calls == ["node_state", "fleet_size"]  # asked once each, however often the checks ran
    dry = env.ctx(pending("drain"), dry_run=True)
    await guardrails.before_lock(dry)
    assert await guardrails.under_lock(dry) is None and dry.node is None  # dry-run tolerates it, as before


def test_a_resolution_cancels_what_has_not_started_and_undoes_what_drained():
    def row(kind: str, state: str, reason: str = "", attempts: int = 0, action_id: int = 1) -> Action:
        return replace(pending(kind), id=action_id, state=state, reason=reason, attempts=attempts)

    assert resolve([row("drain", "pending")]).cancel == (1,)
    assert resolve([row("drain", "pending")]).follow_up is None
    assert resolve([row("drain", "pending", attempts=1)]).follow_up == "undrain"  # it may have drained
    assert resolve([row("drain", "done", "ok")]).follow_up == "undrain"
    assert resolve([row("drain_reset_gpu", "running")]).follow_up == "undrain"
    assert resolve([row("drain", "skipped", "already_drained")]).follow_up == "undrain"
    assert resolve([row("drain", "skipped", "breaker_open")]).follow_up is None
    assert resolve([row("replace", "done", "ok")]).follow_up is None  # a human decides
    assert resolve([row("restart_job", "done", "ok")]).follow_up is None
    assert resolve([row("unknown", "skipped", "unknown_action")]) == resolve([])


def test_the_worker_is_woken_only_for_what_it_can_start():
    key = ("0000000000000001", "2026-11-30T05:00:00+00:00")
    runnable, held = {key: Decision("drain", False)}, {key: Decision("drain", True)}
    refused = {key: Decision("drain_reset_gpu", False, ("no_gpu", "no gpu label"))}
    assert wakes_worker(RecordResult(1, new_actions=[7]), runnable)
    assert not wakes_worker(RecordResult(1, duplicates=1), runnable)  # a second delivery
    assert not wakes_worker(RecordResult(1, new_actions=[7]), held)  # approving it wakes the worker
    assert not wakes_worker(RecordResult(1, refused=[(7, "drain_reset_gpu", "no_gpu", "")]), refused)
    assert wakes_worker(RecordResult(1, new_actions=[8], resolved=1), {})  # the undrain
    assert wakes_worker(RecordResult(1, resolved=1, cancelled=["drain"]), {})  # its node's queue moves
    assert not wakes_worker(RecordResult(1, resolved=1), {})
