"""The webhook's YAML configuration, validated at start-up with every problem listed at once.

Defaults are the safe choice: authentication on, a small circuit breaker, a cooldown per node, a
global rate limit, and undrain only of nodes this webhook drained.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import string
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from gpuhealth.contract.files import parse_yaml, read_text
from gpuhealth.contract.validation import Location, Model, problems
from gpuhealth.webhook.actions import ALERT_ACTIONS as ACTIONS
from gpuhealth.webhook.backends.command import NODE, template_errors
from gpuhealth.webhook.labels import SIGNAL
from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError

DEFAULT_PORT = 9836


class ConfigError(ValueError):
    """The configuration is unusable; ``errors`` lists every problem found."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(errors))
        self.errors = errors


def _relative_to_file(value: Path, info: ValidationInfo) -> Path:
    base = (info.context or {}).get("base", Path("."))
    return value if value.is_absolute() else Path(base) / value


# A path in the file; a relative one is relative to the configuration file's folder.
ConfigPath = Annotated[Path, Field(strict=False), AfterValidator(_relative_to_file)]
Action = Literal[ACTIONS]  # type: ignore[valid-type]  # the values come from the action table
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
SecondsOrZero = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(gt=0)]


def _regex(value: Any) -> re.Pattern[str]:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise PydanticCustomError("regex", "expected a regular expression, got {value}",
                                  {"value": repr(value)})
    try:
        return re.compile(str(value))  # a bare number (xid: 79) is its own expression
    except re.error as exc:
        raise PydanticCustomError("regex", "bad regular expression: {error}", {"error": str(exc)}) from None


Regex = Annotated[re.Pattern[str], PlainValidator(_regex),
                  WithJsonSchema({"type": ["string", "number"], "format": "regex"})]


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ``ValueError`` otherwise."""
    host, sep, port = value.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
    # a name, an IPv4 address, or an IPv6 one (between brackets or not: ":::9836" is "::", port 9836)
    plain = "[" not in host and "]" not in host and (":" not in host or _is_ipv6(host))
    if (not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536
            or not (bracketed or plain)):
        raise ValueError(f"listen: {value!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def _listen(value: str) -> str:
    try:
        parse_listen(value)
    except ValueError as exc:
        raise PydanticCustomError("listen", "{value} is not HOST:PORT", {"value": repr(value)}) from exc
    return value


class BasicAuth(Model):
    username: str
    password_file: ConfigPath


class OperatorAuth(Model):
    """Credentials for approve, cancel and breaker reset; the intake ones are then refused for those."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["token_file"]},
                                                           {"required": ["basic_auth"]}]})

    token_file: ConfigPath | None = None
    basic_auth: BasicAuth | None = None

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> list[tuple[Location, str]]:
        if "token_file" in data or "basic_auth" in data:
            return []
        return [((), "needs token_file, basic_auth or both")]


class AuthConfig(Model):
    disabled: bool = False
    token_file: ConfigPath | None = None  # None: <state_dir>/token, created with a random token if absent
    basic_auth: BasicAuth | None = None
    operator: OperatorAuth | None = None


class TLSConfig(Model):
    cert_file: ConfigPath
    key_file: ConfigPath
    client_ca_file: ConfigPath | None = None  # set: clients must present a certificate signed by it


class Rule(Model):
    """Alerts whose labels all fully match ``match`` (regular expressions) get ``action``."""

    match: dict[str, Regex] = Field(default_factory=dict)
    action: Action

    def matches(self, labels: dict[str, str]) -> bool:
        return all(p.fullmatch(labels.get(k, "")) for k, p in self.match.items())


class PolicyConfig(Model):
    action_label: str = "action"
    rules: Annotated[tuple[Rule, ...], Field(strict=False)] = ()
    default_action: Action = "none"  # for alerts with no action label (an unknown one is refused)


