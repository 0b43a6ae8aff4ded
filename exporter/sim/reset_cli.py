"""``gpuhealth-sim-reset``: ``nvidia-smi -r -i GPU`` for a node whose GPUs are simulated.

The webhook's ``reset_gpu_command`` runs it in the local demo where a real site runs
``ssh -- {node} nvidia-smi -r -i {gpu}``, so a reset step succeeds or fails as on hardware. On a real
node the check before it returns to service reads the GPUs the reset left; the demo's check builds its
simulator from a scenario file, which ``--scenario`` brings up to date with the reset.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml
from gpuhealth.exporter.sim.control import ControlError, Unreachable, reset_gpu
from gpuhealth.exporter.sim.scenario import after_reset


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuhealth-sim-reset",
        description="Reset one simulated GPU, as nvidia-smi -r does on real hardware: volatile ECC "
                    "counts cleared, pending row remaps applied, a recovery action of reset kind "
                    "carried out, the faults a reset repairs over. Fails (exit 1) for a GPU that fell "
                    "off the bus, one that processes still use, or one whose driver asks for a reboot.",
        epilog="The exporter must run with --backend sim --sim-control SOCKET. Exit codes: 0 reset, "
               "1 reset refused, 2 usage error, no simulator answering or a scenario file that "
               "cannot be rewritten.")
    parser.add_argument("--control", required=True, type=Path, metavar="SOCKET",
                        help="the exporter's --sim-control socket")
    parser.add_argument("-i", "--id", dest="gpu", required=True, metavar="GPU",
                        help="the GPU: its index or its UUID (GPU-...)")
    parser.add_argument("--scenario", type=Path, metavar="FILE",
                        help="after a reset, take what it ended on the GPU (the faults it repairs, the "
                             "noise that lasts until a reset) out of this scenario file: the node's "
                             "hardware as gpuhealth-validate --backend sim reads it")
    return parser


def record_reset(path: Path, gpu: int) -> None:
    """Rewrite the scenario file at ``path`` as the reset of ``gpu`` left the hardware (atomically:
    a check reading it meanwhile sees the old file or the new one)."""
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError("not a scenario (a YAML mapping)")
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(yaml.safe_dump(after_reset(data, gpu), sort_keys=False))
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        done = reset_gpu(args.control, args.gpu)
    except Unreachable as exc:
        print(f"gpuhealth-sim-reset: {exc} (is the exporter running with --sim-control?)", file=sys.stderr)
        return 2
    except ControlError as exc:
        print(f"gpuhealth-sim-reset: {exc}", file=sys.stderr)
        return 1
    print(done.detail)
    if args.scenario is not None:
        try:
            record_reset(args.scenario, done.gpu)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            print(f"gpuhealth-sim-reset: the GPU was reset, but {args.scenario} was not rewritten: {exc}",
                  file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
