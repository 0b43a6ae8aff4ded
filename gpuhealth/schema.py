"""``gpuhealth schema``: the JSON Schema of each file gpuhealth reads, for editors and Ansible.

Each schema comes from the model that validates the file, so it cannot drift from what the service
accepts; docs/schema/ holds the committed copies, which ``--check`` (and a test) keeps current.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("docs/schema")
DIALECT = "https://json-schema.org/draft/2020-12/schema"
# name -> (module, attribute): a pydantic model, or (a function returning) a JSON Schema mapping where a
# plain dict is the output.
SCHEMAS = {
    "alertmanager-payload": ("gpuhealth.webhook.models", "NotificationPayload"),
    "exporter-config": ("gpuhealth.exporter.config", "ExporterFile"),
    "webhook-config": ("gpuhealth.webhook.config", "Config"),
    "webhook-backend-slurm": ("gpuhealth.webhook.backends.slurm", "SlurmSettings"),
    "webhook-backend-simulated": ("gpuhealth.webhook.backends.simulated", "SimulatedSettings"),
    "webhook-backend-command": ("gpuhealth.webhook.backends.command", "CommandSettings"),
    "webhook-backend-kubernetes": ("gpuhealth.webhook.backends.kubernetes", "KubernetesSettings"),
    "evaluation-scenario": ("gpuhealth.evaluation.scenario", "ScenarioFile"),
    "exporter-sim-scenario": ("gpuhealth.exporter.sim.scenario", "ScenarioFile"),
    "rule-catalogue": ("gpuhealth.rules.catalogue", "schema"),
}


def schema(name: str) -> dict[str, Any]:
    module, attribute = SCHEMAS[name]
    source = getattr(importlib.import_module(module), attribute)
    if callable(source) and not isinstance(source, type):  # builds the schema of a plain mapping
        source = source()
    document = dict(source) if isinstance(source, dict) else source.model_json_schema()
    return {"$schema": DIALECT, "$id": f"{name}.json", **document}


def render(name: str) -> str:
    return json.dumps(schema(name), indent=2, sort_keys=True) + "\n"


def _run(args: argparse.Namespace) -> int:
    if args.name is not None:
        sys.stdout.write(render(args.name))
        return 0
    stale = []
    for name in SCHEMAS:
        path = args.out / f"{name}.json"
        text = render(name)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{path}: out of date; run 'gpuhealth schema --out {args.out}'", file=sys.stderr)
    return 1 if stale else 0


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "schema", help="print or write the JSON Schema of a configuration or input file",
        description="JSON Schema of each file gpuhealth reads, from the models that validate it. With a "
                    "NAME, print that schema; without, write every schema to --out (or --check that they "
                    "are current). Point an editor at one with '# yaml-language-server: $schema=PATH'.")
    parser.add_argument("name", nargs="?", choices=sorted(SCHEMAS), help="the schema to print")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                        help=f"where the schemas are written (default {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each schema file that is missing or out of date")
    parser.set_defaults(func=_run)
