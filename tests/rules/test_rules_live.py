"""The generated rules in a real Prometheus scraping a synthetic fleet: every rule evaluates without
error on exporter-shaped data (label clashes and many-to-many matches only show up there), and every
GPU gets its evidence and risk series."""

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
    config = {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "rule_files": sorted(str(p) for p in (rules / "gpuhealth").glob("*.yml")),
        "scrape_configs": [fleet.scrape_config("2s")],
    }
    prometheus = PrometheusServer(tmp_path / "prometheus", config)
    try:
        prometheus.start()
        api = prometheus.api

        def contributing() -> set[str]:
            return {r["metric"]["signal"] for r in api.query("gpuhealth:gpu_failure_risk:contribution")}

        def evaluated() -> bool:
            groups = api.rule_groups()
            return len(groups) == 6 and all(
                r.get("lastEvaluation", "").startswith("20") and float(r.get("evaluationTime", 0)) > 0
                for g in groups for r in g["rules"]
            ) and {"temperature_peer", "thermal_slowdown"} <= contributing()

        # The sick GPUs (every fifth) carry evidence; fusion records their contributions by signal.
        wait_until(evaluated, timeout=90, interval=1, what="every rule evaluated on scraped data")
        problems = [f"{r['name']}: {r['lastError']}" for g in api.rule_groups() for r in g["rules"]
                    if r.get("lastError") or r.get("health") != "ok"]
        assert not problems, problems
        gpu_signals = {r["metric"]["__name__"]: float(r["value"][1])
                   for r in api.query('count by (__name__) ({__name__=~"gpuhealth:gpu_evidence:.+"})')}
        assert len(gpu_signals) == 12 and set(gpu_signals.values()) == {32.0}, gpu_signals
        nodes = api.query('count by (__name__) ({__name__=~"gpuhealth:node_evidence:.+"})')
        assert {r["metric"]["__name__"].rsplit(":", 1)[1] for r in nodes} == {
            "gpus_missing", "interrupt_collapse", "procs_running_collapse", "page_out_spike",
            "nfs_latency_spike"}
        assert all(r["value"][1] == "4" for r in nodes)
        assert len(api.query("gpuhealth:gpu_failure_risk:score")) == 32
    finally:
        prometheus.stop()
        fleet.stop()
