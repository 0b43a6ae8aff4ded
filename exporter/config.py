"""Settings from flags and an optional YAML file, validated with every problem listed at once.

Precedence: built-in defaults < the YAML file (``--config``) < command-line flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from gpuhealth.contract.files import parse_yaml, read_text
from gpuhealth.contract.validation import Location, Model
from gpuhealth.contract.validation import problems as listed
from gpuhealth.exporter.fabric_settings import FabricSettings
from gpuhealth.exporter.inventory import GPUS_PER_NODE_MAX
from gpuhealth.exporter.sim.profiles import PROFILES
from gpuhealth.exporter.web import CLIENT_AUTH_TYPES, TLS_VERSIONS, hash_problem
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo
from pydantic_core import PydanticCustomError

DEFAULT_PORT = 9835
BACKENDS = ("nvml", "sim")
UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its terminating NUL


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
    sim_control: Path | None = None  # the simulator's control socket (gpuhealth-sim-reset)
    log_level: str = "info"
    fabric: FabricSettings = field(default_factory=FabricSettings)

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


_WEB_KEYS = ("tls_cert_file", "tls_key_file", "basic_auth_users")


def read_yaml(path: Path, problems: list[str]) -> dict[str, Any]:
    """The YAML file as Settings field names: the ``web`` block's keys are lifted to the top (any
    other key stays under ``web``, to be reported there)."""
    try:
        data = parse_yaml(read_text(path)) or {}
    except OSError as exc:
        problems.append(f"{path}: cannot read: {exc.strerror}")
        return {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        problems.append(f"{path}: not valid YAML: {exc}")
        return {}
    if not isinstance(data, dict):
        problems.append(f"{path}: must be a mapping")
        return {}
    values = dict(data)
    web = values.pop("web", None)
    if isinstance(web, dict):
        values.update({key: value for key, value in web.items() if key in _WEB_KEYS})
        rest = {key: value for key, value in web.items() if key not in _WEB_KEYS}
        if rest:
            values["web"] = rest
    elif web is not None:
        values["web"] = web
    return values


def _path(value: Any) -> Any:
    if value == "":
        raise PydanticCustomError("path", "expected a path, got ''")
    if isinstance(value, str) and "\0" in value:  # no file has one: open() would raise ValueError later
        raise PydanticCustomError("path", "a path cannot hold a NUL byte, got {value}",
                                  {"value": ascii(value)})
    return value


def _relative_to_file(value: Path, info: ValidationInfo) -> Path:
    """A path in an exporter-toolkit web configuration is relative to that file, as the toolkit reads it."""
    base = (info.context or {}).get("base")
    return value if base is None or value.is_absolute() else Path(base) / value


def _readable_file(value: Path) -> Path:
    if not value.is_file():
        raise PydanticCustomError("path", "{path} is not a readable file", {"path": str(value)})
    return value


def _procfs(value: Path) -> Path:
    if not (value / "stat").is_file():
        raise PydanticCustomError("path", "{path} does not look like procfs (no stat file)",
                                  {"path": str(value)})
    return value


def _writable_dir(value: Path) -> Path:
    if not (value.is_dir() and os.access(value, os.W_OK)):
        raise PydanticCustomError("path", "{path} is not a writable directory", {"path": str(value)})
    return value


def _kmsg_parent(value: Path) -> Path:
    if not value.exists() and not value.parent.is_dir():
        raise PydanticCustomError("path", "{path} is not a directory", {"path": str(value.parent)})
    return value


def _socket_path(value: Path) -> Path:
    """A Unix socket to create: its folder exists and the path fits ``sun_path`` (108 bytes)."""
    if not value.parent.is_dir():
        raise PydanticCustomError("path", "{path} is not a directory", {"path": str(value.parent)})
    if len(os.fsencode(value)) > UNIX_PATH_MAX:
        raise PydanticCustomError("path", "a Unix socket path must be at most {limit} bytes",
                                  {"limit": UNIX_PATH_MAX})
    return value


def _listen(value: str) -> str:
    port = value.rpartition(":")[2]
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise PydanticCustomError("listen", "expected HOST:PORT or :PORT, got {value}",
                                  {"value": repr(value)})
    return value


def _collectors(value: dict[str, bool], info: ValidationInfo) -> dict[str, bool]:
    known: list[str] | None = (info.context or {}).get("collectors")
    if known is None:  # no registry to check against (the JSON Schema export)
        return value
    unknown = [name for name in value if name not in known]
    if unknown:
        raise PydanticCustomError("collector", "unknown collector {names} (known: {known})",
                                  {"names": ", ".join(map(repr, unknown)), "known": ", ".join(known)})
    return value


def _user_name(value: str) -> str:
    if not value or ":" in value or not value.isprintable():  # RFC 7617: the user-id ends at ':'
        raise PydanticCustomError("user", "user name {user} can never log in (empty, a ':' or a control "
                                  "character)", {"user": repr(value)})
    return value


def _password_hash(value: str) -> str:
    if (why := hash_problem(value)) is not None:
        raise PydanticCustomError("hash", "{why}", {"why": why})
    return value


Path_ = Annotated[Path, BeforeValidator(_path), Field(strict=False)]
ReadableFile = Annotated[Path_, AfterValidator(_readable_file)]
ToolkitFile = Annotated[Path_, AfterValidator(_relative_to_file), AfterValidator(_readable_file)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Users = dict[Annotated[str, AfterValidator(_user_name)], Annotated[str, AfterValidator(_password_hash)]]
LogLevel = Literal["debug", "info", "warning", "error"]


class WebBlock(Model):
    """The file's ``web`` block: TLS and basic authentication for /metrics."""

    tls_cert_file: ReadableFile | None = None
    tls_key_file: ReadableFile | None = None
    basic_auth_users: Users = Field(default_factory=dict)  # user name: bcrypt or pbkdf2_sha256 hash

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> list[tuple[Location, str]]:
        if ("tls_cert_file" in data) != ("tls_key_file" in data):
            return [((), "tls_cert_file and tls_key_file go together")]
        return []


