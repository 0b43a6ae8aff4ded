"""``gpuhealth dashboards``: generate the Grafana dashboards (CI checks them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuhealth.dashboards.generate import GENERATED_DIR, render, stale, write


def register(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Add ``dashboards generate``; returns the action parser so development tools can add theirs."""
    parser = subparsers.add_parser("dashboards", help="generate the Grafana dashboards",
                                   description="Grafana dashboards generated from code.")
    sub = parser.add_subparsers(dest="dashboards_command", metavar="ACTION", required=True)
    generate = sub.add_parser(
        "generate", help="write the dashboard JSON files",
        description="Write importable Grafana dashboard JSON (fleet overview, GPU drill-down, "
                    "remediation). With --check, write nothing and fail if the files differ.")
    generate.add_argument("--out", type=Path, default=GENERATED_DIR,
                          help="output folder (default: the package's generated/ folder, which is committed)")
    generate.add_argument("--check", action="store_true",
                          help="exit 1 and list the differences if the files in --out are not current")
    generate.set_defaults(func=run_generate)
    return sub


def run_generate(args: argparse.Namespace) -> int:
    rendered = render()
    if args.check:
        problems = stale(args.out, rendered)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("run 'gpuhealth dashboards generate' and commit the result", file=sys.stderr)
            return 1
        print(f"{len(rendered)} dashboards in {args.out} are current")
        return 0
    for path in write(args.out, rendered):
        print(path)
    return 0
