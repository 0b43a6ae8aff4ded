"""Guardrails: the ordered checks an action passes before it may start, each small and testable alone.

As Alertmanager composes its notification stages (dedup, inhibit, silence, retry), admission runs
a list of checks in order and the first that says no decides: a ``Verdict`` ends the action
(skipped, done) or postpones it (deferred, with the time to try again). A check reads what it needs
from the ``Admission`` (the action, the configuration, the cluster, the store), and may leave what
it learnt there for the checks after it (the node's state).

Admission runs in two parts, so that the fleet's admission lock (one replica admits at a time) is
held only for the decision: ``before_lock`` runs the checks that read neither the journal nor the
cluster and reads from the cluster what the later checks need (a backend call can take a while: an
``scontrol`` or an API request); ``under_lock`` runs the checks that count the fleet from the journal
(breaker, cooldown, rate limit), which must see every admission before theirs. A node state read
before the lock cannot let an operator's drain be overwritten: every step that changes the node
reads it again first (``engine._readmit``), and a node's actions never run side by side.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from gpuhealth.webhook.actions import ACTING, DRAINING, KINDS, NONE, UNDRAIN, at_least_as_strong
from gpuhealth.webhook.backends.base import Backend, BackendError, NodeState
from gpuhealth.webhook.config import Config
from gpuhealth.webhook.intake import keeps_drained
from gpuhealth.webhook.labels import action_problem
from gpuhealth.webhook.metrics import Metrics
from gpuhealth.webhook.outcomes import Outcome, Reason
from gpuhealth.webhook.policy import is_ours
from gpuhealth.webhook.store import DONE, Action, Store

log = logging.getLogger(__name__)

T = TypeVar("T")
BREAKER = "breaker"  # the store's meta key: {"open": bool, "since": float, "reason": str}


@dataclass(frozen=True)
class Verdict:
    """A guardrail's answer that ends or postpones admission."""

    outcome: Outcome
    reason: Reason
    detail: str
    retry_at: float | None = None  # for DEFERRED
    drop_drained: bool = False
    started: bool = False  # the action was moved to running before this verdict (dry-run)
    tripped: bool = False  # this verdict opened the circuit breaker


@dataclass
class Admission:
    """One action being admitted, and what the checks learn about it on the way."""

    action: Action
    config: Config
    backend: Backend
    store: Store
    metrics: Metrics
    node: NodeState | None = None  # the node-state check's answer (None: not asked, or unknown in dry-run)
    # what was read from the cluster for this admission, or the error reading it ("node", "fleet")
    _cluster: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def drained_by_us(self) -> bool:
        return self.node is not None and self.node.drained

    async def cluster_node(self) -> NodeState:
        """The node as the cluster sees it, read once per admission (``observe``: before the lock)."""
        return await self._once("node", lambda: self.backend.node_state(self.action.node))

    async def fleet_size(self) -> int:
        return await self._once("fleet", self.backend.fleet_size)

    async def _once(self, key: str, read: Callable[[], Awaitable[T]]) -> T:
        """A cluster read made at most once; its error is kept too, and raised to each check asking."""
        if key not in self._cluster:
            try:
                self._cluster[key] = await read()
            except BackendError as exc:
                self._cluster[key] = exc
        value = self._cluster[key]
        if isinstance(value, BackendError):
            raise value
        return cast(T, value)


Check = Callable[[Admission], Awaitable[Verdict | None]]


async def breaker_state(store: Store) -> dict[str, Any]:
    state = await store.get_meta(BREAKER)
    return state if isinstance(state, dict) else {"open": False}


async def trip(ctx: Admission, reason: str) -> Verdict:
    """Open the breaker: every action stops until an operator resets it."""
    await ctx.store.set_meta(BREAKER, {"open": True, "since": time.time(), "reason": reason})
    ctx.metrics.breaker_open.set(1)
    a = ctx.action
    log.error("event=breaker_tripped id=%s kind=%s node=%s reason=%r", a.id, a.kind, a.node, reason)
    return Verdict(Outcome.SKIPPED, Reason.BREAKER_OPEN, f"circuit breaker tripped: {reason}", tripped=True)


def ownership(a: Action, state: NodeState, step: str) -> Verdict | None:
    """None when ``step`` may change the node now: it is ours to drain, or drained by us."""
    if not state.exists:
        return Verdict(Outcome.SKIPPED, Reason.UNKNOWN_NODE, f"the cluster has no node {a.node}",
                       drop_drained=True)
    if state.drained and not is_ours(state.reason):
        return Verdict(Outcome.SKIPPED, Reason.DRAINED_BY_OTHER,
                       f"{a.node} was drained by someone else before {step}: {state.reason!r}",
                       drop_drained=True)
    if step == "resume" and not state.drained:
        return Verdict(Outcome.DONE, Reason.ALREADY_RESUMED, f"{a.node} is already back in service",
                       drop_drained=True)
    if step in ("reset_gpu", "reboot") and not state.drained:
        return Verdict(Outcome.SKIPPED, Reason.NOT_DRAINED_BY_US,
                       f"{a.node} was put back in service by someone else before {step}",
                       drop_drained=True)
    return None


