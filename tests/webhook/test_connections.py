"""Clients that connect and idle, or trickle a request in a byte at a time, cannot starve the webhook:
with few descriptors and hundreds of such connections, /healthz and Alertmanager's intake still answer,
and the log stays small."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml
from webhook_helpers import TOKEN, alert, notification

from gpuhealth.local.process import ManagedProcess, free_port, http_ok, wait_until


def start_webhook(tmp_path: Path, **settings) -> tuple[ManagedProcess, int]:
    """The webhook on a simulated backend, with at most 64 open files."""
    port = free_port()
    (tmp_path / "token").write_text(TOKEN)
    config = tmp_path / "webhook.yaml"
    config.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{port}", "state_dir": "state", "auth": {"token_file": "token"},
        "backend": {"type": "simulated", "nodes": ["gpu[01-04]"]}, **settings,
    }))
    argv = ["prlimit", "--nofile=64:64", "--", sys.executable, "-m", "gpuhealth.webhook.main",
            "--config", str(config)]
    return ManagedProcess("webhook", argv, tmp_path / "webhook.log").start(), port


def connect(port: int, first_bytes: bytes = b"") -> socket.socket:
    sock = socket.socket()
    sock.settimeout(0.2)
    with contextlib.suppress(OSError):
        sock.connect(("127.0.0.1", port))
        sock.sendall(first_bytes)
    return sock


def intake_accepted(port: int) -> bool:
    body = json.dumps(notification(alert("gpu02"))).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/alerts", data=body, method="POST", headers={
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def refused(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        text = response.read().decode()
    return sum(float(v) for v in re.findall(r"^gpuhealth_webhook_connections_refused_total\{[^}]*\} (\S+)$",
                                            text, re.M))


@pytest.mark.slow
def test_idle_and_trickling_clients_beyond_the_connection_limit_are_closed(tmp_path: Path):
    """The idle timeout is far away: only the connection limit (lowered to fit 64 descriptors) frees the
    way, and clients that keep sending a header byte at a time are closed like idle ones."""
    proc, port = start_webhook(tmp_path, connection_idle_timeout_seconds=600)
    url = f"http://127.0.0.1:{port}/healthz"
    clients: list[socket.socket] = []
    trickling: list[socket.socket] = []
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.5):
            for sock in trickling:
                with contextlib.suppress(OSError):
                    sock.send(b"X")

    trickler = threading.Thread(target=trickle, daemon=True)
    try:
        proc.wait_ready(lambda: http_ok(url), timeout=30)
        for i in range(400):  # far more than the 64 descriptors the process may hold
            if i % 2:
                trickling.append(connect(port, b"POST /alerts HTTP/1.1\r\nHost: gpuhealth\r\nX-Slow: "))
            else:
                clients.append(connect(port))
        trickler.start()
        wait_until(lambda: http_ok(url, timeout=2), timeout=60, what="/healthz despite idle and slow clients")
        wait_until(lambda: intake_accepted(port), timeout=60, what="intake despite idle and slow clients")
        assert refused(port) >= 300
    finally:
        stop.set()
        for sock in clients + trickling:
            sock.close()
        proc.stop()
    log = (tmp_path / "webhook.log").read_text()
    assert "event=connection_limit_lowered configured=512 limit=32" in log
    assert len(log.splitlines()) < 50, log[-2000:]


@pytest.mark.slow
def test_idle_connections_with_a_low_file_limit_do_not_starve_healthz(tmp_path: Path):
    proc, port = start_webhook(tmp_path, connection_idle_timeout_seconds=1)
    url = f"http://127.0.0.1:{port}/healthz"
    idle: list[socket.socket] = []
    try:
        proc.wait_ready(lambda: http_ok(url), timeout=30)
        idle.extend(connect(port) for _ in range(300))  # far more than the 64 descriptors it may hold
        wait_until(lambda: http_ok(url, timeout=2), timeout=60, what="/healthz despite idle connections")
    finally:
        for sock in idle:
            sock.close()
        proc.stop()
    lines = (tmp_path / "webhook.log").read_text().splitlines()
    assert len(lines) < 50, f"{len(lines)} log lines"


def raw_exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` as it is and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


OVERSIZED = {
    "request-line": (b"GET /actions?node=" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    "header": (b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"a" * 20_000 + b"\r\n\r\n", 431),
    "header-count": (b"POST /alerts HTTP/1.1\r\nHost: x\r\n"
                     + b"".join(b"X-%d: 1\r\n" % i for i in range(300)) + b"\r\n", 431),
    "not-http": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 GET / HTTP/1.1\r\n\r\n", 400),
}


@pytest.mark.slow
def test_over_long_request_lines_and_headers_are_refused_with_414_and_431(tmp_path: Path):
    """aiohttp answered all of these with a plain-text 400 that echoed the request, without the
    security headers, and logged a traceback for each (any client could flood the log)."""
    proc, port = start_webhook(tmp_path)
    try:
        proc.wait_ready(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), timeout=30)
        for name, (request, status) in OVERSIZED.items():
            head, _, body = raw_exchange(port, request).partition(b"\r\n\r\n")
            assert head.split(b"\r\n")[0].split(b" ")[1] == str(status).encode(), (name, head)
            assert b"X-Content-Type-Options: nosniff" in head and b"application/json" in head, (name, head)
            assert b"aaaa" not in body and "error" in json.loads(body), (name, body)
        assert intake_accepted(port)
    finally:
        proc.stop()
    log = (tmp_path / "webhook.log").read_text()
    assert "Traceback" not in log and "aaaa" not in log, log[-2000:]
    assert len(re.findall(r"event=bad_request status=(\d+)", log)) == len(OVERSIZED)


# the exporter's RFC 9112 probes, against aiohttp's llhttp parser (strict: its lenient flags are off)
STRICT_HEAD_PROBES = {
    "unsupported version": (b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n", 400),  # RFC: 505 or 400
    "garbled version": (b"GET /healthz HTTP/1.1x\r\nHost: x\r\n\r\n", 400),
    "space before the colon": (b"GET /healthz HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    "obs-fold": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  folded\r\n\r\n", 400),
    "header name not a token": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX[a]: 1\r\n\r\n", 400),
    "NUL in a value": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),
    "two Content-Length": (b"POST /alerts HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
    "Content-Length not a number": (b"POST /alerts HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n\r\n{}", 400),
    "Content-Length and Transfer-Encoding": (b"POST /alerts HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                             b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    "bare LF line ends": (b"GET /healthz HTTP/1.1\nHost: x\n\n", 400),
    "no Host on HTTP/1.1": (b"GET /healthz HTTP/1.1\r\n\r\n", 400),
    "two Host headers": (b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    "raw byte over 0x7f in the target": (b"GET /\xc0\xae HTTP/1.1\r\nHost: x\r\n\r\n", 400),
}


@pytest.mark.slow
def test_malformed_request_heads_are_refused_at_once_without_a_traceback(tmp_path: Path):
    proc, port = start_webhook(tmp_path)
    try:
        proc.wait_ready(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), timeout=30)
        for name, (request, status) in STRICT_HEAD_PROBES.items():
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(request)
                answer = sock.recv(65536)  # left open: the answer must come unprompted
            assert answer.split(b"\r\n")[0].split(b" ")[1] == str(status).encode(), (name, answer[:300])
        assert intake_accepted(port)
    finally:
        proc.stop()
    log = (tmp_path / "webhook.log").read_text()
    assert "Traceback" not in log, log[-2000:]
