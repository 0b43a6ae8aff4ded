"""Each role's meta/argument_specs.yml documents exactly its defaults/main.yml, with the same values,
and documents every variable its shared templates read (the contract for plain-jinja2 renderers)."""

from __future__ import annotations

from pathlib import Path

import jinja2
import jinja2.meta
import pytest
import yaml
from conftest import COLLECTION

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
                                       "gpuhealth_prometheus"}


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
