"""What a resolved alert does, and which actions keep their node drained: when a node is undrained.

The store carries a resolution out in the same commit as the notification that brought it; the
rule is here. An action not started yet is cancelled. An action that drained the node (or found
it already drained for an earlier alert) and whose kind is undone on resolution is followed by an
undrain, which the guardrails admit only once no other firing alert keeps the node drained.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from gpuhealth.webhook.actions import KINDS, UNDRAIN
from gpuhealth.webhook.outcomes import Reason
from gpuhealth.webhook.store import (
    AWAITING_APPROVAL,
    CANCELLED,
    PENDING,
    SKIPPED,
    Action,
    Decision,
    RecordResult,
    Resolution,
)


def holds_node(action: Action) -> bool:
    """The action keeps its node drained while its alert fires.

    Every draining action that was not cancelled or skipped does; so does one skipped because an
    earlier alert had already drained the node, so that the node stays out until every such alert
    resolved.
    """
    kind = KINDS.get(action.kind)
    if kind is None or not kind.drains:
        return False
    return action.state not in (CANCELLED, SKIPPED) or action.reason == Reason.ALREADY_DRAINED


def resolve(actions: Sequence[Action]) -> Resolution:
    """What the resolution of one alert does to ``actions``, the actions that alert asked for."""
    cancel = tuple(a.id for a in actions if a.state in (PENDING, AWAITING_APPROVAL) and a.attempts == 0)
    undo = any(a.id not in cancel and KINDS[a.kind].undone_on_resolve and holds_node(a)
               for a in actions if a.kind in KINDS)
    return Resolution(cancel, UNDRAIN if undo else None)


def keeps_drained(firing: Iterable[Action]) -> bool:
    """Whether any of the actions of alerts still firing keeps the node drained."""
    return any(holds_node(a) for a in firing)


def wakes_worker(result: RecordResult, decisions: Mapping[tuple[str, str], Decision]) -> bool:
    """Whether a journaled notification gave the worker something to start: a new action that needs
    no approval (or the undrain a resolution calls for), or a cancelled one its node's queue waited
    behind. A duplicate, or an action held for approval (approving it wakes the worker), does not:
    on a shared journal each wake-up costs the worker a pass over the queue."""
    if result.cancelled:
        return True
    return bool(result.new_actions) and (result.resolved > 0 or any(
        d.problem is None and not d.needs_approval for d in decisions.values()))
