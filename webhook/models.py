"""Typed models of Alertmanager's webhook payload (version 4), and a parser that never trusts it.

Anything the decision engine relies on is checked here, so that a malformed notification is a 400
with a clear message (Alertmanager does not retry a 4xx) and never an exception deeper down.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

MAX_PROBLEMS = 10  # listed in one 400 answer; the rest are counted


class PayloadError(ValueError):
    """The body is not a valid Alertmanager v4 notification; the message says why."""


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
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        problems.append(f"{where}: {value[:40]!r} is not an RFC 3339 time")
        return None
    if parsed.tzinfo is None:
        problems.append(f"{where}: {value[:40]!r} has no time zone")
        return None
    if parsed.year <= 1:
        return None  # Go's zero time: Alertmanager's "not set"
    try:
        return parsed.astimezone(UTC)
    except OverflowError:
        problems.append(f"{where}: {value[:40]!r} is out of range")
        return None


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
    if not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= 128:
        problems.append(f"{where}.fingerprint: expected a non-empty string")
    labels = _string_map(raw.get("labels"), f"{where}.labels", problems)
    annotations = _string_map(raw.get("annotations"), f"{where}.annotations", problems)
    starts_at = _time(raw.get("startsAt"), f"{where}.startsAt", problems, required=True)
    ends_at = _time(raw.get("endsAt"), f"{where}.endsAt", problems, required=False)
    generator = raw.get("generatorURL", "")
    if not isinstance(generator, str):
        problems.append(f"{where}.generatorURL: expected a string")
    if len(problems) > before or starts_at is None:
        if len(problems) == before:
            problems.append(f"{where}.startsAt: must be a real time, not Go's zero time")
        return None
    return Alert(status, labels, annotations, starts_at, ends_at, fingerprint, generator)


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
    for name in ("receiver", "groupKey", "externalURL"):
        if not isinstance(body.get(name, ""), str):
            problems.append(f"{name}: expected a string")
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
    return Notification(status, body.get("receiver", ""), body.get("groupKey", ""), tuple(alerts), truncated)