class GuardrailConfig(Model):
    breaker_max_nodes: Annotated[int, Field(ge=0)] = 2
    breaker_max_fraction: Annotated[float, Field(ge=0, le=1)] = 0.05
    requeue_breaker_max_nodes: Count = 5  # restart_job on more nodes than this in the window trips it
    requeue_breaker_window_seconds: Seconds = 600.0
    node_cooldown_seconds: SecondsOrZero = 3600.0
    rate_limit_actions: Count = 10
    rate_limit_window_seconds: Seconds = 600.0
    allow_nodes: Annotated[tuple[str, ...], Field(strict=False)] = ()  # globs; empty allows every node
    deny_nodes: Annotated[tuple[str, ...], Field(strict=False)] = ()
    # actions that wait for POST /actions/{id}/approve
    require_approval: Annotated[tuple[Action, ...], Field(strict=False)] = ()


class RetryConfig(Model):
    job_retry_interval_seconds: SecondsOrZero = 300.0
    job_max_attempts: Count = 3
    backend_max_attempts: Count = 5
    backoff_initial_seconds: Seconds = 2.0
    backoff_max_seconds: Seconds = 300.0


# gpuhealth-validate on the node, through ssh: {node} is one checked node name and the host argument,
# never part of the remote command line; BatchMode fails at once instead of asking for a password.
VALIDATE_OVER_SSH = ("ssh", "-o", "BatchMode=yes", "--", "{node}", "gpuhealth-validate")


def _health_check(value: Any) -> tuple[str, ...]:
    """An argv template with ``{node}`` (``{node!q}`` for a remote shell), or ``[]``: no check at all."""
    if isinstance(value, list | tuple) and not value:
        return ()
    errors = template_errors(list(value) if isinstance(value, tuple) else value, NODE)
    if errors:
        raise PydanticCustomError("template", "{errors}", {"errors": "; ".join(errors)})
    return tuple(value)


HealthCheck = Annotated[tuple[str, ...], PlainValidator(_health_check), PlainSerializer(list),
                        WithJsonSchema({"type": "array", "items": {"type": "string"},
                                        "description": "An argv list, no shell; placeholder {node} "
                                                       "({node!q}: quoted for a remote shell); [] runs "
                                                       "no check."})]


class UndrainConfig(Model):
    """How a node we drained returns to service: after its alerts resolved and ``health_check`` passed.

    The default runs ``gpuhealth-validate`` on the node over ssh; ``[]`` turns the check off (the node
    is resumed unchecked), any other argv replaces it. Exit 0 is healthy.
    """

    mode: Literal["auto", "manual"] = "auto"  # auto: resume nodes we drained once their alerts resolve
    health_check: HealthCheck = VALIDATE_OVER_SSH
    health_check_timeout_seconds: Seconds = 120.0
    health_check_retry_seconds: Seconds = 300.0
    health_check_max_attempts: Count = 3


def _database_url(value: str) -> str:
    if not re.fullmatch(r"postgres(ql)?://\S*", value):  # never echoed: a password may be in it
        raise PydanticCustomError("database_url", "expected a postgresql:// URL without spaces (the value "
                                  "is not shown: it may hold a password)")
    return value


def _replica(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}", value):
        raise PydanticCustomError("replica", "expected a name of letters, digits and ._:- (64 at most), got "
                                  "{value}", {"value": repr(value[:80])})
    return value


class JournalConfig(Model):
    """Where the journal lives: SQLite in ``state_dir`` (no ``url``) or PostgreSQL shared by replicas."""

    url: Annotated[str, AfterValidator(_database_url)] | None = None  # libpq URL; none: SQLite
    replica: Annotated[str, AfterValidator(_replica)] | None = None  # this webhook's name; default hostname
    lease_seconds: Seconds = 30.0  # a replica silent this long loses its actions to another one
    # PostgreSQL: a firing notification waits up to this long for others to share its commit (each
    # commit costs the database a fixed share); 0 (default): only those already waiting, as a window
    # lowers the CPU per alert but adds its wait to every answer, which costs a sender that waits for
    # each answer (Alertmanager) more than it saves on a machine with CPU to spare
    commit_window_seconds: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0


