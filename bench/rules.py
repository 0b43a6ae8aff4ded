"""Scale benchmark of the generated rules: a synthetic fleet scraped by a real Prometheus.

Renders the rules from the built-in catalogue (gpuhealth source), serves one exporter target per node
from a synthetic fleet, lets Prometheus scrape and evaluate for a few minutes, then prints each rule
group's evaluation time (prometheus_rule_group_last_duration_seconds: last, median and max) and the recorded
series per GPU. Targets: every group under 1 s on 2 cores; at most 60 recorded series per GPU.

Wall times suffer from whatever else the machine runs, so it then stops scraping and evaluation and
measures the Prometheus CPU time that one evaluation of each group costs (its expressions as instant
queries over the data collected), which other load barely changes; the groups are evaluated in
interleaved rounds so that Prometheus's own background bursts land on no one group (cpu_per_group).

    .venv/bin/python bench/rules.py                 # 2,048 nodes x 8 GPUs x 8 NIC ports, 4 minutes
    .venv/bin/python bench/rules.py --nodes 64 --minutes 2

Range windows only hold the minutes the benchmark ran, so rules over long windows (ECC growth over
6 h, remapped rows over 24 h, lemon nodes over 7 d) read fewer samples than in production. With
`--history DAYS`, the GPU temperature history the thermal groups read (the 10-minute peer-deviation
samples and their hourly daily means) is written for every GPU as TSDB blocks before Prometheus
starts, so those groups (baseline drift, daily trend, cooling) read full windows:

    .venv/bin/python bench/rules.py --minutes 3 --history 4 --groups 'temperature|cooling'
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from gpuhealth.rules.catalogue import load
from gpuhealth.rules.render import render_all

from gpuhealth.evaluation.blocks import BlockWriter
from gpuhealth.evaluation.openmetrics import Thinning
from gpuhealth.evaluation.scenario import parse_duration
from gpuhealth.evaluation.signals import Family
from gpuhealth.evaluation.workload import Timeline
from gpuhealth.local.process import ProcessError, free_port
from gpuhealth.local.prometheus import PrometheusServer
from gpuhealth.local.synthetic_fleet import SyntheticFleet

log = logging.getLogger("bench.rules")


def _value(api, expr: str, empty: float = float("nan"), at: float | None = None) -> float:
    result = api.query(expr, time=at)
    return float(result[0]["value"][1]) if result else empty


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="gpuhealth-bench-rules-") as tmp:
        workdir = Path(tmp)
        rule_files = (sorted(str(path) for path in args.rules.glob("*.yml")) if args.rules
                      else _render(workdir / "rules"))
        fleet = SyntheticFleet(args.nodes, gpus=args.gpus, nvlinks=args.nvlinks, nics=args.nics).start()
        port = free_port()
        config = {
            "global": {"scrape_interval": args.scrape_interval, "evaluation_interval": "1m"},
            "rule_files": rule_files,
            "scrape_configs": [
                fleet.scrape_config(args.scrape_interval),
                {"job_name": "prometheus", "scrape_interval": "5s",
                 "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
            ],
        }
        prometheus = PrometheusServer(workdir / "prometheus", config, port=port,
                                      extra_args=[f"--storage.tsdb.retention.time={args.history + 1:g}d"])
        if args.history:
            _write_history(prometheus.data_dir, fleet.names, args.gpus, args.history)
        try:
            prometheus.start(timeout=120)
            api = prometheus.api
            started = time.monotonic()
            if not _wait_for_targets(api, args.nodes, args.start_timeout):
                return 2
            print(f"all {args.nodes} targets up after {time.monotonic() - started:.0f}s; "
                  f"running {args.minutes} min")
            _run_for(api, args.minutes * 60)
            rules = _last_evaluations(api)
            # Everything after this instant reads the data as it stood: with ingest and evaluation
            # stopped, a machine too loaded to answer queries beside 2,048 scrapes answers them now.
            # After it Prometheus writes staleness markers, so every query is made at this instant.
            at = time.time() - 1
            _stop_scraping(prometheus)
            status = report(api, args, fleet.gpus, at, rules)
            cpu_per_group(prometheus, rule_files, at, args)
            return status
        except (ProcessError, TimeoutError, OSError, RuntimeError) as exc:
            log_tail = "" if isinstance(exc, ProcessError) else f"\nPrometheus log:\n{prometheus.log_tail(5)}"
            print(f"error: {exc}{log_tail}", file=sys.stderr)
            return 2
        finally:
            prometheus.stop()
            fleet.stop()


def _render(directory: Path) -> list[str]:
    """The built-in catalogue's gpuhealth rule files, written under ``directory``."""
    rule_files = []
    for name, text in render_all(load(), ("gpuhealth",)).items():
        if name.endswith(".yml") and name.startswith("gpuhealth/"):
            path = directory / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            rule_files.append(str(path))
    return rule_files


