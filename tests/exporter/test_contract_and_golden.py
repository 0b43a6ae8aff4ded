"""The exporter's metric table matches docs/contract.md, and every golden file passes promtool."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from exporter_helpers import GOLDEN, promtool_check
from gpuhealth.exporter.metrics import SPECS

CONTRACT = Path(__file__).parents[2] / "docs" / "contract.md"


def contract_metrics() -> dict[str, tuple[str, ...]]:
    """metric -> label names, from the metric column of the exporter section's tables (the notes
    column mentions metrics too, without their labels)."""
    text = CONTRACT.read_text()
    section = text[text.index("## Exporter metrics"):text.index("## Rules")]
    found: dict[str, tuple[str, ...]] = {}
    for row in section.splitlines():
        if not row.startswith("| `gpuhealth_"):
            continue
        for name, labels in re.findall(r"`(gpuhealth_[a-z0-9_]+)(?:\{([a-z_,]+)\})?`", row.split("|")[1]):
            assert name not in found, f"{name} is listed twice in docs/contract.md"
            found[name] = tuple(labels.split(",")) if labels else ()
    return found


def test_every_contract_metric_is_published_with_its_labels() -> None:
    contract = contract_metrics()
    assert len(contract) > 50
    assert any(not labels for labels in contract.values())  # node-level metrics are checked too
    for name, labels in contract.items():
        assert name in SPECS, f"{name} is in docs/contract.md but the exporter does not publish it"
        assert set(SPECS[name].labels) == set(labels), (
            f"{name}: the exporter's labels {SPECS[name].labels} differ from the contract's {labels}")


def test_exporter_publishes_nothing_outside_the_contract() -> None:
    assert set(SPECS) - set(contract_metrics()) == set()


def test_help_texts_are_sentences() -> None:
    for name, spec in SPECS.items():
        assert (spec.help[0].isupper() or spec.help[0].isdigit()) and spec.help.endswith("."), name
        assert spec.kind == ("counter" if name.endswith("_total") else "gauge"), name


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.prom")), ids=lambda p: p.name)
def test_golden_file_passes_promtool(path: Path) -> None:
    promtool_check(path.read_text())
