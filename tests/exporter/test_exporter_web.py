"""The HTTP endpoints: snapshot serving, health, TLS and basic auth, on loopback."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from gpuhealth.exporter.collector import Context, load_collectors
from gpuhealth.exporter.sampler import Sampler
from gpuhealth.exporter.web import hash_password, make_server

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
