"""The HTTP side: ``/metrics`` (the latest snapshot), ``/healthz``, optional TLS and basic auth.

One asyncio loop on its own thread serves every connection: an idle or slow client costs a socket,
not a thread, and each connection has deadlines (request head, TLS handshake, keep-alive idle). At
``max_connections`` the oldest connection still waiting for its request is closed to admit the new
one, so hundreds of idle sockets (opened before any authentication) cannot lock scrapers out or
exhaust the process's file limit. The body is rendered by the sampler once per run, and gzipped
once for the scrapers that ask for it (``sampler.py``).
Basic auth follows Prometheus's exporter-toolkit: bcrypt hashes (``htpasswd -B``) or PBKDF2 ones
(``--hash-password``), checked off the loop, an unknown user costing the same time as a known one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import concurrent.futures
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import socket
import ssl
import threading
from dataclasses import dataclass
from http import HTTPStatus
from os import PathLike

import bcrypt
from gpuhealth.exporter.request_head import MAX_HEAD_BYTES, Refusal, Request, parse_head, read_head
from gpuhealth.exporter.sampler import Sampler
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

HASH_SCHEME = "pbkdf2_sha256"
HASH_ITERATIONS = 200_000
MIN_ITERATIONS = 1000
_BCRYPT = re.compile(r"^\$2[aby]\$(0[4-9]|[12]\d|3[01])\$[./A-Za-z0-9]{53}$")
LINGER_SECONDS = 1.0  # reading and dropping what a refused client still sends
MAX_VERIFIED = 64
BCRYPT_MAX_BYTES = 72
_QVALUE = re.compile(r"(?:0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?)")  # RFC 9110 section 12.4.2


def accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding header allows gzip: named with q > 0, or not named and ``*`` allowed.
    A malformed weight counts as 0, so a doubtful scraper gets plain text."""
    weights: dict[str, float] = {}
    for item in header.split(","):
        coding, *params = (part.strip() for part in item.split(";"))
        weight = 1.0
        for param in params:
            name, _, raw = param.partition("=")
            if name.strip().lower() == "q":
                weight = float(raw.strip()) if _QVALUE.fullmatch(raw.strip()) else 0.0
        weights[coding.lower()] = weight
    return weights.get("gzip", weights.get("*", 0.0)) > 0


def hash_password(password: str, iterations: int = HASH_ITERATIONS) -> str:
    salt = secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"{HASH_SCHEME}${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def hash_problem(hashed: str) -> str | None:
    """Why ``hashed`` is not a usable password hash, or None: checked at start, never at a request."""
    if _BCRYPT.match(hashed):
        return None
    parts = hashed.split("$")
    expected = (f"expected a bcrypt hash ($2y$...) or '{HASH_SCHEME}$<iterations>$<salt>$<hash>' "
                "(make one with --hash-password)")
    if len(parts) != 4 or parts[0] != HASH_SCHEME or not parts[1].isdigit():
        return expected
    if int(parts[1]) < MIN_ITERATIONS:
        return f"{HASH_SCHEME}: at least {MIN_ITERATIONS} iterations"
    try:
        salt = base64.b64decode(parts[2], validate=True)
        digest = base64.b64decode(parts[3], validate=True)
    except (binascii.Error, ValueError):
        return f"{HASH_SCHEME}: salt and hash must be base64"
    if not salt or len(digest) != hashlib.sha256().digest_size:
        return f"{HASH_SCHEME}: a non-empty salt and a 32-byte SHA-256 hash"
    return None


def check_password(password: str, hashed: str) -> bool:
    """Constant-time comparison; ``hashed`` was validated by ``hash_problem`` at start-up."""
    if hashed.startswith("$2"):
        secret = password.encode()
        # bcrypt reads 72 bytes and the library raises on more: a longer password costs the same check
        # and never matches (Go's exporter-toolkit refuses it too)
        return bcrypt.checkpw(secret[:BCRYPT_MAX_BYTES], hashed.encode()) and len(secret) <= BCRYPT_MAX_BYTES
    _, iterations, salt, digest = hashed.split("$")
    computed = hashlib.pbkdf2_hmac("sha256", password.encode(), base64.b64decode(salt), int(iterations))
    return hmac.compare_digest(computed, base64.b64decode(digest))


