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
from pathlib import Path

from gpuhealth.contract.faults import FAULT_KINDS, NODE_NOISE_KINDS
from gpuhealth.demo.observe import Observer, Snapshot
from gpuhealth.demo.stack import ClosedLoopStack, Fault, StackOptions
from gpuhealth.local.process import ProcessError

#: binary -> Debian package, for the one message that says what to install.
REQUIRED = {"prometheus": "prometheus", "prometheus-alertmanager": "prometheus-alertmanager",
            "slurmctld": "slurmctld", "slurmd": "slurmd", "scontrol": "slurm-client", "munged": "munge"}


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
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="give up this long after the injection (default: precursor + 120 s)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the latencies and verdict as JSON")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        help="keep every config, log and database here (default: a temporary folder, "
                             "removed on exit)")
    parser.set_defaults(func=run)


def missing_requirements() -> list[str]:
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    return sorted({pkg for binary, pkg in REQUIRED.items() if shutil.which(binary, path=path) is None})


def _say(line: str) -> None:
    """Progress goes out at once, also when stdout is a pipe (a CI log, a test reading it)."""
    print(line, flush=True)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    missing = missing_requirements()
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
    options = StackOptions(nodes=args.nodes)
    try:
        with ClosedLoopStack(options, workdir=args.workdir) as stack:
            stack.start(progress=lambda message: _say(f"* {message}"))
            for name, url in stack.urls().items():
                _say(f"  {name:15s} {url}")
            return _play(stack, args, live)
    except (ProcessError, TimeoutError) as exc:
        print(f"gpuhealth demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: every demo process has been stopped", file=sys.stderr)
        return 130


def _play(stack: ClosedLoopStack, args: argparse.Namespace, live: bool) -> int:
    observer = Observer(stack)
    baseline = 3 * 5.0
    _say(f"* collecting {baseline:.0f}s of healthy baseline")
    deadline = time.time() + baseline
    while time.time() < deadline:
        observer.poll()
        time.sleep(1)
    victim = stack.slurm.job(stack.jobs[0]).nodes[-1]
    is_fault = args.fault in FAULT_KINDS
    fault = Fault(victim, args.fault, args.gpu, args.precursor if is_fault else 60.0)
    injection = observer.inject(fault)
    timeout = args.timeout or (fault.duration + 120.0)
    shown = 0
    while time.time() < injection.at + timeout:
        snap = observer.poll()
        if live:
            _draw(stack, observer, snap)
        else:
            for event in observer.events[shown:]:
                print(f"+{event.at - injection.at:6.1f}s  {event.text}", flush=True)
            shown = len(observer.events)
        settled = time.time() > injection.at + fault.duration + 10
        if (is_fault and observer.loop_closed() and settled) or (not is_fault and settled):
            break
        time.sleep(1)
    print("\nSummary")
    for line in observer.summary():
        print(f"  {line}")
    if args.json:
        args.json.write_text(json.dumps({"loop_closed": observer.loop_closed(),
                                         "latencies": observer.latencies()}, indent=2))
    return 0 if observer.loop_closed() else 1


def _draw(stack: ClosedLoopStack, observer: Observer, snap: Snapshot) -> None:
    """Redraw the whole screen: nodes with Slurm state, riskiest GPU, top signals; then the timeline."""
    lines = [f"gpuhealth demo   t={snap.at - observer.started:5.0f}s   Ctrl-C stops everything", ""]
    lines += [f"  {name:15s} {url}" for name, url in stack.urls().items()]
    lines += ["", f"{'NODE':8} {'SLURM':22} {'GPU':>3} {'RISK':>5}  TOP SIGNALS / ALERTS"]
    for node in stack.nodes:
        state, _ = snap.node_states.get(node, ("?", ""))
        scores = {gpu: score for (n, gpu), score in snap.risk.items() if n == node}
        gpu, score = max(scores.items(), key=lambda item: item[1], default=("-", 0.0))
        top = ", ".join(f"{s}={v:.2f}" for s, v in snap.contributions.get((node, gpu), [])[:3])
        alerts = ", ".join(sorted({a[0] for a in snap.alerts if a[1] == node}))
        bar = "#" * round(score * 10)
        lines.append(f"{node:8} {state[:22]:22} {gpu:>3} {score:5.2f}  {bar:10} {top} {alerts}")
    lines += ["", "JOBS"]
    for job_id, (state, nodes, restarts) in snap.jobs.items():
        saved = snap.checkpoints.get(job_id)
        checkpoint = f", checkpoint step {saved.step} {snap.at - saved.written_at:.0f}s ago" if saved else ""
        lines.append(f"  {job_id}: {state} on {','.join(nodes) or '-'} (restarts {restarts}{checkpoint})")
    lines += ["", "TIMELINE"]
    lines += [f"  +{e.at - observer.started:6.1f}s  {e.text}" for e in observer.events[-12:]]
    sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
    sys.stdout.flush()
