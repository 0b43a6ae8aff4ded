"""A record read under a range selector, stored in the TSDB once, gives what its subquery gives.

The shipped temperature baseline averages a 10-minute record over a day; as a subquery Prometheus
recomputes the whole peer chain 144 times per instant. Stored, the alerts must find the same episodes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuhealth.evaluation.alerts import AlertEvaluator
from gpuhealth.evaluation.expand import Expander
from gpuhealth.evaluation.fleet import backfilled_prometheus, store_ranged_records
from gpuhealth.evaluation.ranges import range_matrix
from gpuhealth.evaluation.rulefiles import load_rules, selectors

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "bench" / "scenarios" / "small.yaml"
RULES = ROOT / "rules" / "generated" / "gpuhealth"
BASELINE = "gpuhealth:gpu_evidence:temperature_baseline"
SAMPLED = "gpuhealth:gpu_temperature_celsius:peer_deviation_sampled"
STEP = 600.0


def test_ranged_records_lists_only_records_read_under_a_range() -> None:
    expander = Expander(load_rules(RULES))
    assert expander.ranged_records(BASELINE) == [SAMPLED]
    assert expander.ranged_records("gpuhealth:gpu_temperature_celsius:peer_deviation") == []
    expander.store(SAMPLED)
    expanded = expander.expand(BASELINE)
    read = [s for s in selectors(expanded) if s.name == SAMPLED]
    # Every read is the stored series under its range (the baseline reads it twice: its own GPU's drift
    # and the node-wide drift that marks a rack's cooling).
    assert read and {s.range_seconds for s in read} == {86400.0}
    assert "gpuhealth:gpu_temperature_celsius:peer_deviation)" not in expanded  # instant reads expanded
    assert f"{SAMPLED}[" not in expander.expand(f"{SAMPLED} > 0")


@pytest.mark.slow
def test_stored_records_give_the_subquery_values_and_episodes(tmp_path: Path) -> None:
    with backfilled_prometheus(SMALL, tmp_path, rules_dir=RULES, record=False) as fleet:
        rules = fleet.rules
        assert rules is not None
        risk = [r for r in rules.alerts if BASELINE in Expander(rules).records_used(r.expr)]
        assert risk, "no alert reads the temperature baseline"

        def run(store: bool) -> tuple[AlertEvaluator, dict]:
            evaluator = AlertEvaluator(fleet.server.api, rules, fleet.data_start, fleet.end, STEP)
            if store:
                stored = store_ranged_records(
                    fleet.server,
                    evaluator.expander,
                    " or ".join(r.expr for r in risk),
                    fleet.data_start,
                    fleet.end,
                    tmp_path,
                    progress=False,
                )
                assert SAMPLED in stored and "gpuhealth:gpu_remapped_rows:sampled" in stored
            for rule in risk:
                evaluator.evaluate(rule)
            baseline = range_matrix(fleet.server.api, evaluator.expander.expand(BASELINE), evaluator.times)
            return evaluator, baseline.series

        subquery, subquery_baseline = run(store=False)
        stored, stored_baseline = run(store=True)
        assert SAMPLED not in subquery.expander.stored and SAMPLED in stored.expander.stored
        assert subquery_baseline, "the scenario never moves the temperature baseline evidence"
        assert stored_baseline.keys() == subquery_baseline.keys()
        for labels, values in subquery_baseline.items():
            np.testing.assert_allclose(stored_baseline[labels], values, equal_nan=True)
        assert stored.run.episodes() == subquery.run.episodes()
        assert stored.run.pending.keys() == subquery.run.pending.keys()
        assert not stored.run.errors and not subquery.run.errors
