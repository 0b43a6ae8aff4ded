"""The exporter's metric table matches docs/contract.md, and every golden file passes promtool."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from exporter_helpers import GOLDEN, promtool_check
from gpuhealth.exporter.metrics import SPECS

CONTRACT = Path(__file__).parents[2] / "docs" / "contract.md"


def contract_metrics() -> dict[str, tuple[str, ...]]:
    """metric -> label names, from the exporter section of the contract."""
    text = CONTRACT.read_text()
    section = text[text.index("## Exporter metrics"):text.index("## Rules")]
    found: dict[str, tuple[str, ...]] = {}
    for name, labels in re.findall(r"`(gpuhealth_[a-z0-9_]+)(?:\{([a-z_,]+)\})?`", section):
        found[name] = tuple(labels.split(",")) if labels else ()
    return found


def test_every_contract_metric_is_published_with_its_labels() -> None:
    contract = contract_metrics()
    assert len(contract) > 50
    for name, labels in contract.items():
        assert name in SPECS, f"{name} is in docs/contract.md but the exporter does not publish it"
        if labels:
            assert set(SPECS[name].labels) == set(labels), name


def test_exporter_publishes_nothing_outside_the_contract() -> None:
    assert set(SPECS) - set(contract_metrics()) == set()


def test_help_texts_are_sentences() -> None:
    for name, spec in SPECS.items():
        assert (spec.help[0].isupper() or spec.help[0].isdigit()) and spec.help.endswith("."), name
        assert spec.kind == ("counter" if name.endswith("_total") else "gauge"), name


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.prom")), ids=lambda p: p.name)
def test_golden_file_passes_promtool(path: Path) -> None:
    promtool_check(path.read_text())
