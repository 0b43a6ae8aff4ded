"""Fault-to-drain latency of the whole loop, over repeated runs on the real local stack.

Each run starts a fresh stack (Slurm, simulated-GPU exporters, Prometheus, Alertmanager, webhook)
with 5 s scrape and evaluation intervals, then injects at once a sudden hard failure (XID 79) on
one job's node and a slow HBM precursor on another's, and measures when Slurm shows each node
drained and its job requeued. Target: hard XID to node drained and job requeued within 30 s.

Recovery figures, per run: ``xid_to_running_seconds`` (the hard XID to its job RUNNING again on
other nodes), ``checkpoint_before_drain`` (the predictive case: the job's newest checkpoint was
written on the webhook's signal before the node showed drained) and ``lost_work_fraction`` for both
cases (the steps the training job itself reports lost at its requeue, as seconds of work, over the
checkpoint interval).

    .venv/bin/python bench/e2e.py --runs 10 [--precursor 90] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import statistics
import sys
import time
from pathlib import Path

from gpuhealth.demo.observe import Observer
from gpuhealth.demo.stack import ClosedLoopStack, Fault, StackOptions
from gpuhealth.local.process import wait_until

TARGET_SECONDS = 30.0
STEP_SECONDS = 0.2  # the training job's step (SlurmCluster.submit_training_job's default)
LOST = re.compile(r"event=terminated .*?lost_steps=(\d+)")


def lost_work_fraction(stack: ClosedLoopStack, job_id: str, interval: float) -> float | None:
    """The work the job lost at its first requeue, from its own log line, over the checkpoint interval."""
    try:
        text = (stack.slurm.workdir / f"job-{job_id}.out").read_text()
    except OSError:
        return None
    match = LOST.search(text)
    return None if match is None else int(match[1]) * STEP_SECONDS / interval


def one_run(precursor: float) -> tuple[dict[str, float | None], int]:
    """One fresh stack: the run's latencies, and how many healthy nodes were drained."""
    options = StackOptions(nodes=6, jobs=2, job_nodes=2, breaker_max_nodes=3)
    with ClosedLoopStack(options) as stack:
        stack.start()
        observer = Observer(stack)
        observer.poll()
        hard = observer.last.jobs[stack.jobs[0]][1][-1]
        slow = observer.last.jobs[stack.jobs[1]][1][-1]
        hard_failure_at = observer.inject(Fault(hard, "fell_off_bus", gpu=2, duration=0.0)).hard_failure_at
        observer.inject(Fault(slow, "hbm_degradation", gpu=5, duration=precursor))

        def closed() -> bool:
            observer.poll()
            return observer.loop_closed()
        with contextlib.suppress(TimeoutError):
            wait_until(closed, timeout=precursor + 90, interval=0.5, what="the loop to close")
        latencies = observer.latencies()
        hard_job, slow_job = stack.jobs[0], stack.jobs[1]

        def running_elsewhere() -> bool:
            state, nodes, restarts = observer.poll().jobs[hard_job]
            return state == "RUNNING" and restarts > 0 and hard not in nodes
        running_at = None
        with contextlib.suppress(TimeoutError):
            wait_until(running_elsewhere, timeout=180, interval=0.5, what="the hard job to run again")
            running_at = observer.last.at
        drained_slow = observer.first.get(("drained", slow))
        saved = observer.last.checkpoints.get(slow_job)
        interval = options.checkpoint_interval
        return {
            "xid_to_running_seconds": None if running_at is None else running_at - hard_failure_at,
            "checkpoint_before_drain": float(saved is not None and saved.reason == "signal" and
                                             drained_slow is not None and saved.written_at <= drained_slow),
            "lost_work_fraction_predictive": lost_work_fraction(stack, slow_job, interval),
            "lost_work_fraction_hard": lost_work_fraction(stack, hard_job, interval),
            "hard_drain_seconds": latencies[hard]["drain_from_hard_failure_seconds"],
            "hard_requeue_seconds": latencies[hard]["requeue_from_hard_failure_seconds"],
            "precursor_drain_from_onset_seconds": latencies[slow]["drain_from_onset_seconds"],
            "precursor_drain_before_failure_seconds": (
                None if latencies[slow]["drain_from_hard_failure_seconds"] is None
                else -latencies[slow]["drain_from_hard_failure_seconds"]),
        }, len(observer.healthy_nodes_touched())


def describe(values: list[float], unit: str = "s") -> str:
    if not values:
        return "no value"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return (f"n={len(values)} min={ordered[0]:.2f}{unit} median={statistics.median(ordered):.2f}{unit} "
            f"p90={p90:.2f}{unit} max={ordered[-1]:.2f}{unit}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--precursor", type=float, default=90.0, help="precursor length, seconds")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    runs, healthy_drained = [], 0
    for index in range(args.runs):
        started = time.time()
        latencies, touched = one_run(args.precursor)
        runs.append(latencies)
        healthy_drained += touched
        print(f"run {index + 1}/{args.runs} ({time.time() - started:.0f}s): "
              + ", ".join(f"{k}={'-' if v is None else f'{v:.1f}'}" for k, v in runs[-1].items()),
              file=sys.stderr, flush=True)
    print(f"\nclosed loop over {args.runs} runs (5 s scrape/evaluation, Alertmanager group_wait 1 s)")
    for key in runs[0]:
        values = [r[key] for r in runs if r[key] is not None]
        missing = sum(r[key] is None for r in runs)
        unit = "s" if key.endswith("_seconds") else ""
        print(f"  {key:42s} {describe(values, unit)}" + (f" (missing in {missing} runs)" if missing else ""))
    print(f"  healthy nodes drained (all runs)           {healthy_drained}")
    hard = [r["hard_requeue_seconds"] for r in runs]
    met = sum(v is not None and v <= TARGET_SECONDS for v in hard)
    print(f"  hard XID -> drained and requeued within {TARGET_SECONDS:.0f}s: {met}/{len(runs)} runs")
    if args.json:
        medians = {key: statistics.median(values) if (values := [r[key] for r in runs if r[key] is not None])
                   else None for key in runs[0]}
        args.json.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
