"""Fleet overview: where the fleet stands now and which GPUs and nodes to look at first."""

from __future__ import annotations

from gpuhealth.dashboards import fabric
from gpuhealth.dashboards.build import new_dashboard, with_sections
from gpuhealth.dashboards.panels import (
    CLUSTER,
    NODE,
    bargauge_panel,
    events,
    query,
    selector,
    stat_panel,
    state_timeline_panel,
    table_panel,
    thresholds,
    timeseries_panel,
)
from gpuhealth.dashboards.settings import Settings
from grafana_foundation_sdk.builders import dashboard

UID = "gpuhealth-fleet"
SCOPE = selector(CLUSTER, NODE)
RISK = f"gpuhealth:gpu_failure_risk:score{SCOPE}"
XIDS = "gpuhealth_xid_events_total"


def risk_steps(settings: Settings):
    return thresholds((None, "green"), (settings.risk_warning, "orange"), (settings.risk_critical, "red"))


def gpu_evidence(scope: str) -> str:
    """Every per-GPU evidence recording rule, its signal name moved into a ``signal`` label."""
    return (f'label_replace({{__name__=~"gpuhealth:gpu_evidence:.+", {scope[1:-1]}}}, '
            f'"signal", "$1", "__name__", "gpuhealth:gpu_evidence:(.+)")')


def _inventory(settings: Settings) -> list:
    missing = f"sum(gpuhealth_gpus_expected{SCOPE}) - sum(gpuhealth_gpus_visible{SCOPE})"
    return [
        stat_panel("GPUs visible", "GPUs NVML enumerates now, over the selected nodes.",
                   [query(f"sum(gpuhealth_gpus_visible{SCOPE})", "visible", instant=True)]),
        stat_panel("GPUs missing", "Expected minus visible: a GPU that fell off the bus disappears here.",
                   [query(missing, "missing", instant=True)],
                   steps=thresholds((None, "green"), (1, "red"))),
        stat_panel("GPUs at risk", f"GPUs whose failure risk is above {settings.risk_warning}, where the "
                   "failure-risk alert starts.",
                   [query(f"count({RISK} > {settings.risk_warning}) or vector(0)", "at risk", instant=True)],
                   steps=thresholds((None, "green"), (1, "orange"))),
        stat_panel("Nodes drained", "Nodes the remediation webhook holds drained now.",
                   [query("sum(gpuhealth_webhook_nodes_drained)", "drained", instant=True)],
                   steps=thresholds((None, "green"), (1, "orange"))),
        timeseries_panel(
            "GPUs visible vs expected",
            "A gap between the lines is a GPU lost from NVML (fallen off the bus, driver failure).",
            [query(f"sum(gpuhealth_gpus_expected{SCOPE})", "expected"),
             query(f"sum(gpuhealth_gpus_visible{SCOPE})", "visible")],
            w=8, h=8, unit="short"),
        timeseries_panel(
            "Nodes missing GPUs", "Per node, expected minus visible GPUs; zero while every GPU answers.",
            [query(f"gpuhealth_gpus_expected{SCOPE} - gpuhealth_gpus_visible{SCOPE}", "{{node}}")],
            w=16, h=8, min_val=0, unit="short"),
    ]


def _risk(settings: Settings) -> list:
    top = f"topk({settings.top_gpus}, {RISK})"
    contributions = f"gpuhealth:gpu_failure_risk:contribution{SCOPE}"
    signals = f"topk by (node, gpu) ({settings.top_signals}, {contributions}) and on (node, gpu) {top}"
    return [
        state_timeline_panel(
            "Failure risk by node and GPU",
            "Fused failure risk (0..1) of every GPU over time, one row per GPU; colours follow the alert "
            "thresholds.",
            [query(f"max by (node, gpu) ({RISK})", "{{node}} gpu {{gpu}}")],
            w=24, h=12, unit="percentunit", steps=risk_steps(settings)),
        bargauge_panel(
            "Riskiest GPUs", f"The {settings.top_gpus} GPUs with the highest failure risk now.",
            [query(f"sort_desc({top})", "{{node}} gpu {{gpu}}", instant=True)],
            w=10, h=10, unit="percentunit", steps=risk_steps(settings), max_val=1),
        table_panel(
            "Top signals of the riskiest GPUs",
            f"For each of the {settings.top_gpus} riskiest GPUs, the {settings.top_signals} signals that "
            "add most to its risk (weight x evidence; within a cause the largest counts, causes add, "
            "capped at 1).",
            [query(signals, instant=True, table_format=True)],
            w=14, h=10, hide=("__name__",), rename={"Value": "contribution"}, sort_by="contribution"),
    ]


def _events(settings: Settings) -> list:
    scope = SCOPE[1:-1]
    by = "node, gpu, xid"
    classified = "|".join(str(x) for c in settings.xid_classes for x in c.xids)
    groups = [(c.name, f'xid=~"{"|".join(map(str, c.xids))}"') for c in settings.xid_classes]
    groups.append(("informational", f'xid!~"{classified}"'))
    by_class = " or ".join(
        f'label_replace({events(XIDS + selector(scope, matcher), "$__interval", by)}, '
        f'"class", "{name}", "", "")' for name, matcher in groups)
    nfs = selector(CLUSTER, NODE, f'op="{settings.nfs_op}"')
    lemons = f"topk({settings.lemon_nodes}, {events(XIDS + SCOPE, '$__range', 'node')})"
    return [
        timeseries_panel(
            "XID events by action class",
            "XIDs grouped by the action their alert asks of the webhook (the rules' XID classes); "
            "informational XIDs raise no alert.",
            [query(f"sum by (class) ({by_class})", "{{class}}")],
            w=12, h=8, bars=True, stacked=True, unit="short", min_val=0),
        bargauge_panel(
            "Lemon nodes",
            "Nodes with the most XID events over the time range: a few nodes cause most exclusions, "
            "so repeat offenders are candidates for repair rather than another retry.",
            [query(f"sort_desc({lemons})", "{{node}}", instant=True)],
            w=12, h=8, unit="short", steps=thresholds((None, "green"), (1, "orange"), (10, "red"))),
        timeseries_panel(
            "Remediation actions",
            "Actions the webhook took, by action and outcome; the drained line counts nodes held drained.",
            [query("sum by (action, outcome) (increase(gpuhealth_webhook_actions_total[$__rate_interval]))",
                   "{{action}} {{outcome}}"),
             query("sum(gpuhealth_webhook_nodes_drained)", "nodes drained")],
            w=12, h=8, unit="short", min_val=0),
        timeseries_panel(
            f"NFS {settings.nfs_op} queueing share",
            f"Share of NFS {settings.nfs_op} time spent queued on the client (RPC slot table) rather than on "
            "the wire; checkpoint bursts push it towards 1.",
            [query(f"sum by (node) (rate(gpuhealth_nfs_rpc_queue_seconds_total{nfs}[$__rate_interval])) "
                   f"/ sum by (node) (rate(gpuhealth_nfs_rpc_execute_seconds_total{nfs}[$__rate_interval]))",
                   "{{node}}")],
            w=12, h=8, unit="percentunit", min_val=0),
    ]


def build(settings: Settings) -> dashboard.Dashboard:
    dash = new_dashboard(UID, "gpuhealth / Fleet overview",
                         "GPU inventory, failure risk, XID events, remediation, checkpoint storage and "
                         "the InfiniBand fabric across the fleet.", settings, node="multi")
    sections = [("Inventory", _inventory(settings)), ("Failure risk", _risk(settings)),
                ("Events and remediation", _events(settings)), ("Fabric", fabric.panels())]
    return with_sections(dash, sections)
