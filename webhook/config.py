"""The webhook's YAML configuration, validated at start-up with every problem listed at once.

Defaults are the safe choice: authentication on, a small circuit breaker, a cooldown per node, a
global rate limit, and undrain only of nodes this webhook drained.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from gpuhealth.webhook.actions import ALERT_ACTIONS as ACTIONS

DEFAULT_PORT = 9836


class ConfigError(ValueError):
    """The configuration is unusable; ``errors`` lists every problem found."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class BasicAuth:
    username: str
    password_file: Path


@dataclass(frozen=True)
class OperatorAuth:
    """Credentials for approve, cancel and breaker reset; the intake ones are then refused for those."""

    token_file: Path | None = None
    basic_auth: BasicAuth | None = None


@dataclass(frozen=True)
class AuthConfig:
    disabled: bool = False
    token_file: Path | None = None  # None: <state_dir>/token, created with a random token if absent
    basic_auth: BasicAuth | None = None
    operator: OperatorAuth | None = None


@dataclass(frozen=True)
class TLSConfig:
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None  # set: clients must present a certificate signed by it


@dataclass(frozen=True)
class Rule:
    """Alerts whose labels all fully match ``match`` (regular expressions) get ``action``."""

    match: dict[str, re.Pattern[str]]
    action: str

    def matches(self, labels: dict[str, str]) -> bool:
        return all(p.fullmatch(labels.get(k, "")) for k, p in self.match.items())


@dataclass(frozen=True)
class PolicyConfig:
    action_label: str = "action"
    rules: tuple[Rule, ...] = ()
    default_action: str = "none"  # for alerts with no action label (an unknown one is refused)


@dataclass(frozen=True)
class GuardrailConfig:
    breaker_max_nodes: int = 2
    breaker_max_fraction: float = 0.05
    requeue_breaker_max_nodes: int = 5  # restart_job on more nodes than this in the window trips it
    requeue_breaker_window_seconds: float = 600.0
    node_cooldown_seconds: float = 3600.0
    rate_limit_actions: int = 10
    rate_limit_window_seconds: float = 600.0
    allow_nodes: tuple[str, ...] = ()  # glob patterns; empty allows every node
    deny_nodes: tuple[str, ...] = ()
    require_approval: tuple[str, ...] = ()  # actions that wait for POST /actions/{id}/approve


@dataclass(frozen=True)
class RetryConfig:
    job_retry_interval_seconds: float = 300.0
    job_max_attempts: int = 3
    backend_max_attempts: int = 5
    backoff_initial_seconds: float = 2.0
    backoff_max_seconds: float = 300.0


@dataclass(frozen=True)
class UndrainConfig:
    mode: str = "auto"  # auto: resume nodes we drained once their alerts resolve; manual: leave them
    health_check: tuple[str, ...] = ()  # argv; {node} is replaced; exit 0 means healthy
    health_check_timeout_seconds: float = 120.0
    health_check_retry_seconds: float = 300.0
    health_check_max_attempts: int = 3


@dataclass(frozen=True)
class Config:
    listen_host: str = "0.0.0.0"
    listen_port: int = DEFAULT_PORT
    state_dir: Path = Path("/var/lib/gpuhealth-webhook")
    dry_run: bool = False
    max_body_bytes: int = 8 * 1024 * 1024
    journal_busy_timeout_seconds: float = 5.0  # then answer 503 and let Alertmanager retry
    journal_retention_days: float = 90.0  # finished history older than this is pruned
    connection_idle_timeout_seconds: float = 15.0  # a connection with no request for this long is closed
    connection_limit: int = 512  # open connections at most; at the cap the oldest one not being served closes
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TLSConfig | None = None
    backend: dict[str, Any] = field(default_factory=lambda: {"type": "slurm"})
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    guardrails: GuardrailConfig = field(default_factory=GuardrailConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    undrain: UndrainConfig = field(default_factory=UndrainConfig)

    @property
    def journal_path(self) -> Path:
        return self.state_dir / "journal.sqlite3"

    @property
    def token_path(self) -> Path | None:
        if self.auth.disabled or (self.auth.basic_auth is not None and self.auth.token_file is None):
            return None
        return self.auth.token_file or self.state_dir / "token"


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ``ValueError`` otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"listen: {value!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


class _Section:
    """Typed reads from one mapping, collecting errors instead of stopping at the first."""

    def __init__(self, data: Any, path: str, errors: list[str], known: set[str]) -> None:
        self.path = path
        self.errors = errors
        if data is None:
            data = {}
        if not isinstance(data, dict):
            errors.append(f"{path}: must be a mapping")
            data = {}
        self.data = data
        for key in sorted(set(data) - known, key=str):
            errors.append(f"{self._name(key)}: unknown key")

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, kind: type | tuple[type, ...], default: Any, check: Any = None,
            expect: str = "") -> Any:
        if key not in self.data or self.data[key] is None:
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, float))
        if ok and check is not None:
            ok = check(value)
        if not ok:
            self.errors.append(f"{self._name(key)}: expected {expect or getattr(kind, '__name__', kind)}, "
                               f"got {value!r}")
            return default
        return value

    def strings(self, key: str, allowed: tuple[str, ...] | None = None) -> tuple[str, ...]:
        value = self.get(key, list, [], lambda v: all(isinstance(x, str) for x in v), "a list of strings")
        if allowed is not None:
            for item in value:
                if item not in allowed:
                    self.errors.append(f"{self._name(key)}: {item!r} is not one of {', '.join(allowed)}")
        return tuple(value)

    def path_value(self, key: str, base: Path) -> Path | None:
        value = self.get(key, str, None, expect="a path")
        return None if value is None else (base / value if not Path(value).is_absolute() else Path(value))


