"""The Kubernetes backend finds its API server the way kubectl and client-go do, and says what is wrong."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import pytest
from gpuhealth.webhook.backends import create_backend
from gpuhealth.webhook.backends.kubernetes import KubernetesBackend, KubernetesSettings
from gpuhealth.webhook.backends.kubernetes_api import PATCH_TYPES

FIXTURES = Path(__file__).parent / "kubernetes_fixtures"
KUBECONFIG = FIXTURES / "kubeconfig.yaml"


def _ca_names(context: ssl.SSLContext) -> set[str]:
    return {value for cert in context.get_ca_certs() for rdn in cert["subject"] for key, value in rdn
            if key == "commonName"}


def test_current_context_with_a_ca_relative_to_the_kubeconfig():
    backend = KubernetesBackend.from_config({"kubeconfig": str(KUBECONFIG)})
    conn = backend.connection
    assert conn.server == "https://10.0.0.1:6443"
    assert conn.headers() == {"Authorization": "Bearer fixture-token-prod"}
    assert isinstance(conn.ssl, ssl.SSLContext)
    assert conn.ssl.verify_mode == ssl.CERT_REQUIRED
    assert _ca_names(conn.ssl) == {"gpuhealth-fixture-ca"}


def test_named_context_reads_a_token_file_that_rotates(tmp_path):
    config = tmp_path / "kubeconfig.yaml"
    shutil.copy(KUBECONFIG, config)
    (tmp_path / "token").write_text("first\n")
    conn = KubernetesBackend.from_config({"kubeconfig": str(config), "context": "lab"}).connection
    assert conn.server == "http://127.0.0.1:8080"
    assert conn.headers() == {"Authorization": "Bearer first"}
    (tmp_path / "token").write_text("rotated\n")
    assert conn.headers() == {"Authorization": "Bearer rotated"}


def test_tls_verification_is_off_only_when_set_explicitly():
    insecure = KubernetesBackend.from_config({"kubeconfig": str(KUBECONFIG),
                                              "context": "insecure"}).connection
    assert insecure.ssl is False
    assert insecure.headers()["Authorization"].startswith("Basic ")
    default = KubernetesBackend.from_config({"kubeconfig": str(KUBECONFIG), "context": "lab"}).connection
    assert default.ssl is True  # plain http: nothing to verify, and nothing switched off
    with pytest.raises(ValueError, match="certificate authority and insecure-skip-tls-verify are both set"):
        KubernetesBackend.from_config({"kubeconfig": str(KUBECONFIG), "insecure_skip_tls_verify": True})


def test_a_broken_kubeconfig_lists_every_problem():
    with pytest.raises(ValueError) as exc:
        KubernetesBackend.from_config({"kubeconfig": str(FIXTURES / "kubeconfig-broken.yaml")})
    message = str(exc.value)
    for problem in ("server must be an http(s) URL", "certificate-authority", "missing-ca.crt",
                    "exec credential plugins are not supported", "needs both a certificate and a key"):
        assert problem in message


def test_unknown_context_and_missing_file_are_named(tmp_path):
    with pytest.raises(ValueError, match="no context named 'nope'"):
        KubernetesBackend.from_config({"kubeconfig": str(KUBECONFIG), "context": "nope"})
    with pytest.raises(ValueError, match="cannot read"):
        KubernetesBackend.from_config({"kubeconfig": str(tmp_path / "absent")})


def test_bad_settings_are_listed_together():
    with pytest.raises(ValueError) as exc:
        KubernetesBackend.from_config({
            "kubeconfig": str(KUBECONFIG), "patch_type": "json", "eviction_deadline_seconds": -1,
            "job_pods": "some", "insecure_skip_tls_verify": "yes", "evicton_deadline_seconds": 5})
    message = str(exc.value)
    for problem in ("backend.patch_type: 'json' is not one of 'strategic', 'merge'",
                    "backend.eviction_deadline_seconds", "backend.job_pods",
                    "backend.insecure_skip_tls_verify",
                    "backend.evicton_deadline_seconds: unknown key"):
        assert problem in message


def test_the_patch_types_offered_are_those_the_client_sends():
    offered = KubernetesSettings.model_json_schema()["properties"]["patch_type"]["enum"]
    assert sorted(offered) == sorted(PATCH_TYPES)


def test_node_commands_are_checked_with_the_settings():
    with pytest.raises(ValueError) as exc:
        KubernetesBackend.from_config({
            "kubeconfig": str(KUBECONFIG), "node_actions": "command",
            "node_commands": {"reset_gpu": ["nvidia-smi", "-r", "-i", "{gpu}", "{job_id}"], "wipe": ["rm"],
                              "reboot": "ssh {node} reboot"}})
    message = str(exc.value)
    for problem in ("node_commands.reset_gpu: unknown placeholder(s) {job_id}", "node_commands.wipe: unknown",
                    "node_commands.reboot: a non-empty list of strings"):
        assert problem in message
    with pytest.raises(ValueError, match="node_commands: required with node_actions: command"):
        KubernetesBackend.from_config({"kubeconfig": str(KUBECONFIG), "node_actions": "command"})
    with pytest.raises(ValueError, match="only used with it"):
        KubernetesBackend.from_config({"kubeconfig": str(KUBECONFIG), "node_commands": {"reboot": ["x"]}})


def _service_account(directory: Path) -> Path:
    directory.mkdir()
    (directory / "token").write_text("sa-token\n")
    shutil.copy(FIXTURES / "ca.crt", directory / "ca.crt")
    return directory


def test_in_cluster_service_account(tmp_path, monkeypatch):
    sa = _service_account(tmp_path / "sa")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    conn = KubernetesBackend.from_config({"service_account_dir": str(sa)}).connection
    assert conn.server == "https://[fd00::1]:443"
    assert conn.headers() == {"Authorization": "Bearer sa-token"}
    assert isinstance(conn.ssl, ssl.SSLContext)
    assert _ca_names(conn.ssl) == {"gpuhealth-fixture-ca"}


def test_in_cluster_outside_a_pod_says_why(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(ValueError) as exc:
        KubernetesBackend.from_config({"service_account_dir": str(tmp_path), "context": "x"})
    message = str(exc.value)
    for problem in ("KUBERNETES_SERVICE_HOST", f"{tmp_path}/token does not exist",
                    f"{tmp_path}/ca.crt does not exist", "backend.context: only meaningful with"):
        assert problem in message


def test_the_registry_builds_it_from_the_backend_section():
    backend = create_backend({"type": "kubernetes", "kubeconfig": str(KUBECONFIG),
                              "node_selector": "gpu=true"})
    assert isinstance(backend, KubernetesBackend)
    assert backend.name == "kubernetes"
    assert backend.settings.node_selector == "gpu=true"
