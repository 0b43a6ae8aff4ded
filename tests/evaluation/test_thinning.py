"""Thinned series answer every query of the rules exactly as the full series do, in a real Prometheus."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuhealth.evaluation.openmetrics import Thinning
from gpuhealth.evaluation.ranges import grid, range_matrix
from gpuhealth.evaluation.rulefiles import RuleSet, load_rules
from gpuhealth.evaluation.selection import Selection
from gpuhealth.evaluation.signals import Family

from .tsdb import COUNT, START, STEP, prometheus_on

QUERIES = {
    "rate": "rate({}[10m])",
    "increase": "increase({}[30m])",
    "delta": "delta({}[30m])",
    "max": "max_over_time({}[10m])",
    "avg": "avg_over_time({}[30m])",
    "instant": "{}",
    "offset": "{} offset 1h",
}


def history() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    counter = np.cumsum(rng.random(COUNT) < 0.01).astype(float)  # rare increments, long still stretches
    flag = np.zeros(COUNT)
    flag[200:260] = 1  # a 0/1 gauge with one hour set
    lost = np.arange(COUNT, dtype=float) % 7
    lost[400:] = np.nan  # a reading that stops (a GPU off the bus)
    return {"counter": counter, "flag": flag, "lost": lost}


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("thinning")
    rules = workdir / "rules.yml"
    rules.write_text(
        "groups:\n- name: g\n  rules:\n"
        + "".join(
            f"  - record: r:{name}\n    expr: {query.format(f'thin_{series}')}\n"
            for name, query in QUERIES.items()
            for series in history()
        )
    )
    selection = Selection.for_rules(load_rules(rules), STEP)
    families = []
    for name, values in history().items():
        families.append((Family(f"full_{name}", "gauge", [('node="n1"', values)]), Thinning(0, 0)))
        families.append(
            (Family(f"thin_{name}", "gauge", [('node="n1"', values)]), selection.thinning(f"thin_{name}"))
        )
    with prometheus_on(workdir, families) as (server, written):
        yield server, dict(zip(history(), written[1::2], strict=True))


def test_thinning_drops_samples(prometheus) -> None:
    _, written = prometheus
    assert written["flag"] < COUNT / 2  # two changes: the stretches far from them are thinned
    assert written["lost"] == 400  # changes at every sample: all kept, and none after it vanished


@pytest.mark.slow
@pytest.mark.parametrize("query", sorted(QUERIES))
@pytest.mark.parametrize("series", sorted(history()))
def test_thinned_series_give_the_same_answers(prometheus, query: str, series: str) -> None:
    server, _ = prometheus
    times = grid(START + 3600, START + STEP * (COUNT - 1), STEP)
    full = range_matrix(server.api, QUERIES[query].format(f"full_{series}"), times).series
    thin = range_matrix(server.api, QUERIES[query].format(f"thin_{series}"), times).series
    assert len(full) == 1 and len(thin) == 1
    (a,), (b,) = full.values(), thin.values()
    np.testing.assert_allclose(a, b, rtol=1e-9, equal_nan=True)


def test_selection_reads_windows_and_matchers_from_the_rules(tmp_path: Path) -> None:
    rules = tmp_path / "r.yml"
    rules.write_text("""groups:
- name: g
  rules:
  - alert: A
    expr: rate(gpuhealth_gpu_nvlink_errors_total{type=~"crc_.*"}[15m]) > 0 and on (node) up == 1
  - record: r:x
    expr: count_over_time(gpuhealth_host_procs_running[5m])
""")
    selection = Selection.for_rules(load_rules(rules), 60.0)
    assert selection.family_wanted("gpuhealth_gpu_nvlink_errors_total")
    assert not selection.family_wanted("gpuhealth_gpu_temperature_celsius")
    assert selection.family_wanted("gpuhealth_gpu_info")  # identity series are always written
    assert selection.series_wanted("gpuhealth_gpu_nvlink_errors_total", 'link="0",type="crc_flit",gpu="1"')
    assert not selection.series_wanted("gpuhealth_gpu_nvlink_errors_total", 'link="0",type="replay",gpu="1"')
    assert selection.thinning("gpuhealth_gpu_nvlink_errors_total") == Thinning(reach=900, grid=450)
    assert selection.thinning("up") == Thinning(reach=60, grid=240)
    assert selection.thinning("gpuhealth_host_procs_running") == Thinning(0, 0)
    assert Selection.for_rules(RuleSet(), 60.0).family_wanted("gpuhealth_gpu_up")
