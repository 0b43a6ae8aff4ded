"""Where the Kubernetes API server is and how to prove who we are: in-cluster or a kubeconfig.

Follows client-go's rules so that a kubeconfig that works with kubectl works here: relative paths
are relative to the kubeconfig file, ``*-data`` fields are base64, the current context is used
unless one is named. Exec and auth-provider plugins are refused with a clear error rather than
silently ignored, and TLS verification is only ever turned off by an explicit setting.
"""

from __future__ import annotations

import base64
import binascii
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from gpuhealth.contract.files import read_text

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class Connection:
    """An API server address with its TLS settings and credentials."""

    server: str  # scheme://host:port[/prefix], no trailing slash
    ssl: ssl.SSLContext | bool  # True: system CAs; False only when verification was switched off explicitly
    token: str | None = None
    token_file: Path | None = None  # re-read on every request: service-account tokens rotate
    basic_auth: tuple[str, str] | None = None

    def headers(self) -> dict[str, str]:
        """Authentication headers for one request; raises ``OSError`` if the token file is gone."""
        token = self.token
        if token is None and self.token_file is not None:
            token = read_text(self.token_file).strip()
        if token:
            return {"Authorization": f"Bearer {token}"}
        if self.basic_auth is not None:
            pair = ":".join(self.basic_auth).encode()
            return {"Authorization": f"Basic {base64.b64encode(pair).decode()}"}
        return {}


def in_cluster(sa_dir: Path, insecure: bool, errors: list[str]) -> Connection | None:
    """The pod's service account, as the kubelet mounts it, and the API service from the environment."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "")
    before = len(errors)
    if not host or not port:
        errors.append("in-cluster: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set "
                      "(not running in a pod? set backend.kubeconfig)")
    token_file, ca_file = sa_dir / "token", sa_dir / "ca.crt"
    for path in (token_file, ca_file):
        if not path.is_file():
            errors.append(f"in-cluster: {path} does not exist (service account token not mounted?)")
    if len(errors) > before:
        return None
    if ":" in host:
        host = f"[{host}]"
    context = False if insecure else _ssl_context(ca_file=ca_file, where="in-cluster", errors=errors)
    return Connection(server=f"https://{host}:{port}", ssl=True if context is None else context,
                      token_file=token_file)


def from_kubeconfig(path: Path, context_name: str | None, insecure: bool,
                    errors: list[str]) -> Connection | None:
    """The cluster and user of one context of a kubeconfig file (the current one by default)."""
    where = f"kubeconfig {path}"
    try:
        doc = yaml.safe_load(read_text(path))
    except OSError as exc:
        errors.append(f"{where}: cannot read: {exc.strerror}")
        return None
    except yaml.YAMLError as exc:
        errors.append(f"{where}: not valid YAML: {exc}")
        return None
    if not isinstance(doc, dict):
        errors.append(f"{where}: not a kubeconfig (expected a mapping)")
        return None
    name = context_name or doc.get("current-context")
    if not name:
        errors.append(f"{where}: no current-context set and no backend.context given")
        return None
    context = _named(doc, "contexts", "context", name, where, errors)
    if context is None:
        return None
    cluster = _named(doc, "clusters", "cluster", context.get("cluster"), where, errors)
    user: Mapping[str, Any] = {}
    if context.get("user"):
        user = _named(doc, "users", "user", context["user"], where, errors) or {}
    if cluster is None:
        return None
    base = path.parent
    before = len(errors)
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("https://", "http://")):
        errors.append(f"{where}: cluster {context.get('cluster')!r}: server must be an http(s) URL, "
                      f"got {server!r}")
    insecure = insecure or cluster.get("insecure-skip-tls-verify") is True
    ca_file, ca_data = _file_or_data(cluster, "certificate-authority", base, where, errors)
    if insecure and (ca_file or ca_data):
        errors.append(f"{where}: a certificate authority and insecure-skip-tls-verify are both set")
    for plugin in ("exec", "auth-provider"):
        if plugin in user:
            errors.append(f"{where}: user {context['user']!r}: {plugin} credential plugins are not "
                          "supported; use a service-account token or a client certificate")
    cert_file, cert_data = _file_or_data(user, "client-certificate", base, where, errors)
    key_file, key_data = _file_or_data(user, "client-key", base, where, errors)
    if bool(cert_file or cert_data) != bool(key_file or key_data):
        errors.append(f"{where}: user {context['user']!r}: a client certificate needs both a "
                      "certificate and a key")
    token_file = _resolve(base, user["tokenFile"]) if user.get("tokenFile") else None
    if token_file is not None and not token_file.is_file():
        errors.append(f"{where}: tokenFile {token_file} does not exist")
    if len(errors) > before:
        return None
    tls: ssl.SSLContext | bool | None = True
    if server.startswith("https://"):
        tls = False if insecure else _ssl_context(
            ca_file=ca_file, ca_data=ca_data, cert=(cert_file, cert_data), key=(key_file, key_data),
            where=where, errors=errors)
    basic = (str(user["username"]), str(user.get("password", ""))) if user.get("username") else None
    return Connection(server=server, ssl=True if tls is None else tls, token=user.get("token") or None,
                      token_file=None if user.get("token") else token_file, basic_auth=basic)


def _named(doc: Mapping[str, Any], section: str, field: str, name: Any, where: str,
           errors: list[str]) -> Mapping[str, Any] | None:
    for entry in doc.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name and isinstance(entry.get(field), dict):
            found: Mapping[str, Any] = entry[field]
            return found
    errors.append(f"{where}: no {field} named {name!r} in {section}")
    return None


def _resolve(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _file_or_data(entry: Mapping[str, Any], field: str, base: Path, where: str,
                  errors: list[str]) -> tuple[Path | None, bytes | None]:
    """A PEM given as a path (``field``) or inline as base64 (``field-data``), never both."""
    path_value, data_value = entry.get(field), entry.get(f"{field}-data")
    if path_value and data_value:
        errors.append(f"{where}: both {field} and {field}-data are set")
        return None, None
    if data_value:
        try:
            return None, base64.b64decode(str(data_value), validate=True)
        except (binascii.Error, ValueError):
            errors.append(f"{where}: {field}-data is not valid base64")
            return None, None
    if path_value:
        path = _resolve(base, str(path_value))
        if not path.is_file():
            errors.append(f"{where}: {field} {path} does not exist")
            return None, None
        return path, None
    return None, None


def _ssl_context(*, ca_file: Path | None = None, ca_data: bytes | None = None,
                 cert: tuple[Path | None, bytes | None] = (None, None),
                 key: tuple[Path | None, bytes | None] = (None, None),
                 where: str, errors: list[str]) -> ssl.SSLContext | None:
    try:
        context = ssl.create_default_context(
            cafile=str(ca_file) if ca_file else None,
            cadata=ca_data.decode() if ca_data else None)
        if cert != (None, None):
            with tempfile.TemporaryDirectory(prefix="gpuhealth-kube-") as tmp:
                # ssl only loads a certificate chain from files; the directory is private (0700).
                certfile = cert[0] or _write(Path(tmp) / "cert.pem", cert[1])
                keyfile = key[0] or _write(Path(tmp) / "key.pem", key[1])
                context.load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError, UnicodeDecodeError) as exc:
        errors.append(f"{where}: cannot load TLS material: {exc}")
        return None
    return context


def _write(path: Path, data: bytes | None) -> Path:
    path.write_bytes(data or b"")
    return path
