"""Exporter cost: scrape latency, CPU and RSS of gpuhealth-exporter next to Debian's node_exporter.

Both run side by side on loopback for the same duration and are scraped alternately, several times
a second each (Prometheus scrapes every 15 s; more scrapes give a steadier p99). gpuhealth-exporter
simulates 8 GPUs of the chosen profile (default H100 SXM) with 18 NVLinks each and samples every second.

    .venv/bin/python bench/exporter.py --duration 300 [--sim-profile b200] [--baseline main]
    .venv/bin/python bench/exporter.py --exporter-arg=--no-collector.fabric   # a collector's share
    .venv/bin/python bench/exporter.py --gzip      # compressed answers, as Prometheus asks for them

``--baseline REF`` adds the exporter as it was at a git commit (its ``exporter/`` and ``gpuhealth/``
trees, run with this venv's interpreter and libraries) as a third target in the same run, so a change
is judged against the code before it on the same machine at the same moment.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from gpuhealth.local.process import ManagedProcess, free_port, http_ok

WARMUP_S = 5.0
# The exporter's targets (issue text and README): scrape p99, CPU of one core, RSS, and how much RSS may
# grow from the first to the last minute and still count as flat.
TARGET_P99_MS = 5.0
TARGET_CPU = 0.02
TARGET_RSS_MB = 60.0
FLAT_MB = 1.0


def scrape_seconds(url: str, gzip: bool = False) -> tuple[float, int]:
    """One scrape on a new connection: seconds and body bytes (compressed ones with ``gzip``)."""
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if gzip else {})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=10) as resp:
        body = resp.read()
    return time.perf_counter() - start, len(body)


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def baseline_tree(ref: str, workdir: Path) -> Path:
    """The ``gpuhealth`` package as it was at ``ref``, laid out to run with ``python -m`` from the
    returned directory, whose copy is found before this checkout's editable install (the exporter's
    source lives in ``exporter/`` and installs as ``gpuhealth.exporter``)."""
    repo = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref, "gpuhealth", "exporter"],
                             capture_output=True, check=True).stdout
    root = workdir / "baseline"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    (root / "exporter").rename(root / "gpuhealth" / "exporter")
    return root


class Target:
    def __init__(self, name: str, argv: list[str], port: int, workdir: Path,
                 cwd: Path | None = None, gzip: bool = False) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.process = ManagedProcess(name, argv, workdir / f"{name}.log", cwd=cwd)
        self.latencies: list[float] = []
        self.rss: list[float] = []
        self.size = 0
        self.gzip = gzip

    def start(self) -> None:
        self.process.start().wait_ready(lambda: http_ok(self.url), timeout=30)
        self.ps = psutil.Process(self.process.proc.pid)

    def measure(self) -> None:
        seconds, self.size = scrape_seconds(self.url, self.gzip)
        self.latencies.append(seconds)
        self.rss.append(self.ps.memory_info().rss / 2**20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300, help="seconds of measurement (default 300)")
    parser.add_argument("--scrape-interval", type=float, default=0.25,
                        help="seconds between scrapes of each target (default 0.25)")
    parser.add_argument("--gzip", action="store_true", help="ask every target for gzip, as Prometheus "
                        "does (body KB is then the compressed size)")
    parser.add_argument("--sim-profile", help="simulator hardware profile (h100-sxm, h200, b200, gb200)")
    parser.add_argument("--baseline", metavar="REF", help="also run the exporter as it was at this git "
                        "commit or branch (e.g. main), side by side")
    parser.add_argument("--exporter-arg", metavar="ARG", action="append", default=[],
                        help="extra argument for every gpuhealth-exporter target, e.g. "
                        "--exporter-arg=--no-collector.fabric (repeatable)")
    args = parser.parse_args()
    node_exporter = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if node_exporter is None:
        print("prometheus-node-exporter not found: apt-get install prometheus-node-exporter", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="gpuhealth-bench-"))
    gh_port, ne_port = free_port(), free_port()
    exporter = Path(sys.executable).parent / "gpuhealth-exporter"
    sim_args = ["--backend", "sim", "--sampling.interval", "1",
                *(["--sim-profile", args.sim_profile] if args.sim_profile else []), *args.exporter_arg]
    targets = [
        Target("gpuhealth-exporter", [str(exporter), *sim_args, "--listen", f"127.0.0.1:{gh_port}"],
               gh_port, workdir, gzip=args.gzip),
        Target("node_exporter", [node_exporter, f"--web.listen-address=127.0.0.1:{ne_port}"], ne_port,
               workdir, gzip=args.gzip),
    ]
    if args.baseline:
        try:
            tree = baseline_tree(args.baseline, workdir)
        except subprocess.CalledProcessError as exc:
            print(f"--baseline {args.baseline}: {exc.stderr.decode().strip()}", file=sys.stderr)
            return 2
        base_port = free_port()
        targets.insert(1, Target(f"exporter@{args.baseline}"[:20],
                                 [sys.executable, "-m", "gpuhealth.exporter.main", *sim_args,
                                  "--listen", f"127.0.0.1:{base_port}"],
                                 base_port, workdir, cwd=tree, gzip=args.gzip))
    try:
        for target in targets:
            target.start()
        time.sleep(WARMUP_S)
        cpu_start = {t.name: cpu_seconds(t.ps) for t in targets}
        load_start = os.getloadavg()[0]
        start = time.monotonic()
        while time.monotonic() - start < args.duration:
            tick = time.monotonic()
            for target in targets:
                target.measure()
            time.sleep(max(0.0, args.scrape_interval - (time.monotonic() - tick)))
        elapsed = time.monotonic() - start
        load_end = os.getloadavg()[0]
        cpu = {t.name: (cpu_seconds(t.ps) - cpu_start[t.name]) / elapsed for t in targets}
    finally:
        for target in targets:
            target.process.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"profile {args.sim_profile or 'default (h100-sxm)'}, duration {elapsed:.0f} s, "
          f"exporter arguments {' '.join(args.exporter_arg) or 'none'}, {'gzip, ' if args.gzip else ''}"
          f"{len(targets[0].latencies)} scrapes each, "
          f"{args.scrape_interval:g} s apart, alternating; load average {load_start:.1f} at the start, "
          f"{load_end:.1f} at the end ({os.cpu_count()} CPUs)")
    print(f"{'target':<20}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'CPU %':>8}{'RSS MB start':>14}"
          f"{'RSS MB end':>12}{'RSS MB max':>12}{'body KB':>9}")
    for t in targets:
        ms = [s * 1000 for s in t.latencies]
        minute = max(1, min(60, len(t.rss) // 4))
        print(f"{t.name:<20}{statistics.median(ms):>9.2f}{percentile(ms, 0.99):>9.2f}{max(ms):>9.2f}"
              f"{cpu[t.name] * 100:>8.2f}{statistics.mean(t.rss[:minute]):>14.1f}"
              f"{statistics.mean(t.rss[-minute:]):>12.1f}{max(t.rss):>12.1f}{t.size / 1024:>9.0f}")
    print("CPU % is of one core, scrapes included; RSS start/end are means over the first/last minute.")
    print(verdict(targets[0], targets[-1], cpu[targets[0].name]))
    return 0


def verdict(exporter: Target, node_exporter: Target, cpu: float) -> str:
    """gpuhealth-exporter's figures of this run against each target, one line."""
    p99 = percentile([s * 1000 for s in exporter.latencies], 0.99)
    node_p99 = percentile([s * 1000 for s in node_exporter.latencies], 0.99)
    minute = max(1, min(60, len(exporter.rss) // 4))
    growth = statistics.mean(exporter.rss[-minute:]) - statistics.mean(exporter.rss[:minute])
    rss = max(exporter.rss)
    checks = [(f"scrape p99 {p99:.2f} ms <= {TARGET_P99_MS:g} ms", p99 <= TARGET_P99_MS),
              (f"p99 not above node_exporter's {node_p99:.2f} ms", p99 <= node_p99),
              (f"CPU {cpu * 100:.2f} % <= {TARGET_CPU * 100:g} % of a core", cpu <= TARGET_CPU),
              (f"RSS max {rss:.1f} MB <= {TARGET_RSS_MB:g} MB", rss <= TARGET_RSS_MB),
              (f"RSS flat ({growth:+.1f} MB first to last minute, at most +{FLAT_MB:g})", growth <= FLAT_MB)]
    return "targets, gpuhealth-exporter: " + "; ".join(f"{text}: {'met' if ok else 'NOT met'}"
                                                       for text, ok in checks)


if __name__ == "__main__":
    sys.exit(main())
