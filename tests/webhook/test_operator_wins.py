"""An operator's drain always wins, guardrails hold on every backend, and credentials are split by role."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

from gpuhealth.webhook.backends.command import CommandBackend
from gpuhealth.webhook.backends.simulated import SimulatedBackend
from webhook_helpers import NODES, TOKEN, alert, notification, resolved

OPERATOR_REASON = "ops: replacing the PSU, ticket 77"



async def test_undrain_leaves_a_node_an_operator_redrained_while_the_health_check_waited(webhook, tmp_path):
    healthy = tmp_path / "healthy"
    check = [sys.executable, "-c", f"import os, sys; sys.exit(0 if os.path.exists({str(healthy)!r}) else 1)"]
    hook = await webhook(undrain={"health_check": check, "health_check_retry_seconds": 0.2,
                                  "health_check_max_attempts": 10})
    firing = alert("gpu01", action="drain")
    await hook.post(firing)
    await hook.settle()
    body = await hook.post(resolved(firing))
    [undrain_id] = body["new_actions"]
    await hook.wait_action(undrain_id, lambda a: a["reason"] == "health_check_failed")
    hook.backend.state["nodes"]["gpu01"]["reason"] = OPERATOR_REASON  # the operator takes the node over
    healthy.touch()
    undrain = await hook.wait_action(undrain_id, lambda a: a["state"] not in ("pending", "running"))
    assert (undrain["state"], undrain["reason"]) == ("skipped", "drained_by_other"), undrain
    assert hook.drained == {"gpu01": OPERATOR_REASON}
    assert [h[0] for h in hook.backend.history] == ["drain"]
    assert (await hook.call("GET", "/status"))["drained_by_us"] == []


async def test_no_alert_can_undrain_a_node_an_operator_drained(webhook):
    """An attacker holding the intake credential asks for an undrain outright, names a node in a
    hostlist or with a look-alike, and forges a resolution of an alert that met the operator's drain:
    nothing reaches the cluster, and the operator's reason stays."""
    hook = await webhook()
    hook.backend.state["nodes"]["gpu07"].update(drained=True, reason=OPERATOR_REASON)
    firing = alert("gpu07", action="drain")
    asks = [alert("gpu07", action=kind) for kind in ("undrain", "resume", "UNDRAIN", "none ")]
    hostlists = ("gpu0[6-8]", "gpu06,gpu07", "ALL", "gpu07 ", "gpu\u200b07")
    asks += [alert(node, action="drain") for node in hostlists]
    await hook.post(firing, *asks)
    await hook.settle()
    await hook.post(resolved(firing))
    actions = await hook.settle()
    assert hook.drained == {"gpu07": OPERATOR_REASON}
    assert hook.backend.history == []
    assert {(a["kind"], a["reason"]) for a in actions} == {
        ("drain", "drained_by_other"), ("unknown", "unknown_action"), ("drain", "invalid_node")}