def _positive(v: float) -> bool:
    return v > 0


def _non_negative(v: float) -> bool:
    return v >= 0


def _basic_auth(data: Any, path: str, base: Path, errors: list[str]) -> BasicAuth | None:
    if data is None:
        return None
    sec = _Section(data, path, errors, {"username", "password_file"})
    username = sec.get("username", str, None, expect="a user name")
    password_file = sec.path_value("password_file", base)
    if username is None or password_file is None:
        errors.append(f"{path}: needs both username and password_file")
        return None
    return BasicAuth(username, password_file)


def _auth(top: _Section, base: Path, errors: list[str]) -> AuthConfig:
    sec = _Section(top.data.get("auth"), "auth", errors, {"disabled", "token_file", "basic_auth", "operator"})
    operator = None
    if sec.data.get("operator") is not None:
        osec = _Section(sec.data["operator"], "auth.operator", errors, {"token_file", "basic_auth"})
        basic = _basic_auth(osec.data.get("basic_auth"), "auth.operator.basic_auth", base, errors)
        operator = OperatorAuth(osec.path_value("token_file", base), basic)
        if operator.token_file is None and operator.basic_auth is None:
            errors.append("auth.operator: needs token_file, basic_auth or both")
    return AuthConfig(disabled=sec.get("disabled", bool, False),
                      token_file=sec.path_value("token_file", base),
                      basic_auth=_basic_auth(sec.data.get("basic_auth"), "auth.basic_auth", base, errors),
                      operator=operator)


def _tls(top: _Section, base: Path, errors: list[str]) -> TLSConfig | None:
    if top.data.get("tls") is None:
        return None
    sec = _Section(top.data["tls"], "tls", errors, {"cert_file", "key_file", "client_ca_file"})
    cert, key = sec.path_value("cert_file", base), sec.path_value("key_file", base)
    if cert is None or key is None:
        errors.append("tls: needs both cert_file and key_file")
        return None
    return TLSConfig(cert, key, sec.path_value("client_ca_file", base))


def _policy(top: _Section, errors: list[str]) -> PolicyConfig:
    sec = _Section(top.data.get("policy"), "policy", errors, {"action_label", "rules", "default_action"})
    default_action = sec.get("default_action", str, "none", lambda v: v in ACTIONS, f"one of {ACTIONS}")
    rules = []
    for i, raw in enumerate(sec.get("rules", list, [], expect="a list of rules")):
        rsec = _Section(raw, f"policy.rules[{i}]", errors, {"match", "action"})
        action = rsec.get("action", str, None, lambda v: v in ACTIONS, f"one of {', '.join(ACTIONS)}")
        if "action" not in rsec.data:
            errors.append(f"policy.rules[{i}].action: required")
        match = {}
        for label, pattern in rsec.get("match", dict, {}, expect="a mapping label: regex").items():
            try:
                match[str(label)] = re.compile(str(pattern))
            except re.error as exc:
                errors.append(f"policy.rules[{i}].match.{label}: bad regular expression: {exc}")
        if action is not None:
            rules.append(Rule(match, action))
    return PolicyConfig(sec.get("action_label", str, "action"), tuple(rules), default_action)


def _guardrails(top: _Section, errors: list[str]) -> GuardrailConfig:
    d = GuardrailConfig()
    sec = _Section(top.data.get("guardrails"), "guardrails", errors, {
        "breaker_max_nodes", "breaker_max_fraction", "requeue_breaker_max_nodes",
        "requeue_breaker_window_seconds", "node_cooldown_seconds", "rate_limit_actions",
        "rate_limit_window_seconds", "allow_nodes", "deny_nodes", "require_approval"})
    return GuardrailConfig(
        breaker_max_nodes=sec.get("breaker_max_nodes", int, d.breaker_max_nodes, _non_negative,
                                  "an integer >= 0"),
        breaker_max_fraction=sec.get("breaker_max_fraction", float, d.breaker_max_fraction,
                                     lambda v: 0 <= v <= 1, "a fraction 0..1"),
        requeue_breaker_max_nodes=sec.get("requeue_breaker_max_nodes", int, d.requeue_breaker_max_nodes,
                                          _positive, "an integer > 0"),
        requeue_breaker_window_seconds=sec.get("requeue_breaker_window_seconds", float,
                                               d.requeue_breaker_window_seconds, _positive, "seconds > 0"),
        node_cooldown_seconds=sec.get("node_cooldown_seconds", float, d.node_cooldown_seconds, _non_negative,
                                      "seconds >= 0"),
        rate_limit_actions=sec.get("rate_limit_actions", int, d.rate_limit_actions, _positive,
                                   "an integer > 0"),
        rate_limit_window_seconds=sec.get("rate_limit_window_seconds", float, d.rate_limit_window_seconds,
                                          _positive, "seconds > 0"),
        allow_nodes=sec.strings("allow_nodes"),
        deny_nodes=sec.strings("deny_nodes"),
        require_approval=sec.strings("require_approval", ACTIONS),
    )


