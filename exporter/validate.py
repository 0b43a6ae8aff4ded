"""``gpuhealth-validate``: may this node take jobs again? A one-shot check run on the node.

Run after a GPU reset or a reboot, before the node is resumed, and as (part of) Slurm's
``HealthCheckProgram``. It reads the GPUs with the exporter's own NVML code and the kernel log with
the exporter's own parser, so "healthy" means the same to both. Exit 0: every check passed; 1: a
check failed; 2: nothing could be checked (bad usage, NVML unavailable). The verdict is one JSON
document on stdout (schema in exporter/VALIDATE.md); logs go to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shlex
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuhealth.exporter import __version__
from gpuhealth.exporter.inventory import GPUS_PER_NODE_MAX, nvidia_gpus_on_pci
from gpuhealth.exporter.nvml_backend import BACKENDS, load_nvml
from gpuhealth.exporter.sim.profiles import PROFILES
from gpuhealth.exporter.sim.scenario import ScenarioError
from gpuhealth.exporter.validate_checks import (
    Check,
    KernelLog,
    NicPorts,
    NodeState,
    NvmlUnavailable,
    check_ecc_mode,
    check_fabric,
    check_gpus_visible,
    check_nic_ports,
    check_recovery_action,
    check_row_remap,
    check_temperature,
    check_xid,
    read_node,
)
from gpuhealth.exporter.validate_commands import check_dcgm, check_site_command

log = logging.getLogger("gpuhealth.exporter.validate")

PROG = "gpuhealth-validate"
SCHEMA_VERSION = 1
EXIT_PASS, EXIT_FAIL, EXIT_CANNOT_CHECK = 0, 1, 2
APPLICATION_XIDS = (13, 31, 32, 43, 45)  # NVIDIA's "restart the application" bucket: not the GPU's fault


@dataclass(frozen=True)
class Options:
    """What to check and how; the command line's parsed form."""

    gpus_expected: int | None = None
    sysfs: Path | None = None
    kernel_log: KernelLog | None = None
    idle_temperature_max: float = 55.0
    busy_temperature_margin: float = 5.0
    nvml_timeout: float = 10.0
    dcgm_level: int | None = None
    dcgmi: str | None = None
    dcgm_timeout: float | None = None
    site_command: tuple[str, ...] = ()
    site_timeout: float = 600.0
    nic_ports: NicPorts | None = None  # None: no NIC port expected, the check does not apply


def validate(nvml: Any, options: Options) -> tuple[int, list[Check]]:
    """Run every check against ``nvml`` (pynvml or the simulator); (exit code, checks)."""
    try:
        node = read_node(nvml, options.nvml_timeout)
    except NvmlUnavailable as exc:
        return EXIT_CANNOT_CHECK, [Check("nvml", False, f"NVML unavailable: {exc.error}", exc.error)]
    try:
        checks = [Check("nvml", True, f"driver {node.driver_version}", node.driver_version),
                  check_gpus_visible(node, *_expected(node, options)),
                  check_row_remap(node, nvml),
                  check_recovery_action(node, nvml),
                  check_fabric(node, nvml),
                  check_nic_ports(options.nic_ports),
                  check_ecc_mode(node, nvml),
                  check_temperature(node, nvml, options.idle_temperature_max,
                                    options.busy_temperature_margin),
                  check_xid(node, options.kernel_log)]
    finally:
        _shutdown(nvml)
    if options.dcgm_level is not None:
        checks.append(check_dcgm(options.dcgm_level, options.dcgmi, options.dcgm_timeout))
    if options.site_command:
        checks.append(check_site_command(options.site_command, options.site_timeout))
    failed = any(check.ok is False for check in checks)
    return (EXIT_FAIL if failed else EXIT_PASS), checks


def _expected(node: NodeState, options: Options) -> tuple[int, str]:
    """GPUs the node should have: the option, else NVIDIA GPUs on the PCI bus, else NVML's count."""
    if options.gpus_expected is not None:
        return options.gpus_expected, "option"
    on_bus = nvidia_gpus_on_pci(options.sysfs) if options.sysfs is not None else None
    if on_bus:
        return on_bus, "pci"
    return node.count, "nvml"


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError as exc:  # the verdict is already known
        log.debug("nvml shutdown failed error=%s", exc)


