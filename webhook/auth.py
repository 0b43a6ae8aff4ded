"""Who may change things: a bearer token or basic auth, compared in constant time.

Reads (status page, metrics, action list) stay open so Prometheus and humans need no secret;
everything that writes (alerts, approvals, cancels, breaker reset) needs credentials.
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

from gpuhealth.webhook.config import Config

log = logging.getLogger(__name__)


class AuthSetupError(RuntimeError):
    """A credentials file is missing or unreadable."""


def _read_secret(path: Path, what: str) -> str:
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise AuthSetupError(f"{what} {path}: cannot read: {exc.strerror}") from None
    if not value:
        raise AuthSetupError(f"{what} {path} is empty")
    return value


@dataclass(frozen=True)
class Authenticator:
    token: str | None
    basic: tuple[str, str] | None
    disabled: bool = False

    @classmethod
    def from_config(cls, config: Config) -> Authenticator:
        """Load credentials; the default token file is created, random, on first start."""
        if config.auth.disabled:
            return cls(None, None, disabled=True)
        basic = None
        if config.auth.basic_auth is not None:
            basic = (config.auth.basic_auth.username,
                     _read_secret(config.auth.basic_auth.password_file, "auth.basic_auth.password_file"))
        token = None
        path = config.token_path
        if path is not None:
            if config.auth.token_file is None and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as out:
                    out.write(secrets.token_urlsafe(32) + "\n")
                log.warning("event=token_created path=%s (give it to Alertmanager's http_config)", path)
            token = _read_secret(path, "auth.token_file")
        return cls(token, basic)

    def allows(self, header: str | None) -> bool:
        if self.disabled:
            return True
        scheme, _, value = (header or "").partition(" ")
        scheme = scheme.lower()
        if scheme == "bearer" and self.token is not None:
            return hmac.compare_digest(value.strip().encode(), self.token.encode())
        if scheme == "basic" and self.basic is not None:
            try:
                user, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False
            user_ok = hmac.compare_digest(user.encode(), self.basic[0].encode())
            return hmac.compare_digest(password.encode(), self.basic[1].encode()) and user_ok
        return False

    def who(self, header: str | None) -> str:
        """A name for the audit trail: the basic-auth user, or "token"."""
        scheme, _, value = (header or "").partition(" ")
        if scheme.lower() == "basic":
            try:
                return base64.b64decode(value.strip()).decode().partition(":")[0] or "basic"
            except (binascii.Error, UnicodeDecodeError):
                return "basic"
        return "token" if not self.disabled else "anonymous"
