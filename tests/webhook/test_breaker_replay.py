"""What the open breaker held back is listed, and its reset replays it or drops it with a record."""

from __future__ import annotations

import io
import json

from webhook_helpers import alert, notification


def audit_events(tmp_path) -> list[tuple[int, str]]:
    lines = (tmp_path / "state" / "audit.jsonl").read_text().splitlines()
    return [(r["id"], r["event"]) for r in map(json.loads, lines)]


async def _tripped(hook) -> list[dict]:
    await hook.post(*[alert(f"gpu{i:02d}", action="drain") for i in range(1, 5)])
    actions = await hook.settle()
    held = [a for a in actions if a["reason"] == "breaker_open"]
    assert len(held) == 3 and len(hook.drained) == 1
    listed = (await hook.call("GET", "/status"))["held_by_breaker"]
    assert sorted(h["id"] for h in listed) == sorted(a["id"] for a in held)
    assert {h["kind"] for h in listed} == {"drain"}
    return held


async def test_a_reset_without_a_choice_keeps_them_listed(webhook):
    hook = await webhook(guardrails={"breaker_max_nodes": 1})
    held = await _tripped(hook)
    await hook.call("POST", "/breaker/reset")
    assert len((await hook.call("GET", "/status"))["held_by_breaker"]) == len(held)
    await hook.call("POST", "/breaker/reset?held=maybe", expect=400)


async def test_dropped_actions_are_recorded_as_dropped(webhook, tmp_path):
    hook = await webhook(guardrails={"breaker_max_nodes": 1})
    held = await _tripped(hook)
    answer = await hook.call("POST", "/breaker/reset?held=drop")
    assert sorted(answer["breaker"]["dropped"]) == sorted(a["id"] for a in held)
    actions = {a["id"]: a for a in await hook.settle()}
    for a in held:
        assert (actions[a["id"]]["state"], actions[a["id"]]["reason"]) == ("skipped", "dropped_at_reset")
        assert "dropped at its reset by" in actions[a["id"]]["detail"]
        assert (a["id"], "dropped") in audit_events(tmp_path)
    assert (await hook.call("GET", "/status"))["held_by_breaker"] == []
    assert len(hook.drained) == 1, "nothing ran"
    assert await hook.metric("gpuhealth_webhook_actions_total", action="drain", outcome="skipped",
                             reason="dropped_at_reset") == 3


async def test_replayed_actions_pass_every_guardrail_again(webhook, tmp_path):
    hook = await webhook(guardrails={"breaker_max_nodes": 2})
    await hook.post(*[alert(f"gpu{i:02d}", action="drain") for i in range(1, 5)])
    first = await hook.settle()
    held = [a["id"] for a in first if a["reason"] == "breaker_open"]
    assert len(held) == 2 and len(hook.drained) == 2
    answer = await hook.call("POST", "/breaker/reset?held=replay")
    assert sorted(answer["breaker"]["replayed"]) == sorted(held)
    again = {a["id"]: a for a in await hook.settle()}
    # the cap still holds: both replays are admitted again, and the first of them trips the breaker anew
    assert sorted(again[i]["reason"] for i in held) == ["breaker_open", "breaker_open"]
    assert all((i, "replayed") in audit_events(tmp_path) for i in held)
    assert len(hook.drained) == 2


async def test_a_flood_of_other_skipped_actions_neither_hides_the_held_ones_nor_loses_their_replay(webhook):
    """10,001 alerts skipped for their node label after the breaker held two drains: the held drains
    are still listed, and a replay still reaches them."""
    hook = await webhook(guardrails={"breaker_max_nodes": 2})
    await hook.post(*[alert(f"gpu{i:02d}", action="drain") for i in range(1, 5)])
    held = sorted(a["id"] for a in await hook.settle() if a["reason"] == "breaker_open")
    assert len(held) == 2
    flood = json.dumps(notification(*[alert("not a node", action="drain") for _ in range(10_001)]))
    resp = await hook.client.post("/alerts", data=io.BytesIO(flood.encode()), headers=hook.posting)
    assert resp.status == 200, await resp.text()
    assert sorted(h["id"] for h in (await hook.call("GET", "/status"))["held_by_breaker"]) == held
    answer = await hook.call("POST", "/breaker/reset?held=replay")
    assert sorted(answer["breaker"]["replayed"]) == held
