"""Clients that connect and idle cannot starve the webhook: with few descriptors and hundreds of idle
connections, /healthz still answers once the idle ones are closed, and the log stays small."""

from __future__ import annotations

import contextlib
import socket
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TOKEN

from gpuhealth.local.process import ManagedProcess, free_port, http_ok, wait_until


@pytest.mark.slow
def test_idle_connections_with_a_low_file_limit_do_not_starve_healthz(tmp_path: Path):
    port = free_port()
    (tmp_path / "token").write_text(TOKEN)
    config = tmp_path / "webhook.yaml"
    config.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{port}", "state_dir": "state", "auth": {"token_file": "token"},
        "backend": {"type": "simulated", "nodes": ["gpu[01-04]"]}, "connection_idle_timeout_seconds": 1,
    }))
    argv = ["prlimit", "--nofile=64:64", "--", sys.executable, "-m", "gpuhealth.webhook.main",
            "--config", str(config)]
    proc = ManagedProcess("webhook", argv, tmp_path / "webhook.log").start()
    url = f"http://127.0.0.1:{port}/healthz"
    idle: list[socket.socket] = []
    try:
        proc.wait_ready(lambda: http_ok(url), timeout=30)
        for _ in range(300):  # far more than the 64 descriptors the process may hold
            sock = socket.socket()
            sock.settimeout(0.2)
            with contextlib.suppress(OSError):
                sock.connect(("127.0.0.1", port))
            idle.append(sock)
        wait_until(lambda: http_ok(url, timeout=2), timeout=60, what="/healthz despite idle connections")
    finally:
        for sock in idle:
            sock.close()
        proc.stop()
    lines = (tmp_path / "webhook.log").read_text().splitlines()
    assert len(lines) < 50, f"{len(lines)} log lines"
