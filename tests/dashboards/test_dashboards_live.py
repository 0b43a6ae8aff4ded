"""Every panel's query against a real Prometheus holding the evaluation benchmark's small fleet.

The fleet is simulated from ``bench/scenarios/small.yaml``, backfilled with every generated recording
rule, and served by a real Prometheus; the queries are expanded exactly as Grafana would expand them
for a user looking at the whole fleet and drilling into its riskiest GPU.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from gpuhealth.dashboards.generate import render
from gpuhealth.dashboards.queries import (
    Window,
    panel_queries,
    riskiest_gpu,
    run,
    variable_queries,
    variable_values,
)

from gpuhealth.evaluation.expand import Expander
from gpuhealth.evaluation.fleet import store_records
from gpuhealth.previews.draw import Previewer
from gpuhealth.previews.fleet_sample import backfilled_fleet
from gpuhealth.previews.webhook_sample import SCRAPE_SECONDS, webhook_session

# The first test backfills a simulated fleet into a real Prometheus: minutes on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SCENARIO = Path(__file__).resolve().parents[2] / "bench" / "scenarios" / "small.yaml"
STEP = 240.0  # the rule groups' interval in the backfill (under Prometheus's 5-minute lookback)


# Counters that exist only once their event has happened; the small fleet has no PCIe fault, so
# there are no AER errors to show. These queries must still run without error.
EVENT_ONLY = ("gpuhealth_pcie_aer_errors_total",)


def webhook_only(expr: str) -> bool:
    """The webhook's metrics are not in the simulated fleet; those queries run against the webhook."""
    return "gpuhealth_webhook_" in expr and "gpuhealth_gpu" not in expr and "gpuhealth:" not in expr


@pytest.fixture(scope="module")
def models() -> dict[str, dict]:
    return {name: json.loads(text) for name, text in render().items()}


def store_every_record(fleet) -> None:
    """Record every shipped recording rule over the fleet's period, each computed once, level by level
    from the records stored before it. Backfilled by its folded expression (the benchmark's way), the
    risk score and its contributions each recompute every evidence record below them, per GPU shard:
    most of an hour on 2 cores. The dashboards read the records, not how they were computed; that the
    two ways agree is tests/evaluation/test_stored_records.py's claim."""
    expander = Expander(fleet.rules)
    every = " or ".join(dict.fromkeys(rule.name for rule in fleet.rules.records))
    # each name read twice: records_to_store keeps every record, not only those read more than once
    stored = store_records(fleet.server, fleet.blocks, expander, f"{every} or {every}", fleet.data_start,
                           fleet.end, STEP, progress=False)
    assert sorted(stored) == sorted(expander.records_used(every)), "every record stored, none broken"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, models):
    queries = [q.expr for model in models.values() for q in panel_queries(model)]
    # Recording rules every 4 minutes instead of every minute: a quarter of the backfill time.
    with backfilled_fleet(SCENARIO, tmp_path_factory.mktemp("fleet"), queries, interval=f"{STEP:.0f}s",
                          record=False) as backfilled:
        store_every_record(backfilled)
        yield backfilled


@pytest.fixture(scope="module")
def webhook(tmp_path_factory):
    with webhook_session(tmp_path_factory.mktemp("webhook"), pause=0.5) as session:
        yield session


@pytest.fixture(scope="module")
def window(fleet) -> Window:
    return Window(fleet.start, fleet.end, step=max(60.0, (fleet.end - fleet.start) // 240 // 60 * 60))


@pytest.fixture(scope="module")
def drill_target(fleet, window) -> tuple[str, str]:
    return riskiest_gpu(fleet.server.api, window)


def test_drill_down_target_is_a_gpu_at_risk(fleet, window, drill_target):
    node, gpu = drill_target
    peak = fleet.server.api.query(
        f'max_over_time(gpuhealth:gpu_failure_risk:score{{node="{node}", gpu="{gpu}"}}'
        f"[{int(window.end - window.start)}s])", time=window.end)
    assert peak and float(peak[0]["value"][1]) > 0


def test_every_fleet_query_returns_data(fleet, window, models, drill_target):
    empty, checked = [], 0
    for name, model in models.items():
        values = variable_values(model, *drill_target)
        for query in panel_queries(model):
            if webhook_only(query.expr):
                continue
            checked += 1
            result = run(fleet.server.api, query, values, window)
            if not result and not any(metric in query.expr for metric in EVENT_ONLY):
                empty.append(f"{name} / {query.panel_title} / {query.ref_id}: {query.expr}")
    assert checked > 40
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_every_webhook_query_returns_data(webhook, models):
    """Against gpuhealth-webhook acting on a simulated cluster, scraped every second."""
    window = Window(webhook.start, webhook.end, step=SCRAPE_SECONDS, scrape_interval=SCRAPE_SECONDS)
    empty, checked = [], 0
    for name, model in models.items():
        values = variable_values(model, "", "")
        for query in panel_queries(model):
            if webhook_only(query.expr):
                checked += 1
                if not run(webhook.server.api, query, values, window):
                    empty.append(f"{name} / {query.panel_title} / {query.ref_id}: {query.expr}")
    assert checked >= 12
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_template_variables_offer_choices(fleet, window, models, drill_target):
    api = fleet.server.api
    for name, model in models.items():
        values = variable_values(model, *drill_target)
        for variable, expr in variable_queries(model).items():
            expanded = expr.replace('"$cluster"', f'"{values["cluster"]}"').replace(
                '"$node"', f'"{values.get("node", ".*")}"')
            assert api.query(expanded, time=window.end), f"{name}: ${variable} offers nothing"


def test_drill_down_preview_has_data_in_every_panel(fleet, window, models, drill_target, tmp_path):
    model = models["gpuhealth-gpu.json"]
    previewer = Previewer(fleet.server.api, window, variable_values(model, *drill_target))
    path = previewer.render(model, tmp_path / "gpu.png")
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width == 1600 and height > width
    assert previewer.empty == []


def test_remediation_preview_has_data_in_every_panel(webhook, models, tmp_path):
    model = models["gpuhealth-remediation.json"]
    window = Window(webhook.start, webhook.end, step=SCRAPE_SECONDS, scrape_interval=SCRAPE_SECONDS)
    previewer = Previewer(webhook.server.api, window, variable_values(model, "", ""))
    assert previewer.render(model, tmp_path / "remediation.png").stat().st_size > 10_000
    assert previewer.empty == []
