"""The generated rules in a real Prometheus scraping a synthetic fleet: every rule evaluates without
error on exporter-shaped data (label clashes and many-to-many matches only show up there), and every
GPU gets its risk score, and evidence is recorded for the sick GPUs only; two clusters with the same
node names in one Prometheus keep their own scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from gpuhealth.webhook.labels import label_problem
from rules_promtool import GENERATED

from gpuhealth.cli import main
from gpuhealth.local.process import wait_until
from gpuhealth.local.prometheus import PrometheusServer
from gpuhealth.local.synthetic_fleet import SyntheticFleet

DEMO = GENERATED.parent / "overlays" / "demo.yaml"


def _prometheus(tmp_path: Path, fleets: list[SyntheticFleet],
                relabel: tuple[dict, ...] = ()) -> tuple[PrometheusServer, int]:
    """A Prometheus loading the rules with the demo's windows, shortened again so that the rates have
    their history within seconds, scraping ``fleets`` as one job (its targets relabelled by ``relabel``
    too); and the number of rule groups."""
    overlay = yaml.safe_load(DEMO.read_text())
    overlay["defaults"].update(scrape_interval="2s", evaluation_interval="2s")
    for signal in ("thermal_slowdown", "temperature_peer"):
        overlay["defaults"]["evidence"][signal]["window"] = "8s"
    # The peer shards start at different offsets, so for an evaluation or two after start-up a node's
    # median sees only some of its GPUs and the deviations it records are off; a short baseline lets
    # those samples age out within seconds instead of the demo's minutes.
    overlay["defaults"]["evidence"]["temperature_baseline"].update(baseline_window="32s", step="8s")
    # The daily means of the slow thermal trend, like the NVLink slices below, are hourly.
    overlay["defaults"]["evidence"].setdefault("temperature_trend", {})["step"] = "8s"
    # The NVLink baseline's hourly slices would first be evaluated up to an hour after start-up.
    overlay["defaults"]["definitive"]["nvlink_error_rate"].update(
        baseline_step="8s", baseline_age="16s", baseline_window="32s")
    (tmp_path / "overlay.yaml").write_text(yaml.safe_dump(overlay))
    rules = tmp_path / "rules"
    assert main(["rules", "generate", "--catalogue", str(tmp_path / "overlay.yaml"), "--source", "gpuhealth",
                 "--out", str(rules)]) == 0
    rule_files = sorted((rules / "gpuhealth").glob("*.yml"))
    group_count = sum(len(yaml.safe_load(p.read_text())["groups"]) for p in rule_files)
    job = fleets[0].scrape_config("2s")
    job["relabel_configs"] += relabel
    for fleet in fleets[1:]:
        job["static_configs"] += fleet.scrape_config("2s")["static_configs"]
    config = {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [job],
    }
    return PrometheusServer(tmp_path / "prometheus", config), group_count


def _all_evaluated(api, group_count: int) -> bool:
    groups = api.rule_groups()
    return len(groups) == group_count and all(
        r.get("lastEvaluation", "").startswith("20") and float(r.get("evaluationTime", 0)) > 0
        for g in groups for r in g["rules"])


def _problems(api) -> list[str]:
    return [f"{r['name']}: {r['lastError']}" for g in api.rule_groups() for r in g["rules"]
            if r.get("lastError") or r.get("health") != "ok"]


@pytest.mark.slow
def test_rules_evaluate_cleanly_in_prometheus(tmp_path):
    fleet = SyntheticFleet(nodes=4, sick_every=5).start()
    prometheus, group_count = _prometheus(tmp_path, [fleet])
    try:
        prometheus.start()
        api = prometheus.api
        sick = fleet.sick()

        def evidence() -> dict[str, set[tuple[str, str]]]:
            found: dict[str, set[tuple[str, str]]] = {}
            for r in api.query('{__name__=~"gpuhealth:gpu_evidence:.+"}'):
                found.setdefault(r["metric"]["__name__"].rsplit(":", 1)[1], set()).add(
                    (r["metric"]["node"], r["metric"]["gpu"]))
            return found

        def collapsed() -> set[str]:
            return {r["metric"]["node"] for r in api.query("gpuhealth:node_evidence:interrupt_collapse")}

        def evaluated() -> bool:
            found = evidence()
            return _all_evaluated(api, group_count) and found.get("thermal_slowdown") == sick and all(
                gpus <= sick for gpus in found.values()) and {
                "thermal_slowdown", "pcie_replay"} <= {
                r["metric"]["signal"] for r in api.query("gpuhealth:gpu_failure_risk:contribution")
            } and fleet.names[1] in collapsed() and len(api.query("gpuhealth:gpu_failure_risk:score")) == 32

        # The sick GPUs (every fifth) carry evidence, and only they; fusion records their contributions.
        # They run hot from the start, as they always did: no drift, so no temperature_peer evidence.
        # Records flow through several groups (peer shards -> GPU set -> score), each reading the last
        # evaluation of the one before: wait until the whole chain has settled on scraped data (and the
        # start-up samples of the baseline have aged out).
        wait_until(evaluated, timeout=90, interval=1, what="every rule evaluated on scraped data")
        assert not _problems(api)
        found = evidence()
        assert all(gpus <= sick for gpus in found.values()), found
        assert "temperature_peer" not in found
        assert collapsed() == {fleet.names[1]}
        assert len(api.query("gpuhealth:gpu_failure_risk:score")) == 32
    finally:
        prometheus.stop()
        fleet.stop()


@pytest.mark.slow
def test_two_clusters_with_the_same_node_names_keep_their_own_scores(tmp_path):
    """Clusters a and b both name their nodes node0000..node0003, with different sick GPUs: every
    record keeps `cluster`, so each GPU's evidence and score are its own and no rule sees duplicates."""
    fleets = [SyntheticFleet(nodes=4, sick_every=5, cluster="a").start(),
              SyntheticFleet(nodes=4, sick_every=3, cluster="b").start()]
    sick = {(f.cluster, node, gpu) for f in fleets for node, gpu in f.sick()}
    prometheus, group_count = _prometheus(tmp_path, fleets)
    try:
        prometheus.start()
        api = prometheus.api

        def labelled(expr: str) -> dict[tuple[str, str, str], float]:
            return {(r["metric"].get("cluster", ""), r["metric"]["node"], r["metric"]["gpu"]):
                    float(r["value"][1]) for r in api.query(expr)}

        def settled() -> bool:
            # The score is a later group than the evidence: wait until every sick GPU's evidence has
            # reached its score, so a GPU still at 0 below is one the other cluster's faults did not touch.
            scores = labelled("gpuhealth:gpu_failure_risk:score")
            return (_all_evaluated(api, group_count)
                    and set(labelled("gpuhealth:gpu_evidence:thermal_slowdown")) == sick
                    and len(scores) == 64 and all(scores.get(gpu, 0) > 0 for gpu in sick))

        wait_until(settled, timeout=120, interval=1, what="both clusters scored on scraped data")
        assert not _problems(api)
        scores = labelled("gpuhealth:gpu_failure_risk:score")
        assert {cluster for cluster, _, _ in scores} == {"a", "b"}
        # node0000 GPU 5 is sick in cluster a only, GPU 3 in cluster b only (neither node collapsed).
        assert scores[("a", "node0000", "5")] > 0 and scores[("b", "node0000", "5")] == 0
        assert scores[("b", "node0000", "3")] > 0 and scores[("a", "node0000", "3")] == 0
        assert set(labelled("gpuhealth:gpu_evidence:temperature_peer")) <= sick
    finally:
        prometheus.stop()
        for fleet in fleets:
            fleet.stop()


