"""The policy: which action an alert calls for, from its labels alone.

Rules are tried in order and the first whose matchers all fit wins; otherwise the alert's own
``action`` label (set by the generated alert rules) decides. Guardrails come later, in the engine,
because they depend on the cluster's state at the moment of acting.
"""

from __future__ import annotations

from gpuhealth.webhook.config import ACTIONS, Config
from gpuhealth.webhook.journal import Decision
from gpuhealth.webhook.labels import clean_text, label_problem
from gpuhealth.webhook.models import Notification

# The steps each action runs, in order; a restart resumes after the last finished step.
STEPS: dict[str, tuple[str, ...]] = {
    "none": (),
    "restart_job": ("requeue",),
    "drain": ("drain", "requeue"),
    "drain_reset_gpu": ("drain", "requeue", "reset_gpu"),
    "drain_reboot": ("drain", "requeue", "reboot"),
    "replace": ("drain", "requeue"),
    "undrain": ("resume",),
}


def choose_action(labels: dict[str, str], config: Config) -> str:
    policy = config.policy
    for rule in policy.rules:
        if rule.matches(labels):
            return rule.action
    action = labels.get(policy.action_label, "")
    return action if action in ACTIONS else policy.default_action


def decide(notification: Notification, config: Config) -> dict[tuple[str, str], Decision]:
    """A decision for every firing alert of the notification, keyed by the alert's identity."""
    decisions = {}
    for alert in notification.alerts:
        if alert.status == "firing":
            kind = choose_action(alert.labels, config)
            problem = None if kind == "none" else label_problem(alert.node, alert.gpu, alert.alertname)
            decisions[alert.key] = Decision(kind, kind in config.guardrails.require_approval, problem)
    return decisions


OURS = "gpuhealth:"


def drain_reason(alert_name: str, summary: str) -> str:
    """The scheduler-visible reason; its prefix is how we recognise our own drains."""
    summary = clean_text(summary)
    return clean_text(f"{OURS} {alert_name or 'alert'}" + (f": {summary}" if summary else ""))


def is_ours(reason: str) -> bool:
    return reason.startswith(OURS)

