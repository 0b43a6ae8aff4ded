"""The gpuhealth_global role for real: localhost as the global-tier host, into a root prefix, without
systemd. The first run installs the global tier's rules and configuration, the second changes nothing,
and what was installed runs: VictoriaMetrics from its arguments file, vmalert from its unit's
ExecStart, with every global rule group loaded."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shlex
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from ansible_helpers import PlaybookRun, run_playbook
from deployment import Deployment
from gpuhealth.rules import catalogue
from gpuhealth.rules.render import render_all

from gpuhealth.local.process import ManagedProcess, free_port, http_ok, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _inventory(prefix: Path, rules: Path, vm_port: int, vmalert_port: int, **extra: object) -> Path:
    user = pwd.getpwuid(os.getuid()).pw_name
    group = grp.getgrgid(os.getgid()).gr_name
    variables = {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable, "ansible_become": False,
        "gpuhealth_global_rules_src": str(rules), "gpuhealth_global_root_prefix": str(prefix),
        "gpuhealth_global_manage_service": False, "gpuhealth_global_install_package": False,
        "gpuhealth_global_victoria_metrics": "victoria-metrics", "gpuhealth_global_vmalert": "vmalert",
        "gpuhealth_global_owner": user, "gpuhealth_global_group": group, "gpuhealth_global_user": user,
        "gpuhealth_global_vm_listen_address": "127.0.0.1", "gpuhealth_global_vm_port": vm_port,
        "gpuhealth_global_vmalert_port": vmalert_port, "gpuhealth_global_evaluation_interval": "5s",
        "gpuhealth_global_alertmanager_urls": ["http://127.0.0.1:9", "http://127.0.0.2:9"], **extra,
    }
    inventory = {"all": {"hosts": {"localhost": None}, "vars": variables,
                         "children": {"gpuhealth_global": {"hosts": {"localhost": None}}}}}
    path = prefix.parent / f"{prefix.name}-inventory.yml"
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, ansible_env) -> tuple[Deployment, PlaybookRun, PlaybookRun, Path]:
    base = tmp_path_factory.mktemp("global")
    rules = base / "rules-global"
    for name, text in render_all(catalogue.load(), ("gpuhealth",), "global").items():
        (rules / name).parent.mkdir(parents=True, exist_ok=True)
        (rules / name).write_text(text)
    prefix = base / "root"
    inventory = _inventory(prefix, rules, free_port(), free_port())
    first = run_playbook(ansible_env, inventory)
    second = run_playbook(ansible_env, inventory) if first.rc == 0 else first
    return Deployment(prefix, inventory, 0, 0), first, second, rules


def test_first_run_installs_the_global_rules_and_configuration(deployed):
    deployment, first, _, rules = deployed
    assert first.rc == 0, first.failures()
    assert deployment.path("/var/lib/victoria-metrics").is_dir()
    installed = sorted(p.name for p in deployment.path("/etc/victoria-metrics/rules/gpuhealth").glob("*.yml"))
    generated = sorted(p.name for p in (rules / "gpuhealth").glob("*.yml"))
    assert installed == generated == ["fleet.yml", "lemon.yml"]
    unit = deployment.path("/etc/systemd/system/gpuhealth-vmalert.service").read_text()
    for hardening in ("NoNewPrivileges=true", "ProtectSystem=strict", "CapabilityBoundingSet="):
        assert hardening in unit


def test_second_run_changes_nothing(deployed):
    _, _, second, _ = deployed
    assert second.rc == 0, second.failures()
    assert second.stats()["changed"] == 0, second.changed_tasks()


def test_installed_global_tier_runs(deployed, tmp_path):
    deployment, first, _, rules = deployed
    assert first.rc == 0, first.failures()
    env_file = deployment.path("/etc/default/victoria-metrics").read_text()
    value = next(line for line in env_file.splitlines() if line.startswith("ARGS=")).removeprefix("ARGS=")
    args = shlex.split(value)[0].split()     # as the unit's `$ARGS` splits the variable
    listen = next(a for a in args if a.startswith("-httpListenAddr=")).split("=", 1)[1]
    vmalert_argv = deployment.exec_start("gpuhealth-vmalert.service")
    vmalert_listen = next(a for a in vmalert_argv if a.startswith("-httpListenAddr="))
    vmalert_url = "http://" + vmalert_listen.split("=", 1)[1]
    assert f"-datasource.url=http://127.0.0.1:{listen.rsplit(':', 1)[1]}" in vmalert_argv
    assert [a for a in vmalert_argv if a.startswith("-notifier.url=")] == [
        "-notifier.url=http://127.0.0.1:9", "-notifier.url=http://127.0.0.2:9"]
    with ManagedProcess("victoria-metrics", ["victoria-metrics", *args], tmp_path / "vm.log") as vm, \
            ManagedProcess("vmalert", vmalert_argv, tmp_path / "vmalert.log") as vmalert:
        vm.start()
        vm.wait_ready(lambda: http_ok(f"http://{listen}/health"), 30)
        vmalert.start()
        vmalert.wait_ready(lambda: http_ok(f"{vmalert_url}/health"), 30)
        expected = {g["name"] for f in (rules / "gpuhealth").glob("*.yml")
                    for g in yaml.safe_load(f.read_text())["groups"]}

        def loaded() -> set[str]:
            with urllib.request.urlopen(f"{vmalert_url}/api/v1/rules", timeout=5) as resp:
                return {g["name"] for g in json.load(resp)["data"]["groups"]}
        wait_until(lambda: loaded() == expected, timeout=30, interval=0.5,
                   what="every global group in vmalert")


def test_preflight_refuses_single_tier_rules(tmp_path, ansible_env):
    from wheelhouse import ROOT

    inventory = _inventory(tmp_path / "root", ROOT / "rules" / "generated", free_port(), free_port())
    run = run_playbook(ansible_env, inventory)
    assert run.rc != 0
    assert "gpuhealth rules generate --tier global --out DIR" in run.failures()


@pytest.mark.parametrize("overrides", [
    {"gpuhealth_global_storage_dir": "/var/lib/vm data -retentionPeriod=1h"},
    {"gpuhealth_global_vm_listen_address": '127.0.0.1" -x="'}],
                         ids=["space-in-storage-dir", "quote-in-listen-address"])
def test_preflight_refuses_values_that_would_split_the_arguments_file(tmp_path, ansible_env, overrides):
    """Debian's unit passes ``$ARGS`` split at spaces: a storage path with a space became more flags."""
    rules = tmp_path / "rules-global"
    for name, text in render_all(catalogue.load(), ("gpuhealth",), "global").items():
        (rules / name).parent.mkdir(parents=True, exist_ok=True)
        (rules / name).write_text(text)
    inventory = _inventory(tmp_path / "root", rules, free_port(), free_port(), **overrides)
    run = run_playbook(ansible_env, inventory)
    assert run.rc != 0
    assert "must hold no space, quote, backslash, $ or backtick" in " ".join(run.failures().split())
    assert not (tmp_path / "root" / "etc").exists(), "preflight must fail before anything is written"
