"""Records computed once and stored in the TSDB give the alerts what the records folded into them give.

Folded, the shipped risk alert is one expression of 170,000 characters in which the temperature peer
chain is evaluated several times per instant, and a record read under a range selector is a subquery
recomputing its chain at every step. Stored, each record is computed once; the alerts must find the
same episodes, and the temperature baseline (which reads the stored history) the same values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from gpuhealth.cli import main
from gpuhealth.evaluation.alerts import AlertEvaluator
from gpuhealth.evaluation.expand import Expander
from gpuhealth.evaluation.fleet import (
    backfilled_prometheus,
    record_levels,
    recorded_series,
    records_to_store,
    store_records,
)
from gpuhealth.evaluation.ranges import Matrix, grid, range_matrix
from gpuhealth.evaluation.rulefiles import load_rules, selectors

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "bench" / "scenarios" / "small.yaml"
RULES = ROOT / "rules" / "generated" / "gpuhealth"
BASELINE = "gpuhealth:gpu_evidence:temperature_baseline"
DEVIATION = "gpuhealth:gpu_temperature_celsius:peer_deviation"
SAMPLED = "gpuhealth:gpu_temperature_celsius:peer_deviation_sampled"
RISK = "gpuhealth:gpu_failure_risk:score"
STEP = 300.0
# alerts compared over the HBM failure's last hour, the GPU lost from the bus and a power cap
WINDOW = (13 * 3600.0, 19 * 3600.0)


def test_ranged_records_lists_only_records_read_under_a_range() -> None:
    expander = Expander(load_rules(RULES))
    assert expander.ranged_records(BASELINE) == [SAMPLED]
    assert expander.ranged_records(DEVIATION) == []
    expander.store(SAMPLED)
    expanded = expander.expand(BASELINE)
    read = [s for s in selectors(expanded) if s.name == SAMPLED]
    # Every read is the stored series under its range (the baseline reads it twice: its own GPU's drift
    # and the node-wide drift that marks a rack's cooling; each drift over the day and its last hours).
    assert read and {s.range_seconds for s in read} == {86400.0, 21600.0}
    assert f"{DEVIATION})" not in expanded  # instant reads expanded
    assert f"{SAMPLED}[" not in expander.expand(f"{SAMPLED} > 0")


def test_records_on_a_grid_are_read_only_at_instants_of_that_grid() -> None:
    expander = Expander(load_rules(RULES))
    expander.store_on_grid(DEVIATION, STEP)
    read = f"last_over_time({DEVIATION}{{}}[299999ms])"
    assert expander.expand(f"{DEVIATION} > 1", STEP) == f"{read} > 1"
    assert expander.expand(f"{DEVIATION} > 1", 2 * STEP).startswith(read)  # every other instant
    for off_grid in (None, 60.0, 450.0):
        assert read not in expander.expand(f"{DEVIATION} > 1", off_grid)
    assert read in expander.expand(f"max_over_time(({DEVIATION} > 1)[1h:10m])", 60.0)
    assert read not in expander.expand(f"max_over_time(({DEVIATION} > 1)[1h:1m])", STEP)
    assert read in expander.expand(f"max_over_time({DEVIATION}[1h:15m])", 60.0)
    assert read not in expander.expand(f"{DEVIATION} offset 1h", STEP)  # offset: folded, exact
    assert expander.expand(f'{DEVIATION}{{gpu="3"}}', STEP) == read.replace("{}", '{gpu="3"}')
    # a record read through it: the sampled history, at 10 minutes, reads the 5-minute grid
    assert read in expander.definition(SAMPLED, (), 600.0)
    assert read in expander.expand(BASELINE, STEP)


def test_record_levels_put_every_record_after_those_it_reads() -> None:
    expander = Expander(load_rules(RULES))
    names = expander.records_used(f"{RISK} > 0.6")
    levels = record_levels(expander, names)
    assert sorted(n for level in levels for n in level) == sorted(names)
    where = {name: k for k, level in enumerate(levels) for name in level}
    for name in names:
        reads = expander.records_used(" or ".join(r.expr for r in expander.definitions[name]))
        assert all(where[read] < where[name] for read in reads if read != name), name
    # reached through {__name__=~"gpuhealth:node_evidence:.+"} only
    assert where["gpuhealth:node_evidence:page_out_spike"] < where["gpuhealth:gpu_set_node_evidence:zero"]
    assert levels[-1] == [RISK]


def test_records_read_once_are_folded_into_their_reader() -> None:
    expander = Expander(load_rules(RULES))
    stored = records_to_store(expander, f"{RISK} > 0.6")
    assert {SAMPLED, DEVIATION, BASELINE, "gpuhealth:gpu_set:zero"} <= set(stored)
    # each contribution is read once, by the score, which the alert reads once
    assert RISK not in stored and "gpuhealth:gpu_failure_risk:contribution" not in stored
    assert RISK in records_to_store(expander, f"{RISK} > 0.6 or {RISK} < 0")
    assert RISK in records_to_store(expander, f"max_over_time(({RISK} > 0.6)[1h:5m])")  # read 12 times


def test_a_record_passing_a_stored_record_through_is_one_series() -> None:
    """``score = ... or gpuhealth:gpu_set:zero`` with the zero read from the TSDB: over a range, a GPU's
    score comes back under the zero's name while it has no evidence and under none after; it is
    recorded as one series (the block writer refuses a series written twice)."""
    nan = np.nan
    zero = (("__name__", "gpuhealth:gpu_set:zero"), ("gpu", "0"), ("node", "n1"))
    matrix = Matrix(np.arange(4.0), {
        zero: np.array([0.0, 0.0, nan, nan]),
        (("gpu", "0"), ("node", "n1")): np.array([nan, nan, 0.4, 0.7]),
        (("gpu", "1"), ("node", "n1")): np.array([0.1, 0.2, 0.3, 0.4]),
    })
    recorded = recorded_series(matrix)
    series = dict(recorded)
    assert len(recorded) == 2 and sorted(series) == ['gpu="0",node="n1"', 'gpu="1",node="n1"']
    np.testing.assert_array_equal(series['gpu="0",node="n1"'], [0.0, 0.0, 0.4, 0.7])
    np.testing.assert_array_equal(series['gpu="1",node="n1"'], [0.1, 0.2, 0.3, 0.4])


def _unsharded_rules(tmp_path: Path) -> Path:
    """The shipped catalogue with one GPU shard and one HCA shard: the same expressions, but a record
    split ten ways is not folded as the union of its ten shards (each shard covering every GPU once is
    tested with the generator)."""
    overlay = tmp_path / "unsharded.yaml"
    overlay.write_text(yaml.safe_dump({"defaults": {"gpu_shards": 1, "fabric": {"hca_shards": 1}}}))
    out = tmp_path / "rules"
    assert main(["rules", "generate", "--catalogue", str(overlay), "--source", "gpuhealth",
                 "--out", str(out)]) == 0
    return out / "gpuhealth"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # every shipped rule folded and stored
def test_stored_records_give_the_folded_episodes_and_values(tmp_path: Path) -> None:
    rules_dir = _unsharded_rules(tmp_path)
    with backfilled_prometheus(SMALL, tmp_path, rules_dir=rules_dir, record=False) as fleet:
        rules = fleet.rules
        assert rules is not None
        reading = [r for r in rules.alerts if Expander(rules).records_used(r.expr)]
        assert any(RISK in Expander(rules).records_used(r.expr) for r in reading)

        def run(store: bool) -> tuple[AlertEvaluator, dict]:
            evaluator = AlertEvaluator(
                fleet.server.api, rules, fleet.start + WINDOW[0], fleet.start + WINDOW[1], STEP
            )
            if store:
                stored = store_records(
                    fleet.server,
                    fleet.blocks,
                    evaluator.expander,
                    " or ".join(r.expr for r in reading),
                    fleet.data_start,
                    fleet.end,
                    STEP,
                    progress=False,
                )
                assert {SAMPLED, DEVIATION, BASELINE} <= set(stored)
            for rule in reading:
                evaluator.evaluate(rule)
            expr = evaluator.expander.expand(BASELINE, STEP)  # over the whole day: the hot aisle at 8h
            series = range_matrix(fleet.server.api, expr, grid(fleet.start, fleet.end, STEP)).series
            # a stored read keeps the record's name, as Prometheus's own reads of a record do
            return evaluator, {tuple(kv for kv in k if kv[0] != "__name__"): v for k, v in series.items()}

        folded, folded_baseline = run(store=False)
        stored, stored_baseline = run(store=True)
        assert not folded.expander.on_grid and BASELINE in stored.expander.on_grid
        assert folded_baseline, "the scenario never moves the temperature baseline evidence"
        assert stored_baseline.keys() == folded_baseline.keys()
        for labels, values in folded_baseline.items():
            np.testing.assert_array_equal(stored_baseline[labels], values)
        assert folded.run.episodes(), "no alert reading records fires on the scenario"
        assert stored.run.episodes() == folded.run.episodes()
        assert stored.run.pending.keys() == folded.run.pending.keys()
        for alert, series in folded.run.pending.items():
            for labels, mask in series.items():
                np.testing.assert_array_equal(stored.run.pending[alert][labels], mask)
        assert not stored.run.errors and not folded.run.errors
