"""Settings from flags and an optional YAML file, validated with every problem listed at once.

Precedence: built-in defaults < the YAML file (``--config``) < command-line flags.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from gpuhealth.exporter.sim.profiles import PROFILES
from gpuhealth.exporter.web import CLIENT_AUTH_TYPES, TLS_VERSIONS, hash_problem

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
    tls_client_ca_file: Path | None = None
    tls_client_auth_type: str = "NoClientCert"
    tls_min_version: str = "TLS12"
    basic_auth_users: dict[str, str] = field(default_factory=dict)
    web_config_file: Path | None = None  # exporter-toolkit format; overrides the web block
    sim_profile: str | None = None
    sim_mig: bool = False
    log_level: str = "info"

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


_PATHS = {"sim_scenario", "kmsg_path", "state_dir", "procfs", "sysfs", "tls_cert_file", "tls_key_file",
          "tls_client_ca_file", "web_config_file"}
_FLOATS = {"sampling_interval", "sampling_window", "nvml_timeout"}
_BOOLS = {"no_kmsg", "sim_mig"}
_WEB_KEYS = {"tls_cert_file", "tls_key_file", "basic_auth_users"}
_FROM_WEB_CONFIG_ONLY = {"tls_client_ca_file", "tls_client_auth_type", "tls_min_version"}


def read_yaml(path: Path, problems: list[str]) -> dict[str, Any]:
    """Flatten the YAML file to Settings field names (the ``web`` block included)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        problems.append(f"{path}: cannot read: {exc.strerror}")
        return {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        problems.append(f"{path}: not valid YAML: {exc}")
        return {}
    if not isinstance(data, dict):
        problems.append(f"{path}: must be a mapping")
        return {}
    known = {f.name for f in fields(Settings)} - _WEB_KEYS - _FROM_WEB_CONFIG_ONLY
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


def _type_problem(key: str, value: Any) -> str | None:
    """Strict YAML types: a quoted "false" is not false, 2.9 GPUs are not 2, NaN is not a duration."""
    if key in _PATHS:
        return None if isinstance(value, str | Path) and str(value) else "expected a path"
    if key in _FLOATS:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or value <= 0:
            return "expected a positive number of seconds"
    elif key == "gpus_expected":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return "expected a whole number of GPUs, 0 or more"
    elif key in _BOOLS and not isinstance(value, bool):
        return "expected true or false"
    elif key == "collectors" and isinstance(value, dict) and \
            not all(isinstance(v, bool) for v in value.values()):
        return "expected a mapping of collector name: true/false"
    elif key == "basic_auth_users" and isinstance(value, dict) and \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return "expected a mapping of user name: password hash, both strings"
    return None


def _apply_web_config(settings: Settings, path: Path, problems: list[str]) -> None:
    """Prometheus exporter-toolkit's web configuration file: ``tls_server_config``, ``basic_auth_users``."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        problems.append(f"web_config_file: {path}: cannot read: {exc}")
        return
    if not isinstance(data, dict):
        problems.append(f"web_config_file: {path}: must be a mapping")
        return
    for key in data:
        if key not in ("tls_server_config", "basic_auth_users", "http_server_config"):
            problems.append(f"web_config_file: unknown key {key!r}")
    tls = data.get("tls_server_config") or {}
    if not isinstance(tls, dict):
        problems.append("web_config_file: tls_server_config must be a mapping")
        tls = {}
    known_tls = {"cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version"}
    for key in tls:
        if key not in known_tls:
            problems.append(f"web_config_file: tls_server_config.{key} is not supported "
                            f"(supported: {', '.join(sorted(known_tls))})")
    for key, field_name in (("cert_file", "tls_cert_file"), ("key_file", "tls_key_file"),
                            ("client_ca_file", "tls_client_ca_file")):
        if key in tls:
            setattr(settings, field_name, path.parent / str(tls[key]))  # relative to the file, as toolkit
    settings.tls_client_auth_type = str(tls.get("client_auth_type", settings.tls_client_auth_type))
    settings.tls_min_version = str(tls.get("min_version", settings.tls_min_version))
    users = data.get("basic_auth_users")
    if users is not None:
        if _type_problem("basic_auth_users", users) is not None or not isinstance(users, dict):
            problems.append("web_config_file: basic_auth_users: expected a mapping of user name: hash")
        else:
            settings.basic_auth_users = users


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
        why = _type_problem(key, value)
        if why is not None:
            shown = "a mapping" if key == "basic_auth_users" else repr(value)  # never echo hashes
            problems.append(f"{key}: {why}, got {shown}")
            continue
        if key in _PATHS:
            value = Path(value)
        elif key in _FLOATS:
            value = float(value)
        setattr(settings, key, value)
    if settings.web_config_file is not None and settings.web_config_file.is_file():
        _apply_web_config(settings, settings.web_config_file, problems)
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
    if s.web_config_file is not None and not s.web_config_file.is_file():
        problems.append(f"web_config_file: {s.web_config_file} is not a readable file")
    if s.tls_client_ca_file is not None and not s.tls_client_ca_file.is_file():
        problems.append(f"tls_server_config.client_ca_file: {s.tls_client_ca_file} is not a readable file")
    if s.tls_client_auth_type not in CLIENT_AUTH_TYPES:
        problems.append(f"tls_server_config.client_auth_type: {s.tls_client_auth_type!r} is not one of "
                        f"{', '.join(CLIENT_AUTH_TYPES)}")
    elif s.tls_client_auth_type == "RequireAndVerifyClientCert" and s.tls_client_ca_file is None:
        problems.append("tls_server_config: RequireAndVerifyClientCert needs client_ca_file")
    if s.tls_min_version not in TLS_VERSIONS:
        problems.append(f"tls_server_config.min_version: {s.tls_min_version!r} is not one of "
                        f"{', '.join(TLS_VERSIONS)}")
    if s.sim_profile is not None and s.sim_profile not in PROFILES:
        problems.append(f"sim_profile: {s.sim_profile!r} is not one of {', '.join(PROFILES)}")
    if (s.sim_profile is not None or s.sim_mig) and s.backend != "sim":
        problems.append("sim_profile, sim_mig: only used with --backend sim")
    if not isinstance(s.basic_auth_users, dict):
        problems.append("web.basic_auth_users: expected a mapping of user: password hash")
    else:
        for user, hashed in s.basic_auth_users.items():
            if not user or ":" in user or not user.isprintable():  # RFC 7617: the user-id ends at ':'
                problems.append(f"web.basic_auth_users: user name {user!r} can never log in (empty, a ':' "
                                "or a control character)")
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
