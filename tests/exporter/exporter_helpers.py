"""Helpers for the exporter tests: a controllable clock, simulated contexts, golden files, promtool."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from gpuhealth.exporter.collector import GPU_IDENTITIES, Context, load_collectors
from gpuhealth.exporter.inventory_step import InventoryStep
from gpuhealth.exporter.metrics import render
from gpuhealth.exporter.sim.nvml import SimulatedNvml
from gpuhealth.exporter.sim.scenario import parse_scenario
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).parent
PROCFS = HERE / "fixtures" / "procfs"
GOLDEN = HERE / "golden"
REGEN = os.environ.get("GPUHEALTH_REGEN_GOLDEN") == "1"


class FakeClock:
    """Time that moves only when a test says so: NVML latency reads 0, windows are exact."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def sim_context(scenario: dict, clock: FakeClock, kmsg_path: Path | None = None, profile=None,
                **kwargs) -> Context:
    """A Context on a simulated node driven by ``clock``, NVML initialised.

    The NVML deadline defaults to 10 s, not the exporter's 2 s: a healthy simulated GPU must never miss it
    on a loaded test machine. Tests about deadlines pass their own.
    """
    kwargs.setdefault("nvml_timeout_seconds", 10.0)
    nvml = SimulatedNvml(parse_scenario(scenario), kmsg_path, clock=clock, profile=profile)
    nvml.nvmlInit()
    ctx = Context(nvml=nvml, procfs=PROCFS, kmsg_path=kmsg_path, clock=clock, **kwargs)
    ctx.inventory.driver_version = nvml.nvmlSystemGetDriverVersion()
    return ctx


class AfterInventory:
    """A collector run as the sampler runs it: the inventory step first, at every collect()."""

    def __init__(self, collector, step: InventoryStep) -> None:
        self.collector, self.step = collector, step

    def collect(self):
        self.step.run()
        yield from self.collector.collect()

    def __getattr__(self, name: str):
        return getattr(self.collector, name)


def make_collector(name: str, ctx: Context):
    registration = load_collectors()[name]
    collector = registration.factory(ctx)
    if ctx.nvml is None or GPU_IDENTITIES not in registration.needs:
        return collector
    return AfterInventory(collector, InventoryStep(ctx))


def assert_golden(name: str, text: str) -> None:
    """Compare with ``golden/<name>.prom``; GPUHEALTH_REGEN_GOLDEN=1 rewrites it instead."""
    path = GOLDEN / f"{name}.prom"
    if REGEN:
        path.write_text(text)
        return
    assert path.exists(), f"{path} missing: run with GPUHEALTH_REGEN_GOLDEN=1 to create it"
    assert text == path.read_text(), f"exposition differs from {path} (GPUHEALTH_REGEN_GOLDEN=1 updates it)"


def promtool_check(text: str) -> None:
    """``promtool check metrics`` must accept the exposition without a single lint problem."""
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr


def scrape(collector) -> str:
    return render(collector.collect()).decode()


def samples(text: str, name: str) -> dict[tuple, float]:
    """{sorted label items: value} for one metric name (counters by their _total sample name)."""
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text, name).get(tuple(sorted(labels.items())))
