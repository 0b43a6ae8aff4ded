"""A cap on open connections. Every connection holds a descriptor and some memory, and aiohttp has
no timeout on a request that trickles in a byte at a time; without a cap, a few hundred idle or slow
clients keep /healthz and Alertmanager from being answered at all. At the cap, a new connection
closes the oldest one that is not being served (idle, or still sending its request); when every
connection is being served, the new one is closed instead. Either way it is counted.

A request aiohttp cannot parse is answered here too, as every other error is: JSON with the security
headers, 414 for an over-long request line, 431 for an over-long header or too many of them, one log
line (aiohttp logs a traceback per request, which lets any client flood the log)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

DESCRIPTORS_RESERVED = 32  # journal, logs, backend pipes and helpers stay possible at the cap
# aiohttp's parser names the limit it hit, not what it was reading: distinct limits tell a request
# line (a path with its query; ours are short) from one header (a credential fits easily).
MAX_REQUEST_LINE_BYTES = 4096
MAX_HEADER_BYTES = 8190
MAX_HEADERS = 64


def effective_limit(configured: int, open_files: int) -> int:
    """The cap in force: the configured one, lowered so that the open-files limit is never the one
    that refuses (a refused accept() leaves its client waiting, and no connection is closed for it)."""
    return max(1, min(configured, open_files - DESCRIPTORS_RESERVED))


def parse_error_status(exc: BaseException | None, max_line_size: int) -> HTTPStatus:
    """What a request aiohttp refused to parse is answered with."""
    if isinstance(exc, LineTooLong):
        if exc.args[1:2] == (max_line_size,):
            return HTTPStatus.REQUEST_URI_TOO_LONG
        return HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
    if isinstance(exc, BadHttpMessage) and "Too many headers" in exc.message:
        return HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
    return HTTPStatus.BAD_REQUEST


class _RequestHandler(RequestHandler):
    """aiohttp's connection protocol, answering what it cannot parse as ``parse_error_status`` says."""

    def __init__(self, manager: web.Server, security_headers: dict[str, str], **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.security_headers = security_headers

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status != HTTPStatus.BAD_REQUEST or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        answer = parse_error_status(exc, self.max_line_size)
        log.warning("event=bad_request status=%d remote=%s error=%s", answer, request.remote,
                    ascii(type(exc).__name__))
        text = {HTTPStatus.REQUEST_URI_TOO_LONG: f"request line over {self.max_line_size} bytes",
                HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE: f"a header over {self.max_field_size} bytes, "
                                                            f"or over {self.max_headers} headers"}
        response = web.json_response({"error": text.get(answer, "malformed HTTP request")}, status=answer,
                                     headers=self.security_headers)
        response.force_close()
        return response


class LimitedServer(web.Server):
    """aiohttp's ``web.Server`` that keeps at most ``limit`` connections open."""

    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]], *, limit: int,
                 on_refused: Callable[[str], None], security_headers: dict[str, str], **kwargs: Any) -> None:
        super().__init__(self._tracked(handler), **kwargs)
        self.limit = limit
        self.on_refused = on_refused
        self.security_headers = security_headers
        self.serving: set[RequestHandler] = set()  # a connection serves one request at a time

    def __call__(self) -> RequestHandler:
        return _RequestHandler(self, self.security_headers, loop=self._loop, **self._kwargs)

    def _tracked(self, handle: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                 ) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
        async def tracked(request: web.BaseRequest) -> web.StreamResponse:
            self.serving.add(request.protocol)
            try:
                return await handle(request)
            finally:
                self.serving.discard(request.protocol)
        return tracked

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        open_ = [h for h in self.connections if h.transport is not None]  # closed ones linger a moment
        if len(open_) <= self.limit:
            return
        victim = next((h for h in open_ if h is not handler and h not in self.serving), handler)
        victim.force_close()
        self.on_refused("oldest_unserved" if victim is not handler else "new")


class LimitedRunner(web.AppRunner):
    """``web.AppRunner`` whose server is a ``LimitedServer``."""

    def __init__(self, app: web.Application, *, limit: int, on_refused: Callable[[str], None],
                 security_headers: dict[str, str], **kwargs: Any) -> None:
        super().__init__(app, max_line_size=MAX_REQUEST_LINE_BYTES, max_field_size=MAX_HEADER_BYTES,
                         max_headers=MAX_HEADERS, **kwargs)
        self.limit, self.on_refused, self.security_headers = limit, on_refused, security_headers

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # runs the app's start-up and applies its handler args
        return LimitedServer(server.request_handler, request_factory=server.request_factory,
                             handler_cancellation=server.handler_cancellation, limit=self.limit,
                             on_refused=self.on_refused, security_headers=self.security_headers,
                             **server._kwargs)