class CheckpointConfig(Model):
    """How ``checkpoint_drain`` (a predictive alert: the GPU still works) saves the node's jobs first.

    Each job is signalled (Slurm: ``scancel --signal=<signal> --<target> JOB``); the drain waits up to
    ``grace_seconds`` for every job to confirm, then goes ahead whether or not they all did. A job's own
    exit always confirms; ``confirm`` adds a checkpoint file newer than the signal (``path``: a file or a
    folder, ``{job_id}`` filled in) or a job comment matching ``comment``.
    """

    signal: Annotated[str, Field(pattern=f"^(?:{SIGNAL.pattern})$")] = "USR1"
    target: Literal["batch", "full"] = "batch"  # batch: the batch script only; full: every step too
    grace_seconds: SecondsOrZero = 120.0
    poll_seconds: Seconds = 1.0
    confirm: Literal["exit", "file", "comment"] = "exit"
    path: str | None = None  # for confirm: file; e.g. /shared/ckpt/job-{job_id}
    comment: Regex = re.compile(r".*checkpoint.*")  # for confirm: comment (matched anywhere)

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> list[tuple[Location, str]]:
        found: list[tuple[Location, str]] = []
        path = data.get("path")
        if data.get("confirm") == "file" and not path:
            found.append((("path",), "required with confirm: file (a file or folder; {job_id} is filled in)"))
        if isinstance(path, str):
            try:
                fields = {f for _, f, _, _ in string.Formatter().parse(path) if f is not None}
            except ValueError:
                fields = {"?"}
            if fields - {"job_id"}:
                found.append((("path",), "the only placeholder is {job_id} (write {{ and }} for braces)"))
        return found


DEFAULT_STEP_TIMEOUT_SECONDS = 3600.0  # for a step step_timeout_seconds does not name


class EscalationConfig(Model):
    """The escalation chain: per node and GPU, each step's action is verified after it ends, and a
    failed verification, a timeout or the same alert firing again starts the next, stronger step.

    Off by default: on, the webhook resets GPUs and reboots nodes of its own accord (through every
    guardrail, as an alert's action would).
    """

    enabled: bool = False
    steps: Annotated[tuple[Action, ...], Field(strict=False, min_length=1)] = (
        "restart_job", "drain_reset_gpu", "drain_reboot", "replace")
    # how long each step's verification may take, from the end of its action; longer than the alert's
    # own time to resolve (the XID alerts' increase window), or a fixed problem still escalates
    step_timeout_seconds: dict[Action, Seconds] = Field(default_factory=lambda: {
        "restart_job": 1800.0, "drain_reset_gpu": 3600.0, "drain_reboot": 3600.0})
    settle_seconds: SecondsOrZero = 120.0  # after a step's action ends, before its first verification
    window_seconds: Seconds = 3600.0  # the same alert firing again this soon after a step fails the step
    poll_seconds: Seconds = 15.0  # a verification that neither passed nor failed is tried again after this

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> list[tuple[Location, str]]:
        found: list[tuple[Location, str]] = []
        steps = data.get("steps")
        if isinstance(steps, list | tuple) and all(isinstance(s, str) and s in ACTIONS for s in steps):
            if "none" in steps:
                found.append((("steps",), "none is not a step (it does nothing to escalate)"))
            order = [ACTIONS.index(s) for s in steps]
            if order != sorted(set(order)):
                found.append((("steps",), "each step must be stronger than the one before it, in the order "
                                          + ", ".join(a for a in ACTIONS if a != "none")))
            timeouts = data.get("step_timeout_seconds")
            if isinstance(timeouts, dict):
                for name in sorted(set(timeouts) - set(steps)):
                    found.append((("step_timeout_seconds", name), "not one of the steps"))
        return found

    def timeout(self, step: str) -> float:
        return self.step_timeout_seconds.get(step, DEFAULT_STEP_TIMEOUT_SECONDS)


