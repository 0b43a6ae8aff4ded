"""The generated rules in a real Prometheus scraping a synthetic fleet: every rule evaluates without
error on exporter-shaped data (label clashes and many-to-many matches only show up there), and every
GPU gets its risk score, and evidence is recorded for the sick GPUs only."""

from __future__ import annotations

import pytest
import yaml
from gpuhealth.rules.fleet import SyntheticFleet
from rules_promtool import GENERATED

from gpuhealth.cli import main
from gpuhealth.local.process import wait_until
from gpuhealth.local.prometheus import PrometheusServer

DEMO = GENERATED.parent / "overlays" / "demo.yaml"


@pytest.mark.slow
def test_rules_evaluate_cleanly_in_prometheus(tmp_path):
    # The demo's windows, shortened again so that the rates have their history within seconds.
    overlay = yaml.safe_load(DEMO.read_text())
    overlay["defaults"].update(scrape_interval="2s", evaluation_interval="2s")
    for signal in ("thermal_slowdown", "temperature_peer"):
        overlay["defaults"]["evidence"][signal]["window"] = "8s"
    (tmp_path / "overlay.yaml").write_text(yaml.safe_dump(overlay))
    rules = tmp_path / "rules"
    assert main(["rules", "generate", "--catalogue", str(tmp_path / "overlay.yaml"), "--source", "gpuhealth",
                 "--out", str(rules)]) == 0
    fleet = SyntheticFleet(nodes=4, sick_every=5).start()
    rule_files = sorted((rules / "gpuhealth").glob("*.yml"))
    group_count = sum(len(yaml.safe_load(p.read_text())["groups"]) for p in rule_files)
    config = {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [fleet.scrape_config("2s")],
    }
    prometheus = PrometheusServer(tmp_path / "prometheus", config)
    try:
        prometheus.start()
        api = prometheus.api

        sick = {(name, str(gpu)) for index, name in enumerate(fleet.names) for gpu in range(8)
                if (index * 8 + gpu) % 5 == 0}

        def evidence() -> dict[str, set[tuple[str, str]]]:
            found: dict[str, set[tuple[str, str]]] = {}
            for r in api.query('{__name__=~"gpuhealth:gpu_evidence:.+"}'):
                found.setdefault(r["metric"]["__name__"].rsplit(":", 1)[1], set()).add(
                    (r["metric"]["node"], r["metric"]["gpu"]))
            return found

        def collapsed() -> set[str]:
            return {r["metric"]["node"] for r in api.query("gpuhealth:node_evidence:interrupt_collapse")}

        def evaluated() -> bool:
            groups = api.rule_groups()
            return len(groups) == group_count and all(
                r.get("lastEvaluation", "").startswith("20") and float(r.get("evaluationTime", 0)) > 0
                for g in groups for r in g["rules"]
            ) and evidence().get("thermal_slowdown") == sick and {"temperature_peer", "thermal_slowdown"} <= {
                r["metric"]["signal"] for r in api.query("gpuhealth:gpu_failure_risk:contribution")
            } and fleet.names[1] in collapsed() and len(api.query("gpuhealth:gpu_failure_risk:score")) == 32

        # The sick GPUs (every fifth) carry evidence, and only they; fusion records their contributions.
        # Records flow through several groups (peer shards -> GPU set -> score), each reading the last
        # evaluation of the one before: wait until the whole chain has settled on scraped data.
        wait_until(evaluated, timeout=90, interval=1, what="every rule evaluated on scraped data")
        problems = [f"{r['name']}: {r['lastError']}" for g in api.rule_groups() for r in g["rules"]
                    if r.get("lastError") or r.get("health") != "ok"]
        assert not problems, problems
        found = evidence()
        assert all(gpus <= sick for gpus in found.values()), found
        assert collapsed() == {fleet.names[1]}
        assert len(api.query("gpuhealth:gpu_failure_risk:score")) == 32
    finally:
        prometheus.stop()
        fleet.stop()
