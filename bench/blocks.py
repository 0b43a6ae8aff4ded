"""What writing a scenario's series into TSDB blocks costs: straight from the arrays
(``gpuhealth.evaluation.blocks``, what ``gpuhealth eval`` does) next to OpenMetrics text turned into
blocks by ``promtool tsdb create-blocks-from openmetrics`` (the former path), in CPU seconds.

``.venv/bin/python bench/blocks.py --scenario bench/scenarios/small.yaml``; CPU time is what to
compare on a shared machine (wall time follows the load, printed beside it).
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from gpuhealth.evaluation.blocks import BlockWriter
from gpuhealth.evaluation.fleet import promtool_blocks
from gpuhealth.evaluation.openmetrics import BlockFiles
from gpuhealth.evaluation.rulefiles import load_rules
from gpuhealth.evaluation.scenario import load_scenario
from gpuhealth.evaluation.selection import Selection
from gpuhealth.evaluation.signals import FleetSignals


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", type=Path, required=True, help="fleet scenario (YAML)")
    parser.add_argument("--rules", type=Path, default=Path("rules/generated/gpuhealth"), help="rule files")
    args = parser.parse_args()
    scenario = load_scenario(args.scenario)
    selection = Selection.for_rules(load_rules(args.rules), scenario.step)
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench-blocks-") as tmp:
        for path in ("direct", "promtool"):
            signals = FleetSignals(scenario)  # each path generates the signals afresh
            cpu, children, wall = time.process_time(), children_cpu(), time.monotonic()
            if path == "direct":
                writer = BlockWriter(Path(tmp) / "direct", signals.timeline)
                for family in signals.families(selection.family_wanted):
                    selection.write(family, writer)
                writer.close()
                samples = writer.samples
            else:
                files = BlockFiles(Path(tmp) / "text", signals.timeline)
                for family in signals.families(selection.family_wanted):
                    selection.write(family, files)
                text = time.process_time() - cpu
                promtool_blocks(
                    files.close(), Path(tmp) / "promtool", "promtool", progress=False, workdir=Path(tmp)
                )
                samples = files.samples
            own, spawned = time.process_time() - cpu, children_cpu() - children
            detail = f" (text {text:.1f} s, promtool {spawned:.1f} s)" if path == "promtool" else ""
            print(
                f"{path:9} {samples:,} samples: {own + spawned:.1f} s CPU{detail}, "
                f"{time.monotonic() - wall:.1f} s wall, load {os.getloadavg()[0]:.1f}"
            )


if __name__ == "__main__":
    main()
