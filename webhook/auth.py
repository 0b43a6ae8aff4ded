"""Who may change things: a bearer token or basic auth, compared in constant time.

Reads (status page, metrics, action list) stay open so Prometheus and humans need no secret;
everything that writes needs credentials: the intake ones for alerts, the operator ones (when
configured) for approvals, cancels and the breaker reset. Each is named in the audit trail.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from gpuhealth.contract.files import read_text
from gpuhealth.webhook.config import BasicAuth, Config

log = logging.getLogger(__name__)


class AuthSetupError(RuntimeError):
    """A credentials file is missing or unreadable."""


def _read_secret(path: Path, what: str) -> str:
    try:
        value = read_text(path).strip()
    except OSError as exc:
        raise AuthSetupError(f"{what} {path}: cannot read: {exc.strerror}") from None
    if not value:
        raise AuthSetupError(f"{what} {path} is empty")
    return value


@dataclass(frozen=True)
class Credentials:
    """One role's secrets: a bearer token, basic auth, or both."""

    role: str  # "intake" (Alertmanager) or "operator" (approve, cancel, breaker reset)
    token: str | None
    basic: tuple[str, str] | None

    @classmethod
    def load(cls, role: str, token_path: Path | None, basic: BasicAuth | None, where: str) -> Credentials:
        pair = None
        if basic is not None:
            pair = (basic.username, _read_secret(basic.password_file, f"{where}.basic_auth.password_file"))
        token = _read_secret(token_path, f"{where}.token_file") if token_path is not None else None
        return cls(role, token, pair)

    def identify(self, header: str | None) -> str | None:
        """The audit name of whoever ``header`` proves to be (``operator basic user alice``), or None."""
        scheme, _, value = (header or "").partition(" ")
        scheme = scheme.lower()
        if scheme == "bearer" and self.token is not None:
            # aiohttp keeps a header's non-UTF-8 bytes as surrogates: compare those bytes, never fail on them
            ok = hmac.compare_digest(value.strip().encode("utf-8", "surrogateescape"), self.token.encode())
            return f"{self.role} token" if ok else None
        if scheme == "basic" and self.basic is not None:
            try:
                user, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return None
            user_ok = hmac.compare_digest(user.encode(), self.basic[0].encode())
            if hmac.compare_digest(password.encode(), self.basic[1].encode()) and user_ok:
                return f"{self.role} basic user {self.basic[0]}"
        return None


@dataclass(frozen=True)
class Authenticator:
    """Intake credentials deliver alerts; operator credentials, when configured, are the only ones that
    approve, cancel or reset the breaker, so a leaked Alertmanager secret cannot approve a replace."""

    intake: Credentials | None
    operator: Credentials | None = None
    disabled: bool = False

    @classmethod
    def from_config(cls, config: Config) -> Authenticator:
        """Load credentials; the default intake token file is created, random, on first start."""
        if config.auth.disabled:
            return cls(None, None, disabled=True)
        path = config.token_path
        if path is not None and config.auth.token_file is None and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32) + "\n")
            log.warning("event=token_created path=%s (give it to Alertmanager's http_config)", path)
        intake = Credentials.load("intake", path, config.auth.basic_auth, "auth")
        operator = None
        if config.auth.operator is not None:
            op = config.auth.operator
            operator = Credentials.load("operator", op.token_file, op.basic_auth, "auth.operator")
        else:  # allowed (one credential is simpler to start with), but said at every start
            log.warning("event=no_operator_credentials (Alertmanager's credential also approves, cancels "
                        "and resets the breaker: set auth.operator to keep those for people)")
        return cls(intake, operator)

    def identify(self, header: str | None, *, operator: bool) -> str | None:
        """Who may do this (an audit name), or None. Operator actions take the operator credentials
        when any are configured, the intake ones otherwise."""
        if self.disabled:
            return "anonymous"
        creds = self.operator if operator and self.operator is not None else self.intake
        return creds.identify(header) if creds is not None else None
