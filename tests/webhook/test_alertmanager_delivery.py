"""A real HA pair of Alertmanagers delivering to the webhook: one drain, then an undrain on resolve."""

from __future__ import annotations

from datetime import UTC, datetime

import aiohttp
import pytest
from webhook_helpers import TOKEN

from gpuhealth.local.prometheus import AlertmanagerServer


def _am_config(webhook_url: str) -> dict:
    return {
        "route": {"receiver": "gpuhealth", "group_by": ["node"], "group_wait": "0s", "group_interval": "1s",
                  "repeat_interval": "1h"},
        "receivers": [{"name": "gpuhealth", "webhook_configs": [{
            "url": webhook_url, "send_resolved": True, "max_alerts": 0,
            "http_config": {"authorization": {"type": "Bearer", "credentials": TOKEN}}}]}],
    }


def _alert(node: str, gpu: str, ends_at: str | None = None) -> dict:
    alert = {"labels": {"alertname": "GPUHealthXidResetGpu", "node": node, "gpu": gpu, "severity": "critical",
                        "action": "drain_reset_gpu"},
             "annotations": {"summary": f"XID 48 on {node} GPU {gpu}"},
             "startsAt": "2026-11-30T05:00:00Z"}
    if ends_at:
        alert["endsAt"] = ends_at
    return alert


@pytest.mark.slow
async def test_ha_alertmanager_pair_drives_one_drain_and_one_undrain(webhook, tmp_path):
    hook = await webhook(jobs={"gpu05": ["77"]})
    url = str(hook.client.make_url("/alerts"))
    pair = [AlertmanagerServer(tmp_path / f"am{i}", _am_config(url)) for i in (1, 2)]
    try:
        for am in pair:
            am.start()
        async with aiohttp.ClientSession() as session:
            async def post(alerts: list[dict]) -> None:
                for am in pair:  # Prometheus sends every alert to every Alertmanager of the pair
                    async with session.post(f"{am.url}/api/v2/alerts", json=alerts) as resp:
                        assert resp.status == 200, await resp.text()

            await post([_alert("gpu05", "3")])
            actions = await hook.until(lambda a: a and a[0]["state"] == "done", "the drain")
            assert hook.drained == {"gpu05": "gpuhealth: GPUHealthXidResetGpu: XID 48 on gpu05 GPU 3"}
            assert ["reset_gpu", "gpu05", "3", hook.drained["gpu05"]] in hook.backend.history
            now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
            await post([_alert("gpu05", "3", ends_at=now)])
            actions = await hook.until(
                lambda a: any(x["kind"] == "undrain" and x["state"] == "done" for x in a), "the undrain")
    finally:
        for am in pair:
            am.stop()
    assert [(a["kind"], a["reason"]) for a in actions] == [("drain_reset_gpu", "ok"), ("undrain", "ok")]
    assert hook.drained == {}
    assert [op[0] for op in hook.backend.history] == ["drain", "requeue", "reset_gpu", "resume"]
    assert await hook.metric("gpuhealth_webhook_notifications_total", outcome="duplicate") >= 1