def verdict(code: int, checks: list[Check], backend: str, started: datetime.datetime,
            seconds: float) -> dict[str, Any]:
    """The JSON document printed on stdout (exporter/VALIDATE.md)."""
    return {"schema_version": SCHEMA_VERSION, "ok": code == EXIT_PASS, "exit_code": code,
            "node": socket.gethostname().split(".")[0], "backend": backend, "version": __version__,
            "started_at": started.isoformat(timespec="seconds"), "duration_seconds": round(seconds, 3),
            "failed": [check.name for check in checks if check.ok is False],
            "checks": [check.as_json() for check in checks]}


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds or degrees, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _gpu_count(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > GPUS_PER_NODE_MAX:
        raise argparse.ArgumentTypeError(
            f"expected a whole number from 0 to {GPUS_PER_NODE_MAX}, got {text!r}")
    return int(text)


def _xids(text: str) -> frozenset[int]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected XID numbers separated by commas, got {text!r}")
    return frozenset(int(part) for part in parts)


def _nic_ports(text: str) -> tuple[tuple[str, str], ...]:
    """``mlx5_0,mlx5_1:1``: HCAs, each with its port number (1 when not given)."""
    ports = []
    for part in (part.strip() for part in text.split(",")):
        device, _, port = part.partition(":")
        port = port or "1"
        if not device or "/" in device or device.startswith(".") or not port.isdigit():
            raise argparse.ArgumentTypeError(f"expected HCA[:PORT] separated by commas (mlx5_0,mlx5_1:1), "
                                             f"got {text!r}")
        ports.append((device, port))
    return tuple(ports)


def _argv(text: str) -> tuple[str, ...]:
    try:
        argv = tuple(shlex.split(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"cannot split {text!r} into arguments: {exc}") from None
    if not argv or not argv[0]:
        raise argparse.ArgumentTypeError("the site command is empty")
    return argv


FUTURE_SLACK_SECONDS = 5.0  # a time typed as "now", or a clock a little ahead


def seconds_after_boot(text: str, now: float | None = None, monotonic: float | None = None) -> float:
    """``--xid-since``: seconds after boot as the kernel log counts them, from that number itself or
    from an ISO 8601 time with its zone (``2026-12-02T01:15:00Z``), through the current boot time.
    A time still to come is refused: every XID would be skipped and the check pass unseen."""
    uptime = time.monotonic() if monotonic is None else monotonic
    try:
        seconds = float(text)
    except ValueError:
        seconds = None
    if seconds is None:
        try:
            when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds after boot or an ISO 8601 time, got "
                                             f"{text!r}") from None
        if when.tzinfo is None:
            raise argparse.ArgumentTypeError(f"{text!r} has no time zone (add Z or +HH:MM)")
        seconds = max(when.timestamp() - ((time.time() if now is None else now) - uptime), 0.0)
    elif not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds after boot >= 0, got {text!r}")
    if seconds > uptime + FUTURE_SLACK_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} is {seconds - uptime:.0f} s in the future: no XID logged "
                                         "so far would count")
    return seconds