class OperatorDuringRequeue(SimulatedBackend):
    """Between our drain and our reboot, an operator changes the node: the reboot must not follow."""

    def __init__(self, *args, operator, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.operator = operator

    async def jobs_on_node(self, node):
        self.operator(self.state["nodes"][node])
        return await super().jobs_on_node(node)


async def test_a_reboot_is_not_sent_to_a_node_an_operator_took_over_after_our_drain(webhook):
    backend = OperatorDuringRequeue(NODES, operator=lambda n: n.update(reason=OPERATOR_REASON))
    hook = await webhook(backend=backend)
    await hook.post(alert("gpu02", action="drain_reboot"))
    [action] = await hook.settle()
    assert (action["state"], action["reason"]) == ("skipped", "drained_by_other"), action
    assert "before reboot" in action["detail"]
    assert [h[0] for h in backend.history] == ["drain"] and hook.drained == {"gpu02": OPERATOR_REASON}


async def test_a_reboot_is_not_sent_to_a_node_an_operator_put_back_in_service(webhook):
    backend = OperatorDuringRequeue(NODES, operator=lambda n: n.update(drained=False, reason=""))
    hook = await webhook(backend=backend)
    await hook.post(alert("gpu03", action="drain_reset_gpu"))
    [action] = await hook.settle()
    assert (action["state"], action["reason"]) == ("skipped", "not_drained_by_us"), action
    assert [h[0] for h in backend.history] == ["drain"] and hook.drained == {}


async def test_a_drain_admitted_before_an_operators_drain_does_not_overwrite_it(webhook):
    class OperatorAtAdmission(SimulatedBackend):
        calls = 0

        async def node_state(self, node):
            state = await super().node_state(node)
            self.calls += 1
            if self.calls == 1:  # right after admission read the node, the operator drains it
                self.state["nodes"][node].update(drained=True, reason=OPERATOR_REASON)
            return state

    backend = OperatorAtAdmission(NODES)
    hook = await webhook(backend=backend)
    await hook.post(alert("gpu04", action="drain"))
    [action] = await hook.settle()
    assert (action["state"], action["reason"]) == ("skipped", "drained_by_other"), action
    assert backend.history == [] and hook.drained == {"gpu04": OPERATOR_REASON}
    assert (await hook.call("GET", "/status"))["drained_by_us"] == []


# --- guardrails on a command backend whose node_state cannot see our drains ---

def blind_command_backend(tmp_path: Path) -> CommandBackend:
    """A site whose node_state always answers 'not drained' (it cannot see drains): the breaker must
    count our own drains from the journal."""
    log = tmp_path / "drains.log"
    return CommandBackend.from_config({
        "fleet_size": 100, "timeout_seconds": 20,
        "commands": {
            "node_state": ["sh", "-c", "echo '{{\"exists\": true, \"drained\": false}}'"],
            "drain": ["sh", "-c", f'echo "$GPUHEALTH_NODE" >> {log}'],
        }})


async def test_the_breaker_holds_on_a_command_backend_that_cannot_see_drains(webhook, tmp_path):
    hook = await webhook(backend=blind_command_backend(tmp_path),
                         guardrails={"breaker_max_nodes": 2, "breaker_max_fraction": 0.05})
    await hook.post(*[alert(f"node{i:03d}", action="drain") for i in range(60)])
    actions = await hook.settle(timeout=60)
    drained = (tmp_path / "drains.log").read_text().split()
    assert len(drained) == 2, drained
    assert sum(a["reason"] == "breaker_open" for a in actions) == 58
    assert (await hook.call("GET", "/status"))["breaker"]["open"] is True


async def test_dry_run_applies_the_breaker(webhook, tmp_path):
    hook = await webhook(dry_run=True, backend=blind_command_backend(tmp_path),
                         guardrails={"breaker_max_nodes": 2, "breaker_max_fraction": 0.05,
                                     "rate_limit_actions": 1000})
    await hook.post(*[alert(f"node{i:03d}", action="drain") for i in range(60)])
    actions = await hook.settle(timeout=60)
    assert sum(a["outcome"] == "dry_run" for a in actions) == 2
    assert sum(a["reason"] == "breaker_open" for a in actions) == 58
    assert not (tmp_path / "drains.log").exists()


async def test_dry_run_applies_the_rate_limit(webhook):
    hook = await webhook(dry_run=True,
                         guardrails={"rate_limit_actions": 3, "rate_limit_window_seconds": 3600})
    await hook.post(*[alert(f"gpu{i:02d}", action="restart_job") for i in range(1, 7)])
    reasons = [a["reason"] for a in await hook.settle()]
    assert reasons == ["dry_run"] * 3 + ["rate_limited"] * 3


async def test_a_requeue_storm_trips_its_own_cap(webhook):
    hook = await webhook(guardrails={"requeue_breaker_max_nodes": 3},
                         jobs={n: [f"{n}-job"] for n in NODES})
    await hook.post(*[alert(f"gpu{i:02d}", action="restart_job") for i in range(1, 9)])
    actions = await hook.settle()
    assert [a["reason"] for a in actions] == ["ok"] * 3 + ["breaker_open"] * 5
    assert sum(h[0] == "requeue" for h in hook.backend.history) == 3
    assert "requeue_breaker_max_nodes" in (await hook.call("GET", "/status"))["breaker"]["reason"]


# --- credentials by role ---

async def test_operator_actions_take_the_operator_credential_only(webhook, tmp_path):
    (tmp_path / "operator-token").write_text("operator-secret-42\n")
    (tmp_path / "alice").write_text("wonderland\n")
    hook = await webhook(auth={"operator": {"token_file": str(tmp_path / "operator-token"),
                                            "basic_auth": {"username": "alice",
                                                           "password_file": str(tmp_path / "alice")}}},
                         guardrails={"require_approval": ["replace"]})
    body = await hook.post(alert("gpu05", action="replace"), alert("gpu06", action="replace"))
    first, second = body["new_actions"]
    intake = {"Authorization": f"Bearer {TOKEN}"}
    operator = {"Authorization": "Bearer operator-secret-42"}
    for path in (f"/actions/{first}/approve", f"/actions/{first}/cancel", "/breaker/reset"):
        assert (await hook.client.post(path, headers=intake)).status == 401, path
    resp = await hook.client.post("/alerts", json=notification(alert("gpu07")), headers=operator)
    assert resp.status == 401, "the operator credential does not deliver alerts"
    assert (await hook.client.post(f"/actions/{first}/approve", headers=operator)).status == 200
    alice = {"Authorization": "Basic " + base64.b64encode(b"alice:wonderland").decode()}
    resp = await hook.client.post(f"/actions/{second}/approve", headers=alice)
    assert resp.status == 200
    await hook.settle()
    approvals = [(await hook.call("GET", f"/actions/{i}"))["transitions"][1]["detail"]
                 for i in (first, second)]
    assert approvals == ["approved by operator token", "approved by operator basic user alice"]



async def test_a_start_without_operator_credentials_says_that_alertmanagers_also_approve(webhook, caplog,
                                                                                         tmp_path):
    """A careless deployment leaves out ``auth.operator``: allowed, but never silently."""
    with caplog.at_level("WARNING", logger="gpuhealth.webhook.auth"):
        await webhook()
    assert any("event=no_operator_credentials" in r.getMessage() for r in caplog.records)
    caplog.clear()
    (tmp_path / "operator-token").write_text("operator-secret-42\n")
    with caplog.at_level("WARNING", logger="gpuhealth.webhook.auth"):
        await webhook(auth={"operator": {"token_file": str(tmp_path / "operator-token")}})
    assert not any("no_operator_credentials" in r.getMessage() for r in caplog.records)


SITE = """\
import json, os, sys
from pathlib import Path
state = Path(os.environ["SITE_STATE"]) / (os.environ["GPUHEALTH_NODE"] + ".json")
op = os.environ["GPUHEALTH_OPERATION"]
with open(Path(os.environ["SITE_STATE"]) / "calls.log", "a") as log:
    log.write(op + " " + os.environ["GPUHEALTH_NODE"] + "\\n")
idle = {"exists": True, "drained": False, "reason": ""}
current = json.loads(state.read_text()) if state.exists() else idle
if op == "drain" and not current["drained"]:
    current = {"exists": True, "drained": True, "reason": os.environ["GPUHEALTH_REASON"]}
elif op == "resume":
    current = idle
state.write_text(json.dumps(current))
if op == "node_state":
    print(json.dumps(current))
"""


async def test_on_a_command_backend_undrain_leaves_a_node_the_operator_redrained(webhook, tmp_path):
    """The same race on a site's own commands: the operator's drain, written where the site's
    node_state reads it, wins over our undrain."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "site.py").write_text(SITE)
    command = [sys.executable, str(site / "site.py")]
    backend = CommandBackend.from_config({
        "fleet_size": 16, "timeout_seconds": 20, "env": {"SITE_STATE": str(site)},
        "commands": {op: command for op in ("node_state", "drain", "resume")}})
    healthy = tmp_path / "healthy"
    check = [sys.executable, "-c", f"import os, sys; sys.exit(0 if os.path.exists({str(healthy)!r}) else 1)"]
    hook = await webhook(backend=backend, undrain={"health_check": check, "health_check_retry_seconds": 0.2,
                                                   "health_check_max_attempts": 10})
    firing = alert("gpu05", action="drain")
    await hook.post(firing)
    assert (await hook.settle(timeout=30))[0]["reason"] == "ok"
    [undrain_id] = (await hook.post(resolved(firing)))["new_actions"]
    await hook.wait_action(undrain_id, lambda a: a["reason"] == "health_check_failed")
    (site / "gpu05.json").write_text(json.dumps({"exists": True, "drained": True, "reason": OPERATOR_REASON}))
    healthy.touch()
    undrain = await hook.wait_action(undrain_id, lambda a: a["state"] not in ("pending", "running"))
    assert (undrain["state"], undrain["reason"]) == ("skipped", "drained_by_other"), undrain
    calls = (site / "calls.log").read_text().split("\n")
    assert "resume gpu05" not in calls and "drain gpu05" in calls
    assert json.loads((site / "gpu05.json").read_text())["reason"] == OPERATOR_REASON