Gbps = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Name = Annotated[str, Field(min_length=1)]


class FabricBlock(Model):
    """The file's ``fabric`` block: what the node's InfiniBand/RoCE ports should be."""

    # one rate for every port (400 for NDR), or a rate per HCA ({mlx5_0: 400, mlx5_4: 200})
    expected_rate_gbps: Gbps | dict[Name, Gbps] | None = None
    switches: dict[Name, Name] = Field(default_factory=dict)  # HCA -> the leaf switch the inventory names

    def settings(self) -> FabricSettings:
        rate = self.expected_rate_gbps
        if isinstance(rate, dict):
            return FabricSettings(expected_rate_by_device=dict(rate), switches=dict(self.switches))
        return FabricSettings(expected_rate_gbps=rate, switches=dict(self.switches))


class ExporterFile(Model):
    """The exporter's YAML file (``--config``), the long flag names with dots as underscores."""

    model_config = ConfigDict(json_schema_extra={"title": "gpuhealth-exporter configuration"})

    backend: Literal[BACKENDS] = "nvml"  # type: ignore[valid-type]  # from a table
    sim_scenario: ReadableFile | None = None
    kmsg_path: Annotated[Path_, AfterValidator(_kmsg_parent)] | None = None
    no_kmsg: bool = False
    listen: Annotated[str, AfterValidator(_listen)] = f":{DEFAULT_PORT}"
    state_dir: Annotated[Path_, AfterValidator(_writable_dir)] | None = None
    procfs: Annotated[Path_, AfterValidator(_procfs)] = Path("/proc")
    sysfs: Path_ | None = None
    sampling_interval: Seconds = 1.0
    sampling_window: Seconds = 15.0
    nvml_timeout: Seconds = 2.0
    gpus_expected: Annotated[int, Field(ge=0, le=GPUS_PER_NODE_MAX)] | None = None
    collectors: Annotated[dict[str, bool], AfterValidator(_collectors)] = Field(default_factory=dict)
    web_config_file: ReadableFile | None = None  # exporter-toolkit format; overrides the web block
    sim_profile: Literal[tuple(PROFILES)] | None = None  # type: ignore[valid-type]  # from a table
    sim_mig: bool = False
    sim_control: Annotated[Path_, AfterValidator(_socket_path)] | None = None
    log_level: Annotated[LogLevel, BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v)] = "info"
    web: WebBlock = WebBlock()
    fabric: FabricBlock = FabricBlock()

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> list[tuple[Location, str]]:
        found: list[tuple[Location, str]] = []
        simulated = data.get("backend", "nvml") == "sim"
        if "sim_scenario" in data and not simulated:
            found.append((("sim_scenario",), "only used with --backend sim"))
        if ("sim_profile" in data or data.get("sim_mig")) and not simulated:
            found.append((("sim_profile, sim_mig",), "only used with --backend sim"))
        if "sim_control" in data and not simulated:
            found.append((("sim_control",), "only used with --backend sim"))
        timeout, window = data.get("nvml_timeout", 2.0), data.get("sampling_window", 15.0)
        if _number(timeout) and _number(window) and timeout >= window:
            found.append((("nvml_timeout",), "must be shorter than sampling_window"))
        return found


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class ToolkitTLS(Model):
    cert_file: ToolkitFile
    key_file: ToolkitFile
    client_ca_file: ToolkitFile | None = None
    client_auth_type: Literal[tuple(CLIENT_AUTH_TYPES)] = "NoClientCert"  # type: ignore[valid-type]  # from a table
    min_version: Literal[tuple(TLS_VERSIONS)] = "TLS12"  # type: ignore[valid-type]  # from a table

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> list[tuple[Location, str]]:
        if data.get("client_auth_type") == "RequireAndVerifyClientCert" and "client_ca_file" not in data:
            return [((), "RequireAndVerifyClientCert needs client_ca_file")]
        return []


