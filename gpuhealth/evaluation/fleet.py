"""A real Prometheus holding a simulated fleet's history, written as TSDB blocks (``blocks``).

``backfilled_prometheus`` is the entry point for anything that needs realistic fleet data in a real
Prometheus (the benchmark, dashboard previews and tests). Prometheus 2.42 only loads blocks present
in its data directory at start-up, so every backfill happens before a (re)start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuhealth.evaluation.blocks import BlockWriter
from gpuhealth.evaluation.expand import Expander
from gpuhealth.evaluation.openmetrics import Thinning
from gpuhealth.evaluation.progress import Progress
from gpuhealth.evaluation.ranges import PARALLEL, Matrix, QueryPool, grid, label_text
from gpuhealth.evaluation.rulefiles import RuleSet, load_rules, selectors, subqueries
from gpuhealth.evaluation.scenario import Scenario, load_scenario
from gpuhealth.evaluation.selection import Selection
from gpuhealth.evaluation.signals import Family, FleetSignals
from gpuhealth.evaluation.workload import Timeline
from gpuhealth.local.process import ProcessError
from gpuhealth.local.prometheus import PrometheusServer, find_binary

log = logging.getLogger(__name__)

MAX_JOBS = 64
PROMETHEUS_ARGS = [
    "--storage.tsdb.retention.time=100y",  # the data is years old by the wall clock's standards
    "--storage.tsdb.min-block-duration=2h",  # no compaction: it would only compete with the queries
    "--storage.tsdb.max-block-duration=2h",
    "--query.max-samples=1000000000",
    "--query.timeout=30m",
    f"--query.max-concurrency={MAX_JOBS}",  # every query ``gpuhealth eval --jobs`` runs at once, none queued
    "--log.level=warn",
]


class BackfillError(RuntimeError):
    """promtool or Prometheus refused the data; the message carries their output."""


@dataclass
class BackfilledFleet:
    """A started Prometheus with the scenario's series; ``start``/``end`` bound the evaluated period
    (unix seconds), ``data_start`` is where the warm-up history begins."""

    server: PrometheusServer
    blocks: BlockWriter  # writes the blocks it serves; ``add_series`` adds to them
    scenario: Scenario
    signals: FleetSignals
    rules: RuleSet | None
    samples: int

    @property
    def start(self) -> float:
        return self.scenario.start

    @property
    def end(self) -> float:
        return self.scenario.end

    @property
    def data_start(self) -> float:
        return self.scenario.data_start


def run_parallel(
    commands: list[list[str]], label: str, *, progress: bool, workdir: Path, on_done: Any = None
) -> None:
    """Run commands, one per CPU at a time; the first failure stops the rest. Children never outlive
    this call, Ctrl-C included."""
    workers = max(1, os.cpu_count() or 1)
    pending = list(enumerate(commands))
    running: list[tuple[int, subprocess.Popen[bytes], Path]] = []
    try:
        with Progress(label, len(commands), enabled=progress) as bar:
            while pending or running:
                while pending and len(running) < workers:
                    index, argv = pending.pop(0)
                    errors = workdir / f"{label.replace(' ', '-')}-{index}.log"
                    with errors.open("wb") as sink:
                        running.append(
                            (
                                index,
                                subprocess.Popen(
                                    argv, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                                ),
                                errors,
                            )
                        )
                for entry in list(running):
                    index, proc, errors = entry
                    if proc.poll() is None:
                        continue
                    running.remove(entry)
                    if proc.returncode != 0:
                        raise BackfillError(
                            f"{' '.join(commands[index][:4])} ... failed "
                            f"(exit {proc.returncode}):\n{errors.read_text()[-2000:]}"
                        )
                    errors.unlink()
                    if on_done:
                        on_done(index)
                    bar.advance()
                time.sleep(0.02)
    finally:
        for _, proc, _ in running:
            proc.kill()
            proc.wait()


def backfill_series(
    signals: FleetSignals, selection: Selection, data_dir: Path, *, progress: bool
) -> BlockWriter:
    """Write the fleet's series as TSDB blocks in ``data_dir``; return their writer, to add more."""
    families = [name for name in signals.builders if selection.family_wanted(name)]
    with Progress("generating series", len(families), enabled=progress) as bar:
        writer = BlockWriter(data_dir, signals.timeline)
        for family in signals.families(selection.family_wanted):
            selection.write(family, writer)
            bar.advance()
    with Progress("writing block indexes", 1, enabled=progress) as bar:
        paths = writer.close()
        bar.advance()
    log.info("series written samples=%d blocks=%d", writer.samples, len(paths))
    return writer


