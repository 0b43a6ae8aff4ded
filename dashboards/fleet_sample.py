"""The evaluation benchmark's simulated fleet in a real Prometheus, with what the dashboards read.

``gpuhealth.evaluation`` writes only the series some rule reads, then backfills the recording rules.
The dashboards also read exporter series no rule needs (power, clocks, NVLink state...), so one more
rule, never evaluated, declares them: it selects every exporter series over a range as long as the
dashboards' rate windows, which also keeps enough samples of each for those windows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RULES_DIR = Path(__file__).resolve().parents[1] / "rules" / "generated" / "gpuhealth"
DASHBOARD_INPUTS = """\
# Declares the series the dashboards read, for the benchmark's backfill; never evaluated.
groups:
- name: dashboard-inputs
  rules:
  - alert: DashboardInputs
    expr: count(rate({__name__=~"gpuhealth_.+"}[6m])) < 0
"""


@contextlib.contextmanager
def backfilled_fleet(scenario: Path, workdir: Path, *, rules_dir: Path = RULES_DIR,
                     seed: int | None = None) -> Iterator[Any]:
    """``gpuhealth.evaluation.fleet.backfilled_prometheus`` with the rules plus the dashboards' inputs."""
    from gpuhealth.evaluation.fleet import backfilled_prometheus

    rule_files = sorted(Path(rules_dir).glob("*.yml"))
    if not rule_files:
        raise FileNotFoundError(f"no rule files in {rules_dir}: run 'gpuhealth rules generate'")
    rules = workdir / "rules"
    rules.mkdir(parents=True, exist_ok=True)
    for path in rule_files:
        (rules / path.name).write_text(path.read_text())
    (rules / "dashboard-inputs.yml").write_text(DASHBOARD_INPUTS)
    with backfilled_prometheus(scenario, workdir / "fleet", rules_dir=rules, seed=seed) as fleet:
        yield fleet
