"""Fleet-level alerts (fleet.yml, the global tier), fed what the shards remote-write: records and ALERTS.

The corrected-ECC storm read from raw counters through the shard's records is tested with the other
definitive signals (test_rules_definitive.py); here the inputs are the records themselves, as
VictoriaMetrics holds them, with the shards' external labels.
"""

from __future__ import annotations

import pytest
from gpuhealth.rules import catalogue
from gpuhealth.rules.render import render_all
from rules_promtool import SOURCES, alert, run_promtool, values

NODES = "gpuhealth:cluster_nodes:count"
HEARTBEAT = "gpuhealth:shard:heartbeat"
SILENT = ("The rule heartbeat of Prometheus shard-1 stopped reaching the global tier: its nodes' alerts and "
          "records are missing from the fleet-wide rules (lemon nodes, corrected-ECC storms, nodes at risk). "
          "Check that Prometheus shard and its remote write.")


def _at_risk_description(share: str) -> str:
    return (f"{share} of the nodes (of one cluster) have a firing alert that drains or replaces them. "
            "That many at once usually has one cause (firmware, cooling, power, a bad batch, a rule that "
            "misfires): find it before more nodes are drained.")


def _run(tmp_path, source: str, series: dict[str, str], checks: list[dict]) -> None:
    inputs = [{"series": s, "values": v} for s, v in sorted(series.items())]
    run_promtool(tmp_path, source, ["fleet"], [{"interval": "1m", "input_series": inputs,
                                                "alert_rule_test": checks}])


def _firing(node: str, alertname: str, action: str, minutes: tuple[int, int], total: int,
            state: str = "firing") -> tuple[str, str]:
    start, end = minutes
    labels = (f'alertname="{alertname}", alertstate="{state}", action="{action}", severity="warning", '
              f'node="{node}", prometheus="shard-{int(node[1:]) % 2}"')
    points = " ".join("1" if start <= m < end else "_" for m in range(total + 1))
    return f"ALERTS{{{labels}}}", points


@pytest.mark.parametrize("source", SOURCES)
def test_nodes_at_risk_share_of_the_fleet(tmp_path, source):
    total = 60
    series = {f'{NODES}{{prometheus="shard-{shard}"}}': values((5, 0, total)) for shard in (0, 1)}
    # Three of ten nodes by minute 20, in both shards.
    for node, start in (("n0", 10), ("n1", 10), ("n2", 20)):
        key, points = _firing(node, "GPUHealthXidResetGpu", "drain_reset_gpu", (start, total), total)
        series[key] = points
    # Neither a pending alert, nor an alert that drains nothing, puts a node at risk.
    for node, name, action, state in (("n3", "GPUHealthXidResetGpu", "drain_reset_gpu", "pending"),
                                      ("n4", "GPUHealthRowRemapPending", "none", "firing"),
                                      ("n5", "GPUHealthRowRemapPending", "none", "firing")):
        key, points = _firing(node, name, action, (5, total), total, state)
        series[key] = points
    at_risk = alert("GPUHealthFleetNodesAtRisk", {"alertname": "GPUHealthFleetNodesAtRisk"},
                    "30% of the nodes are at risk at once", _at_risk_description("30%"), "critical", "none")
    checks = [
        {"eval_time": "18m", "alertname": "GPUHealthFleetNodesAtRisk", "exp_alerts": []},  # 2: < min_nodes
        {"eval_time": "24m", "alertname": "GPUHealthFleetNodesAtRisk", "exp_alerts": []},   # within `for`
        {"eval_time": "26m", "alertname": "GPUHealthFleetNodesAtRisk", "exp_alerts": [at_risk]},
    ]
    _run(tmp_path, source, series, checks)


