"""Typed models of Alertmanager's webhook payload (version 4), and a parser that never trusts it.

Anything the decision engine relies on is checked here, so that a malformed notification is a 400
with a clear message (Alertmanager does not retry a 4xx) and never an exception deeper down.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

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

    @property
    def key(self) -> tuple[str, str]:
        """Identity across deliveries: HA pairs and retries repeat both fields unchanged."""
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


def _time(value: Any, where: str, problems: list[str], required: bool) -> datetime | None:
    if value is None or value == "":
        if required:
            problems.append(f"{where}: required RFC 3339 time")
        return None
    if not isinstance(value, str):
        problems.append(f"{where}: expected an RFC 3339 time string")
        return None
    parsed = rfc3339(value)
    if parsed is None:
        problems.append(f"{where}: {value[:40]!r} is not an RFC 3339 time (with its time zone)")
        return None
    if parsed.year <= 1:
        return None  # Go's zero time: Alertmanager's "not set"
    try:
        return parsed.astimezone(UTC)
    except OverflowError:
        problems.append(f"{where}: {value[:40]!r} is out of range")
        return None


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


def _text(value: Any, where: str, problems: list[str]) -> str:
    """A free-text field Alertmanager fills from its configuration: a string with no control characters."""
    if not isinstance(value, str):
        problems.append(f"{where}: expected a string")
        return ""
    if _CONTROL.search(value):
        problems.append(f"{where}: holds control characters")
        return ""
    return value


def _url(value: Any, where: str, problems: list[str]) -> str:
    """Empty, or an absolute URI of printable ASCII (RFC 3986, as Alertmanager's API checks it): other
    tools push alerts too, so the scheme is not held to http(s); the webhook never follows it."""
    text = _text(value, where, problems)
    if text and not URI.fullmatch(text):
        problems.append(f"{where}: {text[:40]!r} is not an absolute URI")
        return ""
    return text


def _string_map(value: Any, where: str, problems: list[str]) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        problems.append(f"{where}: expected a mapping of strings")
        return {}
    return dict(value)


def _alert(raw: Any, where: str, problems: list[str]) -> Alert | None:
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected an object")
        return None
    before = len(problems)
    status = raw.get("status")
    if status not in ("firing", "resolved"):
        problems.append(f"{where}.status: expected 'firing' or 'resolved'")
    fingerprint = raw.get("fingerprint")
    if not isinstance(fingerprint, str) or not FINGERPRINT.fullmatch(fingerprint):
        problems.append(f"{where}.fingerprint: expected 16 lowercase hex digits, as Alertmanager writes it")
    labels = _string_map(raw.get("labels"), f"{where}.labels", problems)
    annotations = _string_map(raw.get("annotations"), f"{where}.annotations", problems)
    starts_at = _time(raw.get("startsAt"), f"{where}.startsAt", problems, required=True)
    ends_at = _time(raw.get("endsAt"), f"{where}.endsAt", problems, required=False)
    generator = _url(raw.get("generatorURL", ""), f"{where}.generatorURL", problems)
    if len(problems) > before or starts_at is None:
        if len(problems) == before:
            problems.append(f"{where}.startsAt: must be a real time, not Go's zero time")
        return None
    return Alert(str(status), labels, annotations, starts_at, ends_at, str(fingerprint), generator)


def _check_encodable(body: Any) -> None:
    """JSON may escape lone surrogates (``"\\ud800"``) that no UTF-8 store or program can take."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise PayloadError("text that is not valid Unicode (a lone surrogate escape such as "
                           "\\ud800)") from None


def parse_notification(body: Any) -> Notification:
    """Validate decoded JSON; ``PayloadError`` lists the first problems found."""
    if not isinstance(body, dict):
        raise PayloadError("expected a JSON object (Alertmanager webhook payload)")
    _check_encodable(body)
    problems: list[str] = []
    if body.get("version") != "4":
        problems.append(f"version: expected \"4\", got {body.get('version')!r:.40}")
    status = body.get("status")
    if status not in ("firing", "resolved"):
        problems.append("status: expected 'firing' or 'resolved'")
    receiver = _text(body.get("receiver", ""), "receiver", problems)
    group_key = _text(body.get("groupKey", ""), "groupKey", problems)
    _url(body.get("externalURL", ""), "externalURL", problems)
    truncated = body.get("truncatedAlerts", 0)
    if not isinstance(truncated, int) or isinstance(truncated, bool) or truncated < 0:
        problems.append("truncatedAlerts: expected an integer >= 0")
        truncated = 0
    raw_alerts = body.get("alerts")
    alerts: list[Alert] = []
    if not isinstance(raw_alerts, list) or not raw_alerts:
        problems.append("alerts: expected a non-empty list (Alertmanager sends at least one alert)")
    else:
        for i, raw in enumerate(raw_alerts):
            alert = _alert(raw, f"alerts[{i}]", problems)
            if alert is not None:
                alerts.append(alert)
    if problems:
        shown = "; ".join(problems[:MAX_PROBLEMS])
        more = f" (and {len(problems) - MAX_PROBLEMS} more)" if len(problems) > MAX_PROBLEMS else ""
        raise PayloadError(shown + more)
    return Notification(str(status), receiver, group_key, tuple(alerts), truncated)
