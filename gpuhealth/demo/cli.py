"""``gpuhealth demo``: run the closed loop on simulated GPUs and show it closing, live or headless."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuhealth.contract.faults import FAULT_KINDS, NODE_NOISE_KINDS
from gpuhealth.demo.observe import Observer, Snapshot
from gpuhealth.demo.sharded import ShardedStack
from gpuhealth.demo.stack import ClosedLoopStack, Fault, StackOptions
from gpuhealth.local.process import ProcessError

#: binary -> Debian package, for the one message that says what to install.
REQUIRED = {"prometheus": "prometheus", "prometheus-alertmanager": "prometheus-alertmanager",
            "slurmctld": "slurmctld", "slurmd": "slurmd", "scontrol": "slurm-client", "munged": "munge"}
REQUIRED_SHARDED = {"victoria-metrics": "victoria-metrics", "vmalert": "victoria-metrics"}
LEMON = "GPUHealthLemonNode"
#: The lemon history's past failures, minutes before the live one: apart by more than two of the demo
#: overlay's lemon steps (1 min), so each is its own onset, and within its window (1 h).
PAST_FAILURES_MINUTES_AGO = (40, 20)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the closed loop on simulated GPUs",
        description="Start Slurm, simulated-GPU exporters, Prometheus with the generated rules, Alertmanager "
                    "and the webhook on loopback; inject a fault into a node running a training job and show "
                    "the signals rising, the risk score, the alert, the drain and the requeue. Ctrl-C stops "
                    "everything.")
    parser.add_argument("--headless", action="store_true",
                        help="no live screen: print the timeline, then the summary; exit 0 only if the loop "
                             "closed (faulty node drained, job requeued elsewhere, no healthy node touched)")
    parser.add_argument("--fault", default="hbm_degradation", choices=[*FAULT_KINDS, *NODE_NOISE_KINDS],
                        help="what to inject (default: hbm_degradation, a slow HBM precursor)")
    parser.add_argument("--precursor", type=float, default=120.0, metavar="SECONDS",
                        help="precursor length before the hard failure (default 120; 0 for a sudden failure)")
    parser.add_argument("--gpu", type=int, default=3, help="GPU index to fault (default 3)")
    parser.add_argument("--nodes", type=int, default=4, help="simulated GPU nodes (default 4)")
    parser.add_argument("--shards", type=int, default=1, metavar="N",
                        help="shard Prometheus N ways (default 1: one Prometheus). With N >= 2 the metrics "
                             "tier runs as README \"Scaling\" lays it out: N Prometheus shards (hashmod of "
                             "the node) remote-writing to VictoriaMetrics, vmalert with the global rules. "
                             "The demo shows which shard scrapes which node, injects --fault into a node of "
                             "each shard (the webhook drains both), and gives the last of "
                             "them a lemon history spanning the shards: two past failures imported as "
                             "another shard recorded them before a reshard; with the live fault that makes "
                             "three, and the global tier's GPUHealthLemonNode reaches the webhook")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="give up this long after the injection (default: precursor + 120 s; "
                             "+ 180 s with --shards)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the latencies and verdict as JSON")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        help="keep every config, log and database here (default: a temporary folder, "
                             "removed on exit)")
    parser.set_defaults(func=run)


def missing_requirements(sharded: bool = False) -> list[str]:
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    required = {**REQUIRED, **(REQUIRED_SHARDED if sharded else {})}
    return sorted({pkg for binary, pkg in required.items() if shutil.which(binary, path=path) is None})


def _check_arguments(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot make a demo, before anything starts."""
    if args.nodes < 2:
        return "--nodes must be at least 2 (a training job runs on two nodes)"
    if args.shards < 1:
        return "--shards must be at least 1"
    if args.shards > 1:
        if args.fault not in FAULT_KINDS:
            return (f"--shards {args.shards} shows faults drained through the shards and a lemon node: "
                    f"--fault must be a fault, not the noise {args.fault!r}")
        if args.nodes < 2 * args.shards:
            return (f"--shards {args.shards} needs --nodes {2 * args.shards} or more: a node of each shard "
                    "is drained, and the webhook's breaker stops at half the fleet")
    return None


