"""Strict reading of an HTTP/1.1 request head (RFC 9112), for the exporter's own server.

A lenient parser is how request smuggling starts: a front proxy and this server that frame one
request differently disagree about where the next begins. So every MUST of RFC 9112 sections 2-5
that a body-less GET server can check is a refusal here, roughly as Go's net/http (node_exporter's
server) refuses them: a malformed request line, whitespace before a header's colon, obs-fold, a
header name that is not a token, a control character in a value, a missing or repeated ``Host`` on
HTTP/1.1, and any body (no endpoint takes one) are 400; a version other than HTTP/1.x is 505.
Unlike Go, a bare LF line end is a 400 too (the RFC allows either), answered as soon as the line
arrives rather than at the head deadline.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 8192   # the request line alone, and the whole head
MAX_HEADER_LINES = 100  # Go bounds bytes only; a hundred lines is far past any scraper's dozen

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 section 5.6.2
_VERSION = re.compile(r"HTTP/([0-9])\.([0-9])")
_TARGET = re.compile(r"[\x21-\x7e]+")  # visible ASCII: raw bytes over 0x7f or controls are not a URI
_DIGITS = re.compile(r"[0-9]{1,18}")
_VALUE_CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # CTLs but HTAB (RFC 9110 section 5.5)


class Refusal(Exception):
    """A request head this server will not serve: answered with ``status`` and the connection closed."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    keep_alive: bool
    headers: dict[str, str]  # lower-cased names; repeats of a name that may repeat joined by ", "


async def read_head(reader: asyncio.StreamReader) -> list[str]:
    """The request line and header lines, CRLF-terminated each, up to the empty line.

    The reader's limit must be ``MAX_HEAD_BYTES``: a longer line raises ``Refusal`` (414 for the
    request line, 431 for a header); so does a longer head or one of too many lines (431)."""
    lines: list[str] = []
    size = 0
    while True:
        try:
            raw = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            raise _too_large(lines) from None
        size += len(raw)
        if size > MAX_HEAD_BYTES or len(lines) > MAX_HEADER_LINES:
            raise _too_large(lines)
        if not raw.endswith(b"\r\n"):
            raise Refusal(HTTPStatus.BAD_REQUEST, "a line ends in a bare LF, not CRLF")
        if raw == b"\r\n":
            if lines:
                return lines
            continue  # RFC 9112 section 2.2: an empty line before the request line SHOULD be ignored
        lines.append(raw[:-2].decode("latin-1"))


def _too_large(lines: list[str]) -> Refusal:
    if not lines:
        return Refusal(HTTPStatus.REQUEST_URI_TOO_LONG, "request line too long")
    return Refusal(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request headers too large")


def parse_head(lines: list[str]) -> Request:
    """The request the lines carry, or ``Refusal`` for the first rule they break."""
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise Refusal(HTTPStatus.BAD_REQUEST, "malformed request line")
    method, target, version = parts
    matched = _VERSION.fullmatch(version)
    if matched is None:
        raise Refusal(HTTPStatus.BAD_REQUEST, "malformed HTTP version")
    if matched.group(1) != "1":
        raise Refusal(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "only HTTP/1.0 and HTTP/1.1 are served")
    http11 = matched.group(2) != "0"  # a later 1.x is read as 1.1 (RFC 9110 section 2.5)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):
            raise Refusal(HTTPStatus.BAD_REQUEST, "obs-fold (a header line starting with whitespace)")
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise Refusal(HTTPStatus.BAD_REQUEST, "a header name is not a token")
        value = value.strip(" \t")
        if _VALUE_CONTROLS.search(value):
            raise Refusal(HTTPStatus.BAD_REQUEST, "a control character in a header value")
        name = name.lower()
        if name in headers:
            if name in ("host", "content-length"):
                raise Refusal(HTTPStatus.BAD_REQUEST, f"more than one {name} header")
            # two credentials: a proxy may have checked the other one, so neither counts
            value = "" if name == "authorization" else f"{headers[name]}, {value}"
        headers[name] = value
    if http11 and "host" not in headers:
        raise Refusal(HTTPStatus.BAD_REQUEST, "an HTTP/1.1 request without a Host header")
    length = headers.get("content-length")
    if length is not None and not _DIGITS.fullmatch(length):
        raise Refusal(HTTPStatus.BAD_REQUEST, "an invalid Content-Length")
    if "transfer-encoding" in headers or (length is not None and int(length) != 0):
        # no endpoint takes a body, and one left unread would be parsed as the next request
        raise Refusal(HTTPStatus.BAD_REQUEST, "a request body is not accepted")
    if target.startswith(("http://", "https://")):  # absolute-form: a server MUST accept it
        path = urlsplit(target).path or "/"
    elif target.startswith("/"):
        path = target.split("?", 1)[0]
    elif target == "*" and method == "OPTIONS":
        path = "*"
    else:
        raise Refusal(HTTPStatus.BAD_REQUEST, "a request target that is neither a path nor a URL")
    options = {token.strip().lower() for token in headers.get("connection", "").split(",")}
    keep_alive = http11 and "close" not in options
    return Request(method, path, keep_alive, headers)
