"""``gpuhealth-exporter``: command line, start-up checks, signal handling."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import getpass
import logging
import resource
import shutil
import signal
import ssl
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuhealth.exporter import __version__
from gpuhealth.exporter.collector import Context, assemble, load_collectors
from gpuhealth.exporter.config import DEFAULT_PORT, ConfigError, Settings, build_settings, read_yaml
from gpuhealth.exporter.fabric_settings import FabricSettings
from gpuhealth.exporter.metrics import SPECS
from gpuhealth.exporter.nvml_backend import load_nvml
from gpuhealth.exporter.sampler import SWITCH_INTERVAL_SECONDS, Sampler
from gpuhealth.exporter.sim.control import ControlServer
from gpuhealth.exporter.sim.fabric import NIC_RATE_GBPS
from gpuhealth.exporter.sim.profiles import PROFILES
from gpuhealth.exporter.web import hash_password, make_server, tls_context
from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger("gpuhealth.exporter")


def build_parser(collector_names: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuhealth-exporter",
        description="Prometheus exporter of GPU health features: NVML telemetry sampled every second, "
                    "XID events from NVML and the kernel log, host and NFS client figures.",
        epilog="Flags override the YAML file given with --config. SIGHUP reloads the --sim-scenario file.",
    )
    add = parser.add_argument
    add("--backend", choices=("nvml", "sim"), help="real NVML, or the simulator for machines without "
        "GPUs (default: nvml)")
    add("--sim-scenario", metavar="FILE", help="simulator scenario (YAML); default: 8 healthy H100s")
    add("--sim-profile", choices=sorted(PROFILES), help="simulated hardware: model, memory, NVLink "
        "generation and which queries answer (default h100-sxm; sets the scenario's model and NVLinks)")
    add("--sim-control", metavar="SOCKET", help="serve the simulator's control socket here (mode 0600), "
        "through which gpuhealth-sim-reset resets a simulated GPU as nvidia-smi -r does")
    add("--sim-mig", action="store_true", default=None, help="simulate MIG mode inside a container: no "
        "utilisation, NoPermission on some queries")
    add("--kmsg-path", metavar="PATH", help="kernel log to follow: /dev/kmsg (default with nvml) or a "
        "file in kmsg or plain format; with sim, the simulator also writes its kernel lines there")
    add("--no-kmsg", action="store_true", default=None, help="do not read the kernel log")
    add("--listen", metavar="HOST:PORT", help=f"address to serve on (default :{DEFAULT_PORT})")
    add("--config", metavar="FILE", help="YAML settings file (keys: the long flag names with _)")
    add("--state-dir", metavar="DIR", help="where to keep the last kernel log sequence number, so that "
        "a restart does not count old events again (default: skip what is in the log at start-up)")
    add("--path.procfs", dest="procfs", metavar="DIR", help="procfs mount point (default /proc)")
    add("--path.sysfs", dest="sysfs", metavar="DIR", help="sysfs mount point, where the expected GPUs are "
        "counted on the PCI bus and the NICs are read (default /sys with --backend nvml; the simulator "
        "writes its own tree)")
    add("--sampling.interval", dest="sampling_interval", type=float, metavar="SECONDS",
        help="how often collectors sample (default 1)")
    add("--sampling.window", dest="sampling_window", type=float, metavar="SECONDS",
        help="window of the max-over-window features, about the scrape interval (default 15)")
    add("--nvml.timeout", dest="nvml_timeout", type=float, metavar="SECONDS",
        help="deadline for one GPU's NVML sample before it counts as a timeout (default 2)")
    add("--gpus-expected", type=int, metavar="N", help="GPUs this node should have (default: NVIDIA GPUs "
        "on the PCI bus, else the count NVML sees first)")
    add("--web.config.file", dest="web_config_file", metavar="FILE", help="Prometheus exporter-toolkit web "
        "configuration (tls_server_config, basic_auth_users with bcrypt hashes)")
    add("--web.tls-cert-file", dest="tls_cert_file", metavar="FILE", help="serve HTTPS with this certificate")
    add("--web.tls-key-file", dest="tls_key_file", metavar="FILE", help="private key of the certificate")
    add("--log-level", choices=("debug", "info", "warning", "error"), help="default info")
    add("--hash-password", action="store_true", help="read a password on stdin, print its hash for "
        "web.basic_auth_users, and exit")
    group = parser.add_argument_group("collectors")
    for name, help_text in collector_names.items():
        group.add_argument(f"--collector.{name}", dest=f"collector_{name}", action="store_true", default=None,
                           help=f"enable: {help_text}")
        group.add_argument(f"--no-collector.{name}", dest=f"collector_{name}", action="store_false",
                           help="disable it")
    return parser


def _settings(argv: list[str] | None) -> tuple[Settings | None, argparse.Namespace]:
    registrations = load_collectors()
    parser = build_parser({name: reg.help for name, reg in registrations.items()})
    args = parser.parse_args(argv)
    if args.hash_password:
        return None, args
    problems: list[str] = []
    file_values = read_yaml(Path(args.config), problems) if args.config else {}
    flags = {k: v for k, v in vars(args).items()
             if k not in ("config", "hash_password") and not k.startswith("collector_")}
    flags["collectors"] = {name: getattr(args, f"collector_{name}") for name in registrations
                           if getattr(args, f"collector_{name}") is not None}
    return build_settings(file_values, flags, list(registrations), problems), args


def _nvml_module(settings: Settings, kmsg_path: Path | None, sim_sysfs: Path | None) -> Any:
    """The NVML module for the backend, not yet initialised: the gpu collector initialises it under
    a deadline and keeps retrying, so a node with a broken driver still exports ``gpuhealth_nvml_up 0``."""
    return load_nvml(settings.backend, kmsg_path, settings.sim_scenario, settings.sim_profile,
                     settings.sim_mig, sim_sysfs)


def _fabric(settings: Settings, nvml: Any) -> FabricSettings:
    """The fabric settings; the simulator's node has its own fabric manager (a pid file in its tree,
    no systemd unit) and, unless configured, expects the rate its NICs were built for."""
    if settings.backend != "sim" or settings.sysfs is not None:
        return settings.fabric
    fabric = dataclasses.replace(settings.fabric, systemctl=(), manager_pid_file=nvml.fabric_manager_pid_file)
    if fabric.expected_rate_gbps is None and not fabric.expected_rate_by_device:
        fabric = dataclasses.replace(fabric, expected_rate_gbps=NIC_RATE_GBPS)
    return fabric


def _build_info(backend: str) -> Callable[[], list[Metric]]:
    def families() -> list[Metric]:
        name = "gpuhealth_exporter_build_info"
        family = GaugeMetricFamily(name, SPECS[name].help, labels=["version", "backend"])
        family.add_metric([__version__, backend], 1)
        return [family]
    return families


def _raise_file_limit() -> None:
    """Soft file limit up to the hard one, as Go programs do: sockets and NVML share it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.info("file limit unchanged soft=%d hard=%d error=%s", soft, hard, exc)


