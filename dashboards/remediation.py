"""Remediation: what the webhook did with the alerts, why, how fast, and whether it stopped itself."""

from __future__ import annotations

from gpuhealth.dashboards.build import new_dashboard, with_sections
from gpuhealth.dashboards.panels import (
    CLUSTER,
    query,
    selector,
    stat_panel,
    state_timeline_panel,
    table_panel,
    thresholds,
    timeseries_panel,
    value_text,
)
from gpuhealth.dashboards.settings import Settings
from grafana_foundation_sdk.builders import dashboard

UID = "gpuhealth-remediation"
SCOPE = selector(CLUSTER)
ACTIONS = f"gpuhealth_webhook_actions_total{SCOPE}"
BREAKER = value_text({"0": ("closed", "green"), "1": ("open", "red")})


def _now(settings: Settings) -> list:
    return [
        stat_panel("Circuit breaker", "Open while the webhook's safety limit has paused "
                   "remediation: alerts are still received, no node is drained.",
                   [query(f"max(gpuhealth_webhook_breaker_open{SCOPE})", "breaker", instant=True)],
                   mappings=BREAKER, steps=thresholds((None, "green"), (1, "red"))),
        stat_panel("Nodes drained", "Nodes the webhook holds drained now.",
                   [query(f"sum(gpuhealth_webhook_nodes_drained{SCOPE})", "drained", instant=True)],
                   steps=thresholds((None, "green"), (1, "orange"))),
        stat_panel("Queue depth", "Actions accepted from Alertmanager and not yet carried out.",
                   [query(f"sum(gpuhealth_webhook_queue_depth{SCOPE})", "queued", instant=True)],
                   steps=thresholds((None, "green"), (5, "orange"))),
        stat_panel("Actions in range", "Actions taken over the dashboard's time range, all outcomes.",
                   [query(f"round(sum(increase({ACTIONS}[$__range])))", "actions", instant=True)]),
    ]


def _actions(settings: Settings) -> list:
    return [
        timeseries_panel(
            "Actions by outcome", "Remediation actions per interval, stacked by outcome.",
            [query(f"sum by (outcome) (increase({ACTIONS}[$__rate_interval]))", "{{outcome}}")],
            w=12, h=8, bars=True, stacked=True, unit="short", min_val=0),
        timeseries_panel(
            "Notifications by outcome", "Alertmanager notifications the webhook received, by how it "
            "answered them.",
            [query(f"sum by (outcome) (increase(gpuhealth_webhook_notifications_total{SCOPE}"
                   "[$__rate_interval]))", "{{outcome}}")],
            w=12, h=8, bars=True, stacked=True, unit="short", min_val=0),
        table_panel(
            "Actions by action, outcome and reason",
            "Counts over the time range (combinations that did not occur are left out); the reason says "
            "why an action was skipped, deferred or cancelled.",
            [query(f"round(sum by (action, outcome, reason) (increase({ACTIONS}[$__range]))) > 0",
                   instant=True, table_format=True)],
            w=24, h=8, rename={"Value": "count"}, sort_by="count"),
    ]


def _latency(settings: Settings) -> list:
    buckets = (f"sum by (le) (rate(gpuhealth_webhook_notification_to_action_seconds_bucket{SCOPE}"
               "[$__rate_interval]))")
    return [
        state_timeline_panel(
            "Circuit breaker over time", "When the breaker was open and remediation paused.",
            [query(f"max(gpuhealth_webhook_breaker_open{SCOPE})", "breaker")],
            w=24, h=4, mappings=BREAKER, steps=thresholds((None, "green"), (1, "red"))),
        timeseries_panel(
            "Time from alert to action",
            "From the notification's arrival to the action's completion, by quantile.",
            [query(f"histogram_quantile({q}, {buckets})", f"p{q * 100:g}")
             for q in settings.latency_quantiles],
            w=12, h=8, unit="s", min_val=0),
        timeseries_panel(
            "Queue depth and drained nodes", "Backlog of pending actions and nodes held drained.",
            [query(f"sum(gpuhealth_webhook_queue_depth{SCOPE})", "queue depth"),
             query(f"sum(gpuhealth_webhook_nodes_drained{SCOPE})", "nodes drained")],
            w=12, h=8, unit="short", min_val=0),
    ]


def build(settings: Settings) -> dashboard.Dashboard:
    dash = new_dashboard(UID, "gpuhealth / Remediation",
                         "Actions of the remediation webhook by outcome and reason, its circuit breaker "
                         "and the time from alert to action.", settings)
    sections = [("Now", _now(settings)), ("Actions", _actions(settings)),
                ("Latency and safety", _latency(settings))]
    return with_sections(dash, sections)
