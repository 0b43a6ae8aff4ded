"""Fixtures for the webhook core: the real app on aiohttp's test client with a simulated cluster; the
helpers tests import are in webhook_helpers.py."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from gpuhealth.webhook.app import create_app
from gpuhealth.webhook.backends.simulated import SimulatedBackend
from gpuhealth.webhook.config import parse_config
from webhook_helpers import NODES, TOKEN, Factory, Harness


@pytest.fixture
def webhook(aiohttp_client: Any, tmp_path: Path) -> Factory:
    """``await webhook(guardrails={...}, jobs={...})``: a fresh app with a 16-node simulated cluster."""

    async def make(*, jobs: dict[str, list[str]] | None = None, backend: Any = None,
                   **settings: Any) -> Harness:
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        data = {"state_dir": str(tmp_path / "state"), "auth": {"token_file": str(token_file)},
                "backend": {"type": "simulated", "nodes": ["gpu[01-16]"]},
                "guardrails": {"node_cooldown_seconds": 0, "breaker_max_nodes": 16,
                               "breaker_max_fraction": 1.0, "rate_limit_actions": 1000},
                "retry": {"backoff_initial_seconds": 0.05, "job_retry_interval_seconds": 0},
                "undrain": {"health_check": []}}  # the simulated nodes have no ssh to validate them
        for key, value in settings.items():
            data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value
        config = parse_config(data)
        sim = backend or SimulatedBackend(NODES, jobs)
        client = await aiohttp_client(create_app(config, backend=sim))
        return Harness(client, sim)

    return make


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 2 MiB tmpfs for the journal, so that a step can fill the disk under it."""
    mount = tmp_path / "state"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.fail(f"this test needs a small tmpfs (root and mount(8)): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
