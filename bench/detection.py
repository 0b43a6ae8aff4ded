"""Detection-quality benchmark: ``gpuhealth eval`` on the reference fleet (64 nodes x 8 GPUs, 14 days).

Prints the share of failures detected within a minute of their first XID, the share predicted at
least ``min_lead`` ahead (all failures, and those with an hour of precursor or more; 95 % Wilson
intervals), late warnings, lead times, false alarms and distinct false drains per day per 64 nodes,
precision at the field failure rate and lemon alerts, per fault kind and per alert. Extra arguments
go to ``gpuhealth eval``, e.g.
``.venv/bin/python bench/detection.py --seed 7 --json detection.json --plot detection.png``.
"""

import sys
from pathlib import Path

from gpuhealth.cli import main

if __name__ == "__main__":
    reference = Path(__file__).resolve().parent / "scenarios" / "reference.yaml"
    sys.exit(main(["eval", "--scenario", str(reference), *sys.argv[1:]]))
