"""The HTTP endpoints: snapshot serving, health, TLS and basic auth, on loopback."""

from __future__ import annotations

import base64
import contextlib
import datetime
import gzip
import ipaddress
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from gpuhealth.exporter.collector import Context, load_collectors
from gpuhealth.exporter.sampler import GZIP_INTEREST_SECONDS, Sampler
from gpuhealth.exporter.web import Limits, hash_password, hash_problem, make_server

from gpuhealth.local.process import free_port


class Broken:
    def collect(self):
        raise RuntimeError("sensor exploded")


class Partial:
    """Yields a family and then fails: what it yielded is still served."""

    def collect(self):
        yield from load_collectors()["host"].factory(Context()).collect()
        raise OSError("second half unavailable")


@pytest.fixture
def sampler() -> Sampler:
    host = load_collectors()["host"].factory(Context())
    collectors = {"broken": Broken(), "host": host, "partial": Partial()}
    sampler = Sampler(collectors, interval=0.2)
    sampler.sample_once()
    return sampler


def serve(server) -> Iterator[str]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def get(url: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None):
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, valid for a day, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_metrics_health_and_collector_isolation(sampler: Sampler) -> None:
    for address in serve(make_server("127.0.0.1", free_port(), sampler)):
        status, body = get(f"http://{address}/metrics")
        assert status == 200
        assert 'gpuhealth_collector_success{collector="broken"} 0.0' in body
        assert 'gpuhealth_collector_success{collector="host"} 1.0' in body
        assert 'gpuhealth_collector_success{collector="partial"} 0.0' in body
        assert body.count("# TYPE gpuhealth_host_load1 gauge") == 2  # host and partial both served
        assert get(f"http://{address}/healthz") == (200, "ok\n")
        assert get(f"http://{address}/")[0] == 200
        assert get(f"http://{address}/nope")[0] == 404


def test_health_fails_when_sampling_stalls() -> None:
    stalled = Sampler({}, interval=0.01, clock=lambda: stalled_now[0])
    stalled_now = [0.0]
    assert not stalled.healthy()
    stalled.sample_once()
    assert stalled.healthy()
    stalled_now[0] = 60.0
    assert not stalled.healthy()


def test_tls_and_basic_auth(tmp_path: Path, sampler: Sampler) -> None:
    cert, key = self_signed_certificate(tmp_path)
    users = {"prometheus": hash_password("scrape-me", iterations=1000)}
    server = make_server("127.0.0.1", free_port(), sampler, cert, key, users)
    context = ssl.create_default_context(cafile=str(cert))
    good = {"Authorization": "Basic " + base64.b64encode(b"prometheus:scrape-me").decode()}
    bad = {"Authorization": "Basic " + base64.b64encode(b"prometheus:guess").decode()}
    for address in serve(server):
        assert get(f"https://{address}/metrics", context=context)[0] == 401
        assert get(f"https://{address}/metrics", bad, context=context)[0] == 401
        assert get(f"https://{address}/metrics", {"Authorization": "Basic !!!"}, context=context)[0] == 401
        status, body = get(f"https://{address}/metrics", good, context=context)
        assert status == 200 and "gpuhealth_collector_success" in body
        assert get(f"https://{address}/metrics", good, context=context)[0] == 200  # cached credential
        with pytest.raises(OSError):
            get(f"http://{address}/metrics", good)  # plain HTTP is refused


def _raw(address: str, request: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_hundreds_of_idle_clients_do_not_lock_scrapers_out(sampler: Sampler) -> None:
    server = make_server("127.0.0.1", free_port(), sampler, limits=Limits(max_connections=64))
    for address in serve(server):
        host, port = address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(300)]
        slow = idle[-1]
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        try:
            for _ in range(3):
                sampler.sample_once()  # no sampling loop runs here: health is about connections, not time
                assert get(f"http://{address}/metrics")[0] == 200
                assert get(f"http://{address}/healthz") == (200, "ok\n")
            assert len(server._connections) <= 64
        finally:
            for sock in idle:
                sock.close()


def test_a_silent_connection_is_closed_after_the_head_deadline(sampler: Sampler) -> None:
    server = make_server("127.0.0.1", free_port(), sampler, limits=Limits(head_timeout=0.3))
    for address in serve(server):
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            assert sock.recv(100) == b""  # closed by the server, long before the 10 s client timeout