def _say(line: str) -> None:
    """Progress goes out at once, also when stdout is a pipe (a CI log, a test reading it)."""
    print(line, flush=True)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    problem = _check_arguments(args)
    if problem:
        print(f"gpuhealth demo: {problem}", file=sys.stderr)
        return 2
    missing = missing_requirements(sharded=args.shards > 1)
    if missing:
        print(f"gpuhealth demo needs Debian packages: {' '.join(missing)}\n"
              f"  install them with: sudo apt-get install --no-install-recommends {' '.join(missing)}",
              file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("gpuhealth demo runs a local Slurm cluster, whose daemons need root: run it as root "
              "(e.g. sudo ./demo.sh)", file=sys.stderr)
        return 2
    if not args.verbose:
        logging.getLogger().setLevel(logging.WARNING)
    os.environ["PATH"] = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    signal.signal(signal.SIGTERM, _terminate)
    # Ctrl-C stops the demo even when it was started with SIGINT ignored (a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    live = not args.headless and sys.stdout.isatty()
    options = StackOptions(nodes=args.nodes, breaker_max_nodes=max(2, args.shards))
    stack = (ShardedStack(options, workdir=args.workdir, shards=args.shards) if args.shards > 1
             else ClosedLoopStack(options, workdir=args.workdir))
    try:
        with stack:
            stack.start(progress=lambda message: _say(f"* {message}"))
            for name, url in stack.urls().items():
                _say(f"  {name:20s} {url}")
            if isinstance(stack, ShardedStack):
                return _play_sharded(stack, args, live)
            return _play(stack, args, live)
    except (ProcessError, TimeoutError) as exc:
        print(f"gpuhealth demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: every demo process has been stopped", file=sys.stderr)
        return 130


def _baseline(observer: Observer) -> None:
    baseline = 3 * 5.0
    _say(f"* collecting {baseline:.0f}s of healthy baseline")
    deadline = time.time() + baseline
    while time.time() < deadline:
        observer.poll()
        time.sleep(1)


def _watch(stack: ClosedLoopStack, observer: Observer, live: bool, since: float, timeout: float,
           finished: Callable[[], bool]) -> None:
    """Poll and show the loop (the live screen, or the timeline since ``since``) until ``finished``."""
    shown = 0
    while time.time() < since + timeout:
        snap = observer.poll()
        if live:
            _draw(stack, observer, snap)
        else:
            for event in observer.events[shown:]:
                print(f"+{event.at - since:6.1f}s  {event.text}", flush=True)
            shown = len(observer.events)
        if finished():
            break
        time.sleep(1)


def _report(args: argparse.Namespace, lines: list[str], verdict: dict[str, Any]) -> None:
    print("\nSummary")
    for line in lines:
        print(f"  {line}")
    if args.json:
        args.json.write_text(json.dumps(verdict, indent=2))


def _play(stack: ClosedLoopStack, args: argparse.Namespace, live: bool) -> int:
    observer = Observer(stack)
    _baseline(observer)
    victim = stack.slurm.job(stack.jobs[0]).nodes[-1]
    is_fault = args.fault in FAULT_KINDS
    fault = Fault(victim, args.fault, args.gpu, args.precursor if is_fault else 60.0)
    injection = observer.inject(fault)

    def finished() -> bool:
        settled = time.time() > injection.at + fault.duration + 10
        return settled and (observer.loop_closed() or not is_fault)
    _watch(stack, observer, live, injection.at, args.timeout or (fault.duration + 120.0), finished)
    _report(args, observer.summary(),
            {"loop_closed": observer.loop_closed(), "latencies": observer.latencies()})
    return 0 if observer.loop_closed() else 1


def _play_sharded(stack: ShardedStack, args: argparse.Namespace, live: bool) -> int:
    """A fault on a node of each shard, and a lemon pattern spanning the shards on the last of them."""
    observer = Observer(stack)
    shards = [stack.shard_name(index) for index in range(stack.shard_count)]
    for shard in shards:
        _say(f"* {shard} scrapes {', '.join(stack.nodes_of(shard)) or 'no node'}")
    if empty := [shard for shard in shards if not stack.nodes_of(shard)]:
        print(f"gpuhealth demo: hashmod gave {', '.join(empty)} no node of {len(stack.nodes)}: "
              "run with more --nodes or fewer --shards", file=sys.stderr)
        return 2
    _baseline(observer)
    job_nodes = stack.slurm.job(stack.jobs[0]).nodes
    victims = [next((n for n in stack.nodes_of(shard) if n in job_nodes), stack.nodes_of(shard)[0])
               for shard in shards]
    lemon, former = victims[-1], shards[0]
    now = time.time()
    stack.import_past_failures(lemon, former, [now - minutes * 60 for minutes in PAST_FAILURES_MINUTES_AGO])
    observer.note(f"imported into VictoriaMetrics: {lemon} failed {len(PAST_FAILURES_MINUTES_AGO)} times "
                  f"({' and '.join(map(str, PAST_FAILURES_MINUTES_AGO))} min ago) while {former} scraped it, "
                  f"before a reshard moved it to {stack.shard_of[lemon]}")
    injections = [observer.inject(Fault(node, args.fault, args.gpu, args.precursor)) for node in victims]
    began = injections[0].at

    def lemon_reached() -> bool:
        return ("webhook replace", lemon) in observer.first

    def lemon_fired() -> float | None:
        return observer.first.get((f"alert {LEMON}", lemon))

    def finished() -> bool:  # vmalert notifies at once but writes its ALERTS back every few seconds
        settled = time.time() > began + args.precursor + 10
        return settled and observer.loop_closed() and lemon_reached() and lemon_fired() is not None
    _watch(stack, observer, live, began, args.timeout or (args.precursor + 180.0), finished)
    fired = lemon_fired()
    lines = [f"{i.fault.node} is scraped by {stack.shard_of[i.fault.node]}" for i in injections]
    lines += observer.summary()
    lines.append(f"{LEMON} for {lemon} (history from {former}, live failure in {stack.shard_of[lemon]}): "
                 + (f"firing in the global tier's ALERTS {fired - injections[-1].at:.1f}s after the live "
                    "fault began" if fired else "NOT fired")
                 + ("; the webhook acted (replace)" if lemon_reached() else "; NOT acted on by the webhook"))
    closed = observer.loop_closed() and lemon_reached()
    _report(args, lines, {"loop_closed": observer.loop_closed(), "latencies": observer.latencies(),
                          "shards": stack.shard_of, "lemon": {"node": lemon, "fired": fired is not None,
                                                              "reached_webhook": lemon_reached()}})
    return 0 if closed else 1


def _draw(stack: ClosedLoopStack, observer: Observer, snap: Snapshot) -> None:
    """Redraw the whole screen: nodes with Slurm state, riskiest GPU, top signals; then the timeline."""
    lines = [f"gpuhealth demo   t={snap.at - observer.started:5.0f}s   Ctrl-C stops everything", ""]
    lines += [f"  {name:20s} {url}" for name, url in stack.urls().items()]
    shard_of = stack.shard_of if isinstance(stack, ShardedStack) else {}
    lines += ["", f"{'NODE':8} {'SHARD    ' if shard_of else ''}{'SLURM':22} {'GPU':>3} {'RISK':>5}  "
                  "TOP SIGNALS / ALERTS"]
    for node in stack.nodes:
        state, _ = snap.node_states.get(node, ("?", ""))
        scores = {gpu: score for (n, gpu), score in snap.risk.items() if n == node}
        gpu, score = max(scores.items(), key=lambda item: item[1], default=("-", 0.0))
        top = ", ".join(f"{s}={v:.2f}" for s, v in snap.contributions.get((node, gpu), [])[:3])
        alerts = ", ".join(sorted({a[0] for a in snap.alerts if a[1] == node}))
        bar = "#" * round(score * 10)
        shard = f"{shard_of.get(node, '?'):8} " if shard_of else ""
        lines.append(f"{node:8} {shard}{state[:22]:22} {gpu:>3} {score:5.2f}  {bar:10} {top} {alerts}")
    lines += ["", "JOBS"]
    for job_id, (state, nodes, restarts) in snap.jobs.items():
        saved = snap.checkpoints.get(job_id)
        checkpoint = f", checkpoint step {saved.step} {snap.at - saved.written_at:.0f}s ago" if saved else ""
        lines.append(f"  {job_id}: {state} on {','.join(nodes) or '-'} (restarts {restarts}{checkpoint})")
    lines += ["", "TIMELINE"]
    lines += [f"  +{e.at - observer.started:6.1f}s  {e.text}" for e in observer.events[-12:]]
    sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
    sys.stdout.flush()
