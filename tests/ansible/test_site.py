"""playbooks/site.yml for real: localhost in every group, into a root prefix, without systemd.

The first run installs everything, the second changes nothing, and what was installed runs: the
exporter from its unit's ExecStart, Prometheus on the merged configuration, the webhook behind the
token Alertmanager was given."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from ansible_helpers import VERSION, PlaybookRun, finish_playbook, run_playbook, start_playbook
from deployment import NODE, OPERATOR_TOKEN, TOKEN, Deployment, seed_existing_monitoring, write_inventory
from wheelhouse import ROOT, upgrade_wheelhouse

from gpuhealth.local.process import ManagedProcess, free_port, http_ok, wait_until
from gpuhealth.local.prometheus import PrometheusServer

# The first test sets up four playbook runs (deploy, again, upgrade, check mode): minutes on 2 cores,
# three of them one after the other, each allowed ansible_helpers.PLAYBOOK_SECONDS.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2000)]

UPGRADE = f"{VERSION}.post1"
SITE_VARS = {
    "gpuhealth_prometheus_scrape_interval": "1s",
    "gpuhealth_webhook_backend": {"type": "simulated", "nodes": [NODE]},
    "gpuhealth_exporter_slurm_healthcheck_validate": True,
    "gpuhealth_exporter_slurm_healthcheck_validate_args": ["--backend", "sim"],
}


def fresh_deployment(base: Path, wheelhouse: Path, name: str, **overrides: object) -> Deployment:
    prefix = base / name
    seed_existing_monitoring(prefix)
    return write_inventory(prefix, wheelhouse, free_port(), free_port(), **SITE_VARS, **overrides)


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def deploy(base: Path, ansible_env: dict[str, str], wheelhouse: Path) -> dict:
    """A real run, the same again, an upgrade to a newer gpuhealth, and --check on another fresh
    prefix alongside the first.

    The real runs install a snapshot of the generated rules (the checkout may be regenerated
    meanwhile) and use the wheelhouse in place; --check takes the defaults and the copy path."""
    snapshot = base / "rules"
    shutil.copytree(ROOT / "rules" / "generated", snapshot / "generated")
    shutil.copy(ROOT / "rules" / "alertmanager.yml", snapshot / "alertmanager.yml")
    overrides = {"gpuhealth_prometheus_rules_src": str(snapshot / "generated"),
                 "gpuhealth_prometheus_alertmanager_example_file": str(snapshot / "alertmanager.yml"),
                 **{f"gpuhealth_{role}_wheelhouse_remote_src": True for role in ("exporter", "webhook")}}
    deployment = fresh_deployment(base, wheelhouse, "root", **overrides)
    checked = fresh_deployment(base, wheelhouse, "check-root")
    checked_before = tree(checked.prefix)
    check = start_playbook(ansible_env, checked.inventory, "--check")
    first = run_playbook(ansible_env, deployment.inventory)
    second = run_playbook(ansible_env, deployment.inventory) if first.rc == 0 else first
    newer = upgrade_wheelhouse(wheelhouse, base / "wheelhouse-upgrade", base / "upgrade-build", UPGRADE)
    pinned = {f"gpuhealth_{role}_version": UPGRADE for role in ("exporter", "webhook")}
    ports = (deployment.exporter_port, deployment.webhook_port)
    upgraded = write_inventory(deployment.prefix, newer, *ports, **SITE_VARS, **overrides, **pinned)
    upgrade = run_playbook(ansible_env, upgraded.inventory) if second.rc == 0 else second
    return {"deployment": asdict(deployment), "first": asdict(first), "second": asdict(second),
            "upgrade": asdict(upgrade),
            "check": asdict(finish_playbook(check)), "checked": asdict(checked),
            "checked_before": checked_before,
            "rules": sorted(p.name for p in (snapshot / "generated" / "gpuhealth").glob("*.yml"))}


@pytest.fixture(scope="session")
def runs(tmp_path_factory, ansible_env, request) -> dict:
    """The deployment, done once per test session even across pytest-xdist workers (they share it)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    result = shared / "ansible-site.json"
    with (shared / "ansible-site.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            base = shared / "ansible-site"
            base.mkdir()
            wheelhouse = request.getfixturevalue("wheelhouse")
            result.write_text(json.dumps(deploy(base, ansible_env, wheelhouse), default=str))
    data = json.loads(result.read_text())
    for key in ("deployment", "checked"):
        data[key] = Deployment(**{k: Path(v) if k in ("prefix", "inventory") else v
                                  for k, v in data[key].items()})
    for key in ("first", "second", "upgrade", "check"):
        data[key] = PlaybookRun(**data[key])
    return data


@pytest.fixture(scope="session")
def site(runs) -> tuple[Deployment, PlaybookRun, PlaybookRun]:
    assert runs["first"].rc == 0, runs["first"].failures()
    return runs["deployment"], runs["first"], runs["second"]


@contextmanager
def run_installed(deployment: Deployment, name: str, port: int, log_dir: Path) -> Iterator[str]:
    """Start a daemon as its installed systemd unit would; yield its base URL once /metrics answers."""
    url = f"http://127.0.0.1:{port}"
    argv = deployment.exec_start(f"gpuhealth-{name}.service")
    with ManagedProcess(name, argv, log_dir / f"{name}.log") as proc:
        proc.start().wait_ready(lambda: http_ok(f"{url}/metrics"), timeout=60)
        yield url


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_first_run_installs_everything(runs, site):
    deployment, first, _ = site
    assert first.stats()["changed"] > 0

    token = deployment.path("/etc/gpuhealth/webhook.token")
    assert token.read_text().strip() == TOKEN and mode(token) == 0o600
    operator = deployment.path("/etc/gpuhealth/webhook.operator.token")
    assert operator.read_text().strip() == OPERATOR_TOKEN and mode(operator) == 0o600
    assert not deployment.path("/etc/gpuhealth/webhook.operator.password").exists()
    config = yaml.safe_load(deployment.path("/etc/gpuhealth/webhook.yml").read_text())
    assert config["auth"]["operator"] == {"token_file": str(operator)}
    assert mode(deployment.path("/var/lib/gpuhealth-webhook")) == 0o750
    assert mode(deployment.path("/var/lib/gpuhealth-exporter")) == 0o750
    am_token = deployment.path("/etc/prometheus/gpuhealth-webhook.token")
    assert am_token.read_text().strip() == TOKEN and mode(am_token) == 0o640
    assert os.access(deployment.path("/usr/local/sbin/gpuhealth-healthcheck"), os.X_OK)
    assert os.access(deployment.path("/opt/gpuhealth/venv/bin/gpuhealth-validate"), os.X_OK)

    rules = sorted(p.name for p in deployment.path("/etc/prometheus/rules/gpuhealth").iterdir())
    assert rules == runs["rules"]


def test_units_are_hardened_but_reach_the_gpus(site):
    deployment = site[0]
    units = {name: deployment.path(f"/etc/systemd/system/gpuhealth-{name}.service")
             for name in ("exporter", "webhook")}
    exporter = units["exporter"].read_text().splitlines()
    for line in ("NoNewPrivileges=true", "ProtectSystem=strict", "DevicePolicy=closed",
                 "DeviceAllow=char-nvidia-frontend rw", "DeviceAllow=/dev/kmsg r",
                 "AmbientCapabilities=CAP_SYSLOG", "CapabilityBoundingSet=CAP_SYSLOG",
                 "ProtectKernelLogs=false",
                 f'ReadWritePaths="{deployment.path("/var/lib/gpuhealth-exporter")}"'):
        assert line in exporter, line
    assert "PrivateDevices=true" not in exporter
    webhook = units["webhook"].read_text().splitlines()
    for line in ("NoNewPrivileges=true", "PrivateDevices=true", "CapabilityBoundingSet=",
                 f'ReadWritePaths="{deployment.path("/var/lib/gpuhealth-webhook")}"'):
        assert line in webhook, line
    verify = subprocess.run(["systemd-analyze", "verify", "--man=no", *units.values()], capture_output=True,
                            text=True, timeout=60)
    assert (verify.returncode, verify.stdout + verify.stderr) == (0, ""), "systemd-analyze found problems"


def test_second_run_changes_nothing(site):
    second = site[2]
    assert second.rc == 0, second.failures()
    assert second.stats()["changed"] == 0, second.changed_tasks()


def test_upgrade_installs_the_new_version_and_restarts_both_daemons(runs, site):
    deployment, upgrade = site[0], runs["upgrade"]
    assert upgrade.rc == 0, upgrade.failures()
    assert sorted(upgrade.changed_tasks()) == [
        "gpuhealth.gpuhealth.gpuhealth_common : Install gpuhealth into the virtualenv",
        "gpuhealth.gpuhealth.gpuhealth_common : Record the version the daemon runs",
        "gpuhealth.gpuhealth.gpuhealth_common : Record the version the daemon runs"]
    for daemon in ("exporter", "webhook"):
        handler = f"RUNNING HANDLER [gpuhealth.gpuhealth.gpuhealth_{daemon} : Restart gpuhealth-{daemon}]"
        assert handler in upgrade.output
        stamp = deployment.path(f"/opt/gpuhealth/venv/gpuhealth-{daemon}.version")
        assert stamp.read_text() == f"{UPGRADE}\n"
    version = "import importlib.metadata as m; print(m.version('gpuhealth'))"
    installed = subprocess.run([deployment.path("/opt/gpuhealth/venv/bin/python"), "-I", "-c", version],
                               capture_output=True, text=True, check=True).stdout.strip()
    assert installed == UPGRADE


def test_healthcheck_drains_on_hard_faults(site, tmp_path):
    script = site[0].path("/usr/local/sbin/gpuhealth-healthcheck")
    exposition = tmp_path / "metrics"
    exposition.write_text("\n".join([
        "gpuhealth_gpus_expected 8.0", "gpuhealth_gpus_visible 7.0",
        'gpuhealth_gpu_up{gpu="0"} 1.0', 'gpuhealth_gpu_up{gpu="3"} 0.0',
        'gpuhealth_gpu_fallen_off_bus_total{gpu="unknown"} 0.0',
        'gpuhealth_gpu_remap_failure{gpu="5"} 1.0',
        'gpuhealth_gpu_recovery_action{action="none",gpu="6"} 0.0',
        'gpuhealth_gpu_recovery_action{action="node_reboot",gpu="6"} 1.0', ""]))
    result = subprocess.run([script, "--node", NODE, "--url", exposition.as_uri(), "--dry-run"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stdout.split(" ", 3)[1:3] == ["update", f"NodeName={NODE}"]
    assert result.stdout.strip().endswith(
        "State=DRAIN Reason=gpuhealth-healthcheck: gpu 3 lost; gpu 5 row remap failure; "
        "gpu 6 recovery action node_reboot; 7 of 8 GPUs visible")


def test_alertmanager_routes_gpuhealth_alerts_and_keeps_existing_routes(site):
    config = site[0].path("/etc/prometheus/alertmanager.yml")

    def receivers(*labels: str) -> str:
        out = subprocess.run(["amtool", "config", "routes", "test", f"--config.file={config}", *labels],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    drain = ("alertname=GPUHealthXidDrain", f"node={NODE}", "action=drain")
    assert receivers(*drain) == "gpuhealth-webhook"
    assert receivers(*drain, "severity=page") == "gpuhealth-webhook,ops-pager"  # continue: true
    assert receivers("alertname=DiskFull", "severity=page") == "ops-pager"
    assert receivers("alertname=DiskFull") == "ops-mail"
    webhook_config = next(r for r in yaml.safe_load(config.read_text())["receivers"]
                          if r["name"] == "gpuhealth-webhook")["webhook_configs"][0]
    assert webhook_config["url"] == f"http://127.0.0.1:{site[0].webhook_port}/alerts"


def test_installed_daemons_work_together(site, tmp_path):
    """One test, so that one pytest-xdist worker owns the deployment's ports."""
    deployment = site[0]
    with run_installed(deployment, "exporter", deployment.exporter_port, tmp_path) as exporter, \
            run_installed(deployment, "webhook", deployment.webhook_port, tmp_path) as webhook:
        with urllib.request.urlopen(f"{exporter}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert 'gpuhealth_exporter_build_info{backend="sim"' in text
        assert 'gpuhealth_gpu_up{gpu="0"} 1.0' in text

        script = deployment.path("/usr/local/sbin/gpuhealth-healthcheck")
        healthcheck = subprocess.run([script, "--node", NODE, "--url", f"{exporter}/metrics", "--dry-run"],
                                     capture_output=True, text=True, timeout=60)
        assert (healthcheck.returncode, healthcheck.stdout) == (0, ""), healthcheck.stderr
        validator = deployment.path("/opt/gpuhealth/venv/bin/gpuhealth-validate")
        validate = subprocess.run([validator, "--backend", "sim", "--gpus-expected", "9"],
                                  capture_output=True, text=True, timeout=120)
        assert validate.returncode == 1 and json.loads(validate.stdout)["failed"] == ["gpus_visible"], \
            validate.stderr

        assert_webhook_accepts_alertmanagers_token_only(deployment, webhook)
        assert_prometheus_scrapes_the_exporter_with_its_node_label(deployment, tmp_path / "prometheus")


def assert_prometheus_scrapes_the_exporter_with_its_node_label(deployment: Deployment, workdir: Path) -> None:
    merged = yaml.safe_load(deployment.path("/etc/prometheus/prometheus.yml").read_text())
    jobs = [c["job_name"] for c in merged["scrape_configs"]]
    assert jobs == ["node", "gpuhealth-exporter", "gpuhealth-webhook"]
    with PrometheusServer(workdir, merged) as prometheus:
        prometheus.start()

        def health() -> dict[str, str]:
            return {t["labels"]["job"]: t["health"] for t in prometheus.api.targets()}
        wait_until(lambda: health().get("gpuhealth-exporter") == health().get("gpuhealth-webhook") == "up",
                   timeout=60, what="the exporter and webhook targets to be up")
        series = prometheus.api.query('gpuhealth_gpu_up{job="gpuhealth-exporter"}')
        assert series and {s["metric"]["node"] for s in series} == {NODE}
        groups = {g["file"] for g in prometheus.api.rule_groups()}
        assert groups == {str(p) for p in deployment.path("/etc/prometheus/rules/gpuhealth").glob("*.yml")}


def assert_webhook_accepts_alertmanagers_token_only(deployment: Deployment, webhook: str) -> None:
    am_config = yaml.safe_load(deployment.path("/etc/prometheus/alertmanager.yml").read_text())
    receiver = next(r for r in am_config["receivers"] if r["name"] == "gpuhealth-webhook")
    http_config = receiver["webhook_configs"][0]["http_config"]
    token = Path(http_config["authorization"]["credentials_file"]).read_text().strip()
    payload = json.dumps({
        "version": "4", "groupKey": f'{{}}:{{node="{NODE}"}}', "truncatedAlerts": 0, "status": "firing",
        "receiver": "gpuhealth-webhook", "groupLabels": {"node": NODE}, "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://127.0.0.1:9093", "alerts": [{
            "status": "firing", "labels": {"alertname": "GPUHealthXidDrain", "node": NODE, "gpu": "0",
                                           "severity": "warning", "action": "drain"},
            "annotations": {}, "startsAt": "2026-01-01T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "", "fingerprint": "0123456789abcdef"}],
    }).encode()

    def post(bearer: str) -> int:
        request = urllib.request.Request(f"{webhook}/alerts", data=payload, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {bearer}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert post("not-the-token-0123456789") == 401
    assert 200 <= post(token) < 300


def test_check_mode_on_a_fresh_prefix_changes_nothing(runs):
    check = runs["check"]
    assert check.rc == 0, check.failures()
    assert check.stats()["changed"] > 0
    assert tree(runs["checked"].prefix) == runs["checked_before"]
