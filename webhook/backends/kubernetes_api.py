"""The few Kubernetes API calls the backend makes, with the API's errors turned into ``BackendError``.

One HTTP session per backend operation: remediation calls are rare (a handful per drained node),
so a fresh connection costs nothing that matters and no session outlives the event loop it was
opened in. The API server's ``Status`` message is kept in every error, because it is what an
operator needs ("cannot patch resource nodes", "would violate the pod's disruption budget").
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from .base import BackendError
from .kubernetes_config import Connection

PATCH_TYPES = {
    "strategic": "application/strategic-merge-patch+json",
    "merge": "application/merge-patch+json",
}
NOT_RETRYABLE = {400, 403, 404, 405, 409, 410, 415, 422}


class KubeAPIError(BackendError):
    """The API server answered with an error ``Status``; the message keeps its code, reason and text."""

    def __init__(self, where: str, code: int, reason: str, message: str,
                 retry_after: float | None = None) -> None:
        super().__init__(f"{where}: {code} {reason}: {message}", retryable=code not in NOT_RETRYABLE)
        self.code = code
        self.retry_after = retry_after


class KubeClient:
    def __init__(self, connection: Connection, timeout_s: float) -> None:
        self.connection = connection
        self.timeout_s = timeout_s

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[KubeSession]:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        headers = {"Accept": "application/json", "User-Agent": "gpuhealth-webhook"}
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as http:
            yield KubeSession(http, self.connection, self.timeout_s)


class KubeSession:
    def __init__(self, http: aiohttp.ClientSession, connection: Connection, timeout_s: float) -> None:
        self._http = http
        self._conn = connection
        self._timeout_s = timeout_s

    async def get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        return await self._call("GET", path, params=params)

    async def list_all(self, path: str, params: dict[str, str]) -> list[dict[str, Any]]:
        """Every item of a list, following ``continue`` tokens so large fleets come in pages."""
        items: list[dict[str, Any]] = []
        query = {**params, "limit": "500"}
        while True:
            page = await self.get(path, query)
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            query = {**query, "continue": token}

    async def patch(self, path: str, body: dict[str, Any], patch_type: str) -> dict[str, Any]:
        return await self._call("PATCH", path, body=body, content_type=PATCH_TYPES[patch_type])

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", path, body=body)

    async def delete(self, path: str) -> dict[str, Any]:
        return await self._call("DELETE", path)

    async def _call(self, method: str, path: str, *, params: dict[str, str] | None = None,
                    body: dict[str, Any] | None = None,
                    content_type: str = "application/json") -> dict[str, Any]:
        where = f"{method} {path}"
        try:
            headers = self._conn.headers()
        except OSError as exc:
            raise BackendError(f"{where}: cannot read the token file: {exc.strerror}") from None
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        try:
            async with self._http.request(method, self._conn.server + path, params=params, data=data,
                                          headers=headers, ssl=self._conn.ssl) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise _api_error(where, resp.status, text, resp.headers.get("Retry-After"))
        except aiohttp.ClientConnectorCertificateError as exc:
            raise BackendError(f"{where}: TLS verification failed: {exc.certificate_error}",
                               retryable=False) from None
        except aiohttp.ClientError as exc:
            raise BackendError(f"{where}: {type(exc).__name__}: {exc}") from None
        except TimeoutError:
            raise BackendError(f"{where}: no answer within {self._timeout_s:g}s") from None
        try:
            return json.loads(text) if text else {}
        except json.JSONDecodeError:
            raise BackendError(f"{where}: the API server answered {resp.status} with non-JSON") from None


def _api_error(where: str, code: int, text: str, retry_after: str | None) -> KubeAPIError:
    reason, message = "", text.strip()[:500]
    with contextlib.suppress(json.JSONDecodeError, AttributeError):
        status = json.loads(text)
        reason, message = status.get("reason") or "", status.get("message") or message
    delay = None
    with contextlib.suppress(ValueError):
        delay = None if retry_after is None else float(retry_after)
    return KubeAPIError(where, code, reason or _REASONS.get(code, "Error"), message, delay)


_REASONS = {401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict",
            415: "UnsupportedMediaType", 429: "TooManyRequests", 500: "InternalError",
            503: "ServiceUnavailable", 504: "Timeout"}
