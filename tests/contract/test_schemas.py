"""docs/schema/ is current, and each schema accepts and refuses what the service does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
import yaml
from gpuhealth.exporter.config import ConfigError as ExporterConfigError
from gpuhealth.exporter.config import build_settings
from gpuhealth.exporter.sim.scenario import ScenarioError as SimScenarioError
from gpuhealth.exporter.sim.scenario import parse_scenario as parse_sim_scenario
from gpuhealth.rules import catalogue
from gpuhealth.webhook.backends.command import CommandBackend
from gpuhealth.webhook.backends.kubernetes import KubernetesBackend
from gpuhealth.webhook.backends.simulated import SimulatedBackend
from gpuhealth.webhook.backends.slurm import SlurmBackend
from gpuhealth.webhook.config import ConfigError, parse_config
from gpuhealth.webhook.models import PayloadError, parse_notification

from gpuhealth.cli import main
from gpuhealth.schema import SCHEMAS

ROOT = Path(__file__).parents[2]
SCHEMA_DIR = ROOT / "docs" / "schema"
PROCFS = ROOT / "tests" / "exporter" / "fixtures" / "procfs"
KUBECONFIG = str(ROOT / "tests" / "webhook" / "kubernetes_fixtures" / "kubeconfig.yaml")


def committed(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads((SCHEMA_DIR / f"{name}.json").read_text()))


def test_committed_schemas_are_current(capsys):
    assert main(["schema", "--check", "--out", str(SCHEMA_DIR)]) == 0, capsys.readouterr().err
    assert sorted(p.stem for p in SCHEMA_DIR.glob("*.json")) == sorted(SCHEMAS)


def test_a_stale_schema_is_named(tmp_path, capsys):
    shutil.copytree(SCHEMA_DIR, tmp_path, dirs_exist_ok=True)
    (tmp_path / "webhook-config.json").write_text("{}\n")
    assert main(["schema", "--check", "--out", str(tmp_path)]) == 1
    assert "webhook-config.json: out of date" in capsys.readouterr().err


def test_one_schema_is_printed(capsys):
    assert main(["schema", "webhook-config"]) == 0
    assert json.loads(capsys.readouterr().out)["$id"] == "webhook-config.json"


def test_every_schema_is_valid_json_schema():
    for name in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(committed(name).schema)


WEBHOOK_CASES = [
    ({"backend": {"type": "slurm"}}, True),
    ({"backend": {"type": "slurm"}, "listen": "127.0.0.1:9836", "dry_run": True,
      "policy": {"rules": [{"match": {"alertname": "GPUHealth.*", "xid": 79}, "action": "drain"}]},
      "guardrails": {"require_approval": ["replace"], "breaker_max_fraction": 0.1}}, True),
    ({}, False),
    ({"backend": {"type": "slurm"}, "surprise": 1}, False),
    ({"backend": {"type": "slurm"}, "dry_run": "yes"}, False),
    ({"backend": {"type": "slurm"}, "guardrails": {"breaker_max_fraction": 2}}, False),
    ({"backend": {"type": "slurm"}, "guardrails": {"require_approval": ["reboot"]}}, False),
    ({"backend": {"type": "slurm"}, "policy": {"rules": [{"match": {}}]}}, False),
    ({"backend": {"type": "slurm"}, "auth": {"operator": {}}}, False),
    ({"backend": {"type": "slurm"}, "auth": {"basic_auth": {"username": "am"}}}, False),
    ({"backend": {"type": "slurm"}, "connection_limit": 0}, False),
]


@pytest.mark.parametrize(("document", "valid"), WEBHOOK_CASES)
def test_the_webhook_schema_agrees_with_the_webhook(tmp_path, document, valid):
    assert committed("webhook-config").is_valid(document) == valid
    try:
        parse_config(document, tmp_path)
    except ConfigError:
        assert not valid
    else:
        assert valid


def test_the_example_webhook_config_is_valid_for_editors():
    example = yaml.safe_load((ROOT / "webhook" / "config.example.yaml").read_text())
    assert list(committed("webhook-config").iter_errors(example)) == []


EXPORTER_CASES = [
    ({}, True),
    ({"backend": "sim", "sampling_window": 30, "collectors": {"nfs": False}, "log_level": "debug",
      "web": {"basic_auth_users": {}}}, True),
    ({"backend": "cuda"}, False),
    ({"sampling_interval": -1}, False),
    ({"sampling_interval": "1"}, False),
    ({"gpus_expected": 2.9}, False),
    ({"no_kmsg": "false"}, False),
    ({"collectors": {"nfs": "false"}}, False),
    ({"colour": "blue"}, False),
    ({"web": {"colour": 1}}, False),
]


@pytest.mark.parametrize(("document", "valid"), EXPORTER_CASES)
def test_the_exporter_schema_agrees_with_the_exporter(document, valid):
    """Type-level cases: whether a path exists is the service's to check, not an editor's."""
    assert committed("exporter-config").is_valid(document) == valid
    try:
        build_settings(document, {"procfs": str(PROCFS)}, ["gpu", "nfs"])
    except ExporterConfigError:
        assert not valid
    else:
        assert valid


RECORDED = sorted((ROOT / "tests" / "webhook" / "fixtures").glob("*_*.json"))


@pytest.mark.parametrize("path", [p for p in RECORDED if p.name != "delivery_headers.json"],
                         ids=lambda p: p.stem)
def test_notifications_recorded_from_alertmanager_match_the_payload_schema(path):
    body = json.loads(path.read_text())
    assert list(committed("alertmanager-payload").iter_errors(body)) == []
    assert parse_notification(body).alerts


def test_the_payload_schema_refuses_what_the_webhook_refuses():
    body = json.loads((ROOT / "tests" / "webhook" / "fixtures" / "firing_single_gpu.json").read_text())
    for field, value in (("version", "3"), ("alerts", []), ("status", "maybe"), ("truncatedAlerts", -1)):
        broken = {**body, field: value}
        assert not committed("alertmanager-payload").is_valid(broken), field
        with pytest.raises(PayloadError, match=field):
            parse_notification(broken)
    broken = {**body, "alerts": [{**body["alerts"][0], "fingerprint": "XYZ"}]}
    assert not committed("alertmanager-payload").is_valid(broken)
    with pytest.raises(PayloadError, match=r"alerts\[0\]\.fingerprint"):
        parse_notification(broken)


@pytest.mark.parametrize(("section", "valid"), [
    ({}, True),
    ({"scontrol": ["sudo", "-n", "/usr/bin/scontrol"], "timeout_seconds": 10, "partition": "gpu",
      "reset_gpu_command": ["ssh", "--", "{node}", "nvidia-smi", "-r", "-i", "{gpu}"],
      "reset_gpu_fallback": "reboot", "reboot_next_state": "DOWN"}, True),
    ({"scontrol": ""}, False),
    ({"timeout_seconds": 0}, False),
    ({"reboot_next_state": "UP"}, False),
    ({"colour": 1}, False),
])
def test_the_slurm_backend_schema_agrees_with_the_backend(section, valid):
    assert committed("webhook-backend-slurm").is_valid(section) == valid
    try:
        SlurmBackend.from_config(section)
    except ValueError:
        assert not valid
    else:
        assert valid


@pytest.mark.parametrize(("section", "valid"), [
    ({"nodes": "gpu[01-16]"}, True),
    ({"nodes": ["gpu01", "gpu02"], "jobs": {"gpu01": [17, "18_2"]}, "latency_seconds": 0.1}, True),
    ({}, False),
    ({"nodes": []}, False),
    ({"nodes": ["gpu01"], "latency_seconds": -1}, False),
    ({"nodes": ["gpu01"], "jobs": {"gpu01": "17"}}, False),
    ({"nodes": ["gpu01"], "color": "red"}, False),
])
def test_the_simulated_backend_schema_agrees_with_the_backend(section, valid):
    assert committed("webhook-backend-simulated").is_valid(section) == valid
    try:
        SimulatedBackend.from_config(section)
    except ValueError:
        assert not valid
    else:
        assert valid


@pytest.mark.parametrize(("section", "valid"), [
    ({"fleet_size": 4}, True),
    ({"fleet_size": 4, "timeout_seconds": 5, "env": {"SITE": "lab"}, "permanent_exit_codes": [2],
      "commands": {"node_state": ["site-state", "{node}"], "drain": ["ssh", "--", "{node}", "{reason!q}"]}},
     True),
    ({"fleet_size": 0}, False),
    ({"fleet_size": 4, "timeout_seconds": 0}, False),
    ({"fleet_size": 4, "commands": {"explode": ["x"]}}, False),
    ({"fleet_size": 4, "commands": {"node_state": "site-state {node}"}}, False),
    ({"fleet_size": 4, "env": {"A": 1}}, False),
    ({"fleet_size": 4, "colour": 1}, False),
])
def test_the_command_backend_schema_agrees_with_the_backend(section, valid):
    assert committed("webhook-backend-command").is_valid(section) == valid
    try:
        CommandBackend.from_config(section)
    except ValueError:
        assert not valid
    else:
        assert valid


@pytest.mark.parametrize(("section", "valid"), [
    ({"kubeconfig": KUBECONFIG}, True),
    ({"kubeconfig": KUBECONFIG, "context": "lab", "patch_type": "merge", "job_pods": "on_excluded_nodes",
      "node_actions": "command", "node_commands": {"reboot": ["site-reboot", "{node}"]}}, True),
    ({"kubeconfig": KUBECONFIG, "patch_type": "json"}, False),
    ({"kubeconfig": KUBECONFIG, "eviction_deadline_seconds": -1}, False),
    ({"kubeconfig": KUBECONFIG, "insecure_skip_tls_verify": "yes"}, False),
    ({"kubeconfig": KUBECONFIG, "node_actions": "command", "node_commands": {"wipe": ["rm"]}}, False),
    ({"kubeconfig": KUBECONFIG, "evicton_deadline_seconds": 5}, False),
])
def test_the_kubernetes_backend_schema_agrees_with_the_backend(section, valid):
    assert committed("webhook-backend-kubernetes").is_valid(section) == valid
    try:
        KubernetesBackend.from_config(section)
    except ValueError:
        assert not valid
    else:
        assert valid


@pytest.mark.parametrize(("document", "valid"), [
    ({}, True),
    ({"gpus": 2, "nvlinks": 4, "workload": {"utilization": 0.5, "period_seconds": "10m"},
      "processes": [{"pid": 7, "gpus": [0, 1]}],
      "faults": [{"kind": "hbm_degradation", "gpu": 1, "start": "1m", "precursor": 120, "xid": 95},
                 {"kind": "hot_aisle", "gpus": [0], "duration": "5m", "delta_celsius": 4}]}, True),
    ({"gpus": 0}, False),
    ({"workload": {"utilization": 1.5}}, False),
    ({"faults": [{"kind": "meteor_strike", "gpu": 0}]}, False),
    ({"faults": [{"kind": "fell_off_bus", "gpu": 0, "start": "1.5h"}]}, False),
    ({"processes": [{"pid": 0, "gpus": [0]}]}, False),
    ({"colour": 1}, False),
])
def test_the_simulator_scenario_schema_agrees_with_the_simulator(document, valid):
    assert committed("exporter-sim-scenario").is_valid(document) == valid
    try:
        parse_sim_scenario(document)
    except SimScenarioError:
        assert not valid
    else:
        assert valid


@pytest.mark.parametrize(("overlay", "valid"), [
    ({}, True),
    ({"defaults": {"gpu_shards": 2, "for": {"GPUHealthExporterDown": "10m"}}}, True),
    ({"defaults": {"gpu_shards": 4}}, False),
    ({"defaults": {"for": {"GPUHealthExporterDown": "1.5h"}}}, False),
    ({"defaults": {"identity_labels": ["cluster", "gpu"]}}, False),
    ({"defaults": {"xid": {"repeated_app_fault": {"xids": [], "count": 0}}}}, False),
    ({"alerts": {"GPUHealthLemonNode": {"action": "shoot"}}}, False),
])
def test_the_rule_catalogue_schema_agrees_with_the_generator(overlay, valid):
    """The schema is of the merged catalogue: the built-in one with a site's overlay over it."""
    merged = catalogue.merge(yaml.safe_load(catalogue.BUILTIN.read_text()), overlay, "", [])
    assert committed("rule-catalogue").is_valid(merged) == valid
    try:
        catalogue.resolve(overlay)
    except catalogue.CatalogueError:
        assert not valid
    else:
        assert valid