class ToolkitWebConfig(Model):
    """Prometheus exporter-toolkit's web configuration file, the part a Python TLS server can honour."""

    tls_server_config: ToolkitTLS | None = None
    basic_auth_users: Users = Field(default_factory=dict)
    http_server_config: dict[str, Any] = Field(default_factory=dict)  # HTTP/2 and headers: not applicable


def _web_config(path: Path, problems: list[str]) -> dict[str, Any]:
    """Settings fields from an exporter-toolkit file; its problems are named ``web_config_file...``."""
    try:
        data = parse_yaml(read_text(path)) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        problems.append(f"web_config_file: {path}: cannot read: {exc}")
        return {}
    try:
        web = ToolkitWebConfig.model_validate(data, context={"base": path.parent})
    except ValidationError as exc:
        problems.extend(listed(exc, "web_config_file"))
        return {}
    values: dict[str, Any] = {"basic_auth_users": web.basic_auth_users} if "basic_auth_users" in data else {}
    tls = web.tls_server_config
    if tls is not None:
        values.update(tls_cert_file=tls.cert_file, tls_key_file=tls.key_file,
                      tls_client_ca_file=tls.client_ca_file, tls_client_auth_type=tls.client_auth_type,
                      tls_min_version=tls.min_version)
    return values


def build_settings(file_values: dict[str, Any], flag_values: dict[str, Any], collector_names: list[str],
                   problems: list[str] | None = None) -> Settings:
    """Merge and validate; raise ConfigError listing every problem (including ``problems`` so far)."""
    problems = list(problems or [])
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    collectors = file_values.get("collectors") or {}
    if isinstance(collectors, dict):
        collectors = {**collectors, **(flag_values.get("collectors") or {})}
    merged["collectors"] = collectors
    web = merged.pop("web", {})
    lifted = {key: merged.pop(key) for key in _WEB_KEYS if key in merged}
    if isinstance(web, dict):
        web = {**web, **lifted}
    document = {**merged, "web": web} if web else merged
    try:
        parsed = ExporterFile.model_validate(document, context={"collectors": collector_names})
    except ValidationError as exc:
        problems.extend(listed(exc))
        raise ConfigError(problems) from None
    values = parsed.model_dump(exclude={"web", "fabric"})
    values.update(parsed.web.model_dump())
    values["fabric"] = parsed.fabric.settings()
    if parsed.web_config_file is not None:
        values.update(_web_config(parsed.web_config_file, problems))
    if problems:
        raise ConfigError(problems)
    return Settings(**values)
