"""Shards plus the global tier give the alert episodes one Prometheus gives (the single tier).

One small fleet's raw corrected-ECC counters and alert history: one Prometheus evaluates the single
tier's fleet-wide alerts over all of it (the per-GPU rate record folded into them, as ``gpuhealth
eval`` does); for the sharded layout each node's records and alerts are labelled with the shard that
would scrape it and imported into VictoriaMetrics, where ``vmalert -replay`` evaluates the global tier.
The storm quantile, the lemon count and the nodes-at-risk share all need nodes of both shards.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from gpuhealth.contract.duration import parse_duration
from gpuhealth.rules import catalogue
from gpuhealth.rules.render import render_all

from gpuhealth.evaluation.alerts import fires, runs
from gpuhealth.evaluation.fleet import PROMETHEUS_ARGS, promtool_blocks
from gpuhealth.evaluation.openmetrics import BlockFiles, Thinning
from gpuhealth.evaluation.ranges import label_text
from gpuhealth.evaluation.signals import Family
from gpuhealth.evaluation.workload import Timeline
from gpuhealth.local.prometheus import PrometheusServer
from gpuhealth.local.victoria import VictoriaMetricsServer, vmalert_replay

pytestmark = pytest.mark.slow

START, STEP, COUNT = 1_767_571_200.0, 60.0, 5 * 60   # 5 h of 1 min samples
OVERLAY = {"defaults": {"lemon": {"window": "2h", "step": "10m", "count": 3}}}
# What the shards record for the fleet-wide rules.
RECORDS = ("gpuhealth:gpu_ecc_corrected:rate", "gpuhealth:cluster_ecc_corrected_rate:quantile",
           "gpuhealth:cluster_ecc_corrected_rate:gpus", "gpuhealth:cluster_nodes:count")
UP = 'up{job="gpuhealth-exporter"'  # the exporter targets the shards count nodes from
SHARD = {"n1": 0, "n2": 0, "n3": 1, "n4": 1}          # what hashmod of the node would pick
GPUS = 8
LOOKBACK = f"{STEP - 1:g}s"   # see the test
# (node, gpu) -> (corrected errors per second, from minute, to minute)
ECC = {("n1", 0): (3000.0, 20, 80),                    # a storm in shard 0
       ("n3", 1): (2000.0, 40, 110),                   # a storm in shard 1, overlapping it
       ("n2", 2): (50.0, 0, COUNT),                    # steady chatter below the floor
       ("n4", 3): (400.0, 200, 260)}                   # above the floor, but n1 (shard 0) runs hot then:
# shard 1 alone (15 GPUs at 0) would call n4's 400/s a storm; with shard 0's GPUs it is none.
DRAIN = {"alertname": "GPUHealthXidResetGpu", "action": "drain_reset_gpu", "severity": "critical"}
# node -> onsets (minutes) of 15-minute drain alerts
HISTORY = {"n1": [230],                                # with its storm, two failures: no lemon
           "n2": [130, 170, 230],                      # a lemon (shard 0) ...
           "n4": [150, 190, 230]}                      # ... and one in shard 1; three of four nodes at 230
HOT = [("n1", g) for g in range(GPUS)]                 # n1 runs hot from minute 190: raises n4's bar


def _ecc_family() -> Family:
    rows = []
    for node in SHARD:
        for gpu in range(GPUS):
            rate = np.zeros(COUNT)
            per_second, a, b = ECC.get((node, gpu), (0.0, 0, 0))
            rate[a:b] = per_second
            if (node, gpu) in HOT:
                rate[190:] = 100.0
            labels = {"node": node, "gpu": str(gpu), "type": "corrected", "counter": "volatile"}
            rows.append((label_text(tuple(sorted(labels.items()))), np.cumsum(rate * STEP)))
    return Family("gpuhealth_gpu_ecc_errors_total", "counter", rows)


def _up_family() -> Family:
    rows = [(label_text((("job", "gpuhealth-exporter"), ("node", node))), np.ones(COUNT)) for node in SHARD]
    return Family("up", "gauge", rows)


def _in_shard(expr: str, shard: int) -> str:
    """``expr`` over the nodes of one shard only, as that shard's Prometheus evaluates it."""
    nodes = f'node=~"{"|".join(n for n, s in SHARD.items() if s == shard)}"'
    expr = expr.replace("gpuhealth_gpu_ecc_errors_total{", f"gpuhealth_gpu_ecc_errors_total{{{nodes}, ")
    return expr.replace(UP, f"{UP}, {nodes}")


def _alerts_rows() -> list[tuple[dict[str, str], np.ndarray]]:
    rows = []
    for node, onsets in HISTORY.items():
        values = np.full(COUNT, np.nan)
        for onset in onsets:
            values[onset:onset + 15] = 1.0
        rows.append(({**DRAIN, "alertstate": "firing", "node": node, "gpu": "0"}, values))
    return rows


def _lines(name: str, labels: dict[str, str], times: list[float], values: list[float]) -> list[str]:
    text = label_text(tuple(sorted(labels.items())))
    return [f"{name}{{{text}}} {v:g} {int(t * 1000)}" for t, v in zip(times, values, strict=True)]