class BasicAuth:
    """Verifies credentials; remembers a few verified ones so that scrapes stay cheap."""

    def __init__(self, users: dict[str, str]) -> None:
        self.users = users
        self._decoy = next(iter(users.values()))  # an unknown user is checked against a real hash
        self._verified: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def cached(self, header: str | None) -> bool:
        with self._lock:
            return bool(header) and header in self._verified

    def verify(self, header: str | None) -> bool:
        """The slow path, run off the event loop."""
        if not header or header[:6].lower() != "basic ":  # the scheme is case-insensitive (RFC 9110)
            return False
        try:
            user, sep, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        known = user in self.users
        ok = check_password(password, self.users[user] if known else self._decoy) and known and bool(sep)
        if ok:
            with self._lock:
                self._verified[header] = None
                while len(self._verified) > MAX_VERIFIED:
                    self._verified.popitem(last=False)
        return ok


LANDING = b"""<html><head><title>gpuhealth exporter</title></head><body><h1>gpuhealth exporter</h1>
<p><a href="/metrics">Metrics</a> &middot; <a href="/healthz">Health</a></p></body></html>
"""


@dataclass(frozen=True)
class Limits:
    max_connections: int = 512      # well under systemd's usual LimitNOFILE of 1024
    head_timeout: float = 10.0      # to send the request line and headers
    idle_timeout: float = 60.0      # between requests on a kept-alive connection
    handshake_timeout: float = 10.0
    write_timeout: float = 10.0     # for a client to take an answer: one that never reads is closed


class _Connection:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.waiting = True  # no complete request head yet: the first to go when full


