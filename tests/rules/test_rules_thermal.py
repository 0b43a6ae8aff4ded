"""Thermal evidence over days, on both input sources: a cooling that degrades a degree a day is seen
against the GPU's own past days; a GPU that always ran warm, a rack whose cooling falters and a new node
with no history are not. Sampled every 10 minutes for a week and a day (one GPU shard), the thermal
evidence only: how each signal weighs in the risk score is `test_rules_fusion.py`'s."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuhealth.rules import catalogue
from gpuhealth.rules.render import render_all
from rules_promtool import SOURCES, Fleet, alert, run_promtool

STEP = 10                     # minutes between samples and evaluations
DAY = 24 * 60 // STEP         # samples in a day
DAYS = 8
STEPS = DAYS * DAY


def _render(tmp_path: Path, source: str) -> Path:
    """The default rules in one GPU shard: the same expressions, a tenth of the groups to evaluate."""
    rules_dir = tmp_path / "rules"
    for path, text in render_all(catalogue.resolve({"defaults": {"gpu_shards": 1}}), (source,)).items():
        (rules_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (rules_dir / path).write_text(text)
    return rules_dir


def _busy_node(fleet: Fleet, node: str, temperatures: dict[int, str], first: int = 0) -> None:
    """A busy node at 60 C but for the GPUs in ``temperatures`` (promtool values), scraped from sample
    ``first`` on (absent before: a node that joins the fleet then)."""
    absent = (f"_x{first}",) if first else ()
    for gpu in range(8):
        fleet.add("info", node, gpu, *absent, (1, 0, STEPS - first), uuid=f"GPU-{node}-{gpu}")
        fleet.add("utilization", node, gpu, *absent, (0.9, 0, STEPS - first))
        flat = " ".join([*absent, f"60+0x{STEPS - first}"])
        fleet.add("temperature", node, gpu, temperatures.get(gpu, flat))


def _evidence(signal: str, node: str, gpu: int, at: str, above: float | None = None) -> dict:
    expr = f'gpuhealth:gpu_evidence:{signal}{{node="{node}", gpu="{gpu}"}}'
    if above is None:
        return {"expr": expr, "eval_time": at, "exp_samples": []}
    return {"expr": f"{expr} > bool {above}", "eval_time": at,
            "exp_samples": [{"labels": f'{{gpu="{gpu}", node="{node}"}}', "value": 1}]}


def _never(signal: str, node: str, gpus: range | list[int], within: str, at: str) -> dict:
    """No evidence of ``signal`` on any of ``gpus`` over the ``within`` before ``at``."""
    selector = f'node="{node}", gpu=~"{"|".join(str(g) for g in gpus)}"'
    return {"expr": f"count_over_time(gpuhealth:gpu_evidence:{signal}{{{selector}}}[{within}])",
            "eval_time": at, "exp_samples": []}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("source", SOURCES)
def test_thermal_drift_over_a_week(tmp_path, source):
    """n1 GPU 0's cooling degrades: its temperature rises 1 C a day, at the same load, all week. n1 GPU 1
    ran 5 C warmer than its node mates all week (its place in the airflow) and corrects a few SBEs all
    along (chatter). n2 and n3 are one rack whose
    cooling falters for three hours on day 7: every GPU warms by its place in the airflow. n4 joins the
    fleet on day 7 with a GPU 5 C warmer than its mates and SBE chatter."""
    fleet = Fleet(source)
    ramp = " ".join(f"{60 + i / DAY:.3f}" for i in range(STEPS + 1))
    _busy_node(fleet, "n1", {0: ramp, 1: f"65+0x{STEPS}"})
    fleet.add("ecc_corrected", "n1", 1, (0, 1, STEPS))
    incident, hours = 7 * DAY, 3 * 60 // STEP
    after = STEPS - incident - hours - 1
    for node, heat in (("n2", (3, 4, 5, 6, 7, 8, 9, 10)), ("n3", (4, 4, 6, 6, 8, 8, 10, 11))):
        _busy_node(fleet, node, {gpu: f"60+0x{incident} {60 + h}+0x{hours} 60+0x{after}"
                                 for gpu, h in enumerate(heat)})
    joins = 7 * DAY
    _busy_node(fleet, "n4", {0: f"_x{joins} 65+0x{STEPS - joins}"}, first=joins)
    fleet.add("ecc_corrected", "n4", 0, f"_x{joins} 0+1x{STEPS - joins}")

    end = f"{DAYS}d"
    exprs = [
        # A degree a day never stands `low` (2 C) above its own last day or its last hours...
        _never("temperature_baseline", "n1", [0], "8d", end),
        # ...but it rose on each of the last three days, 3 C in all: the trend, once three past days
        # exist (not on day 2), and with it the peer comparison (7 C above its node mates).
        _never("temperature_trend", "n1", [0], "2d", "2d"),
        _evidence("temperature_trend", "n1", 0, "5d", 0.99),
        _evidence("temperature_trend", "n1", 0, "7d", 0.99),
        _evidence("temperature_peer", "n1", 0, "6d", 0.99),
        # Always 5 C warm: its own normal, all week, beside its SBE chatter (memory evidence only).
        *(_never(s, "n1", [1], "8d", end) for s in ("temperature_peer", "temperature_baseline",
                                                     "temperature_trend")),
        _evidence("ecc_corrected_growth", "n1", 1, end, 0.99),
        # The rack's air: every GPU of both nodes warms, none is a GPU's own drift.
        *(_never(s, n, range(8), "1d", end) for n in ("n2", "n3")
          for s in ("temperature_peer", "temperature_baseline", "temperature_trend")),
        # A new node: its warm GPU's only history is warm, no normal to depart from.
        *(_never(s, "n4", range(8), "1d", end) for s in ("temperature_peer", "temperature_baseline",
                                                          "temperature_trend")),
    ]
    run_promtool(tmp_path, source, ["evidence"],
                 [{"interval": f"{STEP}m", "input_series": fleet.input_series(), "promql_expr_test": exprs}],
                 evaluation_interval=f"{STEP}m", rules_dir=_render(tmp_path, source), timeout=600,
                 in_file_order=True)


def _cooling_failing(node: str, value: str) -> dict:
    name = "GPUHealthGpuCoolingFailing"
    return alert(name, {"alertname": name, "node": node, "gpu": "0"},
                 f"GPU 0 on {node} keeps warming at the same load: its cooling is failing",
                 f"GPU 0 on {node} has warmed against its node mates doing the same work, half-hour after "
                 f"half-hour for hours, and runs {value} C above its mean of the last day. A GPU whose "
                 "cooling holds does not keep warming at the same power: a fan or pump is slowing, or the "
                 "cold plate or thermal interface is losing contact. Let its jobs checkpoint, drain the "
                 "node and have the GPU's cooling checked before it reaches its slowdown and shutdown "
                 "temperatures (XID 79 follows a thermal shutdown).", "warning", "checkpoint_drain")


def _warming(start: int, per_sample: float, samples: int, total: int) -> str:
    """60 C until sample ``start``, then warmer by ``per_sample`` each sample for ``samples``, then held."""
    top = 60 + per_sample * samples
    return (f"60+0x{start} {60 + per_sample:g}+{per_sample:g}x{samples - 1} "
            f"{top:g}+0x{total - start - samples}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", SOURCES)
def test_cooling_failing_alert_on_a_gpu_that_keeps_warming(tmp_path, source):
    """After a day of history, from hour 6 of day 2: n1 GPU 0 warms 1.5 C an hour against its node mates
    for 8 hours, then holds (a cooling failing, then settled); GPU 1 steps 8 C warm and stays; GPU 2
    warms 0.5 C an hour (a slow drift: the trend evidence's, not this alert's). n3 GPU 0 warms 1.2 C an
    hour for 10 hours: against its median of the last 6 hours (the baseline's drift) it never stands
    more than 3.6 C, under the baseline's `high`, but it keeps warming and ends 12 C above its day.
    From hour 7 the air of node n2 warms for 3 hours, each GPU by its place in the airflow (2 to 16 C),
    holds 3 hours and cools: GPU 7 rises 7 C against its node mates in those 3 hours, faster than n1
    GPU 0, and would fire without the node-wide exclusion. n4 GPU 0 wobbles 1.5 C warm for 40 minutes,
    then steps 8 C warm and stays: the step lifts two half-hour means, the wobble a third (three rises
    in a row, for three evaluations), never a fourth."""
    days = 2
    steps, start = days * DAY, DAY + 6 * 60 // STEP
    fleet = Fleet(source)
    ramp = 8 * 60 // STEP
    _busy_node(fleet, "n1", {
        0: _warming(start, 0.25, ramp, steps),
        1: f"60+0x{start} 68+0x{steps - start}",
        2: " ".join([f"60+0x{start}", *(f"{60 + (i + 1) / 12:.3f}" for i in range(steps - start))]),
    })
    _busy_node(fleet, "n3", {0: _warming(start, 0.2, 10 * 60 // STEP, steps)})
    wobble = 4
    _busy_node(fleet, "n4", {0: f"60+0x{start} 61.5+0x{wobble - 1} 68+0x{steps - start - wobble}"})
    incident, hours = start + 60 // STEP, 3 * 60 // STEP
    after = steps - incident - 3 * hours
    def warms(heat: int) -> str:
        slope = f"{heat / hours:.4f}"
        return " ".join([f"60+0x{incident - 1}", f"60+{slope}x{hours}", f"{60 + heat}+0x{hours - 1}",
                         f"{60 + heat}-{slope}x{hours}", f"60+0x{after}"])
    _busy_node(fleet, "n2", {gpu: warms(heat) for gpu, heat in enumerate((2, 4, 6, 8, 10, 12, 14, 16))})

    def at(index: int) -> str:
        return f"{index * STEP}m"

    # n1 GPU 0's last half-hour stands 4 C above its day 19 samples into its ramp (190 min), its
    # half-hour means rising all the while: pending from then, firing one `for` (15 min, two
    # evaluations) later, quiet again once it stops warming. n3 GPU 0, warming slower, gets there 50
    # minutes later; it keeps firing until its warming stops, 10 hours in.
    name = "GPUHealthGpuCoolingFailing"
    n3_ramp = 10 * 60 // STEP
    checks = [
        {"eval_time": at(start + 18), "alertname": name, "exp_alerts": []},
        {"eval_time": at(start + 20), "alertname": name, "exp_alerts": []},
        {"eval_time": at(start + 21), "alertname": name, "exp_alerts": [_cooling_failing("n1", "4.5")]},
        {"eval_time": at(start + 25), "alertname": name, "exp_alerts": [_cooling_failing("n1", "5.3")]},
        {"eval_time": at(start + 26), "alertname": name,
         "exp_alerts": [_cooling_failing("n1", "5.5"), _cooling_failing("n3", "4.4")]},
        {"eval_time": at(start + ramp + 6), "alertname": name,
         "exp_alerts": [_cooling_failing("n3", "8.5")]},
        {"eval_time": at(start + n3_ramp - 1), "alertname": name,
         "exp_alerts": [_cooling_failing("n3", "9.1")]},
        {"eval_time": at(start + n3_ramp + 6), "alertname": name, "exp_alerts": []},
    ]
    # Neither the steps, nor the slow drift, nor any GPU of the warming node, ever.
    others = 'alertname="GPUHealthGpuCoolingFailing", alertstate="pending"'
    exprs = [{"expr": f'count_over_time(ALERTS{{{others}, node="n1", gpu!="0"}}[{days}d])',
              "eval_time": f"{days}d", "exp_samples": []},
             *({"expr": f'count_over_time(ALERTS{{{others}, node="{node}"}}[{days}d])',
                "eval_time": f"{days}d", "exp_samples": []} for node in ("n2", "n4"))]
    run_promtool(tmp_path, source, ["evidence", "definitive"],
                 [{"interval": f"{STEP}m", "input_series": fleet.input_series(), "alert_rule_test": checks,
                   "promql_expr_test": exprs}],
                 evaluation_interval=f"{STEP}m", rules_dir=_render(tmp_path, source), timeout=600,
                 in_file_order=True)
