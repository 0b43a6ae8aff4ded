"""Detection-quality benchmark: ``gpuhealth eval`` on the reference fleet (64 nodes x 8 GPUs, 14 days).

Prints recall, the share of failures predicted before the hard failure, lead times and false alarms
per day per 64 nodes, per fault kind and per alert. Extra arguments go to ``gpuhealth eval``, e.g.
``.venv/bin/python bench/detection.py --seed 7 --json detection.json --plot detection.png``.
"""

import sys
from pathlib import Path

from gpuhealth.cli import main

if __name__ == "__main__":
    reference = Path(__file__).resolve().parent / "scenarios" / "reference.yaml"
    sys.exit(main(["eval", "--scenario", str(reference), *sys.argv[1:]]))