class AnnounceConfig(Model):
    """Where action transitions are told: the audit log always, Alertmanager when URLs are given."""

    audit_log: ConfigPath | None = None  # JSON lines; None: <state_dir>/audit.jsonl
    alertmanager_urls: Annotated[tuple[Annotated[str, Field(pattern=r"^https?://[^\s]+$")], ...],
                                 Field(strict=False)] = ()  # every member of an HA pair
    resolve_after_seconds: Seconds = 3600.0  # an outcome alert stands this long, then resolves
    timeout_seconds: Seconds = 5.0


class Config(Model):
    """The whole file. ``backend`` stays a mapping: the backend named by its ``type`` validates it."""

    model_config = ConfigDict(json_schema_extra={"title": "gpuhealth-webhook configuration"})

    listen: Annotated[str, AfterValidator(_listen)] = f"0.0.0.0:{DEFAULT_PORT}"
    state_dir: ConfigPath = Path("/var/lib/gpuhealth-webhook")
    dry_run: bool = False
    max_body_bytes: Count = 8 * 1024 * 1024
    journal_busy_timeout_seconds: Seconds = 5.0  # then answer 503 and let Alertmanager retry
    journal_retention_days: Annotated[float, Field(gt=0)] = 90.0  # finished history older is pruned
    journal: JournalConfig = JournalConfig()
    connection_idle_timeout_seconds: Seconds = 15.0  # a connection with no request for this long closes
    connection_limit: Count = 512  # open connections at most; at the cap the oldest idle one closes
    auth: AuthConfig = AuthConfig()
    tls: TLSConfig | None = None
    backend: Annotated[dict[str, Any], Field(json_schema_extra={"required": ["type"]})]
    policy: PolicyConfig = PolicyConfig()
    guardrails: GuardrailConfig = GuardrailConfig()
    retry: RetryConfig = RetryConfig()
    undrain: UndrainConfig = UndrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    escalation: EscalationConfig = EscalationConfig()
    announce: AnnounceConfig = AnnounceConfig()

    @property
    def listen_host(self) -> str:
        return parse_listen(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return parse_listen(self.listen)[1]

    @property
    def journal_path(self) -> Path:
        return self.state_dir / "journal.sqlite3"

    @property
    def replica(self) -> str:
        return self.journal.replica or socket.gethostname()

    @property
    def audit_log_path(self) -> Path:
        return self.announce.audit_log or self.state_dir / "audit.jsonl"

    @property
    def token_path(self) -> Path | None:
        if self.auth.disabled or (self.auth.basic_auth is not None and self.auth.token_file is None):
            return None
        return self.auth.token_file or self.state_dir / "token"


def parse_config(data: Any, base: Path = Path("."),
                 check_backend: Callable[[dict[str, Any]], list[str]] | None = None) -> Config:
    """Build a ``Config`` from parsed YAML; relative paths are relative to ``base``.

    ``check_backend`` validates the backend section, so that its problems are listed with the rest.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"the file must be a mapping, got {type(data).__name__}"])
    errors: list[str] = []
    config = None
    try:
        config = Config.model_validate(data, context={"base": base})
    except ValidationError as exc:
        errors = problems(exc)
    if isinstance(data.get("backend"), dict) and check_backend is not None:
        errors.extend(check_backend(data["backend"]))
    if errors or config is None:
        raise ConfigError(errors)
    return config


def load_config(path: Path, check_backend: Callable[[dict[str, Any]], list[str]] | None = None) -> Config:
    """Read and validate ``path``; ``ConfigError`` for a missing file, bad YAML or bad values."""
    try:
        data = parse_yaml(read_text(path))
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    return parse_config(data, Path(path).resolve().parent, check_backend)
