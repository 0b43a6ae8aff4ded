"""Where a slow scrape's time goes: the exporter's scrape tail, phase by phase, against what ran meanwhile.

``bench/exporter.py`` gives the wall-clock p99 of whole scrapes, which on a shared machine is mostly
the scheduler's. This runs the exporter in-process on the simulator (sampler and HTTP server, the
switch interval and frozen heap of ``gpuhealth-exporter``) and scrapes it from a separate process
with a raw socket, timing each scrape's phases on the client: connect (the kernel's, no Python),
first byte (the server took the connection, read the request and wrote the answer's start) and
last byte (the rest of the body). The server side records each sampling run and each garbage
collection (and whether a run read the GPUs' counters, health and links: every 5 s, most of the
sampling CPU); a scrape is classed by whether it overlapped one, so the tail's cause is counted, not
guessed. Both processes stamp ``time.monotonic`` (one clock for the machine).

    .venv/bin/python bench/exporter_tail.py --sim-profile h100-sxm --duration 60
    .venv/bin/python bench/exporter_tail.py --gzip --baseline main   # then the same at main
    .venv/bin/python bench/exporter_tail.py --aim-ms 1 --baseline main  # every scrape into a run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from exporter_profile import simulated_sampler, switch_interval  # beside this script
from gpuhealth.exporter.sim.profiles import PROFILES
from gpuhealth.exporter.web import make_server

Interval = tuple[float, float]


def _thread_usage() -> tuple[float, float, float, float]:
    """Now, this thread's CPU seconds, and its voluntary and involuntary context switches so far: a
    thread that waits for the GIL (or for a socket) switches voluntarily, one the scheduler
    preempts involuntarily, so waits for the GIL are counted whatever the machine's load."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return time.monotonic(), usage.ru_utime + usage.ru_stime, usage.ru_nvcsw, usage.ru_nivcsw


def client(port: int, count: int, interval: float, gzip: bool, aim: float | None = None,
           runs_fd: int | None = None) -> list[list[float]]:
    """``count`` scrapes, a new connection each: [start, connected, first byte, last byte, bytes].
    With ``aim``, each scrape starts that many seconds after a sampling run began (the server writes
    a byte to ``runs_fd`` as each run starts): every scrape then meets the run at the same point."""
    request = (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
               + (b"Accept-Encoding: gzip\r\n" if gzip else b"") + b"\r\n")
    scrapes = []
    next_at = time.monotonic()
    for _ in range(count):
        if aim is not None and runs_fd is not None:
            os.read(runs_fd, 1)
            time.sleep(aim)
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            connected = time.monotonic()
            sock.sendall(request)
            size = len(sock.recv(1 << 20))
            first = time.monotonic()
            while chunk := sock.recv(1 << 20):
                size += len(chunk)
        scrapes.append([start, connected, first, time.monotonic(), size])
        if aim is None:
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
    return scrapes


