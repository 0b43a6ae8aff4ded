"""``gpuhealth-sim-reset``: ``nvidia-smi -r -i GPU`` for a node whose GPUs are simulated.

The webhook's ``reset_gpu_command`` runs it in the local demo where a real site runs
``ssh -- {node} nvidia-smi -r -i {gpu}``, so a reset step succeeds or fails as on hardware.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuhealth.exporter.sim.control import ControlError, Unreachable, reset_gpu


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuhealth-sim-reset",
        description="Reset one simulated GPU, as nvidia-smi -r does on real hardware: volatile ECC "
                    "counts cleared, pending row remaps applied, a recovery action of reset kind "
                    "carried out, the faults a reset repairs over. Fails (exit 1) for a GPU that fell "
                    "off the bus, one that processes still use, or one whose driver asks for a reboot.",
        epilog="The exporter must run with --backend sim --sim-control SOCKET. Exit codes: 0 reset, "
               "1 reset refused, 2 usage error or no simulator answering.")
    parser.add_argument("--control", required=True, type=Path, metavar="SOCKET",
                        help="the exporter's --sim-control socket")
    parser.add_argument("-i", "--id", dest="gpu", required=True, metavar="GPU",
                        help="the GPU: its index or its UUID (GPU-...)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(reset_gpu(args.control, args.gpu))
    except Unreachable as exc:
        print(f"gpuhealth-sim-reset: {exc} (is the exporter running with --sim-control?)", file=sys.stderr)
        return 2
    except ControlError as exc:
        print(f"gpuhealth-sim-reset: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