@pytest.mark.parametrize("source", SOURCES)
def test_nodes_at_risk_knobs(tmp_path, source):
    """A lower share and node count, and a longer silence, take effect."""
    cat = catalogue.resolve({"defaults": {"fleet": {"nodes_at_risk": {"min_nodes": 2, "max_share": 0.05},
                                                    "shard_silent": {"after": "10m"}}}})
    rules_dir = tmp_path / "rules"
    for path, text in render_all(cat, (source,), "global").items():
        (rules_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (rules_dir / path).write_text(text)
    total = 40
    series = {f'{NODES}{{prometheus="shard-{shard}"}}': values((10, 0, total)) for shard in (0, 1)}
    for node in ("n0", "n1"):
        key, points = _firing(node, "GPUHealthXidResetGpu", "drain_reset_gpu", (10, total), total)
        series[key] = points
    series[f'{HEARTBEAT}{{prometheus="shard-1"}}'] = values((1, 0, 10))
    inputs = [{"series": s, "values": v} for s, v in sorted(series.items())]
    at_risk = alert("GPUHealthFleetNodesAtRisk", {"alertname": "GPUHealthFleetNodesAtRisk"},
                    "10% of the nodes are at risk at once", _at_risk_description("10%"), "critical", "none")
    silent = alert("GPUHealthShardSilent", {"alertname": "GPUHealthShardSilent", "prometheus": "shard-1"},
                   "Prometheus shard-1 stopped sending to the global tier", SILENT, "critical", "none")
    checks = [{"eval_time": "14m", "alertname": "GPUHealthFleetNodesAtRisk", "exp_alerts": []},
              {"eval_time": "16m", "alertname": "GPUHealthFleetNodesAtRisk", "exp_alerts": [at_risk]},
              {"eval_time": "24m", "alertname": "GPUHealthShardSilent", "exp_alerts": []},  # after + for
              {"eval_time": "26m", "alertname": "GPUHealthShardSilent", "exp_alerts": [silent]}]
    run_promtool(tmp_path, source, ["fleet"], [{"interval": "1m", "input_series": inputs,
                                                "alert_rule_test": checks}], rules_dir=rules_dir)


@pytest.mark.parametrize("source", SOURCES)
def test_shard_silent(tmp_path, source):
    total = 120
    series = {f'{HEARTBEAT}{{prometheus="shard-0"}}': values((1, 0, total)),
              f'{HEARTBEAT}{{prometheus="shard-1"}}': values((1, 0, 30))}   # stops sending after minute 30
    silent = alert("GPUHealthShardSilent", {"alertname": "GPUHealthShardSilent", "prometheus": "shard-1"},
                   "Prometheus shard-1 stopped sending to the global tier", SILENT, "critical", "none")
    checks = [
        {"eval_time": "30m", "alertname": "GPUHealthShardSilent", "exp_alerts": []},
        {"eval_time": "40m", "alertname": "GPUHealthShardSilent", "exp_alerts": []},  # after + for
        {"eval_time": "42m", "alertname": "GPUHealthShardSilent", "exp_alerts": [silent]},
        {"eval_time": "89m", "alertname": "GPUHealthShardSilent", "exp_alerts": [silent]},
        {"eval_time": "92m", "alertname": "GPUHealthShardSilent", "exp_alerts": []},  # past the window
    ]
    _run(tmp_path, source, series, checks)


@pytest.mark.parametrize("source", SOURCES)
def test_storm_bar_is_the_shards_quantiles_weighted_by_their_gpus(tmp_path, source):
    """Shard 0 (30 GPUs) has its 0.9 quantile at 50/s, shard 1 (10 GPUs) at 0: the fleet's estimate is
    37.5/s, so the bar is 375/s. A GPU at 300/s in shard 1 is no storm, though shard 1 alone would call
    it one; one at 400/s is."""
    total = 30
    rate = "gpuhealth:gpu_ecc_corrected:rate"
    series = {
        'gpuhealth:cluster_ecc_corrected_rate:quantile{prometheus="shard-0"}': values((50, 0, total)),
        'gpuhealth:cluster_ecc_corrected_rate:gpus{prometheus="shard-0"}': values((30, 0, total)),
        'gpuhealth:cluster_ecc_corrected_rate:quantile{prometheus="shard-1"}': values((0, 0, total)),
        'gpuhealth:cluster_ecc_corrected_rate:gpus{prometheus="shard-1"}': values((10, 0, total)),
        f'{rate}{{node="n7", gpu="1", prometheus="shard-1"}}': values((300, 0, total)),
        f'{rate}{{node="n8", gpu="2", prometheus="shard-1"}}': values((400, 0, total)),
    }
    labels = {"alertname": "GPUHealthEccCorrectedStorm", "node": "n8", "gpu": "2", "prometheus": "shard-1"}
    storm = alert("GPUHealthEccCorrectedStorm", labels, "Corrected-ECC storm on n8 GPU 2 (400/s)",
                  "GPU 2 of n8 corrects 400 ECC errors per second, far above the rest of the fleet. The "
                  "driver still reports it healthy, but the storm slows every job on it and often precedes "
                  "uncorrectable errors: drain the node and reset the GPU.", "warning",
                  "checkpoint_drain_reset_gpu")
    checks = [{"eval_time": "9m", "alertname": "GPUHealthEccCorrectedStorm", "exp_alerts": []},
              {"eval_time": "10m", "alertname": "GPUHealthEccCorrectedStorm", "exp_alerts": [storm]}]
    _run(tmp_path, source, series, checks)
