"""The closed loop through the tiers: two Prometheus shards and a global tier (VictoriaMetrics, vmalert)
in front of one Alertmanager, the webhook and a real Slurm.

First `gpuhealth demo --shards 2` as a user runs it, interrupted with Ctrl-C once it showed the shards;
then one sharded stack: a hard fault on a node of each shard must drain both in Slurm, and a lemon
pattern spanning both shards (two past failures of a node recorded by the shard that scraped it before
a reshard, then a live one in its current shard) must fire GPUHealthLemonNode in vmalert, which
neither shard can see, and reach the webhook. Checked in Slurm, the shards, VictoriaMetrics and the
webhook's journal, each through its own API.
"""

from __future__ import annotations

import time

import pytest
from demo_process import demo_at_baseline, interrupt, processes_under

from gpuhealth.demo.sharded import ShardedStack
from gpuhealth.demo.stack import Fault, StackOptions, started
from gpuhealth.local.process import wait_until

pytestmark = pytest.mark.slow

LEMON = "GPUHealthLemonNode"
PAST_FAILURES_MINUTES_AGO = (40, 20)  # apart by more than two lemon steps (1 min), within its hour


def test_sharded_demo_shows_the_shards_and_ctrl_c_stops_every_process(tmp_path):
    workdir = tmp_path / "demo"
    with demo_at_baseline(workdir, "--shards", "2") as (proc, lines):
        shown = "".join(lines)
        assert "Prometheus shard-0" in shown and "Prometheus shard-1" in shown, shown
        assert "VictoriaMetrics" in shown and "vmalert" in shown, shown
        placed = [line for line in lines if " scrapes " in line]
        assert len(placed) == 2, shown
        assert {n for line in placed for n in line.split(" scrapes ")[1].strip().split(", ")} == {
            "node01", "node02", "node03", "node04"}, shown
        running = "\n".join(processes_under(workdir))
        for daemon in ("victoria-metrics", "vmalert", "prometheus-shard-0", "prometheus-shard-1"):
            assert daemon in running, running
        interrupt(proc)


def _lemon_actions(stack: ShardedStack, node: str) -> list[dict]:
    return [a for a in stack.webhook_get(f"/actions?node={node}")["actions"] if a["alertname"] == LEMON]


def _lemon_alerts(api, node: str) -> list[dict]:
    return api.query(f'ALERTS{{alertname="{LEMON}",alertstate="firing",node="{node}"}}')


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tiers")
    options = StackOptions(nodes=4, jobs=1, job_nodes=2, breaker_max_nodes=2)
    with ShardedStack(options, workdir=workdir, shards=2) as stack:
        stack.start()
        victims = [stack.nodes_of(shard)[0] for shard in ("shard-0", "shard-1")]
        lemon = victims[1]
        vm, vmalert = started(stack.victoria), started(stack.vmalert)
        now = time.time()
        stack.import_past_failures(lemon, "shard-0", [now - m * 60 for m in PAST_FAILURES_MINUTES_AGO])
        # The history alone is two onsets, short of the lemon count: evaluated, it must not fire.
        evaluated = vmalert.iterations("gpuhealth-lemon")
        wait_until(lambda: vmalert.iterations("gpuhealth-lemon") >= evaluated + 2, timeout=60, interval=0.5,
                   what="vmalert to evaluate the lemon group over the imported history")
        history_alone = {"vm": _lemon_alerts(vm.api, lemon), "webhook": _lemon_actions(stack, lemon)}
        for node in victims:
            stack.inject(Fault(node, "fell_off_bus", gpu=2, duration=0.0))

        def settled() -> bool:
            vm.flush()
            return (all("DRAIN" in stack.slurm.node(node).state for node in victims)
                    and bool(_lemon_actions(stack, lemon)) and bool(_lemon_alerts(vm.api, lemon)))
        wait_until(settled, timeout=240, interval=1.0,
                   what="both faulty nodes drained and the lemon alert at the webhook")
        yield stack, {"victims": victims, "lemon": lemon, "history_alone": history_alone, "workdir": workdir}


def test_each_shard_scrapes_its_hashmod_share_and_sends_only_records_and_alerts(tiers):
    stack, _ = tiers
    scraped = [{t["labels"]["node"] for t in shard.api.targets()
                if t["labels"].get("job") == "gpuhealth-exporter"} for shard in stack.shards]
    assert scraped[0] and scraped[1] and not scraped[0] & scraped[1]
    assert scraped[0] | scraped[1] == set(stack.nodes)
    assert {node: f"shard-{i}" for i, nodes in enumerate(scraped) for node in nodes} == stack.shard_of
    vm = started(stack.victoria).api
    sent = vm.query('count by (prometheus) ({__name__=~"gpuhealth:.+"})')
    assert {s["metric"].get("prometheus") for s in sent} == {"shard-0", "shard-1"}
    assert vm.query('count({__name__=~"gpuhealth_.+"})') == []  # raw exporter series stay in the shards


def test_a_fault_on_a_node_of_each_shard_drains_it_in_slurm(tiers):
    stack, where = tiers
    for index, node in enumerate(where["victims"]):
        info = stack.slurm.node(node)
        assert "DRAIN" in info.state
        assert info.reason.startswith("gpuhealth:")
        # the drain lands before the requeue that moves the job off the node: wait for both
        def left(node: str = node) -> bool:
            return node not in {n for job in stack.jobs for n in stack.slurm.job(job).nodes}
        wait_until(left, timeout=120, what=f"the jobs to leave {node}")
        # the alert came from the shard that scrapes the node; the other shard never saw the node
        own, other = stack.shards[index], stack.shards[1 - index]
        assert own.api.query(f'ALERTS{{alertstate="firing",node="{node}"}}')
        assert not other.api.query(f'ALERTS{{node="{node}"}}')
    healthy = [n for n in stack.nodes if n not in where["victims"]]
    assert not any("DRAIN" in stack.slurm.node(n).state for n in healthy)


def test_lemon_spanning_both_shards_fires_in_the_global_tier_and_reaches_the_webhook(tiers):
    stack, where = tiers
    lemon = where["lemon"]
    assert where["history_alone"] == {"vm": [], "webhook": []}
    vm = started(stack.victoria).api
    failures = vm.query(f'count by (prometheus) (max_over_time(ALERTS{{node="{lemon}",'
                        f'alertname!="{LEMON}",alertstate="firing"}}[1h]))')
    assert {s["metric"].get("prometheus") for s in failures} == {"shard-0", "shard-1"}
    alerts = _lemon_alerts(vm, lemon)
    assert [a["metric"].get("alertgroup") for a in alerts] == ["gpuhealth-lemon"]  # vmalert's
    for shard in stack.shards:
        assert not shard.api.query(f'ALERTS{{alertname="{LEMON}"}}')
    actions = _lemon_actions(stack, lemon)
    assert [(a["kind"], a["node"]) for a in actions] == [("replace", lemon)]
    wait_until(lambda: _lemon_actions(stack, lemon)[0]["state"] == "done", timeout=60, interval=0.5,
               what="the replace action to finish")
    # a lemon is kept out for a human: no resolution or health check returns it to service
    assert "DRAIN" in stack.slurm.node(lemon).state
    drained = {entry["node"]: entry for entry in stack.webhook_get("/status")["drained_by_us"]}
    assert drained[lemon]["left_for_human"] is True
    assert drained[where["victims"][0]]["left_for_human"] is False


def test_stopping_the_sharded_stack_leaves_no_process(tiers):
    stack, where = tiers
    stack.stop()
    wait_until(lambda: not processes_under(where["workdir"]), timeout=10, what="stack processes to exit")
