"""The demo's overlay (rules/overlays/demo.yaml) must keep up with the catalogue: every window is short.

A knob added to the catalogue later (a new window or subquery step) would otherwise keep its
production value in the demo, and a precursor played in a minute would never reach the rule.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from gpuhealth.demo.stack import OVERLAY

SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
RANGE = re.compile(r"\[(\d+)([smhd])(?::(\d+)([smhd]))?\]")
#: Windows that count repeats over days by design (XID escalation, lemon nodes) may stay long; the
#: lemon subquery is written one second short of its window (a range's start is not in it, in
#: VictoriaMetrics), so an hour's window is 3599 s.
LONG_ON_PURPOSE = 3600 - 1


def _render(tmp_path: Path) -> list[dict]:
    gpuhealth = Path(sys.executable).with_name("gpuhealth")
    subprocess.run([gpuhealth, "rules", "generate", "--catalogue", OVERLAY, "--source", "gpuhealth",
                    "--out", tmp_path / "out"], check=True, capture_output=True)
    return [rule for path in sorted((tmp_path / "out" / "gpuhealth").glob("*.yml"))
            for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def test_every_evidence_window_and_step_is_demo_sized(tmp_path):
    rules = _render(tmp_path)
    checked = 0
    for rule in rules:
        name = rule.get("record") or rule.get("alert")
        for match in RANGE.finditer(rule["expr"]):
            window = int(match[1]) * SECONDS[match[2]]
            if window >= LONG_ON_PURPOSE and not name.startswith("gpuhealth:gpu_evidence"):
                continue
            assert window <= 300, f"{name}: range {match[0]} too long for the demo"
            if match[3]:
                step = int(match[3]) * SECONDS[match[4]]
                # a window counted in slices is one second short of them (rules/templates/lib.j2)
                assert step <= (window + 1) / 3, f"{name}: subquery {match[0]} has too few steps"
            checked += 1
    assert checked > 10


def test_predictive_alert_waits_seconds_not_minutes(tmp_path):
    rules = {rule.get("alert"): rule for rule in _render(tmp_path)}
    assert rules["GPUHealthGpuFailureRisk"]["for"] == "15s"