def _write_history(data_dir: Path, nodes: list[str], gpus: int, days: float) -> None:
    """``days`` of the two temperature records that are read over days, ending a minute ago, at the
    catalogue's intervals: each GPU's 10-minute peer-deviation samples (its own steady offset, about
    1 C either way, plus 0.4 C of noise) and their hourly daily means. A healthy fleet: the values
    only need to be realistic enough that the rules' filters keep what they would keep."""
    evidence = load().defaults["evidence"]
    rng = np.random.default_rng(0)
    end = time.time() - 60
    labels = [f'gpu="{gpu}",node="{node}"' for node in nodes for gpu in range(gpus)]
    offsets = rng.normal(0, 1, len(labels))
    records = (("peer_deviation_sampled", evidence["temperature_baseline"]["step"], 0.4),
               ("peer_deviation_daily", evidence["temperature_trend"]["step"], 0.05))
    started = time.monotonic()
    timelines = []
    for record, interval, noise in records:
        step = parse_duration(interval)
        count = int(days * 86400 // step)
        timelines.append((f"gpuhealth:gpu_temperature_celsius:{record}",
                          Timeline(end - (count - 1) * step, step, count), noise))
    writer = BlockWriter(data_dir, timelines[0][1])
    for name, timeline, noise in timelines:
        values = offsets[:, None] + rng.normal(0, noise, (len(labels), timeline.count))
        writer.write(Family(name, "gauge", list(zip(labels, values, strict=True))), Thinning(0, 0), timeline)
    writer.close()
    print(f"history: {days:g} days of {', '.join(name for name, _, _ in timelines)} for {len(labels)} "
          f"GPUs, {writer.samples:,} samples written in {time.monotonic() - started:.0f} s")


def _wait_for_targets(api, nodes: int, timeout: float) -> bool:
    """Every node scraped at least once lately (on a loaded machine a few scrapes answer late, so all
    targets are seldom up at one instant), with progress every 15 s; False, said plainly, on timeout."""
    scraped = 'count(max_over_time(up{job="gpuhealth-exporter"}[2m]) == 1)'
    started = time.monotonic()
    printed = started
    up = 0.0
    while up < nodes:
        now = time.monotonic()
        if now - started > timeout:
            print(f"error: only {up:.0f} of {nodes} synthetic nodes scraped within {timeout:.0f}s: "
                  "the machine is too loaded for this fleet; try fewer --nodes or a longer "
                  "--start-timeout", file=sys.stderr)
            return False
        try:
            up = _value(api, scraped, empty=0.0)
        except (TimeoutError, OSError) as exc:  # a Prometheus busy creating series answers late: ask again
            print(f"{up:.0f} of {nodes} targets scraped after {now - started:.0f}s; Prometheus did not "
                  f"answer ({exc}): busy creating series, asking again")
            printed = now
            continue
        if now - printed >= 15:
            print(f"{up:.0f} of {nodes} targets scraped after {now - started:.0f}s", flush=True)
            printed = now
        time.sleep(2)
    return True


def _run_for(api, seconds: float) -> None:
    """Let Prometheus scrape and evaluate for ``seconds``, saying each minute how far it is and how long
    its slowest group took last (a Prometheus too loaded to answer is said so, and waited for)."""
    started = time.monotonic()
    while (left := seconds - (time.monotonic() - started)) > 0:
        time.sleep(min(60.0, left))
        elapsed = time.monotonic() - started
        try:
            slowest = _value(api, "max(prometheus_rule_group_last_duration_seconds)")
            state = f"slowest group's last evaluation {slowest:.2f} s (wall)"
        except (TimeoutError, OSError) as exc:
            state = f"Prometheus did not answer ({exc})"
        print(f"{elapsed / 60:.1f} of {seconds / 60:g} min: {state}")


def _stop_scraping(prometheus: PrometheusServer, tries: int = 5) -> None:
    """Reload with nothing to scrape; a reload that answers late on a loaded machine is asked again
    (a second reload of the same empty configuration changes nothing)."""
    for attempt in range(tries):
        try:
            prometheus.stop_scraping()
            return
        except (TimeoutError, OSError):
            if attempt == tries - 1:
                raise


def _last_evaluations(api) -> list[tuple[float, str, str]]:
    """(seconds, name, error) of every rule's last evaluation; none when Prometheus, loaded, does not
    answer in time (the figures that matter are the ones read after ingest stops)."""
    try:
        groups = api.rule_groups()
    except (TimeoutError, OSError) as exc:
        print(f"rule evaluation times not read ({exc}); figures below from the recorded metrics")
        return []
    return [(float(r.get("evaluationTime", 0)), r.get("name", ""), r.get("lastError", ""))
            for g in groups for r in g["rules"]]


def cpu_per_group(prometheus: PrometheusServer, rule_files: list[str], at: float,
                  args: argparse.Namespace) -> None:
    """Prometheus CPU seconds to evaluate each group once, with scraping and rule evaluation stopped:
    every rule's expression runs as an instant query at ``at`` over the data just collected. CPU time
    is the process's own, so other load on the machine barely moves it: the figure that decides the
    target. A group whose query gets no answer within the API's timeout is said so.

    The process's CPU also counts its own background work (Go garbage collection of a heap of
    several GiB, head chunk and series garbage collection after ingest stops), which comes in bursts of
    a few seconds. Evaluated back to back, a group's repeats all fall inside one burst, so it once read
    1.5 CPU s for a peer shard whose nine twins read 0.3. So every group is first evaluated once (its
    chunks decoded, as a running Prometheus has them), and then the groups are evaluated in
    ``args.repeats`` rounds, each group once per round and each round starting one step further along
    the list: a group's evaluations lie minutes apart, a burst lands on one of them, and the median
    (reported with min and max) is the cost of one evaluation."""
    repeats = args.repeats
    idle = prometheus.cpu_seconds()
    time.sleep(args.idle_seconds)
    background = (prometheus.cpu_seconds() - idle) / args.idle_seconds
    before = prometheus.cpu_seconds()
    for _ in range(repeats * 20):
        prometheus.api.query("vector(1)")
    overhead = (prometheus.cpu_seconds() - before) / (repeats * 20)
    groups = [group for path in rule_files for group in yaml.safe_load(Path(path).read_text())["groups"]
              if re.search(args.groups, group["name"])]
    print(f"\nPrometheus background CPU with nothing asked ({args.idle_seconds:g} s): {background:.3f} CPU s "
          f"per s; per-query overhead of the HTTP API (vector(1)): {overhead:.4f} CPU s, included below")
    evaluations, per_rule, failed = _evaluate_interleaved(prometheus, groups, at, repeats)
    print(f"CPU s per evaluation of {len(groups)} groups (scraping and evaluation stopped): median, min "
          f"and max of {repeats}, interleaved\n{'rule group':<44}{'median':>8}{'min':>10}{'max':>10}")
    costs: list[tuple[float, str]] = []
    medians: list[tuple[float, str]] = []
    for index, group in enumerate(groups):
        if index in failed:
            print(f"{group['name']:<44}  no answer ({failed[index]})")
            medians.append((float("inf"), group["name"]))
            continue
        costs += [(statistics.median(c), rule.get("record") or rule["alert"])
                  for c, rule in zip(per_rule[index], group["rules"], strict=True)]
        runs = evaluations[index]
        medians.append((statistics.median(runs), group["name"]))
        print(f"{group['name']:<44}{medians[-1][0]:>8.3f}{min(runs):>10.3f}{max(runs):>10.3f}")
    print("costliest rules (CPU s per evaluation):")
    for cost, name in sorted(costs, reverse=True)[:args.top]:
        print(f"  {cost:8.3f}  {name}")
    over = sorted((m for m in medians if m[0] >= 1), reverse=True)
    total = sum(m for m, _ in medians)
    print(f"\nCPU for one evaluation of every group measured: {total:.1f} s; groups at 1 s or more "
          f"(target < 1 s each): {', '.join(f'{n} {m:.2f} s' for m, n in over) or 'none'}")


def _evaluate_interleaved(prometheus: PrometheusServer, groups: list[dict], at: float, repeats: int
                          ) -> tuple[list[list[float]], list[list[list[float]]], dict[int, str]]:
    """CPU seconds of ``repeats`` evaluations of each group, after one to warm up, in rounds that each
    evaluate every group once starting one step further along: per group and evaluation, per group,
    rule and evaluation, and the groups (by index) that got no answer, with the error."""
    evaluations: list[list[float]] = [[] for _ in groups]
    per_rule: list[list[list[float]]] = [[[] for _ in group["rules"]] for group in groups]
    failed: dict[int, str] = {}
    for round_ in range(repeats + 1):
        shift = round_ * len(groups) // (repeats + 1)
        for index in [*range(shift, len(groups)), *range(shift)]:
            if index in failed:
                continue
            try:
                start = prometheus.cpu_seconds()
                for rule_index, rule in enumerate(groups[index]["rules"]):
                    before = prometheus.cpu_seconds()
                    prometheus.api.query(rule["expr"], time=at)
                    if round_:
                        per_rule[index][rule_index].append(prometheus.cpu_seconds() - before)
                if round_:
                    evaluations[index].append(prometheus.cpu_seconds() - start)
            except (TimeoutError, OSError) as exc:
                failed[index] = str(exc)
    return evaluations, per_rule, failed


def _per_group(api, expr: str, at: float) -> dict[str, float]:
    """``expr``'s value by rule group name (the file path prefix of ``rule_group`` dropped)."""
    return {r["metric"]["rule_group"].split(";")[-1]: float(r["value"][1])
            for r in api.query(expr, time=at)}


def report(api, args: argparse.Namespace, gpus: int, at: float, rules: list[tuple[float, str, str]]) -> int:
    window = f"{int(args.minutes * 60)}s"
    duration = "prometheus_rule_group_last_duration_seconds"
    last = _per_group(api, duration, at)
    worst = _per_group(api, f"max_over_time({duration}[{window}])", at)
    median = _per_group(api, f"quantile_over_time(0.5, {duration}[{window}])", at)
    samples = _per_group(api, "prometheus_rule_group_last_evaluation_samples", at)
    recorded = {r["metric"]["__name__"]: float(r["value"][1])
                for r in api.query('count by (__name__) ({__name__=~"gpuhealth:.+"})', time=at)}
    head = _value(api, "prometheus_tsdb_head_series", at=at)
    rss = _value(api, 'process_resident_memory_bytes{job="prometheus"}', at=at)
    print(f"\nfleet: {args.nodes} nodes x {args.gpus} GPUs = {gpus} GPUs, {args.nvlinks} NVLinks per GPU, "
          f"{args.nics} NIC ports per node, scrape {args.scrape_interval}; head series {head:,.0f}; "
          f"Prometheus RSS {rss / 2**30:.2f} GiB; machine load average (1, 5, 15 min) "
          f"{', '.join(f'{load:.1f}' for load in os.getloadavg())}")
    print(f"\n{'rule group':<40}{'last eval s':>12}{'median s':>10}{'max eval s':>12}{'samples':>10}")
    for name in sorted(last):
        print(f"{name:<40}{last[name]:>12.3f}{median.get(name, float('nan')):>10.3f}"
              f"{worst.get(name, float('nan')):>12.3f}{samples.get(name, 0):>10.0f}")
    total = sum(recorded.values())
    print(f"\nrecorded series: {total:,.0f} = {total / gpus:.1f} per GPU (target <= 60)")
    for name, count in sorted(recorded.items()):
        print(f"  {name:<58}{count:>8.0f}")
    print("\nslowest rules (last evaluation):")
    for seconds, name, _ in sorted(rules, reverse=True)[:args.top]:
        print(f"  {seconds:8.3f} s  {name}")
    errors = [(name, error) for _, name, error in rules if error]
    for name, error in errors:
        print(f"ERROR {name}: {error}")
    slowest = max(worst.values(), default=float("nan"))
    print(f"\nslowest group: {slowest:.3f} s (target < 1 s)")
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2048, help="synthetic nodes (default 2048)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--nvlinks", type=int, default=4, help="NVLinks per GPU exposed (default 4)")
    parser.add_argument("--nics", type=int, default=8,
                        help="InfiniBand ports per node, each behind its rack's leaf switch (default 8)")
    parser.add_argument("--minutes", type=float, default=4, help="minutes of scraping and evaluation")
    parser.add_argument("--scrape-interval", default="15s", help="scrape interval (default 15s)")
    parser.add_argument("--start-timeout", type=float, default=600,
                        help="seconds to wait for every node to be scraped once (default 600)")
    parser.add_argument("--history", type=float, default=0, metavar="DAYS",
                        help="write DAYS of the GPU temperature history (10-minute samples, hourly daily "
                             "means) before Prometheus starts, so the thermal groups read full windows "
                             "(default 0: none)")
    parser.add_argument("--top", type=int, default=8, help="slowest rules to list (default 8)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="evaluations per group for the CPU figure (default 5)")
    parser.add_argument("--idle-seconds", type=float, default=10,
                        help="seconds Prometheus's CPU is watched with nothing asked, before the CPU "
                             "figures, to show its background work (default 10)")
    parser.add_argument("--rules", type=Path, metavar="DIR",
                        help="rule files to evaluate instead of the rendered catalogue (e.g. an earlier "
                             "version's rules/generated/gpuhealth, for a side-by-side run)")
    parser.add_argument("--groups", default="", metavar="REGEX",
                        help="measure the CPU of the groups whose name matches REGEX only (default: all); "
                             "every group is still loaded and evaluated")
    args = parser.parse_args(argv)
    if args.history < 0:
        parser.error("--history: days of history, 0 or more")
    try:
        re.compile(args.groups)
    except re.error as exc:
        parser.error(f"--groups: not a regular expression: {exc}")
    sys.stdout.reconfigure(line_buffering=True)  # progress reaches a log file as it happens
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted: Prometheus and the synthetic fleet are stopped", file=sys.stderr)
        return 130


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, through the teardown of everything started."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
