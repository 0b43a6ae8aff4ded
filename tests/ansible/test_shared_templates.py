"""The configuration templates shared with the closed-loop demo render with plain jinja2 (no Ansible)
and produce configurations the real tools accept: promtool, amtool and the webhook's own checker."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible_helpers import BIN
from gpuhealth.exporter.collector import load_collectors
from gpuhealth.exporter.config import build_settings
from gpuhealth.rules.catalogue import REMOTE_WRITE_SERIES
from rendering import render, render_to
from wheelhouse import ROOT

RULES = ROOT / "rules" / "generated" / "gpuhealth"
EXAMPLE = yaml.safe_load((ROOT / "rules" / "alertmanager.yml").read_text())
TARGETS = [{"node": "gpu-a001", "address": "10.0.0.1:9835"}, {"node": "gpu-a002", "address": "10.0.0.2:9835"}]
WEBHOOK_URL = "http://127.0.0.1:19836/alerts"


def prometheus_vars(prefix: Path, targets: list[dict]) -> dict:
    return {
        "gpuhealth_prometheus_root_prefix": str(prefix),
        "gpuhealth_prometheus_exporter_targets": targets,
        "gpuhealth_prometheus_alertmanager_example": EXAMPLE,
        "gpuhealth_prometheus_webhook_url": WEBHOOK_URL,
        "gpuhealth_prometheus_scrape_interval": "5s",
        "gpuhealth_prometheus_evaluation_interval": "5s",
        "gpuhealth_prometheus_extra_scrape_configs": [
            {"job_name": "node", "static_configs": [{"targets": ["127.0.0.1:9100"]}]}],
    }


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("targets", [TARGETS, []], ids=["two-nodes", "no-nodes"])
def test_prometheus_config_passes_promtool(tmp_path: Path, targets: list[dict]):
    variables = prometheus_vars(tmp_path, targets)
    rules_dir = tmp_path / "etc/prometheus/rules/gpuhealth"
    shutil.copytree(RULES, rules_dir)
    sd = render_to(tmp_path / "etc/prometheus/file_sd/gpuhealth-exporters.yml", "gpuhealth_prometheus",
                   "gpuhealth-exporters.yml.j2", variables)
    config = render_to(tmp_path / "etc/prometheus/prometheus.yml", "gpuhealth_prometheus",
                       "prometheus.yml.j2", variables)

    check = run("promtool", "check", "config", str(config))
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{len(list(RULES.glob('*.yml')))} rule files found" in check.stdout

    parsed = yaml.safe_load(config.read_text())
    assert parsed["global"] == {"scrape_interval": "5s", "evaluation_interval": "5s"}
    jobs = [c["job_name"] for c in parsed["scrape_configs"]]
    assert jobs == ["gpuhealth-exporter", "gpuhealth-webhook", "node"]
    assert parsed["scrape_configs"][0]["file_sd_configs"] == [{"files": [str(sd)]}]
    assert yaml.safe_load(sd.read_text()) == [{"targets": [t["address"]], "labels": {"node": t["node"]}}
                                              for t in targets]


def test_prometheus_config_without_webhook_job(tmp_path: Path):
    variables = {**prometheus_vars(tmp_path, TARGETS), "gpuhealth_prometheus_webhook_target": ""}
    parsed = yaml.safe_load(render("gpuhealth_prometheus", "prometheus.yml.j2", variables))
    assert [c["job_name"] for c in parsed["scrape_configs"]] == ["gpuhealth-exporter", "node"]


def test_alertmanager_config_is_the_example_with_site_values(tmp_path: Path):
    config = render_to(tmp_path / "alertmanager.yml", "gpuhealth_prometheus",
                       "alertmanager.yml.j2", prometheus_vars(tmp_path, TARGETS))
    check = run("amtool", "check-config", str(config))
    assert check.returncode == 0, check.stdout + check.stderr

    expected = copy.deepcopy(EXAMPLE)
    webhooks = [w for r in expected["receivers"] for w in r.get("webhook_configs", [])]
    assert webhooks, "rules/alertmanager.yml has no webhook receiver"
    for webhook in webhooks:
        webhook["url"] = WEBHOOK_URL
        webhook["http_config"]["authorization"] = {
            "type": "Bearer", "credentials_file": f"{tmp_path}/etc/prometheus/gpuhealth-webhook.token"}
    assert yaml.safe_load(config.read_text()) == expected


@pytest.mark.parametrize(("action", "receiver"), [
    ("drain", "gpuhealth-webhook"), ("drain_reboot", "gpuhealth-webhook"), ("none", "gpuhealth-notify")])
def test_alertmanager_routes_actions_to_the_webhook(tmp_path: Path, action: str, receiver: str):
    config = render_to(tmp_path / "alertmanager.yml", "gpuhealth_prometheus", "alertmanager.yml.j2",
                       prometheus_vars(tmp_path, TARGETS))
    routed = run("amtool", "config", "routes", "test", f"--config.file={config}",
                 "alertname=GPUHealthXidDrain", "node=gpu-a001", f"action={action}")
    assert routed.stdout.strip() == receiver, routed.stdout + routed.stderr


def test_webhook_config_passes_the_webhooks_checker(tmp_path: Path):
    variables = {"gpuhealth_webhook_root_prefix": str(tmp_path), "gpuhealth_webhook_dry_run": True,
                 "gpuhealth_webhook_guardrails": {"breaker_max_nodes": 1, "deny_nodes": ["login*"]}}
    config = render_to(tmp_path / "etc/gpuhealth/webhook.yml", "gpuhealth_webhook", "webhook.yml.j2",
                       variables)
    (tmp_path / "etc/gpuhealth/webhook.token").write_text("0123456789abcdef0123\n")
    (tmp_path / "var/lib/gpuhealth-webhook").mkdir(parents=True)

    check = run(str(BIN / "gpuhealth-webhook"), "--config", str(config), "--check-config")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "dry_run True" in check.stdout
    parsed = yaml.safe_load(config.read_text())
    assert parsed["auth"] == {"token_file": f"{tmp_path}/etc/gpuhealth/webhook.token"}
    assert parsed["guardrails"] == {"breaker_max_nodes": 1, "deny_nodes": ["login*"],
                                    "requeue_breaker_max_nodes": 5, "requeue_breaker_window_seconds": 600}
    assert (parsed["connection_idle_timeout_seconds"], parsed["connection_limit"]) == (15, 512)


def test_webhook_operator_credentials_requeue_cap_and_connections_reach_the_webhook(tmp_path: Path):
    variables = {"gpuhealth_webhook_root_prefix": str(tmp_path),
                 "gpuhealth_webhook_operator_token": "operator-0123456789",
                 "gpuhealth_webhook_operator_basic_auth": {"username": "alice", "password": "s3cret-pass"},
                 "gpuhealth_webhook_requeue_breaker_max_nodes": 3,
                 "gpuhealth_webhook_requeue_breaker_window_seconds": 120,
                 "gpuhealth_webhook_connection_idle_timeout_seconds": 5,
                 "gpuhealth_webhook_connection_limit": 200}
    etc = tmp_path / "etc/gpuhealth"
    config = render_to(etc / "webhook.yml", "gpuhealth_webhook", "webhook.yml.j2", variables)
    secrets = {"webhook.token": "0123456789abcdef0123", "webhook.operator.token": "operator-0123456789",
               "webhook.operator.password": "s3cret-pass"}
    for name, secret in secrets.items():
        (etc / name).write_text(secret + "\n")
    (tmp_path / "var/lib/gpuhealth-webhook").mkdir(parents=True)

    check = run(str(BIN / "gpuhealth-webhook"), "--config", str(config), "--check-config")
    assert check.returncode == 0, check.stdout + check.stderr
    parsed = yaml.safe_load(config.read_text())
    assert parsed["auth"]["operator"] == {
        "token_file": f"{etc}/webhook.operator.token",
        "basic_auth": {"username": "alice", "password_file": f"{etc}/webhook.operator.password"}}
    assert parsed["guardrails"] == {"requeue_breaker_max_nodes": 3, "requeue_breaker_window_seconds": 120}
    assert (parsed["connection_idle_timeout_seconds"], parsed["connection_limit"]) == (5, 200)


def test_webhook_config_rejected_by_the_webhook_when_wrong(tmp_path: Path):
    variables = {"gpuhealth_webhook_root_prefix": str(tmp_path),
                 "gpuhealth_webhook_backend": {"type": "nosuch"},
                 "gpuhealth_webhook_guardrails": {"breaker_max_nodes": -1}}
    config = render_to(tmp_path / "etc/gpuhealth/webhook.yml", "gpuhealth_webhook", "webhook.yml.j2",
                       variables)
    check = run(str(BIN / "gpuhealth-webhook"), "--config", str(config), "--check-config")
    assert check.returncode == 2
    assert "nosuch" in check.stderr and "breaker_max_nodes" in check.stderr


def test_exporter_config_has_only_what_is_set(tmp_path: Path):
    minimal = yaml.safe_load(render("gpuhealth_exporter", "exporter.yml.j2", {}))
    assert minimal == {"state_dir": "/var/lib/gpuhealth-exporter"}
    full = yaml.safe_load(render("gpuhealth_exporter", "exporter.yml.j2", {
        "gpuhealth_exporter_root_prefix": str(tmp_path), "gpuhealth_exporter_gpus_expected": 8,
        "gpuhealth_exporter_kmsg_path": "/var/log/kern.log",
        "gpuhealth_exporter_settings": {"sampling_window": 30, "collectors": {"nfs": False}}}))
    assert full == {"state_dir": f"{tmp_path}/var/lib/gpuhealth-exporter", "gpus_expected": 8,
                    "kmsg_path": "/var/log/kern.log", "sampling_window": 30, "collectors": {"nfs": False}}


@pytest.mark.parametrize(("rate", "switches", "fabric"), [
    (0, {}, None),
    (400, {}, {"expected_rate_gbps": 400.0}),
    ({"mlx5_0": 400, "mlx5_8": 200}, {"mlx5_0": "leaf-r3-a"},
     {"expected_rate_gbps": {"mlx5_0": 400, "mlx5_8": 200}, "switches": {"mlx5_0": "leaf-r3-a"}}),
    (0, {"mlx5_1": "leaf-r3-b"}, {"switches": {"mlx5_1": "leaf-r3-b"}}),
])
def test_exporter_fabric_settings_reach_the_exporter(rate: object, switches: dict, fabric: dict | None):
    config = yaml.safe_load(render("gpuhealth_exporter", "exporter.yml.j2", {
        "gpuhealth_exporter_fabric_expected_rate_gbps": rate,
        "gpuhealth_exporter_fabric_switches": switches}))
    assert config.get("fabric") == fabric
    del config["state_dir"]  # not on this machine
    settings = build_settings(config, {}, list(load_collectors())).fabric
    assert settings.switches == switches
    if isinstance(rate, dict):
        assert settings.expected_rate("mlx5_8") == 200 * 1e9 / 8
    else:
        assert settings.expected_rate("mlx5_0") == (rate * 1e9 / 8 if rate else None)


def test_exporter_settings_keys_cannot_inject_yaml():
    """A key was written as it was: a newline in it wrote a second setting of its own."""
    hostile = 'sampling_window: 1\nbackend: "nvml"\nx'
    config = yaml.safe_load(render("gpuhealth_exporter", "exporter.yml.j2", {
        "gpuhealth_exporter_settings": {hostile: 30, "a: b": 1}}))
    assert config == {"state_dir": "/var/lib/gpuhealth-exporter", hostile: 30, "a: b": 1}


def test_managed_header_is_optional():
    header = "# Ansible managed"
    text = render("gpuhealth_exporter", "exporter.yml.j2", {"gpuhealth_managed_header": header})
    assert text.startswith(header + "\n")
    assert not render("gpuhealth_exporter", "exporter.yml.j2", {}).startswith(header)


def test_webhook_kubeconfig_becomes_the_kubernetes_backends(tmp_path: Path):
    kubeconfig = yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fleet",
        "clusters": [{"name": "fleet", "cluster": {"server": "https://127.0.0.1:6443",
                                                   "insecure-skip-tls-verify": True}}],
        "users": [{"name": "gpuhealth", "user": {"token": "sa-token"}}],
        "contexts": [{"name": "fleet", "context": {"cluster": "fleet", "user": "gpuhealth"}}]})
    variables = {"gpuhealth_webhook_root_prefix": str(tmp_path), "gpuhealth_webhook_kubeconfig": kubeconfig,
                 "gpuhealth_webhook_backend": {"type": "kubernetes"}}
    config = render_to(tmp_path / "etc/gpuhealth/webhook.yml", "gpuhealth_webhook", "webhook.yml.j2",
                       variables)
    kubeconfig_file = tmp_path / "etc/gpuhealth/webhook.kubeconfig"
    kubeconfig_file.write_text(kubeconfig)
    (tmp_path / "etc/gpuhealth/webhook.token").write_text("0123456789abcdef0123\n")
    (tmp_path / "var/lib/gpuhealth-webhook").mkdir(parents=True)

    assert yaml.safe_load(config.read_text())["backend"] == {"type": "kubernetes",
                                                             "kubeconfig": str(kubeconfig_file)}
    check = run(str(BIN / "gpuhealth-webhook"), "--config", str(config), "--check-config")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "backend kubernetes" in check.stdout

    own = {"type": "kubernetes", "kubeconfig": "/etc/k8s/admin.conf"}
    named = {**variables, "gpuhealth_webhook_backend": own}
    rendered = yaml.safe_load(render("gpuhealth_webhook", "webhook.yml.j2", named))
    assert rendered["backend"]["kubeconfig"] == "/etc/k8s/admin.conf"


@pytest.mark.parametrize(("role", "template"), [
    ("gpuhealth_prometheus", "gpuhealth-exporters.yml.j2"), ("gpuhealth_prometheus", "prometheus.yml.j2"),
    ("gpuhealth_prometheus", "alertmanager.yml.j2"), ("gpuhealth_webhook", "webhook.yml.j2"),
    ("gpuhealth_exporter", "exporter.yml.j2")])
def test_whitespace_options_do_not_change_the_result(tmp_path: Path, role: str, template: str):
    variables = {**prometheus_vars(tmp_path, TARGETS), "gpuhealth_prometheus_cluster": "east",
                 "gpuhealth_webhook_kubeconfig": "x", "gpuhealth_exporter_gpus_expected": 8,
                 "gpuhealth_managed_header": "# managed"}
    trimmed = yaml.safe_load(render(role, template, variables))
    assert trimmed == yaml.safe_load(render(role, template, variables, trim_blocks=False))


def test_cluster_label_on_every_gpuhealth_target(tmp_path: Path):
    variables = {**prometheus_vars(tmp_path, TARGETS), "gpuhealth_prometheus_cluster": "east"}
    targets = yaml.safe_load(render("gpuhealth_prometheus", "gpuhealth-exporters.yml.j2", variables))
    assert [t["labels"] for t in targets] == [{"node": t["node"], "cluster": "east"} for t in TARGETS]
    config = yaml.safe_load(render("gpuhealth_prometheus", "prometheus.yml.j2", variables))
    webhook = next(c for c in config["scrape_configs"] if c["job_name"] == "gpuhealth-webhook")
    assert webhook["static_configs"][0]["labels"] == {"cluster": "east"}


def test_shard_config_keeps_its_share_and_sends_records_and_alerts(tmp_path: Path):
    """A shard of the tiered layout: its hashmod share of the exporters by node, its external label,
    and a remote write of what the global tier reads (the catalogue's REMOTE_WRITE_SERIES)."""
    variables = {**prometheus_vars(tmp_path, TARGETS), "gpuhealth_prometheus_shards": 4,
                 "gpuhealth_prometheus_shard_index": 3,
                 "gpuhealth_prometheus_remote_write_url": "http://127.0.0.1:8428/api/v1/write"}
    config = render_to(tmp_path / "prometheus.yml", "gpuhealth_prometheus", "prometheus.yml.j2", variables)
    check = run("promtool", "check", "config", str(config))
    assert check.returncode == 0, check.stdout + check.stderr
    parsed = yaml.safe_load(config.read_text())
    assert parsed["global"]["external_labels"] == {"prometheus": "shard-3"}
    assert parsed["scrape_configs"][0]["relabel_configs"] == [
        {"source_labels": ["node"], "modulus": 4, "target_label": "__tmp_shard", "action": "hashmod"},
        {"source_labels": ["__tmp_shard"], "regex": "3", "action": "keep"}]
    assert parsed["remote_write"] == [{"url": "http://127.0.0.1:8428/api/v1/write", "write_relabel_configs": [
        {"source_labels": ["__name__"], "regex": REMOTE_WRITE_SERIES, "action": "keep"}]}]
    single = yaml.safe_load(render("gpuhealth_prometheus", "prometheus.yml.j2",
                                   prometheus_vars(tmp_path, TARGETS)))
    assert "remote_write" not in single and "relabel_configs" not in single["scrape_configs"][0]
