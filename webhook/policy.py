"""The policy: which action an alert calls for, from its labels alone.

Rules are tried in order and the first whose matchers all fit wins; otherwise the alert's own
``action`` label (set by the generated alert rules) decides. The kinds and what they do are
``actions.py``'s; guardrails come later, at admission, because they depend on the cluster's state
at the moment of acting.
"""

from __future__ import annotations

from gpuhealth.webhook.actions import ALERT_ACTIONS, UNKNOWN
from gpuhealth.webhook.config import Config
from gpuhealth.webhook.labels import UNNAMED_ALERT, action_problem, clean_text, unknown_action
from gpuhealth.webhook.models import Notification
from gpuhealth.webhook.store import Decision


def choose_action(labels: dict[str, str], config: Config) -> str:
    """The action the first matching rule names, else the alert's action label (checked later: an
    unknown one is refused, never mistaken for ``none``), else ``default_action``."""
    policy = config.policy
    for rule in policy.rules:
        if rule.matches(labels):
            return rule.action
    return labels.get(policy.action_label) or policy.default_action


def decide(notification: Notification, config: Config) -> dict[tuple[str, str], Decision]:
    """A decision for every firing alert of the notification, keyed by the alert's identity."""
    decisions = {}
    for alert in notification.alerts:
        if alert.status == "firing":
            asked = choose_action(alert.labels, config)
            if asked in ALERT_ACTIONS:
                kind, problem = asked, action_problem(asked, alert.node, alert.gpu, alert.alertname)
            else:  # journaled as "unknown": the label's text appears only quoted, in the detail
                kind, problem = UNKNOWN, unknown_action(asked)
            decisions[alert.key] = Decision(kind, kind in config.guardrails.require_approval, problem)
    return decisions


OURS = "gpuhealth:"


def drain_reason(alert_name: str, summary: str) -> str:
    """The scheduler-visible reason; its prefix is how we recognise our own drains."""
    summary = clean_text(summary)
    return clean_text(f"{OURS} {alert_name or UNNAMED_ALERT}" + (f": {summary}" if summary else ""))


def is_ours(reason: str) -> bool:
    return reason.startswith(OURS)

