"""Settings from flags and an optional YAML file, validated with every problem listed at once.

Precedence: built-in defaults < the YAML file (``--config``) < command-line flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from gpuhealth.exporter.web import hash_problem

DEFAULT_PORT = 9835
BACKENDS = ("nvml", "sim")


class ConfigError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass
class Settings:
    backend: str = "nvml"
    sim_scenario: Path | None = None
    kmsg_path: Path | None = None   # None: /dev/kmsg for nvml, a temporary file for sim
    no_kmsg: bool = False
    listen: str = f":{DEFAULT_PORT}"
    state_dir: Path | None = None
    procfs: Path = Path("/proc")
    sysfs: Path | None = None       # None: /sys for nvml; the sim counts its own GPUs
    sampling_interval: float = 1.0
    sampling_window: float = 15.0
    nvml_timeout: float = 2.0
    gpus_expected: int | None = None
    collectors: dict[str, bool] = field(default_factory=dict)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    basic_auth_users: dict[str, str] = field(default_factory=dict)
    log_level: str = "info"

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


_PATHS = {"sim_scenario", "kmsg_path", "state_dir", "procfs", "sysfs", "tls_cert_file", "tls_key_file"}
_FLOATS = {"sampling_interval", "sampling_window", "nvml_timeout"}
_WEB_KEYS = {"tls_cert_file", "tls_key_file", "basic_auth_users"}


def read_yaml(path: Path, problems: list[str]) -> dict[str, Any]:
    """Flatten the YAML file to Settings field names (the ``web`` block included)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        problems.append(f"{path}: cannot read: {exc.strerror}")
        return {}
    except yaml.YAMLError as exc:
        problems.append(f"{path}: not valid YAML: {exc}")
        return {}
    if not isinstance(data, dict):
        problems.append(f"{path}: must be a mapping")
        return {}
    known = {f.name for f in fields(Settings)} - _WEB_KEYS
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "web" and isinstance(value, dict):
            for web_key, web_value in value.items():
                if web_key in _WEB_KEYS:
                    values[web_key] = web_value
                else:
                    problems.append(f"{path}: unknown key web.{web_key} "
                                    f"(known: {', '.join(sorted(_WEB_KEYS))})")
        elif key in known:
            values[key] = value
        else:
            problems.append(f"{path}: unknown key {key!r} (known: {', '.join(sorted(known | {'web'}))})")
    return values


def build_settings(file_values: dict[str, Any], flag_values: dict[str, Any], collector_names: list[str],
                   problems: list[str] | None = None) -> Settings:
    """Merge and validate; raise ConfigError listing every problem (including ``problems`` so far)."""
    problems = list(problems or [])
    settings = Settings()
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    collectors = file_values.get("collectors") or {}
    if isinstance(collectors, dict):
        collectors = {**collectors, **(flag_values.get("collectors") or {})}
    merged["collectors"] = collectors
    for key, value in merged.items():
        try:
            if key in _PATHS:
                value = Path(value)
            elif key in _FLOATS:
                value = float(value)
                if value <= 0:
                    raise ValueError
            elif key == "gpus_expected":
                value = int(value)
                if value < 0:
                    raise ValueError
        except (TypeError, ValueError):
            problems.append(f"{key}: invalid value {value!r}")
            continue
        setattr(settings, key, value)
    _check(settings, collector_names, problems)
    if problems:
        raise ConfigError(problems)
    return settings


def _check(s: Settings, collector_names: list[str], problems: list[str]) -> None:
    for key in ("backend", "listen", "log_level"):
        if not isinstance(getattr(s, key), str):
            problems.append(f"{key}: expected a string, got {getattr(s, key)!r}")
            setattr(s, key, getattr(Settings(), key))
    if not isinstance(s.collectors, dict):
        problems.append("collectors: expected a mapping of collector name: true/false")
        s.collectors = {}
    if s.backend not in BACKENDS:
        problems.append(f"backend: {s.backend!r} is not one of {', '.join(BACKENDS)}")
    if s.sim_scenario is not None and s.backend != "sim":
        problems.append("sim_scenario: only used with --backend sim")
    for name in s.collectors:
        if name not in collector_names:
            problems.append(f"collectors: unknown collector {name!r} (known: {', '.join(collector_names)})")
    port = s.listen.rpartition(":")[2]
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        problems.append(f"listen: expected HOST:PORT or :PORT, got {s.listen!r}")
    for key in ("sim_scenario", "tls_cert_file", "tls_key_file"):
        path = getattr(s, key)
        if path is not None and not path.is_file():
            problems.append(f"{key}: {path} is not a readable file")
    if (s.tls_cert_file is None) != (s.tls_key_file is None):
        problems.append("web: tls_cert_file and tls_key_file go together")
    if not isinstance(s.basic_auth_users, dict):
        problems.append("web.basic_auth_users: expected a mapping of user: password hash")
    else:
        for user, hashed in s.basic_auth_users.items():
            if (why := hash_problem(str(hashed))) is not None:
                problems.append(f"web.basic_auth_users.{user}: {why}")
    if not (s.procfs / "stat").is_file():
        problems.append(f"procfs: {s.procfs} does not look like procfs (no stat file)")
    if s.state_dir is not None and not (s.state_dir.is_dir() and os.access(s.state_dir, os.W_OK)):
        problems.append(f"state_dir: {s.state_dir} is not a writable directory")
    if s.kmsg_path is not None and not s.kmsg_path.exists() and not s.kmsg_path.parent.is_dir():
        problems.append(f"kmsg_path: {s.kmsg_path.parent} is not a directory")
    if s.nvml_timeout >= s.sampling_window:
        problems.append("nvml_timeout: must be shorter than sampling_window")
    if s.log_level.lower() not in ("debug", "info", "warning", "error"):
        problems.append(f"log_level: {s.log_level!r} is not one of debug, info, warning, error")
