"""The webhook's own metrics, on a private registry so that two apps in one process never clash."""

from __future__ import annotations

from gpuhealth.webhook.actions import KINDS, UNKNOWN
from gpuhealth.webhook.outcomes import VALID, Outcome, Reason
from gpuhealth.webhook.store import CHAIN_STATES
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

NOTIFICATION_OUTCOMES = ("accepted", "duplicate", "malformed", "unauthorized", "too_large", "journal_error")
CONNECTIONS_CLOSED = ("oldest_unserved", "new")  # which connection the cap closed


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.notifications = Counter(
            "gpuhealth_webhook_notifications", "Alertmanager notifications received, by outcome.",
            ["outcome"], registry=self.registry)
        self.actions = Counter(
            "gpuhealth_webhook_actions", "Action decisions and results, by action, outcome and reason.",
            ["action", "outcome", "reason"], registry=self.registry)
        self.queue_depth = Gauge(
            "gpuhealth_webhook_queue_depth",
            "Actions not finished yet (pending, awaiting approval, running).", registry=self.registry)
        self.latency = Histogram(
            "gpuhealth_webhook_notification_to_action_seconds",
            "Time from receiving an alert to its action having been carried out.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600), registry=self.registry)
        self.breaker_open = Gauge(
            "gpuhealth_webhook_breaker_open", "1 while the circuit breaker stops all actions.",
            registry=self.registry)
        self.nodes_drained = Gauge(
            "gpuhealth_webhook_nodes_drained", "Nodes currently drained by this webhook.",
            registry=self.registry)
        self.claimed_actions = Gauge(
            "gpuhealth_webhook_claimed_actions",
            "Unfinished actions each webhook replica holds a live claim on (the journal's view, shared by "
            "all replicas).", ["replica"], registry=self.registry)
        self.chains = Gauge(
            "gpuhealth_webhook_chains",
            "Escalation chains by state (running, verifying, succeeded, exhausted, cancelled), as the "
            "journal holds them.", ["state"], registry=self.registry)
        for state in CHAIN_STATES:
            self.chains.labels(state)
        self.journal_write_failures = Counter(
            "gpuhealth_webhook_journal_write_failures",
            "Journal writes refused (disk full, read-only, I/O error); nothing starts while they fail.",
            registry=self.registry)
        self.announce_failures = Counter(
            "gpuhealth_webhook_announce_failures",
            "GPUHealthRemediation* alert posts an Alertmanager refused or did not answer in time.",
            registry=self.registry)
        self.connections_refused = Counter(
            "gpuhealth_webhook_connections_refused",
            "Connections closed because connection_limit was reached: the oldest one not being served, "
            "or the new one when every connection was being served.", ["which"], registry=self.registry)
        for which in CONNECTIONS_CLOSED:
            self.connections_refused.labels(which)
        for outcome in NOTIFICATION_OUTCOMES:
            self.notifications.labels(outcome)
        for action in KINDS:
            for outcome, reasons in VALID.items():
                for reason in reasons:
                    self.actions.labels(action, outcome.value, reason.value)
        self.actions.labels(UNKNOWN, Outcome.SKIPPED.value, Reason.UNKNOWN_ACTION.value)

    def action(self, action: str, outcome: Outcome, reason: Reason) -> None:
        self.actions.labels(action, outcome.value, reason.value).inc()