def _matches(node: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(node, p) for p in patterns)


# -- the checks, in the order they run -------------------------------------------------------------

async def record_only(ctx: Admission) -> Verdict | None:
    if ctx.action.kind == NONE:
        return Verdict(Outcome.DONE, Reason.RECORD_ONLY, "recorded only (action none)")
    return None


async def labels(ctx: Admission) -> Verdict | None:
    """Checked at intake too; again here for actions journaled before a check existed."""
    a = ctx.action
    problem = action_problem(a.kind, a.node, a.gpu, a.alertname)
    return None if problem is None else Verdict(Outcome.SKIPPED, *problem)


async def deny_list(ctx: Admission) -> Verdict | None:
    node = ctx.action.node
    if _matches(node, ctx.config.guardrails.deny_nodes):
        return Verdict(Outcome.SKIPPED, Reason.DENIED, f"{node} is on the deny list")
    return None


async def allow_list(ctx: Admission) -> Verdict | None:
    node, allowed = ctx.action.node, ctx.config.guardrails.allow_nodes
    if allowed and not _matches(node, allowed):
        return Verdict(Outcome.SKIPPED, Reason.NOT_ALLOWED, f"{node} is not on the allow list")
    return None


async def breaker_closed(ctx: Admission) -> Verdict | None:
    if (await breaker_state(ctx.store))["open"]:
        return Verdict(Outcome.SKIPPED, Reason.BREAKER_OPEN, "the circuit breaker is open")
    return None


async def node_state(ctx: Admission) -> Verdict | None:
    """The node as the cluster sees it: known, not drained by someone else, not drained by us already
    for a plain drain. In dry-run an unreachable cluster is tolerated (the state stays unknown)."""
    a = ctx.action
    try:
        ctx.node = await ctx.cluster_node()
    except BackendError:
        if ctx.config.dry_run:
            return None
        raise
    if not ctx.node.exists:
        return Verdict(Outcome.SKIPPED, Reason.UNKNOWN_NODE, f"the cluster has no node {a.node}")
    if ctx.node.drained and not is_ours(ctx.node.reason):
        return Verdict(Outcome.SKIPPED, Reason.DRAINED_BY_OTHER,
                       f"{a.node} was drained by someone else: {ctx.node.reason!r}")
    if a.kind == "drain" and ctx.drained_by_us:
        return Verdict(Outcome.SKIPPED, Reason.ALREADY_DRAINED, f"{a.node} is already drained by us")
    return None


async def cooldown(ctx: Admission) -> Verdict | None:
    """Only as strong an action counts: a drain after a requeue, or a reboot after a drain, is an
    escalation the cooldown must not hold back; nor is a drain after our own undrain (a new incident)."""
    a, wait = ctx.action, ctx.config.guardrails.node_cooldown_seconds
    last = await ctx.store.last_started(a.node, a.id, at_least_as_strong(a.kind))
    if last is None:
        return None
    undrained = await ctx.store.last_finished(a.node, UNDRAIN, DONE, Reason.OK)
    if undrained is not None and undrained >= last:
        return None
    now = time.time()
    if now - last >= wait:
        return None
    return Verdict(Outcome.DEFERRED, Reason.COOLDOWN,
                   f"{a.node} was acted on {now - last:.0f}s ago (cooldown {wait:.0f}s)", last + wait)


async def rate_limit(ctx: Admission) -> Verdict | None:
    g = ctx.config.guardrails
    window, limit = g.rate_limit_window_seconds, g.rate_limit_actions
    oldest = await ctx.store.nth_latest_start(time.time() - window, ACTING, limit)
    if oldest is None:
        return None
    return Verdict(Outcome.DEFERRED, Reason.RATE_LIMITED,
                   f"{limit} actions started in the last {window:.0f}s (the limit)", oldest + window)


async def breaker_cap(ctx: Admission) -> Verdict | None:
    """Count what we drained, from the store: a backend that cannot see drains (or a human who
    resumed a node while its alert still fires) must not let a storm through."""
    a, g = ctx.action, ctx.config.guardrails
    if a.kind not in DRAINING or ctx.drained_by_us:
        return None
    fleet: int | None = None  # dry-run without a reachable cluster: only breaker_max_nodes applies
    try:
        fleet = await ctx.fleet_size()
    except BackendError:
        if not ctx.config.dry_run:
            raise
    cap = g.breaker_max_nodes
    if fleet is not None:
        cap = min(cap, max(1, math.floor(g.breaker_max_fraction * fleet)))
    would_be = len(set(await ctx.store.drained()) - {a.node}) + 1
    if would_be <= cap:
        return None
    return await trip(ctx, f"draining {a.node} would make {would_be} nodes drained by gpuhealth; cap is "
                           f"{cap} (breaker_max_nodes {g.breaker_max_nodes}, breaker_max_fraction "
                           f"{g.breaker_max_fraction:g} of {fleet} nodes)")


