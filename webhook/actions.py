"""The action vocabulary: one table of what each action kind does, and the steps it is made of.

Policy, configuration, guardrails, the engine, the metrics and the contract tests all read this
table, so that adding a kind, or changing whether one drains or is undone when its alert resolves,
is one edit here and nowhere else. ``docs/contract.md`` keeps the same table for rule authors; a
contract test holds the two (and the rules' catalogue) together.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One call to the cluster; a restart resumes after the last step journaled as done."""

    name: str
    plan: str  # what the step would do, for dry-run and logs: {node}, {gpu} and {reason} are filled in
    changes_node: bool  # re-checked against the cluster right before it runs: an operator's drain wins
    needs_gpu: bool = False  # acts on the alert's GPU, so the alert must name a real one


STEPS: dict[str, Step] = {step.name: step for step in (
    Step("checkpoint", "ask the jobs on {node} to checkpoint and wait for them", changes_node=False),
    Step("drain", "drain {node} ({reason!r})", changes_node=True),
    Step("requeue", "requeue the jobs on {node} excluding it", changes_node=False),
    Step("reset_gpu", "reset GPU {gpu} on {node}", changes_node=True, needs_gpu=True),
    Step("reboot", "reboot {node}", changes_node=True),
    Step("resume", "resume {node}", changes_node=True),
)}


@dataclass(frozen=True)
class ActionKind:
    """What one action kind does to a node."""

    name: str
    steps: tuple[str, ...]
    drains: bool  # the node stays drained while the alert fires (counted by the breaker)
    undone_on_resolve: bool  # the alert's resolution undrains the node (replace: a human decides)
    from_alerts: bool = True  # an alert or policy rule may ask for it (undrain follows a resolution)
    reason_note: str = ""  # put before the summary in the drain reason, for operators to read

    @property
    def needs_gpu(self) -> bool:
        return any(STEPS[step].needs_gpu for step in self.steps)

    @property
    def moves_work_only(self) -> bool:
        """Requeues jobs without draining: the requeue cap, not the drain breaker, bounds it."""
        return "requeue" in self.steps and not self.drains


NONE, UNDRAIN = "none", "undrain"
UNKNOWN = "unknown"  # the kind journaled for an action label the webhook does not know; never run

# Weakest first: the cooldown holds back only an action at least as strong as the last one.
KINDS: dict[str, ActionKind] = {kind.name: kind for kind in (
    ActionKind(NONE, (), drains=False, undone_on_resolve=False),
    ActionKind("restart_job", ("requeue",), drains=False, undone_on_resolve=False),
    # predictive: time to save work first; weaker than a drain, so a hard fault after it still acts
    ActionKind("checkpoint_drain", ("checkpoint", "drain", "requeue"), drains=True, undone_on_resolve=True),
    # predictive too, with a reset to apply (corrected-ECC storm, HBM wear): the jobs save work first;
    # weaker than the hard failures' drain_reset_gpu, which a later uncorrectable error still gets
    ActionKind("checkpoint_drain_reset_gpu", ("checkpoint", "drain", "requeue", "reset_gpu"), drains=True,
               undone_on_resolve=True),
    ActionKind("drain", ("drain", "requeue"), drains=True, undone_on_resolve=True),
    ActionKind("drain_reset_gpu", ("drain", "requeue", "reset_gpu"), drains=True, undone_on_resolve=True),
    ActionKind("drain_reboot", ("drain", "requeue", "reboot"), drains=True, undone_on_resolve=True),
    ActionKind("replace", ("drain", "requeue"), drains=True, undone_on_resolve=False,
               reason_note="replace requested"),
    ActionKind(UNDRAIN, ("resume",), drains=False, undone_on_resolve=False, from_alerts=False),
)}

ALERT_ACTIONS = tuple(name for name, kind in KINDS.items() if kind.from_alerts)  # what an alert may ask
DRAINING = tuple(name for name, kind in KINDS.items() if kind.drains)
ACTING = tuple(name for name in KINDS if name != NONE)  # kinds that start and count against rate limits


def at_least_as_strong(name: str) -> tuple[str, ...]:
    """The alert actions as strong as ``name`` or stronger (the cooldown's comparison)."""
    return ALERT_ACTIONS[ALERT_ACTIONS.index(name):]
