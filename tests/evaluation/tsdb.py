"""Shared helpers: a real Prometheus on a few hand-made series."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuhealth.evaluation.blocks import BlockWriter
from gpuhealth.evaluation.fleet import start_prometheus
from gpuhealth.evaluation.openmetrics import Thinning
from gpuhealth.evaluation.signals import Family
from gpuhealth.evaluation.workload import Timeline
from gpuhealth.local.prometheus import PrometheusServer

START, STEP, COUNT = 1_767_571_200.0, 60.0, 600


@contextmanager
def prometheus_on(
    workdir: Path, families: list[tuple[Family, Thinning]]
) -> Iterator[tuple[PrometheusServer, list[int]]]:
    """Backfill ``families`` (sampled from START every STEP) and serve them; yields the server and
    the samples written per family."""
    writer = BlockWriter(workdir / "data", Timeline(START, STEP, COUNT))
    written = []
    for family, thinning in families:
        before = writer.samples
        writer.write(family, thinning)
        written.append(writer.samples - before)
    writer.close()
    server = start_prometheus(workdir, workdir / "data", STEP)
    try:
        yield server, written
    finally:
        server.stop()
