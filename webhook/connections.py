"""A cap on open connections. Every connection holds a descriptor and some memory, and aiohttp has
no timeout on a request that trickles in a byte at a time; without a cap, a few hundred idle or slow
clients keep /healthz and Alertmanager from being answered at all. At the cap, a new connection
closes the oldest one that is not being served (idle, or still sending its request); when every
connection is being served, the new one is closed instead. Either way it is counted."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

DESCRIPTORS_RESERVED = 32  # journal, logs, backend pipes and helpers stay possible at the cap


def effective_limit(configured: int, open_files: int) -> int:
    """The cap in force: the configured one, lowered so that the open-files limit is never the one
    that refuses (a refused accept() leaves its client waiting, and no connection is closed for it)."""
    return max(1, min(configured, open_files - DESCRIPTORS_RESERVED))


class LimitedServer(web.Server):
    """aiohttp's ``web.Server`` that keeps at most ``limit`` connections open."""

    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]], *, limit: int,
                 on_refused: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(self._tracked(handler), **kwargs)
        self.limit = limit
        self.on_refused = on_refused
        self.serving: set[RequestHandler] = set()  # a connection serves one request at a time

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
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limit, self.on_refused = limit, on_refused

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # runs the app's start-up and applies its handler args
        return LimitedServer(server.request_handler, request_factory=server.request_factory,
                             handler_cancellation=server.handler_cancellation, limit=self.limit,
                             on_refused=self.on_refused, **server._kwargs)