def test_oversized_or_garbled_requests_are_refused_and_serving_goes_on(sampler: Sampler) -> None:
    for address in serve(make_server("127.0.0.1", free_port(), sampler)):
        assert _raw(address, b"GET /metrics HTTP/1.1\r\n"
                             b"Host: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n").startswith(
            b"HTTP/1.1 431 ")
        long_line = b"GET /metrics?" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
        assert _raw(address, long_line).startswith(b"HTTP/1.1 414 ")
        many = b"".join(b"X-%d: 1\r\n" % i for i in range(2000))
        assert _raw(address, b"GET /metrics HTTP/1.1\r\n"
                             b"Host: x\r\n" + many + b"\r\n").startswith(b"HTTP/1.1 431 ")
        assert _raw(address, b"\x16\x03\x01garbage\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert _raw(address, b"POST /metrics HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 405")
        assert get(f"http://{address}/metrics")[0] == 200


def test_gzip_when_the_scraper_accepts_it_and_keep_alive(sampler: Sampler) -> None:
    for address in serve(make_server("127.0.0.1", free_port(), sampler)):
        plain = _raw(address, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        zipped = _raw(address, b"GET /metrics HTTP/1.1\r\n"
                               b"Host: x\r\nAccept-Encoding: gzip\r\nConnection: close\r\n\r\n")
        plain_head, plain_body = plain.split(b"\r\n\r\n", 1)
        zipped_head, zipped_body = zipped.split(b"\r\n\r\n", 1)
        assert b"Content-Encoding: gzip" in zipped_head and b"Content-Encoding" not in plain_head
        assert gzip.decompress(zipped_body) == plain_body and len(zipped_body) < len(plain_body)
        two = _raw(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                            b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert two.count(b"HTTP/1.1 200 OK") == 2  # one kept-alive connection, two answers


def test_gzip_costs_nothing_until_a_scraper_asks_for_it_and_stops_when_none_does() -> None:
    now = [0.0]
    sampler = Sampler({"host": load_collectors()["host"].factory(Context())}, clock=lambda: now[0])
    sampler.sample_once()
    plain = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    zipped = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\nConnection: close\r\n\r\n"
    for address in serve(make_server("127.0.0.1", free_port(), sampler)):
        for _ in range(3):
            assert b"Content-Encoding" not in _raw(address, plain).split(b"\r\n\r\n", 1)[0]
            sampler.sample_once()
        assert sampler.snapshot.gzipped is None  # plain scrapers only: no run and no scrape compressed
        body = _raw(address, zipped).split(b"\r\n\r\n", 1)[1]
        assert gzip.decompress(body) == sampler.exposition
        assert sampler.snapshot.gzipped == body  # compressed once for this snapshot, kept for the next
        sampler.sample_once()
        ready = sampler.snapshot.gzipped  # gzip scrapers are coming: the run compressed its own
        assert ready is not None and gzip.decompress(ready) == sampler.exposition
        assert _raw(address, zipped).split(b"\r\n\r\n", 1)[1] == ready
        now[0] += GZIP_INTEREST_SECONDS
        sampler.sample_once()
        assert sampler.snapshot.gzipped is None  # none asked for a while: the runs stop compressing


def test_healthz_needs_no_credentials_and_bcrypt_users_work(sampler: Sampler) -> None:
    hashed = bcrypt.hashpw(b"scrape-me", bcrypt.gensalt(rounds=4)).decode()
    users = {"prometheus": hashed}
    good = {"Authorization": "Basic " + base64.b64encode(b"prometheus:scrape-me").decode()}
    for address in serve(make_server("127.0.0.1", free_port(), sampler, users=users)):
        assert get(f"http://{address}/healthz") == (200, "ok\n")
        assert get(f"http://{address}/metrics")[0] == 401
        assert get(f"http://{address}/metrics", good)[0] == 200


def test_hashes_are_validated_at_start() -> None:
    assert hash_problem(bcrypt.hashpw(b"x", bcrypt.gensalt(rounds=4)).decode()) is None
    assert hash_problem(hash_password("x", iterations=1000)) is None
    for bad in ("pbkdf2_sha256$1000$!!!$AAAA", "pbkdf2_sha256$10$c2FsdA==$" + "A" * 44,
                "pbkdf2_sha256$1000$c2FsdA==$c2hvcnQ=", "$2y$10$tooshort", "plaintext"):
        assert hash_problem(bad) is not None, bad


def test_an_unknown_user_costs_one_password_check_like_a_known_one(monkeypatch) -> None:
    from gpuhealth.exporter import web

    checks = []
    real = web.check_password
    monkeypatch.setattr(web, "check_password", lambda p, h: (checks.append(h), real(p, h))[1])
    auth = web.BasicAuth({"prometheus": hash_password("right", iterations=1000)})
    for user in (b"prometheus:wrong", b"intruder:wrong", b"prometheus:right"):
        checks.clear()
        ok = auth.verify("Basic " + base64.b64encode(user).decode())
        assert len(checks) == 1 and ok == (user == b"prometheus:right")


def test_a_password_longer_than_bcrypt_reads_is_refused_not_dropped(sampler: Sampler) -> None:
    """bcrypt reads 72 bytes; the library raises on more, which must be a 401 like any wrong password."""
    hashed = bcrypt.hashpw(b"p" * 72, bcrypt.gensalt(rounds=4)).decode()
    for address in serve(make_server("127.0.0.1", free_port(), sampler, users={"prometheus": hashed})):
        for password in (b"p" * 73, b"p" * 72 + b"extra", "é".encode() * 60):
            header = {"Authorization": "Basic " + base64.b64encode(b"prometheus:" + password).decode()}
            assert get(f"http://{address}/metrics", header)[0] == 401
        for user in (b"nobody", b"prometheus"):  # unknown user, too: same answer, same cost
            header = {"Authorization": "Basic " + base64.b64encode(user + b":" + b"x" * 100).decode()}
            assert get(f"http://{address}/metrics", header)[0] == 401
        good = {"Authorization": "Basic " + base64.b64encode(b"prometheus:" + b"p" * 72).decode()}
        assert get(f"http://{address}/metrics", good)[0] == 200


@pytest.mark.parametrize(("accept", "gzipped"), [
    ("gzip", True), ("GZIP", True), ("deflate, gzip;q=0.5", True), ("*", True), ("br, *;q=0.1", True),
    ("gzip;q=0", False), ("gzip; q=0.000", False), ("identity", False), ("x-gzip-not", False),
    ("notgzip", False), ("*;q=0", False), ("gzip;q=0, *;q=1", False), ("gzip;q=abc", False), ("", False),
])
def test_gzip_only_when_the_accept_encoding_header_allows_it(sampler: Sampler, accept: str,
                                                             gzipped: bool) -> None:
    for address in serve(make_server("127.0.0.1", free_port(), sampler)):
        answer = _raw(address, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: " + accept.encode()
                      + b"\r\nConnection: close\r\n\r\n")
        head = answer.split(b"\r\n\r\n", 1)[0]
        assert head.startswith(b"HTTP/1.1 200") and b"Vary: Accept-Encoding" in head
        assert (b"Content-Encoding: gzip" in head) == gzipped


def test_a_request_with_a_body_is_refused_so_it_cannot_smuggle_a_second_request(sampler: Sampler) -> None:
    hashed = bcrypt.hashpw(b"scrape-me", bcrypt.gensalt(rounds=4)).decode()
    for address in serve(make_server("127.0.0.1", free_port(), sampler, users={"prometheus": hashed})):
        smuggled = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic eDp5\r\n\r\n"
        for framing in (b"Content-Length: %d" % len(smuggled), b"Transfer-Encoding: chunked",
                        b"Content-Length: %d\r\nContent-Length: 0" % len(smuggled)):
            answer = _raw(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n\r\n" + smuggled)
            assert answer.startswith(b"HTTP/1.1 400") and answer.count(b"HTTP/1.1 ") == 1, answer[:200]
        assert _raw(address, b"GET /healthz HTTP/1.1\r\n"
                             b"Host: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    ).startswith(b"HTTP/1.1 200")


def test_basic_is_case_insensitive_and_two_authorization_headers_are_refused(sampler: Sampler) -> None:
    hashed = bcrypt.hashpw(b"scrape-me", bcrypt.gensalt(rounds=4)).decode()
    token = base64.b64encode(b"prometheus:scrape-me")
    for address in serve(make_server("127.0.0.1", free_port(), sampler, users={"prometheus": hashed})):
        for scheme in (b"Basic", b"basic", b"BASIC"):
            answer = _raw(address, b"GET /metrics HTTP/1.1\r\n"
                                   b"Host: x\r\nAuthorization: " + scheme + b" " + token
                          + b"\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200"), scheme
        for first, second in ((token, b"eDp5"), (b"eDp5", token), (token, token)):
            answer = _raw(address, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic " + first
                          + b"\r\nAuthorization: Basic " + second + b"\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 401"), (first, second)


def test_a_client_that_never_reads_its_answers_is_closed_after_the_write_deadline(sampler: Sampler) -> None:
    """Pipelined requests whose answers are never read would hold a connection and a body each forever."""
    server = make_server("127.0.0.1", free_port(), sampler, limits=Limits(write_timeout=0.5))
    for address in serve(server):
        host, port = address.rsplit(":", 1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 3000)  # ~10 MB of answers
        deadline = time.monotonic() + 20
        while not server._connections:  # accepted and answering
            assert time.monotonic() < deadline, "the connection was never accepted"
            time.sleep(0.01)
        while server._connections:
            assert time.monotonic() < deadline, "a connection that never reads was kept"
            time.sleep(0.05)
        sock.close()
        assert get(f"http://{address}/healthz")[0] in (200, 503)


def test_head_answers_carry_no_body_so_a_kept_alive_client_stays_in_step(sampler: Sampler) -> None:
    """A HEAD answered 404 or 401 once sent its body; a client that keeps the connection reads that body
    as the start of the next answer (one answer injected ahead of the real one)."""
    hashed = bcrypt.hashpw(b"scrape-me", bcrypt.gensalt(rounds=4)).decode()
    for address in serve(make_server("127.0.0.1", free_port(), sampler, users={"prometheus": hashed})):
        for first in (b"HEAD /nope HTTP/1.1\r\nHost: x\r\n\r\n", b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
                      b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
                      b"HEAD / HTTP/1.1\r\nHost: x\r\nAuthorization: Basic eDp5\r\n\r\n"):
            answer = _raw(address, first + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            _, sep, rest = answer.partition(b"\r\n\r\n")
            assert sep and rest.startswith(b"HTTP/1.1 200 OK\r\n") and rest.endswith(b"\r\n\r\nok\n"), answer


# RFC 9112 MUSTs a lenient parser let through (request smuggling, a 10 s wait), each with its answer
STRICT_HEAD_PROBES = {
    "unsupported version": (b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n", 505),
    "version 2.0": (b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    "garbled version": (b"GET /healthz HTTP/1.1x\r\nHost: x\r\n\r\n", 400),
    "lower-case version": (b"GET /healthz http/1.1\r\nHost: x\r\n\r\n", 400),
    "two spaces in the request line": (b"GET  /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "method not a token": (b"G(T /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "raw byte over 0x7f in the target": (b"GET /metrics\xc0\xae HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "target neither path nor URL": (b"GET metrics HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "space before the colon": (b"GET /healthz HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    "tab before the colon": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A\t: 1\r\n\r\n", 400),
    "obs-fold": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  folded\r\n\r\n", 400),
    "whitespace before the first header": (b"GET /healthz HTTP/1.1\r\n Host: x\r\n\r\n", 400),
    "header line without a colon": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n", 400),
    "header name not a token": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX[a]: 1\r\n\r\n", 400),
    "NUL in a value": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),
    "bare CR in a value": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n", 400),
    "no Host on HTTP/1.1": (b"GET /healthz HTTP/1.1\r\n\r\n", 400),
    "two Host headers": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
    "two Content-Length 0": (b"GET /healthz HTTP/1.1\r\n"
                             b"Host: x\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n",
                             400),
    "Content-Length not a number": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -0\r\n\r\n", 400),
    "Content-Length list": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0, 0\r\n\r\n", 400),
    "Transfer-Encoding on a GET": (b"GET /healthz HTTP/1.1\r\n"
                                   b"Host: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                                   400),
    "bare LF line ends": (b"GET /healthz HTTP/1.1\nHost: x\n\n", 400),
    "bare LF after CRLF lines": (b"GET /healthz HTTP/1.1\r\nHost: x\n\r\n", 400),
    "150 small header lines": (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"A: b\r\n" * 150 + b"\r\n", 431),
}


@pytest.mark.parametrize("probe", STRICT_HEAD_PROBES)
def test_malformed_request_heads_are_refused_at_once_as_rfc_9112_says(sampler: Sampler, probe: str) -> None:
    request, status = STRICT_HEAD_PROBES[probe]
    # a head deadline far past the socket timeout: an answer held back until the deadline fails here
    server = make_server("127.0.0.1", free_port(), sampler, limits=Limits(head_timeout=60))
    for address in serve(server):
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(request)
            answer = sock.recv(65536)  # the connection is left open: the answer must come unprompted
        assert answer.startswith(b"HTTP/1.1 %d " % status) and b"Connection: close" in answer, answer[:200]
        assert get(f"http://{address}/healthz")[0] == 200  # and serving goes on


def test_odd_but_valid_requests_are_served(sampler: Sampler) -> None:
    cases = {  # request line (+ headers), expected status
        b"GET http://x/metrics HTTP/1.1\r\nHost: x": 200,  # absolute-form: a server MUST accept it
        b"GET https://x:9/healthz?a=b HTTP/1.1\r\nHost: x": 200,
        b"GET /metrics?x=&y=%00&z=%C0%AE%C0%AE%2F&&== HTTP/1.1\r\nHost: x": 200,
        b"GET /metrics/../metrics HTTP/1.1\r\nHost: x": 404,  # no path is normalised into another
        b"GET /%2e%2e/metrics HTTP/1.1\r\nHost: x": 404,
        b"GET /metrics%00 HTTP/1.1\r\nHost: x": 404,
        b"GET /healthz HTTP/1.0": 200,  # HTTP/1.0 needs no Host
        b"GET /healthz HTTP/1.2\r\nHost: x": 200,  # a later 1.x is read as 1.1 (RFC 9110 section 2.5)
        b"OPTIONS * HTTP/1.1\r\nHost: x": 405,
        b"TRACE /metrics HTTP/1.1\r\nHost: x": 405,  # no echo of the request (cross-site tracing)
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Latin: caf\xe9\tok": 200,  # obs-text and HTAB are allowed
    }
    for address in serve(make_server("127.0.0.1", free_port(), sampler)):
        for request, status in cases.items():
            # a leading CRLF is skipped (RFC 9112 section 2.2)
            answer = _raw(address, b"\r\n" + request + b"\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 %d " % status), (request, answer[:200])
            assert b"TRACE" not in answer.partition(b"\r\n\r\n")[2]


def test_a_slowloris_head_is_cut_at_the_head_deadline_not_per_byte(sampler: Sampler) -> None:
    server = make_server("127.0.0.1", free_port(), sampler, limits=Limits(head_timeout=1.0))
    for address in serve(server):
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            start, closed = time.monotonic(), False
            for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                try:
                    sock.sendall(bytes([byte]))
                    readable = sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
                except BlockingIOError:
                    readable = False
                except OSError:
                    readable = True
                if readable:
                    closed = True
                    break
                time.sleep(0.1)  # the client's pace, one byte per tenth of a second
            assert closed and time.monotonic() - start < 5  # a byte now and then does not renew the deadline
        assert get(f"http://{address}/healthz")[0] == 200


def test_half_open_tls_handshakes_neither_block_scrapes_nor_outlive_the_handshake_deadline(
        tmp_path: Path, sampler: Sampler) -> None:
    cert, key = self_signed_certificate(tmp_path)
    server = make_server("127.0.0.1", free_port(), sampler, cert, key, limits=Limits(handshake_timeout=1.0))
    context = ssl.create_default_context(cafile=str(cert))
    for address in serve(server):
        host, port = address.rsplit(":", 1)
        half_open = [socket.create_connection((host, int(port)), timeout=10) for _ in range(200)]
        try:
            for index, sock in enumerate(half_open):  # nothing, or the first bytes of a ClientHello
                if index % 2:
                    sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
            assert get(f"https://{address}/healthz", context=context)[0] == 200
            assert get(f"https://{address}/metrics", context=context)[0] == 200
            deadline = time.monotonic() + 10
            for sock in half_open:  # each is closed by the server once its handshake deadline passes
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                with contextlib.suppress(ConnectionResetError):  # a TLS alert, then EOF, or a reset
                    while sock.recv(65536):
                        pass
        finally:
            for sock in half_open:
                sock.close()
        assert get(f"https://{address}/metrics", context=context)[0] == 200
