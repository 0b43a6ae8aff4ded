"""A deployment of the whole collection onto localhost, into a root prefix, without systemd."""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from ansible_helpers import VERSION

TOKEN = "test-token-0123456789abcdef"
OPERATOR_TOKEN = "operator-token-0123456789"
NODE = "gpu-test-01"

# What an existing Debian Prometheus and Alertmanager would have before gpuhealth arrives.
EXISTING_PROMETHEUS = {
    "global": {"scrape_interval": "1m"},
    "scrape_configs": [{"job_name": "node", "static_configs": [{"targets": ["127.0.0.1:9100"]}]}],
}
EXISTING_ALERTMANAGER = {
    "route": {"receiver": "ops-mail", "group_by": ["alertname"],
              "routes": [{"receiver": "ops-pager", "matchers": ['severity="page"']}]},
    "receivers": [{"name": "ops-mail"}, {"name": "ops-pager"}],
}


@dataclass
class Deployment:
    prefix: Path
    inventory: Path
    exporter_port: int
    webhook_port: int

    def path(self, absolute: str) -> Path:
        """Where a path of the target system lives under the prefix."""
        return self.prefix / absolute.lstrip("/")

    def exec_start(self, unit: str) -> list[str]:
        """The ExecStart command line of an installed systemd unit, unquoted as systemd would."""
        text = self.path(f"/etc/systemd/system/{unit}").read_text().replace("\\\n", " ")
        line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
        return shlex.split(line.removeprefix("ExecStart="))


def seed_existing_monitoring(prefix: Path) -> None:
    existing = {"prometheus.yml": EXISTING_PROMETHEUS, "alertmanager.yml": EXISTING_ALERTMANAGER}
    for name, content in existing.items():
        target = prefix / "etc" / "prometheus" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(yaml.safe_dump(content, sort_keys=False))


def local_vars(prefix: Path, wheelhouse: Path, exporter_port: int, webhook_port: int) -> dict[str, object]:
    """Variables for localhost: everything under ``prefix``, owned by the current user, no systemd."""
    user = pwd.getpwuid(os.getuid()).pw_name
    group = grp.getgrgid(os.getgid()).gr_name
    common = {
        "version": VERSION, "wheelhouse": str(wheelhouse), "pip_extra_args": "--no-index",
        "python": sys.executable, "root_prefix": str(prefix), "manage_service": False, "create_user": False,
        "user": user, "group": group,
    }
    return {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become": False,
        "ansible_host": "127.0.0.1",
        "gpuhealth_node_name": NODE,
        **{f"gpuhealth_exporter_{k}": v for k, v in common.items()},
        **{f"gpuhealth_webhook_{k}": v for k, v in common.items()},
        "gpuhealth_exporter_backend": "sim",
        "gpuhealth_exporter_listen_address": "127.0.0.1",
        "gpuhealth_exporter_port": exporter_port,
        "gpuhealth_exporter_slurm_healthcheck": True,
        "gpuhealth_webhook_port": webhook_port,
        "gpuhealth_webhook_token": TOKEN,
        "gpuhealth_webhook_operator_token": OPERATOR_TOKEN,
        "gpuhealth_webhook_dry_run": True,
        "gpuhealth_prometheus_root_prefix": str(prefix),
        "gpuhealth_prometheus_manage_service": False,
        "gpuhealth_prometheus_owner": user,
        "gpuhealth_prometheus_group": group,
        "gpuhealth_prometheus_alertmanager_group": group,
        "gpuhealth_prometheus_webhook_token": TOKEN,
        "gpuhealth_prometheus_webhook_url": f"http://127.0.0.1:{webhook_port}/alerts",
        "gpuhealth_prometheus_webhook_target": f"127.0.0.1:{webhook_port}",
    }


def write_inventory(prefix: Path, wheelhouse: Path, exporter_port: int, webhook_port: int,
                    **overrides: object) -> Deployment:
    """Localhost in every group, deploying into ``prefix``."""
    variables = {**local_vars(prefix, wheelhouse, exporter_port, webhook_port), **overrides}
    inventory = {"all": {
        "hosts": {"localhost": None},
        "vars": variables,
        "children": {group: {"hosts": {"localhost": None}} for group in ("gpu_nodes", "gpuhealth_webhook",
                                                                         "prometheus")},
    }}
    path = prefix.parent / f"{prefix.name}-inventory.yml"
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return Deployment(prefix, path, exporter_port, webhook_port)
