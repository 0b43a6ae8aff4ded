"""The HTTP side: ``/metrics`` (the latest snapshot), ``/healthz``, optional TLS and basic auth.

Modelled on Prometheus's exporter-toolkit web config. Passwords are stored as PBKDF2-SHA256 hashes
(``gpuhealth-exporter --hash-password``); a verified credential is cached so scrapes stay cheap.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from gpuhealth.exporter.sampler import Sampler
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

HASH_SCHEME = "pbkdf2_sha256"
HASH_ITERATIONS = 200_000


def hash_password(password: str, iterations: int = HASH_ITERATIONS) -> str:
    salt = secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"{HASH_SCHEME}${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def hash_problem(hashed: str) -> str | None:
    """Why ``hashed`` is not a usable password hash, or None."""
    parts = hashed.split("$")
    if len(parts) != 4 or parts[0] != HASH_SCHEME or not parts[1].isdigit():
        return f"expected '{HASH_SCHEME}$<iterations>$<salt>$<hash>' (make one with --hash-password)"
    return None


def check_password(password: str, hashed: str) -> bool:
    _, iterations, salt, digest = hashed.split("$")
    computed = hashlib.pbkdf2_hmac("sha256", password.encode(), base64.b64decode(salt), int(iterations))
    return hmac.compare_digest(computed, base64.b64decode(digest))


class BasicAuth:
    def __init__(self, users: dict[str, str]) -> None:
        self.users = users
        self._verified: set[str] = set()
        self._lock = threading.Lock()

    def allows(self, header: str | None) -> bool:
        if not header or not header.startswith("Basic "):
            return False
        token = header[6:]
        with self._lock:
            if token in self._verified:
                return True
        try:
            user, _, password = base64.b64decode(token, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        if user in self.users and check_password(password, self.users[user]):
            with self._lock:
                self._verified.add(token)
            return True
        return False


LANDING = b"""<html><head><title>gpuhealth exporter</title></head><body><h1>gpuhealth exporter</h1>
<p><a href="/metrics">Metrics</a> &middot; <a href="/healthz">Health</a></p></body></html>
"""


def make_handler(sampler: Sampler, auth: BasicAuth | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "gpuhealth-exporter"

        def do_GET(self) -> None:
            if auth is not None and not auth.allows(self.headers.get("Authorization")):
                self._reply(HTTPStatus.UNAUTHORIZED, b"unauthorized\n", "text/plain",
                            {"WWW-Authenticate": 'Basic realm="gpuhealth-exporter"'})
                return
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(HTTPStatus.OK, sampler.exposition, CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                ok = sampler.healthy()
                self._reply(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE,
                            b"ok\n" if ok else b"sampling stalled\n", "text/plain")
            elif path == "/":
                self._reply(HTTPStatus.OK, LANDING, "text/html")
            else:
                self._reply(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

        def _reply(self, status: HTTPStatus, body: bytes, content_type: str,
                   headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http client=%s request=%r", self.address_string(), format % args)

    return Handler


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: tuple) -> None:
        """A client that drops the connection or fails the TLS handshake is its problem, not ours."""
        log.debug("http client error client=%s", client_address, exc_info=True)


def make_server(host: str, port: int, sampler: Sampler, tls_cert: Path | None = None,
                tls_key: Path | None = None, users: dict[str, str] | None = None) -> ExporterServer:
    server = ExporterServer((host, port), make_handler(sampler, BasicAuth(users) if users else None))
    if tls_cert is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(tls_cert, tls_key)
        # the handshake happens in the request's thread, so a slow client cannot stall accept()
        server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    return server
