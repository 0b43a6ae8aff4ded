"""The ``gpuhealth`` command: one entry point for the project's tools.

Each subcommand lives with the code it drives and exposes ``register(subparsers)``, which adds its
parser and sets ``func(args) -> int``. Subcommand modules are imported only when needed for help or
dispatch, so a broken optional tool never blocks the others. A subcommand whose optional
dependencies (the ``tools`` extra) are not installed still shows in the help, and says what to install.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

SUBCOMMANDS = {
    "rules": "gpuhealth.rules.cli",
    "dashboards": "gpuhealth.previews.cli",
    "eval": "gpuhealth.evaluation.cli",
    "demo": "gpuhealth.demo",
}
# Modules of the ``tools`` extra (pyproject.toml): the daemons' installs leave them out.
TOOLS_EXTRA = ("numpy", "psutil", "matplotlib")


def _load(name: str) -> ModuleType | str:
    """The subcommand's module, or why it cannot run here (a missing optional dependency)."""
    try:
        return importlib.import_module(SUBCOMMANDS[name])
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in TOOLS_EXTRA:
            raise
        return f"'gpuhealth {name}' needs {exc.name}: pip install 'gpuhealth[tools]'"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuhealth",
        description="GPU fleet health tools: generate rules and dashboards, evaluate detection "
                    "quality, run the closed-loop demo.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        if only is None or name == only:
            loaded = _load(name)
            if isinstance(loaded, str):
                sub.add_parser(name, help=f"unavailable: {loaded}")
            else:
                loaded.register(sub)
        else:
            sub.add_parser(name, help=f"see 'gpuhealth {name} --help'")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in SUBCOMMANDS), None)
    loaded = _load(command) if command else None
    if isinstance(loaded, str):
        print(f"error: {loaded}", file=sys.stderr)
        return 2
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
