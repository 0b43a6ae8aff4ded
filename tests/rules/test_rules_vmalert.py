"""The global tier's rules give in vmalert over VictoriaMetrics the alert episodes Prometheus gives.

The same ALERTS history (what the shards remote-write) is backfilled into Prometheus and imported into
VictoriaMetrics; Prometheus evaluates the global alerts over it, ``vmalert -replay`` replays them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from gpuhealth.rules import catalogue
from gpuhealth.rules.render import render_all

from gpuhealth.evaluation.fleet import promtool_blocks, start_prometheus
from gpuhealth.evaluation.openmetrics import BlockFiles, Thinning
from gpuhealth.evaluation.ranges import label_text
from gpuhealth.evaluation.signals import Family
from gpuhealth.evaluation.workload import Timeline
from gpuhealth.local.victoria import VictoriaMetricsServer, vmalert_replay

pytestmark = pytest.mark.slow

START, STEP, COUNT = 1_767_571_200.0, 60.0, 8 * 60   # 8 h of 1 min samples
# Lemon over a 2 h window on a 10 min grid: the shortest history that shows a lemon appear and expire.
OVERLAY = {"defaults": {"lemon": {"window": "2h", "step": "10m", "count": 3}}}
DRAIN = {"alertname": "GPUHealthXidDrainResetGpu", "action": "drain_reset_gpu", "severity": "critical"}
NOTICE = {"alertname": "GPUHealthRowRemapPending", "action": "none", "severity": "info"}
# node -> (alert labels, onsets in minutes); each failure fires 15 min, off the 10 min grid's edges.
HISTORY = {
    "n1": (DRAIN, [62, 92, 122]),              # three failures within 2 h: a lemon
    "n2": (DRAIN, [62, 152]),                  # two: not one
    "n3": (DRAIN, [182, 232, 282, 332]),       # four, 50 min apart: a lemon for a while, then not
    "n4": (NOTICE, [62, 92, 122, 152]),        # routine notices are no failures
    "n5": (DRAIN, [42]),                       # one long failure counts once
}
LONG = {"n5": 200}


def _alerts_family() -> Family:
    rows = []
    for node, (labels, onsets) in HISTORY.items():
        values = np.full(COUNT, np.nan)
        for onset in onsets:
            values[onset:onset + LONG.get(node, 15)] = 1.0
        text = label_text((*sorted({**labels, "alertstate": "firing", "node": node, "cluster": ""}.items()),))
        rows.append((text, values))
    return Family("ALERTS", "gauge", rows)


def _exposition(family: Family) -> list[str]:
    return [f"{family.name}{{{text}}} {value:g} {int((START + i * STEP) * 1000)}"
            for text, values in family.series for i, value in enumerate(values) if not np.isnan(value)]


def _episodes(points: dict[str, list[float]]) -> set[tuple[str, float, float]]:
    """(node, first, last) of each run of evaluations with no gap longer than one interval."""
    found = set()
    for node, times in points.items():
        times = sorted(times)
        first = times[0]
        for before, after in zip(times, [*times[1:], None], strict=True):
            if after is None or after - before > STEP:
                found.add((node, first, before))
                first = after
    return found


def test_lemon_episodes_match_prometheus(tmp_path: Path):
    cat = catalogue.resolve(OVERLAY)
    rule_dir = tmp_path / "rules"
    for path, text in render_all(cat, ("gpuhealth",), "global").items():
        if path == "gpuhealth/lemon.yml":
            (rule_dir / path).parent.mkdir(parents=True, exist_ok=True)
            (rule_dir / path).write_text(text)
    rule_files = sorted(rule_dir.rglob("*.yml"))
    alerts = [rule for f in rule_files for g in yaml.safe_load(f.read_text())["groups"] for rule in g["rules"]
              if "alert" in rule]
    assert [a["alert"] for a in alerts] == ["GPUHealthLemonNode"]
    family = _alerts_family()
    end = START + (COUNT - 1) * STEP

    files = BlockFiles(tmp_path / "om", Timeline(START, STEP, COUNT))
    files.write(family, Thinning(0, STEP))
    promtool_blocks(files.close(), tmp_path / "prom-data", "test", progress=False, workdir=tmp_path)
    prometheus = start_prometheus(tmp_path, tmp_path / "prom-data", STEP)
    try:
        result = prometheus.api.query_range(alerts[0]["expr"], START, end, STEP)
    finally:
        prometheus.stop()
    in_prometheus = _episodes({s["metric"]["node"]: [float(t) for t, _ in s["values"]] for s in result})

    with VictoriaMetricsServer(tmp_path / "vm") as vm:
        vm.start()
        vm.import_text(_exposition(family))
        vmalert_replay(rule_files, vm, START, end, tmp_path / "vmalert.log")
        result = vm.api.query('ALERTS{alertname="GPUHealthLemonNode", alertstate="firing"}[10h]', end)
    in_vmalert = _episodes({s["metric"]["node"]: [float(t) for t, _ in s["values"]] for s in result})

    assert {node for node, _, _ in in_prometheus} == {"n1", "n3"}
    assert in_vmalert == in_prometheus