def overlaps(scrape: list[float], spans: list[Interval]) -> bool:
    return any(start < scrape[3] and end > scrape[0] for start, end in spans)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def report(scrapes: list[list[float]], runs: list[Interval], collections: list[Interval],
           full: list[Interval], cpu: dict[Interval, float]) -> None:
    def line(label: str, group: list[list[float]]) -> None:
        if not group:
            print(f"  {label:<34}{0:>6}")
            return
        total = [(s[3] - s[0]) * 1000 for s in group]
        phases = [statistics.mean((s[i + 1] - s[i]) * 1000 for s in group) for i in range(3)]
        print(f"  {label:<34}{len(group):>6}{statistics.median(total):>8.2f}{percentile(total, 0.99):>8.2f}"
              f"{max(total):>8.2f}   " + " / ".join(f"{p:.2f}" for p in phases))

    during_run = [s for s in scrapes if overlaps(s, runs)]
    during_gc = [s for s in scrapes if overlaps(s, collections)]
    quiet = [s for s in scrapes if not overlaps(s, runs) and not overlaps(s, collections)]
    slowest = sorted(scrapes, key=lambda s: s[3] - s[0])[-max(1, len(scrapes) // 100):]
    print(f"  {'scrapes':<34}{'n':>6}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}   "
          "mean connect / first byte / rest, ms")
    line("all", scrapes)
    line("overlapping a sampling run", during_run)
    line("  one with full GPU readings", [s for s in during_run if overlaps(s, full)])
    line("  one with fast readings only", [s for s in during_run if not overlaps(s, full)])
    line("overlapping a garbage collection", during_gc)
    line("overlapping neither", quiet)
    line("slowest 1 %", slowest)
    print(f"  of the slowest 1 %: {sum(overlaps(s, runs) for s in slowest)} overlapped a sampling run, "
          f"{sum(overlaps(s, collections) for s in slowest)} a garbage collection")
    walls = [(end - start) * 1000 for start, end in runs]
    pauses = [(end - start) * 1000 for start, end in collections]
    share = sum(walls) / 1000 / (scrapes[-1][3] - scrapes[0][0]) * 100
    print(f"  sampling runs: {len(runs)}, wall p50 {statistics.median(walls):.1f} ms, max {max(walls):.1f} "
          f"ms ({share:.1f} % of the time); garbage collections: {len(pauses)}, max "
          f"{max(pauses, default=0):.1f} ms; body {scrapes[-1][4] // 1024} KB")
    for label, kind in (("with full GPU readings", [r for r in runs if r in full]),
                        ("with fast readings only", [r for r in runs if r not in full])):
        if kind:
            wall = statistics.median((end - start) * 1000 for start, end in kind)
            print(f"  runs {label}: {len(kind)}, wall p50 {wall:.1f} ms, process CPU p50 "
                  f"{statistics.median(cpu[r] for r in kind) * 1000:.1f} ms")


def report_server(scrapes: list[list[float]], handled: list[list[float]], runs: list[Interval]) -> None:
    """The server thread's side of each scrape (the i-th connection is the client's i-th scrape)."""
    if len(handled) < len(scrapes):
        print("  (server records missing: no per-request figures)")
        return
    pairs = list(zip(scrapes, handled[-len(scrapes):], strict=True))
    print(f"  {'server thread, per scrape (medians)':<34}{'n':>6}{'accept ms':>10}{'wall ms':>9}{'CPU ms':>8}"
          f"{'waits':>7}{'preempted':>10}")
    for label, group in (("overlapping a sampling run", [(s, h) for s, h in pairs if overlaps(s, runs)]),
                         ("overlapping none", [(s, h) for s, h in pairs if not overlaps(s, runs)])):
        if group:
            print(f"  {label:<34}{len(group):>6}"
                  f"{statistics.median((h[0] - s[1]) * 1000 for s, h in group):>10.2f}"
                  f"{statistics.median((h[4] - h[0]) * 1000 for _, h in group):>9.2f}"
                  f"{statistics.median((h[5] - h[1]) * 1000 for _, h in group):>8.2f}"
                  f"{statistics.median(h[6] - h[2] for _, h in group):>7.1f}"
                  f"{statistics.median(h[7] - h[3] for _, h in group):>10.1f}")


def measure(args: argparse.Namespace, workdir: Path) -> None:
    sampler = simulated_sampler(args.sim_profile, workdir, [])
    runs: list[Interval] = []
    full: list[Interval] = []  # the runs that read counters, health and links too (every 5 s)
    run_cpu: dict[Interval, float] = {}  # the process's CPU seconds during each run, mostly sampling
    gpu = sampler.collectors.get("gpu")
    sample_once = sampler.sample_once
    runs_read, runs_write = os.pipe()
    os.set_blocking(runs_write, False)

    def timed_run() -> bytes:
        start, run_cpu_start = time.monotonic(), time.process_time()
        full_due = getattr(gpu, "_full_due", None)
        full_run = full_due is not None and full_due(0)
        with contextlib.suppress(BlockingIOError):  # a client that is not aiming leaves the pipe full
            os.write(runs_write, b"r")
        try:
            return sample_once()
        finally:
            runs.append((start, time.monotonic()))
            run_cpu[runs[-1]] = time.process_time() - run_cpu_start
            if full_run:
                full.append(runs[-1])

    sampler.sample_once = timed_run  # type: ignore[method-assign]  # the bench's own stopwatch
    collections: list[Interval] = []
    gc_start = [0.0]

    generations: dict[int, list[float]] = {}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[0] = time.monotonic()
        else:
            collections.append((gc_start[0], time.monotonic()))
            generations.setdefault(info["generation"], []).append((time.monotonic() - gc_start[0]) * 1000)

    server = make_server("127.0.0.1", 0, sampler)
    handled: list[list[float]] = []
    handle = server._handle

    async def timed_handle(reader: Any, writer: Any) -> None:
        before = _thread_usage()
        try:
            await handle(reader, writer)
        finally:
            handled.append([*before, *_thread_usage()])

    server._handle = timed_handle  # type: ignore[method-assign]  # the bench's own stopwatch
    sys.setswitchinterval(switch_interval())  # as gpuhealth-exporter runs
    sampler.start()
    gc.freeze()
    gc.callbacks.append(on_gc)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    load_start = os.getloadavg()[0]
    cpu_start, wall_start = time.process_time(), time.monotonic()
    count = int(args.duration / (1.0 if args.aim_ms is not None else args.interval))
    try:
        out = subprocess.run([sys.executable, __file__, "--client", str(server.server_address[1]),
                              "--count", str(count), "--interval", str(args.interval),
                              "--runs-fd", str(runs_read), *(["--gzip"] if args.gzip else []),
                              *(["--aim-ms", str(args.aim_ms)] if args.aim_ms is not None else [])],
                             check=True, capture_output=True, text=True, pass_fds=[runs_read]).stdout
        cpu = (time.process_time() - cpu_start) / (time.monotonic() - wall_start)
    finally:
        server.shutdown()
        server.server_close()
        sampler.stop()
    scrapes = json.loads(out)
    window = scrapes[0][0]
    runs = [r for r in runs if r[0] >= window]
    print(f"exporter code from {Path(sys.modules[make_server.__module__].__file__ or '').parent}")
    spacing = f"each {args.aim_ms:g} ms into a sampling run" if args.aim_ms is not None else \
        f"{args.interval:g} s apart"
    print(f"profile {args.sim_profile}, {count} scrapes {spacing}"
          f"{', gzip' if args.gzip else ''}; load average {load_start:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs); the exporter's CPU "
          f"{cpu * 100:.2f} % of one core, scrapes included")
    report(scrapes, runs, collections, full, run_cpu)
    report_server(scrapes, handled, runs)
    print("  garbage collections by generation: " + ", ".join(
        f"{g}: {len(ms)}, max {max(ms):.2f} ms" for g, ms in sorted(generations.items())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim-profile", default="h100-sxm", choices=sorted(PROFILES))
    parser.add_argument("--duration", type=float, default=60, help="seconds of scraping (default 60)")
    parser.add_argument("--interval", type=float, default=0.05,
                        help="seconds between scrapes (default 0.05: ~20 per sampling run)")
    parser.add_argument("--gzip", action="store_true", help="ask for gzip, as Prometheus does")
    parser.add_argument("--aim-ms", type=float, metavar="MS", help="start each scrape this long after a "
                        "sampling run began (one a run): the worst case, measured on every scrape")
    parser.add_argument("--baseline", metavar="REF", help="then measure the exporter as it was at this git "
                        "commit or branch the same way (its exporter/ and gpuhealth/ trees, this venv)")
    parser.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--runs-fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        aim = None if args.aim_ms is None else args.aim_ms / 1000
        print(json.dumps(client(args.client, args.count, args.interval, args.gzip, aim, args.runs_fd)))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="gpuhealth-tail-"))
    try:
        measure(args, workdir)
        if args.baseline:
            from exporter import baseline_tree  # bench/exporter.py, beside this script

            tree = baseline_tree(args.baseline, workdir)
            argv = [a for a in sys.argv[1:] if a != "--baseline" and not a.startswith("--baseline=")
                    and a != args.baseline]
            print(f"at {args.baseline}:", flush=True)
            return subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], check=False,
                                  cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}).returncode
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
