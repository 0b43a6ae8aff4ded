"""The recorded Alertmanager payloads keep the v4 webhook schema, and a fresh recording still matches them."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from record_fixtures import FIRING, FIXTURES_DIR, PARTLY, RESOLVED, WEBHOOK_RECEIVER, record

PAYLOAD_FIELDS = {"version", "groupKey", "truncatedAlerts", "status", "receiver", "groupLabels",
                  "commonLabels", "commonAnnotations", "externalURL", "alerts"}
ALERT_FIELDS = {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL", "fingerprint"}
PAYLOADS = sorted(p for p in FIXTURES_DIR.glob("*.json") if p.stem != "delivery_headers")


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _shape(body: dict[str, Any]) -> tuple[Any, ...]:
    """What must not drift between recordings: grouping, statuses, label sets (not times or ports)."""
    alerts = sorted((a["labels"]["alertname"], a["status"], tuple(sorted(a["labels"].items())),
                     tuple(sorted(a["annotations"]))) for a in body["alerts"])
    return body["status"], body["groupKey"], body["groupLabels"], body["commonLabels"], alerts


def test_every_scenario_was_recorded():
    assert {p.stem for p in PAYLOADS} == {name for name, _, _ in FIRING + PARTLY + RESOLVED}


@pytest.mark.parametrize("path", PAYLOADS, ids=lambda p: p.stem)
def test_payload_has_v4_schema(path):
    body = _load(path)
    assert set(body) == PAYLOAD_FIELDS
    assert body["version"] == "4"
    assert body["status"] in ("firing", "resolved")
    assert body["truncatedAlerts"] == 0
    assert body["alerts"], "a notification always carries alerts"
    for alert in body["alerts"]:
        assert set(alert) == ALERT_FIELDS
        assert alert["status"] in ("firing", "resolved")
        assert {"alertname", "node", "severity", "action"} <= set(alert["labels"])
        assert alert["labels"]["action"] == body["commonLabels"]["action"]
        assert {"summary", "description", "runbook_url"} <= set(alert["annotations"])
        assert len(alert["fingerprint"]) == 16
        datetime.fromisoformat(alert["startsAt"])
        datetime.fromisoformat(alert["endsAt"])
        assert body["groupLabels"]["node"] == alert["labels"]["node"]
    firing = any(a["status"] == "firing" for a in body["alerts"])
    assert body["status"] == ("firing" if firing else "resolved")


def test_node_level_and_gpu_alerts_are_both_present():
    group = _load(FIXTURES_DIR / "firing_node_and_gpu.json")
    assert sorted("gpu" in a["labels"] for a in group["alerts"]) == [False, True]


def test_the_projects_routing_splits_a_node_by_action():
    """rules/alertmanager.yml groups by node within each action's route: one notification per action."""
    same_node = [_load(FIXTURES_DIR / f"{name}.json")
                 for name in ("firing_node_and_gpu", "firing_same_node_other_action")]
    assert {body["groupLabels"]["node"] for body in same_node} == {"gpu03"}
    assert [body["commonLabels"]["action"] for body in same_node] == ["replace", "drain_reboot"]
    assert all(body["receiver"] == WEBHOOK_RECEIVER for body in same_node)


def test_delivery_headers_carry_the_bearer_token():
    headers = _load(FIXTURES_DIR / "delivery_headers.json")
    assert headers["Authorization"].startswith("Bearer ")
    assert headers["Content-Type"] == "application/json"
    assert headers["User-Agent"].startswith("Alertmanager/")


@pytest.mark.slow
async def test_fresh_recording_matches_committed_fixtures(tmp_path):
    fresh = await record(tmp_path)
    for path in PAYLOADS:
        assert _shape(fresh[path.stem]) == _shape(_load(path)), \
            f"{path.name} drifted from what Alertmanager sends; re-run record_fixtures.py"
    assert set(fresh["delivery_headers"]) == set(_load(FIXTURES_DIR / "delivery_headers.json"))