def _tier_rules(tier: str, out: Path) -> list[Path]:
    paths = []
    for name, text in render_all(catalogue.resolve(OVERLAY), ("gpuhealth",), tier).items():
        if name in ("gpuhealth/fleet.yml", "gpuhealth/lemon.yml", "gpuhealth/definitive.yml",
                    "gpuhealth/meta.yml"):
            paths.append(out / tier / name)
            paths[-1].parent.mkdir(parents=True, exist_ok=True)
            paths[-1].write_text(text)
    return paths


def _rules(paths: list[Path]) -> list[dict]:
    return [r for p in paths for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"]]


def _key(labels: dict[str, str]) -> tuple[str, str, str]:
    return labels["alertname"], labels.get("node", ""), labels.get("gpu", "")


def test_shards_and_global_tier_give_the_single_tier_episodes(tmp_path: Path):
    single = _rules(_tier_rules("single", tmp_path / "rules"))
    records = {r["record"]: r["expr"] for r in single if r.get("record") in RECORDS}
    global_files = [p for p in _tier_rules("global", tmp_path / "rules")
                    if p.name in ("fleet.yml", "lemon.yml")]
    alerts = [r for r in _rules(global_files) if "alert" in r]
    assert {a["alert"] for a in alerts} == {"GPUHealthEccCorrectedStorm", "GPUHealthLemonNode",
                                            "GPUHealthFleetNodesAtRisk", "GPUHealthShardSilent"}
    end = START + (COUNT - 1) * STEP
    times = [START + i * STEP for i in range(COUNT)]

    files = BlockFiles(tmp_path / "om", Timeline(START, STEP, COUNT))
    files.write(_ecc_family(), Thinning(0, STEP))
    files.write(_up_family(), Thinning(0, STEP))
    files.write(Family("ALERTS", "gauge", [(label_text(tuple(sorted(labels.items()))), values)
                                           for labels, values in _alerts_rows()]), Thinning(0, STEP))
    promtool_blocks(files.close(), tmp_path / "prom-data", "test", progress=False, workdir=tmp_path)
    # Imported series (ALERTS, records) end without the staleness marker a live Prometheus writes, and
    # remote-writes, when a series ends: an instant read would find the last sample for Prometheus's
    # 5-minute lookback, VictoriaMetrics's for about one sample interval. A lookback just short of one
    # interval in both reads them as they were live.
    config = {"global": {"scrape_interval": "1m", "evaluation_interval": "1m"}}
    prometheus = PrometheusServer(tmp_path / "prometheus", config, data_dir=tmp_path / "prom-data",
                                  extra_args=[*PROMETHEUS_ARGS, f"--query.lookback-delta={LOOKBACK}"])
    prometheus.start(timeout=300)
    in_single: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    try:
        for rule in alerts:     # single tier: the records folded into the alerts that read them
            expr = rule["expr"]
            for name, record in records.items():
                expr = re.sub(re.escape(name) + r"(?![\w:])", f"({record})", expr)
            for series in prometheus.api.query_range(expr, START, end, STEP):
                present = np.zeros(COUNT, dtype=bool)
                present[[round((float(t) - START) / STEP) for t, _ in series["values"]]] = True
                firing = fires(present, parse_duration(rule.get("for", "0s")), STEP)
                key = _key({**series["metric"], "alertname": rule["alert"]})
                in_single[key] = [(times[a], times[b - 1]) for a, b in runs(firing)]
        lines = []     # what each shard remote-writes: its records, its alerts, its heartbeat
        for shard in (0, 1):
            for name, record in records.items():
                for series in prometheus.api.query_range(_in_shard(record, shard), START, end, STEP):
                    points = series["values"]
                    lines += _lines(name, {**series["metric"], "prometheus": f"shard-{shard}"},
                                    [float(t) for t, _ in points], [float(v) for _, v in points])
    finally:
        prometheus.stop()

    for labels, values in _alerts_rows():
        kept = ~np.isnan(values)
        lines += _lines("ALERTS", {**labels, "prometheus": f"shard-{SHARD[labels['node']]}"},
                        list(np.asarray(times)[kept]), list(values[kept]))
    for shard in (0, 1):
        lines += _lines("gpuhealth:shard:heartbeat", {"prometheus": f"shard-{shard}"}, times, [1.0] * COUNT)
    with VictoriaMetricsServer(tmp_path / "vm", extra_args=[f"-search.maxLookback={LOOKBACK}"]) as vm:
        vm.start()
        vm.import_text(lines)
        vmalert_replay(global_files, vm, START, end, tmp_path / "vmalert.log")
        names = "|".join(a["alert"] for a in alerts)
        result = vm.api.query(f'ALERTS{{alertstate="firing", alertname=~"{names}"}}[10h]', end)
    in_global: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for series in result:
        present = np.zeros(COUNT, dtype=bool)
        present[[round((float(t) - START) / STEP) for t, _ in series["values"]]] = True
        in_global.setdefault(_key(series["metric"]), []).extend(
            (times[a], times[b - 1]) for a, b in runs(present))

    fired = {k for k, v in in_single.items() if v}
    assert fired == {("GPUHealthEccCorrectedStorm", "n1", "0"), ("GPUHealthEccCorrectedStorm", "n3", "1"),
                     ("GPUHealthLemonNode", "n2", ""), ("GPUHealthLemonNode", "n4", ""),
                     ("GPUHealthFleetNodesAtRisk", "", "")}, in_single
    assert {k: sorted(v) for k, v in in_global.items()} == {k: sorted(in_single[k]) for k in fired}