def promtool_blocks(paths: list[Path], out: Path, label: str, *, progress: bool, workdir: Path) -> None:
    """Turn OpenMetrics files into TSDB blocks in ``out`` with promtool, removing each file once it is
    in: the reference ``blocks.BlockWriter`` is tested against, and a way in for other tools' data."""
    promtool = find_binary("promtool")
    out.mkdir(parents=True, exist_ok=True)
    commands = [
        [promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(p), str(out)] for p in paths
    ]
    run_parallel(commands, label, progress=progress, workdir=workdir, on_done=lambda i: paths[i].unlink())


def add_series(
    server: PrometheusServer,
    blocks: BlockWriter,
    batches: list[tuple[list[Family], np.ndarray]],
    label: str,
    *,
    progress: bool,
) -> None:
    """Add series to a running Prometheus, each batch's families sampled at its ``times``: stop it,
    write them into the blocks it serves (``blocks`` wrote them), and start it again. New blocks
    beside the old would overlap them, and Prometheus would merge every pair, competing with the
    queries for the CPU."""
    server.stop()
    with Progress(label, len(batches) + 1, enabled=progress) as bar:
        for families, times in batches:
            step = float(times[1] - times[0]) if times.size > 1 else 60.0
            for family in families:
                blocks.write(family, Thinning(0, 0), Timeline(float(times[0]), step, times.size))
            bar.advance()
        blocks.close()
        bar.advance()
    server.start(timeout=300)


def _recorded(
    pool: QueryPool,
    expander: Expander,
    names: list[tuple[str, np.ndarray]],
    *,
    progress: bool,
) -> list[Family]:
    """What each recording rule records at its instants (``names``: name and a regular grid), by its
    expanded expression; the queries run ``pool.jobs`` at a time, the results taken in order."""

    def asked(item: tuple[str, np.ndarray]) -> tuple[str, np.ndarray]:
        name, times = item
        return expander.definition(name, (), _step(times)), times

    families = []
    with Progress("recording rules", len(names), enabled=progress) as bar:
        for (name, times), ahead in pool.ahead(names, asked):
            expr = asked((name, times))[0]  # a record marked broken meanwhile changes the expansion
            try:
                query = ahead if ahead.expr == expr else pool.submit(expr, times)
                matrix = query.result()
            except RuntimeError as exc:  # Prometheus rejects the rule: it would record nothing either
                log.warning("recording rule fails name=%s error=%r", name, str(exc))
                expander.mark_broken(name, str(exc))
                continue
            finally:
                bar.advance()
            log.info(
                "record computed name=%s step=%gs seconds=%.1f",
                name,
                _step(times) or 0,
                query.seconds,
            )
            families.append(Family(name, "gauge", recorded_series(matrix)))
    return families


def recorded_series(matrix: Matrix) -> list[tuple[str, np.ndarray]]:
    """The series a rule records from ``matrix``, its expression's values, by their labels less
    ``__name__`` (the rule names them). A range query can answer one of them under two names: a
    branch that passes a stored record through keeps the record's name (``... or gpuhealth:gpu_set:zero``
    read from the TSDB), the other has none, and at each instant one of them has the value."""
    merged: dict[str, np.ndarray] = {}
    for labels, values in matrix.series.items():
        text = label_text(labels)
        merged[text] = np.where(np.isnan(merged[text]), values, merged[text]) if text in merged else values
    return list(merged.items())


def _step(times: np.ndarray) -> float | None:
    return float(times[1] - times[0]) if times.size > 1 else None


def backfill_records(
    server: PrometheusServer, blocks: BlockWriter, rules: RuleSet, start: float, end: float, *, progress: bool
) -> None:
    """Record every recording rule over [start, end] at the rules' interval. Each recorded name is
    computed from raw series by its expanded expression (see ``expand``), so no rule reads another's
    backfilled output, which would lack the staleness markers rule evaluation writes."""
    expander = Expander(rules)
    every = " or ".join(dict.fromkeys(r.name for r in rules.records))
    names = expander.records_used(every)  # dependencies first
    times = grid(start, end, rules.interval)
    with QueryPool(server.api) as pool:
        families = _recorded(pool, expander, [(name, times) for name in names], progress=progress)
    add_series(server, blocks, [(families, times)], "backfilling records", progress=progress)


def record_levels(expander: Expander, names: list[str]) -> list[list[str]]:
    """``names`` (dependencies first) in levels: each reads only those of ``names`` in levels before it."""
    level: dict[str, int] = {}
    for name in names:
        reads = expander.records_used(" or ".join(rule.expr for rule in expander.definitions[name]))
        level[name] = 1 + max((level[read] for read in reads if read in level), default=-1)
    return [[n for n in names if level[n] == k] for k in range(max(level.values(), default=-1) + 1)]


def records_to_store(expander: Expander, expr: str) -> list[str]:
    """The records ``expr`` reads that are worth storing, dependencies first: those read under a
    range selector or in a subquery, and those read more than once (by ``expr`` and the records it
    reads). A record read once is computed once either way, folded into its reader, which saves a
    level of storing."""
    used = expander.records_used(expr)
    reads: Counter[str] = Counter()
    for text in [expr, *(rule.expr for name in used for rule in expander.definitions[name])]:
        spans = subqueries(text)
        for selector in selectors(text):
            many = selector.range_seconds is not None or any(a <= selector.start < b for a, b, _ in spans)
            for name in expander.names_read(selector):
                reads[name] += 2 if many else 1
    return [name for name in used if reads[name] > 1]


