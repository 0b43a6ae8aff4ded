"""A journal on a full disk: no side effect is repeated, /healthz says so, and work resumes once space
returns. The disk is a real 2 MiB tmpfs (``small_disk``), filled by the drain command itself, so the
write that records the drain is the first one refused. The same on the real Slurm: test_slurm_backend.py."""

from __future__ import annotations

from gpuhealth.webhook.backends.command import CommandBackend
from waiting import eventually
from webhook_helpers import alert


async def test_a_full_disk_never_repeats_a_drain_and_work_resumes_when_space_returns(webhook, tmp_path,
                                                                                  small_disk):
    filler, calls = small_disk / "filler", tmp_path / "drains.log"
    backend = CommandBackend.from_config({"fleet_size": 16, "timeout_seconds": 20, "commands": {
        "node_state": ["sh", "-c", "echo '{{\"exists\": true, \"drained\": false}}'"],
        "drain": ["sh", "-c", f'echo "$GPUHEALTH_NODE" >> {calls}; dd if=/dev/zero of={filler} bs=64k '
                              "2>/dev/null; exit 0"]}})
    hook = await webhook(backend=backend, state_dir=str(small_disk))
    await hook.post(alert("gpu01", action="drain"))

    await hook.until_metric("gpuhealth_webhook_journal_write_failures_total", 4,  # several retry rounds
                            "the journal to report refused writes")
    assert calls.read_text().split() == ["gpu01"], "the drain was sent again without its record"
    health = await hook.client.get("/healthz")
    assert health.status == 503 and "journal cannot be written" in (await health.json())["error"]
    resp = await hook.client.post("/breaker/reset", headers=hook.auth)
    assert resp.status == 503 and "journal" in (await resp.json())["error"]
    resp = await hook.client.post("/alerts", json={"version": "4", "status": "firing", "alerts": [
        alert("gpu02", action="restart_job")]}, headers=hook.auth)
    assert resp.status == 503

    filler.unlink()  # space returns
    actions = await eventually(hook.actions, lambda a: a and a[0]["state"] == "done", timeout=60,
                               what="the drain once space returned", interval=0.1)
    assert (actions[0]["reason"], actions[0]["progress"]["done"]) == ("ok", ["drain", "requeue"])
    assert calls.read_text().split() == ["gpu01"], "exactly one drain, first to last"
    assert (await hook.client.get("/healthz")).status == 200
