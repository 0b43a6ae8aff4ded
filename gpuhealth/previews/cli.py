"""``gpuhealth dashboards``: the dashboards' own ``generate`` plus ``preview``, which draws their PNGs.

``preview`` joins the deployable package's command here rather than in ``dashboards/cli.py``, so the
dashboards package never imports the simulated fleet or the local daemons it needs.
"""

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

import gpuhealth.dashboards
from gpuhealth.dashboards import cli as dashboards_cli
from gpuhealth.dashboards.generate import render
from gpuhealth.dashboards.queries import Window, panel_queries, riskiest_gpu, variable_values
from gpuhealth.dashboards.remediation import UID as REMEDIATION_UID
from gpuhealth.local.prometheus import PrometheusAPI
from gpuhealth.previews.fleet_sample import RULES_DIR, backfilled_fleet
from gpuhealth.previews.webhook_sample import SCRAPE_SECONDS, webhook_session

log = logging.getLogger(__name__)

PREVIEW_DIR = Path(gpuhealth.dashboards.__file__).resolve().parent / "previews"
# Grafana asks for about one point per pixel column; a preview panel is a few hundred pixels wide.
PREVIEW_POINTS = 240


def register(subparsers: argparse._SubParsersAction) -> None:
    sub = dashboards_cli.register(subparsers)
    preview = sub.add_parser(
        "preview", help="draw PNG previews of the dashboards from a Prometheus",
        description="Run every panel's query against a Prometheus and draw each dashboard to a PNG, "
                    "laid out as Grafana lays it out. The drill-down shows the riskiest GPU.")
    source = preview.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", type=Path,
                        help="fleet scenario YAML (e.g. bench/scenarios/small.yaml): simulate it, backfill a "
                             "local Prometheus with it and the rules, and preview that; the remediation "
                             "dashboard is drawn from gpuhealth-webhook acting on a simulated cluster")
    source.add_argument("--url", help="a running Prometheus that already has gpuhealth data")
    preview.add_argument("--since", type=float, default=6.0,
                         help="with --url: hours before now to show (default: 6)")
    preview.add_argument("--seed", type=int, help="with --scenario: random seed of the simulated fleet")
    preview.add_argument("--rules", type=Path, default=RULES_DIR,
                         help="with --scenario: folder of Prometheus rule files whose recording rules are "
                              "backfilled (default: the generated gpuhealth rules)")
    preview.add_argument("--out", type=Path, default=PREVIEW_DIR,
                         help="output folder (default: the package's previews/ folder, shown in its README)")
    preview.set_defaults(func=run_preview)


@contextlib.contextmanager
def _prometheus(args: argparse.Namespace) -> Iterator[tuple[PrometheusAPI, float, float]]:
    """The Prometheus to draw from and the window it holds data for."""
    if args.url:
        end = time.time()
        yield PrometheusAPI(args.url), end - args.since * 3600, end
        return
    with tempfile.TemporaryDirectory(prefix="gpuhealth-preview-") as workdir, \
            backfilled_fleet(args.scenario, Path(workdir), _all_queries(), rules_dir=args.rules,
                             seed=args.seed) as fleet:
        yield fleet.server.api, fleet.start, fleet.end


def run_preview(args: argparse.Namespace) -> int:
    from gpuhealth.previews.draw import Previewer  # matplotlib is a development dependency

    if args.scenario and not args.scenario.is_file():
        print(f"{args.scenario}: no such scenario file", file=sys.stderr)
        return 2
    try:
        return _preview(args, Previewer)
    except (LookupError, OSError, RuntimeError, ValueError) as exc:
        print(f"error: cannot draw previews: {exc}", file=sys.stderr)
        return 1


def _draw(previewer: type, api: PrometheusAPI, window: Window, models: dict[str, dict], out: Path,
          ) -> None:
    node, gpu = riskiest_gpu(api, window) if any("gpu" in _pickers(m) for m in models.values()) else ("", "")
    log.info("preview window_start=%d window_end=%d node=%s gpu=%s", window.start, window.end, node, gpu)
    for name, model in models.items():
        path = out / name.replace(".json", ".png")
        previewer(api, window, variable_values(model, node, gpu)).render(model, path)
        print(path)


def _all_queries() -> list[str]:
    return [q.expr for text in render().values() for q in panel_queries(json.loads(text))]


def _pickers(model: dict) -> set[str]:
    return {v["name"] for v in model["templating"]["list"]}


def _window(start: float, end: float, scrape_interval: float) -> Window:
    step = max(scrape_interval, round((end - start) / PREVIEW_POINTS / scrape_interval) * scrape_interval)
    return Window(start, end, step=step, scrape_interval=scrape_interval)


def _preview(args: argparse.Namespace, previewer: type) -> int:
    models = {name: json.loads(text) for name, text in render().items()}
    remediation = {name: m for name, m in models.items() if m["uid"] == REMEDIATION_UID}
    with _prometheus(args) as (api, start, end):
        fleet = models if args.url else {n: m for n, m in models.items() if n not in remediation}
        _draw(previewer, api, _window(start, end, 15.0), fleet, args.out)
    if args.scenario:
        with tempfile.TemporaryDirectory(prefix="gpuhealth-preview-webhook-") as workdir, \
                webhook_session(Path(workdir)) as session:
            _draw(previewer, session.server.api, _window(session.start, session.end, SCRAPE_SECONDS),
                  remediation, args.out)
    return 0
