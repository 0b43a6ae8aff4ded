"""Each third-party import is declared where it is used (pyproject.toml), and nothing more:
the daemons install only what they import; the tool's extras (``tools``) and the development set
(``dev``) carry the rest; a daemon's optional feature (the webhook's ``postgres``) has its own extra."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib

import pytest
from layout_imports import ROOT, imports

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DEPLOYABLE = ("exporter", "webhook", "rules", "dashboards")


def _name(requirement: str) -> str:
    """A requirement's project name, normalised as PEP 503 does."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement)[0]).lower()


CORE = {_name(r) for r in PROJECT["dependencies"]}
TOOLS = {_name(r) for r in PROJECT["optional-dependencies"]["tools"]}
DEV = {_name(r) for r in PROJECT["optional-dependencies"]["dev"]}
POSTGRES = {_name(r) for r in PROJECT["optional-dependencies"]["postgres"]}
# A daemon's own extras: what one optional feature needs, imported only when it is configured.
EXTRAS = {"webhook": POSTGRES}
DISTRIBUTIONS = importlib.metadata.packages_distributions()


def third_party(folder: str) -> dict[str, str]:
    """Project name -> one place that imports it, for every import outside the stdlib and the repo."""
    out: dict[str, str] = {}
    beside = {p.stem for p in (ROOT / folder).glob("*.py")}  # a script's own siblings, on its path
    for found in imports(folder):
        top = found.module.split(".")[0]
        if top in sys.stdlib_module_names or top in {"__future__", "gpuhealth", ""} or top in beside:
            continue
        for dist in DISTRIBUTIONS.get(top, [top]):
            out.setdefault(_name(dist), str(found))
    return out


@pytest.mark.parametrize("component", DEPLOYABLE)
def test_a_daemon_imports_only_core_dependencies(component):
    allowed = CORE | EXTRAS.get(component, set())
    assert {n: where for n, where in third_party(component).items() if n not in allowed} == {}


def test_the_tool_imports_only_core_and_tools_dependencies():
    assert {n: where for n, where in third_party("gpuhealth").items() if n not in CORE | TOOLS} == {}


def test_benchmarks_import_only_declared_dependencies():
    declared = CORE | TOOLS | DEV | POSTGRES
    assert {n: where for n, where in third_party("bench").items() if n not in declared} == {}


def test_every_core_dependency_is_imported_by_a_daemon():
    used = {name for component in DEPLOYABLE for name in third_party(component)}
    assert CORE - used == set()


def test_every_tools_dependency_is_imported_by_the_tool():
    assert TOOLS - set(third_party("gpuhealth")) == set()


def test_dev_installs_the_tools():
    assert "gpuhealth" in DEV, "dev should include gpuhealth[tools]"
    dev = PROJECT["optional-dependencies"]["dev"]
    assert any(r.replace(" ", "").startswith("gpuhealth[tools") for r in dev)