def store_records(
    server: PrometheusServer,
    blocks: BlockWriter,
    expander: Expander,
    expr: str,
    start: float,
    end: float,
    step: float,
    *,
    progress: bool,
    jobs: int = PARALLEL,
) -> list[str]:
    """Compute the records ``expr`` reads once each (see ``records_to_store``), over [start, end],
    write them into the TSDB and have ``expander`` read them there (see ``expand``); return those
    stored. Records read under a range selector are stored at their group's interval, the others at
    the multiples of ``step``, the instants ``expr`` is evaluated at. They are computed level by
    level, each level reading the ones before it from the TSDB: one Prometheus restart per level."""
    ranged = set(expander.ranged_records(expr))
    stored: list[str] = []
    for number, level in enumerate(record_levels(expander, records_to_store(expander, expr))):
        began = time.monotonic()
        every = {name: expander.interval(name) if name in ranged else step for name in level}
        with QueryPool(server.api, jobs) as pool:
            families = _recorded(
                pool, expander, [(name, grid(start, end, every[name])) for name in level], progress=False
            )
        by_grid: dict[float, list[Family]] = {every[name]: [] for name in level}
        for family in families:
            by_grid.setdefault(every[family.name], []).append(family)
        batches = [(families, grid(start, end, every)) for every, families in by_grid.items() if families]
        if batches:
            add_series(server, blocks, batches, f"storing records, level {number}", progress=progress)
        for families, _ in batches:
            for family in families:
                if family.name in ranged:
                    expander.store(family.name)
                else:
                    expander.store_on_grid(family.name, step)
                stored.append(family.name)
        log.info("records stored level=%d seconds=%.1f", number, time.monotonic() - began)
    return stored


def start_prometheus(workdir: Path, data_dir: Path, interval: float) -> PrometheusServer:
    config = {"global": {"scrape_interval": f"{int(interval)}s", "evaluation_interval": f"{int(interval)}s"}}
    server = PrometheusServer(workdir / "prometheus", config, data_dir=data_dir, extra_args=PROMETHEUS_ARGS)
    try:
        server.start(timeout=300)
    except ProcessError as exc:
        server.stop()
        raise BackfillError(f"Prometheus did not start on the backfilled data: {exc}") from None
    except BaseException:  # interrupted while it starts: it must not outlive us
        server.stop()
        raise
    return server


@contextlib.contextmanager
def backfilled_prometheus(
    scenario_path: Path,
    workdir: Path,
    *,
    rules_dir: Path | None = None,
    seed: int | None = None,
    record: bool = True,
    progress: bool = False,
) -> Iterator[BackfilledFleet]:
    """Yield a started Prometheus whose TSDB holds the scenario's fleet history.

    ``scenario_path``: a fleet scenario (``bench/scenarios/README.md``); ``seed`` overrides its seed.
    ``workdir``: an existing or new directory for the TSDB, logs and staging files; the caller owns it
    (a ``tempfile.TemporaryDirectory`` is typical).
    ``rules_dir``: Prometheus rule files. Only the series their selectors can read are written
    (plus identity series: ``up``, ``gpuhealth_gpu_info``, ``gpuhealth_gpu_up``,
    ``gpuhealth_gpus_expected``/``_visible``); without rules every exporter series is written. With
    ``record`` (the default) every recording rule is also backfilled, so recorded names such as
    ``gpuhealth:gpu_failure_risk:score`` can be queried over the whole period.

    The yielded ``BackfilledFleet`` has ``.server`` (a ``PrometheusServer``; ``.server.api`` queries
    it), ``.start``/``.end`` (the evaluated period, unix seconds), ``.data_start`` (warm-up start) and
    ``.scenario`` (ground truth: ``.failures``, ``.noise``). Prometheus is stopped on exit, whatever
    happens, Ctrl-C included; the caller removes ``workdir``.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    scenario = load_scenario(Path(scenario_path), seed=seed)
    rules = load_rules(Path(rules_dir)) if rules_dir is not None else None
    signals = FleetSignals(scenario)
    selection = Selection.for_rules(rules, scenario.step)
    data_dir = workdir / "data"
    blocks = backfill_series(signals, selection, data_dir, progress=progress)
    server = start_prometheus(workdir, data_dir, rules.interval if rules else 60.0)
    try:
        if rules is not None and record and rules.records:
            backfill_records(server, blocks, rules, scenario.data_start, scenario.end, progress=progress)
        yield BackfilledFleet(server, blocks, scenario, signals, rules, blocks.samples)
    finally:
        server.stop()
