"""The exporter's metric table matches docs/contract.md, its collectors and its simulator's faults
match the shared vocabulary (gpuhealth.contract), and every golden file passes promtool."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from exporter_helpers import GOLDEN, promtool_check
from gpuhealth.contract.faults import (
    FABRIC_KINDS,
    FALLS_OFF_BUS_KINDS,
    FAULT_KINDS,
    FAULT_XIDS,
    NODE_NOISE_KINDS,
    RECOVERY_ACTION_KINDS,
    RECOVERY_ACTION_XID,
)
from gpuhealth.contract.metrics import CLOCK_EVENT_REASONS, COLLECTORS
from gpuhealth.exporter import nvml_reader
from gpuhealth.exporter.collector import load_collectors
from gpuhealth.exporter.metrics import SPECS
from gpuhealth.exporter.sim.fabric import FabricRun
from gpuhealth.exporter.sim.gpu import FaultRun, Node
from gpuhealth.exporter.sim.scenario import NOISE_KINDS, parse_scenario

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


def test_the_shared_collector_names_are_the_exporters_collectors() -> None:
    assert tuple(load_collectors()) == COLLECTORS


def test_the_shared_clock_event_reasons_are_the_ones_the_exporter_reads() -> None:
    assert tuple(nvml_reader.CLOCK_EVENT_REASONS) == CLOCK_EVENT_REASONS


GPU_FAULT_KINDS = tuple(kind for kind in FAULT_KINDS if kind not in FABRIC_KINDS)


def test_the_simulator_implements_every_fault_and_node_noise_kind() -> None:
    assert set(NODE_NOISE_KINDS) <= set(NOISE_KINDS)
    for kind in (*FAULT_KINDS, *NOISE_KINDS):
        run = FabricRun if kind in FABRIC_KINDS else FaultRun
        assert callable(getattr(run, f"_{kind}", None)), kind
    for kind in FAULT_KINDS:
        run = FabricRun if kind in FABRIC_KINDS else FaultRun
        assert callable(getattr(run, f"_fail_{kind}", None)), kind


def _logged(kind: str) -> tuple[set[int], bool]:
    """XIDs the simulator logs for one fault run to its hard failure, and whether the GPU is lost."""
    xids: set[int] = set()

    def emit(gpu: int, text: str, event: int | None) -> None:
        if found := re.search(r"Xid \([^)]*\): (\d+),", text):
            xids.add(int(found[1]))

    node = Node(parse_scenario({"gpus": 1, "faults": [{"kind": kind, "gpu": 0, "start": 1}]}), emit)
    for t in (0.0, 1.0, 200.0, 400.0):
        node.advance(t)
    return xids, node.gpus[0].lost


@pytest.mark.parametrize("kind", GPU_FAULT_KINDS)
def test_the_simulators_faults_log_the_shared_xids(kind: str) -> None:
    xids, lost = _logged(kind)
    wear = {63} if kind == "hbm_degradation" else set()  # rows remapped while HBM wears out
    recovery = {RECOVERY_ACTION_XID} if kind in RECOVERY_ACTION_KINDS else set()
    assert xids - wear - recovery <= set(FAULT_XIDS[kind]) and xids & set(FAULT_XIDS[kind])
    assert (RECOVERY_ACTION_XID in xids) == (kind in RECOVERY_ACTION_KINDS)
    assert lost == (kind in FALLS_OFF_BUS_KINDS)
