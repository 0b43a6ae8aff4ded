"""Typed models of Alertmanager's webhook payload (version 4), and a parser that never trusts it.

Anything the decision engine relies on is checked here, so that a malformed notification is a 400
with a clear message (Alertmanager does not retry a 4xx) and never an exception deeper down.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from gpuhealth.contract.validation import problems
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

MAX_PROBLEMS = 10  # listed in one 400 answer; the rest are counted
MAX_INT_DIGITS = 18  # no number in a notification needs more; a longer one is refused, not converted
# Alertmanager prints an alert's fingerprint as 16 lowercase hex digits (model.Fingerprint's String()).
FINGERPRINT = re.compile(r"[0-9a-f]{16}")
# RFC 3339 date-time (section 5.6), the only form Alertmanager writes; fromisoformat alone takes more.
RFC3339 = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?"
                     r"(?:[Zz]|[+-][0-9]{2}:[0-9]{2})")
URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:[!-~]*")  # scheme ":" then printable ASCII, no space
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class PayloadError(ValueError):
    """The body is not a valid Alertmanager v4 notification; the message says why."""


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Two values for one key would let a proxy and this parser read different notifications."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise PayloadError(f"body is not valid JSON: key {key[:40]!r} appears twice in one object")
            seen.add(key)
    return obj


def _refuse_constant(name: str) -> Any:
    raise PayloadError(f"body is not valid JSON: {name} is not a JSON number")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise PayloadError(f"body is not valid JSON: a number of {len(text)} digits is out of range")
    return int(text)


def decode_body(raw: bytes) -> Any:
    """Strict JSON (RFC 8259): UTF-8 only, each key once per object, no NaN or Infinity, bounded
    integers; anything else is a ``PayloadError``."""
    try:
        text = raw.decode("utf-8")
        return json.loads(text, object_pairs_hook=_refuse_duplicates, parse_constant=_refuse_constant,
                          parse_int=_bounded_int)
    except PayloadError:
        raise
    except (ValueError, RecursionError) as exc:
        raise PayloadError(f"body is not valid JSON: {exc}") from None


@dataclass(frozen=True)
class Alert:
    status: str  # "firing" | "resolved"
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: datetime
    ends_at: datetime | None
    fingerprint: str
    generator_url: str = ""

    @functools.cached_property
    def key(self) -> tuple[str, str]:
        """Identity across deliveries: HA pairs and retries repeat both fields unchanged (asked for
        several times per alert on the intake path: computed once)."""
        return self.fingerprint, self.starts_at.isoformat()

    @property
    def node(self) -> str:
        return self.labels.get("node", "")

    @property
    def gpu(self) -> str:
        return self.labels.get("gpu", "")

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")


@dataclass(frozen=True)
class Notification:
    status: str
    receiver: str
    group_key: str
    alerts: tuple[Alert, ...]
    truncated_alerts: int = 0


def rfc3339(value: str) -> datetime | None:
    """An RFC 3339 date-time, or None; nanoseconds (Go's precision) are cut to microseconds."""
    if not RFC3339.fullmatch(value):
        return None
    head, dot, rest = value.partition(".")
    if dot:
        digits = len(rest) - len(rest.lstrip("0123456789"))
        value = f"{head}.{rest[:min(digits, 6)]}{rest[digits:]}"
    try:
        return datetime.fromisoformat(value.upper())
    except ValueError:
        return None


def _time(value: Any) -> datetime | None:
    """An RFC 3339 time in UTC; None when not set (Go's zero time, or empty)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise PydanticCustomError("rfc3339", "expected an RFC 3339 time string")
    parsed = rfc3339(value)
    if parsed is None:
        raise PydanticCustomError("rfc3339", "{value} is not an RFC 3339 time (with its time zone)",
                                  {"value": f"{value[:40]!r}"})
    if parsed.year <= 1:
        return None
    try:
        return parsed.astimezone(UTC)
    except OverflowError:
        raise PydanticCustomError("rfc3339", "{value} is out of range", {"value": f"{value[:40]!r}"}) \
            from None


def _start_time(value: Any) -> datetime:
    if value is None or value == "":
        raise PydanticCustomError("rfc3339", "required RFC 3339 time")
    if (parsed := _time(value)) is None:
        raise PydanticCustomError("rfc3339", "must be a real time, not Go's zero time")
    return parsed


def _text(value: str) -> str:
    """A free-text field Alertmanager fills from its configuration: no control characters."""
    if _CONTROL.search(value):
        raise PydanticCustomError("text", "holds control characters")
    return value


def _url(value: str) -> str:
    """Empty, or an absolute URI of printable ASCII (RFC 3986, as Alertmanager's API checks it): other
    tools push alerts too, so the scheme is not held to http(s); the webhook never follows it."""
    if value and not URI.fullmatch(value):
        raise PydanticCustomError("uri", "{value} is not an absolute URI", {"value": f"{value[:40]!r}"})
    return value


def _fingerprint(value: str) -> str:
    if not FINGERPRINT.fullmatch(value):
        raise PydanticCustomError("fingerprint",
                                  "expected 16 lowercase hex digits, as Alertmanager writes it")
    return value


def _version(value: Any) -> str:
    if value != "4":
        raise PydanticCustomError("version", 'expected "4", got {value}', {"value": f"{value!r:.40}"})
    return "4"


def _alerts(value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise PydanticCustomError("alerts",
                                  "expected a non-empty list (Alertmanager sends at least one alert)")
    return value


Text = Annotated[str, AfterValidator(_text)]
URL = Annotated[Text, AfterValidator(_url)]
_TIME_SCHEMA = WithJsonSchema({"type": "string", "format": "date-time"})
StartTime = Annotated[datetime, PlainValidator(_start_time), _TIME_SCHEMA]
EndTime = Annotated[datetime | None, PlainValidator(_time), _TIME_SCHEMA]
Status = Literal["firing", "resolved"]


class _Wire(BaseModel):
    """Strict like every gpuhealth model, but open: Alertmanager may add fields in a later release, so
    keys not read here are ignored, not refused. On the intake path, so without ``Model``'s per-object
    pre-pass: a null is refused where Alertmanager never sends one."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class AlertPayload(_Wire):
    status: Status
    labels: dict[str, str] | None = None  # null: none, as Alertmanager's Go maps marshal
    annotations: dict[str, str] | None = None
    starts_at: StartTime = Field(alias="startsAt")
    ends_at: EndTime = Field(default=None, alias="endsAt")
    generator_url: URL = Field(default="", alias="generatorURL")
    fingerprint: Annotated[str, AfterValidator(_fingerprint),
                           WithJsonSchema({"type": "string", "pattern": f"^{FINGERPRINT.pattern}$"})]

    @model_validator(mode="after")
    def _ends_after_start(self) -> AlertPayload:
        """Alertmanager refuses such an alert (``model.Alert.Validate``); one that claims it is forged."""
        if self.ends_at is not None and self.ends_at < self.starts_at:
            raise PydanticCustomError("time_order", "endsAt is before startsAt")
        return self


class NotificationPayload(_Wire):
    """Alertmanager's webhook payload, version 4 (the fields the webhook reads)."""

    model_config = ConfigDict(json_schema_extra={"title": "Alertmanager webhook notification (version 4)"})

    version: Annotated[str, PlainValidator(_version), WithJsonSchema({"const": "4"})]
    status: Status
    receiver: Text = ""
    group_key: Text = Field(default="", alias="groupKey")
    external_url: URL = Field(default="", alias="externalURL")
    truncated_alerts: Annotated[int, Field(ge=0)] = Field(default=0, alias="truncatedAlerts")
    alerts: Annotated[list[AlertPayload], BeforeValidator(_alerts), Field(min_length=1)]


# A JSON escape of a UTF-16 surrogate (``\ud800``-``\udfff``): the only way a body decoded as strict
# UTF-8 can carry one. A match may be a valid pair, or an escaped backslash before "ud8..": both
# merely pay the full check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def may_hold_surrogate(raw: bytes) -> bool:
    """Whether a body needs ``_check_encodable``: a byte scan, far cheaper than encoding every string."""
    return _SURROGATE_ESCAPE.search(raw) is not None


def _check_encodable(body: Any) -> None:
    """JSON may escape lone surrogates (``"\\ud800"``) that no UTF-8 store or program can take."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise PayloadError("text that is not valid Unicode (a lone surrogate escape such as "
                           "\\ud800)") from None


def _without_nul(pairs: dict[str, str] | None, instead: str) -> dict[str, str]:
    """Labels or annotations with NUL replaced. A NUL is never part of a real value, but a hostile one
    must still be journaled and refused on its own (``invalid_label``), and PostgreSQL's text holds no
    NUL: kept, it would fail the whole notification on that journal only, and Alertmanager would retry
    it, good alerts and all, for ever. Labels get U+FFFD, which keeps the value invalid for every label
    grammar; annotations, free text, just lose it."""
    return {k.replace("\x00", instead): v.replace("\x00", instead) for k, v in (pairs or {}).items()}


def parse_notification(body: Any, *, surrogates: bool = True) -> Notification:
    """Validate decoded JSON; ``PayloadError`` lists the first problems found. ``surrogates``: whether
    its text may hold a lone surrogate (``may_hold_surrogate`` of the raw body says, for one decoded
    from UTF-8)."""
    if not isinstance(body, dict):
        raise PayloadError("expected a JSON object (Alertmanager webhook payload)")
    if surrogates:
        _check_encodable(body)
    try:
        payload = NotificationPayload.model_validate(body)
    except ValidationError as exc:
        found = problems(exc)
        shown = "; ".join(found[:MAX_PROBLEMS])
        more = f" (and {len(found) - MAX_PROBLEMS} more)" if len(found) > MAX_PROBLEMS else ""
        raise PayloadError(shown + more) from None
    alerts = tuple(Alert(a.status, _without_nul(a.labels, "\ufffd"), _without_nul(a.annotations, ""),
                         a.starts_at, a.ends_at, a.fingerprint, a.generator_url) for a in payload.alerts)
    return Notification(payload.status, payload.receiver, payload.group_key, alerts, payload.truncated_alerts)
