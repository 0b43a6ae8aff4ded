"""``gpuhealth dashboards``: generate the Grafana dashboards (CI checks them), and draw their previews."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from gpuhealth.dashboards.generate import GENERATED_DIR, render, stale, write
from gpuhealth.dashboards.queries import Window, riskiest_gpu, variable_values

from gpuhealth.local.prometheus import PrometheusAPI

log = logging.getLogger(__name__)

PREVIEW_DIR = Path(__file__).resolve().parent / "previews"
# Grafana asks for about one point per pixel column; a preview panel is a few hundred pixels wide.
PREVIEW_POINTS = 240


def register(subparsers: argparse._SubParsersAction) -> None:
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

    preview = sub.add_parser(
        "preview", help="draw PNG previews of the dashboards from a Prometheus",
        description="Run every panel's query against a Prometheus and draw each dashboard to a PNG, "
                    "laid out as Grafana lays it out. The drill-down shows the riskiest GPU.")
    source = preview.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", type=Path,
                        help="fleet scenario YAML (e.g. bench/scenarios/small.yaml): simulate it, backfill a "
                             "local Prometheus with it and the rules, and preview that")
    source.add_argument("--url", help="a running Prometheus that already has gpuhealth data")
    preview.add_argument("--since", type=float, default=6.0,
                         help="with --url: hours before now to show (default: 6)")
    preview.add_argument("--seed", type=int, help="with --scenario: random seed of the simulated fleet")
    preview.add_argument("--out", type=Path, default=PREVIEW_DIR,
                         help="output folder (default: the package's previews/ folder, shown in its README)")
    preview.set_defaults(func=run_preview)


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


@contextlib.contextmanager
def _prometheus(args: argparse.Namespace) -> Iterator[tuple[PrometheusAPI, float, float]]:
    """The Prometheus to draw from and the window it holds data for."""
    if args.url:
        end = time.time()
        yield PrometheusAPI(args.url), end - args.since * 3600, end
        return
    from gpuhealth.evaluation.fleet import backfilled_prometheus

    with tempfile.TemporaryDirectory(prefix="gpuhealth-preview-") as workdir, \
            backfilled_prometheus(args.scenario, Path(workdir), seed=args.seed) as fleet:
        yield fleet.server.api, fleet.start, fleet.end


def run_preview(args: argparse.Namespace) -> int:
    from gpuhealth.dashboards.preview import Previewer  # matplotlib is a development dependency

    if args.scenario and not args.scenario.is_file():
        print(f"{args.scenario}: no such scenario file", file=sys.stderr)
        return 2
    try:
        return _preview(args, Previewer)
    except (LookupError, OSError, RuntimeError) as exc:
        print(f"error: cannot draw previews: {exc}", file=sys.stderr)
        return 1


def _preview(args: argparse.Namespace, previewer: type) -> int:
    with _prometheus(args) as (api, start, end):
        window = Window(start, end, step=max(15.0, round((end - start) / PREVIEW_POINTS / 15) * 15))
        node, gpu = riskiest_gpu(api, window)
        log.info("preview window_start=%d window_end=%d node=%s gpu=%s", start, end, node, gpu)
        for name, text in render().items():
            model = json.loads(text)
            path = args.out / name.replace(".json", ".png")
            previewer(api, window, variable_values(model, node, gpu)).render(model, path)
            print(path)
    return 0