class ExporterServer:
    """Serves on a socket bound at construction (so a busy port fails at start-up)."""

    def __init__(self, host: str, port: int, sampler: Sampler, tls: ssl.SSLContext | None = None,
                 users: dict[str, str] | None = None, limits: Limits = Limits()) -> None:
        self.sampler = sampler
        self.tls = tls
        self.auth = BasicAuth(users) if users else None
        self.limits = limits
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host or "", port), family=family, reuse_port=False,
                                           dualstack_ipv6=False, backlog=128)
        self.server_address = self.socket.getsockname()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._connections: collections.OrderedDict[int, _Connection] = collections.OrderedDict()
        self._checks = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="http-auth")
        self._ready = threading.Event()
        self._done = threading.Event()

    # lifetime, shaped like socketserver's so main and the tests run it on a thread
    def serve_forever(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._start())
            self._ready.set()
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._stop())
            self._loop.close()
            self._done.set()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, sock=self.socket, ssl=self.tls, limit=MAX_HEAD_BYTES,
            ssl_handshake_timeout=self.limits.handshake_timeout if self.tls else None)

    async def _stop(self) -> None:
        for connection in list(self._connections.values()):
            connection.writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def shutdown(self) -> None:
        """Stop serving and wait until the loop has closed its connections, as socketserver's does."""
        if self._loop is not None and self._ready.wait(5):
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._done.wait(5)

    def server_close(self) -> None:
        self._checks.shutdown(wait=False)
        self.socket.close()

    # connections
    def _admit(self, writer: asyncio.StreamWriter) -> int:
        if len(self._connections) >= self.limits.max_connections:
            victim = next((k for k, c in self._connections.items() if c.waiting), None)
            if victim is None:
                victim = next(iter(self._connections))
            log.debug("http connection limit reached; closing the oldest waiting connection")
            self._connections.pop(victim).writer.close()
        key = id(writer)
        self._connections[key] = _Connection(writer)
        return key

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        key = self._admit(writer)
        timeout = self.limits.head_timeout
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout):  # no task per wait, unlike wait_for
                        request = parse_head(await read_head(reader))
                except Refusal as refusal:
                    await self._refuse(reader, writer, refusal)
                    break
                connection = self._connections.get(key)
                if connection is None:
                    break
                connection.waiting = False
                keep_alive = await self._respond(request, writer)
                async with asyncio.timeout(self.limits.write_timeout):
                    await writer.drain()
                if not keep_alive:
                    break
                connection.waiting = True
                timeout = self.limits.idle_timeout
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, OSError):
            pass  # a slow, silent, oversized or vanished client: closed below, nothing to report
        finally:
            self._connections.pop(key, None)
            writer.close()

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      refusal: Refusal) -> None:
        """Answers a head that is not served and closes. What the client still sends is read and
        dropped for a moment, so that closing with unread input (a TCP reset) does not destroy the
        answer before the client reads it."""
        log.debug("http request refused status=%d reason=%r", refusal.status.value, refusal.reason)
        self._write(writer, refusal.status, f"{refusal.reason}\n".encode(), "text/plain", {}, False)
        async with asyncio.timeout(self.limits.write_timeout):
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LINGER_SECONDS):
                while await reader.read(65536):
                    pass

    async def _respond(self, request: Request, writer: asyncio.StreamWriter) -> bool:
        method, path, headers, keep_alive = request.method, request.path, request.headers, request.keep_alive
        if method not in ("GET", "HEAD"):
            self._write(writer, HTTPStatus.METHOD_NOT_ALLOWED, b"method not allowed\n", "text/plain",
                        {"Allow": "GET, HEAD"}, keep_alive)
            return keep_alive
        head_only = method == "HEAD"  # no body then, or a kept-alive client reads it as the next answer
        if path == "/healthz":  # for the process supervisor: no credentials, no metrics in it
            ok = self.sampler.healthy()
            self._write(writer, HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE,
                        b"ok\n" if ok else b"sampling stalled\n", "text/plain", {}, keep_alive, head_only)
            return keep_alive
        if self.auth is not None and not await self._authorised(headers.get("authorization")):
            self._write(writer, HTTPStatus.UNAUTHORIZED, b"unauthorized\n", "text/plain",
                        {"WWW-Authenticate": 'Basic realm="gpuhealth-exporter"'}, keep_alive, head_only)
            return keep_alive
        if path == "/metrics":
            body, extra = self.sampler.exposition, {"Vary": "Accept-Encoding"}
            if accepts_gzip(headers.get("accept-encoding", "")):
                body, extra = self.sampler.gzipped(), extra | {"Content-Encoding": "gzip"}
            self._write(writer, HTTPStatus.OK, body, CONTENT_TYPE_LATEST, extra, keep_alive, head_only)
        elif path == "/":
            self._write(writer, HTTPStatus.OK, LANDING, "text/html", {}, keep_alive, head_only)
        else:
            self._write(writer, HTTPStatus.NOT_FOUND, b"not found\n", "text/plain", {}, keep_alive, head_only)
        return keep_alive

    async def _authorised(self, header: str | None) -> bool:
        assert self.auth is not None
        if self.auth.cached(header):
            return True
        return await asyncio.get_running_loop().run_in_executor(self._checks, self.auth.verify, header)

    @staticmethod
    def _write(writer: asyncio.StreamWriter, status: HTTPStatus, body: bytes, content_type: str,
               headers: dict[str, str], keep_alive: bool, head_only: bool = False) -> None:
        lines = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Type: {content_type}",
                 f"Content-Length: {len(body)}", "Server: gpuhealth-exporter",
                 f"Connection: {'keep-alive' if keep_alive else 'close'}",
                 *(f"{name}: {value}" for name, value in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body))


# exporter-toolkit's client_auth_type values that a Python TLS server can honour exactly
StrPath = str | PathLike[str]
CLIENT_AUTH_TYPES = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
                     "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
TLS_VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}


def tls_context(cert_file: StrPath, key_file: StrPath | None, client_ca_file: StrPath | None = None,
                client_auth: str = "NoClientCert",
                min_version: str = "TLS12") -> ssl.SSLContext:
    """A server context as exporter-toolkit's ``tls_server_config`` describes it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS[min_version]
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file is not None:
        context.load_verify_locations(cafile=str(client_ca_file))
    context.verify_mode = CLIENT_AUTH_TYPES[client_auth]
    return context


def make_server(host: str, port: int, sampler: Sampler, tls_cert: StrPath | None = None,
                tls_key: StrPath | None = None,
                users: dict[str, str] | None = None, limits: Limits = Limits(), *,
                tls: ssl.SSLContext | None = None) -> ExporterServer:
    if tls is None and tls_cert is not None:
        tls = tls_context(tls_cert, tls_key)
    return ExporterServer(host, port, sampler, tls, users, limits)
