"""Preflight stops a misconfigured host before anything is written, with a message saying what to fix.

Each case is its own alias of localhost in the group of the role whose preflight it exercises; one
run per group (a play whose hosts all fail ends the playbook), the three side by side."""

from __future__ import annotations

import re

import yaml
from ansible_helpers import finish_playbook, start_playbook
from deployment import TOKEN, local_vars

CASES = {
    "no-driver": ("gpu_nodes", {"gpuhealth_exporter_backend": "nvml",
                                "gpuhealth_exporter_driver_version_file": "/nonexistent/nvidia/version"},
                  "The NVIDIA driver is not loaded on no-driver"),
    "bad-port": ("gpu_nodes", {"gpuhealth_exporter_port": 70000},
                 "gpuhealth_exporter_port must be a TCP port 1..65535, got 70000"),
    "too-many-gpus": ("gpu_nodes", {"gpuhealth_exporter_gpus_expected": 65},
                      "gpuhealth_exporter_gpus_expected must be 0 (count at start-up) to 64, got 65"),
    "scenario-without-sim": ("gpu_nodes", {"gpuhealth_exporter_backend": "nvml",
                                           "gpuhealth_exporter_driver_version_file": "/",
                                           "gpuhealth_exporter_sim_scenario": "/"},
                             "needs gpuhealth_exporter_backend: sim"),
    "validate-without-healthcheck": ("gpu_nodes", {"gpuhealth_exporter_slurm_healthcheck": False,
                                                   "gpuhealth_exporter_slurm_healthcheck_validate": True},
                                     "runs from the Slurm health check: set "
                                     "gpuhealth_exporter_slurm_healthcheck: true too"),
    "bad-nic-rate": ("gpu_nodes", {"gpuhealth_exporter_fabric_expected_rate_gbps": {"mlx5_0": "fast"}},
                     "gpuhealth_exporter_fabric_expected_rate_gbps must be 0 (not checked), a rate in Gb/s"),
    "no-token": ("gpuhealth_webhook", {"gpuhealth_webhook_token": ""}, "gpuhealth_webhook_token must be set"),
    "bad-backend": ("gpuhealth_webhook", {"gpuhealth_webhook_backend": {"type": "pbs"}},
                    "gpuhealth_webhook_backend.type must be one of slurm, kubernetes, command, simulated"),
    "operator-token-reused": ("gpuhealth_webhook", {"gpuhealth_webhook_operator_token": TOKEN},
                              "gpuhealth_webhook_operator_token must be at least 16 characters and differ"),
    "no-connections": ("gpuhealth_webhook", {"gpuhealth_webhook_connection_limit": 0},
                       "gpuhealth_webhook_connection_limit and gpuhealth_webhook_requeue_breaker_max_nodes"),
    "no-rules": ("prometheus", {"gpuhealth_prometheus_rules_src": "/nonexistent"},
                 "No rule files in /nonexistent/gpuhealth/"),
    "no-prometheus": ("prometheus", {}, "install Prometheus first, or set gpuhealth_prometheus_config_mode"),
}


def test_preflight_failures_name_the_fix(tmp_path, ansible_env, wheelhouse):
    base = local_vars(tmp_path / "root", wheelhouse, 9835, 9836)
    groups: dict[str, dict] = {"gpu_nodes": {}, "gpuhealth_webhook": {}, "prometheus": {}}
    for host, (group, overrides, _) in CASES.items():
        groups[group][host] = overrides
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {
        "vars": base, "children": {name: {"hosts": hosts} for name, hosts in groups.items()}}}))

    started = {group: start_playbook(ansible_env, inventory, "--limit", group) for group in groups}
    runs = {group: finish_playbook(proc) for group, proc in started.items()}

    for host, (group, _, message) in CASES.items():
        run = runs[group]
        failure = re.search(rf"^fatal: \[{host}\]: FAILED! => (.*)$", run.output, re.MULTILINE)
        assert failure, f"{host} did not fail:\n{run.output[-3000:]}"
        assert message in " ".join(failure.group(1).split()), failure.group(1)
    assert not (tmp_path / "root").exists(), "preflight must fail before anything is written"
