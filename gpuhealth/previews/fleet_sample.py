"""The evaluation benchmark's simulated fleet in a real Prometheus, with what the dashboards read.

``gpuhealth.evaluation`` writes only the series some rule reads, then backfills the recording rules.
The dashboards also read exporter series no rule needs (power, clocks, NVLink state...), so one more
rule, never evaluated, declares them: it selects each series the dashboards' queries name, over a
range as long as their rate windows, which also keeps enough samples of each for those windows.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from gpuhealth.rules.cli import DEFAULT_OUT

RULES_DIR = DEFAULT_OUT / "gpuhealth"
METRIC = re.compile(r"gpuhealth_[a-z0-9_]+")


def dashboard_inputs(queries: list[str]) -> str:
    """A rule file declaring every exporter series the ``queries`` read; it is never evaluated."""
    names = sorted({m for q in queries for m in METRIC.findall(q) if not m.startswith("gpuhealth_webhook_")})
    selector = '{__name__=~"' + "|".join(names) + '"}'
    return yaml.safe_dump({"groups": [{"name": "dashboard-inputs", "rules": [
        {"alert": "DashboardInputs", "expr": f"count(rate({selector}[6m])) < 0"}]}]}, sort_keys=False)


@contextlib.contextmanager
def backfilled_fleet(scenario: Path, workdir: Path, queries: list[str], *, rules_dir: Path = RULES_DIR,
                     seed: int | None = None, interval: str | None = None,
                     record: bool = True) -> Iterator[Any]:
    """``gpuhealth.evaluation.fleet.backfilled_prometheus`` with the rules plus what ``queries`` read;
    ``record`` as there.

    ``interval`` (a Prometheus duration) replaces the rule groups' evaluation interval: the recording
    rules are backfilled at that resolution, and most of the time goes there, so tests use a coarser
    one. Keep it under Prometheus's 5m lookback, or instant queries fall between recorded samples.
    """
    from gpuhealth.evaluation.fleet import backfilled_prometheus

    rule_files = sorted(Path(rules_dir).glob("*.yml"))
    if not rule_files:
        raise FileNotFoundError(f"no rule files in {rules_dir}: run 'gpuhealth rules generate'")
    rules = workdir / "rules"
    rules.mkdir(parents=True, exist_ok=True)
    sources = [(path.name, path.read_text()) for path in rule_files]
    for name, text in [*sources, ("dashboard-inputs.yml", dashboard_inputs(queries))]:
        if interval:
            groups = yaml.safe_load(text)
            for group in groups["groups"]:
                group["interval"] = interval
            text = yaml.safe_dump(groups, sort_keys=False)
        (rules / name).write_text(text)
    with backfilled_prometheus(scenario, workdir / "fleet", rules_dir=rules, seed=seed,
                               record=record) as fleet:
        yield fleet