class _HelpWithDefaults(argparse.HelpFormatter):
    """Appends an option's default where it has one (argparse's own formatter also prints None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) \
                and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Check that this node's GPUs are fit to take jobs again: NVML sees every expected "
                    "GPU; no row remap pending or failed; no recovery action requested; NVLink fabric "
                    "registered (where there is one); the expected InfiniBand/RoCE ports up at their "
                    "rate; ECC on; no XID in the kernel log since the last reset; sane temperatures; "
                    "optionally DCGM's diagnostic and a site command.",
        epilog="Exit status: 0 every check passed, 1 a check failed, 2 nothing could be checked "
               "(bad usage, NVML unavailable). The verdict is printed on stdout as JSON "
               "(exporter/VALIDATE.md); logs go to stderr.",
        formatter_class=_HelpWithDefaults)
    add = parser.add_argument
    add("--backend", choices=BACKENDS, default="nvml", help="real NVML, or the simulator")
    add("--sim-scenario", "--scenario", dest="sim_scenario", type=Path, metavar="FILE",
        help="simulator scenario (YAML, as for gpuhealth-exporter); faults with start 0 and precursor 0 "
             "are there from the first query (default: 8 healthy H100s)")
    add("--sim-profile", choices=sorted(PROFILES), help="simulated hardware (default h100-sxm)")
    add("--sim-mig", action="store_true", help="simulate MIG mode inside a container")
    add("--gpus-expected", type=_gpu_count, metavar="N",
        help="GPUs this node must have (by default: NVIDIA GPUs on the PCI bus, else the count NVML sees)")
    add("--path.sysfs", dest="sysfs", type=Path, metavar="DIR",
        help="sysfs mount point where the expected GPUs are counted and the NIC ports read (default /sys; "
             "with sim, the simulator's own tree)")
    add("--nic-ports", type=_nic_ports, metavar="LIST",
        help="InfiniBand/RoCE ports that must be up, HCA[:PORT] separated by commas (mlx5_0,mlx5_1:1); "
             "with only --nic-rate-gbps, every port found")
    add("--nic-rate-gbps", type=_positive, metavar="GBPS",
        help="rate every checked port must run at, in Gb/s (400 for NDR)")
    add("--kmsg-path", type=Path, metavar="PATH",
        help="kernel log: /dev/kmsg (default with nvml; needs root or CAP_SYSLOG) or a file in kmsg or "
             "plain format; with sim, a temporary file the simulator writes")
    add("--no-kmsg", action="store_true", help="do not read the kernel log (the xid check is skipped)")
    add("--xid-since", type=seconds_after_boot, metavar="WHEN",
        help="count XIDs logged after WHEN: seconds after boot, or an ISO 8601 time with zone such as "
             "the time of the GPU reset (default: since boot). Plain-text logs carry no time: every "
             "line counts")
    add("--xid-ignore", type=_xids, default=",".join(map(str, APPLICATION_XIDS)), metavar="LIST",
        help="XIDs that do not fail validation, comma-separated ('' counts every XID); the default is "
             "NVIDIA's restart-the-application bucket")
    add("--idle-temperature-max", type=_positive, default=Options.idle_temperature_max, metavar="CELSIUS",
        help="highest sane temperature of an idle GPU")
    add("--busy-temperature-margin", type=_positive, default=Options.busy_temperature_margin,
        metavar="CELSIUS", help="a busy GPU must stay this far below its slowdown temperature")
    add("--nvml-timeout", type=_positive, default=Options.nvml_timeout, metavar="SECONDS",
        help="deadline for NVML's initialisation and for reading every GPU")
    add("--dcgm-level", type=int, choices=(1, 2, 3, 4), metavar="N",
        help="also run 'dcgmi diag -r N' (1 quick .. 4 extended) when DCGM is installed")
    add("--dcgmi", metavar="PATH", help="dcgmi binary (default: the one on PATH)")
    add("--dcgm-timeout", type=_positive, metavar="SECONDS",
        help="deadline of the DCGM diagnostic (by level: 120, 600, 3600, 7200)")
    add("--site-command", type=_argv, metavar="COMMAND",
        help="also run this command (e.g. an NCCL all-reduce); exit 0 passes. Split into arguments "
             "like a shell would, but no shell runs it: no pipes, variables or globs")
    add("--site-timeout", type=_positive, default=Options.site_timeout, metavar="SECONDS",
        help="deadline of the site command; its whole process group is killed after it")
    add("--log-level", choices=("debug", "info", "warning", "error"), default="warning",
        help="what goes to stderr")
    add("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    if args.backend != "sim" and (args.sim_scenario or args.sim_profile or args.sim_mig):
        parser.error("--sim-scenario, --sim-profile and --sim-mig need --backend sim")
    if args.no_kmsg and args.kmsg_path:
        parser.error("--kmsg-path and --no-kmsg contradict each other")
    if args.dcgm_level is None and (args.dcgmi or args.dcgm_timeout):
        parser.error("--dcgmi and --dcgm-timeout need --dcgm-level")
    started, clock = datetime.datetime.now(datetime.UTC), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuhealth-validate-") as tmp:
        kmsg = args.kmsg_path
        if kmsg is None and not args.no_kmsg:
            kmsg = Path(tmp) / "kmsg" if args.backend == "sim" else Path("/dev/kmsg")
        sim_sysfs = Path(tmp) / "sys" if args.backend == "sim" and args.sysfs is None else None
        try:
            nvml = load_nvml(args.backend, kmsg, args.sim_scenario, args.sim_profile, args.sim_mig, sim_sysfs)
        except ScenarioError as exc:
            for problem in exc.problems:
                print(f"{PROG}: {args.sim_scenario}: {problem}", file=sys.stderr)
            return EXIT_CANNOT_CHECK
        except ImportError as exc:  # no nvidia-ml-py in this environment
            print(f"{PROG}: cannot load NVML's Python binding: {exc}", file=sys.stderr)
            return EXIT_CANNOT_CHECK
        sysfs = args.sysfs or sim_sysfs or Path("/sys")
        wants_nics = args.nic_ports is not None or args.nic_rate_gbps is not None
        options = Options(
            gpus_expected=args.gpus_expected,
            sysfs=sysfs,
            nic_ports=NicPorts(sysfs, args.nic_ports or (), args.nic_rate_gbps) if wants_nics else None,
            kernel_log=None if kmsg is None else KernelLog(kmsg, args.xid_since or 0.0, args.xid_ignore),
            idle_temperature_max=args.idle_temperature_max,
            busy_temperature_margin=args.busy_temperature_margin, nvml_timeout=args.nvml_timeout,
            dcgm_level=args.dcgm_level, dcgmi=args.dcgmi, dcgm_timeout=args.dcgm_timeout,
            site_command=args.site_command or (), site_timeout=args.site_timeout)
        code, checks = validate(nvml, options)
    document = verdict(code, checks, args.backend, started, time.monotonic() - clock)
    print(json.dumps(document, ensure_ascii=False))
    for check in checks:
        if check.ok is False:
            log.warning("check failed name=%s detail=%s", check.name, check.detail)
    return code


if __name__ == "__main__":
    sys.exit(main())
