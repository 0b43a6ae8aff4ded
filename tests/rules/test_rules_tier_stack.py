"""The tiers live: two Prometheus shards split a fleet by node and remote-write their records and
alerts to VictoriaMetrics, where vmalert fires a lemon alert that no shard could see on its own."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from gpuhealth.rules import catalogue
from gpuhealth.rules.render import render_all

from gpuhealth.local.process import wait_until
from gpuhealth.local.prometheus import AlertmanagerServer, PrometheusServer
from gpuhealth.local.synthetic_fleet import SyntheticFleet
from gpuhealth.local.victoria import VictoriaMetricsServer, VmalertServer, shard_config

pytestmark = pytest.mark.slow

OVERLAY = {"defaults": {"scrape_interval": "5s", "evaluation_interval": "5s",
                        "lemon": {"window": "2h", "step": "10m", "count": 3}}}
LEMON = "gpu-lemon"


def _rule_files(tier: str, out: Path) -> list[Path]:
    paths = []
    for name, text in render_all(catalogue.resolve(OVERLAY), ("gpuhealth",), tier).items():
        if name.startswith("gpuhealth/"):
            paths.append(out / tier / name)
            paths[-1].parent.mkdir(parents=True, exist_ok=True)
            paths[-1].write_text(text)
    return paths


def _lemon_history(now: float) -> list[str]:
    """Three failures of one node within the window: two while shard 0 scraped it, one after it moved
    to shard 1 (a reshard), so each shard holds fewer than the lemon count. The gaps between them are
    longer than two onset steps, so each is its own onset wherever the step grid falls."""
    lines = []
    for shard, onset_minutes_ago in ((0, 110), (0, 70), (1, 30)):
        labels = (f'alertname="GPUHealthXidResetGpu",alertstate="firing",action="drain_reset_gpu",'
                  f'severity="critical",node="{LEMON}",gpu="0",prometheus="shard-{shard}"')
        start = int(now) - onset_minutes_ago * 60
        lines += [f"ALERTS{{{labels}}} 1 {(start + 60 * m) * 1000}" for m in range(15)]
    return lines


def _am_alerts(url: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v2/alerts", timeout=5) as resp:
        return json.load(resp)


def test_global_lemon_from_two_shards_reaches_alertmanager(tmp_path: Path):
    fleet = SyntheticFleet(6).start()
    am = AlertmanagerServer(tmp_path / "am", {"route": {"receiver": "none"}, "receivers": [{"name": "none"}]})
    shards: list[PrometheusServer] = []
    with VictoriaMetricsServer(tmp_path / "vm") as vm, am:
        am.start()
        vm.start()
        base = {"global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
                "rule_files": [str(p) for p in _rule_files("shard", tmp_path / "rules")],
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am.port}"]}]}]},
                "scrape_configs": [fleet.scrape_config("5s")]}
        try:
            for index in range(2):
                shards.append(PrometheusServer(tmp_path / f"shard{index}",
                                               shard_config(index, 2, base, vm.remote_write_url)).start())
            vm.import_text(_lemon_history(time.time()))
            vmalert = VmalertServer(tmp_path / "vmalert", _rule_files("global", tmp_path / "rules"), vm,
                                    am.url, interval="5s")
            with vmalert:
                vmalert.start()
                def scraped() -> list[set[str]]:
                    return [{t["labels"]["node"] for t in shard.api.targets()} for shard in shards]
                wait_until(lambda: sum(map(len, scraped())) == len(fleet.names), timeout=60, interval=0.5,
                           what="every node's target in a shard")
                nodes = scraped()
                assert nodes[0] and nodes[1] and not nodes[0] & nodes[1]
                assert nodes[0] | nodes[1] == set(fleet.names)

                def both_shards_sent() -> bool:
                    vm.flush()
                    sent = vm.api.query('count by (prometheus) ({__name__=~"gpuhealth:.+"})')
                    return {s["metric"].get("prometheus") for s in sent} == {"shard-0", "shard-1"}
                wait_until(both_shards_sent, timeout=90, interval=1, what="records of both shards in VM")
                assert vm.api.query('count({__name__=~"gpuhealth_.+"})') == []   # raw series stay home

                def lemon_notified() -> bool:
                    return any(a["labels"].get("alertname") == "GPUHealthLemonNode"
                               and a["labels"].get("node") == LEMON for a in _am_alerts(am.url))
                wait_until(lemon_notified, timeout=90, interval=1, what="the lemon alert in Alertmanager")
                for shard in shards:
                    assert not shard.api.query('ALERTS{alertname="GPUHealthLemonNode"}')
        finally:
            for shard in shards:
                shard.stop()
            fleet.stop()
