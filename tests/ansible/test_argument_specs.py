"""Each role's meta/argument_specs.yml documents exactly its defaults/main.yml, with the same values,
and documents every variable its shared templates read (the contract for plain-jinja2 renderers)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import jinja2.meta
import jsonschema
import pytest
import yaml
from ansible_helpers import COLLECTION
from rendering import render
from wheelhouse import ROOT

ROLES = sorted(p for p in (COLLECTION / "roles").iterdir() if (p / "meta" / "argument_specs.yml").exists())
SHARED_TEMPLATES = {
    "gpuhealth_exporter": ["exporter.yml.j2"],
    "gpuhealth_webhook": ["webhook.yml.j2"],
    "gpuhealth_prometheus": ["gpuhealth-exporters.yml.j2", "gpuhealth-scrape-configs.yml.j2",
                             "prometheus.yml.j2", "alertmanager.yml.j2"],
}


def load(path: Path):
    return yaml.safe_load(path.read_text())


def entry_points(role: Path) -> dict[str, dict]:
    return load(role / "meta" / "argument_specs.yml")["argument_specs"]


def test_every_role_has_argument_specs():
    assert {r.name for r in ROLES} == {"gpuhealth_common", "gpuhealth_exporter", "gpuhealth_webhook",
                                       "gpuhealth_prometheus", "gpuhealth_global"}


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.name)
def test_argument_specs_match_defaults(role: Path):
    defaults = load(role / "defaults" / "main.yml") or {}
    options: dict[str, dict] = {}
    for spec in entry_points(role).values():
        options.update(spec["options"])
    optional = {name for name, spec in options.items() if not spec.get("required")}
    assert set(defaults) == optional, "defaults/main.yml and meta/argument_specs.yml list different variables"
    for name in optional:
        assert options[name].get("default") == defaults[name], f"{name}: default differs"
        assert options[name].get("description"), f"{name}: no description"
    assert all(name.startswith(role.name + "_") for name in options), "variables must carry the role's prefix"


@pytest.mark.parametrize("role", sorted(SHARED_TEMPLATES))
def test_shared_templates_read_only_documented_variables(role: str):
    options = entry_points(COLLECTION / "roles" / role)["main"]["options"]
    env = jinja2.Environment()
    for name in SHARED_TEMPLATES[role]:
        source = (COLLECTION / "roles" / role / "templates" / name).read_text()
        used = jinja2.meta.find_undeclared_variables(env.parse(source)) - {"gpuhealth_managed_header"}
        assert used <= set(options), f"{name} reads undocumented variables {sorted(used - set(options))}"


def test_example_inventory_sets_only_documented_variables():
    example = COLLECTION / "inventory" / "example"
    documented = {name for role in ROLES for spec in entry_points(role).values() for name in spec["options"]}
    set_here: dict[str, str] = {}
    for path in sorted((example / "group_vars").glob("*.yml")):
        set_here.update(dict.fromkeys(load(path), path.name))

    def host_vars(node: dict) -> None:
        for host in (node.get("hosts") or {}).values():
            set_here.update(dict.fromkeys(host or {}, "hosts.yml"))
        for child in (node.get("children") or {}).values():
            host_vars(child)

    inventory = load(example / "hosts.yml")
    host_vars(inventory["all"])
    roles = tuple(f"{role.name}_" for role in ROLES)
    unknown = {name: where for name, where in set_here.items()
               if name.startswith(roles) and name not in documented}
    assert not unknown, f"undocumented role variables (typos?): {unknown}"

    plays = load(COLLECTION / "playbooks" / "site.yml")
    assert {play["hosts"] for play in plays} == set(inventory["all"]["children"])


SCHEMA_REFERENCE = re.compile(r"Schema: C\(properties(?:\.(\w+))?\) of docs/schema/([\w-]+\.json)")


def schema_references(role: Path) -> list[tuple[str, str, str]]:
    """(variable, schema file, property) for each variable whose description names its JSON Schema; the
    property is empty for a variable that holds top-level keys of the file."""
    found = []
    for spec in entry_points(role).values():
        for name, option in spec["options"].items():
            description = option.get("description", "")
            text = " ".join(description) if isinstance(description, list) else description
            found += [(name, file, prop) for prop, file in SCHEMA_REFERENCE.findall(text)]
    return found


def test_webhook_sections_name_the_schema_that_validates_them():
    named = {name for name, _, _ in schema_references(COLLECTION / "roles" / "gpuhealth_webhook")}
    assert named == {f"gpuhealth_webhook_{section}"
                     for section in ("backend", "policy", "guardrails", "retry", "undrain",
                                     "checkpoint", "announce")}


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.name)
def test_schema_references_name_a_committed_schema_and_property(role: Path):
    for name, file, prop in schema_references(role):
        path = ROOT / "docs" / "schema" / file
        assert path.is_file(), f"{name}: {file} is not in docs/schema"
        properties = json.loads(path.read_text())["properties"]
        assert not prop or prop in properties, f"{name}: {file} has no property {prop}"


def test_exporter_settings_name_the_schema_that_validates_them():
    references = schema_references(COLLECTION / "roles" / "gpuhealth_exporter")
    assert references == [("gpuhealth_exporter_settings", "exporter-config.json", "")]


def test_the_rendered_exporter_config_validates_against_its_schema(tmp_path: Path):
    schema = json.loads((ROOT / "docs" / "schema" / "exporter-config.json").read_text())
    variables = {"gpuhealth_exporter_root_prefix": str(tmp_path), "gpuhealth_exporter_gpus_expected": 8,
                 "gpuhealth_exporter_kmsg_path": "/var/log/kern.log",
                 "gpuhealth_exporter_settings": {"sampling_window": 30, "collectors": {"nfs": False}}}
    config = yaml.safe_load(render("gpuhealth_exporter", "exporter.yml.j2", variables))
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(config)) == []
    config["sampling_window"] = "30"
    assert not jsonschema.Draft202012Validator(schema).is_valid(config)


def test_the_rendered_webhook_config_validates_against_its_schema(tmp_path: Path):
    schema = json.loads((ROOT / "docs" / "schema" / "webhook-config.json").read_text())
    variables = {"gpuhealth_webhook_root_prefix": str(tmp_path), "gpuhealth_webhook_dry_run": True,
                 "gpuhealth_webhook_guardrails": {"breaker_max_nodes": 1, "deny_nodes": ["login*"]},
                 "gpuhealth_webhook_policy": {"rules": [{"match": {"alertname": "GPUHealth.*"},
                                                         "action": "drain"}]},
                 "gpuhealth_webhook_operator_token": "operator-0123456789"}
    config = yaml.safe_load(render("gpuhealth_webhook", "webhook.yml.j2", variables))
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(config)) == []
    config["guardrails"]["breaker_max_nodes"] = -1
    assert not jsonschema.Draft202012Validator(schema).is_valid(config)
