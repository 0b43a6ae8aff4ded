"""The ``gpuhealth`` command: one entry point for the project's tools.

Each subcommand lives with the code it drives and exposes ``register(subparsers)``, which adds its
parser and sets ``func(args) -> int``. Subcommand modules are imported only when needed for help or
dispatch, so a broken optional tool never blocks the others.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = {
    "rules": "gpuhealth.rules.cli",
    "dashboards": "gpuhealth.dashboards.cli",
    "eval": "gpuhealth.evaluation.cli",
    "demo": "gpuhealth.demo",
    "schema": "gpuhealth.schema",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuhealth",
        description="GPU fleet health tools: generate rules and dashboards, evaluate detection "
                    "quality, run the closed-loop demo.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=f"see 'gpuhealth {name} --help'")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in SUBCOMMANDS), None)
    args = build_parser(only=command).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
