"""``gpuhealth eval``: how well the rules predict failures on a simulated fleet with ground truth."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
from pathlib import Path

from gpuhealth.evaluation.benchmark import Options, evaluate
from gpuhealth.evaluation.fleet import MAX_JOBS, BackfillError
from gpuhealth.evaluation.matching import LEMON_ALERTS
from gpuhealth.evaluation.ranges import PARALLEL
from gpuhealth.evaluation.report import table
from gpuhealth.evaluation.rulefiles import RulesError
from gpuhealth.evaluation.scenario import ScenarioError, parse_duration
from gpuhealth.local.process import ProcessError

DEFAULT_RULES = Path("rules/generated/gpuhealth")


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {exc}") from None
    return text


def _jobs(text: str) -> int:
    try:
        jobs = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= jobs <= MAX_JOBS:
        raise argparse.ArgumentTypeError(f"{jobs} is not between 1 and {MAX_JOBS}")
    return jobs


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="measure detection quality on a simulated fleet",
        description="Simulate a fleet's metrics with injected failures and benign noise, backfill them into "
        "a real Prometheus, evaluate every alert rule over the period with Prometheus's own engine, "
        "and score the alerts against the ground truth: share detected within a minute of the failure "
        "instant (its first XID), share predicted at least min_lead ahead (all failures, and those with "
        "a precursor of an hour or more, with 95% Wilson intervals), late warnings, lead times, false "
        "alarms and false drains per day per 64 nodes, precision at the field failure rate.",
        epilog="Scenario format: bench/scenarios/README.md. Exit status: 0 done, 2 bad scenario or rules, "
        "1 Prometheus/promtool failure, 130 interrupted.",
    )
    parser.add_argument("--scenario", type=Path, required=True, metavar="FILE", help="fleet scenario (YAML)")
    parser.add_argument("--seed", type=int, help="override the scenario's seed (another fleet history)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the figures as JSON")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help="write a timeline of one failure (the one predicted with the longest lead, else the first "
        "with a precursor): its signal, evidence, risk score and alerts",
    )
    parser.add_argument(
        "--plot-false-alarm",
        action="store_true",
        help="with --plot, draw the longest false-alarm episode instead, with the benign event near it",
    )
    parser.add_argument(
        "--lemon-alerts",
        default=LEMON_ALERTS,
        type=_regex,
        metavar="REGEX",
        help="alert names scored as lemon-node alerts: right when their node fails again within the "
        f"scenario's lemon_window (default: {LEMON_ALERTS!r})",
    )
    parser.add_argument(
        "--rules",
        type=Path,
        default=DEFAULT_RULES,
        metavar="DIR",
        help=f"Prometheus rule files to evaluate (default: {DEFAULT_RULES})",
    )
    parser.add_argument(
        "--step",
        type=_duration,
        metavar="DURATION",
        help="alert evaluation step (default: the rules' group interval)",
    )
    parser.add_argument(
        "--fused-step",
        type=_duration,
        metavar="DURATION",
        help="evaluation step of the alerts that read recording rules, the costly ones on big fleets "
        "(default: the scenario's fused_step, else --step)",
    )
    parser.add_argument(
        "--fold-records",
        action="store_true",
        help="fold the recording rules into the alerts that read them, as one PromQL expression each, "
        "instead of computing every record once and storing it (the same alerts, many times slower; "
        "the reference the stored form is tested against)",
    )
    parser.add_argument(
        "--jobs",
        type=_jobs,
        default=PARALLEL,
        metavar="N",
        help="range queries Prometheus evaluates at once, each on one core; the results are the same "
        f"for any N, more take more memory (default: the number of CPUs, {PARALLEL} here; at most "
        f"{MAX_JOBS})",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="build the TSDB in DIR and keep it (default: a temporary directory, removed)",
    )
    parser.set_defaults(func=run)


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so Prometheus is stopped and the temporary TSDB removed."""
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    if not args.rules.exists():
        print(
            f"gpuhealth eval: rules {args.rules} not found (generate them with 'gpuhealth rules generate', "
            "or pass --rules DIR)",
            file=sys.stderr,
        )
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="gpuhealth-eval-") as temporary:
            workdir = args.keep or Path(temporary)
            result = evaluate(
                Options(
                    scenario=args.scenario,
                    rules=args.rules,
                    workdir=workdir,
                    seed=args.seed,
                    step=args.step,
                    fused_step=args.fused_step,
                    plot=args.plot,
                    plot_false_alarm=args.plot_false_alarm,
                    lemon_alerts=args.lemon_alerts,
                    fold_records=args.fold_records,
                    jobs=args.jobs,
                    progress=True,
                )
            )
    except (ScenarioError, RulesError) as exc:
        print(f"gpuhealth eval: {exc}", file=sys.stderr)
        return 2
    except (BackfillError, ProcessError) as exc:
        print(f"gpuhealth eval: {exc}", file=sys.stderr)
        return 1
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
