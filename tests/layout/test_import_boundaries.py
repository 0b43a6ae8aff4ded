"""What deploys imports only itself and the shared contract: never another component, the tool, the
benchmark or the development helpers (docs/contract.md: components share Prometheus data, not code)."""

from __future__ import annotations

import pytest
from layout_imports import ROOT, Import, imports

DEPLOYABLE = ("exporter", "webhook", "rules", "dashboards")
SHARED = "gpuhealth.contract"
# Top-level names that exist only as folders of this repository (or the tool's own packages).
REPOSITORY_NAMES = {"bench", "tests", "scripts", *DEPLOYABLE, "contract", "gpuhealth"}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(component: str, found: list[Import]) -> list[str]:
    own = f"gpuhealth.{component}"
    return [str(i) for i in found if i.module.split(".")[0] in REPOSITORY_NAMES
            and not (_within(i.module, own) or _within(i.module, SHARED))]


# The shared contract package, once there, depends on no component either.
@pytest.mark.parametrize("component", [c for c in (*DEPLOYABLE, "contract") if (ROOT / c).is_dir()])
def test_deployable_component_imports_only_itself_and_the_contract(component):
    found = list(imports(component))
    assert found, f"no imports found under {component}/"
    assert violations(component, found) == []


@pytest.mark.parametrize(("module", "bad"), [
    ("gpuhealth.evaluation.fleet", True),
    ("gpuhealth.local.process", True),
    ("gpuhealth.demo", True),
    ("gpuhealth.previews.draw", True),
    ("gpuhealth", True),
    ("gpuhealth.webhook.journal", True),
    ("bench", True),
    ("exporter.config", True),
    ("gpuhealth.contract", False),
    ("gpuhealth.contract.actions", False),
    ("gpuhealth.rules.catalogue", False),
    ("gpuhealth.rulesx", True),
    ("yaml", False),
])
def test_the_check_tells_allowed_from_forbidden(module, bad):
    found = [Import(ROOT / "rules" / "render.py", 1, module)]
    assert bool(violations("rules", found)) is bad


def test_relative_imports_resolve_to_the_installed_package():
    found = {i.module for i in imports("webhook") if "backends" in str(i.path)}
    assert "gpuhealth.webhook.labels" in found
    assert "gpuhealth.webhook.backends.base" in found
