"""Sharded Prometheus with a global tier: what the global rules cost, and what a shard sends.

Global tier: a VictoriaMetrics holding what the shards of a fleet would have remote-written (synthetic:
a week of ALERTS history for every node, with failure onsets far above the field rate and a few
lemons, plus the latest minutes of what the shards record for the fleet rules: storming GPUs' rates,
each shard's ECC-rate quantile, GPU and node counts and heartbeat, labelled by shard as remote write
labels them). Each global rule
group (``gpuhealth rules generate --tier global``) runs as vmalert runs it, an instant query per rule
with ``step`` the group's interval; the wall time per group evaluation is repeated, median and max
printed. Target: every global group under 1 s median on 2 cores.

Shard: a real Prometheus with the shard rules scrapes a synthetic fleet (``bench/rules.py``'s) and
remote-writes ``gpuhealth:*`` records and ALERTS (``REMOTE_WRITE_SERIES``) to that VictoriaMetrics;
its own counters give samples and bytes sent per minute, per node, and so per shard of the fleet.

    .venv/bin/python bench/tiers.py                         # 8,192 nodes x 8 GPUs; a 64-node shard
    .venv/bin/python bench/tiers.py --nodes 512 --shard-nodes 16 --minutes 3
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml
from gpuhealth.contract.duration import parse_duration
from gpuhealth.rules.catalogue import REMOTE_WRITE_SERIES, load
from gpuhealth.rules.render import render_all

from gpuhealth.local.process import wait_until
from gpuhealth.local.prometheus import PrometheusServer
from gpuhealth.local.synthetic_fleet import SyntheticFleet
from gpuhealth.local.victoria import VictoriaMetricsServer

WEEK_MINUTES = 7 * 24 * 60
ALERT_KINDS = [  # (alertname, action, severity, per GPU)
    ("GPUHealthXidDrainResetGpu", "drain_reset_gpu", "critical", True),
    ("GPUHealthGpuFailureRisk", "drain_reset_gpu", "warning", True),
    ("GPUHealthExporterDown", "none", "warning", False),
    ("GPUHealthRowRemapPending", "none", "info", True),
]


def _alert_history(nodes: int, end_ms: int, onsets_per_node: float, seed: int) -> Iterator[str]:
    """A week of ALERTS at 1 min: Poisson onsets per node lasting 30 min to 4 h; 1 % of nodes lemons."""
    rng = random.Random(seed)
    for index in range(nodes):
        node = f"gpu-{index:05d}"
        lemon = index % 100 == 0
        count = 4 if lemon else sum(rng.random() < onsets_per_node / 8 for _ in range(8))
        for _ in range(count):
            name, action, severity, per_gpu = rng.choice(ALERT_KINDS[:2] if lemon else ALERT_KINDS)
            gpu = f',gpu="{rng.randrange(8)}"' if per_gpu else ""
            labels = (f'alertname="{name}",alertstate="firing",action="{action}",severity="{severity}",'
                      f'node="{node}"{gpu}')
            start = rng.randrange(WEEK_MINUTES)
            for minute in range(start, min(start + rng.randrange(30, 240), WEEK_MINUTES)):
                yield f"ALERTS{{{labels}}} 1 {end_ms - (WEEK_MINUTES - minute) * 60_000}"


def _shard_records(nodes: int, end_ms: int, minutes: int, seed: int, shards: int) -> Iterator[str]:
    """What the fleet-wide rules read besides ALERTS, as the shards record them: the GPUs whose
    corrected-ECC rate is at the storm floor (one in 5,000), each shard's quantile of the rate and GPU
    and node counts, and its heartbeat, each with the shard's label."""
    rng = random.Random(seed)
    for index in range(nodes):
        for gpu in range(8):
            if rng.random() < 0.0002:
                labels = f'node="gpu-{index:05d}",gpu="{gpu}",prometheus="shard-{index % shards}"'
                for minute in range(minutes):
                    yield f"gpuhealth:gpu_ecc_corrected:rate{{{labels}}} 5000 {end_ms - minute * 60_000}"
    for shard in range(shards):
        label = f'{{prometheus="shard-{shard}"}}'
        per_shard = {"gpuhealth:cluster_ecc_corrected_rate:quantile": rng.random(),
                     "gpuhealth:cluster_ecc_corrected_rate:gpus": 8 * nodes // shards,
                     "gpuhealth:cluster_nodes:count": nodes // shards, "gpuhealth:shard:heartbeat": 1}
        for name, value in per_shard.items():
            for minute in range(minutes):
                yield f"{name}{label} {value:g} {end_ms - minute * 60_000}"


def _import(vm: VictoriaMetricsServer, lines: Iterator[str], chunk: int = 200_000) -> int:
    total, batch = 0, []
    for line in lines:
        batch.append(line)
        if len(batch) == chunk:
            vm.import_text(batch)
            total, batch = total + len(batch), []
    if batch:
        vm.import_text(batch)
    return total + len(batch)


def global_cost(vm: VictoriaMetricsServer, workdir: Path, args: argparse.Namespace) -> int:
    end = time.time() - 60
    end_ms = int(end * 1000)
    began = time.monotonic()
    alerts = _import(vm, _alert_history(args.nodes, end_ms, args.onsets, args.seed))
    records = _import(vm, _shard_records(args.nodes, end_ms, args.record_minutes, args.seed, args.shards))
    print(f"global tier: {args.nodes} nodes x 8 GPUs in {args.shards} shards; imported {alerts:,} ALERTS "
          f"samples (a week) and {records:,} record samples in {time.monotonic() - began:.0f} s", flush=True)
    groups = [g for name, text in render_all(load(), ("gpuhealth",), "global").items()
              if name.startswith("gpuhealth/") for g in yaml.safe_load(text)["groups"]]
    print(f"\n{'global rule group':<32}{'median s':>10}{'max s':>8}{'series':>8}   (target: median < 1 s)")
    worst = 0.0
    for group in groups:
        step = f"{parse_duration(group.get('interval', '1m')):g}s"
        times, series = [], 0
        for _ in range(args.repeats):
            started = time.monotonic()
            series = sum(len(vm.api.query_step(rule["expr"], end, step)) for rule in group["rules"])
            times.append(time.monotonic() - started)
        median = statistics.median(times)
        worst = max(worst, median)
        print(f"{group['name']:<32}{median:>10.3f}{max(times):>8.3f}{series:>8}")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return 0 if worst < 1 else 1


def _counter(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def shard_volume(vm: VictoriaMetricsServer, workdir: Path, args: argparse.Namespace) -> None:
    rule_files = []
    for name, text in render_all(load(), ("gpuhealth",), "shard").items():
        if name.startswith("gpuhealth/"):
            path = workdir / "rules" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            rule_files.append(str(path))
    fleet = SyntheticFleet(args.shard_nodes).start()
    config = {
        "global": {"scrape_interval": "15s", "evaluation_interval": "1m",
                   "external_labels": {"prometheus": "shard-0"}},   # as a shard names itself
        "rule_files": rule_files,
        "scrape_configs": [fleet.scrape_config("15s")],
        "remote_write": [{"url": vm.remote_write_url, "write_relabel_configs": [
            {"source_labels": ["__name__"], "regex": REMOTE_WRITE_SERIES, "action": "keep"}]}],
    }
    prometheus = PrometheusServer(workdir / "shard", config, extra_args=["--storage.tsdb.retention.time=1d"])
    try:
        prometheus.start(timeout=120)
        wait_until(lambda: len(prometheus.api.query('up{job="gpuhealth-exporter"} == 1')) >= args.shard_nodes,
                   timeout=300, interval=2, what="every synthetic node scraped")
        time.sleep(120)   # the first evaluations: records with windows fill in
        samples = _counter(prometheus.url, "prometheus_remote_storage_samples_total")
        sent = _counter(prometheus.url, "prometheus_remote_storage_bytes_total")
        time.sleep(args.minutes * 60)
        per_node = (_counter(prometheus.url, "prometheus_remote_storage_samples_total") - samples) \
            / args.minutes / args.shard_nodes
        bytes_per_node = (_counter(prometheus.url, "prometheus_remote_storage_bytes_total") - sent) \
            / args.minutes / args.shard_nodes
    finally:
        prometheus.stop()
        fleet.stop()
    print(f"\nshard: {args.shard_nodes} synthetic nodes x 8 GPUs, shard rules, remote write of "
          f"{REMOTE_WRITE_SERIES!r}, measured over {args.minutes} min")
    print(f"per node: {per_node:.1f} samples/min, {bytes_per_node / 1024:.2f} KiB/min (compressed)")
    print(f"{'shards':>8}{'nodes per shard':>16}{'samples/min per shard':>24}{'MiB/min per shard':>20}")
    for shards in (2, 4, 8, 16):
        nodes = args.nodes // shards
        print(f"{shards:>8}{nodes:>16}{per_node * nodes:>24,.0f}{bytes_per_node * nodes / 2**20:>20.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=8192, help="fleet nodes of 8 GPUs (default 8192)")
    parser.add_argument("--onsets", type=float, default=0.5,
                        help="mean alert onsets per node per week (default 0.5, ~25x the field rate)")
    parser.add_argument("--record-minutes", type=int, default=10,
                        help="minutes of the shards' records (default 10)")
    parser.add_argument("--shards", type=int, default=4, help="shards the records come from (default 4)")
    parser.add_argument("--repeats", type=int, default=11, help="evaluations per group (default 11)")
    parser.add_argument("--shard-nodes", type=int, default=64,
                        help="nodes of the measured shard (default 64)")
    parser.add_argument("--minutes", type=float, default=3, help="minutes of remote write measured")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="gpuhealth-bench-tiers-") as tmp, \
            VictoriaMetricsServer(Path(tmp) / "vm") as vm:
        vm.start()
        status = global_cost(vm, Path(tmp), args)
        if args.shard_nodes:
            shard_volume(vm, Path(tmp), args)
    return status


if __name__ == "__main__":
    sys.exit(main())