def run(settings: Settings) -> int:
    """Serve until SIGTERM or SIGINT; the simulator's private directory goes with it."""
    tmpdir = Path(tempfile.mkdtemp(prefix="gpuhealth-sim-")) if settings.backend == "sim" else None
    try:
        return _serve(settings, tmpdir)
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _serve(settings: Settings, tmpdir: Path | None) -> int:
    from gpuhealth.exporter.sim.scenario import ScenarioError, load_scenario

    kmsg_path = settings.kmsg_path
    if kmsg_path is None and not settings.no_kmsg:
        kmsg_path = tmpdir / "kmsg" if tmpdir is not None else Path("/dev/kmsg")
    # the simulator writes its node's PCI tree and InfiniBand ports here, for the collectors to read
    sim_sysfs = tmpdir / "sys" if tmpdir is not None and settings.sysfs is None else None
    try:
        nvml = _nvml_module(settings, kmsg_path, sim_sysfs)
    except ScenarioError as exc:
        for problem in exc.problems:
            print(f"gpuhealth-exporter: {settings.sim_scenario}: {problem}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"gpuhealth-exporter: cannot use the kernel log {kmsg_path}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    sysfs = settings.sysfs or sim_sysfs or Path("/sys")
    ctx = Context(nvml=nvml, procfs=settings.procfs, sysfs=sysfs,
                  kmsg_path=None if settings.no_kmsg else kmsg_path, state_dir=settings.state_dir,
                  gpus_expected=settings.gpus_expected, window_seconds=settings.sampling_window,
                  nvml_timeout_seconds=settings.nvml_timeout, fabric=_fabric(settings, nvml))
    collectors, steps = assemble(ctx, settings.collectors)
    sampler = Sampler(collectors, _build_info(settings.backend), settings.sampling_interval, steps=steps)
    host, port = settings.host_port
    try:
        tls = None if settings.tls_cert_file is None else tls_context(
            settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file,
            settings.tls_client_auth_type, settings.tls_min_version)
        server = make_server(host, port, sampler, users=settings.basic_auth_users, tls=tls)
    except (OSError, ssl.SSLError) as exc:
        print(f"gpuhealth-exporter: cannot serve on {settings.listen}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    try:
        control = None if settings.sim_control is None else ControlServer(settings.sim_control, nvml)
    except OSError as exc:
        print(f"gpuhealth-exporter: cannot serve the control socket {settings.sim_control}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def reload(*_: object) -> None:
        if settings.backend != "sim":
            log.info("SIGHUP ignored backend=%s", settings.backend)
            return
        try:
            nvml.reload(load_scenario(settings.sim_scenario))
            log.info("scenario reloaded path=%s", settings.sim_scenario)
        except (ScenarioError, ValueError) as exc:
            log.error("scenario reload failed, keeping the old one error=%s", exc)

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, reload)
    _raise_file_limit()
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)  # each GIL wait of a scrape that meets a run
    sampler.start()
    # What start-up and the first run built (modules, caches, identities) lives as long as the process;
    # frozen, a full collection no longer walks it while holding the GIL (35 ms of CPU on an 8-GPU B200
    # simulator, a scrape's worst case).
    gc.freeze()
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log.info("listening address=%s:%d backend=%s collectors=%s kmsg=%s tls=%s", host or "*", port,
             settings.backend, ",".join(collectors), ctx.kmsg_path, settings.tls_cert_file is not None)
    while not stop.wait(1.0):
        pass
    log.info("shutting down")
    server.shutdown()
    if control is not None:
        control.close()
    sampler.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        settings, _ = _settings(argv)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"gpuhealth-exporter: {problem}", file=sys.stderr)
        return 2
    if settings is None:
        password = getpass.getpass("password: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\n")
        print(hash_password(password))
        return 0
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