def _retry(top: _Section, errors: list[str]) -> RetryConfig:
    d = RetryConfig()
    sec = _Section(top.data.get("retry"), "retry", errors, set(RetryConfig.__dataclass_fields__))
    return RetryConfig(
        job_retry_interval_seconds=sec.get("job_retry_interval_seconds", float, d.job_retry_interval_seconds,
                                           _non_negative, "seconds >= 0"),
        job_max_attempts=sec.get("job_max_attempts", int, d.job_max_attempts, _positive, "an integer > 0"),
        backend_max_attempts=sec.get("backend_max_attempts", int, d.backend_max_attempts, _positive,
                                     "an integer > 0"),
        backoff_initial_seconds=sec.get("backoff_initial_seconds", float, d.backoff_initial_seconds,
                                        _positive, "seconds > 0"),
        backoff_max_seconds=sec.get("backoff_max_seconds", float, d.backoff_max_seconds, _positive,
                                    "seconds > 0"),
    )


def _undrain(top: _Section, errors: list[str]) -> UndrainConfig:
    d = UndrainConfig()
    sec = _Section(top.data.get("undrain"), "undrain", errors, set(UndrainConfig.__dataclass_fields__))
    return UndrainConfig(
        mode=sec.get("mode", str, d.mode, lambda v: v in ("auto", "manual"), "'auto' or 'manual'"),
        health_check=sec.strings("health_check"),
        health_check_timeout_seconds=sec.get("health_check_timeout_seconds", float,
                                             d.health_check_timeout_seconds, _positive, "seconds > 0"),
        health_check_retry_seconds=sec.get("health_check_retry_seconds", float, d.health_check_retry_seconds,
                                           _positive, "seconds > 0"),
        health_check_max_attempts=sec.get("health_check_max_attempts", int, d.health_check_max_attempts,
                                          _positive, "an integer > 0"),
    )


def parse_config(data: Any, base: Path = Path("."),
                 check_backend: Callable[[dict[str, Any]], list[str]] | None = None) -> Config:
    """Build a ``Config`` from parsed YAML; relative paths are relative to ``base``.

    ``check_backend`` validates the backend section, so that its problems are listed with the rest.
    """
    errors: list[str] = []
    top = _Section(data, "", errors, {"listen", "state_dir", "dry_run", "max_body_bytes", "auth", "tls",
                                      "backend", "policy", "guardrails", "retry", "undrain",
                                      "journal_busy_timeout_seconds", "journal_retention_days",
                                      "connection_idle_timeout_seconds", "connection_limit"})
    host, port = Config.listen_host, Config.listen_port
    listen = top.get("listen", str, None, expect="HOST:PORT")
    if listen is not None:
        try:
            host, port = parse_listen(listen)
        except ValueError as exc:
            errors.append(str(exc))
    backend = top.get("backend", dict, None, expect="a mapping with a type")
    if backend is None:
        errors.append("backend: required (e.g. {type: slurm})")
        backend = {}
    elif check_backend is not None:
        errors.extend(check_backend(backend))
    config = Config(
        listen_host=host,
        listen_port=port,
        state_dir=top.path_value("state_dir", base) or Config.state_dir,
        dry_run=top.get("dry_run", bool, False),
        max_body_bytes=top.get("max_body_bytes", int, Config.max_body_bytes, _positive, "bytes > 0"),
        journal_busy_timeout_seconds=top.get("journal_busy_timeout_seconds", float,
                                             Config.journal_busy_timeout_seconds, _positive, "seconds > 0"),
        journal_retention_days=top.get("journal_retention_days", float, Config.journal_retention_days,
                                       _positive, "days > 0"),
        connection_idle_timeout_seconds=top.get("connection_idle_timeout_seconds", float,
                                                Config.connection_idle_timeout_seconds, _positive,
                                                "seconds > 0"),
        connection_limit=top.get("connection_limit", int, Config.connection_limit, _positive,
                                 "an integer > 0"),
        auth=_auth(top, base, errors),
        tls=_tls(top, base, errors),
        backend=backend,
        policy=_policy(top, errors),
        guardrails=_guardrails(top, errors),
        retry=_retry(top, errors),
        undrain=_undrain(top, errors),
    )
    if errors:
        raise ConfigError(errors)
    return config


def load_config(path: Path, check_backend: Callable[[dict[str, Any]], list[str]] | None = None) -> Config:
    """Read and validate ``path``; ``ConfigError`` for a missing file, bad YAML or bad values."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    return parse_config(data, Path(path).resolve().parent, check_backend)