async def requeue_cap(ctx: Admission) -> Verdict | None:
    """Requeueing moves work without draining, so it has its own cap: nodes in a window."""
    a, g = ctx.action, ctx.config.guardrails
    if a.kind not in KINDS or not KINDS[a.kind].moves_work_only:
        return None
    since = time.time() - g.requeue_breaker_window_seconds
    nodes = await ctx.store.nodes_started(a.kind, since, a.node)
    if nodes + 1 <= g.requeue_breaker_max_nodes:
        return None
    return await trip(ctx, f"requeueing on {a.node} would make {nodes + 1} nodes whose jobs gpuhealth "
                           f"requeued in {g.requeue_breaker_window_seconds:.0f}s; cap is "
                           f"{g.requeue_breaker_max_nodes} (requeue_breaker_max_nodes)")


async def drained_by_us(ctx: Admission) -> Verdict | None:
    """An undrain touches only a node this webhook drained, and not one left for a human."""
    node = ctx.action.node
    entry = (await ctx.store.drained()).get(node)
    if entry is None:
        return Verdict(Outcome.SKIPPED, Reason.NOT_DRAINED_BY_US, f"{node} is not drained by us")
    if entry.keep:
        return Verdict(Outcome.SKIPPED, Reason.LEFT_FOR_HUMAN, f"{node} is left drained for a human")
    return None


async def all_resolved(ctx: Admission) -> Verdict | None:
    """Every alert that keeps the node drained must have resolved, not only this one."""
    a = ctx.action
    if keeps_drained(await ctx.store.firing_actions(a.node, a.alert)):
        return Verdict(Outcome.SKIPPED, Reason.STILL_FIRING, f"other alerts still keep {a.node} drained")
    return None


async def automatic_undrain(ctx: Admission) -> Verdict | None:
    if ctx.config.undrain.mode == "manual":
        return Verdict(Outcome.SKIPPED, Reason.LEFT_FOR_HUMAN, "undrain mode is manual")
    return None


async def still_ours(ctx: Admission) -> Verdict | None:
    """The node is still drained with our reason (in dry-run it was never drained: it would be resumed)."""
    if ctx.config.dry_run:
        return None
    return ownership(ctx.action, await ctx.cluster_node(), "resume")


# Each list in two parts: what runs before the fleet's admission lock (no journal, no cluster), and
# what runs under it; the order within each list is the order of the checks.
ACTION_CHECKS_BEFORE_LOCK: tuple[Check, ...] = (record_only, labels, deny_list, allow_list)
ACTION_CHECKS: tuple[Check, ...] = (*ACTION_CHECKS_BEFORE_LOCK, breaker_closed, node_state, cooldown,
                                    rate_limit, breaker_cap, requeue_cap)
UNDRAIN_CHECKS_BEFORE_LOCK: tuple[Check, ...] = (labels,)
UNDRAIN_CHECKS: tuple[Check, ...] = (*UNDRAIN_CHECKS_BEFORE_LOCK, drained_by_us, all_resolved,
                                     automatic_undrain, breaker_closed, still_ours)


def _checks(ctx: Admission) -> tuple[tuple[Check, ...], tuple[Check, ...]]:
    """The action's checks: those before the lock, and the rest."""
    checks, before = ((UNDRAIN_CHECKS, UNDRAIN_CHECKS_BEFORE_LOCK) if ctx.action.kind == UNDRAIN
                      else (ACTION_CHECKS, ACTION_CHECKS_BEFORE_LOCK))
    return before, checks[len(before):]


async def _first(ctx: Admission, checks: tuple[Check, ...]) -> Verdict | None:
    for check in checks:
        verdict = await check(ctx)
        if verdict is not None:
            return verdict
    return None


async def observe(ctx: Admission) -> None:
    """Read from the cluster what the checks under the lock will ask for (a read that fails is kept,
    and raised by the check that needs it, in its turn)."""
    a = ctx.action
    if a.kind != UNDRAIN or not ctx.config.dry_run:  # a dry-run undrain never asks the cluster
        with contextlib.suppress(BackendError):
            await ctx.cluster_node()
    if a.kind in DRAINING:
        with contextlib.suppress(BackendError):
            await ctx.fleet_size()


async def before_lock(ctx: Admission) -> Verdict | None:
    """The checks that need neither the journal nor the cluster, then the cluster's reads."""
    before, _ = _checks(ctx)
    verdict = await _first(ctx, before)
    if verdict is None:
        await observe(ctx)
    return verdict


async def under_lock(ctx: Admission) -> Verdict | None:
    """The checks that count the fleet from the journal, held under the fleet's admission lock."""
    _, after = _checks(ctx)
    return await _first(ctx, after)

