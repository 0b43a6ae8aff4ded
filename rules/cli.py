"""``gpuhealth rules generate``: render the catalogue into rule files, or check the committed ones."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gpuhealth.rules.catalogue import TIERS, CatalogueError, load
from gpuhealth.rules.render import SOURCES, render_all

log = logging.getLogger(__name__)

RULES_DIR = Path(__file__).parent
DEFAULT_OUT = RULES_DIR / "generated"
DEFAULT_ALERTMANAGER = RULES_DIR / "alertmanager.yml"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rules", help="generate Prometheus rules and Alertmanager routing from the rule catalogue",
        description="Prometheus rules for GPU failure prediction, generated from rules/catalogue.yaml.")
    sub = parser.add_subparsers(dest="rules_command", metavar="COMMAND", required=True)
    gen = sub.add_parser(
        "generate", help="render rule files (or check that the committed ones are current)",
        description="Validate the catalogue (listing every error), render <out>/<source>/<group>.yml for "
                    "each source, plus the Alertmanager config. Without --out, rule files go to "
                    f"{DEFAULT_OUT} and the Alertmanager config to {DEFAULT_ALERTMANAGER}; with --out "
                    "DIR, both go under DIR.")
    gen.add_argument("--catalogue", type=Path, metavar="FILE",
                     help="partial catalogue merged over the built-in one (e.g. short windows for a demo)")
    gen.add_argument("--source", choices=SOURCES, action="append",
                     help="input metrics: gpuhealth-exporter's (gpuhealth) or dcgm-exporter + node_exporter "
                          "(dcgm); repeatable; default both")
    gen.add_argument("--tier", choices=TIERS, default="single",
                     help="which rule files: every one (single: one Prometheus; the default), those that "
                          "read one node's raw series (shard: each Prometheus shard) or those that need the "
                          "whole fleet (global: vmalert over what the shards remote-write); shard and global "
                          "need --out")
    gen.add_argument("--out", type=Path, metavar="DIR", help=f"output directory (default {DEFAULT_OUT})")
    gen.add_argument("--check", action="store_true",
                     help="write nothing; exit 1 when the files on disk differ from a fresh render (CI)")
    gen.set_defaults(func=generate)


def _targets(out: Path | None, files: dict[str, str]) -> dict[Path, str]:
    """Where each rendered file goes: all under ``out``, or the repository's default places."""
    if out is not None:
        return {out / name: text for name, text in files.items()}
    return {(DEFAULT_ALERTMANAGER if name == "alertmanager.yml" else DEFAULT_OUT / name): text
            for name, text in files.items()}


def generate(args: argparse.Namespace) -> int:
    sources = tuple(sorted(set(args.source), key=SOURCES.index)) if args.source else SOURCES
    if args.tier != "single" and args.out is None:
        print(f"--tier {args.tier} needs --out DIR: {DEFAULT_OUT} holds the single-tier files",
              file=sys.stderr)
        return 2
    try:
        files = render_all(load(args.catalogue), sources, args.tier)
    except CatalogueError as exc:
        print(f"catalogue has {len(exc.errors)} error(s):", file=sys.stderr)
        for error in exc.errors:
            print(f"  {error}", file=sys.stderr)
        return 2
    targets = _targets(args.out, files)
    stale = {path.parent for path in targets if path.suffix == ".yml" and path.parent.name in sources}
    extra = sorted(p for d in stale if d.is_dir() for p in d.glob("*.yml") if p not in targets)
    if args.check:
        changed = [p for p, text in targets.items() if not p.is_file() or p.read_text() != text]
        for path in changed + extra:
            print(f"stale: {path}", file=sys.stderr)
        if changed or extra:
            print("run 'gpuhealth rules generate' and commit the result", file=sys.stderr)
            return 1
        log.info("event=rules_current files=%d", len(targets))
        return 0
    for path, text in sorted(targets.items()):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for path in extra:
        path.unlink()
    log.info("event=rules_generated files=%d removed=%d sources=%s tier=%s",
             len(targets), len(extra), ",".join(sources), args.tier)
    return 0