@pytest.mark.slow
def test_a_crafted_node_label_flows_through_the_records_and_is_refused_by_the_webhook(tmp_path):
    """A target's ``node`` label is whatever the scrape configuration (a file_sd written from an
    inventory) says: quotes, braces and a newline reach every record unchanged, the rules still
    evaluate, and an alert carrying that label set names no node the webhook would act on."""
    hostile = 'node0000"} 1\ngpuhealth_gpu_up{node="gpu01'
    fleet = SyntheticFleet(nodes=2, sick_every=5).start()
    crafted = {"source_labels": ["__param_node"], "regex": fleet.names[0], "target_label": "node",
               "replacement": hostile}
    prometheus, group_count = _prometheus(tmp_path, [fleet], relabel=(crafted,))
    try:
        prometheus.start()
        api = prometheus.api

        def scored() -> list[dict]:
            return [r["metric"] for r in api.query("gpuhealth:gpu_failure_risk:score")
                    if r["metric"]["node"] == hostile]

        wait_until(lambda: _all_evaluated(api, group_count) and len(scored()) == 8, timeout=90, interval=1,
                   what="the crafted node's GPUs scored")
        assert not _problems(api)
        for labels in scored():
            problem = label_problem(labels["node"], labels["gpu"], "GPUHealthGpuFailureRisk")
            assert problem is not None and problem[0] == "invalid_node", labels
            assert "\n" not in problem[1]
    finally:
        prometheus.stop()
        fleet.stop()
